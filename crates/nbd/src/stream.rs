//! The connected socket a session runs on: a Unix or TCP stream behind one type.
//!
//! Owns nothing but the file descriptor. `try_clone` gives the session a second handle, so
//! requests are read under one lock and replies written under another, and the server keeps
//! a third to shut the connection down from outside. [`Deadline`] bounds the handshake as a
//! whole.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// A Unix or TCP stream.
#[derive(Debug)]
pub(crate) enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    pub(crate) fn try_clone(&self) -> io::Result<Stream> {
        match self {
            Stream::Unix(stream) => stream.try_clone().map(Stream::Unix),
            Stream::Tcp(stream) => stream.try_clone().map(Stream::Tcp),
        }
    }

    pub(crate) fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Stream::Unix(stream) => stream.shutdown(how),
            Stream::Tcp(stream) => stream.shutdown(how),
        }
    }

    pub(crate) fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(stream) => stream.set_read_timeout(timeout),
            Stream::Tcp(stream) => stream.set_read_timeout(timeout),
        }
    }

    pub(crate) fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        match self {
            Stream::Unix(stream) => stream.set_nonblocking(nonblocking),
            Stream::Tcp(stream) => stream.set_nonblocking(nonblocking),
        }
    }

    pub(crate) fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(stream) => stream.set_write_timeout(timeout),
            Stream::Tcp(stream) => stream.set_write_timeout(timeout),
        }
    }
}

impl AsFd for Stream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Unix(stream) => stream.as_fd(),
            Stream::Tcp(stream) => stream.as_fd(),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(stream) => stream.read(buffer),
            Stream::Tcp(stream) => stream.read(buffer),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buffer: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(stream) => stream.write(buffer),
            Stream::Tcp(stream) => stream.write(buffer),
        }
    }

    fn write_vectored(&mut self, buffers: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Unix(stream) => stream.write_vectored(buffers),
            Stream::Tcp(stream) => stream.write_vectored(buffers),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Writes every byte of `buffers`, issuing vectored writes until done.
pub(crate) fn write_all_vectored(
    writer: &mut impl Write,
    mut buffers: &mut [IoSlice<'_>],
) -> io::Result<()> {
    IoSlice::advance_slices(&mut buffers, 0);
    while !buffers.is_empty() {
        match writer.write_vectored(buffers) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(written) => IoSlice::advance_slices(&mut buffers, written),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// Reads exactly `buffer.len()` bytes; `Ok(false)` if the peer closed before the first byte.
pub(crate) fn read_exact_or_eof(reader: &mut impl Read, buffer: &mut [u8]) -> io::Result<bool> {
    let mut filled = 0;
    while filled < buffer.len() {
        match reader.read(&mut buffer[filled..]) {
            Ok(0) if filled == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(count) => filled += count,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(true)
}

/// A stream whose reads and writes must all finish before one instant: each operation's
/// socket timeout is set to the time left (one extra `setsockopt` per read or write, which
/// only the handshake pays), so a peer that trickles bytes cannot stretch the total.
pub(crate) struct Deadline<'a> {
    stream: &'a mut Stream,
    deadline: Instant,
    /// Longest wait for one write, even with more time left.
    write_timeout: Duration,
}

impl<'a> Deadline<'a> {
    pub(crate) fn new(stream: &'a mut Stream, deadline: Instant, write_timeout: Duration) -> Self {
        Deadline {
            stream,
            deadline,
            write_timeout,
        }
    }

    /// The stream itself (STARTTLS replaces it with the session's end of the TLS pump).
    pub(crate) fn stream_mut(&mut self) -> &mut Stream {
        self.stream
    }

    /// Time left, or a timeout error once the deadline has passed.
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "handshake deadline passed",
            ));
        }
        Ok(left)
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buffer)
    }
}

impl Write for Deadline<'_> {
    fn write(&mut self, buffer: &[u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.stream
            .set_write_timeout(Some(left.min(self.write_timeout)))?;
        self.stream.write(buffer)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
