//! The mapping of [`Error`]s to the NBD error values sent in replies ([`nbd_error_code`]),
//! and the error reports.

use std::io;

use super::nbd_error_code;
use crate::error::*;

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
