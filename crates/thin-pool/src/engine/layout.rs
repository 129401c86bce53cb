//! A pool directory's files: `metadata` and `data` for a pool on files, `devices.json` for
//! one on block devices (`block_device`), beside the catalog (`catalog`).

use std::path::Path;

/// The metadata file inside a pool directory.
pub const METADATA_FILE: &str = "metadata";
/// The data file inside a pool directory.
pub const DATA_FILE: &str = "data";
/// The file in a pool directory that names the pool's devices.
pub const DEVICES_FILE: &str = "devices.json";

/// Default data block size: 64 KiB.
pub const BLOCK_SIZE_DEFAULT_BYTES: u64 = 64 * 1024;

/// Whether `dir` holds a pool.
pub(crate) fn pool_exists(dir: &Path) -> bool {
    dir.join(METADATA_FILE).exists() || dir.join(DEVICES_FILE).exists()
}
