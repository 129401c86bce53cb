//! Management operations on an open pool: create, snapshot, delete and resize volumes,
//! grow the data and metadata devices, set the transaction id, hold and release the
//! metadata snapshot. Revert and rename are in `revert`.
//!
//! Each takes the commit lock, applies the ops queued before it (their data flushed), checks
//! every limit, then changes the catalog and the metadata in one transaction (catalog
//! `T + 1` stored first, see `catalog`), and only then the in-memory state (published
//! volumes, indexes, the pool time). A refused operation changes nothing. None of them
//! builds an index: a snapshot starts without one (its tree is its content), and a resize
//! or delete of a volume without one changes only the metadata.

use crate::engine::catalog::{validate_name, CatalogVolume};
use crate::engine::commit::{metadata_blocks_for_ops, metadata_reserve_blocks};
use crate::engine::index::{Index, INDEX_BLOCKS_MAX, INDEX_DATA_BLOCK_MAX};
use crate::engine::options::{PoolMode, VolumeInfo};
use crate::engine::pool::Pool;
use crate::engine::shared::{io_error, Shared, VolumeState};
use crate::error::{Error, Result};
use crate::ids::{TransactionId, VirtualBlock};
use persistent_data::btree::node::max_entries;
use persistent_data::space_map::core::{bitmap_count, ENTRIES_PER_BITMAP};
use persistent_data::space_map::METADATA_BLOCKS_MAX;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The largest volume, in bytes: 1 EiB. dm-thin's virtual block keys are 64-bit; the limit
/// is the index's ([`INDEX_BLOCKS_MAX`] blocks of the smallest block size, 64 KiB), and keeps
/// every byte offset far inside the `i64` that NBD clients and the kernel use. An unwritten
/// volume of this size costs 4 KiB of index.
pub const VOLUME_SIZE_MAX_BYTES: u64 = 1 << 60;

const _: () = assert!(VOLUME_SIZE_MAX_BYTES / (64 * 1024) <= INDEX_BLOCKS_MAX);

impl Pool {
    /// Create a thin volume of `size_bytes` (a multiple of 512).
    pub fn create_volume(&self, name: &str, size_bytes: u64) -> Result<VolumeInfo> {
        validate_name(name)?;
        check_size(size_bytes)?;
        let shared = &self.shared;
        let _commit = shared.lock_commit();
        shared.check_changes_allowed()?;
        let (mut meta, taken) = shared.flush_and_lock()?;
        if meta.catalog.find(name).is_some() {
            return Err(Error::NameExists(name.to_string()));
        }
        let id = meta.catalog.free_id()?;
        let entry = CatalogVolume {
            name: name.to_string(),
            id,
            size_bytes,
            read_only: false,
            origin: None,
        };
        let mut catalog = meta.catalog.clone();
        catalog.volumes.push(entry.clone());
        shared.catalog_transaction(&mut meta, taken, catalog, |md| md.create_thin(id))?;
        let volume = Arc::new(VolumeState::new(
            &entry,
            // Empty and 16 bytes a 2^36 blocks: built at once.
            Some(Arc::new(Index::new(
                size_bytes.div_ceil(shared.block_size_bytes),
            ))),
            shared.time(),
        ));
        shared.publish_volume(volume);
        drop(meta);
        self.info(name)
    }

