//! Pure parse and encode of every NBD wire structure; no I/O happens here.
//!
//! Owns the protocol constants and the byte layout of the greeting, option requests and
//! replies, INFO items, metadata-context requests, transmission requests (compact and
//! extended), simple replies, structured and extended reply chunks, and block-status and
//! error payloads. Invariants: every parser checks each length field against the bytes it
//! was given before using it, never allocates by a count the peer chose, and bounds strings at
//! [`STRING_LENGTH_MAX`]; a parser returns an [`Error`] for malformed input and never panics.
//! Encoders assert their own preconditions (a compact header cannot carry a 64-bit length).
//!
//! NBD is big-endian on the wire by specification, so this module (and only this module in
//! the crate) converts integers with `to_be_bytes`/`from_be_bytes`; the workspace lint against
//! big-endian conversions guards on-disk formats, which are little-endian.
#![allow(clippy::big_endian_bytes)]

use crate::error::{Error, Result};

/// "NBDMAGIC", first 8 bytes of the greeting.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": second magic of the greeting and the magic of every option request.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a compact (28-byte) transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of an extended (32-byte) transmission request.
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// Magic of an extended reply chunk.
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

/// Longest string (export name, context name, message) accepted or sent, in bytes.
pub const STRING_LENGTH_MAX: usize = 4096;
/// Longest option data accepted; larger options close the connection.
pub const OPTION_DATA_LENGTH_MAX: u32 = 64 * 1024;
/// Largest READ or WRITE payload served, in bytes (advertised as the maximum block size).
pub const PAYLOAD_LENGTH_MAX: u32 = 32 * 1024 * 1024;
/// Minimum block size advertised and enforced: offsets and lengths are multiples of it.
pub const BLOCK_SIZE_MIN: u32 = 512;
/// Preferred block size advertised.
pub const BLOCK_SIZE_PREFERRED: u32 = 4096;
/// The only metadata context this server offers.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Most descriptors the server puts in one block-status chunk (the protocol allows 2^20).
pub const EXTENTS_PER_REPLY_MAX: usize = 16 * 1024;

/// Size of the greeting the server sends first.
pub const GREETING_SIZE: usize = 18;
/// Size of an option request header.
pub const OPTION_HEADER_SIZE: usize = 16;
/// Size of an option reply header.
pub const OPTION_REPLY_HEADER_SIZE: usize = 20;
/// Size of a compact request header.
pub const COMPACT_REQUEST_SIZE: usize = 28;
/// Size of an extended request header.
pub const EXTENDED_REQUEST_SIZE: usize = 32;
/// Size of a simple reply header.
pub const SIMPLE_REPLY_SIZE: usize = 16;
/// Size of a structured reply chunk header.
pub const STRUCTURED_CHUNK_HEADER_SIZE: usize = 20;
/// Size of an extended reply chunk header.
pub const EXTENDED_CHUNK_HEADER_SIZE: usize = 32;

/// Handshake flags sent in the greeting.
pub mod handshake_flags {
    /// The server speaks fixed newstyle.
    pub const FIXED_NEWSTYLE: u16 = 1 << 0;
    /// The server can omit the 124 zero bytes after an EXPORT_NAME reply.
    pub const NO_ZEROES: u16 = 1 << 1;
}

/// Client flags sent after the greeting.
pub mod client_flags {
    /// The client speaks fixed newstyle.
    pub const FIXED_NEWSTYLE: u32 = 1 << 0;
    /// The client wants no zero padding after an EXPORT_NAME reply.
    pub const NO_ZEROES: u32 = 1 << 1;
}

/// Option codes.
pub mod option {
    #![allow(missing_docs)]
    pub const EXPORT_NAME: u32 = 1;
    pub const ABORT: u32 = 2;
    pub const LIST: u32 = 3;
    pub const PEEK_EXPORT: u32 = 4;
    pub const STARTTLS: u32 = 5;
    pub const INFO: u32 = 6;
    pub const GO: u32 = 7;
    pub const STRUCTURED_REPLY: u32 = 8;
    pub const LIST_META_CONTEXT: u32 = 9;
    pub const SET_META_CONTEXT: u32 = 10;
    pub const EXTENDED_HEADERS: u32 = 11;
}

