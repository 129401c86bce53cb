//! Serving a checked request: calling the export, then writing the reply in the style the
//! handshake negotiated (simple, structured or extended).
//!
//! Invariants: every request that reaches [`Connection::run`] gets exactly one reply; a panic
//! in the export becomes an I/O error reply for that request alone ([`call_export`]); every
//! reply goes whole into the thread's [`Batch`] or, if it does not fit there, out by itself
//! in one vectored write under the writer lock (see [`Connection::send`]), so replies never
//! interleave byte-wise; once a write fails (or a thread panicked mid-reply) the connection
//! is marked broken, its socket shut, and nothing more is written. A READ of at most
//! [`BATCH_REQUEST_BYTES_MAX`] is read by the export straight into the batch, behind the
//! room left for its reply header.
//!
//! BLOCK_STATUS sends one status chunk per selected metadata context, the last one flagged
//! DONE, all in one write; if any context fails it sends one error reply instead, and the
//! connection goes on.

use std::io::IoSlice;
use std::net::Shutdown;
use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

use rustix::net::SendFlags;

use super::batch::{Batch, BATCH_REQUEST_BYTES_MAX};
use super::splice::{Pipe, SPLICE_MIN_BYTES};
use super::{Connection, Job, Scratch};
use crate::error::{Error, ErrorKind, Result};
use crate::export::ZeroOptions;
use crate::handshake::ReplyStyle;
use crate::handshake::{ContextSource, SelectedContext};
use crate::protocol::{
    self, chunk, command, command_flags, encode_simple_reply, nbd_error_code, state, ChunkHeader,
    Descriptor, Request, EXTENTS_PER_REPLY_MAX, REPLY_FLAG_DONE,
};
use crate::stream::Stream;

impl Connection {
    pub(super) fn run(&self, job: &Job, scratch: &mut Scratch) {
        let request = &job.request;
        let fua = request.flags & command_flags::FUA != 0;
        let export = self.export.as_ref();
        let result = match request.command {
            command::READ => return self.run_read(request, scratch),
            command::BLOCK_STATUS => return self.run_block_status(request, &mut scratch.batch),
            command::WRITE => call_export(request, || {
                export.write_at(
                    request.offset,
                    scratch.payload.current(job.payload_length),
                    fua,
                )
            }),
            command::FLUSH => call_export(request, || export.flush()),
            command::TRIM => {
                call_export(request, || export.trim(request.offset, request.length, fua))
            }
            command::CACHE => call_export(request, || export.cache(request.offset, request.length)),
            command::WRITE_ZEROES => {
                let fast = request.flags & command_flags::FAST_ZERO != 0;
                let options = ZeroOptions {
                    may_trim: request.flags & command_flags::NO_HOLE == 0,
                    fast,
                    fua,
                };
                call_export(request, || {
                    export.write_zeroes(request.offset, request.length, options)
                })
                .map_err(|error| {
                    if !fast && error.kind() == ErrorKind::NotSupported {
                        // ENOTSUP is reserved for refused fast zeroes.
                        Error::Export {
                            kind: ErrorKind::Io,
                            context: "write zeroes failed".to_owned(),
                            source: Some(Box::new(error)),
                        }
                    } else {
                        error
                    }
                })
            }
            other => unreachable!("command {other} passed the checks"),
        };
        match result {
            Ok(()) => self.reply_done(request, &mut scratch.batch),
            Err(error) => self.reply_error(request, &error, &mut scratch.batch),
        }
    }

    fn run_read(&self, request: &Request, scratch: &mut Scratch) {
        let length = usize::try_from(request.length).expect("read length checked");
        if length > 0 && request.length <= BATCH_REQUEST_BYTES_MAX {
            return self.run_read_into_batch(request, length, &mut scratch.batch);
        }
        if self.splice_reads
            && length >= SPLICE_MIN_BYTES
            && self.reply_spliced(request, length, &mut scratch.pipe)
        {
            return;
        }
        let buffer = scratch.payload.prepare(length);
        let export = self.export.as_ref();
        match call_export(request, || export.read_at(request.offset, buffer)) {
            Ok(()) => self.reply_data(request, buffer, &mut scratch.batch),
            Err(error) => self.reply_error(request, &error, &mut scratch.batch),
        }
    }

