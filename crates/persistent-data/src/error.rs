//! The crate's one error type. Three kinds of failure are kept apart: operating errors (I/O,
//! out of space), corruption (disk contents breaking a format rule: always names the block
//! and the rule) and programmer errors (assertions, not errors).

use crate::block::MetadataBlock;
use crate::checksum::BlockKind;
use std::io;

/// Result with the crate's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in persistent-data.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The metadata device failed.
    #[error("metadata i/o error: {operation} of block {block}")]
    Io {
        /// `read`, `write` or `flush`.
        operation: &'static str,
        /// The block involved (0 for a flush).
        block: MetadataBlock,
        /// What the device said.
        #[source]
        source: io::Error,
    },
    /// A block's checksum does not match its expected kind.
    #[error(
        "block {block}: bad {kind} checksum (stored {stored:#010x}, computed {computed:#010x})"
    )]
    Checksum {
        /// The block read.
        block: MetadataBlock,
        /// The kind expected there.
        kind: BlockKind,
        /// Checksum found in the block.
        stored: u32,
        /// Checksum the contents give.
        computed: u32,
    },
    /// A block's contents break a format rule.
    #[error("block {block}: {rule}")]
    Corrupt {
        /// The broken block.
        block: MetadataBlock,
        /// The broken rule, with the numbers involved.
        rule: String,
    },
    /// No free metadata block is left.
    #[error("out of metadata space ({block_count} blocks, all in use)")]
    OutOfMetadataSpace {
        /// Size of the metadata space map.
        block_count: u64,
    },
    /// No free data block is left.
    #[error("out of data space ({block_count} blocks, all in use)")]
    OutOfDataSpace {
        /// Size of the data space map.
        block_count: u64,
    },
    /// A request that can never succeed (e.g. a reference count below zero).
    #[error("invalid operation: {0}")]
    Invalid(String),
}

impl Error {
    /// A corruption error for `block` breaking `rule`.
    pub fn corrupt(block: MetadataBlock, rule: impl Into<String>) -> Error {
        Error::Corrupt {
            block,
            rule: rule.into(),
        }
    }

    /// Whether this error means the on-disk contents are damaged (as opposed to an I/O error
    /// or running out of space).
    pub fn is_corruption(&self) -> bool {
        self.kind() == ErrorKind::Corrupt
    }

    /// Which kind of failure this is; callers above decide from it how to react (a corrupt
    /// block makes a pool read-only with needs_check, an I/O error keeps the device's errno).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Io { .. } => ErrorKind::Io,
            Error::Checksum { .. } | Error::Corrupt { .. } => ErrorKind::Corrupt,
            Error::OutOfMetadataSpace { .. } | Error::OutOfDataSpace { .. } => ErrorKind::NoSpace,
            Error::Invalid(_) => ErrorKind::Invalid,
        }
    }
}

/// The kinds of [`Error`], one per way a caller must react.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The metadata device failed; the `io::Error` is the error's source.
    Io,
    /// What is on disk breaks a format rule or a checksum.
    Corrupt,
    /// No free block is left (metadata or data).
    NoSpace,
    /// The caller asked for something that can never succeed: a bug in the caller, or bad
    /// input it passed on unchecked.
    Invalid,
}
