//! The handshake phase on the wire: greeting, client flags, option requests and replies,
//! INFO items and metadata-context requests.

use super::*;

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
