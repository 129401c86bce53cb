//! A thread's replies not yet sent ([`Batch`]): whole replies back to back in one buffer,
//! sent with one write ([`Connection::flush`]) when the thread would otherwise block.
//!
//! Invariants: the buffer holds only whole replies (a reply that does not fit goes out by
//! itself after the batch, never split); the requests whose replies are in the batch keep
//! their budget slots until the batch is written; a batch is flushed before its thread
//! blocks on anything (a socket read, a budget, the input lock, an export call it hands the
//! input off for), so a client never waits for a reply that sits in a sleeping thread's
//! buffer, except behind an export call of that same thread that blocks.
//!
//! Sizes: a batch holds up to 128 KiB ([`BATCH_BYTES_MAX`]) or 16 replies
//! ([`BATCH_REQUESTS_MAX`]); the reader's one `recv` fills a 64 KiB input buffer. At queue
//! depth 32-64 a connection so costs one `recv` per burst, one `pread` per request and one
//! `send` per batch, with no thread wake-up per request. The non-blocking `recv` for more
//! before a send is tried while at least a third of such tries find some, else every 16th
//! time (`Input::receive_more`).

use std::io::{IoSlice, Write};
use std::net::Shutdown;
use std::sync::atomic::Ordering;

use super::Connection;

/// Bytes of replies a batch holds before it is sent: 16 READ replies of 8 KiB.
pub(super) const BATCH_BYTES_MAX: usize = 128 * 1024;

/// Replies a batch holds before it is sent even though more requests are buffered.
pub(super) const BATCH_REQUESTS_MAX: usize = 16;

/// Largest READ or WRITE served in a batch. Larger ones (and every READ that may be spliced,
/// from [`super::splice::SPLICE_MIN_BYTES`]) cost enough that another thread may as well
/// read on meanwhile.
pub(super) const BATCH_REQUEST_BYTES_MAX: u64 = 32 * 1024;

/// Replies waiting to be sent, and the budget of their requests.
#[derive(Default)]
pub(super) struct Batch {
    /// `buffer[..used]` are whole replies; the rest is room, never zeroed again.
    buffer: Box<[u8]>,
    used: usize,
    /// Requests answered in the buffer (or sent by themselves) whose budget is still held.
    requests: usize,
    reserved_bytes: u64,
}

impl Batch {
    /// Nothing to send and no budget held.
    pub(super) fn is_empty(&self) -> bool {
        self.used == 0 && self.requests == 0
    }

    /// Requests whose budget the batch holds.
    pub(super) fn requests(&self) -> usize {
        self.requests
    }

    /// Counts a request answered into this batch; its budget is released when it is sent.
    pub(super) fn add_request(&mut self, reserved_bytes: u64) {
        self.requests += 1;
        self.reserved_bytes += reserved_bytes;
    }

    /// True if a reply of `length` bytes fits after those already here.
    pub(super) fn fits(&self, length: usize) -> bool {
        self.used + length <= BATCH_BYTES_MAX
    }

    /// True once the batch holds enough replies to be sent even though more requests are
    /// waiting: the client gets the first replies while the rest are served.
    pub(super) fn is_full(&self) -> bool {
        self.requests >= BATCH_REQUESTS_MAX
    }

    /// `length` bytes of room at the end for one reply, to be filled and then kept with
    /// [`Batch::commit`]; [`Batch::fits`] must have said yes.
    pub(super) fn room(&mut self, length: usize) -> &mut [u8] {
        assert!(self.fits(length), "reply does not fit in the batch");
        if self.buffer.is_empty() {
            self.buffer = vec![0u8; BATCH_BYTES_MAX].into_boxed_slice();
        }
        &mut self.buffer[self.used..self.used + length]
    }

    /// Keeps the `length` bytes of room filled last.
    pub(super) fn commit(&mut self, length: usize) {
        assert!(self.fits(length), "reply does not fit in the batch");
        self.used += length;
    }

    /// Appends one reply made of `parts`; [`Batch::fits`] must have said yes.
    fn append(&mut self, parts: &[IoSlice<'_>]) {
        let length = parts.iter().map(|part| part.len()).sum();
        let mut room = self.room(length);
        for part in parts {
            let (head, rest) = room.split_at_mut(part.len());
            head.copy_from_slice(part);
            room = rest;
        }
        self.commit(length);
    }
}

impl Connection {
    /// Sends one whole reply: into `batch` if it fits there, otherwise by itself (after the
    /// batch, which is sent first if the reply could never fit beside it).
    pub(super) fn send(&self, batch: &mut Batch, parts: &mut [IoSlice<'_>]) {
        let length = parts.iter().map(|part| part.len()).sum();
        if !batch.fits(length) {
            self.flush(batch);
        }
        if batch.fits(length) {
            batch.append(parts);
            return;
        }
        let Some(mut writer) = self.lock_writer() else {
            return;
        };
        if crate::stream::write_all_vectored(&mut *writer, parts).is_err() {
            self.broken.store(true, Ordering::SeqCst);
            let _ = writer.shutdown(Shutdown::Both);
        }
    }

    /// Writes the batched replies with one write under the writer lock, then releases their
    /// requests' budget. A failed write marks the connection broken and shuts the socket, so
    /// the reader stops too; the budget is released all the same.
    pub(super) fn flush(&self, batch: &mut Batch) {
        if batch.used > 0 {
            if let Some(mut writer) = self.lock_writer() {
                if writer.write_all(&batch.buffer[..batch.used]).is_err() {
                    self.broken.store(true, Ordering::SeqCst);
                    let _ = writer.shutdown(Shutdown::Both);
                }
            }
            batch.used = 0;
        }
        if batch.requests > 0 {
            self.release_many(batch.requests, batch.reserved_bytes);
            batch.requests = 0;
            batch.reserved_bytes = 0;
        }
    }
}
