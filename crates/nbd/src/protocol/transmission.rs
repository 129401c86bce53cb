//! The transmission phase on the wire: request headers (compact and extended), simple
//! replies, structured and extended reply chunks, and their payloads.

use super::*;

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
