//! The data space map and the data blocks reserved for writes in flight.
//!
//! The engine writes a block's data before it maps the block (the mapping is applied at the
//! next commit, after the data device is flushed). Between the two, the block is
//! *reserved*: promised to that write, counted as used, but not in the space map. So:
//!
//! - reserving picks a block whose count is zero, that is not reserved, and whose count did
//!   not fall to zero in this transaction (the committed metadata may still map it); the
//!   space map is not touched;
//! - mapping the block (`PoolMetadata::insert`) moves it from the reserved set into the
//!   space map, with count 1;
//! - releasing a reservation (the write failed, its volume went away) just forgets it;
//! - a commit writes the space map, which never holds a reserved block: a crash loses the
//!   reservations and nothing else.
//!
//! Invariants: reserved ∩ {count > 0} = ∅ (checked at every commit in debug builds, and on
//! every reference taken); reserved ∩ freed = ∅.
//!
//! *Held* blocks: with [`DataSpace::set_hold_freed`], a commit does not make the blocks
//! its transaction freed reservable, but holds them (free in the space map, so not counted
//! as used, yet never reserved) until the owner releases each one: the engine holds them
//! while lock-free I/O may still reach them through a stale lookup (`engine::grace`).
//! held ∩ reserved = ∅, and every held block has count zero.

use crate::error::{Error, Result};
use crate::format::writer::{DataRefCounter, DataRefs};
use crate::ids::DataBlock;
use persistent_data::btree::{self, RefCounter};
use persistent_data::space_map::core::ENTRIES_PER_BITMAP;
use persistent_data::space_map::{DataSpaceMap, SpaceMapRoot};
use persistent_data::{CopyOnWrite, MetadataBlock, TransactionManager};
use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};

/// Entries (blocks) per 64-bit word of a bitmap: 2 bits each.
const ENTRIES_PER_WORD: u64 = 32;
/// Bit 2j of a word set for every entry j: the low bit of each 2-bit field.
const LOW_BITS: u64 = 0x5555_5555_5555_5555;

/// A hasher for block numbers: one multiply (SipHash costs more than the rest of freeing a
/// block, and deleting a volume frees every block only it maps).
#[derive(Default)]
struct BlockHasher(u64);

impl Hasher for BlockHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, value: u64) {
        let h = (self.0 ^ value).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 29);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

type BlockSet = HashSet<DataBlock, BuildHasherDefault<BlockHasher>>;

/// See the module documentation.
#[derive(Debug)]
pub(crate) struct DataSpace {
    map: DataSpaceMap,
    reserved: BlockSet,
    /// Blocks whose count fell to zero in this transaction: not reserved before it commits.
    freed: BlockSet,
    /// Blocks held back from reservation (see the module documentation).
    held: BlockSet,
    /// Whether a commit holds the blocks its transaction freed.
    hold_freed: bool,
    /// Blocks held by commits since the last [`DataSpace::take_newly_held`].
    newly_held: Vec<DataBlock>,
    /// Where the next search starts (after the last reservation), so a run of reservations
    /// costs O(1) amortised.
    cursor: u64,
}

impl DataSpace {
    pub(crate) fn new(map: DataSpaceMap) -> DataSpace {
        DataSpace {
            map,
            reserved: BlockSet::default(),
            freed: BlockSet::default(),
            held: BlockSet::default(),
            hold_freed: false,
            newly_held: Vec::new(),
            cursor: 0,
        }
    }

    /// The space map (committed references only: no reservation is in it).
    pub(crate) fn map(&self) -> &DataSpaceMap {
        &self.map
    }

    /// Data blocks in the pool.
    pub(crate) fn block_count(&self) -> u64 {
        self.map.block_count()
    }

    /// Blocks in use: referenced by a mapping, or reserved.
    pub(crate) fn used_count(&self) -> u64 {
        self.map.core().allocated_count() + self.reserved.len() as u64
    }

    /// Reference count of `block` in the space map (0 for a reserved block).
    pub(crate) fn count(&self, block: DataBlock) -> u32 {
        self.map.count(block.get())
    }

    /// Whether `block` is reserved for a write in flight.
    pub(crate) fn is_reserved(&self, block: DataBlock) -> bool {
        self.reserved.contains(&block)
    }

    /// Reserve a free block. `OutOfDataSpace` when every block is in use, reserved, or
    /// freed in this transaction.
    pub(crate) fn reserve(&mut self) -> Result<DataBlock> {
        let block_count = self.map.block_count();
        let start = self.cursor.min(block_count.saturating_sub(1));
        let found = self
            .search(start, block_count)
            .or_else(|| self.search(0, start))
            .ok_or(Error::OutOfDataSpace { block_count })?;
        let block = DataBlock::new(found);
        debug_assert_eq!(self.map.count(found), 0, "reserving a referenced block");
        self.reserved.insert(block);
        self.cursor = found + 1;
        Ok(block)
    }