/// Option reply types; errors have bit 31 set.
pub mod reply {
    #![allow(missing_docs)]
    pub const ACK: u32 = 1;
    pub const SERVER: u32 = 2;
    pub const INFO: u32 = 3;
    pub const META_CONTEXT: u32 = 4;
    pub const ERR_UNSUP: u32 = 0x8000_0001;
    pub const ERR_POLICY: u32 = 0x8000_0002;
    pub const ERR_INVALID: u32 = 0x8000_0003;
    pub const ERR_PLATFORM: u32 = 0x8000_0004;
    pub const ERR_TLS_REQD: u32 = 0x8000_0005;
    pub const ERR_UNKNOWN: u32 = 0x8000_0006;
    pub const ERR_SHUTDOWN: u32 = 0x8000_0007;
    pub const ERR_BLOCK_SIZE_REQD: u32 = 0x8000_0008;
    pub const ERR_TOO_BIG: u32 = 0x8000_0009;
    pub const ERR_EXT_HEADER_REQD: u32 = 0x8000_000a;
}

/// Information item types in INFO/GO.
pub mod info {
    #![allow(missing_docs)]
    pub const EXPORT: u16 = 0;
    pub const NAME: u16 = 1;
    pub const DESCRIPTION: u16 = 2;
    pub const BLOCK_SIZE: u16 = 3;
}

/// Transmission flags.
pub mod transmission_flags {
    #![allow(missing_docs)]
    pub const HAS_FLAGS: u16 = 1 << 0;
    pub const READ_ONLY: u16 = 1 << 1;
    pub const SEND_FLUSH: u16 = 1 << 2;
    pub const SEND_FUA: u16 = 1 << 3;
    pub const ROTATIONAL: u16 = 1 << 4;
    pub const SEND_TRIM: u16 = 1 << 5;
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    pub const SEND_DF: u16 = 1 << 7;
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    pub const SEND_RESIZE: u16 = 1 << 9;
    pub const SEND_CACHE: u16 = 1 << 10;
    pub const SEND_FAST_ZERO: u16 = 1 << 11;
    pub const BLOCK_STATUS_PAYLOAD: u16 = 1 << 12;
}

/// Command types.
pub mod command {
    #![allow(missing_docs)]
    pub const READ: u16 = 0;
    pub const WRITE: u16 = 1;
    pub const DISC: u16 = 2;
    pub const FLUSH: u16 = 3;
    pub const TRIM: u16 = 4;
    pub const CACHE: u16 = 5;
    pub const WRITE_ZEROES: u16 = 6;
    pub const BLOCK_STATUS: u16 = 7;
}

/// Command flags.
pub mod command_flags {
    #![allow(missing_docs)]
    pub const FUA: u16 = 1 << 0;
    pub const NO_HOLE: u16 = 1 << 1;
    pub const DF: u16 = 1 << 2;
    pub const REQ_ONE: u16 = 1 << 3;
    pub const FAST_ZERO: u16 = 1 << 4;
    pub const PAYLOAD_LEN: u16 = 1 << 5;
}

/// Reply chunk flag: this is the last chunk of the reply.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;

/// Structured reply chunk types.
pub mod chunk {
    #![allow(missing_docs)]
    pub const NONE: u16 = 0;
    pub const OFFSET_DATA: u16 = 1;
    pub const OFFSET_HOLE: u16 = 2;
    pub const BLOCK_STATUS: u16 = 5;
    pub const BLOCK_STATUS_EXT: u16 = 6;
    pub const ERROR: u16 = 0x8001;
    pub const ERROR_OFFSET: u16 = 0x8002;
}

