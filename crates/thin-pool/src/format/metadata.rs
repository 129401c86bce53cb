//! Pool metadata: dm-thin's on-disk metadata and its operations (spec §6, §8, §10.3).
//!
//! [`PoolMetadata`] is the one writer of a metadata device. It keeps, per volume, the
//! details and the root of the volume's mapping tree in memory, and writes them into the
//! details tree and the top level of the mapping tree at commit, as the kernel does.
//!
//! Sharing: a snapshot shares its origin's mapping root (one more reference, O(1)). The
//! first change to a volume's tree in a transaction first rewrites the volume's entry in the
//! top level ("touch"), so that a top-level leaf shared with a metadata snapshot is copied
//! (taking a reference to every subtree root it holds) before the subtree is shadowed.
//!
//! Reference counting of values (spec §7.8):
//! - a bottom-level leaf entry holds one reference to its data block (a leaf shared by
//!   several trees counts once; copying a shared leaf takes a reference per entry);
//! - a top-level leaf entry holds one reference to its subtree root.
//!
//! Data blocks for writes in flight are *reserved* here, outside the space map
//! (`data_space`); the volume and mapping operations are in `mapping`.
//!
//! Failure rule: every operation checks its preconditions before it changes anything, so a
//! refused operation (an error before the first change) leaves the transaction intact. An
//! error after the first change marks the transaction failed
//! ([`PoolMetadata::transaction_failed`]): every later change and the commit are refused,
//! and the caller must reopen the metadata (abandoning the transaction, as dm-thin does).

mod data_space;
mod mapping;
pub mod usage;

use crate::error::{Error, Result};
use crate::format::details::DeviceDetails;
use crate::format::superblock::{self, Superblock, NEEDS_CHECK_FLAG};
use crate::format::writer::{self, NewPool};
use crate::ids::{DataBlock, Time, TransactionId, VolumeId, DATA_BLOCK_MAX};
use data_space::{DataSpace, SubtreeDelete, SubtreeUpdate};
use persistent_data::block_manager::{BlockManager, CACHE_BLOCKS_DEFAULT};
use persistent_data::btree::{self, NoRefs};
use persistent_data::space_map::DataSpaceMap;
use persistent_data::{BlockDevice, MetadataBlock, TransactionManager};
use std::collections::BTreeMap;
use std::sync::Arc;

/// A mapping found in a volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mapping {
    /// Where the block's data lives.
    pub data_block: DataBlock,
    /// Pool time when the mapping was made.
    pub time: u32,
    /// Whether another volume may share the data block (spec §8.5: the volume was
    /// snapshotted after the mapping was made). Conservative: may be true after sharing
    /// was already broken.
    pub shared: bool,
}

#[derive(Clone, Debug)]
struct VolumeState {
    details: DeviceDetails,
    root: MetadataBlock,
    /// `root` differs from the top-level entry (or there is none yet).
    root_changed: bool,
    /// The top-level path to this volume was rewritten in this transaction.
    touched: bool,
    details_changed: bool,
}

impl VolumeState {
    /// A volume created in this transaction, with mapping tree `root`.
    fn created(details: DeviceDetails, root: MetadataBlock) -> VolumeState {
        VolumeState {
            details,
            root,
            root_changed: true,
            touched: true,
            details_changed: true,
        }
    }
}

/// Pool-wide counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    /// Data blocks in use: referenced by a mapping, or reserved for a write in flight.
    pub data_used_blocks: u64,
    /// Data blocks in the pool.
    pub data_total_blocks: u64,
    /// Metadata blocks in use.
    pub metadata_used_blocks: u64,
    /// Metadata blocks managed.
    pub metadata_total_blocks: u64,
}

/// dm-thin pool metadata, open for reading and writing.
pub struct PoolMetadata {
    tm: TransactionManager,
    data: DataSpace,
    superblock: Superblock,
    mapping_root: MetadataBlock,
    details_root: MetadataBlock,
    volumes: BTreeMap<VolumeId, VolumeState>,
    /// Something changed since the last commit.
    changed: bool,
    /// An operation failed after changing something: the transaction must be abandoned.
    failed: bool,
    /// Commits started since this metadata was opened: a reader of committed blocks
    /// without the lock (`engine::usage`) knows none of them was reused while the count
    /// grew by at most one.
    commits_started: u64,
}

