//! The transaction manager: the one writer of a metadata device.
//!
//! It owns the metadata space map and the blocks changed in the current transaction, and
//! implements dm-thin's copy-on-write discipline (spec §8.1):
//!
//! - No block reachable from the last committed superblock is modified in place. To change a
//!   block, `shadow` it: allocate a new block, copy, drop one reference to the original.
//!   Blocks allocated in this transaction ("shadowed") are changed in place.
//! - Changed blocks stay in memory (`dirty`) until the commit writes them.
//! - Commit is two-phase: every dirty block written and flushed, then the superblock written
//!   and flushed. A crash before the superblock write leaves the previous commit, whose blocks
//!   were never overwritten: the allocator never hands out a block that is in use in the
//!   committed state (a block freed in this transaction is not reused before it commits).
//!
//! The metadata space map accounts for its own blocks (bitmaps, index block, overflow tree).
//! The overflow tree is a btree changed through this manager's [`CopyOnWrite`] implementation;
//! `commit_space_map` resolves the knot by iterating until updating the map allocates nothing
//! more, then writing it: see the function's comment.

use crate::block::{zeroed_block, Block, MetadataBlock};
use crate::block_manager::{BlockManager, BLOCKNR_OFFSET};
use crate::btree::{self, NoRefs};
use crate::checksum::{self, BlockKind};
use crate::cow::{BlockSource, CopyOnWrite};
use crate::error::{Error, Result};
use crate::space_map::core::{bitmap_count, CoreSpaceMap};
use crate::space_map::{disk, IndexEntry, SpaceMapRoot, MAX_METADATA_BITMAPS};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// The one writer of a metadata device.
pub struct TransactionManager {
    bm: Arc<BlockManager>,
    sm: CoreSpaceMap,
    /// Location of each metadata bitmap (None until first written).
    bitmap_locations: Vec<Option<MetadataBlock>>,
    index_block: Option<MetadataBlock>,
    /// Root of the overflow tree; `None` until the first commit of a fresh map creates it
    /// (so a restore's first blocks go to what it builds, as thin_restore's do).
    overflow_root: Option<MetadataBlock>,
    dirty: HashMap<MetadataBlock, (Arc<Block>, BlockKind)>,
    shadowed: HashSet<MetadataBlock>,
}

impl std::fmt::Debug for TransactionManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransactionManager")
            .field("metadata_blocks", &self.sm.block_count())
            .field("dirty_blocks", &self.dirty.len())
            .finish()
    }
}

impl BlockSource for TransactionManager {
    fn read_block(&self, block: MetadataBlock, kind: BlockKind) -> Result<Arc<Block>> {
        self.read(block, kind)
    }
    fn block_count(&self) -> u64 {
        self.sm.block_count()
    }
}

/// The btree and the data space map change metadata through this (the inherent methods of
/// the same names do the work).
impl CopyOnWrite for TransactionManager {
    fn new_block(&mut self) -> Result<MetadataBlock> {
        TransactionManager::new_block(self)
    }
    fn shadow(
        &mut self,
        block: MetadataBlock,
        kind: BlockKind,
    ) -> Result<(MetadataBlock, Arc<Block>, bool)> {
        TransactionManager::shadow(self, block, kind)
    }
    fn write(&mut self, block: MetadataBlock, data: Arc<Block>, kind: BlockKind) {
        TransactionManager::write(self, block, data, kind);
    }
    fn is_shadowed(&self, block: MetadataBlock) -> bool {
        TransactionManager::is_shadowed(self, block)
    }
    fn count(&self, block: MetadataBlock) -> u32 {
        TransactionManager::count(self, block)
    }
    fn inc(&mut self, block: MetadataBlock) -> Result<()> {
        TransactionManager::inc(self, block)
    }
    fn dec(&mut self, block: MetadataBlock) -> Result<u32> {
        TransactionManager::dec(self, block)
    }
}

impl TransactionManager {
    /// Start a fresh metadata space map over the first `block_count` blocks of the device
    /// (at most 4 161 600). Block 0, the superblock, gets its implicit reference. Nothing is
    /// written until the first commit.
    pub fn format(bm: Arc<BlockManager>, block_count: u64) -> Result<TransactionManager> {
        let block_count = block_count.min(crate::space_map::METADATA_BLOCKS_MAX);
        if block_count > bm.block_count() || block_count < 8 {
            return Err(Error::Invalid(format!(
                "metadata space map of {block_count} blocks on a device of {} blocks",
                bm.block_count()
            )));
        }
        let mut sm = CoreSpaceMap::new(block_count);
        sm.set(0, 1);
        let bitmaps = sm.bitmap_count();
        let tm = TransactionManager {
            bm,
            sm,
            bitmap_locations: vec![None; bitmaps],
            index_block: None,
            overflow_root: None,
            dirty: HashMap::new(),
            shadowed: HashSet::new(),
        };
        Ok(tm)
    }

