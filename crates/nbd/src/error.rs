//! The crate's one error type, and the one place that turns errors into NBD error codes.
//!
//! [`Error`] covers four sources: the socket ([`Error::Io`]), a peer that breaks the
//! protocol ([`Error::Protocol`], [`Error::TooLong`], [`Error::BadMagic`]), an export that
//! refuses or fails an operation ([`Error::Export`]), TLS set-up and sessions ([`Error::Tls`])
//! and the server's own bugs
//! ([`Error::Internal`]). Every error has an [`ErrorKind`], an errno-like classification,
//! and [`nbd_error_code`](crate::protocol::nbd_error_code) is the only function that
//! maps a kind to the error value sent on the wire. Invariant: no other code in the crate
//! chooses an NBD error number for an export failure.
//!
//! An export whose own errors carry a Linux errno (the binary's thin volumes do) classifies
//! them with [`ErrorKind::from_errno`], the one table from errno to what the client sees, so
//! the crate never needs to know the export's error type.
//!
//! Messages never repeat their source; [`Error::report`] prints the error with its causes.

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

impl ErrorKind {
    /// Classifies a Linux errno as the client will see it; anything without a closer NBD
    /// error is an I/O failure (the wire protocol knows only EPERM, EIO, ENOMEM, EINVAL,
    /// ENOSPC, EOVERFLOW, ENOTSUP and ESHUTDOWN).
    pub fn from_errno(errno: i32) -> ErrorKind {
        match errno {
            libc::ENOSPC | libc::EDQUOT | libc::EFBIG => ErrorKind::NoSpace,
            libc::EPERM | libc::EROFS | libc::EACCES => ErrorKind::PermissionDenied,
            libc::EINVAL => ErrorKind::InvalidArgument,
            libc::EOVERFLOW => ErrorKind::Overflow,
            libc::ENOTSUP => ErrorKind::NotSupported,
            libc::ENOMEM => ErrorKind::OutOfMemory,
            libc::ESHUTDOWN => ErrorKind::Shutdown,
            _ => ErrorKind::Io,
        }
    }
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
    /// TLS could not be set up (certificates, keys), or a TLS session failed.
    #[error("{context}")]
    Tls {
        /// What failed: the file, or the stage of the session.
        context: String,
        /// The underlying error, if any.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// A broken invariant in the server itself (a bug), e.g. a serving thread that panicked.
    #[error("internal error: {0}")]
    Internal(String),
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
            Error::Internal(_) | Error::Tls { .. } => ErrorKind::Io,
        }
    }

    /// The error followed by each of its causes, for logs and events.
    pub fn report(&self) -> Report<'_> {
        Report(self)
    }
}

/// Classifies an OS error by its errno; one without an errno counts as an I/O failure.
fn kind_of_io_error(error: &io::Error) -> ErrorKind {
    error
        .raw_os_error()
        .map_or(ErrorKind::Io, ErrorKind::from_errno)
}

/// Displays an error and its causes, outermost first, joined by ": ". Since no message
/// repeats its source, each cause appears once.
pub struct Report<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(error) = cause {
            write!(f, ": {error}")?;
            cause = error.source();
        }
        Ok(())
    }
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