impl std::fmt::Debug for PoolMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolMetadata")
            .field("time", &self.superblock.time)
            .field("transaction_id", &self.superblock.transaction_id)
            .field("volumes", &self.volumes.len())
            .finish()
    }
}

fn check_volume_id(id: u64) -> Result<VolumeId> {
    if id > u64::from(VolumeId::MAX.get()) {
        return Err(Error::BadVolumeId(id));
    }
    Ok(VolumeId::new(id as u32))
}

impl PoolMetadata {
    /// Refuse changes to metadata that needs a check, or whose transaction failed.
    fn check_writable(&self) -> Result<()> {
        self.check_not_failed()?;
        if self.needs_check() {
            return Err(Error::ReadOnly { needs_check: true });
        }
        Ok(())
    }

    /// Refuse to go on with a transaction an operation failed part way through.
    fn check_not_failed(&self) -> Result<()> {
        if self.failed {
            return Err(Error::Internal(
                "a metadata operation failed part way: the transaction must be abandoned"
                    .to_string(),
            ));
        }
        Ok(())
    }

    /// Run `change`, the part of an operation after its checks: on error the transaction
    /// holds part of the change, so it is marked failed.
    fn change<T>(&mut self, change: impl FnOnce(&mut PoolMetadata) -> Result<T>) -> Result<T> {
        self.changed = true;
        let result = change(self);
        if result.is_err() {
            self.failed = true;
        }
        result
    }
}

impl PoolMetadata {
    /// Format `device` as empty pool metadata for data blocks of `data_block_size_sectors`
    /// and a data device of `data_block_count` blocks, and commit it.
    pub fn format(
        device: Arc<dyn BlockDevice>,
        data_block_size_sectors: u32,
        data_block_count: u64,
    ) -> Result<PoolMetadata> {
        let new_pool = NewPool {
            data_block_size_sectors,
            data_block_count,
            time: Time::default(),
            transaction_id: TransactionId::default(),
        };
        let writer::Formatted {
            mut tm,
            data_sm,
            superblock,
        } = writer::format(device, &new_pool)?;
        let data = DataSpace::new(data_sm);
        let mapping_root = btree::create_empty::<u64>(&mut tm)?;
        let details_root = btree::create_empty::<DeviceDetails>(&mut tm)?;
        let mut metadata = PoolMetadata {
            tm,
            data,
            superblock,
            mapping_root,
            details_root,
            volumes: BTreeMap::new(),
            changed: true,
            failed: false,
            commits_started: 0,
        };
        metadata.commit()?;
        Ok(metadata)
    }

    /// Open existing metadata on `device`.
    pub fn open(device: Arc<dyn BlockDevice>) -> Result<PoolMetadata> {
        let bm = Arc::new(BlockManager::new(device, CACHE_BLOCKS_DEFAULT));
        let superblock = Superblock::read(&bm, MetadataBlock::SUPERBLOCK)?;
        if superblock.metadata_space_map.is_empty() {
            return Err(Error::Metadata(persistent_data::Error::corrupt(
                MetadataBlock::SUPERBLOCK,
                "superblock has no metadata space map",
            )));
        }
        let tm = TransactionManager::open(bm.clone(), &superblock.metadata_space_map)?;
        let data = DataSpace::new(DataSpaceMap::open(&*bm, &superblock.data_space_map)?);
        let mapping_root = superblock.data_mapping_root;
        let details_root = superblock.device_details_root;
        let mut volumes = BTreeMap::new();
        btree::walk::<DeviceDetails, _>(&*bm, details_root, &mut |key, details| {
            let id = check_volume_id(key).map_err(|_| {
                persistent_data::Error::corrupt(
                    details_root,
                    format!("device id {key} out of range"),
                )
            })?;
            volumes.insert(
                id,
                VolumeState {
                    details,
                    root: MetadataBlock::new(0),
                    root_changed: false,
                    touched: false,
                    details_changed: false,
                },
            );
            Ok(())
        })?;
        let mut roots_found = 0usize;
        let mut mismatch = None;
        btree::walk::<u64, _>(&*bm, mapping_root, &mut |key, root| {
            match u32::try_from(key)
                .ok()
                .and_then(|k| volumes.get_mut(&VolumeId::new(k)))
            {
                Some(state) => {
                    state.root = MetadataBlock::new(root);
                    roots_found += 1;
                }
                None => mismatch = Some(key),
            }
            Ok(())
        })?;
        if mismatch.is_some() || roots_found != volumes.len() {
            return Err(Error::Metadata(persistent_data::Error::corrupt(
                mapping_root,
                "the details tree and the mapping tree list different devices",
            )));
        }
        Ok(PoolMetadata {
            tm,
            data,
            superblock,
            mapping_root,
            details_root,
            volumes,
            changed: false,
            failed: false,
            commits_started: 0,
        })
    }

