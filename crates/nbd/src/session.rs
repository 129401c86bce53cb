//! The transmission phase of one connection: reading requests, running them on a small pool
//! of worker threads, and writing replies in any order.
//!
//! Threading: the connection thread reads request headers and WRITE payloads (straight into
//! the buffer later passed to [`Export::write_at`]) and checks every request before it is
//! dispatched; `workers` threads take checked requests from a queue, call the export, and write
//! the reply under the writer lock with one vectored write (READ data goes from the buffer
//! [`Export::read_at`] filled to the socket). Invariants: at most `requests_in_flight_max`
//! requests and about `bytes_in_flight_max` payload bytes are between "header read" and
//! "reply written" at once, and the server-wide byte budget bounds the sum over all
//! connections ([`Budget`]); a request reaches the export only with a range inside
//! the export, aligned to [`BLOCK_SIZE_MIN`], and a payload of at most [`PAYLOAD_LENGTH_MAX`];
//! every reply is written whole while holding the writer lock, so replies never interleave
//! byte-wise. Out-of-range, misaligned, unknown or badly flagged requests get an error reply
//! and the connection goes on; a bad magic, an oversize WRITE payload or a socket error ends
//! the connection after in-flight requests are answered.

use std::io::{self, IoSlice, Read};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};

use crate::error::{nbd_error_code, Error, ErrorKind, Result};
use crate::export::{Export, ZeroOptions};
use crate::handshake::{Negotiated, ReplyStyle};
use crate::protocol::{
    self, chunk, command, command_flags, encode_simple_reply, state, ChunkHeader, Descriptor,
    HeaderStyle, Request, BLOCK_SIZE_MIN, EXTENTS_PER_REPLY_MAX, PAYLOAD_LENGTH_MAX,
    REPLY_FLAG_DONE,
};
use crate::stream::{read_exact_or_eof, write_all_vectored, Stream};

/// Limits of one connection's transmission phase.
#[derive(Clone)]
pub(crate) struct Limits {
    pub(crate) workers: usize,
    pub(crate) requests_in_flight_max: usize,
    pub(crate) bytes_in_flight_max: u64,
    /// Payload bytes in flight over all connections of the server.
    pub(crate) server_bytes: Arc<Budget>,
}

/// Counts requests and payload bytes in flight; the reader waits here when either is full.
pub(crate) struct Budget {
    used: Mutex<(usize, u64)>,
    released: Condvar,
    requests_max: usize,
    bytes_max: u64,
}

impl Budget {
    pub(crate) fn new(requests_max: usize, bytes_max: u64) -> Self {
        Budget {
            used: Mutex::new((0, 0)),
            released: Condvar::new(),
            requests_max,
            bytes_max,
        }
    }

    fn acquire(&self, bytes: u64) {
        let mut used = self.used.lock().expect("budget lock");
        // A single request larger than the byte budget still runs, alone.
        while used.0 >= self.requests_max || (used.0 > 0 && used.1 + bytes > self.bytes_max) {
            used = self.released.wait(used).expect("budget lock");
        }
        used.0 += 1;
        used.1 += bytes;
    }

    fn release(&self, bytes: u64) {
        let mut used = self.used.lock().expect("budget lock");
        assert!(used.0 > 0, "budget released more requests than acquired");
        assert!(used.1 >= bytes, "budget released more bytes than acquired");
        used.0 -= 1;
        used.1 -= bytes;
        self.released.notify_all();
    }
}

/// A checked request on its way to a worker.
struct Job {
    request: Request,
    payload: Vec<u8>,
    reserved_bytes: u64,
}

/// State shared by the reader and the workers of one connection.
struct Connection {
    export: Arc<dyn Export>,
    style: ReplyStyle,
    base_allocation_id: Option<u32>,
    writer: Mutex<Stream>,
    broken: AtomicBool,
    budget: Budget,
    server_bytes: Arc<Budget>,
}

/// What the reader decided about one request.
enum Verdict {
    /// Dispatch to a worker.
    Run,
    /// Answer at once with this error (after discarding any payload).
    Refuse(Error),
}

