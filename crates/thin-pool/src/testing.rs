//! Pools for tests, built from parts the test keeps (cargo feature `testing`, off by
//! default; this crate's own integration tests turn it on through a dev-dependency on
//! itself).
//!
//! - [`memory_pool`]: a formatted pool in memory, nothing to keep; [`dir_pool`]: one in a
//!   directory's files;
//! - [`MemoryParts`]: a metadata device, a data device and a catalog in memory, kept by the
//!   test so that it can check the metadata, look at the data and reopen the same pool;
//! - [`PoolParts`]: the same for parts of the test's own making (devices that fail, crash
//!   or wait), so every test formats and reopens a pool the same way.
//! - [`data_device_contract`]: one suite of the `DataDevice` contract, for every data
//!   device, real or fake.
//!
//! Every helper panics, naming what failed, instead of returning an error: these are
//! set-up steps, not behaviour under test (use [`PoolParts::try_reopen`] where a refused
//! open is what the test checks).

pub mod data_device_contract;

use crate::engine::catalog::{CatalogStore, MemoryCatalog};
use crate::engine::data_device::{DataDevice, MemoryDataDevice};
use crate::{CreateOptions, Pool, PoolOptions, Result};
use persistent_data::{BlockDevice, MemoryDevice};
use std::path::Path;
use std::sync::Arc;

/// The data block size of [`memory_pool`] and of most tests (64 KiB).
pub const BLOCK_BYTES: u64 = 64 * 1024;

/// Metadata blocks of [`memory_pool`] (4 MiB).
pub const METADATA_BLOCKS: u64 = 1024;

/// Data blocks of [`memory_pool`] (16 MiB of data at [`BLOCK_BYTES`]).
pub const DATA_BLOCKS: u64 = 256;

/// Options for deterministic tests: no commit thread (commits happen when the test makes
/// them), and a write that finds no space fails at once instead of waiting.
pub fn deterministic_options() -> PoolOptions {
    PoolOptions {
        commit_interval: None,
        error_if_no_space: true,
        ..PoolOptions::default()
    }
}

/// A new, empty pool in memory: [`METADATA_BLOCKS`] of metadata, [`DATA_BLOCKS`] data
/// blocks of [`BLOCK_BYTES`], [`deterministic_options`].
pub fn memory_pool() -> Pool {
    memory_pool_with(deterministic_options())
}

/// [`memory_pool`] with other options.
pub fn memory_pool_with(options: PoolOptions) -> Pool {
    MemoryParts::default().format(BLOCK_BYTES, options)
}

/// A new, empty pool in the directory `dir` (its files, as `thinpool create` makes them):
/// `data_bytes` of data in blocks of [`BLOCK_BYTES`], the metadata sized by default.
pub fn dir_pool(dir: &Path, data_bytes: u64, options: PoolOptions) -> Pool {
    let create = CreateOptions {
        data_size_bytes: data_bytes,
        block_size_bytes: BLOCK_BYTES,
        metadata_size_bytes: None,
    };
    Pool::create(dir, &create, options)
        .unwrap_or_else(|e| panic!("creating a pool in {}: {e}", dir.display()))
}

/// The parts a pool runs on: a metadata device, a data device and a catalog store, kept
/// so that the test can reach them beside the pool and open the pool on them again.
pub struct PoolParts<M = MemoryDevice, D = MemoryDataDevice, C = MemoryCatalog> {
    /// The metadata device.
    pub metadata: Arc<M>,
    /// The data device.
    pub data: Arc<D>,
    /// The volume catalog store.
    pub catalog: Arc<C>,
}

/// A pool's parts, all in memory.
pub type MemoryParts = PoolParts<MemoryDevice, MemoryDataDevice, MemoryCatalog>;

impl MemoryParts {
    /// `metadata_blocks` of metadata and `data_bytes` of data, zeroed, and an empty
    /// catalog: nothing formatted yet.
    pub fn new(metadata_blocks: u64, data_bytes: u64) -> MemoryParts {
        assert!(metadata_blocks > 0, "a metadata device needs blocks");
        PoolParts::on(
            Arc::new(MemoryDevice::new(metadata_blocks)),
            Arc::new(MemoryDataDevice::new(data_bytes)),
            Arc::new(MemoryCatalog::default()),
        )
    }
}

