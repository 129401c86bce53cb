//! A thread's payload buffer: READ data and WRITE payloads, reused between requests up to
//! [`RETAINED_BUFFER_BYTES`], larger ones allocated per request; and where a WRITE payload
//! is received ([`PayloadTarget`]).

use rustix::net::RecvFlags;

use super::input::receive;
use super::RETAINED_BUFFER_BYTES;
use crate::stream::Stream;

/// A thread's payload buffer for READ data and WRITE payloads, reused between requests.
#[derive(Default)]
pub(super) struct Payload {
    /// Grows to the largest payload up to [`RETAINED_BUFFER_BYTES`] and stays; never zeroed
    /// again (READs are filled completely by the export, WRITEs by the socket).
    retained: Vec<u8>,
    /// A larger payload's buffer, for one request only.
    large: Vec<u8>,
}

impl Payload {
    /// A buffer of `length` bytes; its contents are left over from earlier requests.
    pub(super) fn prepare(&mut self, length: usize) -> &mut [u8] {
        if length <= RETAINED_BUFFER_BYTES {
            if self.retained.len() < length {
                self.retained.resize(length, 0);
            }
            &mut self.retained[..length]
        } else {
            self.large = vec![0u8; length];
            &mut self.large
        }
    }

    /// Where a WRITE payload of `length` bytes is to be received. A large one gets a fresh
    /// vector of exactly that capacity, filled without zeroing it first (zeroing a 1 MiB
    /// buffer per WRITE was a few percent of the server's CPU on large writes).
    pub(super) fn target(&mut self, length: usize) -> PayloadTarget<'_> {
        if length <= RETAINED_BUFFER_BYTES {
            return PayloadTarget::Slice {
                buffer: self.prepare(length),
                filled: 0,
            };
        }
        self.large = Vec::with_capacity(length);
        if self.large.capacity() != length {
            // Receiving into spare capacity must not read past the payload.
            return PayloadTarget::Slice {
                buffer: self.prepare(length),
                filled: 0,
            };
        }
        PayloadTarget::Spare(&mut self.large)
    }

    /// The buffer [`Payload::prepare`] or [`Payload::target`] gave out last, for `length`
    /// bytes.
    pub(super) fn current(&self, length: usize) -> &[u8] {
        if length <= RETAINED_BUFFER_BYTES {
            &self.retained[..length]
        } else {
            &self.large[..length]
        }
    }

    /// Frees a large buffer once its request is answered.
    pub(super) fn shrink(&mut self) {
        self.large = Vec::new();
    }
}

/// Where a WRITE payload is received: a buffer of its length whose old contents are
/// overwritten, or an empty vector whose spare capacity is exactly the payload's length,
/// filled without being zeroed first (`rustix`'s receive into spare capacity grows the
/// vector by what it received).
pub(super) enum PayloadTarget<'a> {
    Slice { buffer: &'a mut [u8], filled: usize },
    Spare(&'a mut Vec<u8>),
}

impl PayloadTarget<'_> {
    /// Bytes still to be received.
    pub(super) fn remaining(&self) -> usize {
        match self {
            PayloadTarget::Slice { buffer, filled } => buffer.len() - filled,
            PayloadTarget::Spare(vector) => vector.capacity() - vector.len(),
        }
    }

    /// Appends `bytes` (at most [`PayloadTarget::remaining`]).
    pub(super) fn push(&mut self, bytes: &[u8]) {
        assert!(bytes.len() <= self.remaining(), "payload overflow");
        match self {
            PayloadTarget::Slice { buffer, filled } => {
                buffer[*filled..*filled + bytes.len()].copy_from_slice(bytes);
                *filled += bytes.len();
            }
            PayloadTarget::Spare(vector) => vector.extend_from_slice(bytes),
        }
    }

    /// One receive of at most [`PayloadTarget::remaining`] bytes.
    pub(super) fn receive(
        &mut self,
        stream: &Stream,
        flags: RecvFlags,
    ) -> rustix::io::Result<usize> {
        match self {
            PayloadTarget::Slice { buffer, filled } => {
                let count = receive(stream, &mut buffer[*filled..], flags)?;
                *filled += count;
                Ok(count)
            }
            PayloadTarget::Spare(vector) => {
                rustix::net::recv(stream, rustix::buffer::spare_capacity(vector), flags)
                    .map(|(count, _)| count)
            }
        }
    }
}