/// Serves requests on `reader`/`writer` until the client disconnects. Returns an error if the
/// connection ended because of a protocol violation or a socket failure.
pub(crate) fn serve(
    negotiated: Negotiated,
    mut reader: Stream,
    writer: Stream,
    limits: Limits,
) -> Result<()> {
    assert!(limits.workers > 0, "a session needs a worker");
    assert!(
        limits.requests_in_flight_max > 0,
        "a session needs a request slot"
    );
    let connection = Connection {
        export: negotiated.export,
        style: negotiated.style,
        base_allocation_id: negotiated.base_allocation_id,
        writer: Mutex::new(writer),
        broken: AtomicBool::new(false),
        budget: Budget::new(limits.requests_in_flight_max, limits.bytes_in_flight_max),
        server_bytes: limits.server_bytes,
    };
    let (sender, receiver) = mpsc::sync_channel::<Job>(limits.requests_in_flight_max);
    let receiver = Mutex::new(receiver);
    std::thread::scope(|scope| {
        for _ in 0..limits.workers {
            scope.spawn(|| connection.work(&receiver));
        }
        let result = connection.read_requests(&mut reader, &sender);
        // Dropping the sender lets the workers drain the queue and stop.
        drop(sender);
        result
    })
}

impl Connection {
    fn header_style(&self) -> HeaderStyle {
        match self.style {
            ReplyStyle::Extended => HeaderStyle::Extended,
            ReplyStyle::Simple | ReplyStyle::Structured => HeaderStyle::Compact,
        }
    }

    /// Takes a request slot and `bytes` from this connection's budget, then `bytes` from the
    /// server's; always in this order, and released together, so waits cannot form a cycle.
    fn acquire(&self, bytes: u64) {
        self.budget.acquire(bytes);
        if bytes > 0 {
            self.server_bytes.acquire(bytes);
        }
    }

    fn release(&self, bytes: u64) {
        if bytes > 0 {
            self.server_bytes.release(bytes);
        }
        self.budget.release(bytes);
    }

    fn read_requests(&self, reader: &mut Stream, sender: &mpsc::SyncSender<Job>) -> Result<()> {
        let style = self.header_style();
        let mut header = [0u8; protocol::EXTENDED_REQUEST_SIZE];
        let header = &mut header[..style.request_size()];
        loop {
            if self.broken.load(Ordering::SeqCst) {
                return Err(Error::protocol("reply could not be sent"));
            }
            let open =
                read_exact_or_eof(reader, header).map_err(|e| Error::io("read request", e))?;
            if !open {
                return Ok(());
            }
            let request = Request::parse(style, header)?;
            if request.command == command::DISC {
                return Ok(());
            }
            let payload_length = self.payload_length(&request);
            if payload_length > u64::from(PAYLOAD_LENGTH_MAX) {
                // The payload cannot be skipped safely: answer, then hang up.
                let error = Error::TooLong {
                    what: "request payload",
                    length: payload_length,
                    maximum: u64::from(PAYLOAD_LENGTH_MAX),
                };
                self.reply_error(&request, &error);
                return Err(error);
            }
            match self.check(&request, payload_length) {
                Verdict::Refuse(error) => {
                    discard(reader, payload_length)?;
                    self.reply_error(&request, &error);
                }
                Verdict::Run => {
                    let reserved_bytes = match request.command {
                        command::READ | command::WRITE => request.length,
                        _ => 0,
                    };
                    self.acquire(reserved_bytes);
                    let mut payload = Vec::new();
                    if payload_length > 0 {
                        payload = vec![0u8; payload_length as usize];
                        if let Err(error) = reader.read_exact(&mut payload) {
                            self.release(reserved_bytes);
                            return Err(Error::io("read write payload", error));
                        }
                    }
                    let job = Job {
                        request,
                        payload,
                        reserved_bytes,
                    };
                    if sender.send(job).is_err() {
                        unreachable!("workers outlive the reader");
                    }
                }
            }
        }
    }

    /// Bytes of payload that follow the header of `request`.
    fn payload_length(&self, request: &Request) -> u64 {
        let flagged = request.flags & command_flags::PAYLOAD_LEN != 0;
        match self.style {
            ReplyStyle::Extended if flagged => request.length,
            _ if request.command == command::WRITE => request.length,
            _ => 0,
        }
    }

