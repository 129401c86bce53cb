//! Shared helpers for `thinpool-bench serve`'s tests: pools made with the daemon library (no
//! `thinpool` binary needed), the server started as testkit's [`Served`] for this binary,
//! and the raw NBD client and process helpers of testkit, re-exported.
#![allow(dead_code)]

use std::path::Path;
use std::time::Duration;

#[allow(unused_imports)]
pub use testkit::nbd_client::{Client, CMD_READ, EINVAL, ENOSPC};
#[allow(unused_imports)]
pub use testkit::process::{require_tool, run_ok, run_tool};
#[allow(unused_imports)]
pub use testkit::{pattern, sized_file, ScratchDir, Served};
use thin_pool::CreateOptions;
use thinpool_daemon::control::{self, OpError, Outcome, Request};
use thinpool_daemon::pool_dir::{PoolArg, PoolDir, StoredOptions};

/// The binary under test.
pub const THINPOOL_BENCH: &str = env!("CARGO_BIN_EXE_thinpool-bench");

pub const MIB: u64 = 1 << 20;

fn pool_dir(path: &Path) -> PoolDir {
    PoolArg {
        pool: Some(path.to_path_buf()),
        allow_shared_dir: false,
    }
    .resolve()
}

/// Creates a pool of `data_size_bytes` (64 KiB blocks) at `path`, as `thinpool create` does.
pub fn create_pool(path: &Path, data_size_bytes: u64) {
    let create = CreateOptions {
        data_size_bytes,
        block_size_bytes: 64 << 10,
        metadata_size_bytes: None,
    };
    thinpool_daemon::create::create_pool(&pool_dir(path), &create, StoredOptions::default())
        .expect("create a pool");
}

/// `thinpool volume create` on the pool at `path`: directly, or through the server's
/// control socket while one holds the pool.
pub fn create_volume(path: &Path, name: &str, size_bytes: u64) -> Result<Outcome, OpError> {
    let request = Request::CreateVolume {
        name: name.to_string(),
        size_bytes,
    };
    control::perform(&pool_dir(path), &request).expect("reach the pool")
}

/// `thinpool-bench serve --pool POOL EXTRA...`, ready.
pub fn serve(pool: &Path, extra: &[&str]) -> Served {
    Served::start(Path::new(THINPOOL_BENCH), pool, extra, None)
}

/// `thinpool-bench ARGS`, which must fail; returns stderr.
#[track_caller]
pub fn bench_err(args: &[&str]) -> String {
    let output = run_tool(THINPOOL_BENCH, args, Duration::from_secs(60));
    assert!(
        !output.status.success(),
        "thinpool-bench {args:?} succeeded:\n{}",
        String::from_utf8_lossy(&output.stdout)
    );
    String::from_utf8_lossy(&output.stderr).into_owned()
}
