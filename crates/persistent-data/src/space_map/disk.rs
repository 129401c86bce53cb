//! On-disk form of the space maps: bitmap blocks, the metadata index block, and the data
//! space map (index btree + bitmaps + overflow btree).
//!
//! Bitmap block layout (spec §7.3):
//!
//! ```text
//!   0  csum      u32  (salt 240779)
//!   4  not_used  u32  = 0
//!   8  blocknr   u64
//!  16  510 × u64 words, 32 two-bit entries each, entry j at bits 2j (high) and 2j+1 (low)
//! ```
//!
//! Metadata index block: the same 16-byte header (salt 160478) then 255 index entries of 16
//! bytes at offset 16 + 16 i.

use super::core::{bitmap_count, CoreSpaceMap, ENTRIES_PER_BITMAP, WORDS_PER_BITMAP};
use super::{IndexEntry, SpaceMapRoot, MAX_METADATA_BITMAPS};
use crate::block::{zeroed_block, Block, MetadataBlock};
use crate::btree::{self, NoRefs, Value};
use crate::checksum::BlockKind;
use crate::cow::{BlockSource, CopyOnWrite};
use crate::error::{Error, Result};
use std::sync::Arc;

const HEADER_SIZE: usize = 16;

/// Build a bitmap block (checksum left for the commit to stamp).
pub fn encode_bitmap(location: MetadataBlock, words: &[u64]) -> Box<Block> {
    assert_eq!(words.len(), WORDS_PER_BITMAP);
    let mut data = zeroed_block();
    data[8..16].copy_from_slice(&location.get().to_le_bytes());
    for (i, word) in words.iter().enumerate() {
        let at = HEADER_SIZE + i * 8;
        data[at..at + 8].copy_from_slice(&word.to_le_bytes());
    }
    data
}

/// Read, validate and decode bitmap `index` of a map of `block_count` blocks.
pub fn read_bitmap(
    source: &dyn BlockSource,
    entry: &IndexEntry,
    index: usize,
    block_count: u64,
) -> Result<Vec<u64>> {
    let location = MetadataBlock::new(entry.blocknr);
    if entry.blocknr == 0 || entry.blocknr >= source.block_count() {
        return Err(Error::corrupt(
            location,
            format!(
                "index entry {index} points at block {} (device has {} blocks)",
                entry.blocknr,
                source.block_count()
            ),
        ));
    }
    let data = source.read_block(location, BlockKind::Bitmap)?;
    let mut words = Vec::with_capacity(WORDS_PER_BITMAP);
    for i in 0..WORDS_PER_BITMAP {
        let at = HEADER_SIZE + i * 8;
        words.push(u64::from_le_bytes(
            data[at..at + 8].try_into().expect("8 bytes"),
        ));
    }
    // Entries past the end of the map must be zero.
    let first = index as u64 * ENTRIES_PER_BITMAP;
    if first + ENTRIES_PER_BITMAP > block_count {
        let valid = block_count.saturating_sub(first);
        for entry_index in valid..ENTRIES_PER_BITMAP {
            let word = words[(entry_index / 32) as usize];
            if (word >> ((entry_index % 32) * 2)) & 3 != 0 {
                return Err(Error::corrupt(
                    location,
                    format!(
                        "bitmap entry for block {} beyond the map's {block_count} blocks is in use",
                        first + entry_index
                    ),
                ));
            }
        }
    }
    Ok(words)
}

/// Build the metadata index block.
pub fn encode_index_block(location: MetadataBlock, entries: &[IndexEntry]) -> Box<Block> {
    assert!(entries.len() <= MAX_METADATA_BITMAPS);
    let mut data = zeroed_block();
    data[8..16].copy_from_slice(&location.get().to_le_bytes());
    for (i, entry) in entries.iter().enumerate() {
        let at = HEADER_SIZE + i * IndexEntry::SIZE;
        entry.pack(&mut data[at..at + IndexEntry::SIZE]);
    }
    data
}

