//! Goal: no size typed by an operator can brick a pool (issue 9, reproductions 3, 4 and the
//! host-file-system part of 9). A volume of the largest size is created and served at a
//! constant memory cost; a larger one is refused and the pool still opens; growing the data
//! beyond what the metadata can map is refused before the data file changes; on a host file
//! system that fills, writes get ENOSPC, the pool stays `rw` and needs no check after a
//! restart.
//!
//! Method: drive the binary (`volume`, `create --grow`, `serve`) and our raw NBD client; the
//! host-full case mounts an 8 MiB tmpfs (skipped with a message where mounting is not
//! permitted).

mod e2e_support;

use e2e_support::*;
use std::path::{Path, PathBuf};
use std::process::Command;

const BLOCK: u64 = 64 * 1024;

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}):\n{text}"))
}

fn status(p: &str) -> serde_json::Value {
    json(&thinpool_ok(&["status", "--json", "--pool", p]))
}

/// Resident memory of a process, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = text.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn the_largest_volume_costs_little_and_larger_sizes_are_refused() {
    let temp = ScratchDir::new("limits-size");
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap();
    create_pool(&pool, &["--data-size", "64M"]);
    // 1048576T is 1 EiB, the largest volume: 2^44 blocks of 64 KiB.
    let out = thinpool_ok(&["volume", "create", "big", "--size", "1048576T", "--pool", p]);
    assert!(out.contains("\"big\""), "{out}");
    create_volume(&pool, "small", "1G");
    for size in ["1048577T", "9999999T"] {
        let error = thinpool_err(&["volume", "create", "bigger", "--size", size, "--pool", p]);
        assert!(error.contains("largest volume"), "{size}: {error}");
        let error = thinpool_err(&["volume", "resize", "small", "--size", size, "--pool", p]);
        assert!(error.contains("largest volume"), "{size}: {error}");
    }
    // Nothing of the refused requests reached the catalog: the pool lists and serves.
    let listing = json(&thinpool_ok(&["list", "--json", "--pool", p]));
    let volumes = listing["volumes"].as_array().unwrap();
    assert_eq!(volumes.len(), 2, "{listing}");
    let small = volumes.iter().find(|v| v["name"] == "small").unwrap();
    assert_eq!(small["size_bytes"], 1u64 << 30);
    let big = volumes.iter().find(|v| v["name"] == "big").unwrap();
    assert_eq!(big["size_bytes"], 1u64 << 60);

    let served = serve(&pool, &["--quiet"]);
    let mut client = Client::open(&served.socket, "big");
    let last = (1u64 << 60) - BLOCK;
    for (i, offset) in [0, 1 << 50, last].into_iter().enumerate() {
        client.write(offset, &pattern(i as u64, BLOCK as usize));
    }
    client.flush();
    for (i, offset) in [0, 1 << 50, last].into_iter().enumerate() {
        assert_eq!(
            client.read(offset, BLOCK),
            pattern(i as u64, BLOCK as usize)
        );
    }
    // Three mappings in an exabyte: the index holds a few nodes, not a table for the size.
    let rss = rss_kib(served.pid());
    assert!(rss < 256 * 1024, "serve holds {rss} KiB for three mappings");
    // A resize through the control socket is refused the same way while serving.
    let error = thinpool_err(&["volume", "resize", "big", "--size", "1048577T", "--pool", p]);
    assert!(error.contains("largest volume"), "{error}");
    client.disconnect();
    assert!(served.stop().success());

    let served = serve(&pool, &["--quiet"]);
    let mut client = Client::open(&served.socket, "big");
    assert_eq!(client.read(last, BLOCK), pattern(2, BLOCK as usize));
    client.disconnect();
    assert!(served.stop().success());
    let listing = json(&thinpool_ok(&["list", "--json", "--pool", p]));
    let big = listing["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "big")
        .cloned()
        .unwrap();
    assert_eq!(big["mapped_blocks"], 3);
}

fn data_file_len(pool: &Path) -> u64 {
    std::fs::metadata(pool.join("data")).unwrap().len()
}