    /// The superblock as of the last commit, with in-memory changes to time and transaction id.
    pub fn superblock(&self) -> &Superblock {
        &self.superblock
    }

    /// Data block size in sectors.
    pub fn data_block_size_sectors(&self) -> u32 {
        self.superblock.data_block_size_sectors
    }

    /// The pool's snapshot epoch.
    pub fn time(&self) -> u32 {
        self.superblock.time
    }

    /// The pool's snapshot epoch as a mapping stores it (24 bits).
    pub fn pool_time(&self) -> Result<Time> {
        Time::new(self.superblock.time).ok_or_else(|| {
            Error::Corrupt(format!(
                "pool time {} does not fit in a mapping's 24 bits",
                self.superblock.time
            ))
        })
    }

    /// The user transaction id.
    pub fn transaction_id(&self) -> TransactionId {
        TransactionId::new(self.superblock.transaction_id)
    }

    /// Whether the needs_check flag is set.
    pub fn needs_check(&self) -> bool {
        self.superblock.needs_check()
    }

    /// The metadata snapshot's superblock block, if one is held.
    pub fn metadata_snap(&self) -> Option<MetadataBlock> {
        self.superblock.metadata_snap
    }

    /// Commits started since this metadata was opened. Blocks of the last committed
    /// transaction stay intact on the device until the commit after the next one starts
    /// (a block freed by a transaction is reused only by a later one).
    pub fn commits_started(&self) -> u64 {
        self.commits_started
    }

    /// Whether anything changed since the last commit.
    pub fn has_changes(&self) -> bool {
        self.changed
    }

    /// The transaction manager (read access for checkers and dumps).
    pub fn transaction_manager(&self) -> &TransactionManager {
        &self.tm
    }

    /// Whether an operation failed after changing something: the transaction is refused
    /// from then on and must be abandoned (reopen the metadata).
    pub fn transaction_failed(&self) -> bool {
        self.failed
    }

    /// The data space map: references of committed and applied mappings (reserved blocks
    /// are not in it; see [`PoolMetadata::usage`] for the counts that include them).
    pub fn data_space_map(&self) -> &DataSpaceMap {
        self.data.map()
    }

    /// Pool-wide counters.
    pub fn usage(&self) -> Usage {
        let meta = self.tm.space_map();
        Usage {
            data_used_blocks: self.data.used_count(),
            data_total_blocks: self.data.block_count(),
            metadata_used_blocks: meta.allocated_count(),
            metadata_total_blocks: meta.block_count(),
        }
    }

    /// Reserve a free data block for a mapping: it counts as used but stays out of the
    /// space map (and of any commit) until [`PoolMetadata::insert`] maps it, or
    /// [`PoolMetadata::release_data_block`] gives it back.
    pub fn alloc_data_block(&mut self) -> Result<DataBlock> {
        self.check_writable()?;
        self.data.reserve()
    }

    /// Give back a reserved block that will not be mapped. Returns whether it was reserved.
    pub fn release_data_block(&mut self, block: DataBlock) -> bool {
        self.data.release(block)
    }