/// `base:allocation` extent flags.
pub mod state {
    /// Not allocated.
    pub const HOLE: u32 = 1 << 0;
    /// Reads as zeroes.
    pub const ZERO: u32 = 1 << 1;
}

/// NBD error values carried in replies.
pub mod errno {
    #![allow(missing_docs)]
    pub const EPERM: u32 = 1;
    pub const EIO: u32 = 5;
    pub const ENOMEM: u32 = 12;
    pub const EINVAL: u32 = 22;
    pub const ENOSPC: u32 = 28;
    pub const EOVERFLOW: u32 = 75;
    pub const ENOTSUP: u32 = 95;
    pub const ESHUTDOWN: u32 = 108;
}

/// Bounds-checked big-endian reader over a byte slice.
struct Cursor<'a> {
    bytes: &'a [u8],
    what: &'static str,
}

impl<'a> Cursor<'a> {
    fn new(bytes: &'a [u8], what: &'static str) -> Self {
        Cursor { bytes, what }
    }

    fn take(&mut self, length: usize) -> Result<&'a [u8]> {
        if length > self.bytes.len() {
            return Err(Error::protocol(format!(
                "{} truncated: need {length} more bytes, have {}",
                self.what,
                self.bytes.len()
            )));
        }
        let (head, tail) = self.bytes.split_at(length);
        self.bytes = tail;
        Ok(head)
    }

    fn u16(&mut self) -> Result<u16> {
        let mut array = [0u8; 2];
        array.copy_from_slice(self.take(2)?);
        Ok(u16::from_be_bytes(array))
    }

    fn u32(&mut self) -> Result<u32> {
        let mut array = [0u8; 4];
        array.copy_from_slice(self.take(4)?);
        Ok(u32::from_be_bytes(array))
    }

    fn u64(&mut self) -> Result<u64> {
        let mut array = [0u8; 8];
        array.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(array))
    }

    /// A string whose 4-byte length prefix has just been read as `length`.
    fn string(&mut self, length: u32) -> Result<String> {
        let length = usize::try_from(length).unwrap_or(usize::MAX);
        if length > STRING_LENGTH_MAX {
            return Err(Error::TooLong {
                what: "string",
                length: length as u64,
                maximum: STRING_LENGTH_MAX as u64,
            });
        }
        parse_string(self.take(length)?)
    }

    fn remaining(&self) -> usize {
        self.bytes.len()
    }

    fn finish(&self) -> Result<()> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(Error::protocol(format!(
                "{} has {} trailing bytes",
                self.what,
                self.bytes.len()
            )))
        }
    }
}

/// Validates a protocol string: at most [`STRING_LENGTH_MAX`] bytes of UTF-8 with no NUL.
pub fn parse_string(bytes: &[u8]) -> Result<String> {
    if bytes.len() > STRING_LENGTH_MAX {
        return Err(Error::TooLong {
            what: "string",
            length: bytes.len() as u64,
            maximum: STRING_LENGTH_MAX as u64,
        });
    }
    if bytes.contains(&0) {
        return Err(Error::protocol("string contains a NUL byte"));
    }
    String::from_utf8(bytes.to_vec()).map_err(|_| Error::protocol("string is not valid UTF-8"))
}