    /// Snapshot `origin` as `name`. Pauses only the origin's writes, briefly.
    pub fn snapshot(&self, origin: &str, name: &str, read_only: bool) -> Result<VolumeInfo> {
        validate_name(name)?;
        let shared = &self.shared;
        let origin_volume = shared.volume_named(origin)?;
        let _pause = origin_volume.gate.pause();
        let _commit = shared.lock_commit();
        shared.check_changes_allowed()?;
        still_published(shared, origin, &origin_volume)?;
        let (mut meta, taken) = shared.flush_and_lock()?;
        if meta.catalog.find(name).is_some() {
            return Err(Error::NameExists(name.to_string()));
        }
        let id = meta.catalog.free_id()?;
        let entry = CatalogVolume {
            name: name.to_string(),
            id,
            size_bytes: origin_volume.size_bytes.load(Ordering::Acquire),
            read_only,
            origin: Some(origin_volume.id),
        };
        let mut catalog = meta.catalog.clone();
        catalog.volumes.push(entry.clone());
        let origin_id = origin_volume.id;
        shared.catalog_transaction(&mut meta, taken, catalog, |md| {
            md.create_snap(id, origin_id)
        })?;
        let time = meta.md()?.pool_time()?;
        shared.set_time(time);
        origin_volume
            .snapshotted_time
            .store(time.get(), Ordering::Release);
        // No index: its tree (the origin's root, shared) is its content until a first use
        // builds one (`Shared::index`), so a snapshot costs the same whatever its size.
        let volume = Arc::new(VolumeState::new(&entry, None, time));
        shared.publish_volume(volume);
        drop(meta);
        self.info(name)
    }

    /// Delete a volume. Refused (busy) while it is open; from the moment it is claimed
    /// until it is gone no handle can be opened, so when it returns no handle reaches the
    /// volume, and its thin id and data blocks can be given to another.
    pub fn delete_volume(&self, name: &str) -> Result<()> {
        let shared = &self.shared;
        let _commit = shared.lock_commit();
        shared.check_changes_allowed()?;
        let volume = shared.volume_named(name)?;
        volume.begin_delete()?;
        let result = (|| -> Result<()> {
            let (mut meta, taken) = shared.flush_and_lock()?;
            let mut catalog = meta.catalog.clone();
            let id = volume.id;
            // Its snapshots lose their origin: the id and the name may be reused.
            catalog.remove(id);
            shared.catalog_transaction(&mut meta, taken, catalog, |md| md.delete(id))?;
            // Under the metadata lock: no commit sees the volume's id free while the
            // volume is still published.
            shared.unpublish_volume(name);
            for snapshot in shared.volumes.load().values() {
                snapshot.forget_origin(id);
            }
            // Its freed blocks are in no index now: release (and pass down) at once.
            shared.reclaim_freed(&mut meta);
            Ok(())
        })();
        if result.is_err() {
            volume.end_delete();
        }
        result?;
        shared.space.notify_all();
        Ok(())
    }

    /// Change a volume's virtual size. Shrinking unmaps the blocks beyond the new end.
    pub fn resize_volume(&self, name: &str, size_bytes: u64) -> Result<VolumeInfo> {
        check_size(size_bytes)?;
        let shared = &self.shared;
        let volume = shared.volume_named(name)?;
        let _pause = volume.gate.pause();
        let _commit = shared.lock_commit();
        shared.check_changes_allowed()?;
        still_published(shared, name, &volume)?;
        let (mut meta, taken) = shared.flush_and_lock()?;
        let block_count = size_bytes.div_ceil(shared.block_size_bytes);
        let old_size = volume.size_bytes.load(Ordering::Acquire);
        let old_block_count = old_size.div_ceil(shared.block_size_bytes);
        if size_bytes < old_size && !size_bytes.is_multiple_of(shared.block_size_bytes) {
            return Err(Error::Invalid(format!(
                "shrinking to {size_bytes} bytes: a smaller size must be a multiple of the {}-byte block size",
                shared.block_size_bytes
            )));
        }
        let mut catalog = meta.catalog.clone();
        for v in catalog.volumes.iter_mut().filter(|v| v.name == name) {
            v.size_bytes = size_bytes;
        }
        let id = volume.id;
        shared.catalog_transaction(&mut meta, taken, catalog, |md| {
            if block_count < old_block_count {
                md.remove_range(
                    id,
                    VirtualBlock::new(block_count),
                    VirtualBlock::new(u64::MAX),
                )?;
            }
            Ok(())
        })?;
        // An unbuilt index is built later from the shrunk tree and the new size (both
        // changed under this metadata lock, which builds hold).
        if let Some(index) = volume.loaded_index() {
            index.clear_from(VirtualBlock::new(block_count));
            index.resize(block_count);
        }
        volume.size_bytes.store(size_bytes, Ordering::Release);
        // The blocks the shrink freed are in no index now: release (and pass down) at once.
        shared.reclaim_freed(&mut meta);
        drop(meta);
        self.info(name)
    }

