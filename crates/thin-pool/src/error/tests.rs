use super::*;
use persistent_data::MetadataBlock;

fn io(errno: i32) -> Error {
    Error::Io {
        what: "writing the data device".to_string(),
        source: io::Error::from_raw_os_error(errno),
    }
}

fn metadata_io(errno: i32) -> Error {
    Error::Metadata(persistent_data::Error::Io {
        operation: "write",
        block: MetadataBlock::new(7),
        source: io::Error::from_raw_os_error(errno),
    })
}

#[test]
fn each_error_has_the_kind_and_errno_a_client_expects() {
    use ErrorKind::{Corrupt, Internal, Io, Refused};
    let cases = [
        (Error::VolumeExists(VolumeId::new(1)), Refused, libc::EEXIST),
        (Error::NameExists("a".into()), Refused, libc::EEXIST),
        (
            Error::VolumeNotFound(VolumeId::new(1)),
            Refused,
            libc::ENODATA,
        ),
        (Error::NoSuchVolume("a".into()), Refused, libc::ENOENT),
        (Error::BadVolumeId(1 << 24), Refused, libc::EINVAL),
        (
            Error::TransactionMismatch {
                expected: TransactionId::new(1),
                actual: TransactionId::new(2),
            },
            Refused,
            libc::EINVAL,
        ),
        (Error::NoMetadataSnap, Refused, libc::EINVAL),
        (
            Error::BadVolumeSize { size_bytes: 0 },
            Refused,
            libc::EINVAL,
        ),
        (Error::MetadataSnapExists(5), Refused, libc::EBUSY),
        (Error::Locked { path: "p".into() }, Refused, libc::EBUSY),
        (
            Error::Busy("volume \"a\" is open".into()),
            Refused,
            libc::EBUSY,
        ),
        (Error::ReadOnly { needs_check: false }, Refused, libc::EROFS),
        (Error::ReadOnly { needs_check: true }, Corrupt, libc::EIO),
        (
            Error::OutOfDataSpace { block_count: 8 },
            Refused,
            libc::ENOSPC,
        ),
        (
            Error::OutOfMetadataSpace { block_count: 8 },
            Refused,
            libc::ENOSPC,
        ),
        (
            Error::Corrupt("mapping root 9 beyond 8 blocks".into()),
            Corrupt,
            libc::EIO,
        ),
        (
            Error::Internal("op applied twice".into()),
            Internal,
            libc::EIO,
        ),
        (io(libc::ENOSPC), Io, libc::ENOSPC),
        (io(libc::EIO), Io, libc::EIO),
        (io(libc::EPERM), Io, libc::EPERM),
        (metadata_io(libc::ENOSPC), Io, libc::ENOSPC),
        (
            Error::Io {
                what: "reading the data device".into(),
                source: io::ErrorKind::UnexpectedEof.into(),
            },
            Io,
            libc::EIO,
        ),
        (
            persistent_data::Error::corrupt(MetadataBlock::new(3), "keys out of order").into(),
            Corrupt,
            libc::EIO,
        ),
        (
            Error::Metadata(persistent_data::Error::Checksum {
                block: MetadataBlock::new(3),
                kind: persistent_data::checksum::BlockKind::Superblock,
                stored: 1,
                computed: 2,
            }),
            Corrupt,
            libc::EIO,
        ),
        (
            persistent_data::Error::OutOfDataSpace { block_count: 8 }.into(),
            Refused,
            libc::ENOSPC,
        ),
        (
            Error::Metadata(persistent_data::Error::OutOfMetadataSpace { block_count: 8 }),
            Refused,
            libc::ENOSPC,
        ),
        (
            persistent_data::Error::Invalid("dropping a reference to free block 4".into()).into(),
            Internal,
            libc::EIO,
        ),
    ];
    for (error, kind, errno) in cases {
        assert_eq!(error.kind(), kind, "kind of {error:?}");
        assert_eq!(error.errno(), errno, "errno of {error:?}");
    }
}

#[test]
fn out_of_space_from_persistent_data_keeps_its_variant() {
    let error: Error = persistent_data::Error::OutOfDataSpace { block_count: 8 }.into();
    assert!(matches!(error, Error::OutOfDataSpace { block_count: 8 }));
}

#[test]
fn reports_name_each_cause_once() {
    let cause = io::Error::from_raw_os_error(libc::EPERM).to_string();
    for error in [io(libc::EPERM), metadata_io(libc::EPERM)] {
        let report = error.report().to_string();
        assert_eq!(report.matches(&cause).count(), 1, "{report}");
        assert!(report.starts_with(&error.to_string()), "{report}");
        assert!(!error.to_string().contains(&cause), "{error}");
    }
    assert_eq!(
        metadata_io(libc::EPERM).report().to_string(),
        format!("metadata i/o error: write of block 7: {cause}")
    );
    assert_eq!(
        io(libc::ENOSPC).report().to_string(),
        format!(
            "writing the data device: {}",
            io::Error::from_raw_os_error(libc::ENOSPC)
        )
    );
}
