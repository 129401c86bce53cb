//! What every writer of thin metadata shares: formatting a metadata device, the data
//! references mapping values hold, building the details tree and the mapping tree's top
//! level, and committing a superblock.
//!
//! Two writers use it: [`PoolMetadata`](super::metadata::PoolMetadata), which changes
//! metadata operation by operation, and [`restore`](super::restore), which builds it from a
//! dump bottom up. Both commit with [`commit`], so both follow the same two-phase protocol
//! (spec §8.3): the space maps are written first (their roots go into the superblock), then
//! the transaction manager flushes every other block before it writes and flushes the
//! superblock.

use crate::error::{Error, Result};
use crate::format::details::DeviceDetails;
use crate::format::superblock::{valid_data_block_size, Superblock};
use crate::ids::{BlockTime, DataBlock, Time, TransactionId, VolumeId, DATA_BLOCK_MAX};
use persistent_data::block_manager::{BlockManager, CACHE_BLOCKS_DEFAULT};
use persistent_data::btree::builder::TreeBuilder;
use persistent_data::btree::{NoRefs, RefCounter};
use persistent_data::space_map::{DataSpaceMap, SpaceMapRoot};
use persistent_data::{BlockDevice, CopyOnWrite, MetadataBlock, TransactionManager};
use std::sync::Arc;

/// Something that counts references to data blocks: the data space map itself (restore), or
/// the pool's `DataSpace` (in `format::metadata`), which also keeps the blocks reserved for
/// writes in flight.
pub trait DataRefCounter {
    /// Take one reference to `block`.
    fn inc(&mut self, block: DataBlock) -> persistent_data::Result<()>;
    /// Drop one reference to `block`.
    fn dec(&mut self, block: DataBlock) -> persistent_data::Result<()>;
}

impl DataRefCounter for DataSpaceMap {
    fn inc(&mut self, block: DataBlock) -> persistent_data::Result<()> {
        DataSpaceMap::inc(self, block.get())
    }
    fn dec(&mut self, block: DataBlock) -> persistent_data::Result<()> {
        DataSpaceMap::dec(self, block.get()).map(|_| ())
    }
}

/// Mapping values (bottom-level leaf entries) hold one reference to their data block.
pub struct DataRefs<'a, C: DataRefCounter>(pub &'a mut C);

impl<C: DataRefCounter> RefCounter<u64> for DataRefs<'_, C> {
    fn inc(&mut self, _: &mut dyn CopyOnWrite, value: &u64) -> persistent_data::Result<()> {
        self.0.inc(BlockTime::unpack(*value).data_block())
    }
    fn dec(&mut self, _: &mut dyn CopyOnWrite, value: &u64) -> persistent_data::Result<()> {
        self.0.dec(BlockTime::unpack(*value).data_block())
    }
}

/// What a new pool starts with.
#[derive(Clone, Copy, Debug)]
pub struct NewPool {
    /// Data block size in 512-byte sectors (checked by [`format()`]).
    pub data_block_size_sectors: u32,
    /// Data blocks in the pool (checked by [`format()`]: at most 2^40).
    pub data_block_count: u64,
    /// The pool's snapshot epoch.
    pub time: Time,
    /// The user transaction id.
    pub transaction_id: TransactionId,
}

/// A formatted metadata device, not committed yet: its trees are for the caller to make,
/// and the superblock's roots to set at [`commit`].
pub struct Formatted {
    /// The transaction manager, with the metadata space map of the whole device.
    pub tm: TransactionManager,
    /// An empty data space map.
    pub data_sm: DataSpaceMap,
    /// The superblock to commit: version 2, no flags, `pool`'s settings.
    pub superblock: Superblock,
}

impl std::fmt::Debug for Formatted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Formatted")
            .field("superblock", &self.superblock)
            .finish()
    }
}

/// Format the whole of `device` for a new pool: a metadata space map of every block of the
/// device and an empty data space map. Refuses (nothing written) a data block size or a
/// data block count the format cannot hold.
pub fn format(device: Arc<dyn BlockDevice>, pool: &NewPool) -> Result<Formatted> {
    let sectors = pool.data_block_size_sectors;
    if !valid_data_block_size(sectors) {
        return Err(Error::BadBlockSize {
            bytes: u64::from(sectors) * 512,
        });
    }
    if pool.data_block_count > DATA_BLOCK_MAX + 1 {
        return Err(Error::SizeOverLimit {
            what: crate::error::Limit::FormatDataBlocks,
            requested: pool.data_block_count,
            max: 1 << 40,
        });
    }
    let metadata_blocks = device.block_count();
    let bm = Arc::new(BlockManager::new(device, CACHE_BLOCKS_DEFAULT));
    let mut tm = TransactionManager::format(bm, metadata_blocks)?;
    let data_sm = DataSpaceMap::format(&mut tm, pool.data_block_count)?;
    let superblock = Superblock::new(
        sectors,
        tm.space_map().block_count(),
        pool.time.get(),
        pool.transaction_id.get(),
    );
    Ok(Formatted {
        tm,
        data_sm,
        superblock,
    })
}