    /// Grow the data device to `size_bytes` (a regular data file is extended; a block device
    /// must already be that large) and the pool with it, letting queued writes proceed.
    /// Returns the number of data blocks.
    pub fn grow_data(&self, size_bytes: u64) -> Result<u64> {
        self.shared.grow_data(size_bytes)
    }

    /// Grow the metadata device to `size_bytes` (a regular file is extended; None: use the
    /// device's current size) and the metadata space map with it. Returns the number of
    /// metadata blocks the space map manages.
    pub fn grow_metadata(&self, size_bytes: Option<u64>) -> Result<u64> {
        self.shared.grow_metadata(size_bytes)
    }
}

impl Shared {
    /// [`Pool::grow_data`] (also the autoextend thread's).
    pub(crate) fn grow_data(&self, size_bytes: u64) -> Result<u64> {
        let shared = self;
        let _commit = shared.lock_commit();
        self.check_data_grow(size_bytes)?;
        let device_bytes = shared
            .data
            .grow_to(size_bytes)
            .map_err(io_error("growing the data device".to_string()))?;
        let blocks = size_bytes.min(device_bytes) / shared.block_size_bytes;
        let (mut meta, taken) = shared.flush_and_lock()?;
        let md = meta.md()?;
        if blocks > md.data_space_map().block_count() {
            md.extend_data(blocks)?;
            shared.commit_locked(&mut meta, taken)?;
        }
        let blocks = meta.md()?.data_space_map().block_count();
        if shared.mode() == PoolMode::OutOfDataSpace {
            shared.set_mode(PoolMode::Write);
        }
        drop(meta);
        shared.space.notify_all();
        Ok(blocks)
    }

    /// [`Pool::grow_metadata`] (also the autoextend thread's).
    pub(crate) fn grow_metadata(&self, size_bytes: Option<u64>) -> Result<u64> {
        let shared = self;
        let _commit = shared.lock_commit();
        let wanted_blocks = size_bytes.map_or(0, |bytes| bytes / 4096);
        if wanted_blocks > METADATA_BLOCKS_MAX {
            return Err(Error::Invalid(format!(
                "metadata size {} bytes: the format addresses at most {METADATA_BLOCKS_MAX} blocks of 4 KiB ({} bytes)",
                size_bytes.unwrap_or(0),
                METADATA_BLOCKS_MAX * 4096
            )));
        }
        let blocks = shared
            .metadata_device
            .extend_to(wanted_blocks)
            .map_err(io_error("growing the metadata device".to_string()))?;
        let (mut meta, taken) = shared.flush_and_lock()?;
        if meta.md.as_ref().is_some_and(|md| md.needs_check()) {
            return Err(Error::ReadOnly { needs_check: true });
        }
        let result = meta.md()?.extend_metadata(blocks);
        let total = shared.checked(&mut meta, result)?;
        if shared.mode() == PoolMode::OutOfMetadataSpace {
            shared.set_mode(PoolMode::Write);
        }
        shared.commit_locked(&mut meta, taken)?;
        drop(meta);
        shared.space.notify_all();
        Ok(total)
    }
}

impl Pool {
    /// Set the user transaction id (the catalog follows it).
    pub fn set_transaction_id(&self, current: TransactionId, new: TransactionId) -> Result<()> {
        let shared = &self.shared;
        let _commit = shared.lock_commit();
        shared.check_changes_allowed()?;
        let (mut meta, taken) = shared.flush_and_lock()?;
        let mut catalog = meta.catalog.clone();
        catalog.transaction_id = new.get();
        shared.catalog_store.store(&catalog)?;
        let md = meta.md()?;
        md.set_transaction_id(current, new)?;
        shared.commit_locked(&mut meta, taken)?;
        meta.catalog = catalog;
        shared.catalog_store.committed(new.get())?;
        Ok(())
    }

