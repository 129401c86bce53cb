//! Resume tokens: what a receiver kept of a stream, as text a user copies from
//! `thinpool receive` (or `receive --list-partial`) to `thinpool send --resume`.
//!
//! ```text
//! 1-<stream id, 32 hex>-<base id, 32 hex, or "full">-<offset, decimal>-<crc, 8 hex>
//! ```
//!
//! The CRC-32C (of the text before it) catches a token mistyped or cut short.

use crate::engine::catalog::PartialReceive;
use crate::error::{Error, Result};
use std::fmt;
use std::str::FromStr;

/// What a receiver kept of a stream: where a resumed stream starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResumeToken {
    /// The stream's id (the sent snapshot's content id).
    pub stream_id: uuid::Uuid,
    /// For an incremental: the base's content id.
    pub base_id: Option<uuid::Uuid>,
    /// Every byte of the volume before this one was received and kept.
    pub offset: u64,
}

impl ResumeToken {
    /// The token of a kept partial receive.
    pub fn of(partial: &PartialReceive) -> Result<ResumeToken> {
        let id = |text: &str| {
            uuid::Uuid::parse_str(text).map_err(|_| {
                Error::Internal(format!(
                    "partial receive {:?} names content id {text:?}, not a uuid",
                    partial.name
                ))
            })
        };
        Ok(ResumeToken {
            stream_id: id(&partial.content_id)?,
            base_id: partial.base_content_id.as_deref().map(id).transpose()?,
            offset: partial.offset,
        })
    }

    fn body(&self) -> String {
        let base = match self.base_id {
            Some(base) => base.simple().to_string(),
            None => "full".to_string(),
        };
        format!("1-{}-{base}-{}", self.stream_id.simple(), self.offset)
    }
}

impl fmt::Display for ResumeToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let body = self.body();
        write!(f, "{body}-{:08x}", crc32c::crc32c(body.as_bytes()))
    }
}

impl FromStr for ResumeToken {
    type Err = Error;

    fn from_str(text: &str) -> Result<ResumeToken> {
        let bad = |why: &str| Error::BadStream(format!("resume token {text:?}: {why}"));
        let parts: Vec<&str> = text.trim().split('-').collect();
        let [version, stream, base, offset, crc] = parts[..] else {
            return Err(bad("not a thinpool resume token (five parts joined by -)"));
        };
        if version != "1" {
            return Err(bad("an unknown token version"));
        }
        let uuid = |t: &str| {
            (t.len() == 32)
                .then(|| uuid::Uuid::parse_str(t).ok())
                .flatten()
                .ok_or_else(|| bad("a stream id is not 32 hex digits"))
        };
        let token = ResumeToken {
            stream_id: uuid(stream)?,
            base_id: match base {
                "full" => None,
                base => Some(uuid(base)?),
            },
            offset: offset
                .parse()
                .map_err(|_| bad("the offset is not a number"))?,
        };
        let expected = format!("{:08x}", crc32c::crc32c(token.body().as_bytes()));
        if crc != expected {
            return Err(bad("its checksum does not match (mistyped or cut short?)"));
        }
        Ok(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_a_changed_character_is_refused() {
        let token = ResumeToken {
            stream_id: uuid::Uuid::new_v4(),
            base_id: Some(uuid::Uuid::new_v4()),
            offset: 123 << 20,
        };
        let text = token.to_string();
        assert_eq!(text.parse::<ResumeToken>().unwrap(), token);
        let full = ResumeToken {
            base_id: None,
            ..token
        };
        assert_eq!(full.to_string().parse::<ResumeToken>().unwrap(), full);
        // One digit of the offset changed: the checksum no longer matches.
        let changed = text.replacen(&format!("-{}-", 123u64 << 20), "-128974849-", 1);
        assert_ne!(changed, text);
        assert!(changed.parse::<ResumeToken>().is_err());
        assert!("1-xyz".parse::<ResumeToken>().is_err());
        assert!(text[..text.len() - 1].parse::<ResumeToken>().is_err());
    }
}
