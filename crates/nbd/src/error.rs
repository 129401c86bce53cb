//! The crate's one error type, and the one place that turns errors into NBD error codes.
//!
//! [`Error`] covers three sources: the socket ([`Error::Io`]), a peer that breaks the
//! protocol ([`Error::Protocol`], [`Error::TooLong`], [`Error::BadMagic`]) and an export that
//! refuses or fails an operation ([`Error::Export`]). Every error has an [`ErrorKind`], an
//! errno-like classification, and [`nbd_error_code`] is the only function that maps a kind to
//! the error value sent on the wire. Invariant: no other code in the crate chooses an NBD error
//! number for an export failure.

use std::io;

/// Errno-like classification of a failure, as the NBD client will see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Device or metadata I/O failed, or the export is in a failed state (`NBD_EIO`).
    Io,
    /// Out of space, or a write past the end of the export (`NBD_ENOSPC`).
    NoSpace,
    /// Bad alignment, range, command, flag or option (`NBD_EINVAL`).
    InvalidArgument,
    /// Write to a read-only export (`NBD_EPERM`).
    PermissionDenied,
    /// Request too large to serve (`NBD_EOVERFLOW`).
    Overflow,
    /// A fast-zero request that cannot be done fast (`NBD_ENOTSUP`).
    NotSupported,
    /// Out of memory (`NBD_ENOMEM`); avoid where possible.
    OutOfMemory,
    /// The server or export is shutting down (`NBD_ESHUTDOWN`).
    Shutdown,
}

/// Errors of the `nbd` crate, including those an [`crate::Export`] reports.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A socket or filesystem operation failed.
    #[error("{context}")]
    Io {
        /// What the server was doing.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// An export operation failed or was refused.
    #[error("{context} ({kind:?})")]
    Export {
        /// How the client should see the failure.
        kind: ErrorKind,
        /// What failed, with the numbers (offset, length, ...).
        context: String,
        /// The underlying error, if any.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// The peer sent something that breaks a protocol rule.
    #[error("protocol violation: {detail}")]
    Protocol {
        /// Which rule, with the offending values.
        detail: String,
    },
    /// A magic number did not match.
    #[error("bad {what} magic: expected {expected:#x}, got {actual:#x}")]
    BadMagic {
        /// Which structure carried the magic.
        what: &'static str,
        /// The magic the protocol requires.
        expected: u64,
        /// The value received.
        actual: u64,
    },
    /// A length field exceeds what the server accepts.
    #[error("{what} length {length} exceeds the maximum {maximum}")]
    TooLong {
        /// Which field.
        what: &'static str,
        /// The length received.
        length: u64,
        /// The largest length accepted.
        maximum: u64,
    },
}

impl Error {
    /// An export error of `kind` without an underlying source.
    pub fn export(kind: ErrorKind, context: impl Into<String>) -> Self {
        Error::Export {
            kind,
            context: context.into(),
            source: None,
        }
    }

    /// An export error of `kind` wrapping `source`.
    pub fn export_with_source(
        kind: ErrorKind,
        context: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Error::Export {
            kind,
            context: context.into(),
            source: Some(Box::new(source)),
        }
    }

    /// A socket or filesystem error with context.
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn protocol(detail: impl Into<String>) -> Self {
        Error::Protocol {
            detail: detail.into(),
        }
    }

    /// The errno-like classification of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Io { source, .. } => kind_of_io_error(source),
            Error::Export { kind, .. } => *kind,
            Error::Protocol { .. } | Error::BadMagic { .. } => ErrorKind::InvalidArgument,
            Error::TooLong { .. } => ErrorKind::Overflow,
        }
    }
}

/// Classifies an OS error by its errno; anything unrecognised counts as an I/O failure.
fn kind_of_io_error(error: &io::Error) -> ErrorKind {
    match error.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => ErrorKind::NoSpace,
        Some(libc::EPERM) | Some(libc::EROFS) | Some(libc::EACCES) => ErrorKind::PermissionDenied,
        Some(libc::EINVAL) => ErrorKind::InvalidArgument,
        Some(libc::EOVERFLOW) => ErrorKind::Overflow,
        Some(libc::ENOTSUP) => ErrorKind::NotSupported,
        Some(libc::ENOMEM) => ErrorKind::OutOfMemory,
        Some(libc::ESHUTDOWN) => ErrorKind::Shutdown,
        _ => ErrorKind::Io,
    }
}

/// Maps an error to the NBD error value sent in a reply. The only such mapping in the crate.
pub fn nbd_error_code(error: &Error) -> u32 {
    use crate::protocol::errno;
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

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_map_by_errno() {
        let no_space = Error::io("write", io::Error::from_raw_os_error(libc::ENOSPC));
        assert_eq!(nbd_error_code(&no_space), 28);
        let other = Error::io("write", io::Error::other("boom"));
        assert_eq!(nbd_error_code(&other), 5);
    }

    #[test]
    fn export_kinds_map_to_protocol_values() {
        let cases = [
            (ErrorKind::PermissionDenied, 1),
            (ErrorKind::Io, 5),
            (ErrorKind::OutOfMemory, 12),
            (ErrorKind::InvalidArgument, 22),
            (ErrorKind::NoSpace, 28),
            (ErrorKind::Overflow, 75),
            (ErrorKind::NotSupported, 95),
            (ErrorKind::Shutdown, 108),
        ];
        for (kind, code) in cases {
            assert_eq!(nbd_error_code(&Error::export(kind, "x")), code, "{kind:?}");
        }
    }
}