    /// Hold a metadata snapshot (so `thin_dump -m` can read a consistent tree while serving).
    pub fn reserve_metadata_snap(&self) -> Result<u64> {
        let shared = &self.shared;
        let _commit = shared.lock_commit();
        shared.check_changes_allowed()?;
        let (mut meta, taken) = shared.flush_and_lock()?;
        shared.apply_ops(&mut meta, taken)?;
        let location = shared.commit_change(&mut meta, |md| md.reserve_metadata_snap())?;
        Ok(location.get())
    }

    /// Release the held metadata snapshot.
    pub fn release_metadata_snap(&self) -> Result<()> {
        let shared = &self.shared;
        let _commit = shared.lock_commit();
        shared.check_changes_allowed()?;
        let (mut meta, taken) = shared.flush_and_lock()?;
        shared.apply_ops(&mut meta, taken)?;
        shared.commit_change(&mut meta, |md| md.release_metadata_snap())
    }
}

/// Whether `volume`, looked up before the commit lock was taken, is still the one published
/// as `name`: a delete (and a create reusing its thin id) may have run in between.
pub(crate) fn still_published(
    shared: &Shared,
    name: &str,
    volume: &Arc<VolumeState>,
) -> Result<()> {
    match shared.volume_named(name) {
        Ok(now) if Arc::ptr_eq(&now, volume) => Ok(()),
        _ => Err(Error::NoSuchVolume(name.to_string())),
    }
}

fn check_size(size_bytes: u64) -> Result<()> {
    if size_bytes == 0 || !size_bytes.is_multiple_of(512) {
        return Err(Error::Invalid(format!(
            "volume size {size_bytes} bytes: must be a positive multiple of 512"
        )));
    }
    if size_bytes > VOLUME_SIZE_MAX_BYTES {
        return Err(Error::Invalid(format!(
            "volume size {size_bytes} bytes is larger than the largest volume, {VOLUME_SIZE_MAX_BYTES} bytes (1 EiB)"
        )));
    }
    Ok(())
}

impl Shared {
    /// Refuse a data grow to `size_bytes` that the pool could not map or record: more data
    /// blocks than the index and the format address, or a data space map whose new bitmaps
    /// and index would not fit in the free metadata blocks beside the reserve. Called before
    /// the data device changes.
    fn check_data_grow(&self, size_bytes: u64) -> Result<()> {
        let shared = self;
        let blocks = size_bytes / shared.block_size_bytes;
        let blocks_max = INDEX_DATA_BLOCK_MAX + 1;
        if blocks > blocks_max {
            return Err(Error::Invalid(format!(
                "data size {size_bytes} bytes is {blocks} blocks of {} bytes: a pool holds at most {blocks_max}",
                shared.block_size_bytes
            )));
        }
        let mut meta = shared.lock_meta();
        let ops = meta.ops.len();
        let md = meta.md()?;
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
            return Err(Error::Invalid(format!(
                "growing the data from {current} to {blocks} blocks needs {cost} metadata blocks for the data space map's bitmaps and index, and {reserve} stay reserved: {free} of the {total} metadata blocks are free; grow the metadata first"
            )));
        }
        Ok(())
    }
}

/// Metadata blocks the commit growing a data space map from `from` to `to` blocks may take,
/// counted high: the new bitmaps and the last old one (rewritten), the whole index btree for
/// the new size at half occupancy (leaves of 168 entries, internal nodes of 252), and the
/// metadata space map's bitmaps and index recording those blocks.
pub(crate) fn data_grow_metadata_blocks(from: u64, to: u64) -> u64 {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::options::{CreateOptions, PoolOptions};

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
