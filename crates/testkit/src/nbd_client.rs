//! A raw NBD client for tests, written from the protocol notes and independent of the `nbd`
//! crate's codec (so a bug in the codec cannot hide itself): it speaks the wire protocol
//! itself, constants included.
//!
//! It connects over a Unix socket, runs the fixed-newstyle handshake one option at a time
//! ([`Client::option`]), negotiates simple, structured or extended replies
//! ([`Client::negotiate`]), or just opens an export with `NBD_OPT_GO` ([`Client::open`]). In
//! transmission it sends requests and reassembles replies by cookie, checking the framing
//! as it goes: a reply to an unknown cookie, a chunk of the wrong kind for the mode, or data
//! outside the requested range fails the test.
//!
//! ```no_run
//! use testkit::nbd_client::Client;
//! let mut client = Client::open("/tmp/nbd.sock".as_ref(), "disk");
//! client.write(0, &[1u8; 4096]);
//! assert_eq!(client.read(0, 4096), vec![1u8; 4096]);
//! client.disconnect();
//! ```
//!
//! NBD is big-endian on the wire, hence the explicit conversions here.
#![allow(clippy::big_endian_bytes)]

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

mod wire;

pub use wire::*;

/// Largest option reply or chunk payload the client accepts.
const PAYLOAD_LENGTH_MAX: u64 = 64 << 20;
/// How long a read may wait before the test fails instead of hanging.
const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// One option reply.
#[derive(Debug, Clone)]
pub struct OptionReply {
    pub option: u32,
    pub reply_type: u32,
    pub data: Vec<u8>,
}

impl OptionReply {
    /// Whether this is the last reply to its option (an ACK or an error).
    pub fn is_final(&self) -> bool {
        self.reply_type == REP_ACK || self.reply_type & REP_ERROR_BIT != 0
    }
}

/// Reply framing in the transmission phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Simple,
    Structured,
    Extended,
}

/// A finished reply, reassembled from its chunks.
#[derive(Debug, Default)]
pub struct Completed {
    pub cookie: u64,
    /// The NBD error value; 0 for success.
    pub error: u32,
    pub error_message: String,
    /// A READ's data (holes filled with zeros).
    pub data: Vec<u8>,
    pub chunk_types: Vec<u16>,
    /// (context id, [(length, flags)]) per block-status chunk.
    pub block_status: Vec<(u32, Vec<(u64, u64)>)>,
}

#[derive(Debug)]
struct Pending {
    command: u16,
    offset: u64,
    length: u64,
    partial: Completed,
}

/// A raw NBD connection over a Unix socket.
#[derive(Debug)]
pub struct Client {
    pub stream: UnixStream,
    /// Reply framing; set by [`Client::negotiate`] once the export is open.
    pub mode: Mode,
    /// Export size from the last successful GO.
    pub size: u64,
    /// Transmission flags from the last successful GO.
    pub flags: u16,
    next_cookie: u64,
    pending: HashMap<u64, Pending>,
}

impl Client {
    /// Connects and reads the greeting (checked), without sending client flags.
    pub fn connect(socket: &Path) -> Client {
        Client::try_connect(socket)
            .unwrap_or_else(|e| panic!("cannot connect to {}: {e}", socket.display()))
    }

    fn try_connect(socket: &Path) -> io::Result<Client> {
        let stream = UnixStream::connect(socket)?;
        stream.set_read_timeout(Some(READ_TIMEOUT))?;
        let mut client = Client {
            stream,
            mode: Mode::Simple,
            size: 0,
            flags: 0,
            next_cookie: 1,
            pending: HashMap::new(),
        };
        let greeting = client.try_read_bytes(18)?;
        assert_eq!(be64(&greeting[0..]), NBDMAGIC, "greeting magic");
        assert_eq!(be64(&greeting[8..]), IHAVEOPT, "greeting option magic");
        assert_eq!(be16(&greeting[16..]), 3, "FIXED_NEWSTYLE | NO_ZEROES");
        Ok(client)
    }

