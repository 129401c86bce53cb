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
//! This file holds the constants and the bounds-checked reader; `negotiation.rs` the
//! handshake's structures, `transmission.rs` requests and reply chunks.
//!
//! NBD is big-endian on the wire by specification, so this module (and only this module in
//! the crate) converts integers with `to_be_bytes`/`from_be_bytes`; the workspace lint against
//! big-endian conversions guards on-disk formats, which are little-endian.
#![allow(clippy::big_endian_bytes)]

use crate::error::{Error, ErrorKind, Result};

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

/// Maps an error to the NBD error value sent in a reply, by its kind. The only such mapping
/// in the crate (`error` knows nothing of the wire; this module depends on it, not back).
pub fn nbd_error_code(error: &Error) -> u32 {
    match error.kind() {
        ErrorKind::Io => errno::EIO,
        ErrorKind::NoSpace => errno::ENOSPC,
        ErrorKind::InvalidArgument => errno::EINVAL,
        ErrorKind::PermissionDenied => errno::EPERM,
        ErrorKind::Overflow => errno::EOVERFLOW,
        ErrorKind::NotSupported => errno::ENOTSUP,
        ErrorKind::OutOfMemory => errno::ENOMEM,
        ErrorKind::Shutdown => errno::ESHUTDOWN,
    }
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

mod negotiation;
mod transmission;

pub use negotiation::{
    encode_export_name_reply, encode_greeting, encode_info_block_size, encode_info_export,
    encode_info_string, encode_meta_context_reply, encode_option_reply, encode_server_reply,
    parse_client_flags, ClientFlags, ExportRequest, MetaContextRequest, OptionHeader,
};
pub use transmission::{
    encode_block_status, encode_error_payload, encode_offset, encode_simple_reply, ChunkHeader,
    ChunkHeaderBytes, Descriptor, HeaderStyle, Request,
};

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

#[cfg(test)]
mod error_code_tests;