/// The 18-byte greeting: NBDMAGIC, IHAVEOPT, FIXED_NEWSTYLE | NO_ZEROES.
pub fn encode_greeting() -> [u8; GREETING_SIZE] {
    let mut out = [0u8; GREETING_SIZE];
    out[0..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    out[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    let flags = handshake_flags::FIXED_NEWSTYLE | handshake_flags::NO_ZEROES;
    out[16..18].copy_from_slice(&flags.to_be_bytes());
    out
}

/// What the client's 4-byte flags field agreed to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientFlags {
    /// The client speaks fixed newstyle.
    pub fixed_newstyle: bool,
    /// No zero padding after an EXPORT_NAME reply.
    pub no_zeroes: bool,
}

/// Parses the client flags; any bit we did not advertise is a protocol violation.
pub fn parse_client_flags(bytes: [u8; 4]) -> Result<ClientFlags> {
    let flags = u32::from_be_bytes(bytes);
    let known = client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES;
    if flags & !known != 0 {
        return Err(Error::protocol(format!("unknown client flags {flags:#x}")));
    }
    Ok(ClientFlags {
        fixed_newstyle: flags & client_flags::FIXED_NEWSTYLE != 0,
        no_zeroes: flags & client_flags::NO_ZEROES != 0,
    })
}

/// Header of an option request; `length` bytes of option data follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OptionHeader {
    /// Option code.
    pub code: u32,
    /// Length of the option data.
    pub length: u32,
}

impl OptionHeader {
    /// Parses a header, checking the IHAVEOPT magic.
    pub fn parse(bytes: &[u8; OPTION_HEADER_SIZE]) -> Result<Self> {
        let mut cursor = Cursor::new(bytes, "option header");
        let magic = cursor.u64()?;
        if magic != IHAVEOPT {
            return Err(Error::BadMagic {
                what: "option",
                expected: IHAVEOPT,
                actual: magic,
            });
        }
        Ok(OptionHeader {
            code: cursor.u32()?,
            length: cursor.u32()?,
        })
    }

    /// Encodes the header (used by clients and tests).
    pub fn encode(&self) -> [u8; OPTION_HEADER_SIZE] {
        let mut out = [0u8; OPTION_HEADER_SIZE];
        out[0..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
        out[8..12].copy_from_slice(&self.code.to_be_bytes());
        out[12..16].copy_from_slice(&self.length.to_be_bytes());
        out
    }
}

/// Encodes a whole option reply: header plus `data`.
pub fn encode_option_reply(option: u32, reply_type: u32, data: &[u8]) -> Vec<u8> {
    let length = u32::try_from(data.len()).expect("option reply data fits in u32");
    let mut out = Vec::with_capacity(OPTION_REPLY_HEADER_SIZE + data.len());
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    out.extend_from_slice(&length.to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// An NBD_OPT_INFO or NBD_OPT_GO request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportRequest {
    /// Export name; empty means the default export.
    pub name: String,
    /// Information types the client asked for.
    pub info_requests: Vec<u16>,
}

impl ExportRequest {
    /// Parses the option data of INFO or GO.
    pub fn parse(data: &[u8]) -> Result<Self> {
        let mut cursor = Cursor::new(data, "info request");
        let name_length = cursor.u32()?;
        let name = cursor.string(name_length)?;
        let count = cursor.u16()?;
        if usize::from(count) * 2 != cursor.remaining() {
            return Err(Error::protocol(format!(
                "info request count {count} does not match {} remaining bytes",
                cursor.remaining()
            )));
        }
        let mut info_requests = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            info_requests.push(cursor.u16()?);
        }
        cursor.finish()?;
        Ok(ExportRequest {
            name,
            info_requests,
        })
    }

    /// Encodes the option data (used by clients and tests).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&(self.name.len() as u32).to_be_bytes());
        out.extend_from_slice(self.name.as_bytes());
        out.extend_from_slice(&(self.info_requests.len() as u16).to_be_bytes());
        for request in &self.info_requests {
            out.extend_from_slice(&request.to_be_bytes());
        }
        out
    }
}

/// An NBD_OPT_LIST_META_CONTEXT or NBD_OPT_SET_META_CONTEXT request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetaContextRequest {
    /// The export the contexts are for.
    pub export_name: String,
    /// Queries such as `base:allocation` or `base:`.
    pub queries: Vec<String>,
}

