//! The client's own copy of the wire constants (deliberately not the `nbd` crate's) and the
//! encoders for options and request headers, which tests also use to send malformed bytes.

use super::Mode;

/// Greeting magic ("NBDMAGIC").
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// Option magic ("IHAVEOPT").
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a compact (28-byte) request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of an extended (32-byte) request.
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// Magic of an extended reply chunk.
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

/// Client flags: FIXED_NEWSTYLE | NO_ZEROES.
pub const CLIENT_FLAGS: u32 = 3;

pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;
pub const OPT_EXTENDED_HEADERS: u32 = 11;

pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
/// Option reply types with this bit set are errors.
pub const REP_ERROR_BIT: u32 = 0x8000_0000;
pub const REP_ERR_UNSUP: u32 = 0x8000_0001;
pub const REP_ERR_INVALID: u32 = 0x8000_0003;
pub const REP_ERR_UNKNOWN: u32 = 0x8000_0006;
pub const REP_ERR_SHUTDOWN: u32 = 0x8000_0007;
pub const REP_ERR_TOO_BIG: u32 = 0x8000_0009;
pub const REP_ERR_EXT_HEADER_REQD: u32 = 0x8000_000a;

pub const INFO_EXPORT: u16 = 0;
pub const INFO_BLOCK_SIZE: u16 = 3;

pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

pub const FLAG_FUA: u16 = 1;
pub const FLAG_NO_HOLE: u16 = 2;
pub const FLAG_DF: u16 = 4;
pub const FLAG_REQ_ONE: u16 = 8;
pub const FLAG_FAST_ZERO: u16 = 16;
pub const FLAG_PAYLOAD_LEN: u16 = 32;

pub const TF_HAS_FLAGS: u16 = 1;
pub const TF_READ_ONLY: u16 = 2;
pub const TF_SEND_FLUSH: u16 = 4;
pub const TF_SEND_FUA: u16 = 8;
pub const TF_SEND_TRIM: u16 = 32;
pub const TF_SEND_WRITE_ZEROES: u16 = 64;
pub const TF_SEND_DF: u16 = 128;
pub const TF_CAN_MULTI_CONN: u16 = 256;
pub const TF_SEND_CACHE: u16 = 1024;
pub const TF_SEND_FAST_ZERO: u16 = 2048;

pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;

/// Chunk flag: the last chunk of a reply.
pub const CHUNK_FLAG_DONE: u16 = 1;
pub const CHUNK_NONE: u16 = 0;
pub const CHUNK_OFFSET_DATA: u16 = 1;
pub const CHUNK_OFFSET_HOLE: u16 = 2;
pub const CHUNK_BLOCK_STATUS: u16 = 5;
pub const CHUNK_BLOCK_STATUS_EXT: u16 = 6;
pub const CHUNK_ERROR: u16 = 0x8001;
pub const CHUNK_ERROR_OFFSET: u16 = 0x8002;

/// The first two bytes of `bytes`, big-endian.
pub fn be16(bytes: &[u8]) -> u16 {
    u16::from_be_bytes(bytes[..2].try_into().expect("2 bytes"))
}
/// The first four bytes of `bytes`, big-endian.
pub fn be32(bytes: &[u8]) -> u32 {
    u32::from_be_bytes(bytes[..4].try_into().expect("4 bytes"))
}
/// The first eight bytes of `bytes`, big-endian.
pub fn be64(bytes: &[u8]) -> u64 {
    u64::from_be_bytes(bytes[..8].try_into().expect("8 bytes"))
}

/// An option header: IHAVEOPT, code, and a data length that may lie.
pub fn option_header(code: u32, length: u32) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(16);
    bytes.extend_from_slice(&IHAVEOPT.to_be_bytes());
    bytes.extend_from_slice(&code.to_be_bytes());
    bytes.extend_from_slice(&length.to_be_bytes());
    bytes
}

/// An option on the wire: its header and its data.
pub fn option_bytes(code: u32, data: &[u8]) -> Vec<u8> {
    let mut bytes = option_header(code, data.len() as u32);
    bytes.extend_from_slice(data);
    bytes
}

/// GO/INFO option data: the export name and the information requests.
pub fn export_request(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut data = Vec::new();
    data.extend_from_slice(&(name.len() as u32).to_be_bytes());
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for info in infos {
        data.extend_from_slice(&info.to_be_bytes());
    }
    data
}

/// LIST/SET_META_CONTEXT option data.
pub fn meta_request(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut data = Vec::new();
    data.extend_from_slice(&(name.len() as u32).to_be_bytes());
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for query in queries {
        data.extend_from_slice(&(query.len() as u32).to_be_bytes());
        data.extend_from_slice(query.as_bytes());
    }
    data
}

/// A request header in `mode`'s framing (compact for simple and structured replies,
/// extended for extended headers). A compact header keeps the low 32 bits of `length`.
pub fn request_header(
    mode: Mode,
    command: u16,
    flags: u16,
    cookie: u64,
    offset: u64,
    length: u64,
) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(32);
    let magic = if mode == Mode::Extended {
        EXTENDED_REQUEST_MAGIC
    } else {
        REQUEST_MAGIC
    };
    bytes.extend_from_slice(&magic.to_be_bytes());
    bytes.extend_from_slice(&flags.to_be_bytes());
    bytes.extend_from_slice(&command.to_be_bytes());
    bytes.extend_from_slice(&cookie.to_be_bytes());
    bytes.extend_from_slice(&offset.to_be_bytes());
    if mode == Mode::Extended {
        bytes.extend_from_slice(&length.to_be_bytes());
    } else {
        bytes.extend_from_slice(&(length as u32).to_be_bytes());
    }
    bytes
}