    /// First block in `begin..end` that is free in the space map, not reserved and not
    /// freed in this transaction. Full bitmaps are skipped whole.
    fn search(&self, begin: u64, end: u64) -> Option<u64> {
        let core = self.map.core();
        let mut block = begin;
        while block < end {
            let bitmap = (block / ENTRIES_PER_BITMAP) as usize;
            let bitmap_begin = bitmap as u64 * ENTRIES_PER_BITMAP;
            let bitmap_end = (bitmap_begin + ENTRIES_PER_BITMAP).min(end);
            if core.bitmap_free_count(bitmap) == 0 {
                block = bitmap_end;
                continue;
            }
            let words = core.bitmap_words(bitmap);
            while block < bitmap_end {
                let word_begin = block - block % ENTRIES_PER_WORD;
                let word = words[((word_begin - bitmap_begin) / ENTRIES_PER_WORD) as usize];
                // Entry j is free when neither of its two bits is set.
                let mut free = !(word | (word >> 1)) & LOW_BITS;
                free &= !0u64 << ((block - word_begin) * 2);
                while free != 0 {
                    let candidate = word_begin + u64::from(free.trailing_zeros() / 2);
                    if candidate >= bitmap_end {
                        break;
                    }
                    let b = DataBlock::new(candidate);
                    if !self.reserved.contains(&b)
                        && !self.freed.contains(&b)
                        && !self.held.contains(&b)
                    {
                        return Some(candidate);
                    }
                    free &= free - 1;
                }
                block = word_begin + ENTRIES_PER_WORD;
            }
            block = block.max(bitmap_end);
        }
        None
    }

    /// Runs `(first, count)` of the blocks in `begin..end` that nothing uses or may use
    /// soon: count zero, not reserved, not freed in this transaction, not held.
    pub(crate) fn free_runs(&self, begin: u64, end: u64) -> Vec<(u64, u64)> {
        let end = end.min(self.map.block_count());
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut block = begin;
        while let Some(found) = self.search(block, end) {
            match runs.last_mut() {
                Some((first, count)) if *first + *count == found => *count += 1,
                _ => runs.push((found, 1)),
            }
            block = found + 1;
        }
        runs
    }

    /// Forget a reservation. Returns whether `block` was reserved.
    pub(crate) fn release(&mut self, block: DataBlock) -> bool {
        self.reserved.remove(&block)
    }

    /// From now on, hold the blocks each commit frees.
    pub(crate) fn set_hold_freed(&mut self, hold: bool) {
        self.hold_freed = hold;
    }

    /// The blocks commits held since the last call.
    pub(crate) fn take_newly_held(&mut self) -> Vec<DataBlock> {
        std::mem::take(&mut self.newly_held)
    }

    /// Hold `block` if it is free (count zero, in range, not reserved, not freed in this
    /// transaction, not held). Returns whether it is now held.
    pub(crate) fn hold(&mut self, block: DataBlock) -> bool {
        if block.get() >= self.map.block_count()
            || self.map.count(block.get()) != 0
            || self.reserved.contains(&block)
            || self.freed.contains(&block)
        {
            return false;
        }
        self.held.insert(block)
    }

    /// Whether `block` is held.
    pub(crate) fn is_held(&self, block: DataBlock) -> bool {
        self.held.contains(&block)
    }

    /// Let a held block be reserved again. Returns whether it was held.
    pub(crate) fn release_held(&mut self, block: DataBlock) -> bool {
        self.held.remove(&block)
    }

    /// Map a reserved block: it leaves the reserved set and enters the space map with the
    /// mapping's reference. The caller checked [`DataSpace::is_reserved`].
    pub(crate) fn take_reserved(&mut self, block: DataBlock) -> Result<()> {
        if !self.reserved.remove(&block) {
            return Err(Error::Internal(format!(
                "data block {block} mapped without a reservation"
            )));
        }
        debug_assert_eq!(self.map.count(block.get()), 0, "a reserved block is free");
        self.map.inc(block.get())?;
        Ok(())
    }

    /// Grow to `block_count` blocks.
    pub(crate) fn extend(&mut self, block_count: u64) {
        self.map.extend(block_count);
    }

    /// Write the space map into `tm`'s transaction. It holds no reservation, so the
    /// reservations survive the commit in memory only.
    pub(crate) fn commit(&mut self, tm: &mut TransactionManager) -> Result<SpaceMapRoot> {
        debug_assert!(
            self.reserved.iter().all(|b| self.map.count(b.get()) == 0),
            "a reserved data block is referenced in the space map being committed"
        );
        let root = self.map.commit(tm)?;
        if self.hold_freed {
            for block in self.freed.drain() {
                if self.map.count(block.get()) == 0 && self.held.insert(block) {
                    self.newly_held.push(block);
                }
            }
        } else {
            self.freed.clear();
        }
        Ok(root)
    }
}