impl Default for MemoryParts {
    /// The sizes of [`memory_pool`].
    fn default() -> MemoryParts {
        MemoryParts::new(METADATA_BLOCKS, DATA_BLOCKS * BLOCK_BYTES)
    }
}

impl<M, D, C> PoolParts<M, D, C>
where
    M: BlockDevice + 'static,
    D: DataDevice + 'static,
    C: CatalogStore + 'static,
{
    /// Parts made by the test.
    pub fn on(metadata: Arc<M>, data: Arc<D>, catalog: Arc<C>) -> PoolParts<M, D, C> {
        PoolParts {
            metadata,
            data,
            catalog,
        }
    }

    /// The same parts with another metadata device (one wrapping this one, say, to fail
    /// or count its I/O).
    pub fn with_metadata<M2>(&self, metadata: Arc<M2>) -> PoolParts<M2, D, C> {
        PoolParts {
            metadata,
            data: self.data.clone(),
            catalog: self.catalog.clone(),
        }
    }

    /// The same parts with another data device (one wrapping this one, say).
    pub fn with_data<D2>(&self, data: Arc<D2>) -> PoolParts<M, D2, C> {
        PoolParts {
            metadata: self.metadata.clone(),
            data,
            catalog: self.catalog.clone(),
        }
    }

    /// Formats a new pool of `block_size_bytes` data blocks over the whole data device,
    /// and opens it.
    pub fn format(&self, block_size_bytes: u64, options: PoolOptions) -> Pool {
        assert!(
            self.data.size_bytes() >= block_size_bytes,
            "a data device of {} bytes holds no {block_size_bytes}-byte block",
            self.data.size_bytes()
        );
        Pool::format_parts(
            self.metadata.clone(),
            self.data.clone(),
            Box::new(self.catalog.clone()),
            block_size_bytes,
            options,
        )
        .unwrap_or_else(|e| panic!("formatting a pool on the test's parts: {e}"))
    }

    /// Opens the pool these parts hold again (after the last handle was dropped).
    pub fn reopen(&self, options: PoolOptions) -> Pool {
        self.try_reopen(options)
            .unwrap_or_else(|e| panic!("reopening the pool on the test's parts: {e}"))
    }

    /// [`PoolParts::reopen`], for tests of a refused open.
    pub fn try_reopen(&self, options: PoolOptions) -> Result<Pool> {
        Pool::open_parts(
            self.metadata.clone(),
            self.data.clone(),
            Box::new(self.catalog.clone()),
            options,
            None,
        )
    }
}

impl<M, D, C> Clone for PoolParts<M, D, C> {
    /// The same parts (not a copy of their contents).
    fn clone(&self) -> PoolParts<M, D, C> {
        PoolParts {
            metadata: self.metadata.clone(),
            data: self.data.clone(),
            catalog: self.catalog.clone(),
        }
    }
}

impl<M, D, C> std::fmt::Debug for PoolParts<M, D, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolParts").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_pool_is_empty_and_sized_as_documented() {
        let pool = memory_pool();
        let status = pool.status();
        assert_eq!(status.data_total_blocks, DATA_BLOCKS);
        assert_eq!(status.data_used_blocks, 0);
        assert!(pool.list().is_empty());
    }

    #[test]
    fn reopened_parts_hold_what_the_pool_wrote() {
        let parts = MemoryParts::new(256, 16 * BLOCK_BYTES);
        let pool = parts.format(BLOCK_BYTES, deterministic_options());
        pool.create_volume("v", 4 * BLOCK_BYTES).unwrap();
        let volume = pool.volume("v").unwrap();
        volume.write(BLOCK_BYTES, &[7u8; 4096], false).unwrap();
        volume.flush().unwrap();
        drop(volume);
        pool.close().unwrap();
        drop(pool);
        let pool = parts.reopen(deterministic_options());
        let mut buf = [0u8; 4096];
        pool.volume("v")
            .unwrap()
            .read(BLOCK_BYTES, &mut buf)
            .unwrap();
        assert_eq!(buf, [7u8; 4096]);
        assert_eq!(pool.status().data_used_blocks, 1);
    }

    #[test]
    fn a_data_device_smaller_than_a_block_is_refused_before_formatting() {
        let parts = MemoryParts::new(256, BLOCK_BYTES / 2);
        let refused = std::panic::catch_unwind(|| {
            parts.format(BLOCK_BYTES, deterministic_options());
        });
        assert!(refused.is_err());
    }
}