#[test]
fn growing_data_beyond_what_the_metadata_can_map_is_refused_and_changes_nothing() {
    let temp = ScratchDir::new("limits-grow");
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap();
    create_pool(&pool, &["--data-size", "256M"]);
    create_volume(&pool, "v", "64M");
    let before = data_file_len(&pool);
    assert_eq!(before, 256 << 20);

    // Offline.
    let error = thinpool_err(&["create", "--grow", "--data-size", "8T", "--pool", p]);
    assert!(error.contains("metadata blocks"), "{error}");
    assert!(!error.contains("all in use"), "{error}");
    assert_eq!(data_file_len(&pool), before);
    assert_eq!(status(p)["mode"], "rw");

    // Served, with an acknowledged write not yet flushed.
    let served = serve(&pool, &["--quiet"]);
    let mut client = Client::open(&served.socket, "v");
    client.write(0, &pattern(1, BLOCK as usize));
    let error = thinpool_err(&["create", "--grow", "--data-size", "8T", "--pool", p]);
    assert!(error.contains("metadata blocks"), "{error}");
    assert_eq!(data_file_len(&pool), before);
    let live = status(p);
    assert_eq!(live["mode"], "rw", "{live}");
    assert_eq!(live["data_total_blocks"], 4096, "{live}");
    client.write(BLOCK, &pattern(2, BLOCK as usize));
    client.flush();
    // A grow the metadata can map still works.
    let grown = json(&thinpool_ok(&[
        "create",
        "--grow",
        "--data-size",
        "512M",
        "--json",
        "--pool",
        p,
    ]));
    assert_eq!(grown["data_total_blocks"], 8192);
    client.disconnect();
    assert!(served.stop().success());

    let served = serve(&pool, &["--quiet"]);
    let mut client = Client::open(&served.socket, "v");
    assert_eq!(client.read(0, BLOCK), pattern(1, BLOCK as usize));
    assert_eq!(client.read(BLOCK, BLOCK), pattern(2, BLOCK as usize));
    client.disconnect();
    assert!(served.stop().success());
    assert_eq!(data_file_len(&pool), 512 << 20);
}

/// A tmpfs mounted for the test, unmounted when dropped.
struct Mount(PathBuf);

impl Mount {
    fn tmpfs(dir: &Path, size: &str) -> Option<Mount> {
        std::fs::create_dir_all(dir).unwrap();
        let output = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .ok()?;
        if !output.status.success() {
            eprintln!(
                "skipped: cannot mount a tmpfs ({})",
                String::from_utf8_lossy(&output.stderr).trim()
            );
            return None;
        }
        Some(Mount(dir.to_path_buf()))
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn a_full_host_file_system_gives_enospc_and_leaves_the_pool_healthy() {
    let temp = ScratchDir::new("limits-hostfull");
    let Some(mount) = Mount::tmpfs(&temp.join("fs"), "8M") else {
        return;
    };
    let pool = mount.0.join("pool");
    let p = pool.to_str().unwrap();
    // Metadata that cannot be preallocated is refused.
    let error = thinpool_err(&[
        "create",
        "--pool",
        p,
        "--data-size",
        "64M",
        "--metadata-size",
        "16M",
    ]);
    assert!(error.contains("metadata"), "{error}");
    assert!(!Path::new(&pool).join("metadata").exists());
    // Data larger than the file system is allowed (the data file is sparse), with a warning.
    let output = thinpool(&[
        "create",
        "--pool",
        p,
        "--data-size",
        "64M",
        "--metadata-size",
        "2M",
        "--error-if-no-space",
    ]);
    assert!(output.status.success(), "{output:?}");
    let warning = String::from_utf8_lossy(&output.stderr);
    assert!(warning.contains("warning"), "{warning}");
    create_volume(&pool, "v", "64M");

    let served = serve(&pool, &["--quiet"]);
    let mut client = Client::open(&served.socket, "v");
    let mut written = 0;
    let mut errno = 0;
    for block in 0..1024 {
        errno = client.write_errno(block * BLOCK, &pattern(block, BLOCK as usize));
        if errno != 0 {
            break;
        }
        written += 1;
    }
    assert_eq!(errno, ENOSPC, "after {written} blocks");
    assert!(written > 0);
    assert_eq!(client.flush_errno(), 0);
    let live = status(p);
    assert_eq!(live["mode"], "rw", "{live}");
    assert_eq!(live["needs_check"], false, "{live}");
    client.disconnect();
    assert!(served.stop().success());

    let served = serve(&pool, &["--quiet"]);
    let after = status(p);
    assert_eq!(after["needs_check"], false, "{after}");
    assert_eq!(after["mode"], "rw", "{after}");
    assert_eq!(after["data_used_blocks"], written, "{after}");
    let mut client = Client::open(&served.socket, "v");
    for block in 0..written {
        assert_eq!(
            client.read(block * BLOCK, BLOCK),
            pattern(block, BLOCK as usize)
        );
    }
    client.disconnect();
    assert!(served.stop().success());
    drop(pool);
}
