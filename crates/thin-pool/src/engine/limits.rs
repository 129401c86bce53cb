//! The engine's limits and the metadata-space arithmetic every layer checks against: the
//! largest volume, the metadata blocks kept free for management, what a commit of `n` ops
//! and a data grow may take. Pure functions; no state.
//!
//! Every management operation checks its limits before it changes anything (here, in
//! `open.rs` and in `grow.rs`): volumes up to 1 EiB ([`VOLUME_SIZE_MAX_BYTES`]), at most
//! 2^40 − 1 data blocks, 255 × 16320 metadata blocks (`METADATA_BLOCKS_MAX`), and a data grow
//! is refused when its new space map does not fit beside the metadata reserve (a tenth of the
//! metadata blocks, 8 to 4096: [`metadata_reserve_blocks`]). The metadata file is preallocated
//! at create and grow, so a full host file system cannot fail a commit; the data file stays
//! sparse, and a host ENOSPC on it reaches the client as ENOSPC.

use crate::engine::index::INDEX_BLOCKS_MAX;
use crate::error::{Error, Limit, Result};
use persistent_data::btree::node::max_entries;
use persistent_data::space_map::core::{bitmap_count, ENTRIES_PER_BITMAP};

/// The largest volume, in bytes: 1 EiB. dm-thin's virtual block keys are 64-bit; the limit
/// is the index's (`INDEX_BLOCKS_MAX` blocks of the smallest block size, 64 KiB), and keeps
/// every byte offset far inside the `i64` that NBD clients and the kernel use. An unwritten
/// volume of this size costs 4 KiB of index.
pub const VOLUME_SIZE_MAX_BYTES: u64 = 1 << 60;

const _: () = assert!(VOLUME_SIZE_MAX_BYTES / (64 * 1024) <= INDEX_BLOCKS_MAX);

/// Metadata blocks one commit may need per applied op: roughly a leaf split every 126
/// inserts (over-estimated as one per 64 ops), plus a path shadow per volume touched.
const METADATA_BLOCKS_PER_OP_DIVISOR: u64 = 64;
const METADATA_BLOCKS_PER_COMMIT: u64 = 16;

/// Metadata blocks kept free for management operations (writes stop before they take them).
pub(crate) fn metadata_reserve_blocks(total: u64) -> u64 {
    (total / 10).clamp(8, 4096)
}

/// Metadata blocks a commit applying `count` ops may need.
pub(crate) fn metadata_blocks_for_ops(count: usize) -> u64 {
    count as u64 / METADATA_BLOCKS_PER_OP_DIVISOR + METADATA_BLOCKS_PER_COMMIT
}

/// Metadata blocks the commit growing a data space map from `from` to `to` blocks may take,
/// counted high: the new bitmaps and the last old one (rewritten), the whole index btree for
/// the new size at half occupancy (leaves of 168 entries, internal nodes of 252), and the
/// metadata space map's bitmaps and index recording those blocks.
pub(crate) fn data_grow_metadata_blocks(from: u64, to: u64) -> u64 {
    debug_assert!(from <= to, "a data grow never shrinks ({from} → {to})");
    let old = bitmap_count(from) as u64;
    let new = bitmap_count(to) as u64;
    let bitmaps = new - old + u64::from(old > 0);
    let mut level = new.div_ceil(max_entries(16) as u64 / 2).max(1);
    let mut index = level;
    while level > 1 {
        level = level.div_ceil(max_entries(8) as u64 / 2);
        index += level;
    }
    let blocks = bitmaps + index;
    blocks + blocks.div_ceil(ENTRIES_PER_BITMAP) + 1
}

/// A volume size a create or resize may ask for: a positive multiple of 512, at most
/// [`VOLUME_SIZE_MAX_BYTES`].
pub(crate) fn check_volume_size(size_bytes: u64) -> Result<()> {
    if size_bytes == 0 || !size_bytes.is_multiple_of(512) {
        return Err(Error::BadVolumeSize { size_bytes });
    }
    if size_bytes > VOLUME_SIZE_MAX_BYTES {
        return Err(Error::SizeOverLimit {
            what: Limit::VolumeBytes,
            requested: size_bytes,
            max: VOLUME_SIZE_MAX_BYTES,
        });
    }
    Ok(())
}

/// Runs of consecutive numbers in sorted `blocks`, as (first, count).
pub(crate) fn block_runs(blocks: &[u64]) -> Vec<(u64, u64)> {
    debug_assert!(blocks.windows(2).all(|w| w[0] < w[1]), "sorted, distinct");
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &block in blocks {
        match runs.last_mut() {
            Some((first, count)) if *first + *count == block => *count += 1,
            _ => runs.push((block, 1)),
        }
    }
    runs
}

/// `metadata_blocks` hold the formatted pool (superblock, empty trees, the metadata space
/// map), the data space map of `data_blocks` and the reserve: the check of every create, on
/// files or on block devices.
pub(crate) fn check_metadata_room(metadata_blocks: u64, data_blocks: u64) -> Result<()> {
    if metadata_blocks < 64 {
        return Err(Error::MetadataTooSmall {
            blocks: metadata_blocks,
        });
    }
    let space_map = data_grow_metadata_blocks(0, data_blocks);
    let reserve = metadata_reserve_blocks(metadata_blocks);
    // The superblock, the empty trees and the metadata space map's own blocks.
    let formatted = 8 + metadata_blocks.div_ceil(ENTRIES_PER_BITMAP);
    if space_map + reserve + formatted > metadata_blocks {
        return Err(Error::MetadataCannotMap {
            metadata_blocks,
            data_blocks,
            space_map_blocks: space_map,
            reserve_blocks: reserve,
            formatted_blocks: formatted,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{block_runs, data_grow_metadata_blocks};
    use crate::engine::options::{CreateOptions, PoolOptions};
    use crate::Pool;

    #[test]
    fn runs_join_neighbours_only() {
        assert_eq!(block_runs(&[]), vec![]);
        assert_eq!(block_runs(&[3]), vec![(3, 1)]);
        assert_eq!(
            block_runs(&[1, 2, 3, 5, 7, 8]),
            vec![(1, 3), (5, 1), (7, 2)]
        );
    }

    /// The estimate of a data grow's metadata cost is never below what the grow takes.
    #[test]
    fn the_data_grow_estimate_covers_the_blocks_used() {
        let dir = std::env::temp_dir().join(format!("tp-grow-estimate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let block = 64 * 1024;
        let pool = Pool::create(
            &dir,
            &CreateOptions {
                data_size_bytes: 256 << 20,
                block_size_bytes: block,
                metadata_size_bytes: Some(64 << 20),
            },
            PoolOptions {
                commit_interval: None,
                ..PoolOptions::default()
            },
        )
        .unwrap();
        let mut blocks = 4096;
        // 1 GiB, 1 TiB, 4 TiB of 64 KiB blocks (the data file is sparse).
        for next in [1u64 << 14, 1 << 24, 1 << 26] {
            let before = pool.status().metadata_used_blocks;
            assert_eq!(pool.grow_data(next * block).unwrap(), next);
            let used = pool.status().metadata_used_blocks - before;
            let estimate = data_grow_metadata_blocks(blocks, next);
            assert!(
                used <= estimate,
                "{blocks} → {next}: used {used}, estimated {estimate}"
            );
            blocks = next;
        }
        pool.close().unwrap();
        drop(pool);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