    /// Open the metadata space map described by `root` (from a superblock).
    pub fn open(bm: Arc<BlockManager>, root: &SpaceMapRoot) -> Result<TransactionManager> {
        let device_blocks = bm.block_count();
        if root.block_count > device_blocks
            || root.block_count > crate::space_map::METADATA_BLOCKS_MAX
        {
            return Err(Error::corrupt(
                MetadataBlock::SUPERBLOCK,
                format!(
                    "metadata space map claims {} blocks, the device has {device_blocks}",
                    root.block_count
                ),
            ));
        }
        let mut sm = CoreSpaceMap::new(root.block_count);
        let index_block = MetadataBlock::new(root.bitmap_root);
        let index = bm.read(index_block, BlockKind::Index)?;
        let entries = disk::decode_index_block(&index);
        let bitmaps = bitmap_count(root.block_count);
        let mut bitmap_locations = Vec::with_capacity(bitmaps);
        for (i, entry) in entries.iter().take(bitmaps).enumerate() {
            let words = disk::read_bitmap(&*bm, entry, i, root.block_count)?;
            sm.load_bitmap(i, &words);
            bitmap_locations.push(Some(MetadataBlock::new(entry.blocknr)));
        }
        let overflow_root = MetadataBlock::new(root.ref_count_root);
        btree::walk::<u32, _>(&*bm, overflow_root, &mut |key, count| {
            if key >= root.block_count {
                return Err(Error::corrupt(
                    overflow_root,
                    format!("metadata overflow count for block {key} beyond the map"),
                ));
            }
            sm.load_overflow(key, count);
            Ok(())
        })?;
        if let Some((_, rule)) = sm.overflow_mismatch() {
            return Err(Error::corrupt(
                overflow_root,
                format!("metadata space map: {rule}"),
            ));
        }
        sm.end_transaction();
        Ok(TransactionManager {
            bm,
            sm,
            bitmap_locations,
            index_block: Some(index_block),
            overflow_root: Some(overflow_root),
            dirty: HashMap::new(),
            shadowed: HashSet::new(),
        })
    }

    /// The block manager underneath.
    pub fn block_manager(&self) -> &Arc<BlockManager> {
        &self.bm
    }

    /// The metadata space map (read-only view).
    pub fn space_map(&self) -> &CoreSpaceMap {
        &self.sm
    }

    /// Number of blocks changed in this transaction.
    pub fn dirty_count(&self) -> usize {
        self.dirty.len()
    }

    /// Read a block as it is in this transaction.
    pub fn read(&self, block: MetadataBlock, kind: BlockKind) -> Result<Arc<Block>> {
        if let Some((data, dirty_kind)) = self.dirty.get(&block) {
            assert_eq!(*dirty_kind, kind, "block {block} read as another kind");
            return Ok(data.clone());
        }
        if block.get() >= self.sm.block_count() {
            return Err(Error::corrupt(
                block,
                format!(
                    "reference beyond the metadata space map ({} blocks)",
                    self.sm.block_count()
                ),
            ));
        }
        self.bm.read(block, kind)
    }

    /// Whether `block` was allocated in this transaction (and so may be changed in place).
    pub fn is_shadowed(&self, block: MetadataBlock) -> bool {
        self.shadowed.contains(&block)
    }

    /// Allocate a new metadata block (count 1), zero-filled, owned by this transaction.
    pub fn new_block(&mut self) -> Result<MetadataBlock> {
        let block = self
            .sm
            .alloc()
            .map(MetadataBlock::new)
            .ok_or(Error::OutOfMetadataSpace {
                block_count: self.sm.block_count(),
            })?;
        self.shadowed.insert(block);
        Ok(block)
    }

