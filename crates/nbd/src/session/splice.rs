//! READ replies sent from the export's file without a user-space copy: the file's cached
//! pages go into a pipe (`splice` file → pipe, which takes references, not copies), the reply
//! header is written, and the pipe is spliced into the socket.
//!
//! Invariants: the whole range is in the pipe before the header is written, so a file that
//! ends early or fails to read costs nothing on the wire: the caller falls back to the copy
//! (`Export::read_at`), which answers the error if there is one. Once the header is out,
//! every byte of the range follows or the connection is broken (a socket error). A pipe that
//! may hold leftover bytes (any failure) is closed and a fresh one made next time, so a
//! reply never carries another's bytes. Only for ranges that fit in the pipe whole (its size
//! is raised up to the system's `pipe-max-size`, 1 MiB by default).
//!
//! When: on a plaintext TCP connection (no TLS; `Config::splice_reads`, by default TCP only,
//! because over a Unix socket the client paid three times the CPU and throughput halved), a
//! READ of 64 KiB or more whose export answers `Export::read_source` (the raw export of
//! `thinpool-bench serve`: the file is the export). Other READs of more than the batch's limit
//! are read into the thread's payload buffer and sent, header and data, in one `writev`. Thin
//! volumes never splice: the socket's send queue keeps references to the file's pages after
//! the reply is written, and a block freed once the read's grace pin drops could be reused by
//! another volume before the client has read it.

use std::io;

use rustix::fd::{AsFd, OwnedFd};
use rustix::io::Errno;
use rustix::pipe::{fcntl_setpipe_size, pipe_with, splice, PipeFlags, SpliceFlags};

use crate::export::ReadSource;
use crate::stream::Stream;

/// Smallest READ sent by splice: below it, `pread` + one `writev` (two system calls) beat
/// splice in + header write + splice out (three), and the copy is cheap.
pub(super) const SPLICE_MIN_BYTES: usize = 64 * 1024;

/// The page size the pipe's room is reckoned in (larger pages only mean more room).
const PAGE_BYTES: usize = 4096;

/// A thread's pipe for spliced READ replies, made on first use and kept.
#[derive(Default)]
pub(super) struct Pipe {
    /// Read end, write end and capacity in bytes.
    ends: Option<(OwnedFd, OwnedFd, usize)>,
    /// Raising the capacity failed once for this size: larger reads are copied.
    refused_from: Option<usize>,
}

impl Pipe {
    /// Moves `length` bytes of `source` into the pipe; `false` (nothing kept) if the pipe
    /// cannot hold them or the file cannot give them all, so the caller copies instead.
    pub(super) fn fill(&mut self, source: ReadSource<'_>, length: usize) -> bool {
        if self.refused_from.is_some_and(|refused| length >= refused) {
            return false;
        }
        let Some((_, write_end, _)) = self.ready(length) else {
            return false;
        };
        let mut offset = source.offset;
        let mut filled = 0;
        while filled < length {
            match splice(
                source.file,
                Some(&mut offset),
                write_end,
                None,
                length - filled,
                // Never wait for room: a range that needs more pipe slots than the pipe has
                // (pages only partly used at its ends) is copied instead.
                SpliceFlags::NONBLOCK,
            ) {
                Ok(0) => break,
                Ok(count) => filled += count,
                Err(Errno::INTR) => {}
                Err(_) => break,
            }
        }
        if filled < length {
            self.ends = None;
            return false;
        }
        true
    }

    /// Sends the `length` bytes [`Pipe::fill`] put in the pipe to `socket`.
    pub(super) fn drain_into(&mut self, socket: &Stream, length: usize) -> io::Result<()> {
        let (read_end, _, _) = self
            .ends
            .as_ref()
            .expect("drain_into follows a successful fill");
        let mut sent = 0;
        while sent < length {
            match splice(
                read_end,
                None,
                socket.as_fd(),
                None,
                length - sent,
                SpliceFlags::empty(),
            ) {
                Ok(0) => {
                    self.ends = None;
                    return Err(io::ErrorKind::WriteZero.into());
                }
                Ok(count) => sent += count,
                Err(Errno::INTR) => {}
                Err(error) => {
                    self.ends = None;
                    return Err(error.into());
                }
            }
        }
        Ok(())
    }

    /// Closes the pipe with whatever it holds; the next fill makes a fresh one.
    pub(super) fn discard(&mut self) {
        self.ends = None;
    }

    /// The pipe, made if needed and grown to hold `length` bytes.
    fn ready(&mut self, length: usize) -> Option<&(OwnedFd, OwnedFd, usize)> {
        if self.ends.is_none() {
            let (read_end, write_end) = pipe_with(PipeFlags::CLOEXEC).ok()?;
            self.ends = Some((read_end, write_end, 0));
        }
        let (_, write_end, capacity) = self.ends.as_mut()?;
        if *capacity < length {
            // One page more for a range that does not start on a page boundary.
            let granted = fcntl_setpipe_size(&*write_end, length + PAGE_BYTES)
                .or_else(|_| fcntl_setpipe_size(&*write_end, length));
            match granted {
                Ok(granted) if granted >= length => *capacity = granted,
                _ => {
                    self.refused_from = Some(length);
                    return None;
                }
            }
        }
        self.ends.as_ref()
    }
}
