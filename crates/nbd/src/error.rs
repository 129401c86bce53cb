//! The crate's one error type, and the one place that turns errors into NBD error codes.
//!
//! [`Error`] covers four sources: the socket ([`Error::Io`]), a peer that breaks the
//! protocol ([`Error::Protocol`], [`Error::TooLong`], [`Error::BadMagic`]), an export that
//! refuses or fails an operation ([`Error::Export`]), TLS set-up and sessions ([`Error::Tls`])
//! and the server's own bugs
//! ([`Error::Internal`]). Every error has an [`ErrorKind`], an
//! errno-like classification, and [`nbd_error_code`] is the only function that maps a kind to
//! the error value sent on the wire. Invariant: no other code in the crate chooses an NBD error
//! number for an export failure.
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
    fn errnos_map_to_the_nbd_error_of_the_same_meaning() {
        let cases = [
            (libc::EPERM, 1),
            (libc::EROFS, 1),
            (libc::EACCES, 1),
            (libc::EIO, 5),
            (libc::ENOMEM, 12),
            (libc::EINVAL, 22),
            (libc::ENOSPC, 28),
            (libc::EDQUOT, 28),
            (libc::EFBIG, 28),
            (libc::EOVERFLOW, 75),
            (libc::ENOTSUP, 95),
            (libc::ESHUTDOWN, 108),
            // No NBD error of their own: the client sees an I/O error.
            (libc::EEXIST, 5),
            (libc::EBUSY, 5),
            (libc::ENOENT, 5),
            (libc::ENODATA, 5),
            (0, 5),
            (-1, 5),
        ];
        for (errno, code) in cases {
            let kind = ErrorKind::from_errno(errno);
            assert_eq!(
                nbd_error_code(&Error::export(kind, "x")),
                code,
                "errno {errno}"
            );
            let io = Error::io("x", io::Error::from_raw_os_error(errno));
            assert_eq!(nbd_error_code(&io), code, "os error {errno}");
        }
    }

    #[test]
    fn reports_name_each_cause_once() {
        let cause = io::Error::from_raw_os_error(libc::EPERM);
        let cause_text = cause.to_string();
        let error = Error::export_with_source(ErrorKind::PermissionDenied, "write at 0", cause);
        let report = error.report().to_string();
        assert_eq!(report.matches(&cause_text).count(), 1, "{report}");
        assert!(report.starts_with("write at 0"), "{report}");
        let error = Error::io("read request", io::Error::from_raw_os_error(libc::EPERM));
        assert_eq!(
            error.report().to_string(),
            format!("read request: {cause_text}")
        );
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