    /// Prepare `block` for change. Returns the block to write the change to, its contents
    /// (taken out of the transaction: hand them back with `write`), and whether the original
    /// was shared (count > 1) so the caller must take a reference to everything it points to.
    pub fn shadow(
        &mut self,
        block: MetadataBlock,
        kind: BlockKind,
    ) -> Result<(MetadataBlock, Arc<Block>, bool)> {
        // A block of this transaction may be changed in place, unless something took a
        // second reference to it since (a snapshot sharing a root created this transaction).
        if self.shadowed.contains(&block) && self.sm.count(block.get()) == 1 {
            let data = match self.dirty.remove(&block) {
                Some((data, _)) => data,
                None => self.bm.read(block, kind)?,
            };
            return Ok((block, data, false));
        }
        let original = self.read(block, kind)?;
        let count = self.sm.count(block.get());
        if count == 0 {
            return Err(Error::corrupt(
                block,
                "shadowing a block whose reference count is 0",
            ));
        }
        let copy = self.new_block()?;
        self.sm.set(block.get(), count - 1);
        let mut data = zeroed_block();
        data.copy_from_slice(&original[..]);
        data[BLOCKNR_OFFSET..BLOCKNR_OFFSET + 8].copy_from_slice(&copy.get().to_le_bytes());
        Ok((copy, Arc::from(data), count > 1))
    }

    /// Store the new contents of a block owned by this transaction. The checksum is stamped
    /// when the block is written at commit.
    pub fn write(&mut self, block: MetadataBlock, data: Arc<Block>, kind: BlockKind) {
        assert!(
            self.shadowed.contains(&block),
            "block {block} written without being shadowed"
        );
        debug_assert_eq!(
            crate::block_manager::stored_location(&data),
            block.get(),
            "block {block} carries another location"
        );
        self.dirty.insert(block, (data, kind));
    }

    /// Reference count of a metadata block.
    pub fn count(&self, block: MetadataBlock) -> u32 {
        self.sm.count(block.get())
    }

    /// Take one more reference to a metadata block.
    pub fn inc(&mut self, block: MetadataBlock) -> Result<()> {
        self.check_in_map(block)?;
        self.sm.inc(block.get());
        Ok(())
    }

    /// Drop a reference to a metadata block; at zero it is free (after this transaction).
    pub fn dec(&mut self, block: MetadataBlock) -> Result<u32> {
        self.check_in_map(block)?;
        let left = self.sm.dec(block.get()).map_err(|b| {
            Error::corrupt(
                MetadataBlock::new(b),
                "dropping a reference to a free block",
            )
        })?;
        if left == 0 {
            self.dirty.remove(&block);
            self.shadowed.remove(&block);
        }
        Ok(left)
    }

    fn check_in_map(&self, block: MetadataBlock) -> Result<()> {
        if block.get() >= self.sm.block_count() {
            return Err(Error::corrupt(
                block,
                format!(
                    "reference beyond the metadata space map ({} blocks)",
                    self.sm.block_count()
                ),
            ));
        }
        Ok(())
    }

    /// Grow the metadata space map to `block_count` blocks (the device must already be that
    /// large). The new bitmaps are allocated from the grown area at the next commit.
    pub fn extend(&mut self, block_count: u64) -> Result<()> {
        let block_count = block_count.min(crate::space_map::METADATA_BLOCKS_MAX);
        if block_count > self.bm.block_count() {
            return Err(Error::Invalid(format!(
                "metadata device has {} blocks, cannot grow the space map to {block_count}",
                self.bm.block_count()
            )));
        }
        if block_count <= self.sm.block_count() {
            return Ok(());
        }
        self.sm.extend(block_count);
        self.bitmap_locations.resize(self.sm.bitmap_count(), None);
        Ok(())
    }

