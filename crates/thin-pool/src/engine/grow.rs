//! Growing the data and the metadata of an open pool: [`grow_data`] and [`grow_metadata`],
//! called by `Pool` and by the autoextend worker. Free functions over the metadata owner,
//! the data device and the pool's health.
//!
//! Each refuses first what the pool could not record (more data blocks than the index and
//! the format address, a data space map that would not fit in the free metadata beside the
//! reserve, a metadata size beyond the format), then grows the device, then records the
//! new size in one commit (`Change::extend_data`, `Change::extend_metadata`), and wakes the
//! writes waiting for space.

use crate::engine::data_device::DataDevice;
use crate::engine::health::Health;
use crate::engine::index::INDEX_DATA_BLOCK_MAX;
use crate::engine::limits::{
    data_grow_metadata_blocks, metadata_blocks_for_ops, metadata_reserve_blocks,
};
use crate::engine::meta::Meta;
use crate::engine::options::PoolMode;
use crate::error::{Error, Limit, Result};
use persistent_data::space_map::METADATA_BLOCKS_MAX;

/// Grow the data device to `size_bytes` (a regular data file is extended; a block device
/// must already be that large) and the pool with it. Returns the number of data blocks.
pub(crate) fn grow_data(
    meta: &Meta,
    data: &dyn DataDevice,
    health: &Health,
    size_bytes: u64,
) -> Result<u64> {
    let turn = meta.turn();
    check_data_grow(meta, size_bytes)?;
    let device_bytes = data.grow_to(size_bytes).map_err(|source| Error::Io {
        what: "growing the data device".to_string(),
        source,
    })?;
    let blocks = size_bytes.min(device_bytes) / meta.block_size_bytes();
    let mut change = turn.begin()?;
    let blocks = change.extend_data(blocks)?;
    if health.mode() == PoolMode::OutOfDataSpace {
        health.set_mode(PoolMode::Write);
    }
    drop(change);
    meta.notify_space();
    Ok(blocks)
}

/// Grow the metadata device to `size_bytes` (a regular file is extended; None: use the
/// device's current size) and the metadata space map with it. Returns the number of
/// metadata blocks the space map manages.
pub(crate) fn grow_metadata(meta: &Meta, size_bytes: Option<u64>) -> Result<u64> {
    let turn = meta.turn();
    let wanted_blocks = size_bytes.map_or(0, |bytes| bytes / 4096);
    if wanted_blocks > METADATA_BLOCKS_MAX {
        return Err(Error::SizeOverLimit {
            what: Limit::MetadataBytes,
            requested: size_bytes.unwrap_or(0),
            max: METADATA_BLOCKS_MAX * 4096,
        });
    }
    let blocks = meta.extend_device(wanted_blocks)?;
    let mut change = turn.begin()?;
    let total = change.extend_metadata(blocks)?;
    drop(change);
    meta.notify_space();
    Ok(total)
}

/// Refuse a data grow to `size_bytes` that the pool could not map or record: more data
/// blocks than the index and the format address, or a data space map whose new bitmaps and
/// index would not fit in the free metadata blocks beside the reserve. Called before the
/// data device changes.
fn check_data_grow(meta: &Meta, size_bytes: u64) -> Result<()> {
    let block_size = meta.block_size_bytes();
    let blocks = size_bytes / block_size;
    let blocks_max = INDEX_DATA_BLOCK_MAX + 1;
    if blocks > blocks_max {
        return Err(Error::SizeOverLimit {
            what: Limit::DataBlocks { size_bytes },
            requested: blocks,
            max: blocks_max,
        });
    }
    meta.read(|view| {
        let ops = view.queue.len();
        let md = view.md()?;
        let current = md.data_space_map().block_count();
        if blocks <= current {
            return Ok(());
        }
        let usage = md.usage();
        let total = usage.metadata_total_blocks;
        let free = total - usage.metadata_used_blocks;
        let cost = data_grow_metadata_blocks(current, blocks);
        let reserve = metadata_reserve_blocks(total);
        let needed = cost + reserve + metadata_blocks_for_ops(ops);
        if needed > free {
            return Err(Error::GrowNeedsMetadata {
                from_blocks: current,
                to_blocks: blocks,
                cost_blocks: cost,
                reserve_blocks: reserve,
                free_blocks: free,
                total_blocks: total,
            });
        }
        Ok(())
    })
}
