//! Goal: a real filesystem on a thin volume can be snapshotted while mounted, and the
//! snapshot, served read-only, holds exactly the files as they were, however the origin
//! changes afterwards.
//!
//! Method: `nbdfuse` exposes the volume's export as a file, `losetup` makes it a block device,
//! `mkfs.ext4` and `mount` it, and a seeded tree of files is written and synced. The mount is
//! frozen (`fsfreeze -f`) around `thinpool volume snapshot --read-only` (through the control
//! socket), the snapshot's export is attached the same way read-only on a second loop device
//! and mounted read-only, and every file is compared. Then the origin is changed (files
//! overwritten, added, deleted), the snapshot side is torn down and attached afresh (no cache
//! can answer), and it must still hold the original tree. Every mount, loop device and nbdfuse
//! is undone by a guard, by PID for processes, even on failure.

mod e2e_support;

use e2e_support::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

const TOOL_TIMEOUT: Duration = Duration::from_secs(120);

/// Undo actions run in reverse order on drop, whatever happened.
#[derive(Default)]
struct Cleanup {
    actions: Vec<(String, Box<dyn FnOnce()>)>,
}

impl Cleanup {
    fn push(&mut self, what: impl Into<String>, action: impl FnOnce() + 'static) {
        self.actions.push((what.into(), Box::new(action)));
    }

    /// Runs the most recent actions down to (and including) the one called `what`.
    fn undo_to(&mut self, what: &str) {
        while let Some((name, action)) = self.actions.pop() {
            action();
            if name == what {
                return;
            }
        }
        panic!("no cleanup step {what:?}");
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        while let Some((_, action)) = self.actions.pop() {
            action();
        }
    }
}

fn quiet(program: &str, args: &[&str]) {
    let _ = std::process::Command::new(program)
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
}

/// Attaches `uri` through nbdfuse at `fuse_dir` and a loop device; returns the device. With
/// `read_only`, both nbdfuse and the loop device are read-only.
fn attach(cleanup: &mut Cleanup, tag: &str, uri: &str, fuse_dir: &Path, read_only: bool) -> String {
    std::fs::create_dir_all(fuse_dir).unwrap();
    let dir = fuse_dir.to_str().unwrap().to_string();
    let mut args = vec![];
    if read_only {
        args.push("-r");
    }
    args.extend([dir.as_str(), uri]);
    let nbdfuse = ChildGuard::background("nbdfuse", &args);
    let pid = nbdfuse.pid();
    let unmount_dir = dir.clone();
    cleanup.push(format!("{tag}-nbdfuse"), move || {
        quiet("fusermount3", &["-u", &unmount_dir]);
        let mut nbdfuse = nbdfuse;
        // Give nbdfuse a moment to exit on its own after the unmount, then kill it by PID.
        nbdfuse.wait_exit(Duration::from_secs(1));
        drop(nbdfuse);
        quiet("fusermount3", &["-u", "-z", &unmount_dir]);
    });
    let file = fuse_dir.join("nbd");
    wait_for(
        &format!("nbdfuse (pid {pid}) to expose {}", file.display()),
        Duration::from_secs(30),
        || {
            std::fs::metadata(&file)
                .map(|m| m.len() > 0)
                .unwrap_or(false)
        },
    );
    let mut losetup = vec!["-f", "--show"];
    if read_only {
        losetup.push("-r");
    }
    let file_str = file.to_str().unwrap().to_string();
    losetup.push(&file_str);
    let device = run_ok("losetup", &losetup, TOOL_TIMEOUT).trim().to_string();
    assert!(
        device.starts_with("/dev/loop"),
        "losetup printed {device:?}"
    );
    let detach = device.clone();
    cleanup.push(format!("{tag}-loop"), move || {
        quiet("losetup", &["-d", &detach])
    });
    device
}

fn mount(cleanup: &mut Cleanup, tag: &str, device: &str, target: &Path, options: &str) {
    std::fs::create_dir_all(target).unwrap();
    let target_str = target.to_str().unwrap().to_string();
    let mut args = vec![];
    if !options.is_empty() {
        args.extend(["-o", options]);
    }
    args.extend([device, target_str.as_str()]);
    run_ok("mount", &args, TOOL_TIMEOUT);
    cleanup.push(format!("{tag}-mount"), move || {
        if !run_tool("umount", &[&target_str], TOOL_TIMEOUT)
            .status
            .success()
        {
            quiet("umount", &["-l", &target_str]);
        }
    });
}

/// Every regular file under `root`, by relative path.
fn tree(root: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let path = entry.path();
            let kind = entry.file_type().unwrap();
            if path.file_name().unwrap() == "lost+found" {
                continue;
            }
            if kind.is_dir() {
                stack.push(path);
            } else if kind.is_file() {
                let relative = path.strip_prefix(root).unwrap().to_path_buf();
                files.insert(relative, std::fs::read(&path).unwrap());
            }
        }
    }
    files
}

