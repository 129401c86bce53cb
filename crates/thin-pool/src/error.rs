//! The thin-pool crate's one error type. Variants carry the volume, block and numbers
//! involved; out of data space and out of metadata space are separate because the pool
//! reacts to them differently.

use crate::ids::{TransactionId, VolumeId};
use std::io;

/// Result with the crate's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong in the pool.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Metadata could not be read, written or understood.
    #[error("metadata: {0}")]
    Metadata(#[source] persistent_data::Error),
    /// The metadata file or data device failed outside persistent-data.
    #[error("{what}: {source}")]
    Io {
        /// What was being done, with the path.
        what: String,
        /// The device's error.
        #[source]
        source: io::Error,
    },
    /// A volume id is already in use.
    #[error("volume {0} already exists")]
    VolumeExists(VolumeId),
    /// No volume has this id.
    #[error("volume {0} does not exist")]
    VolumeNotFound(VolumeId),
    /// A volume id beyond what dm-thin accepts.
    #[error("volume id {0} is out of range (0..=16777215)")]
    BadVolumeId(u64),
    /// `set_transaction_id` with a wrong current id.
    #[error("transaction id is {actual}, not {expected}")]
    TransactionMismatch {
        /// What the caller thought it was.
        expected: TransactionId,
        /// What it is.
        actual: TransactionId,
    },
    /// A metadata snapshot is already held.
    #[error("a metadata snapshot is already held (block {0})")]
    MetadataSnapExists(u64),
    /// No metadata snapshot is held.
    #[error("no metadata snapshot is held")]
    NoMetadataSnap,
    /// The pool is read-only (by option, or after a metadata error).
    #[error("pool is read-only{}", if *.needs_check { " and needs a check" } else { "" })]
    ReadOnly {
        /// Whether the metadata is marked as needing a check.
        needs_check: bool,
    },
    /// No free data block.
    #[error("out of data space ({block_count} data blocks, all in use)")]
    OutOfDataSpace {
        /// Data blocks in the pool.
        block_count: u64,
    },
    /// No free metadata block.
    #[error("out of metadata space ({block_count} metadata blocks, all in use)")]
    OutOfMetadataSpace {
        /// Metadata blocks in the pool.
        block_count: u64,
    },
    /// Another process holds the pool.
    #[error("{path} is in use by another process")]
    Locked {
        /// The metadata path.
        path: String,
    },
    /// No volume has this name.
    #[error("no volume named {0:?}")]
    NoSuchVolume(String),
    /// A volume with this name exists.
    #[error("a volume named {0:?} exists")]
    NameExists(String),
    /// The object is in use (an open volume cannot be deleted).
    #[error("{0}")]
    Busy(String),
    /// Refused: a request that can never succeed (bad size, name, range, ...). Nothing
    /// was changed.
    #[error("{0}")]
    Invalid(String),
    /// What is on disk breaks a format rule (even with a valid checksum): the pool goes
    /// read-only with needs_check.
    #[error("corrupt metadata: {0}")]
    Corrupt(String),
    /// A broken internal invariant: a bug in thinpool, not the caller's fault.
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<persistent_data::Error> for Error {
    fn from(e: persistent_data::Error) -> Error {
        match e {
            persistent_data::Error::OutOfDataSpace { block_count } => {
                Error::OutOfDataSpace { block_count }
            }
            persistent_data::Error::OutOfMetadataSpace { block_count } => {
                Error::OutOfMetadataSpace { block_count }
            }
            other => Error::Metadata(other),
        }
    }
}

impl Error {
    /// The errno a kernel would give for this error (for NBD replies and messages).
    pub fn errno(&self) -> i32 {
        match self {
            Error::Metadata(_) | Error::Io { .. } => libc_errno::EIO,
            Error::VolumeExists(_) | Error::NameExists(_) => libc_errno::EEXIST,
            Error::VolumeNotFound(_) => libc_errno::ENODATA,
            Error::NoSuchVolume(_) => libc_errno::ENOENT,
            Error::BadVolumeId(_)
            | Error::TransactionMismatch { .. }
            | Error::NoMetadataSnap
            | Error::Invalid(_) => libc_errno::EINVAL,
            Error::Corrupt(_) | Error::Internal(_) => libc_errno::EIO,
            Error::MetadataSnapExists(_) | Error::Locked { .. } | Error::Busy(_) => {
                libc_errno::EBUSY
            }
            // dm-thin fails I/O with EIO in read-only mode after a metadata error; a pool or
            // volume read-only by choice refuses writes with EROFS.
            Error::ReadOnly { needs_check: true } => libc_errno::EIO,
            Error::ReadOnly { needs_check: false } => libc_errno::EROFS,
            Error::OutOfDataSpace { .. } | Error::OutOfMetadataSpace { .. } => libc_errno::ENOSPC,
        }
    }
}

/// The errno values used (Linux numbering).
pub mod libc_errno {
    /// I/O error.
    pub const EIO: i32 = 5;
    /// Device or resource busy.
    pub const EBUSY: i32 = 16;
    /// Exists.
    pub const EEXIST: i32 = 17;
    /// Invalid argument.
    pub const EINVAL: i32 = 22;
    /// No space left.
    pub const ENOSPC: i32 = 28;
    /// Read-only.
    pub const EROFS: i32 = 30;
    /// No such file or directory.
    pub const ENOENT: i32 = 2;
    /// No data available.
    pub const ENODATA: i32 = 61;
}