/// Commit `superblock` with these tree roots and the data space map's root (the caller
/// wrote the data space map into this transaction just before, so its blocks are counted):
/// write the metadata space map (its root goes into the superblock), then let the
/// transaction manager write every block before the superblock. On error the caller must
/// abandon the transaction.
pub fn commit(
    tm: &mut TransactionManager,
    superblock: &mut Superblock,
    data_space_map: SpaceMapRoot,
    mapping_root: MetadataBlock,
    details_root: MetadataBlock,
) -> Result<()> {
    superblock.data_space_map = data_space_map;
    superblock.metadata_space_map = tm.commit_space_map()?;
    superblock.data_mapping_root = mapping_root;
    superblock.device_details_root = details_root;
    tm.commit(superblock.encode())?;
    Ok(())
}

/// One volume of the trees [`build_volume_trees`] writes.
#[derive(Clone, Copy, Debug)]
pub struct VolumeEntry {
    /// The volume's id.
    pub id: VolumeId,
    /// Root of its mapping tree (the reference the top level will hold).
    pub root: MetadataBlock,
    /// Its details.
    pub details: DeviceDetails,
}

/// Build the details tree and the top level of the mapping tree bottom up, from volumes in
/// strictly ascending id order. Returns (mapping root, details root). Each top-level entry
/// takes over the reference the caller holds on the volume's root.
pub fn build_volume_trees(
    tm: &mut TransactionManager,
    volumes: impl IntoIterator<Item = VolumeEntry>,
) -> Result<(MetadataBlock, MetadataBlock)> {
    let mut details = TreeBuilder::<DeviceDetails>::new();
    let mut roots = TreeBuilder::<u64>::new();
    let mut last: Option<VolumeId> = None;
    for volume in volumes {
        if last.is_some_and(|last| last >= volume.id) {
            return Err(Error::Internal(format!(
                "volume {} listed after volume {}",
                volume.id,
                last.map_or(0, VolumeId::get)
            )));
        }
        last = Some(volume.id);
        let key = u64::from(volume.id.get());
        details.push_value(tm, &mut NoRefs, key, volume.details)?;
        roots.push_value(tm, &mut NoRefs, key, volume.root.get())?;
    }
    let details_root = details.complete(tm, &mut NoRefs)?;
    let mapping_root = roots.complete(tm, &mut NoRefs)?;
    Ok((mapping_root, details_root))
}

#[cfg(test)]
mod tests {
    use super::*;
    use persistent_data::{btree, MemoryDevice};

    fn new_pool(data_block_size_sectors: u32, data_block_count: u64) -> NewPool {
        NewPool {
            data_block_size_sectors,
            data_block_count,
            time: Time::new(2).unwrap(),
            transaction_id: TransactionId::new(5),
        }
    }

    #[test]
    fn format_refuses_what_the_format_cannot_hold() {
        let device = Arc::new(MemoryDevice::new(64));
        let error = format(device.clone(), &new_pool(100, 10)).unwrap_err();
        assert!(matches!(error, Error::BadBlockSize { .. }), "{error:?}");
        let error = format(device, &new_pool(128, DATA_BLOCK_MAX + 2)).unwrap_err();
        assert!(matches!(error, Error::SizeOverLimit { .. }), "{error:?}");
    }

    #[test]
    fn committed_volume_trees_read_back() {
        let device = Arc::new(MemoryDevice::new(64));
        let Formatted {
            mut tm,
            mut data_sm,
            mut superblock,
        } = format(device.clone(), &new_pool(128, 10)).unwrap();
        let details = DeviceDetails {
            mapped_blocks: 0,
            transaction_id: 5,
            creation_time: 2,
            snapshotted_time: 2,
        };
        let mut volumes = Vec::new();
        for id in [1u32, 4] {
            let root = btree::create_empty::<u64>(&mut tm).unwrap();
            let id = VolumeId::new(id);
            volumes.push(VolumeEntry { id, root, details });
        }
        let (mapping_root, details_root) =
            build_volume_trees(&mut tm, volumes.iter().copied()).unwrap();
        let data_space_map = data_sm.commit(&mut tm).unwrap();
        commit(
            &mut tm,
            &mut superblock,
            data_space_map,
            mapping_root,
            details_root,
        )
        .unwrap();
        drop(tm);
        let bm = BlockManager::new(device, 16);
        let read = Superblock::read(&bm, MetadataBlock::SUPERBLOCK).unwrap();
        assert_eq!(read, superblock);
        assert_eq!((read.time, read.transaction_id), (2, 5));
        for volume in &volumes {
            let key = u64::from(volume.id.get());
            let root = btree::lookup::<u64, _>(&bm, read.data_mapping_root, key).unwrap();
            assert_eq!(root, Some(volume.root.get()));
            let found = btree::lookup::<DeviceDetails, _>(&bm, read.device_details_root, key);
            assert_eq!(found.unwrap(), Some(details));
        }
    }

    #[test]
    fn volumes_out_of_order_are_an_internal_error() {
        let device = Arc::new(MemoryDevice::new(64));
        let mut metadata = format(device, &new_pool(128, 10)).unwrap();
        let root = btree::create_empty::<u64>(&mut metadata.tm).unwrap();
        let entry = |id| VolumeEntry {
            id: VolumeId::new(id),
            root,
            details: DeviceDetails::default(),
        };
        let error = build_volume_trees(&mut metadata.tm, [entry(3), entry(3)]).unwrap_err();
        assert!(matches!(error, Error::Internal(_)), "{error:?}");
    }
}
