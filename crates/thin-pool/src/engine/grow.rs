//! Growing the data and the metadata of an open pool, [`grow_data`] and [`grow_metadata`]
//! (called by `Pool` and by the autoextend worker), and resizing a volume,
//! [`resize_volume`] (called by `Pool`). Free functions over the metadata owner, the volume
//! registry, the data device and the pool's health.
//!
//! Each data or metadata grow refuses first what the pool could not record (more data
//! blocks than the index and the format address, a data space map that would not fit in
//! the free metadata beside the reserve, a metadata size beyond the format), then grows the
//! device, then records the new size in one commit (`Change::extend_data`,
//! `Change::extend_metadata`), and wakes the writes waiting for space.
//!
//! **Safe shrink.** A volume grows while clients use it (its writers paused for a moment),
//! but shrinks only when no handle is open: the shrink claims the volume as a delete, a
//! revert and a rename do (`VolumeState::claim`, busy with the number of handles), so no
//! client ever sees its blocks vanish under it, and no handle opens until it is done. A
//! shrink that would unmap mapped blocks is refused ([`Error::ShrinkWouldUnmap`], with how
//! many) unless the caller passes [`Shrink::DropData`]; one past unmapped blocks only needs
//! nothing. The count is taken under the commit lock from what the volume maps: its index
//! if built (the tree plus the queued ops), else its tree (a volume without an index has no
//! queued op), and the removal that follows must remove exactly that many. Every caller
//! (the control socket, the offline CLI, tests) goes through this policy.

use crate::engine::data_device::DataDevice;
use crate::engine::health::Health;
use crate::engine::index::INDEX_DATA_BLOCK_MAX;
use crate::engine::limits::check_volume_size;
use crate::engine::limits::{
    data_grow_metadata_blocks, metadata_blocks_for_ops, metadata_reserve_blocks,
};
use crate::engine::meta::{Change, Meta};
use crate::engine::options::{PoolMode, VolumeInfo};
use crate::engine::volumes::{VolumeState, Volumes};
use crate::error::{Error, Limit, Result};
use crate::ids::VirtualBlock;
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

/// What a shrink may do to the data a volume maps beyond its new end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Shrink {
    /// Refuse a shrink that would unmap mapped blocks ([`Error::ShrinkWouldUnmap`]); one
    /// past unmapped blocks only goes ahead.
    #[default]
    KeepData,
    /// Unmap whatever lies beyond the new end (the operator's `--force`).
    DropData,
}

/// What [`Pool::resize_volume`](crate::Pool::resize_volume) did.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Resized {
    /// The volume, resized.
    pub volume: VolumeInfo,
    /// Mapped blocks the shrink unmapped (0 for a grow, or a shrink past unmapped blocks).
    pub unmapped_blocks: u64,
    /// Their bytes.
    pub unmapped_bytes: u64,
}

impl Resized {
    pub(crate) fn new(volume: VolumeInfo, unmapped_blocks: u64) -> Resized {
        let unmapped_bytes = unmapped_blocks * volume.block_size_bytes;
        Resized {
            volume,
            unmapped_blocks,
            unmapped_bytes,
        }
    }
}

/// Change a volume's virtual size. Growing is allowed while the volume is open; shrinking
/// is refused (busy) while it is, and refused past mapped blocks unless `shrink` is
/// [`Shrink::DropData`] (see the module doc). Returns the blocks the shrink unmapped.
pub(crate) fn resize_volume(
    meta: &Meta,
    volumes: &Volumes,
    name: &str,
    size_bytes: u64,
    shrink: Shrink,
) -> Result<u64> {
    check_volume_size(size_bytes)?;
    let volume = volumes.named(name)?;
    let _pause = volume.gate().pause();
    // Sizes change only with the writers paused: this is the size the resize changes.
    let shrinking = size_bytes < volume.size_bytes();
    if shrinking {
        volume.claim("shrinking it")?;
    }
    let result = (|| {
        let turn = meta.changes()?;
        volumes.still_published(name, &volume)?;
        let mut change = turn.begin()?;
        resize_locked(&mut change, meta, &volume, size_bytes, shrink)
    })();
    if shrinking {
        volume.end_delete();
    }
    result
}

/// [`resize_volume`] under the commit lock and the metadata mutex, the volume's writers
/// paused (and, shrinking, no handle open).
fn resize_locked(
    change: &mut Change<'_>,
    meta: &Meta,
    volume: &VolumeState,
    size_bytes: u64,
    shrink: Shrink,
) -> Result<u64> {
    let block_size = meta.block_size_bytes();
    let block_count = size_bytes.div_ceil(block_size);
    let old_size = volume.size_bytes();
    let old_block_count = old_size.div_ceil(block_size);
    if size_bytes < old_size && !size_bytes.is_multiple_of(block_size) {
        return Err(Error::ShrinkNotAligned {
            size_bytes,
            block_size_bytes: block_size,
        });
    }
    let end = VirtualBlock::new(block_count);
    let mapped = if block_count < old_block_count {
        mapped_from(change, volume, end)?
    } else {
        0
    };
    if mapped > 0 && shrink == Shrink::KeepData {
        return Err(Error::ShrinkWouldUnmap {
            volume: volume.name().to_string(),
            size_bytes: old_size,
            new_size_bytes: size_bytes,
            mapped_blocks: mapped,
            mapped_bytes: mapped * block_size,
        });
    }
    let mut catalog = change.catalog().clone();
    catalog.set_content_changed(volume.id(), size_bytes);
    let id = volume.id();
    let mut removed = 0;
    change.commit_catalog(catalog, |md| {
        if mapped > 0 {
            removed = md.remove_range(id, end, VirtualBlock::new(u64::MAX))?;
        }
        Ok(())
    })?;
    assert_eq!(
        removed,
        mapped,
        "volume {:?}: the shrink removes what it counted",
        volume.name()
    );
    // An unbuilt index is built later from the shrunk tree and the new size (both changed
    // under this metadata lock, which builds hold).
    if let Some(index) = volume.loaded_index() {
        index.clear_from(end);
        index.resize(block_count);
        assert_eq!(index.block_count(), block_count);
    }
    volume.set_size_bytes(size_bytes);
    // The blocks the shrink freed are in no index now: release (and pass down) at once.
    change.reclaim_freed();
    Ok(mapped)
}

/// The blocks `volume` maps at or beyond `end`: counted in its index if built (the tree
/// plus the queued ops), else in its tree, one lookup per mapped block (what removing them
/// costs anyway).
fn mapped_from(change: &Change<'_>, volume: &VolumeState, end: VirtualBlock) -> Result<u64> {
    let mut count = 0;
    if let Some(index) = volume.loaded_index() {
        index.for_each_in(end, VirtualBlock::new(u64::MAX), &mut |_, _| count += 1);
        return Ok(count);
    }
    let view = change.view();
    let md = view.md()?;
    let mut next = end;
    while let Some((block, _)) = md.lookup_next(volume.id(), next)? {
        count += 1;
        match block.get().checked_add(1) {
            Some(after) => next = VirtualBlock::new(after),
            None => break,
        }
    }
    Ok(count)
}