    /// Checks a request before it may reach the export.
    fn check(&self, request: &Request, payload_length: u64) -> Verdict {
        let refuse =
            |kind: ErrorKind, message: String| Verdict::Refuse(Error::export(kind, message));
        let command = request.command;
        let extended = self.style == ReplyStyle::Extended;
        let mut flags_allowed = command_flags::FUA;
        match command {
            command::READ => flags_allowed |= command_flags::DF,
            command::WRITE if extended => flags_allowed |= command_flags::PAYLOAD_LEN,
            command::WRITE_ZEROES => {
                flags_allowed |= command_flags::NO_HOLE;
                if self.export.can_fast_zero() {
                    flags_allowed |= command_flags::FAST_ZERO;
                }
            }
            command::BLOCK_STATUS => flags_allowed |= command_flags::REQ_ONE,
            command::WRITE | command::FLUSH | command::TRIM | command::CACHE => {}
            _ => {
                return refuse(
                    ErrorKind::InvalidArgument,
                    format!("unknown command {command}"),
                )
            }
        }
        if request.flags & !flags_allowed != 0 {
            return refuse(
                ErrorKind::InvalidArgument,
                format!("flags {:#x} not valid for command {command}", request.flags),
            );
        }
        if command != command::WRITE && payload_length > 0 {
            return refuse(
                ErrorKind::InvalidArgument,
                format!("command {command} takes no payload"),
            );
        }
        if command == command::FLUSH {
            return Verdict::Run;
        }
        let writes = matches!(
            command,
            command::WRITE | command::TRIM | command::WRITE_ZEROES
        );
        if writes && self.export.read_only() {
            return refuse(
                ErrorKind::PermissionDenied,
                "export is read-only".to_owned(),
            );
        }
        let size = self.export.size_bytes();
        let inside = request
            .offset
            .checked_add(request.length)
            .is_some_and(|end| end <= size);
        if !inside {
            let kind = match command {
                command::WRITE | command::WRITE_ZEROES => ErrorKind::NoSpace,
                _ => ErrorKind::InvalidArgument,
            };
            return refuse(
                kind,
                format!(
                    "offset {} length {} is outside the export of {size} bytes",
                    request.offset, request.length
                ),
            );
        }
        let block = u64::from(BLOCK_SIZE_MIN);
        if !request.offset.is_multiple_of(block) || !request.length.is_multiple_of(block) {
            return refuse(
                ErrorKind::InvalidArgument,
                format!(
                    "offset {} length {} not aligned to {block} bytes",
                    request.offset, request.length
                ),
            );
        }
        if command == command::READ && request.length > u64::from(PAYLOAD_LENGTH_MAX) {
            return refuse(
                ErrorKind::Overflow,
                format!(
                    "read length {} exceeds the maximum {PAYLOAD_LENGTH_MAX}",
                    request.length
                ),
            );
        }
        if command == command::BLOCK_STATUS {
            if self.base_allocation_id.is_none() {
                return refuse(
                    ErrorKind::InvalidArgument,
                    "no metadata context selected".to_owned(),
                );
            }
            if request.length == 0 {
                return refuse(
                    ErrorKind::InvalidArgument,
                    "block status of zero length".to_owned(),
                );
            }
        }
        Verdict::Run
    }

    fn work(&self, receiver: &Mutex<mpsc::Receiver<Job>>) {
        loop {
            let job = match receiver.lock().expect("queue lock").recv() {
                Ok(job) => job,
                Err(mpsc::RecvError) => return,
            };
            if !self.broken.load(Ordering::SeqCst) {
                self.run(&job);
            }
            self.release(job.reserved_bytes);
        }
    }

