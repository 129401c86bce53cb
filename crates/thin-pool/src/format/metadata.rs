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

use crate::error::{Error, Result};
use crate::format::details::{pack_block_time, unpack_block_time, DeviceDetails};
use crate::format::superblock::{self, Superblock, NEEDS_CHECK_FLAG};
use crate::format::writer::{self, DataRefs, NewPool};
use crate::ids::{DataBlock, Time, TransactionId, VirtualBlock, VolumeId, DATA_BLOCK_MAX};
use persistent_data::block_manager::{BlockManager, CACHE_BLOCKS_DEFAULT};
use persistent_data::btree::{self, NoRefs, RefCounter};
use persistent_data::space_map::DataSpaceMap;
use persistent_data::{BlockDevice, CopyOnWrite, MetadataBlock, TransactionManager};
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

/// Top-level values while updating a volume's root: a copied top-level leaf takes a
/// reference to each subtree; an overwritten root was already released by shadowing.
struct SubtreeUpdate;

impl RefCounter<u64> for SubtreeUpdate {
    fn inc(&mut self, tm: &mut dyn CopyOnWrite, value: &u64) -> persistent_data::Result<()> {
        tm.inc(MetadataBlock(*value))
    }
    fn dec(&mut self, _: &mut dyn CopyOnWrite, _: &u64) -> persistent_data::Result<()> {
        Ok(())
    }
}

/// Top-level values while deleting: a removed entry releases its whole subtree.
struct SubtreeDelete<'a>(&'a mut DataSpaceMap);

impl RefCounter<u64> for SubtreeDelete<'_> {
    fn inc(&mut self, tm: &mut dyn CopyOnWrite, value: &u64) -> persistent_data::Result<()> {
        tm.inc(MetadataBlock(*value))
    }
    fn dec(&mut self, tm: &mut dyn CopyOnWrite, value: &u64) -> persistent_data::Result<()> {
        btree::delete_tree::<u64, _>(tm, &mut DataRefs(self.0), MetadataBlock(*value))
    }
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