    /// Phase one of a commit, for the metadata space map: bring its on-disk form up to date
    /// and return its root for the superblock. Call after every other structure (including
    /// the data space map) has been updated, since they allocate metadata blocks.
    ///
    /// Updating the map changes counts in the map itself (a new bitmap location is a new
    /// block; the old one is released; overflow-tree nodes are shadowed). So: apply overflow
    /// changes to the overflow tree, move every changed bitmap to a block of this transaction,
    /// move the index block likewise, and repeat until a pass changes nothing. Each bitmap and
    /// the index block move at most once per transaction, so the loop ends. Only then are the
    /// bitmaps and the index block serialized, from counts that no longer change.
    pub fn commit_space_map(&mut self) -> Result<SpaceMapRoot> {
        if self.overflow_root.is_none() {
            self.overflow_root = Some(btree::create_empty::<u32>(self)?);
        }
        for _pass in 0..1000 {
            let mut changed = false;
            let changes = self.sm.take_overflow_changes();
            if !changes.is_empty() {
                changed = true;
                let mut root = self.overflow_root.expect("created above");
                for (key, count) in changes {
                    root = match count {
                        Some(count) => btree::insert(self, &mut NoRefs, root, key, &count)?.0,
                        None => btree::remove::<u32, _>(self, &mut NoRefs, root, key)?.0,
                    };
                }
                self.overflow_root = Some(root);
            }
            for index in self.sm.dirty_bitmaps() {
                let current = self.bitmap_locations[index];
                if current.is_some_and(|b| self.shadowed.contains(&b)) {
                    continue;
                }
                let new = self.new_block()?;
                if let Some(old) = current {
                    self.dec(old)?;
                }
                self.bitmap_locations[index] = Some(new);
                changed = true;
            }
            if !self.index_block.is_some_and(|b| self.shadowed.contains(&b)) {
                let new = self.new_block()?;
                if let Some(old) = self.index_block {
                    self.dec(old)?;
                }
                self.index_block = Some(new);
                changed = true;
            }
            if !changed {
                return self.write_metadata_space_map();
            }
        }
        unreachable!("metadata space-map commit did not converge");
    }

    fn write_metadata_space_map(&mut self) -> Result<SpaceMapRoot> {
        let bitmaps = self.sm.bitmap_count();
        assert!(bitmaps <= MAX_METADATA_BITMAPS);
        let mut entries = Vec::with_capacity(bitmaps);
        for index in 0..bitmaps {
            let location = self.bitmap_locations[index].expect("every bitmap placed");
            if self.sm.is_dirty(index) {
                let data = disk::encode_bitmap(location, self.sm.bitmap_words(index));
                self.write(location, Arc::from(data), BlockKind::Bitmap);
            }
            entries.push(IndexEntry {
                blocknr: location.get(),
                free_count: self.sm.bitmap_free_count(index),
                none_free_before: self.sm.bitmap_first_free(index),
            });
        }
        let index_block = self.index_block.expect("index block placed");
        let data = disk::encode_index_block(index_block, &entries);
        self.write(index_block, Arc::from(data), BlockKind::Index);
        assert!(
            !self.sm.has_overflow_changes(),
            "space map changed while being written"
        );
        Ok(SpaceMapRoot {
            block_count: self.sm.block_count(),
            allocated_count: self.sm.allocated_count(),
            bitmap_root: index_block.get(),
            ref_count_root: self.overflow_root.expect("created at commit").get(),
        })
    }

    /// Phase two of a commit: write every changed block, flush, then write `superblock` at
    /// block 0 and flush. `superblock` must carry the roots returned by `commit_space_map`
    /// (and by the data space map's commit); its checksum is stamped here.
    ///
    /// On error the transaction must be abandoned (the device holds some of the new blocks,
    /// but the previous superblock still describes a complete, untouched state).
    pub fn commit(&mut self, mut superblock: Box<Block>) -> Result<()> {
        let mut blocks: Vec<_> = self.dirty.drain().collect();
        blocks.sort_by_key(|(b, _)| *b);
        for (block, (data, kind)) in blocks {
            assert_ne!(
                block,
                MetadataBlock::SUPERBLOCK,
                "superblock written before the commit point"
            );
            let mut data = data;
            checksum::stamp(Arc::make_mut(&mut data), kind);
            self.bm.write(block, data, kind)?;
        }
        self.bm.flush()?;
        superblock[BLOCKNR_OFFSET..BLOCKNR_OFFSET + 8].copy_from_slice(&0u64.to_le_bytes());
        checksum::stamp(&mut superblock, BlockKind::Superblock);
        self.bm.write(
            MetadataBlock::SUPERBLOCK,
            Arc::from(superblock),
            BlockKind::Superblock,
        )?;
        self.bm.flush()?;
        self.shadowed.clear();
        self.sm.end_transaction();
        Ok(())
    }

    /// Write a whole block outside the transaction discipline, e.g. a metadata-snapshot
    /// superblock placed in a block of this transaction.
    pub fn write_raw_superblock(&mut self, block: MetadataBlock, mut data: Box<Block>) {
        data[BLOCKNR_OFFSET..BLOCKNR_OFFSET + 8].copy_from_slice(&block.get().to_le_bytes());
        self.write(block, Arc::from(data), BlockKind::Superblock);
    }
}
