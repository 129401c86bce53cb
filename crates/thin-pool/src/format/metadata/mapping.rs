//! Volumes and their mappings: dm-thin's `create_thin`, `create_snap`, `delete`, and
//! insert, remove and lookup in a volume's mapping tree (spec §8).
//!
//! Every operation checks its preconditions (volume ids, times, reservations) before it
//! changes anything, so a refusal leaves the transaction as it was; a failure after the
//! first change (I/O, out of metadata space, corruption found on the way) marks the
//! transaction failed (see `PoolMetadata::change`).

use super::data_space::{SubtreeDelete, SubtreeUpdate};
use super::{check_volume_id, Mapping, PoolMetadata, VolumeState};
use crate::error::{Error, Result};
use crate::format::details::DeviceDetails;
use crate::format::writer::DataRefs;
use crate::ids::{BlockTime, DataBlock, Time, VirtualBlock, VolumeId};
use persistent_data::btree::{self, NoRefs};
use persistent_data::MetadataBlock;

impl PoolMetadata {
    /// Ids of every volume, ascending.
    pub fn volumes(&self) -> Vec<VolumeId> {
        self.volumes.keys().copied().collect()
    }

    /// Whether a volume exists.
    pub fn has_volume(&self, id: VolumeId) -> bool {
        self.volumes.contains_key(&id)
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

    fn check_new_volume(&self, id: VolumeId) -> Result<()> {
        check_volume_id(u64::from(id.get()))?;
        if self.volumes.contains_key(&id) {
            return Err(Error::VolumeExists(id));
        }
        Ok(())
    }

    /// `create_thin`: a new, empty volume.
    pub fn create_thin(&mut self, id: VolumeId) -> Result<()> {
        self.check_writable()?;
        self.check_new_volume(id)?;
        self.change(|md| {
            let root = btree::create_empty::<u64>(&mut md.tm)?;
            let details = DeviceDetails {
                mapped_blocks: 0,
                transaction_id: md.superblock.transaction_id,
                creation_time: md.superblock.time,
                snapshotted_time: md.superblock.time,
            };
            md.volumes.insert(id, VolumeState::created(details, root));
            Ok(())
        })
    }

    /// `create_snap`: a new volume sharing `origin`'s mappings. O(1): one more reference
    /// to the origin's root; the pool time advances.
    pub fn create_snap(&mut self, id: VolumeId, origin: VolumeId) -> Result<()> {
        self.check_writable()?;
        self.check_new_volume(id)?;
        let origin_state = self.volume(origin)?.clone();
        let time = self
            .superblock
            .time
            .checked_add(1)
            .and_then(Time::new)
            .ok_or(Error::TimeExhausted)?;
        self.change(|md| {
            md.tm.inc(origin_state.root)?;
            md.superblock.time = time.get();
            let details = DeviceDetails {
                mapped_blocks: origin_state.details.mapped_blocks,
                transaction_id: md.superblock.transaction_id,
                creation_time: time.get(),
                snapshotted_time: time.get(),
            };
            md.volumes
                .insert(id, VolumeState::created(details, origin_state.root));
            let origin_state = md.volumes.get_mut(&origin).expect("checked above");
            origin_state.details.snapshotted_time = time.get();
            origin_state.details_changed = true;
            Ok(())
        })
    }

    /// `delete`: remove a volume, releasing exactly the blocks only it references.
    pub fn delete(&mut self, id: VolumeId) -> Result<()> {
        self.check_writable()?;
        self.volume(id)?;
        self.change(|md| {
            let state = md.volumes.remove(&id).expect("checked above");
            let key = u64::from(id.get());
            // Is the volume in the committed top level? Then remove it there (releasing the
            // subtree the entry references) after pointing the entry at the current root.
            let in_top_level = btree::lookup::<u64, _>(&md.tm, md.mapping_root, key)?.is_some();
            if !in_top_level {
                // Created in this transaction: only the in-memory reference holds the root.
                return Ok(btree::delete_tree::<u64, _>(
                    &mut md.tm,
                    &mut DataRefs(&mut md.data),
                    state.root,
                )?);
            }
            if state.root_changed {
                let (root, _) = btree::insert(
                    &mut md.tm,
                    &mut SubtreeUpdate,
                    md.mapping_root,
                    key,
                    &state.root.get(),
                )?;
                md.mapping_root = root;
            }
            let (root, _) = btree::remove::<u64, _>(
                &mut md.tm,
                &mut SubtreeDelete(&mut md.data),
                md.mapping_root,
                key,
            )?;
            md.mapping_root = root;
            let (root, _) =
                btree::remove::<DeviceDetails, _>(&mut md.tm, &mut NoRefs, md.details_root, key)?;
            md.details_root = root;
            Ok(())
        })
    }

    fn mapping(state: &VolumeState, value: u64) -> Mapping {
        let value = BlockTime::unpack(value);
        Mapping {
            data_block: value.data_block(),
            time: value.time().get(),
            shared: state.details.snapshotted_time > value.time().get(),
        }
    }

    /// Look up a virtual block of a volume.
    pub fn lookup(&self, id: VolumeId, block: VirtualBlock) -> Result<Option<Mapping>> {
        let state = self.volume(id)?;
        Ok(btree::lookup::<u64, _>(&self.tm, state.root, block.get())?
            .map(|value| Self::mapping(state, value)))
    }

    /// First mapping at or after `block`.
    pub fn lookup_next(
        &self,
        id: VolumeId,
        block: VirtualBlock,
    ) -> Result<Option<(VirtualBlock, Mapping)>> {
        let state = self.volume(id)?;
        Ok(
            btree::lookup_ge::<u64, _>(&self.tm, state.root, block.get())?
                .map(|(key, value)| (VirtualBlock::new(key), Self::mapping(state, value))),
        )
    }

    /// Highest mapped virtual block of a volume.
    pub fn highest_mapped(&self, id: VolumeId) -> Result<Option<VirtualBlock>> {
        let state = self.volume(id)?;
        Ok(btree::last::<u64, _>(&self.tm, state.root)?.map(|(k, _)| VirtualBlock::new(k)))
    }

    /// Visit every mapping of a volume in order.
    pub fn walk_mappings(
        &self,
        id: VolumeId,
        visit: &mut dyn FnMut(VirtualBlock, BlockTime) -> Result<()>,
    ) -> Result<()> {
        let state = self.volume(id)?;
        let mut inner_error = None;
        let result = btree::walk::<u64, _>(&self.tm, state.root, &mut |key, value| {
            visit(VirtualBlock::new(key), BlockTime::unpack(value)).map_err(|e| {
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

    /// Visit every mapping of a volume in order, as (virtual block, data block, time).
    pub fn walk_volume(
        &self,
        id: VolumeId,
        visit: &mut dyn FnMut(VirtualBlock, DataBlock, u32) -> Result<()>,
    ) -> Result<()> {
        self.walk_mappings(id, &mut |block, value| {
            visit(block, value.data_block(), value.time().get())
        })
    }

    /// Before the first change to a volume's tree in this transaction, rewrite its top-level
    /// entry so a top-level leaf shared with a metadata snapshot is copied first.
    fn touch(&mut self, id: VolumeId) -> Result<()> {
        let state = self.volume(id)?;
        if state.touched {
            return Ok(());
        }
        let root = state.root;
        let (mapping_root, _) = btree::insert(
            &mut self.tm,
            &mut SubtreeUpdate,
            self.mapping_root,
            u64::from(id.get()),
            &root.get(),
        )?;
        self.mapping_root = mapping_root;
        self.volumes.get_mut(&id).expect("volume exists").touched = true;
        Ok(())
    }

    /// Map `block` of volume `id` to `data_block`, a block reserved with
    /// [`PoolMetadata::alloc_data_block`] (the mapping takes it out of the reservations and
    /// holds its reference), at the current pool time. Returns the previous mapping, whose
    /// data block loses the mapping's reference.
    pub fn insert(
        &mut self,
        id: VolumeId,
        block: VirtualBlock,
        data_block: DataBlock,
    ) -> Result<Option<Mapping>> {
        let time = self.pool_time()?;
        self.insert_at(id, block, data_block, time)
    }

    /// Like [`PoolMetadata::insert`], with the mapping's time given (at most the pool time):
    /// the engine records the time a write was provisioned at.
    pub fn insert_at(
        &mut self,
        id: VolumeId,
        block: VirtualBlock,
        data_block: DataBlock,
        time: Time,
    ) -> Result<Option<Mapping>> {
        self.check_writable()?;
        if time.get() > self.superblock.time {
            return Err(Error::TimeAfterPoolTime {
                time: time.get(),
                pool_time: self.superblock.time,
            });
        }
        if data_block.get() >= self.data.block_count() {
            return Err(Error::DataBlockBeyondDevice {
                block: data_block,
                block_count: self.data.block_count(),
            });
        }
        if !self.data.is_reserved(data_block) {
            return Err(Error::Internal(format!(
                "data block {data_block} mapped without a reservation"
            )));
        }
        self.volume(id)?;
        self.change(|md| {
            md.data.take_reserved(data_block)?;
            md.touch(id)?;
            let state = md.volumes.get(&id).expect("checked above");
            let value = BlockTime::new(data_block, time).pack();
            let (root, old) = btree::insert(
                &mut md.tm,
                &mut DataRefs(&mut md.data),
                state.root,
                block.get(),
                &value,
            )?;
            let old = old.map(|value| Self::mapping(state, value));
            md.mappings_changed(id, root, i64::from(old.is_none()))?;
            Ok(old)
        })
    }

    /// Unmap `block` of volume `id`, releasing the mapping's data-block reference.
    pub fn remove(&mut self, id: VolumeId, block: VirtualBlock) -> Result<Option<DataBlock>> {
        self.check_writable()?;
        let root = self.volume(id)?.root;
        if btree::lookup::<u64, _>(&self.tm, root, block.get())?.is_none() {
            return Ok(None);
        }
        self.change(|md| {
            md.touch(id)?;
            let root = md.volume(id)?.root;
            let (root, old) = btree::remove::<u64, _>(
                &mut md.tm,
                &mut DataRefs(&mut md.data),
                root,
                block.get(),
            )?;
            md.mappings_changed(id, root, -i64::from(old.is_some()))?;
            Ok(old.map(|v| BlockTime::unpack(v).data_block()))
        })
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
        match btree::lookup_ge::<u64, _>(&self.tm, root, begin.get())? {
            Some((key, _)) if key < end.get() => {}
            _ => return Ok(0),
        }
        self.change(|md| {
            md.touch(id)?;
            let root = md.volume(id)?.root;
            let (root, removed) = btree::remove_range::<u64, _>(
                &mut md.tm,
                &mut DataRefs(&mut md.data),
                root,
                begin.get(),
                end.get(),
            )?;
            md.mappings_changed(id, root, -(removed as i64))?;
            Ok(removed)
        })
    }

    /// Record that volume `id`'s mappings changed: its tree now has root `root` and
    /// `mapped_delta` more mappings. Like the kernel, the details of every volume whose
    /// mappings changed are rewritten at commit, even when their values are the same:
    /// thin_check 1.1.0 rejects a metadata snapshot whose details tree is still shared with
    /// the live one while its mapping tree is not ("metadata snap: unexpected thin ids").
    fn mappings_changed(
        &mut self,
        id: VolumeId,
        root: MetadataBlock,
        mapped_delta: i64,
    ) -> Result<()> {
        let state = self.volumes.get_mut(&id).expect("volume exists");
        if root != state.root {
            state.root = root;
            state.root_changed = true;
        }
        state.details.mapped_blocks = state
            .details
            .mapped_blocks
            .checked_add_signed(mapped_delta)
            .ok_or_else(|| {
                Error::Corrupt(format!(
                    "volume {id}: mapped block count {} and a change of {mapped_delta}",
                    state.details.mapped_blocks
                ))
            })?;
        state.details_changed = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::check::{check, CheckOptions};
    use persistent_data::{BlockDevice, MemoryDevice};
    use std::sync::Arc;

    fn metadata() -> (Arc<dyn BlockDevice>, PoolMetadata) {
        let device: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(1024));
        let md = PoolMetadata::format(device.clone(), 128, 1000).unwrap();
        (device, md)
    }

    fn assert_clean(device: &Arc<dyn BlockDevice>) {
        let report = check(device.clone(), &CheckOptions::default(), &mut |_| {});
        assert!(report.is_clean(), "{report}");
    }

    /// Regression: `create_snap` took a reference to the origin's root before it refused
    /// with "pool time exhausted", leaving a count one too high in a transaction that went on.
    #[test]
    fn create_snap_refused_for_time_changes_nothing() {
        let (device, mut md) = metadata();
        let origin = VolumeId::new(0);
        md.create_thin(origin).unwrap();
        for block in 0..20 {
            let data_block = md.alloc_data_block().unwrap();
            md.insert(origin, VirtualBlock::new(block), data_block)
                .unwrap();
        }
        md.commit().unwrap();
        md.superblock.time = Time::MAX.get();
        let refused = md.create_snap(VolumeId::new(1), origin);
        assert!(matches!(refused, Err(Error::TimeExhausted)), "{refused:?}");
        assert!(!md.transaction_failed(), "a refusal is not a failure");
        assert!(!md.has_volume(VolumeId::new(1)));
        md.superblock.time = 0;
        md.commit().unwrap();
        assert_clean(&device);
    }

    #[test]
    fn refusals_leave_the_transaction_usable() {
        let (device, mut md) = metadata();
        let id = VolumeId::new(3);
        md.create_thin(id).unwrap();
        assert!(matches!(md.create_thin(id), Err(Error::VolumeExists(_))));
        assert!(matches!(
            md.create_thin(VolumeId::new(1 << 24)),
            Err(Error::BadVolumeId(_))
        ));
        assert!(matches!(
            md.delete(VolumeId::new(9)),
            Err(Error::VolumeNotFound(_))
        ));
        let unreserved = DataBlock::new(5);
        assert!(matches!(
            md.insert(id, VirtualBlock::new(0), unreserved),
            Err(Error::Internal(_))
        ));
        assert!(!md.transaction_failed());
        let data_block = md.alloc_data_block().unwrap();
        md.insert(id, VirtualBlock::new(0), data_block).unwrap();
        md.commit().unwrap();
        assert_eq!(md.data_block_count(data_block), 1);
        assert_clean(&device);
    }

    #[test]
    fn a_reservation_maps_once_and_a_released_one_is_free() {
        let (device, mut md) = metadata();
        let id = VolumeId::new(0);
        md.create_thin(id).unwrap();
        let mapped = md.alloc_data_block().unwrap();
        let dropped = md.alloc_data_block().unwrap();
        assert_eq!(md.usage().data_used_blocks, 2);
        md.insert(id, VirtualBlock::new(7), mapped).unwrap();
        assert!(md.insert(id, VirtualBlock::new(8), mapped).is_err());
        md.commit().unwrap();
        assert_clean(&device);
        assert_eq!(md.data_space_map().core().allocated_count(), 1);
        assert!(md.release_data_block(dropped));
        assert!(!md.release_data_block(dropped));
        assert_eq!(md.usage().data_used_blocks, 1);
    }
}