    /// Runs `(first block, count)` of free data blocks in `begin..end`: free in the space
    /// map, not reserved, not held, and not freed by the transaction under way (the
    /// committed metadata may still map those).
    pub fn free_data_runs(&self, begin: u64, end: u64) -> Vec<(u64, u64)> {
        self.data.free_runs(begin, end)
    }

    /// Whether `block` is reserved for a mapping not made yet.
    pub fn is_reserved(&self, block: DataBlock) -> bool {
        self.data.is_reserved(block)
    }

    /// Reference count of a data block (0 for a free or reserved block).
    pub fn data_block_count(&self, block: DataBlock) -> u32 {
        self.data.count(block)
    }

    /// From now on, a commit holds the data blocks its transaction freed instead of making
    /// them reservable, until [`PoolMetadata::release_held_data_block`] (the engine keeps
    /// them from reuse while lock-free I/O may still reach them). Held blocks are free in
    /// the space map; like reservations they live in memory only.
    pub fn hold_freed_data_blocks(&mut self) {
        self.data.set_hold_freed(true);
    }

    /// The data blocks commits held since the last call.
    pub fn take_newly_held_data_blocks(&mut self) -> Vec<DataBlock> {
        self.data.take_newly_held()
    }

    /// Hold a free data block (count zero, not reserved). Returns whether it is now held.
    pub fn hold_data_block(&mut self, block: DataBlock) -> bool {
        self.data.hold(block)
    }

    /// Whether a data block is held.
    pub fn is_held(&self, block: DataBlock) -> bool {
        self.data.is_held(block)
    }

    /// Let a held data block be reserved again. Returns whether it was held.
    pub fn release_held_data_block(&mut self, block: DataBlock) -> bool {
        self.data.release_held(block)
    }

    /// Grow the data space map to `block_count` data blocks (never shrinks).
    pub fn extend_data(&mut self, block_count: u64) -> Result<()> {
        self.check_writable()?;
        let current = self.data.block_count();
        if block_count < current {
            return Err(Error::DataDeviceShrank {
                device_blocks: block_count,
                recorded_blocks: current,
            });
        }
        if block_count > DATA_BLOCK_MAX + 1 {
            return Err(Error::SizeOverLimit {
                what: crate::error::Limit::FormatDataBlocks,
                requested: block_count,
                max: 1 << 40,
            });
        }
        if block_count > current {
            self.data.extend(block_count);
            self.changed = true;
        }
        Ok(())
    }

    /// Grow the metadata space map to the metadata device's current size (capped at the
    /// format's limit). Returns the new number of metadata blocks.
    pub fn extend_metadata(&mut self, block_count: u64) -> Result<u64> {
        self.check_writable()?;
        self.change(|md| md.tm.extend(block_count).map_err(Error::from))?;
        Ok(self.tm.space_map().block_count())
    }

    /// `set_transaction_id`.
    pub fn set_transaction_id(&mut self, current: TransactionId, new: TransactionId) -> Result<()> {
        self.check_writable()?;
        if current.get() != self.superblock.transaction_id {
            return Err(Error::TransactionMismatch {
                expected: current,
                actual: TransactionId::new(self.superblock.transaction_id),
            });
        }
        self.superblock.transaction_id = new.get();
        self.changed = true;
        Ok(())
    }

    /// Write everything changed into the trees and space maps and commit atomically
    /// (spec §8.3). On error the caller must abandon the transaction (reopen).
    pub fn commit(&mut self) -> Result<()> {
        self.check_not_failed()?;
        self.commits_started += 1;
        self.change(PoolMetadata::commit_changes)?;
        self.changed = false;
        Ok(())
    }