impl MetaContextRequest {
    /// Parses the option data; the query count is checked against the bytes present.
    pub fn parse(data: &[u8]) -> Result<Self> {
        let mut cursor = Cursor::new(data, "meta context request");
        let name_length = cursor.u32()?;
        let export_name = cursor.string(name_length)?;
        let count = cursor.u32()?;
        // Each query needs at least its 4-byte length, so this bounds the loop by the data.
        if u64::from(count) * 4 > cursor.remaining() as u64 {
            return Err(Error::protocol(format!(
                "meta context query count {count} exceeds the data"
            )));
        }
        let mut queries = Vec::new();
        for _ in 0..count {
            let length = cursor.u32()?;
            queries.push(cursor.string(length)?);
        }
        cursor.finish()?;
        Ok(MetaContextRequest {
            export_name,
            queries,
        })
    }

    /// Encodes the option data (used by clients and tests).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&(self.export_name.len() as u32).to_be_bytes());
        out.extend_from_slice(self.export_name.as_bytes());
        out.extend_from_slice(&(self.queries.len() as u32).to_be_bytes());
        for query in &self.queries {
            out.extend_from_slice(&(query.len() as u32).to_be_bytes());
            out.extend_from_slice(query.as_bytes());
        }
        out
    }
}

/// NBD_INFO_EXPORT item: type, size, transmission flags (12 bytes).
pub fn encode_info_export(size_bytes: u64, flags: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(12);
    out.extend_from_slice(&info::EXPORT.to_be_bytes());
    out.extend_from_slice(&size_bytes.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out
}

/// NBD_INFO_NAME or NBD_INFO_DESCRIPTION item.
pub fn encode_info_string(info_type: u16, text: &str) -> Vec<u8> {
    let text = truncate_str(text, STRING_LENGTH_MAX);
    let mut out = Vec::with_capacity(2 + text.len());
    out.extend_from_slice(&info_type.to_be_bytes());
    out.extend_from_slice(text.as_bytes());
    out
}

/// NBD_INFO_BLOCK_SIZE item (14 bytes).
pub fn encode_info_block_size(minimum: u32, preferred: u32, maximum: u32) -> Vec<u8> {
    assert!(minimum.is_power_of_two(), "minimum block size {minimum}");
    assert!(
        preferred.is_power_of_two(),
        "preferred block size {preferred}"
    );
    assert!(preferred >= minimum);
    assert!(maximum >= preferred);
    let mut out = Vec::with_capacity(14);
    out.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
    out.extend_from_slice(&minimum.to_be_bytes());
    out.extend_from_slice(&preferred.to_be_bytes());
    out.extend_from_slice(&maximum.to_be_bytes());
    out
}

/// NBD_REP_SERVER data: name length, name, description.
pub fn encode_server_reply(name: &str, description: &str) -> Vec<u8> {
    let name = truncate_str(name, STRING_LENGTH_MAX);
    let description = truncate_str(description, STRING_LENGTH_MAX);
    let mut out = Vec::with_capacity(4 + name.len() + description.len());
    out.extend_from_slice(&(name.len() as u32).to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(description.as_bytes());
    out
}

/// NBD_REP_META_CONTEXT data: context id, context name.
pub fn encode_meta_context_reply(context_id: u32, name: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + name.len());
    out.extend_from_slice(&context_id.to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out
}

/// Reply to NBD_OPT_EXPORT_NAME: size, flags, and 124 zero bytes unless NO_ZEROES was agreed.
pub fn encode_export_name_reply(size_bytes: u64, flags: u16, no_zeroes: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(134);
    out.extend_from_slice(&size_bytes.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    if !no_zeroes {
        out.extend_from_slice(&[0u8; 124]);
    }
    out
}

/// Which header format the transmission phase uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderStyle {
    /// 28-byte requests; simple replies or 20-byte structured chunks.
    Compact,
    /// 32-byte requests and 32-byte reply chunks (NBD_OPT_EXTENDED_HEADERS).
    Extended,
}

impl HeaderStyle {
    /// Size of a request header in this style.
    pub fn request_size(self) -> usize {
        match self {
            HeaderStyle::Compact => COMPACT_REQUEST_SIZE,
            HeaderStyle::Extended => EXTENDED_REQUEST_SIZE,
        }
    }
}

/// A transmission request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// Command flags.
    pub flags: u16,
    /// Command type.
    pub command: u16,
    /// Opaque value echoed in the reply.
    pub cookie: u64,
    /// Byte offset.
    pub offset: u64,
    /// Length: effect length, or payload length (WRITE, or PAYLOAD_LEN set).
    pub length: u64,
}

impl Request {
    /// Parses a header of `style`; `bytes` must be exactly the header size.
    pub fn parse(style: HeaderStyle, bytes: &[u8]) -> Result<Self> {
        if bytes.len() != style.request_size() {
            return Err(Error::protocol(format!(
                "request header is {} bytes, expected {}",
                bytes.len(),
                style.request_size()
            )));
        }
        let mut cursor = Cursor::new(bytes, "request header");
        let magic = cursor.u32()?;
        let expected = match style {
            HeaderStyle::Compact => REQUEST_MAGIC,
            HeaderStyle::Extended => EXTENDED_REQUEST_MAGIC,
        };
        if magic != expected {
            return Err(Error::BadMagic {
                what: "request",
                expected: u64::from(expected),
                actual: u64::from(magic),
            });
        }
        let flags = cursor.u16()?;
        let command = cursor.u16()?;
        let cookie = cursor.u64()?;
        let offset = cursor.u64()?;
        let length = match style {
            HeaderStyle::Compact => u64::from(cursor.u32()?),
            HeaderStyle::Extended => cursor.u64()?,
        };
        cursor.finish()?;
        Ok(Request {
            flags,
            command,
            cookie,
            offset,
            length,
        })
    }

    /// Encodes the header (used by clients and tests). Compact style needs `length < 2^32`.
    pub fn encode(&self, style: HeaderStyle) -> Vec<u8> {
        let mut out = Vec::with_capacity(style.request_size());
        match style {
            HeaderStyle::Compact => out.extend_from_slice(&REQUEST_MAGIC.to_be_bytes()),
            HeaderStyle::Extended => out.extend_from_slice(&EXTENDED_REQUEST_MAGIC.to_be_bytes()),
        }
        out.extend_from_slice(&self.flags.to_be_bytes());
        out.extend_from_slice(&self.command.to_be_bytes());
        out.extend_from_slice(&self.cookie.to_be_bytes());
        out.extend_from_slice(&self.offset.to_be_bytes());
        match style {
            HeaderStyle::Compact => {
                let length = u32::try_from(self.length).expect("compact length fits in u32");
                out.extend_from_slice(&length.to_be_bytes());
            }
            HeaderStyle::Extended => out.extend_from_slice(&self.length.to_be_bytes()),
        }
        out
    }
}

/// A simple reply header: magic, error, cookie.
pub fn encode_simple_reply(error: u32, cookie: u64) -> [u8; SIMPLE_REPLY_SIZE] {
    let mut out = [0u8; SIMPLE_REPLY_SIZE];
    out[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out[4..8].copy_from_slice(&error.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out
}

/// A structured or extended reply chunk header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkHeader {
    /// Reply flags ([`REPLY_FLAG_DONE`]).
    pub flags: u16,
    /// Chunk type ([`chunk`]).
    pub chunk_type: u16,
    /// The request's cookie.
    pub cookie: u64,
    /// The request's offset (extended headers only).
    pub offset: u64,
    /// Length of the payload after the header.
    pub payload_length: u64,
}

/// An encoded chunk header; compact headers use the first 20 bytes.
#[derive(Clone, Copy, Debug)]
pub struct ChunkHeaderBytes {
    bytes: [u8; EXTENDED_CHUNK_HEADER_SIZE],
    length: usize,
}

impl ChunkHeaderBytes {
    /// The encoded header.
    pub fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.length]
    }
}