impl DataRefCounter for DataSpace {
    /// One more reference to a block a mapping holds (a copied leaf, a shared subtree).
    fn inc(&mut self, block: DataBlock) -> persistent_data::Result<()> {
        debug_assert!(
            !self.reserved.contains(&block),
            "reserved data block {block} referenced by a mapping"
        );
        self.map.inc(block.get())
    }

    /// One reference less; a block whose count falls to zero is freed for this transaction.
    fn dec(&mut self, block: DataBlock) -> persistent_data::Result<()> {
        if self.map.dec(block.get())? == 0 {
            self.freed.insert(block);
        }
        Ok(())
    }
}

/// Top-level values while updating a volume's root: a copied top-level leaf takes a
/// reference to each subtree; an overwritten root was already released by shadowing.
pub(crate) struct SubtreeUpdate;

impl RefCounter<u64> for SubtreeUpdate {
    fn inc(&mut self, tm: &mut dyn CopyOnWrite, value: &u64) -> persistent_data::Result<()> {
        tm.inc(MetadataBlock::new(*value))
    }
    fn dec(&mut self, _: &mut dyn CopyOnWrite, _: &u64) -> persistent_data::Result<()> {
        Ok(())
    }
}

/// Top-level values while deleting: a removed entry releases its whole subtree.
pub(crate) struct SubtreeDelete<'a>(pub &'a mut DataSpace);

impl RefCounter<u64> for SubtreeDelete<'_> {
    fn inc(&mut self, tm: &mut dyn CopyOnWrite, value: &u64) -> persistent_data::Result<()> {
        tm.inc(MetadataBlock::new(*value))
    }
    fn dec(&mut self, tm: &mut dyn CopyOnWrite, value: &u64) -> persistent_data::Result<()> {
        btree::delete_tree::<u64, _>(tm, &mut DataRefs(self.0), MetadataBlock::new(*value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use persistent_data::block_manager::BlockManager;
    use persistent_data::{BlockDevice, MemoryDevice};
    use std::sync::Arc;

    fn space(block_count: u64) -> (TransactionManager, DataSpace) {
        let device: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(256));
        let bm = Arc::new(BlockManager::new(device, 64));
        let mut tm = TransactionManager::format(bm, 256).unwrap();
        let map = DataSpaceMap::format(&mut tm, block_count).unwrap();
        (tm, DataSpace::new(map))
    }

    #[test]
    fn reservations_count_as_used_and_stay_out_of_the_space_map() {
        let (mut tm, mut space) = space(3);
        let a = space.reserve().unwrap();
        let b = space.reserve().unwrap();
        assert_ne!(a, b);
        assert_eq!(space.used_count(), 2);
        assert_eq!(space.count(a), 0);
        space.take_reserved(a).unwrap();
        assert_eq!(space.count(a), 1);
        assert!(space.take_reserved(a).is_err(), "a reservation maps once");
        let root = space.commit(&mut tm).unwrap();
        assert_eq!(root.allocated_count, 1, "the committed map leaves out {b}");
        assert!(space.release(b));
        assert_eq!(space.used_count(), 1);
    }

    #[test]
    fn blocks_freed_while_holding_stay_out_of_reach_until_released() {
        let (mut tm, mut space) = space(2);
        space.set_hold_freed(true);
        let a = space.reserve().unwrap();
        space.take_reserved(a).unwrap();
        space.commit(&mut tm).unwrap();
        assert!(space.take_newly_held().is_empty());
        space.dec(a).unwrap();
        assert_eq!(space.count(a), 0);
        space.commit(&mut tm).unwrap();
        assert_eq!(space.take_newly_held(), vec![a]);
        assert!(space.is_held(a));
        assert_eq!(
            space.used_count(),
            0,
            "a held block is free in the space map"
        );
        let b = space.reserve().unwrap();
        assert_ne!(a, b);
        assert!(space.reserve().is_err(), "the held block is not reserved");
        assert!(!space.hold(b), "a reserved block is not held");
        assert!(space.release_held(a));
        assert_eq!(space.reserve().unwrap(), a);
    }

    #[test]
    fn a_block_freed_in_a_transaction_is_not_reserved_before_it_commits() {
        let (mut tm, mut space) = space(2);
        let a = space.reserve().unwrap();
        space.take_reserved(a).unwrap();
        space.commit(&mut tm).unwrap();
        space.dec(a).unwrap();
        assert_eq!(space.count(a), 0, "the last reference to {a} is gone");
        let b = space.reserve().unwrap();
        assert_ne!(a, b);
        assert!(matches!(
            space.reserve(),
            Err(Error::OutOfDataSpace { block_count: 2 })
        ));
        space.commit(&mut tm).unwrap();
        space.release(b);
        let again: Vec<DataBlock> = (0..2).map(|_| space.reserve().unwrap()).collect();
        assert!(again.contains(&a));
    }
}