    /// Reads the data of a small READ straight into `batch`, after room for its reply
    /// header, which is filled once the read succeeded; on failure the room is given back
    /// and the error is answered instead.
    fn run_read_into_batch(&self, request: &Request, length: usize, batch: &mut Batch) {
        let mut header = [0u8; 40];
        let header_length = self.encode_data_header(request, &mut header);
        let total = header_length + length;
        if !batch.fits(total) {
            self.flush(batch);
        }
        let room = batch.room(total);
        let (head, data) = room.split_at_mut(header_length);
        let export = self.export.as_ref();
        match call_export(request, || export.read_at(request.offset, data)) {
            Ok(()) => {
                head.copy_from_slice(&header[..header_length]);
                batch.commit(total);
            }
            Err(error) => self.reply_error(request, &error, batch),
        }
    }

    /// Encodes into `out` the header of a successful READ reply carrying data (simple reply,
    /// or an OFFSET_DATA chunk and its offset), returning its length.
    fn encode_data_header(&self, request: &Request, out: &mut [u8; 40]) -> usize {
        match self.style {
            ReplyStyle::Simple => {
                let header = encode_simple_reply(0, request.cookie);
                out[..header.len()].copy_from_slice(&header);
                header.len()
            }
            ReplyStyle::Structured | ReplyStyle::Extended => {
                let header = ChunkHeader {
                    flags: REPLY_FLAG_DONE,
                    chunk_type: chunk::OFFSET_DATA,
                    cookie: request.cookie,
                    offset: request.offset,
                    payload_length: 8 + request.length,
                }
                .encode(self.header_style());
                let header = header.as_slice();
                let offset = protocol::encode_offset(request.offset);
                out[..header.len()].copy_from_slice(header);
                out[header.len()..header.len() + offset.len()].copy_from_slice(&offset);
                header.len() + offset.len()
            }
        }
    }

    /// Answers a READ from the export's file through `pipe` (see [`super::splice`]), if the
    /// export says where the bytes are and the pipe takes them all; `false` if nothing was
    /// sent and the READ is to be served by copy.
    fn reply_spliced(&self, request: &Request, length: usize, pipe: &mut Pipe) -> bool {
        let export = self.export.as_ref();
        let source = call_export(request, || {
            Ok(export.read_source(request.offset, request.length))
        });
        match source {
            Ok(Some(source)) if pipe.fill(source, length) => {}
            _ => return false,
        }
        let mut header = [0; 40];
        let header_length = self.encode_data_header(request, &mut header);
        let head = &header[..header_length];
        let Some(writer) = self.lock_writer() else {
            // Broken: nothing more is sent; the filled pipe must not feed a later reply.
            pipe.discard();
            return true;
        };
        let sent = send_more(&writer, head).and_then(|()| pipe.drain_into(&writer, length));
        if sent.is_err() {
            self.broken.store(true, Ordering::SeqCst);
            let _ = writer.shutdown(Shutdown::Both);
        }
        true
    }