    /// Connects, reads the greeting and sends FIXED_NEWSTYLE | NO_ZEROES.
    pub fn start(socket: &Path) -> Client {
        let mut client = Client::connect(socket);
        client.send(&CLIENT_FLAGS.to_be_bytes());
        client
    }

    /// Connects and opens `export` with NBD_OPT_GO in simple-reply mode; panics if the
    /// connection fails or the server refuses.
    pub fn open(socket: &Path, export: &str) -> Client {
        Client::try_open(socket, export)
            .unwrap_or_else(|error| panic!("cannot open export {export:?}: {error}"))
    }

    /// Like [`Client::open`], but a refused GO or a failed connection is an `Err` naming it.
    pub fn try_open(socket: &Path, export: &str) -> Result<Client, String> {
        let mut client = Client::try_connect(socket).map_err(|e| e.to_string())?;
        client
            .try_send(&CLIENT_FLAGS.to_be_bytes())
            .map_err(|e| e.to_string())?;
        let replies = client
            .try_option(OPT_GO, &export_request(export, &[]))
            .map_err(|e| e.to_string())?;
        let last = replies.last().expect("at least the final reply");
        if last.reply_type != REP_ACK {
            return Err(format!(
                "option refused with {:#x}: {}",
                last.reply_type,
                String::from_utf8_lossy(&last.data)
            ));
        }
        client.take_export_info(&replies);
        Ok(client)
    }

    /// Negotiates `mode`, optionally selects base:allocation, and GOes to `name` (asking
    /// for the block size). Returns (client, size, transmission flags, context id).
    pub fn negotiate(socket: &Path, name: &str, mode: Mode, meta: bool) -> (Client, u64, u16, u32) {
        let mut client = Client::start(socket);
        let mode_option = match mode {
            Mode::Simple => None,
            Mode::Structured => Some(OPT_STRUCTURED_REPLY),
            Mode::Extended => Some(OPT_EXTENDED_HEADERS),
        };
        if let Some(code) = mode_option {
            let replies = client.option(code, &[]);
            assert_eq!(replies[0].reply_type, REP_ACK, "{replies:?}");
        }
        let mut context = 0;
        if meta {
            let replies = client.option(
                OPT_SET_META_CONTEXT,
                &meta_request(name, &["base:allocation"]),
            );
            assert_eq!(replies.len(), 2, "{replies:?}");
            assert_eq!(replies[0].reply_type, REP_META_CONTEXT);
            assert_eq!(&replies[0].data[4..], b"base:allocation");
            context = be32(&replies[0].data);
        }
        let (size, flags) = client.go(name);
        client.mode = mode;
        (client, size, flags, context)
    }

    /// Sends GO asking for BLOCK_SIZE; requires success and returns (size, flags).
    pub fn go(&mut self, name: &str) -> (u64, u16) {
        let replies = self.option(OPT_GO, &export_request(name, &[INFO_BLOCK_SIZE]));
        let last = replies.last().expect("at least the final reply");
        assert_eq!(last.reply_type, REP_ACK, "GO failed: {replies:?}");
        assert!(self.take_export_info(&replies), "no NBD_INFO_EXPORT");
        (self.size, self.flags)
    }

    /// Takes size and flags from an NBD_INFO_EXPORT among `replies`; false if none.
    fn take_export_info(&mut self, replies: &[OptionReply]) -> bool {
        let Some(export) = replies
            .iter()
            .find(|reply| reply.reply_type == REP_INFO && be16(&reply.data) == INFO_EXPORT)
        else {
            return false;
        };
        assert_eq!(export.data.len(), 12, "NBD_INFO_EXPORT length");
        self.size = be64(&export.data[2..]);
        self.flags = be16(&export.data[10..]);
        true
    }

