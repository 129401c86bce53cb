//! Goal: `thinpool serve` checks the metadata before it opens the pool read-write (as LVM
//! runs thin_check before activation) and refuses metadata that fails, naming what the
//! check found (issue 9, reproduction 5: serve opened metadata both checkers reject).
//!
//! Method: a pool made by the binary; its superblock's data space map claims twice the data
//! device (checksum re-stamped, so only the check can tell); `serve` must exit with the
//! finding instead of serving.

mod e2e_support;

use e2e_support::*;
use persistent_data::checksum::{self, BlockKind};
use std::os::unix::fs::FileExt;
use std::time::Duration;

#[test]
fn serve_refuses_metadata_that_fails_the_check() {
    let temp = ScratchDir::new("serve-check");
    let pool = temp.join("pool");
    let pool_arg = pool.to_str().unwrap();
    let out = thinpool(&["create", "--pool", pool_arg, "--data-size", "64M"]);
    assert!(out.status.success(), "{out:?}");
    let out = thinpool(&["volume", "create", "v", "--size", "16M", "--pool", pool_arg]);
    assert!(out.status.success(), "{out:?}");

    // The data space map's nr_blocks (superblock offset 64) doubled, checksum re-stamped.
    let metadata = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(pool.join("metadata"))
        .unwrap();
    let mut block = [0u8; 4096];
    metadata.read_exact_at(&mut block, 0).unwrap();
    let nr_blocks = u64::from_le_bytes(block[64..72].try_into().unwrap());
    assert_eq!(nr_blocks, 1024);
    block[64..72].copy_from_slice(&(2 * nr_blocks).to_le_bytes());
    checksum::stamp(&mut block, BlockKind::Superblock);
    metadata.write_all_at(&block, 0).unwrap();
    drop(metadata);

    let socket = pool.join("nbd.sock");
    let out = run_tool(
        THINPOOL,
        &[
            "serve",
            "--pool",
            pool_arg,
            "--socket",
            socket.to_str().unwrap(),
        ],
        Duration::from_secs(60),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "served damaged metadata:\n{stderr}");
    assert!(stderr.contains("fails its check"), "{stderr}");
    assert!(stderr.contains("data device holds 1024"), "{stderr}");
    assert!(!socket.exists());
}
