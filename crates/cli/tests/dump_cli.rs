//! Goal: `thinpool dump` behaves like `thin_dump` 1.1.0 at its interface: the same bytes on
//! stdout or in `-o FILE` for XML and human-readable output, `-m`, `--dev-id`,
//! `--skip-mappings`, the 0.9.0 flavour, and exit status 64 on failure.
//! Method: run the built binary next to the real tools on metadata written by `PoolMetadata`
//! (snapshots with copied-on-write shared leaves, a metadata snapshot) and by thin_restore.

use persistent_data::FileDevice;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;
use testkit::scratch::ScratchDir;
use testkit::tools::ThinTools;
use thin_pool::{PoolMetadata, VirtualBlock, VolumeId};

fn thinpool(args: &[&str], path: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_thinpool"))
        .arg("dump")
        .args(args)
        .arg(path)
        .output()
        .expect("run thinpool")
}

fn make_pool(path: &Path) {
    let device = Arc::new(FileDevice::create(path, 2048).unwrap());
    let mut md = PoolMetadata::format(device, 256, 50_000).unwrap();
    md.create_thin(VolumeId::new(3)).unwrap();
    for vb in 0..2000 {
        let db = md.alloc_data_block().unwrap();
        md.insert(VolumeId::new(3), VirtualBlock::new(vb), db)
            .unwrap();
    }
    md.commit().unwrap();
    md.create_snap(VolumeId::new(7), VolumeId::new(3)).unwrap();
    md.create_snap(VolumeId::new(9), VolumeId::new(7)).unwrap();
    md.commit().unwrap();
    md.reserve_metadata_snap().unwrap();
    for vb in (0..2000).step_by(300) {
        let db = md.alloc_data_block().unwrap();
        md.insert(VolumeId::new(7), VirtualBlock::new(vb), db)
            .unwrap();
    }
    md.remove_range(
        VolumeId::new(3),
        VirtualBlock::new(900),
        VirtualBlock::new(1000),
    )
    .unwrap();
    md.commit().unwrap();
}

#[test]
fn output_matches_thin_dump_for_every_option() {
    let dir = ScratchDir::new("dump-cli");
    let path = dir.join("metadata");
    make_pool(&path);
    let v1 = ThinTools::v1_1();
    let cases: [&[&str]; 7] = [
        &[],
        &["--format", "human_readable"],
        &["-f", "xml"],
        &["-m"],
        &["--dev-id", "7"],
        &["--skip-mappings"],
        &["--transaction-id", "99", "--nr-data-blocks", "60000"],
    ];
    for args in cases {
        let ours = thinpool(args, &path);
        assert!(ours.status.success(), "{args:?}: {ours:?}");
        assert_eq!(
            String::from_utf8(ours.stdout).unwrap(),
            v1.dump(&path, args),
            "thinpool dump {args:?}"
        );
    }
    let out = dir.join("out.xml");
    let ours = thinpool(&["-o", out.to_str().unwrap()], &path);
    assert!(ours.status.success());
    assert_eq!(std::fs::read_to_string(&out).unwrap(), v1.dump(&path, &[]));

    let v0 = ThinTools::v0_9();
    let ours = thinpool(&["--tools-version", "0.9.0"], &path);
    assert_eq!(String::from_utf8(ours.stdout).unwrap(), v0.dump(&path, &[]));
}

#[test]
fn failures_exit_64_like_thin_dump() {
    let dir = ScratchDir::new("dump-cli-failures");
    let v1 = ThinTools::v1_1();
    let zero = dir.join("zero");
    testkit::sized_file(&zero, 1 << 20);
    let missing = dir.join("missing");
    let no_snap = dir.join("no-snap");
    let device = Arc::new(FileDevice::create(&no_snap, 256).unwrap());
    PoolMetadata::format(device, 128, 100).unwrap();
    for (args, path) in [
        (&[][..], &zero),
        (&[][..], &missing),
        (&["-m"][..], &no_snap),
    ] {
        let ours = thinpool(args, path);
        let theirs = v1.dump_output(path, args);
        assert_eq!(ours.status.code(), Some(64), "{args:?} {}", path.display());
        assert_eq!(ours.status.code(), theirs.status.code());
        assert!(!ours.stderr.is_empty());
        let quiet = thinpool(&[&["-q"][..], args].concat(), path);
        assert_eq!(quiet.status.code(), Some(64));
        assert!(quiet.stderr.is_empty());
    }
}