/// Pool-wide counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    /// Data blocks in use.
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
    data_sm: DataSpaceMap,
    superblock: Superblock,
    mapping_root: MetadataBlock,
    details_root: MetadataBlock,
    volumes: BTreeMap<VolumeId, VolumeState>,
    /// Something changed since the last commit.
    changed: bool,
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
    if id > u64::from(VolumeId::MAX.0) {
        return Err(Error::BadVolumeId(id));
    }
    Ok(VolumeId(id as u32))
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
        let mapping_root = btree::create_empty::<u64>(&mut tm)?;
        let details_root = btree::create_empty::<DeviceDetails>(&mut tm)?;
        let mut metadata = PoolMetadata {
            tm,
            data_sm,
            superblock,
            mapping_root,
            details_root,
            volumes: BTreeMap::new(),
            changed: true,
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
        let data_sm = DataSpaceMap::open(&*bm, &superblock.data_space_map)?;
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
                    root: MetadataBlock(0),
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
                .and_then(|k| volumes.get_mut(&VolumeId(k)))
            {
                Some(state) => {
                    state.root = MetadataBlock(root);
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
            data_sm,
            superblock,
            mapping_root,
            details_root,
            volumes,
            changed: false,
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

    /// The user transaction id.
    pub fn transaction_id(&self) -> TransactionId {
        TransactionId(self.superblock.transaction_id)
    }

    /// Whether the needs_check flag is set.
    pub fn needs_check(&self) -> bool {
        self.superblock.needs_check()
    }

    /// The metadata snapshot's superblock block, if one is held.
    pub fn metadata_snap(&self) -> Option<MetadataBlock> {
        self.superblock.metadata_snap
    }

    /// Whether anything changed since the last commit.
    pub fn has_changes(&self) -> bool {
        self.changed
    }

    /// The transaction manager (read access for checkers and dumps).
    pub fn transaction_manager(&self) -> &TransactionManager {
        &self.tm
    }

    /// The data space map.
    pub fn data_space_map(&self) -> &DataSpaceMap {
        &self.data_sm
    }

    /// Pool-wide counters.
    pub fn usage(&self) -> Usage {
        let meta = self.tm.space_map();
        Usage {
            data_used_blocks: self.data_sm.core().allocated_count(),
            data_total_blocks: self.data_sm.block_count(),
            metadata_used_blocks: meta.allocated_count(),
            metadata_total_blocks: meta.block_count(),
        }
    }

    /// Ids of every volume, ascending.
    pub fn volumes(&self) -> Vec<VolumeId> {
        self.volumes.keys().copied().collect()
    }

    /// A volume's details (mapped_blocks current).
    pub fn details(&self, id: VolumeId) -> Result<DeviceDetails> {
        Ok(self.volume(id)?.details)
    }

    /// Root of a volume's mapping tree in the current transaction.
    pub fn volume_root(&self, id: VolumeId) -> Result<MetadataBlock> {
        Ok(self.volume(id)?.root)
    }

    fn volume(&self, id: VolumeId) -> Result<&VolumeState> {
        self.volumes.get(&id).ok_or(Error::VolumeNotFound(id))
    }

    fn check_writable(&self) -> Result<()> {
        if self.needs_check() {
            return Err(Error::ReadOnly { needs_check: true });
        }
        Ok(())
    }

    /// `create_thin`: a new, empty volume.
    pub fn create_thin(&mut self, id: VolumeId) -> Result<()> {
        self.check_writable()?;
        check_volume_id(u64::from(id.0))?;
        if self.volumes.contains_key(&id) {
            return Err(Error::VolumeExists(id));
        }
        let root = btree::create_empty::<u64>(&mut self.tm)?;
        let details = DeviceDetails {
            mapped_blocks: 0,
            transaction_id: self.superblock.transaction_id,
            creation_time: self.superblock.time,
            snapshotted_time: self.superblock.time,
        };
        self.volumes.insert(
            id,
            VolumeState {
                details,
                root,
                root_changed: true,
                touched: true,
                details_changed: true,
            },
        );
        self.changed = true;
        Ok(())
    }

    /// `create_snap`: a new volume sharing `origin`'s mappings. O(1): one more reference
    /// to the origin's root; the pool time advances.
    pub fn create_snap(&mut self, id: VolumeId, origin: VolumeId) -> Result<()> {
        self.check_writable()?;
        check_volume_id(u64::from(id.0))?;
        if self.volumes.contains_key(&id) {
            return Err(Error::VolumeExists(id));
        }
        let origin_state = self.volume(origin)?.clone();
        self.tm.inc(origin_state.root)?;
        let time = self
            .superblock
            .time
            .checked_add(1)
            .filter(|t| *t < (1 << 24))
            .ok_or_else(|| Error::Invalid("pool time exhausted (2^24 snapshots)".to_string()))?;
        self.superblock.time = time;
        let details = DeviceDetails {
            mapped_blocks: origin_state.details.mapped_blocks,
            transaction_id: self.superblock.transaction_id,
            creation_time: time,
            snapshotted_time: time,
        };
        self.volumes.insert(
            id,
            VolumeState {
                details,
                root: origin_state.root,
                root_changed: true,
                touched: true,
                details_changed: true,
            },
        );
        let origin_state = self.volumes.get_mut(&origin).expect("origin exists");
        origin_state.details.snapshotted_time = time;
        origin_state.details_changed = true;
        self.changed = true;
        Ok(())
    }

    /// `delete`: remove a volume, releasing exactly the blocks only it references.
    pub fn delete(&mut self, id: VolumeId) -> Result<()> {
        self.check_writable()?;
        let state = self.volumes.remove(&id).ok_or(Error::VolumeNotFound(id))?;
        let key = u64::from(id.0);
        // Is the volume in the committed top level? Then remove it there (releasing the
        // subtree the entry references) after pointing the entry at the current root.
        let in_top_level = btree::lookup::<u64, _>(&self.tm, self.mapping_root, key)?.is_some();
        if in_top_level {
            if state.root_changed {
                let (root, _) = btree::insert(
                    &mut self.tm,
                    &mut SubtreeUpdate,
                    self.mapping_root,
                    key,
                    &state.root.0,
                )?;
                self.mapping_root = root;
            }
            let (root, _) = btree::remove::<u64, _>(
                &mut self.tm,
                &mut SubtreeDelete(&mut self.data_sm),
                self.mapping_root,
                key,
            )?;
            self.mapping_root = root;
            let (root, _) = btree::remove::<DeviceDetails, _>(
                &mut self.tm,
                &mut NoRefs,
                self.details_root,
                key,
            )?;
            self.details_root = root;
        } else {
            // Created in this transaction: only the in-memory reference holds the root.
            btree::delete_tree::<u64, _>(
                &mut self.tm,
                &mut DataRefs(&mut self.data_sm),
                state.root,
            )?;
        }
        self.changed = true;
        Ok(())
    }

    /// `set_transaction_id`.
    pub fn set_transaction_id(&mut self, current: TransactionId, new: TransactionId) -> Result<()> {
        self.check_writable()?;
        if current.0 != self.superblock.transaction_id {
            return Err(Error::TransactionMismatch {
                expected: current,
                actual: TransactionId(self.superblock.transaction_id),
            });
        }
        self.superblock.transaction_id = new.0;
        self.changed = true;
        Ok(())
    }

    /// Look up a virtual block of a volume.
    pub fn lookup(&self, id: VolumeId, block: VirtualBlock) -> Result<Option<Mapping>> {
        let state = self.volume(id)?;
        Ok(
            btree::lookup::<u64, _>(&self.tm, state.root, block.0)?.map(|value| {
                let (data_block, time) = unpack_block_time(value);
                Mapping {
                    data_block: DataBlock(data_block),
                    time,
                    shared: state.details.snapshotted_time > time,
                }
            }),
        )
    }

    /// First mapping at or after `block`.
    pub fn lookup_next(
        &self,
        id: VolumeId,
        block: VirtualBlock,
    ) -> Result<Option<(VirtualBlock, Mapping)>> {
        let state = self.volume(id)?;
        Ok(
            btree::lookup_ge::<u64, _>(&self.tm, state.root, block.0)?.map(|(key, value)| {
                let (data_block, time) = unpack_block_time(value);
                (
                    VirtualBlock(key),
                    Mapping {
                        data_block: DataBlock(data_block),
                        time,
                        shared: state.details.snapshotted_time > time,
                    },
                )
            }),
        )
    }

    /// Highest mapped virtual block of a volume.
    pub fn highest_mapped(&self, id: VolumeId) -> Result<Option<VirtualBlock>> {
        let state = self.volume(id)?;
        Ok(btree::last::<u64, _>(&self.tm, state.root)?.map(|(k, _)| VirtualBlock(k)))
    }

    /// Visit every mapping of a volume in order.
    pub fn walk_volume(
        &self,
        id: VolumeId,
        visit: &mut dyn FnMut(VirtualBlock, DataBlock, u32) -> Result<()>,
    ) -> Result<()> {
        let state = self.volume(id)?;
        let mut inner_error = None;
        let result = btree::walk::<u64, _>(&self.tm, state.root, &mut |key, value| {
            let (data, time) = unpack_block_time(value);
            visit(VirtualBlock(key), DataBlock(data), time).map_err(|e| {
                inner_error = Some(e);
                persistent_data::Error::Invalid("walk stopped".to_string())
            })
        });
        match (result, inner_error) {
            (_, Some(e)) => Err(e),
            (Err(e), None) => Err(e.into()),
            (Ok(()), None) => Ok(()),
        }
    }

    /// Before the first change to a volume's tree in this transaction, rewrite its top-level
    /// entry so a top-level leaf shared with a metadata snapshot is copied first.
    fn touch(&mut self, id: VolumeId) -> Result<()> {
        let state = self.volumes.get(&id).ok_or(Error::VolumeNotFound(id))?;
        if state.touched {
            return Ok(());
        }
        let root = state.root;
        let (mapping_root, _) = btree::insert(
            &mut self.tm,
            &mut SubtreeUpdate,
            self.mapping_root,
            u64::from(id.0),
            &root.0,
        )?;
        self.mapping_root = mapping_root;
        self.volumes.get_mut(&id).expect("volume exists").touched = true;
        Ok(())
    }

    /// Map `block` of volume `id` to `data_block` (whose reference the caller allocated and
    /// hands to the mapping), at the current pool time. Returns the previous mapping, whose
    /// data block loses the mapping's reference.
    pub fn insert(
        &mut self,
        id: VolumeId,
        block: VirtualBlock,
        data_block: DataBlock,
    ) -> Result<Option<Mapping>> {
        let time = self.superblock.time;
        self.insert_at(id, block, data_block, time)
    }

    /// Whether a volume exists.
    pub fn has_volume(&self, id: VolumeId) -> bool {
        self.volumes.contains_key(&id)
    }

    /// Like [`PoolMetadata::insert`], with the mapping's time given (at most the pool time):
    /// the engine records the time a write was provisioned at.
    pub fn insert_at(
        &mut self,
        id: VolumeId,
        block: VirtualBlock,
        data_block: DataBlock,
        time: u32,
    ) -> Result<Option<Mapping>> {
        self.check_writable()?;
        if time > self.superblock.time {
            return Err(Error::Invalid(format!(
                "mapping time {time} is after the pool time {}",
                self.superblock.time
            )));
        }
        if data_block.0 >= self.data_sm.block_count() {
            return Err(Error::Invalid(format!(
                "data block {data_block} beyond the data device ({} blocks)",
                self.data_sm.block_count()
            )));
        }
        self.touch(id)?;
        let state = self.volumes.get(&id).expect("touched volume exists");
        let snapshotted_time = state.details.snapshotted_time;
        let value = pack_block_time(data_block.0, time);
        let (root, old) = btree::insert(
            &mut self.tm,
            &mut DataRefs(&mut self.data_sm),
            state.root,
            block.0,
            &value,
        )?;
        self.mappings_changed(id, root, i64::from(old.is_none()));
        Ok(old.map(|value| {
            let (data, time) = unpack_block_time(value);
            Mapping {
                data_block: DataBlock(data),
                time,
                shared: snapshotted_time > time,
            }
        }))
    }

    /// Unmap `block` of volume `id`, releasing the mapping's data-block reference.
    pub fn remove(&mut self, id: VolumeId, block: VirtualBlock) -> Result<Option<DataBlock>> {
        self.check_writable()?;
        let root = self.volume(id)?.root;
        if btree::lookup::<u64, _>(&self.tm, root, block.0)?.is_none() {
            return Ok(None);
        }
        self.touch(id)?;
        let root = self.volume(id)?.root;
        let (root, old) = btree::remove::<u64, _>(
            &mut self.tm,
            &mut DataRefs(&mut self.data_sm),
            root,
            block.0,
        )?;
        self.mappings_changed(id, root, -i64::from(old.is_some()));
        Ok(old.map(|v| DataBlock(unpack_block_time(v).0)))
    }

    /// Unmap every block in `begin..end`. Returns how many were unmapped.
    pub fn remove_range(
        &mut self,
        id: VolumeId,
        begin: VirtualBlock,
        end: VirtualBlock,
    ) -> Result<u64> {
        self.check_writable()?;
        let root = self.volume(id)?.root;
        match btree::lookup_ge::<u64, _>(&self.tm, root, begin.0)? {
            Some((key, _)) if key < end.0 => {}
            _ => return Ok(0),
        }
        self.touch(id)?;
        let root = self.volume(id)?.root;
        let (root, removed) = btree::remove_range::<u64, _>(
            &mut self.tm,
            &mut DataRefs(&mut self.data_sm),
            root,
            begin.0,
            end.0,
        )?;
        self.mappings_changed(id, root, -(removed as i64));
        Ok(removed)
    }

    /// Record that volume `id`'s mappings changed: its tree now has root `root` and
    /// `mapped_delta` more mappings. Like the kernel, the details of every volume whose
    /// mappings changed are rewritten at commit, even when their values are the same:
    /// thin_check 1.1.0 rejects a metadata snapshot whose details tree is still shared with
    /// the live one while its mapping tree is not ("metadata snap: unexpected thin ids").
    fn mappings_changed(&mut self, id: VolumeId, root: MetadataBlock, mapped_delta: i64) {
        let state = self.volumes.get_mut(&id).expect("volume exists");
        if root != state.root {
            state.root = root;
            state.root_changed = true;
        }
        state.details.mapped_blocks = state
            .details
            .mapped_blocks
            .checked_add_signed(mapped_delta)
            .expect("mapped block count stays in range");
        state.details_changed = true;
        self.changed = true;
    }

    /// Allocate a free data block (count 1: the reference a new mapping will hold).
    pub fn alloc_data_block(&mut self) -> Result<DataBlock> {
        self.check_writable()?;
        let block = self.data_sm.alloc()?;
        self.changed = true;
        Ok(DataBlock(block))
    }

    /// Take one more reference to a data block (e.g. to hold it across a discard passdown).
    pub fn inc_data_block(&mut self, block: DataBlock) -> Result<()> {
        self.data_sm.inc(block.0)?;
        self.changed = true;
        Ok(())
    }

    /// Drop a reference to a data block; returns the count left.
    pub fn dec_data_block(&mut self, block: DataBlock) -> Result<u32> {
        let left = self.data_sm.dec(block.0)?;
        self.changed = true;
        Ok(left)
    }

    /// Reference count of a data block.
    pub fn data_block_count(&self, block: DataBlock) -> u32 {
        self.data_sm.count(block.0)
    }

    /// Grow the data space map to `block_count` data blocks (never shrinks).
    pub fn extend_data(&mut self, block_count: u64) -> Result<()> {
        self.check_writable()?;
        let current = self.data_sm.block_count();
        if block_count < current {
            return Err(Error::Invalid(format!(
                "data device of {block_count} blocks is smaller than the pool's {current}"
            )));
        }
        if block_count > DATA_BLOCK_MAX + 1 {
            return Err(Error::Invalid(format!(
                "{block_count} data blocks: at most 2^40"
            )));
        }
        if block_count > current {
            self.data_sm.extend(block_count);
            self.changed = true;
        }
        Ok(())
    }

    /// Grow the metadata space map to the metadata device's current size (capped at the
    /// format's limit). Returns the new number of metadata blocks.
    pub fn extend_metadata(&mut self, block_count: u64) -> Result<u64> {
        self.check_writable()?;
        self.tm.extend(block_count)?;
        self.changed = true;
        Ok(self.tm.space_map().block_count())
    }

    /// Write everything changed into the trees and space maps and commit atomically
    /// (spec §8.3). On error the caller must abandon the transaction (reopen).
    pub fn commit(&mut self) -> Result<()> {
        let ids: Vec<VolumeId> = self.volumes.keys().copied().collect();
        for id in ids {
            let state = self.volumes.get(&id).expect("listed volume").clone();
            let key = u64::from(id.0);
            if state.root_changed {
                let (root, _) = btree::insert(
                    &mut self.tm,
                    &mut SubtreeUpdate,
                    self.mapping_root,
                    key,
                    &state.root.0,
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
        writer::commit(
            &mut self.tm,
            &mut self.data_sm,
            &mut self.superblock,
            self.mapping_root,
            self.details_root,
        )?;
        self.changed = false;
        Ok(())
    }

    /// `reserve_metadata_snap`: commit, then keep a copy of the superblock (with no space
    /// maps) whose trees stay intact while it is held.
    pub fn reserve_metadata_snap(&mut self) -> Result<MetadataBlock> {
        self.check_writable()?;
        if let Some(held) = self.metadata_snap() {
            return Err(Error::MetadataSnapExists(held.0));
        }
        self.commit()?;
        let location = self.tm.new_block()?;
        let copy = self.superblock.metadata_snapshot(location);
        self.tm.inc(self.mapping_root)?;
        self.tm.inc(self.details_root)?;
        self.tm.write_raw_superblock(location, copy.encode());
        self.superblock.metadata_snap = Some(location);
        self.changed = true;
        self.commit()?;
        Ok(location)
    }

    /// `release_metadata_snap`: drop the held metadata snapshot and what only it references.
    pub fn release_metadata_snap(&mut self) -> Result<()> {
        self.check_writable()?;
        let location = self.metadata_snap().ok_or(Error::NoMetadataSnap)?;
        let snap = Superblock::read(self.tm.block_manager(), location)?;
        btree::delete_tree::<u64, _>(
            &mut self.tm,
            &mut SubtreeDelete(&mut self.data_sm),
            snap.data_mapping_root,
        )?;
        btree::delete_tree::<DeviceDetails, _>(
            &mut self.tm,
            &mut NoRefs,
            snap.device_details_root,
        )?;
        self.tm.dec(location)?;
        self.superblock.metadata_snap = None;
        self.changed = true;
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

    /// Clear the needs_check flag (after a clean check) and commit.
    pub fn clear_needs_check(&mut self) -> Result<()> {
        self.superblock.flags &= !NEEDS_CHECK_FLAG;
        self.changed = true;
        self.commit()
    }
}