    /// Answers BLOCK_STATUS with one status chunk per selected context, the last flagged
    /// DONE, all in one write; if any context fails, the request gets that error instead.
    fn run_block_status(&self, request: &Request, batch: &mut Batch) {
        assert!(
            !self.contexts.is_empty(),
            "checked before dispatch: context selected"
        );
        let one = request.flags & command_flags::REQ_ONE != 0;
        let extents_max = if one { 1 } else { EXTENTS_PER_REPLY_MAX };
        let mut payloads = Vec::with_capacity(self.contexts.len());
        for context in &self.contexts {
            match self.context_descriptors(request, context, extents_max) {
                Ok(descriptors) => payloads.push(protocol::encode_block_status(
                    self.header_style(),
                    context.id,
                    &descriptors,
                )),
                Err(error) => return self.reply_error(request, &error, batch),
            }
        }
        let chunk_type = match self.style {
            ReplyStyle::Extended => chunk::BLOCK_STATUS_EXT,
            _ => chunk::BLOCK_STATUS,
        };
        let last = payloads.len() - 1;
        let headers: Vec<_> = payloads
            .iter()
            .enumerate()
            .map(|(index, payload)| {
                ChunkHeader {
                    flags: if index == last { REPLY_FLAG_DONE } else { 0 },
                    chunk_type,
                    cookie: request.cookie,
                    offset: request.offset,
                    payload_length: payload.len() as u64,
                }
                .encode(self.header_style())
            })
            .collect();
        let mut buffers = Vec::with_capacity(2 * payloads.len());
        for (header, payload) in headers.iter().zip(&payloads) {
            buffers.push(IoSlice::new(header.as_slice()));
            buffers.push(IoSlice::new(payload));
        }
        self.send(batch, &mut buffers);
    }

    /// The descriptors of one context for a BLOCK_STATUS request.
    fn context_descriptors(
        &self,
        request: &Request,
        context: &SelectedContext,
        extents_max: usize,
    ) -> Result<Vec<Descriptor>> {
        let export = self.export.as_ref();
        let extents: Vec<(u64, u32)> = match &context.source {
            ContextSource::BaseAllocation => call_export(request, || {
                export.block_status(request.offset, request.length, extents_max)
            })?
            .iter()
            .map(|extent| {
                let flags = if extent.hole { state::HOLE } else { 0 }
                    | if extent.zero { state::ZERO } else { 0 };
                (extent.length_bytes, flags)
            })
            .collect(),
            ContextSource::Export(meta) => call_export(request, || {
                meta.block_status(request.offset, request.length, extents_max)
            })?
            .iter()
            .map(|extent| (extent.length_bytes, extent.flags))
            .collect(),
        };
        descriptors(&extents, request.length, extents_max, export.name())
    }

    /// The writer, locked; `None` if the connection is broken and nothing more may be written.
    pub(super) fn lock_writer(&self) -> Option<MutexGuard<'_, Stream>> {
        let writer = match self.writer.lock() {
            Ok(writer) => writer,
            Err(poisoned) => {
                // A thread panicked mid-reply: the stream may hold half a reply, so nothing
                // more can be framed on it (see [`crate::sync`]).
                self.broken.store(true, Ordering::SeqCst);
                let _ = poisoned.into_inner().shutdown(Shutdown::Both);
                return None;
            }
        };
        if self.broken.load(Ordering::SeqCst) {
            return None;
        }
        Some(writer)
    }

    fn reply_chunk(
        &self,
        request: &Request,
        chunk_type: u16,
        payload: &[&[u8]],
        batch: &mut Batch,
    ) {
        let header = ChunkHeader {
            flags: REPLY_FLAG_DONE,
            chunk_type,
            cookie: request.cookie,
            offset: request.offset,
            payload_length: payload.iter().map(|part| part.len() as u64).sum(),
        }
        .encode(self.header_style());
        let mut buffers = [IoSlice::new(&[]); 3];
        buffers[0] = IoSlice::new(header.as_slice());
        assert!(payload.len() < buffers.len(), "too many payload parts");
        for (slot, part) in buffers[1..].iter_mut().zip(payload) {
            *slot = IoSlice::new(part);
        }
        self.send(batch, &mut buffers[..1 + payload.len()]);
    }

    /// Success without data.
    fn reply_done(&self, request: &Request, batch: &mut Batch) {
        match self.style {
            ReplyStyle::Simple | ReplyStyle::Structured => {
                let header = encode_simple_reply(0, request.cookie);
                self.send(batch, &mut [IoSlice::new(&header)]);
            }
            ReplyStyle::Extended => self.reply_chunk(request, chunk::NONE, &[], batch),
        }
    }

    fn reply_data(&self, request: &Request, data: &[u8], batch: &mut Batch) {
        match self.style {
            ReplyStyle::Simple => {
                let header = encode_simple_reply(0, request.cookie);
                self.send(batch, &mut [IoSlice::new(&header), IoSlice::new(data)]);
            }
            _ if data.is_empty() => self.reply_chunk(request, chunk::NONE, &[], batch),
            _ => {
                let offset = protocol::encode_offset(request.offset);
                self.reply_chunk(request, chunk::OFFSET_DATA, &[&offset, data], batch);
            }
        }
    }

    pub(super) fn reply_error(&self, request: &Request, error: &Error, batch: &mut Batch) {
        let code = nbd_error_code(error);
        match self.style {
            ReplyStyle::Simple => {
                let header = encode_simple_reply(code, request.cookie);
                self.send(batch, &mut [IoSlice::new(&header)]);
            }
            ReplyStyle::Structured | ReplyStyle::Extended => {
                let payload = protocol::encode_error_payload(code, &error.to_string());
                self.reply_chunk(request, chunk::ERROR, &[&payload], batch);
            }
        }
    }
}