    /// Writes raw bytes.
    pub fn send(&mut self, bytes: &[u8]) {
        self.try_send(bytes).expect("send to the server");
    }

    fn try_send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// Reads exactly `length` bytes.
    pub fn read_bytes(&mut self, length: usize) -> Vec<u8> {
        self.try_read_bytes(length).expect("read from the server")
    }

    fn try_read_bytes(&mut self, length: usize) -> io::Result<Vec<u8>> {
        let mut buffer = vec![0u8; length];
        self.stream.read_exact(&mut buffer)?;
        Ok(buffer)
    }

    /// True if the server closed the connection (EOF, reset or another socket error) within
    /// the read timeout, false if it is still open then; bytes the server still sends before
    /// closing are skipped.
    pub fn is_closed(&mut self) -> bool {
        let mut buffer = [0u8; 4096];
        loop {
            match self.stream.read(&mut buffer) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => {
                    return !matches!(
                        error.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    )
                }
            }
        }
    }

    /// Sends one option.
    pub fn send_option(&mut self, code: u32, data: &[u8]) {
        self.send(&option_bytes(code, data));
    }

    /// Reads one option reply (checked magic, bounded length).
    pub fn read_option_reply(&mut self) -> OptionReply {
        self.try_read_option_reply().expect("option reply")
    }

    fn try_read_option_reply(&mut self) -> io::Result<OptionReply> {
        let header = self.try_read_bytes(20)?;
        assert_eq!(be64(&header), OPTION_REPLY_MAGIC, "option reply magic");
        let length = be32(&header[16..]);
        assert!(
            u64::from(length) <= PAYLOAD_LENGTH_MAX,
            "option reply of {length} bytes"
        );
        Ok(OptionReply {
            option: be32(&header[8..]),
            reply_type: be32(&header[12..]),
            data: self.try_read_bytes(length as usize)?,
        })
    }

    /// Sends an option and collects replies up to the final ACK or error.
    pub fn option(&mut self, code: u32, data: &[u8]) -> Vec<OptionReply> {
        self.try_option(code, data).expect("option exchange")
    }

    fn try_option(&mut self, code: u32, data: &[u8]) -> io::Result<Vec<OptionReply>> {
        self.try_send(&option_bytes(code, data))?;
        let mut replies = Vec::new();
        loop {
            let reply = self.try_read_option_reply()?;
            assert_eq!(reply.option, code, "reply to the wrong option");
            let last = reply.is_final();
            replies.push(reply);
            if last {
                return Ok(replies);
            }
        }
    }

    /// Sends a request in this connection's framing; returns its cookie. `payload` goes
    /// after the header.
    pub fn send_request(
        &mut self,
        command: u16,
        flags: u16,
        offset: u64,
        length: u64,
        payload: &[u8],
    ) -> u64 {
        let cookie = self.expect_reply(command, offset, length);
        let mut bytes = request_header(self.mode, command, flags, cookie, offset, length);
        bytes.extend_from_slice(payload);
        self.send(&bytes);
        cookie
    }

    /// A new cookie, and a reply awaited for it unless `command` is DISC.
    fn expect_reply(&mut self, command: u16, offset: u64, length: u64) -> u64 {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        if command != CMD_DISC {
            let partial = Completed {
                cookie,
                ..Default::default()
            };
            let pending = Pending {
                command,
                offset,
                length,
                partial,
            };
            self.pending.insert(cookie, pending);
        }
        cookie
    }

    /// Reads messages until some request is complete; validates framing as it goes.
    pub fn read_completed(&mut self) -> Completed {
        self.try_read_completed().expect("read reply")
    }

    /// Like [`Client::read_completed`], but a failed socket is an `Err` (for tests that
    /// kill the server); a framing error still fails the test.
    pub fn try_read_completed(&mut self) -> io::Result<Completed> {
        loop {
            let magic = be32(&self.try_read_bytes(4)?);
            match magic {
                SIMPLE_REPLY_MAGIC => return self.read_simple_reply(),
                STRUCTURED_REPLY_MAGIC | EXTENDED_REPLY_MAGIC => {
                    if let Some(completed) = self.read_chunk(magic == EXTENDED_REPLY_MAGIC)? {
                        return Ok(completed);
                    }
                }
                other => panic!("bad reply magic {other:#x}"),
            }
        }
    }

    fn read_simple_reply(&mut self) -> io::Result<Completed> {
        let rest = self.try_read_bytes(12)?;
        let error = be32(&rest);
        let cookie = be64(&rest[4..]);
        let pending = self
            .pending
            .remove(&cookie)
            .unwrap_or_else(|| panic!("simple reply for unknown cookie {cookie}"));
        assert!(
            pending.command != CMD_READ || self.mode == Mode::Simple || error != 0,
            "successful READ answered with a simple reply in {:?} mode",
            self.mode
        );
        assert_ne!(self.mode, Mode::Extended, "simple reply in extended mode");
        let mut completed = pending.partial;
        completed.error = error;
        if pending.command == CMD_READ && error == 0 {
            completed.data = self.try_read_bytes(pending.length as usize)?;
        }
        Ok(completed)
    }

    /// Reads one chunk (its magic already read); the completed reply if it was the last.
    fn read_chunk(&mut self, extended: bool) -> io::Result<Option<Completed>> {
        assert_eq!(
            extended,
            self.mode == Mode::Extended,
            "chunk magic for mode {:?}",
            self.mode
        );
        let rest = self.try_read_bytes(if extended { 28 } else { 16 })?;
        let flags = be16(&rest);
        let chunk_type = be16(&rest[2..]);
        let cookie = be64(&rest[4..]);
        let length = if extended {
            be64(&rest[20..])
        } else {
            u64::from(be32(&rest[12..]))
        };
        assert!(length <= PAYLOAD_LENGTH_MAX, "chunk payload {length}");
        let payload = self.try_read_bytes(length as usize)?;
        let pending = self
            .pending
            .get_mut(&cookie)
            .unwrap_or_else(|| panic!("chunk for unknown cookie {cookie}"));
        if extended {
            assert_eq!(be64(&rest[12..]), pending.offset, "extended chunk offset");
        }
        apply_chunk(pending, chunk_type, &payload);
        if flags & CHUNK_FLAG_DONE == 0 {
            return Ok(None);
        }
        let pending = self.pending.remove(&cookie).expect("pending above");
        let mut completed = pending.partial;
        if pending.command == CMD_READ && completed.error == 0 && completed.data.is_empty() {
            completed.data = vec![0u8; pending.length as usize];
        }
        Ok(Some(completed))
    }

    /// Sends one request and waits for its reply (nothing else may be in flight).
    pub fn request(
        &mut self,
        command: u16,
        flags: u16,
        offset: u64,
        length: u64,
        payload: &[u8],
    ) -> Completed {
        let cookie = self.send_request(command, flags, offset, length, payload);
        let completed = self.read_completed();
        assert_eq!(completed.cookie, cookie, "reply to another request");
        completed
    }

    /// A request with `payload` as its data (a WRITE) or none (FLUSH, ...), with no flags;
    /// a failed socket is an `Err` (for tests that kill the server mid-request).
    pub fn try_request(
        &mut self,
        command: u16,
        offset: u64,
        payload: &[u8],
    ) -> io::Result<Completed> {
        let length = payload.len() as u64;
        let cookie = self.expect_reply(command, offset, length);
        let mut bytes = request_header(self.mode, command, 0, cookie, offset, length);
        bytes.extend_from_slice(payload);
        self.try_send(&bytes)?;
        let completed = self.try_read_completed()?;
        assert_eq!(completed.cookie, cookie, "reply to another request");
        Ok(completed)
    }

    /// WRITE, which must succeed.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        let error = self.write_errno(offset, data);
        assert_eq!(error, 0, "write of {} bytes at {offset}", data.len());
    }

    /// WRITE; returns the NBD error value (0 for success).
    pub fn write_errno(&mut self, offset: u64, data: &[u8]) -> u32 {
        self.request(CMD_WRITE, 0, offset, data.len() as u64, data)
            .error
    }

    /// READ, which must succeed.
    pub fn read(&mut self, offset: u64, length: u64) -> Vec<u8> {
        let reply = self.request(CMD_READ, 0, offset, length, &[]);
        assert_eq!(reply.error, 0, "read at {offset}: {}", reply.error_message);
        assert_eq!(reply.data.len() as u64, length);
        reply.data
    }

    /// FLUSH, which must succeed.
    pub fn flush(&mut self) {
        let error = self.flush_errno();
        assert_eq!(error, 0, "flush");
    }

    /// FLUSH; returns the NBD error value.
    pub fn flush_errno(&mut self) -> u32 {
        self.request(CMD_FLUSH, 0, 0, 0, &[]).error
    }

    /// NBD_CMD_DISC; the server must then close the connection.
    pub fn disconnect(mut self) {
        self.send_request(CMD_DISC, 0, 0, 0, &[]);
        assert!(self.is_closed(), "server did not close after DISC");
    }
}