impl ChunkHeader {
    /// Encodes the header in `style`. Compact style needs `payload_length < 2^32`.
    pub fn encode(&self, style: HeaderStyle) -> ChunkHeaderBytes {
        let mut bytes = [0u8; EXTENDED_CHUNK_HEADER_SIZE];
        let magic = match style {
            HeaderStyle::Compact => STRUCTURED_REPLY_MAGIC,
            HeaderStyle::Extended => EXTENDED_REPLY_MAGIC,
        };
        bytes[0..4].copy_from_slice(&magic.to_be_bytes());
        bytes[4..6].copy_from_slice(&self.flags.to_be_bytes());
        bytes[6..8].copy_from_slice(&self.chunk_type.to_be_bytes());
        bytes[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        let length = match style {
            HeaderStyle::Compact => {
                let payload_length =
                    u32::try_from(self.payload_length).expect("compact chunk payload fits in u32");
                bytes[16..20].copy_from_slice(&payload_length.to_be_bytes());
                STRUCTURED_CHUNK_HEADER_SIZE
            }
            HeaderStyle::Extended => {
                bytes[16..24].copy_from_slice(&self.offset.to_be_bytes());
                bytes[24..32].copy_from_slice(&self.payload_length.to_be_bytes());
                EXTENDED_CHUNK_HEADER_SIZE
            }
        };
        ChunkHeaderBytes { bytes, length }
    }
}

/// The 8-byte offset that starts an OFFSET_DATA payload.
pub fn encode_offset(offset: u64) -> [u8; 8] {
    offset.to_be_bytes()
}

/// Payload of an ERROR chunk: error, message length, message (truncated to 4096 bytes).
pub fn encode_error_payload(error: u32, message: &str) -> Vec<u8> {
    let message = truncate_str(message, STRING_LENGTH_MAX);
    let mut out = Vec::with_capacity(6 + message.len());
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&(message.len() as u16).to_be_bytes());
    out.extend_from_slice(message.as_bytes());
    out
}