fn assert_same_tree(
    expected: &BTreeMap<PathBuf, Vec<u8>>,
    actual: &BTreeMap<PathBuf, Vec<u8>>,
    what: &str,
) {
    let expected_names: Vec<_> = expected.keys().collect();
    let actual_names: Vec<_> = actual.keys().collect();
    assert_eq!(expected_names, actual_names, "{what}: file names differ");
    for (path, bytes) in expected {
        assert!(actual[path] == *bytes, "{what}: {} differs", path.display());
    }
}

fn write_tree(root: &Path, seed: u64, count: u64) {
    for index in 0..count {
        let dir = root
            .join(format!("d{}", index % 4))
            .join(format!("e{}", index % 3));
        std::fs::create_dir_all(&dir).unwrap();
        let length = 1000 + (seed.wrapping_mul(31).wrapping_add(index * 7919) % 300_000) as usize;
        std::fs::write(
            dir.join(format!("f{seed}-{index}")),
            pattern(seed << 20 | index, length),
        )
        .unwrap();
    }
    std::fs::write(root.join(format!("big-{seed}")), pattern(seed, 4 << 20)).unwrap();
}

#[test]
fn ext4_snapshot_while_mounted_keeps_the_tree() {
    for (tool, package) in [
        ("nbdfuse", "nbdfuse"),
        ("fusermount3", "fuse3"),
        ("losetup", "mount"),
        ("mkfs.ext4", "e2fsprogs"),
        ("fsfreeze", "util-linux"),
    ] {
        require_tool(tool, package);
    }
    let temp = ScratchDir::new("e2e-ext4");
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap().to_string();
    create_pool(&pool, &["--data-size", "1G"]);
    create_volume(&pool, "fs", "256M");
    let served = serve(&pool, &["--quiet"]);
    let mut cleanup = Cleanup::default();

    let origin_device = attach(
        &mut cleanup,
        "origin",
        &served.uri("fs"),
        &temp.join("fuse-origin"),
        false,
    );
    run_ok("mkfs.ext4", &["-q", "-F", &origin_device], TOOL_TIMEOUT);
    let origin = temp.join("mnt-origin");
    mount(&mut cleanup, "origin", &origin_device, &origin, "");
    write_tree(&origin, 1, 40);
    run_ok("sync", &[], TOOL_TIMEOUT);
    let before = tree(&origin);
    assert_eq!(before.len(), 41);

    // Snapshot with the filesystem frozen, so the snapshot is clean.
    let origin_str = origin.to_str().unwrap().to_string();
    run_ok("fsfreeze", &["-f", &origin_str], TOOL_TIMEOUT);
    let thaw = origin_str.clone();
    cleanup.push("thaw", move || quiet("fsfreeze", &["-u", &thaw]));
    let snapshot = thinpool(&[
        "volume",
        "snapshot",
        "fs",
        "fs-snap",
        "--read-only",
        "--pool",
        &p,
    ]);
    cleanup.undo_to("thaw");
    assert!(snapshot.status.success(), "{snapshot:?}");

    let snapshot_mount = temp.join("mnt-snap");
    let attach_snapshot = |cleanup: &mut Cleanup| {
        let device = attach(
            cleanup,
            "snap",
            &served.uri("fs-snap"),
            &temp.join("fuse-snap"),
            true,
        );
        mount(cleanup, "snap", &device, &snapshot_mount, "ro,noload");
    };
    attach_snapshot(&mut cleanup);
    assert_same_tree(
        &before,
        &tree(&snapshot_mount),
        "snapshot right after it was taken",
    );

    // Change the origin: overwrite, add, delete.
    write_tree(&origin, 2, 30);
    for (index, path) in before.keys().enumerate() {
        let full = origin.join(path);
        match index % 3 {
            0 => std::fs::remove_file(&full).unwrap(),
            1 => std::fs::write(&full, pattern(index as u64 + 99, 8192)).unwrap(),
            _ => {}
        }
    }
    run_ok("sync", &[], TOOL_TIMEOUT);
    let after = tree(&origin);
    assert_ne!(after.len(), before.len());

    // Tear the snapshot side down and attach it afresh: nothing cached can answer for it.
    cleanup.undo_to("snap-nbdfuse");
    attach_snapshot(&mut cleanup);
    assert_same_tree(
        &before,
        &tree(&snapshot_mount),
        "snapshot after the origin changed",
    );

    // The origin, remounted afresh too, holds the new tree.
    cleanup.undo_to("origin-nbdfuse");
    let device = attach(
        &mut cleanup,
        "origin",
        &served.uri("fs"),
        &temp.join("fuse-origin"),
        false,
    );
    mount(&mut cleanup, "origin", &device, &origin, "");
    assert_same_tree(&after, &tree(&origin), "origin after remount");
    drop(cleanup);

    let listing: serde_json::Value =
        serde_json::from_str(&thinpool_ok(&["list", "--json", "--pool", &p])).unwrap();
    for volume in listing["volumes"].as_array().unwrap() {
        assert_eq!(volume["open_count"], 0, "{volume}");
    }
    assert!(served.stop().success());
}