/// Decode all 255 entries of a metadata index block.
pub fn decode_index_block(data: &Block) -> Vec<IndexEntry> {
    (0..MAX_METADATA_BITMAPS)
        .map(|i| {
            let at = HEADER_SIZE + i * IndexEntry::SIZE;
            IndexEntry::unpack(&data[at..at + IndexEntry::SIZE])
        })
        .collect()
}

/// The data space map: a count for every data block, stored in metadata blocks.
#[derive(Debug, Clone)]
pub struct DataSpaceMap {
    core: CoreSpaceMap,
    bitmap_locations: Vec<Option<MetadataBlock>>,
    index_root: MetadataBlock,
    overflow_root: MetadataBlock,
}

impl DataSpaceMap {
    /// A new, empty data space map of `block_count` blocks. Its trees are created in the
    /// transaction at its first commit.
    pub fn format(_tm: &mut dyn CopyOnWrite, block_count: u64) -> Result<DataSpaceMap> {
        let core = CoreSpaceMap::new(block_count);
        let bitmaps = core.bitmap_count();
        Ok(DataSpaceMap {
            core,
            bitmap_locations: vec![None; bitmaps],
            // Created at the first commit (block 0, the superblock, means "not yet"), so a
            // restore's first blocks go to what it builds, as thin_restore's do.
            index_root: MetadataBlock::SUPERBLOCK,
            overflow_root: MetadataBlock::SUPERBLOCK,
        })
    }

    /// Load the data space map described by `root`.
    pub fn open(source: &dyn BlockSource, root: &SpaceMapRoot) -> Result<DataSpaceMap> {
        // Every bitmap is a metadata block: a size needing more bitmaps than the metadata
        // device has blocks is corrupt (and must not be allocated).
        if root.block_count.div_ceil(ENTRIES_PER_BITMAP) > source.block_count() {
            return Err(Error::corrupt(
                MetadataBlock::new(root.bitmap_root),
                format!(
                    "data space map of {} blocks needs more bitmaps than the metadata device's {} blocks",
                    root.block_count,
                    source.block_count()
                ),
            ));
        }
        let mut core = CoreSpaceMap::new(root.block_count);
        let bitmaps = bitmap_count(root.block_count);
        let mut bitmap_locations = vec![None; bitmaps];
        let index_root = MetadataBlock::new(root.bitmap_root);
        let mut loaded = vec![false; bitmaps];
        btree::walk::<IndexEntry, _>(source, index_root, &mut |key, entry| {
            let index = usize::try_from(key)
                .ok()
                .filter(|&i| i < bitmaps)
                .ok_or_else(|| {
                    Error::corrupt(
                        index_root,
                        format!("data space map index has entry {key}, map needs {bitmaps}"),
                    )
                })?;
            let words = read_bitmap(source, &entry, index, root.block_count)?;
            core.load_bitmap(index, &words);
            bitmap_locations[index] = Some(MetadataBlock::new(entry.blocknr));
            loaded[index] = true;
            Ok(())
        })?;
        if let Some(missing) = loaded.iter().position(|l| !l) {
            return Err(Error::corrupt(
                index_root,
                format!("data space map index lacks bitmap {missing}"),
            ));
        }
        let overflow_root = MetadataBlock::new(root.ref_count_root);
        btree::walk::<u32, _>(source, overflow_root, &mut |key, count| {
            if key >= root.block_count {
                return Err(Error::corrupt(
                    overflow_root,
                    format!("data overflow count for block {key} beyond the map"),
                ));
            }
            core.load_overflow(key, count);
            Ok(())
        })?;
        if let Some((_, rule)) = core.overflow_mismatch() {
            return Err(Error::corrupt(
                overflow_root,
                format!("data space map: {rule}"),
            ));
        }
        core.end_transaction();
        Ok(DataSpaceMap {
            core,
            bitmap_locations,
            index_root,
            overflow_root,
        })
    }