/// One block-status descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Descriptor {
    /// Length of the extent in bytes, nonzero.
    pub length: u64,
    /// Status flags ([`state`]).
    pub flags: u32,
}

/// Payload of a BLOCK_STATUS (compact) or BLOCK_STATUS_EXT (extended) chunk.
pub fn encode_block_status(
    style: HeaderStyle,
    context_id: u32,
    descriptors: &[Descriptor],
) -> Vec<u8> {
    assert!(!descriptors.is_empty(), "block status needs a descriptor");
    let mut out;
    match style {
        HeaderStyle::Compact => {
            out = Vec::with_capacity(4 + 8 * descriptors.len());
            out.extend_from_slice(&context_id.to_be_bytes());
            for descriptor in descriptors {
                assert!(descriptor.length > 0, "zero-length extent");
                let length =
                    u32::try_from(descriptor.length).expect("compact extent length fits in u32");
                out.extend_from_slice(&length.to_be_bytes());
                out.extend_from_slice(&descriptor.flags.to_be_bytes());
            }
        }
        HeaderStyle::Extended => {
            out = Vec::with_capacity(8 + 16 * descriptors.len());
            out.extend_from_slice(&context_id.to_be_bytes());
            let count = u32::try_from(descriptors.len()).expect("descriptor count fits in u32");
            out.extend_from_slice(&count.to_be_bytes());
            for descriptor in descriptors {
                assert!(descriptor.length > 0, "zero-length extent");
                out.extend_from_slice(&descriptor.length.to_be_bytes());
                out.extend_from_slice(&u64::from(descriptor.flags).to_be_bytes());
            }
        }
    }
    out
}

/// The longest prefix of `text` of at most `maximum` bytes that ends on a char boundary.
fn truncate_str(text: &str, maximum: usize) -> &str {
    if text.len() <= maximum {
        return text;
    }
    let mut end = maximum;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests;