    fn run(&self, job: &Job) {
        let request = &job.request;
        let fua = request.flags & command_flags::FUA != 0;
        let export = self.export.as_ref();
        let result = match request.command {
            command::READ => return self.run_read(request),
            command::BLOCK_STATUS => return self.run_block_status(request),
            command::WRITE => export.write_at(request.offset, &job.payload, fua),
            command::FLUSH => export.flush(),
            command::TRIM => export.trim(request.offset, request.length, fua),
            command::CACHE => export.cache(request.offset, request.length),
            command::WRITE_ZEROES => {
                let fast = request.flags & command_flags::FAST_ZERO != 0;
                let options = ZeroOptions {
                    may_trim: request.flags & command_flags::NO_HOLE == 0,
                    fast,
                    fua,
                };
                export
                    .write_zeroes(request.offset, request.length, options)
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
            Ok(()) => self.reply_done(request),
            Err(error) => self.reply_error(request, &error),
        }
    }

    fn run_read(&self, request: &Request) {
        let mut buffer = vec![0u8; request.length as usize];
        match self.export.read_at(request.offset, &mut buffer) {
            Ok(()) => self.reply_data(request, &buffer),
            Err(error) => self.reply_error(request, &error),
        }
    }

    fn run_block_status(&self, request: &Request) {
        let id = self
            .base_allocation_id
            .expect("checked before dispatch: context selected");
        let one = request.flags & command_flags::REQ_ONE != 0;
        let extents_max = if one { 1 } else { EXTENTS_PER_REPLY_MAX };
        let result = self
            .export
            .block_status(request.offset, request.length, extents_max)
            .and_then(|extents| {
                descriptors(
                    &extents,
                    request.length,
                    extents_max,
                    self.export.as_ref().name(),
                )
            });
        match result {
            Ok(descriptors) => {
                let chunk_type = match self.style {
                    ReplyStyle::Extended => chunk::BLOCK_STATUS_EXT,
                    _ => chunk::BLOCK_STATUS,
                };
                let payload = protocol::encode_block_status(self.header_style(), id, &descriptors);
                self.reply_chunk(request, chunk_type, &[&payload]);
            }
            Err(error) => self.reply_error(request, &error),
        }
    }

    /// Writes one reply with a single vectored write; a failure marks the connection broken
    /// and shuts the socket so the reader stops too.
    fn send(&self, buffers: &mut [IoSlice<'_>]) {
        let mut writer = self.writer.lock().expect("writer lock");
        if self.broken.load(Ordering::SeqCst) {
            return;
        }
        if write_all_vectored(&mut *writer, buffers).is_err() {
            self.broken.store(true, Ordering::SeqCst);
            let _ = writer.shutdown(Shutdown::Both);
        }
    }

    fn reply_chunk(&self, request: &Request, chunk_type: u16, payload: &[&[u8]]) {
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
        self.send(&mut buffers[..1 + payload.len()]);
    }

    /// Success without data.
    fn reply_done(&self, request: &Request) {
        match self.style {
            ReplyStyle::Simple | ReplyStyle::Structured => {
                let header = encode_simple_reply(0, request.cookie);
                self.send(&mut [IoSlice::new(&header)]);
            }
            ReplyStyle::Extended => self.reply_chunk(request, chunk::NONE, &[]),
        }
    }

    fn reply_data(&self, request: &Request, data: &[u8]) {
        match self.style {
            ReplyStyle::Simple => {
                let header = encode_simple_reply(0, request.cookie);
                self.send(&mut [IoSlice::new(&header), IoSlice::new(data)]);
            }
            _ if data.is_empty() => self.reply_chunk(request, chunk::NONE, &[]),
            _ => {
                let offset = protocol::encode_offset(request.offset);
                self.reply_chunk(request, chunk::OFFSET_DATA, &[&offset, data]);
            }
        }
    }

    fn reply_error(&self, request: &Request, error: &Error) {
        let code = nbd_error_code(error);
        match self.style {
            ReplyStyle::Simple => {
                let header = encode_simple_reply(code, request.cookie);
                self.send(&mut [IoSlice::new(&header)]);
            }
            ReplyStyle::Structured | ReplyStyle::Extended => {
                let payload = protocol::encode_error_payload(code, &error.to_string());
                self.reply_chunk(request, chunk::ERROR, &[&payload]);
            }
        }
    }
}

/// Turns the export's extents into wire descriptors for a request of `length` bytes: drops
/// empty extents, merges neighbours with equal flags, stops at the request end (clipping the
/// last one) and at `descriptors_max`.
fn descriptors(
    extents: &[crate::export::Extent],
    length: u64,
    descriptors_max: usize,
    export_name: &str,
) -> Result<Vec<Descriptor>> {
    let mut out: Vec<Descriptor> = Vec::new();
    let mut covered = 0u64;
    for extent in extents {
        if covered >= length {
            break;
        }
        if extent.length_bytes == 0 {
            continue;
        }
        let flags =
            if extent.hole { state::HOLE } else { 0 } | if extent.zero { state::ZERO } else { 0 };
        let piece = extent.length_bytes.min(length - covered);
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

/// Reads and drops `length` payload bytes through a small stack buffer.
fn discard(reader: &mut Stream, length: u64) -> Result<()> {
    if length == 0 {
        return Ok(());
    }
    let copied = io::copy(&mut reader.take(length), &mut io::sink())
        .map_err(|e| Error::io("discard payload", e))?;
    if copied != length {
        return Err(Error::io(
            "discard payload",
            io::ErrorKind::UnexpectedEof.into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::Extent;

    fn extent(length_bytes: u64, hole: bool) -> Extent {
        Extent {
            length_bytes,
            hole,
            zero: hole,
        }
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