    /// The counts.
    pub fn core(&self) -> &CoreSpaceMap {
        &self.core
    }

    /// Number of data blocks.
    pub fn block_count(&self) -> u64 {
        self.core.block_count()
    }

    /// Free data blocks.
    pub fn free_count(&self) -> u64 {
        self.core.free_count()
    }

    /// Count of a data block.
    pub fn count(&self, block: u64) -> u32 {
        self.core.count(block)
    }

    /// Take a reference to a data block.
    pub fn inc(&mut self, block: u64) -> Result<()> {
        self.check(block)?;
        self.core.inc(block);
        Ok(())
    }

    /// Drop a reference to a data block; returns the count left.
    pub fn dec(&mut self, block: u64) -> Result<u32> {
        self.check(block)?;
        self.core
            .dec(block)
            .map_err(|b| Error::Invalid(format!("dropping a reference to free data block {b}")))
    }

    fn check(&self, block: u64) -> Result<()> {
        if block >= self.core.block_count() {
            return Err(Error::Invalid(format!(
                "data block {block} beyond the data space map ({} blocks)",
                self.core.block_count()
            )));
        }
        Ok(())
    }

    /// Allocate a data block (count 1).
    pub fn alloc(&mut self) -> Result<u64> {
        self.core.alloc().ok_or(Error::OutOfDataSpace {
            block_count: self.core.block_count(),
        })
    }

    /// Grow to `block_count` data blocks.
    pub fn extend(&mut self, block_count: u64) {
        self.core.extend(block_count);
        self.bitmap_locations.resize(self.core.bitmap_count(), None);
    }

    /// Write the changed bitmaps and overflow counts into metadata (in `tm`'s transaction)
    /// and return the root for the superblock. Call before the metadata space map's commit.
    pub fn commit(&mut self, tm: &mut dyn CopyOnWrite) -> Result<SpaceMapRoot> {
        if self.index_root == MetadataBlock::SUPERBLOCK {
            self.index_root = btree::create_empty::<IndexEntry>(tm)?;
        }
        if self.overflow_root == MetadataBlock::SUPERBLOCK {
            self.overflow_root = btree::create_empty::<u32>(tm)?;
        }
        let mut overflow_root = self.overflow_root;
        for (key, count) in self.core.take_overflow_changes() {
            overflow_root = match count {
                Some(count) => btree::insert(tm, &mut NoRefs, overflow_root, key, &count)?.0,
                None => btree::remove::<u32, _>(tm, &mut NoRefs, overflow_root, key)?.0,
            };
        }
        self.overflow_root = overflow_root;
        let mut index_root = self.index_root;
        for index in self.core.dirty_bitmaps() {
            let location = match self.bitmap_locations[index] {
                Some(b) if tm.is_shadowed(b) => b,
                current => {
                    let new = tm.new_block()?;
                    if let Some(old) = current {
                        tm.dec(old)?;
                    }
                    new
                }
            };
            self.bitmap_locations[index] = Some(location);
            tm.write(
                location,
                Arc::from(encode_bitmap(location, self.core.bitmap_words(index))),
                BlockKind::Bitmap,
            );
            let entry = IndexEntry {
                blocknr: location.get(),
                free_count: self.core.bitmap_free_count(index),
                none_free_before: self.core.bitmap_first_free(index),
            };
            index_root = btree::insert(tm, &mut NoRefs, index_root, index as u64, &entry)?.0;
            self.core.mark_clean(index);
        }
        self.index_root = index_root;
        self.core.end_transaction();
        Ok(self.root())
    }

    /// The root as of the last commit (or format).
    pub fn root(&self) -> SpaceMapRoot {
        SpaceMapRoot {
            block_count: self.core.block_count(),
            allocated_count: self.core.allocated_count(),
            bitmap_root: self.index_root.get(),
            ref_count_root: self.overflow_root.get(),
        }
    }
}
