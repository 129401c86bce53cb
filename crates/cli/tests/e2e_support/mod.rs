//! Shared helpers for the binary's end-to-end tests: the `thinpool` binary run with a
//! timeout, pools and volumes made with it, a served pool (testkit's [`Served`] for this
//! binary), and allocation maps read with `nbdinfo` and `qemu-img`. The raw NBD client,
//! process helpers, scratch directories, seeds and test data are testkit's, re-exported here
//! so each test needs one `use e2e_support::*`.
#![allow(dead_code)]

use std::path::Path;
use std::process::Output;
use std::time::Duration;

#[allow(unused_imports)]
pub use testkit::nbd_client::{option_header, request_header, Client, Mode, OPT_GO};
#[allow(unused_imports)]
pub use testkit::nbd_client::{CMD_DISC, CMD_FLUSH, CMD_READ, CMD_TRIM, CMD_WRITE};
#[allow(unused_imports)]
pub use testkit::nbd_client::{EINVAL, ENOSPC, EPERM};
#[allow(unused_imports)]
pub use testkit::process::{require_tool, run_ok, run_tool, run_tool_in, wait_for, ChildGuard};
#[allow(unused_imports)]
pub use testkit::{pattern, seed_report, sized_file, ScratchDir, Served};

/// The binary under test.
pub const THINPOOL: &str = env!("CARGO_BIN_EXE_thinpool");

pub const MIB: u64 = 1 << 20;

/// `thinpool ARGS` (with `$THINPOOL_POOL` unset).
pub fn thinpool(args: &[&str]) -> Output {
    run_tool(THINPOOL, args, Duration::from_secs(60))
}

/// `thinpool ARGS`, which must succeed; returns stdout.
#[track_caller]
pub fn thinpool_ok(args: &[&str]) -> String {
    run_ok(THINPOOL, args, Duration::from_secs(60))
}

/// `thinpool ARGS`, which must fail; returns stderr.
#[track_caller]
pub fn thinpool_err(args: &[&str]) -> String {
    let output = thinpool(args);
    assert!(
        !output.status.success(),
        "thinpool {args:?} succeeded:\n{}",
        String::from_utf8_lossy(&output.stdout)
    );
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Creates a pool at `dir` with `extra` create arguments.
pub fn create_pool(dir: &Path, extra: &[&str]) {
    let dir = dir.to_str().unwrap();
    let mut args = vec!["create", "--pool", dir];
    args.extend_from_slice(extra);
    thinpool_ok(&args);
}

/// Creates a volume.
pub fn create_volume(dir: &Path, name: &str, size: &str) {
    thinpool_ok(&[
        "volume",
        "create",
        name,
        "--size",
        size,
        "--pool",
        dir.to_str().unwrap(),
    ]);
}

/// Starts `thinpool serve --pool POOL EXTRA...` and waits until it is ready.
pub fn serve(pool: &Path, extra: &[&str]) -> Served {
    Served::start(Path::new(THINPOOL), pool, extra, None)
}

/// As [`serve`], in working directory `cwd`; `pool` may be empty to use the default pool
/// directory of `cwd`.
pub fn serve_in(pool: &Path, extra: &[&str], cwd: &Path) -> Served {
    Served::start(Path::new(THINPOOL), pool, extra, Some(cwd))
}

/// Allocated ranges `(offset, length)` from `nbdinfo --map --json`, merged.
pub fn nbdinfo_data_extents(uri: &str) -> Vec<(u64, u64)> {
    let text = run_ok(
        "nbdinfo",
        &["--map", "--json", uri],
        Duration::from_secs(30),
    );
    let extents: serde_json::Value = serde_json::from_str(&text).expect("nbdinfo json");
    let mut ranges = Vec::new();
    for extent in extents.as_array().expect("array") {
        let kind = extent["type"].as_u64().unwrap();
        if kind & 1 == 0 {
            ranges.push((
                extent["offset"].as_u64().unwrap(),
                extent["length"].as_u64().unwrap(),
            ));
        }
    }
    merge(ranges)
}

/// Allocated ranges from `qemu-img map --output=json`, merged.
pub fn qemu_img_data_extents(uri: &str) -> Vec<(u64, u64)> {
    merge(testkit::qemu_img::data_extents(uri))
}

/// Sorts and merges adjacent ranges.
pub fn merge(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (offset, length) in ranges {
        match merged.last_mut() {
            Some(last) if last.0 + last.1 == offset => last.1 += length,
            _ => merged.push((offset, length)),
        }
    }
    merged
}

/// The volume objects of `list --json` of the pool in `pool`.
pub fn listed_volumes(pool: &str) -> Vec<serde_json::Value> {
    let mut listing: serde_json::Value =
        serde_json::from_str(&thinpool_ok(&["list", "--json", "--pool", pool])).unwrap();
    match listing["volumes"].take() {
        serde_json::Value::Array(volumes) => volumes,
        other => panic!("list --json has no volumes array: {other}"),
    }
}

/// (name, origin) of every volume from `list --json` of the pool in `pool`.
pub fn origins(pool: &str) -> Vec<(String, Option<String>)> {
    listed_volumes(pool)
        .iter()
        .map(|v| {
            (
                v["name"].as_str().unwrap().to_string(),
                v["origin"].as_str().map(str::to_string),
            )
        })
        .collect()
}