/// Adds one chunk's contents to its pending reply, checking it fits the request.
fn apply_chunk(pending: &mut Pending, chunk_type: u16, payload: &[u8]) {
    let completed = &mut pending.partial;
    completed.chunk_types.push(chunk_type);
    match chunk_type {
        CHUNK_NONE => assert!(payload.is_empty(), "NONE chunk with a payload"),
        CHUNK_OFFSET_DATA => {
            assert_eq!(pending.command, CMD_READ, "OFFSET_DATA for a non-READ");
            let offset = be64(payload);
            let data = &payload[8..];
            assert!(offset >= pending.offset, "data before the request");
            assert!(
                offset + data.len() as u64 <= pending.offset + pending.length,
                "data beyond the request"
            );
            if completed.data.is_empty() {
                completed.data = vec![0u8; pending.length as usize];
            }
            let at = (offset - pending.offset) as usize;
            completed.data[at..at + data.len()].copy_from_slice(data);
        }
        CHUNK_OFFSET_HOLE => {
            assert_eq!(pending.command, CMD_READ, "OFFSET_HOLE for a non-READ");
            if completed.data.is_empty() {
                completed.data = vec![0u8; pending.length as usize];
            }
        }
        CHUNK_BLOCK_STATUS => {
            assert_eq!(pending.command, CMD_BLOCK_STATUS);
            assert_eq!((payload.len() - 4) % 8, 0, "block status payload");
            let id = be32(payload);
            let extents = payload[4..]
                .chunks(8)
                .map(|pair| (u64::from(be32(pair)), u64::from(be32(&pair[4..]))))
                .collect();
            completed.block_status.push((id, extents));
        }
        CHUNK_BLOCK_STATUS_EXT => {
            assert_eq!(pending.command, CMD_BLOCK_STATUS);
            let id = be32(payload);
            let count = be32(&payload[4..]) as usize;
            assert_eq!(
                payload.len(),
                8 + 16 * count,
                "extended block status payload"
            );
            let extents = payload[8..]
                .chunks(16)
                .map(|pair| (be64(pair), be64(&pair[8..])))
                .collect();
            completed.block_status.push((id, extents));
        }
        CHUNK_ERROR | CHUNK_ERROR_OFFSET => {
            completed.error = be32(payload);
            let message_length = be16(&payload[4..]) as usize;
            completed.error_message = String::from_utf8(payload[6..6 + message_length].to_vec())
                .expect("error message is UTF-8");
        }
        other => panic!("unknown chunk type {other}"),
    }
}

#[cfg(test)]
mod tests;
