//! Goal: the tools LVM calls behave as thin-provisioning-tools 1.1.0 at their interface
//! (issue 20, finding 12): `check -q --clear-needs-check-flag` (LVM's activation check)
//! and `check --auto-repair` free leaked blocks in place and exit 0; `-m` with either is
//! refused as a usage error; `-V` on every drop-in subcommand prints the tools' version;
//! `repair` and `dump --repair` (what `lvconvert --repair` runs) rebuild and print damaged
//! metadata as `thin_repair` and `thin_dump --repair` 1.1.0 do.
//! Method: metadata written by `PoolMetadata`, damaged with `testkit::metadata_patch`; the
//! built binary and the real tools run on copies of the same file.

use persistent_data::checksum::BlockKind;
use persistent_data::FileDevice;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;
use testkit::metadata_patch::{data_bitmap, leak, metadata_bitmap, patch, put_u32};
use testkit::scratch::{sized_file, ScratchDir};
use testkit::tools::ThinTools;
use thin_pool::{PoolMetadata, TransactionId, VirtualBlock, VolumeId};

const METADATA_BLOCKS: u64 = 1024;
const DATA_BLOCKS: u64 = 10_000;

fn thinpool(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_thinpool"))
        .args(args)
        .output()
        .expect("run thinpool")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn path_str(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// Two volumes (one a snapshot that diverged) of 600 mappings, written by `PoolMetadata`.
fn make_metadata(path: &Path) {
    let device = Arc::new(FileDevice::create(path, METADATA_BLOCKS).unwrap());
    let mut md = PoolMetadata::format(device, 128, DATA_BLOCKS).unwrap();
    md.create_thin(VolumeId::new(0)).unwrap();
    for vb in 0..600 {
        let db = md.alloc_data_block().unwrap();
        md.insert(VolumeId::new(0), VirtualBlock::new(vb), db)
            .unwrap();
    }
    md.create_snap(VolumeId::new(1), VolumeId::new(0)).unwrap();
    for vb in 0..50 {
        let db = md.alloc_data_block().unwrap();
        md.insert(VolumeId::new(1), VirtualBlock::new(vb * 10), db)
            .unwrap();
    }
    md.set_transaction_id(TransactionId::new(0), TransactionId::new(42))
        .unwrap();
    md.commit().unwrap();
}

fn open(path: &Path) -> PoolMetadata {
    PoolMetadata::open(Arc::new(FileDevice::open(path, false).unwrap())).unwrap()
}

/// Metadata flagged needs_check, with one leaked metadata block and one leaked data block.
fn leaked_metadata(path: &Path) {
    make_metadata(path);
    PoolMetadata::mark_needs_check(&FileDevice::open(path, true).unwrap()).unwrap();
    leak(path, metadata_bitmap(path), METADATA_BLOCKS - 1);
    leak(path, data_bitmap(path), DATA_BLOCKS - 1);
}

#[test]
fn lvm_activation_check_repairs_leaks_and_clears_needs_check_like_thin_check_1_1() {
    let dir = ScratchDir::new("repair-cli-leaks");
    let ours = dir.join("ours");
    let theirs = dir.join("theirs");
    leaked_metadata(&ours);
    std::fs::copy(&ours, &theirs).unwrap();
    let v11 = ThinTools::v1_1();
    let real = v11.check_with(&theirs, &["-q", "--clear-needs-check-flag"]);
    real.assert_success();
    let out = thinpool(&["check", "-q", "--clear-needs-check-flag", path_str(&ours)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(out.stdout.is_empty() && out.stderr.is_empty());
    assert!(!open(&ours).needs_check());
    assert!(!open(&theirs).needs_check());
    // Repaired, not only passed: a plain check of either tool is clean now.
    for tools in ThinTools::all() {
        tools.check(&ours).assert_success();
    }
    assert!(thinpool(&["check", path_str(&ours)]).status.success());
}

#[test]
fn auto_repair_frees_leaks_and_says_so() {
    let dir = ScratchDir::new("repair-cli-auto");
    let path = dir.join("metadata");
    leaked_metadata(&path);
    let before = thinpool(&["check", path_str(&path)]);
    assert_eq!(before.status.code(), Some(1));
    assert!(text(&before.stderr).contains("1 metadata blocks have leaked."));
    assert!(text(&before.stderr).contains("1 data blocks have leaked."));
    let out = thinpool(&["check", "--auto-repair", path_str(&path)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("Repairing metadata leaks."), "{stderr}");
    assert!(stderr.contains("Repairing data leaks."), "{stderr}");
    // --auto-repair alone leaves the flag, as 1.1.0 does.
    assert!(open(&path).needs_check());
    for tools in ThinTools::all() {
        tools.check(&path).assert_success();
    }
}

#[test]
fn fatal_damage_is_not_repaired_by_check() {
    let dir = ScratchDir::new("repair-cli-fatal");
    let path = dir.join("metadata");
    leaked_metadata(&path);
    let details_root = open(&path).superblock().device_details_root.get();
    patch(&path, details_root, None, |d| d[100] ^= 1);
    let before = std::fs::read(&path).unwrap();
    let out = thinpool(&["check", "-q", "--clear-needs-check-flag", path_str(&path)]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(std::fs::read(&path).unwrap(), before, "nothing written");
}

#[test]
fn metadata_snap_with_a_repairing_flag_is_refused_like_thin_check_1_1() {
    let dir = ScratchDir::new("repair-cli-snap");
    let path = dir.join("metadata");
    make_metadata(&path);
    PoolMetadata::mark_needs_check(&FileDevice::open(&path, true).unwrap()).unwrap();
    let v11 = ThinTools::v1_1();
    let refused = [
        vec!["-m", "--clear-needs-check-flag"],
        vec!["-q", "--clear-needs-check-flag", "-m"],
        vec!["--auto-repair", "-m"],
        vec!["--auto-repair", "--skip-mappings"],
        vec!["--auto-repair", "--super-block-only"],
    ];
    for args in refused {
        let theirs = v11.check_with(&path, &args);
        let mut ours_args = vec!["check"];
        ours_args.extend(&args);
        ours_args.push(path_str(&path));
        let ours = thinpool(&ours_args);
        assert_eq!(
            ours.status.code(),
            theirs.status.code(),
            "{args:?}: {theirs}"
        );
        assert_eq!(ours.status.code(), Some(2), "{args:?}");
        assert!(
            text(&ours.stderr).contains("cannot be used with"),
            "{args:?}: {}",
            text(&ours.stderr)
        );
        assert!(open(&path).needs_check(), "{args:?}: the flag stays");
    }
    // 0.9.0 refuses -m with the flag too (its own usage error, exit 1).
    assert!(!ThinTools::v0_9()
        .check_with(&path, &["-m", "--clear-needs-check-flag"])
        .success());
}

#[test]
fn every_drop_in_subcommand_prints_the_tools_version() {
    let expected = ThinTools::v1_1().run("thin_check", &["-V"]);
    let expected = expected.assert_success().stdout.clone();
    for command in ["check", "dump", "restore", "repair", "metadata-size"] {
        for flag in ["-V", "--version"] {
            let out = thinpool(&[command, flag]);
            assert!(
                out.status.success(),
                "{command} {flag}: {}",
                text(&out.stderr)
            );
            assert_eq!(text(&out.stdout), expected, "{command} {flag}");
        }
    }
}

#[test]
fn repair_rebuilds_a_damaged_superblock_like_thin_repair_1_1() {
    let dir = ScratchDir::new("repair-cli-superblock");
    let input = dir.join("damaged");
    make_metadata(&input);
    let v11 = ThinTools::v1_1();
    let original = v11.dump(&input, &[]);
    patch(&input, 0, None, |d| d[100] ^= 1);
    let ours = dir.join("ours");
    sized_file(&ours, 8 << 20);
    let (i, o) = (path_str(&input), path_str(&ours));
    let refused = thinpool(&["repair", "-i", i, "-o", o]);
    assert_eq!(refused.status.code(), Some(64));
    assert!(text(&refused.stderr).contains("--data-block-size"));
    let out = thinpool(&["repair", "-i", i, "-o", o, "--data-block-size", "128"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let theirs = dir.join("theirs");
    sized_file(&theirs, 8 << 20);
    let args = ["-i", i, "-o", path_str(&theirs), "--data-block-size", "128"];
    v11.run("thin_repair", &args).assert_success();
    for tools in ThinTools::all() {
        tools.check(&ours).assert_success();
    }
    // The same rebuilt superblock (transaction id, time, data blocks) and mappings.
    let dump_ours = v11.dump(&ours, &[]);
    assert_eq!(dump_ours, v11.dump(&theirs, &[]));
    let devices = |dump: &str| dump.lines().skip(1).map(str::to_string).collect::<Vec<_>>();
    assert_eq!(devices(&dump_ours), devices(&original));
}

#[test]
fn dump_repair_prints_what_repair_writes() {
    let dir = ScratchDir::new("repair-cli-dump");
    let input = dir.join("damaged");
    make_metadata(&input);
    // Break volume 1's root: the snapshot loses its tree, volume 0 keeps everything.
    let root = open(&input).volume_root(VolumeId::new(1)).unwrap().get();
    patch(&input, root, Some(BlockKind::Node), |d| {
        put_u32(d, 16, 1000)
    });
    let plain = thinpool(&["dump", path_str(&input)]);
    assert_eq!(plain.status.code(), Some(64), "a plain dump fails");
    let repaired_dump = thinpool(&["dump", "--repair", path_str(&input)]);
    assert!(
        repaired_dump.status.success(),
        "{}",
        text(&repaired_dump.stderr)
    );
    let output = dir.join("repaired");
    sized_file(&output, 8 << 20);
    let out = thinpool(&["repair", "-i", path_str(&input), "-o", path_str(&output)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("skipped 1 damaged nodes"));
    let dump = thinpool(&["dump", path_str(&output)]);
    assert_eq!(text(&dump.stdout), text(&repaired_dump.stdout));
    assert!(text(&dump.stdout).contains(r#"dev_id="0" mapped_blocks="600""#));
    for tools in ThinTools::all() {
        tools.check(&output).assert_success();
    }
}

#[test]
fn repair_refuses_to_write_over_its_input() {
    let dir = ScratchDir::new("repair-cli-same");
    let input = dir.join("metadata");
    make_metadata(&input);
    let before = std::fs::read(&input).unwrap();
    let out = thinpool(&["repair", "-i", path_str(&input), "-o", path_str(&input)]);
    assert_eq!(out.status.code(), Some(64));
    assert_eq!(std::fs::read(&input).unwrap(), before);
}
