//! Goal: `thinpool check` behaves like `thin_check` 1.1.0 at its interface: arguments,
//! stdout figures, exit codes, `-q`, `--super-block-only`, `--ignore-non-fatal-errors`
//! and `--clear-needs-check-flag`.
//! Method: run the built binary on metadata made by the real thin_restore and by
//! `PoolMetadata`, good and with one patched block, next to the real thin_check.

use persistent_data::checksum::{self, BlockKind};
use persistent_data::{BlockDevice, FileDevice, MetadataBlock, BLOCK_SIZE};
use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;
use testkit::scratch::ScratchDir;
use testkit::tools::ThinTools;
use thin_pool::{PoolMetadata, VirtualBlock, VolumeId};

fn thinpool_check(path: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_thinpool"))
        .arg("check")
        .args(args)
        .arg(path)
        .output()
        .expect("run thinpool")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Metadata with one volume of 600 mappings, written by `PoolMetadata`.
fn make_metadata(path: &Path) {
    let device = Arc::new(FileDevice::create(path, 1024).unwrap());
    let mut md = PoolMetadata::format(device, 128, 10_000).unwrap();
    md.create_thin(VolumeId::new(0)).unwrap();
    for vb in 0..600 {
        let db = md.alloc_data_block().unwrap();
        md.insert(VolumeId::new(0), VirtualBlock::new(vb), db)
            .unwrap();
    }
    md.set_transaction_id(Default::default(), thin_pool::TransactionId::new(42))
        .unwrap();
    md.commit().unwrap();
}

fn patch(
    path: &Path,
    block: u64,
    restamp: Option<BlockKind>,
    edit: impl FnOnce(&mut [u8; BLOCK_SIZE]),
) {
    let device = FileDevice::open(path, true).unwrap();
    let mut data = [0u8; BLOCK_SIZE];
    device.read(MetadataBlock::new(block), &mut data).unwrap();
    edit(&mut data);
    if let Some(kind) = restamp {
        checksum::stamp(&mut data, kind);
    }
    device.write(MetadataBlock::new(block), &data).unwrap();
    device.flush().unwrap();
}

#[test]
fn good_metadata_prints_the_same_figures_as_thin_check_1_1() {
    let dir = ScratchDir::new("check-cli-good");
    let v11 = ThinTools::v1_1();
    for name in testkit::fixtures::COMMITTED {
        let path = dir.join(name);
        v11.restore(&testkit::fixtures::xml(name), &path)
            .assert_success();
        let ours = thinpool_check(&path, &[]);
        let theirs = v11.check(&path);
        assert!(ours.status.success(), "{name}: {}", text(&ours.stderr));
        assert_eq!(text(&ours.stdout), theirs.stdout, "{name}");
        assert!(text(&ours.stderr).starts_with("Checking thin metadata\n"));
        let quiet = thinpool_check(&path, &["-q"]);
        assert!(quiet.status.success());
        assert!(quiet.stdout.is_empty() && quiet.stderr.is_empty());
    }
}

#[test]
fn broken_superblock_fails_with_status_1_unless_only_the_superblock_is_checked() {
    let dir = ScratchDir::new("check-cli-broken");
    let path = dir.join("metadata");
    make_metadata(&path);
    assert!(thinpool_check(&path, &[]).status.success());
    // A broken node: fatal, but --super-block-only does not look at it.
    let root = {
        let md = PoolMetadata::open(Arc::new(FileDevice::open(&path, false).unwrap())).unwrap();
        md.volume_root(VolumeId::new(0)).unwrap().get()
    };
    patch(&path, root, None, |d| d[500] ^= 0xff);
    let out = thinpool_check(&path, &[]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(stderr.contains(&format!("block {root}")), "{stderr}");
    assert!(stderr.contains("btree node checksum"), "{stderr}");
    assert!(text(&out.stdout).contains("TRANSACTION_ID=42"));
    let only = thinpool_check(&path, &["--super-block-only"]);
    assert!(only.status.success(), "{}", text(&only.stderr));
    assert!(!ThinTools::v1_1().check(&path).success());
    // A broken superblock checksum.
    patch(&path, 0, None, |d| d[200] ^= 1);
    let out = thinpool_check(&path, &["--super-block-only"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("superblock checksum"));
    assert!(out.stdout.is_empty());
    let quiet = thinpool_check(&path, &["-q"]);
    assert_eq!(quiet.status.code(), Some(1));
    assert!(quiet.stdout.is_empty() && quiet.stderr.is_empty());
}

#[test]
fn a_leak_fails_unless_non_fatal_errors_are_ignored() {
    let dir = ScratchDir::new("check-cli-leak");
    let path = dir.join("metadata");
    make_metadata(&path);
    let md = PoolMetadata::open(Arc::new(FileDevice::open(&path, false).unwrap())).unwrap();
    let index = md.superblock().metadata_space_map.bitmap_root;
    drop(md);
    let mut bitmap = 0;
    patch(&path, index, None, |d| {
        bitmap = u64::from_le_bytes(d[16..24].try_into().unwrap());
    });
    // Mark the last block (free) as used once: count field 2 = count 1.
    let last = 1023u64;
    patch(&path, bitmap, Some(BlockKind::Bitmap), |d| {
        let at = 16 + (last / 32) as usize * 8;
        let mut word = u64::from_le_bytes(d[at..at + 8].try_into().unwrap());
        word |= 2 << ((last % 32) * 2);
        d[at..at + 8].copy_from_slice(&word.to_le_bytes());
    });
    let out = thinpool_check(&path, &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("1 metadata blocks have leaked."));
    assert!(thinpool_check(&path, &["--ignore-non-fatal-errors"])
        .status
        .success());
    for tools in ThinTools::all() {
        assert!(!tools.check(&path).success());
        assert!(tools
            .check_with(&path, &["--ignore-non-fatal-errors"])
            .success());
    }
}

#[test]
fn clear_needs_check_flag_clears_it_after_a_clean_check() {
    let dir = ScratchDir::new("check-cli-needs-check");
    let path = dir.join("metadata");
    make_metadata(&path);
    PoolMetadata::mark_needs_check(&FileDevice::open(&path, true).unwrap()).unwrap();
    let open = || PoolMetadata::open(Arc::new(FileDevice::open(&path, false).unwrap())).unwrap();
    assert!(open().needs_check());
    // A plain check passes (like thin_check) and leaves the flag.
    assert!(thinpool_check(&path, &[]).status.success());
    assert!(open().needs_check());
    let out = thinpool_check(&path, &["--clear-needs-check-flag"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!open().needs_check());
    for tools in ThinTools::all() {
        tools.check(&path).assert_success();
    }
}