/// Turns the export's extents (length in bytes, flags) into wire descriptors for a request
/// of `length` bytes: drops empty extents, merges neighbours with equal flags, stops at the
/// request end (clipping the last one) and at `descriptors_max`.
fn descriptors(
    extents: &[(u64, u32)],
    length: u64,
    descriptors_max: usize,
    export_name: &str,
) -> Result<Vec<Descriptor>> {
    let mut out: Vec<Descriptor> = Vec::new();
    let mut covered = 0u64;
    for &(extent_length, flags) in extents {
        if covered >= length {
            break;
        }
        if extent_length == 0 {
            continue;
        }
        let piece = extent_length.min(length - covered);
        covered += piece;
        let full = out.len() >= descriptors_max;
        match out.last_mut() {
            Some(last) if last.flags == flags => last.length += piece,
            _ if full => break,
            _ => out.push(Descriptor {
                length: piece,
                flags,
            }),
        }
    }
    if out.is_empty() {
        return Err(Error::export(
            ErrorKind::Io,
            format!("export {export_name} returned no extents"),
        ));
    }
    Ok(out)
}

/// Writes all of `bytes` with MSG_MORE: on TCP, the data spliced next may share a segment.
fn send_more(socket: &Stream, mut bytes: &[u8]) -> std::io::Result<()> {
    while !bytes.is_empty() {
        match rustix::net::send(socket, bytes, SendFlags::MORE) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(count) => bytes = &bytes[count..],
            Err(rustix::io::Errno::INTR) => {}
            Err(error) => return Err(error.into()),
        }
    }
    Ok(())
}

/// Calls the export for `request`, turning a panic in it into an I/O error for that request
/// alone: the request is answered and its budget released like any failed request, and the
/// threads and locks of the session stay usable (the export's own state is its business; an
/// export that cannot go on after a panic fails its later requests itself).
fn call_export<T>(request: &Request, call: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
        Ok(result) => result,
        Err(_) => Err(Error::Export {
            kind: ErrorKind::Io,
            context: format!(
                "the export panicked serving command {} at offset {}",
                request.command, request.offset
            ),
            source: None,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extent(length_bytes: u64, hole: bool) -> (u64, u32) {
        (length_bytes, if hole { 3 } else { 0 })
    }

    #[test]
    fn descriptors_merge_clip_and_cap() {
        let extents = [
            extent(512, true),
            extent(512, true),
            extent(0, false),
            extent(1024, false),
            extent(4096, true),
        ];
        let out = descriptors(&extents, 2048 + 512, 100, "e").unwrap();
        assert_eq!(
            out,
            vec![
                Descriptor {
                    length: 1024,
                    flags: 3
                },
                Descriptor {
                    length: 1024,
                    flags: 0
                },
                Descriptor {
                    length: 512,
                    flags: 3
                },
            ]
        );
        let one = descriptors(&extents, 4096, 1, "e").unwrap();
        assert_eq!(one.len(), 1);
        assert!(descriptors(&[], 512, 1, "e").is_err());
    }
}