    fn commit_changes(&mut self) -> Result<()> {
        let ids: Vec<VolumeId> = self.volumes.keys().copied().collect();
        for id in ids {
            let state = self.volumes.get(&id).expect("listed volume").clone();
            let key = u64::from(id.get());
            if state.root_changed {
                let (root, _) = btree::insert(
                    &mut self.tm,
                    &mut SubtreeUpdate,
                    self.mapping_root,
                    key,
                    &state.root.get(),
                )?;
                self.mapping_root = root;
            }
            if state.details_changed {
                let (root, _) = btree::insert(
                    &mut self.tm,
                    &mut NoRefs,
                    self.details_root,
                    key,
                    &state.details,
                )?;
                self.details_root = root;
            }
            let state = self.volumes.get_mut(&id).expect("listed volume");
            state.root_changed = false;
            state.details_changed = false;
            state.touched = false;
        }
        let data_space_map = self.data.commit(&mut self.tm)?;
        writer::commit(
            &mut self.tm,
            &mut self.superblock,
            data_space_map,
            self.mapping_root,
            self.details_root,
        )
    }

    /// `reserve_metadata_snap`: commit, then keep a copy of the superblock (with no space
    /// maps) whose trees stay intact while it is held.
    pub fn reserve_metadata_snap(&mut self) -> Result<MetadataBlock> {
        self.check_writable()?;
        if let Some(held) = self.metadata_snap() {
            return Err(Error::MetadataSnapExists(held.get()));
        }
        self.commit()?;
        let location = self.change(|md| {
            let location = md.tm.new_block()?;
            let copy = md.superblock.metadata_snapshot(location);
            md.tm.inc(md.mapping_root)?;
            md.tm.inc(md.details_root)?;
            md.tm.write_raw_superblock(location, copy.encode());
            md.superblock.metadata_snap = Some(location);
            Ok(location)
        })?;
        self.commit()?;
        Ok(location)
    }

    /// `release_metadata_snap`: drop the held metadata snapshot and what only it references.
    pub fn release_metadata_snap(&mut self) -> Result<()> {
        self.check_writable()?;
        let location = self.metadata_snap().ok_or(Error::NoMetadataSnap)?;
        let snap = Superblock::read(self.tm.block_manager(), location)?;
        self.change(|md| {
            btree::delete_tree::<u64, _>(
                &mut md.tm,
                &mut SubtreeDelete(&mut md.data),
                snap.data_mapping_root,
            )?;
            btree::delete_tree::<DeviceDetails, _>(
                &mut md.tm,
                &mut NoRefs,
                snap.device_details_root,
            )?;
            md.tm.dec(location)?;
            md.superblock.metadata_snap = None;
            Ok(())
        })?;
        self.commit()
    }

    /// Set the needs_check flag directly in the on-disk superblock (no commit), as the kernel
    /// does after a failed metadata operation. The in-memory transaction is abandoned by the
    /// caller.
    pub fn mark_needs_check(device: &dyn BlockDevice) -> Result<()> {
        let mut data = persistent_data::block::zeroed_block();
        device
            .read(MetadataBlock::SUPERBLOCK, &mut data)
            .map_err(|source| Error::Io {
                what: "reading the superblock".to_string(),
                source,
            })?;
        superblock::set_needs_check(&mut data);
        let io = |source| Error::Io {
            what: "writing the needs_check flag".to_string(),
            source,
        };
        device.write(MetadataBlock::SUPERBLOCK, &data).map_err(io)?;
        device.flush().map_err(io)
    }

    /// Drop every count of blocks a check found no reference to (leaks: `thin_check
    /// --auto-repair`), and commit. The caller passes only leaked blocks: a referenced block
    /// given here would be freed under its references.
    pub fn release_leaks(&mut self, metadata: &[MetadataBlock], data: &[DataBlock]) -> Result<()> {
        self.check_not_failed()?;
        self.change(|md| {
            for &block in metadata {
                while md.tm.count(block) > 0 {
                    md.tm.dec(block)?;
                }
            }
            for &block in data {
                while md.data.count(block) > 0 {
                    writer::DataRefCounter::dec(&mut md.data, block)?;
                }
            }
            Ok(())
        })?;
        self.commit()
    }

    /// Clear the needs_check flag (after a clean check) and commit.
    pub fn clear_needs_check(&mut self) -> Result<()> {
        self.superblock.flags &= !NEEDS_CHECK_FLAG;
        self.changed = true;
        self.commit()
    }
}
