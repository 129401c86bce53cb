//! Space maps: a reference count for every block of a device (spec §7).
//!
//! - [`core::CoreSpaceMap`]: the counts in memory, packed as on disk; used by both maps.
//! - The **metadata space map** lives inside the transaction manager (it allocates the
//!   blocks every other structure is made of) and is stored as one index block + bitmaps +
//!   an overflow btree.
//! - [`DataSpaceMap`]: counts for data blocks, stored as an index btree + bitmaps + an
//!   overflow btree, all in metadata blocks.
//!
//! Layout of a root as stored in the superblock (32 bytes, spec §7.2):
//!
//! ```text
//!   0  nr_blocks        u64
//!   8  nr_allocated     u64
//!  16  bitmap_root      u64  (metadata: the index block; data: the index btree root)
//!  24  ref_count_root   u64  (the overflow btree root)
//! ```

pub mod core;
pub mod disk;

pub use disk::DataSpaceMap;

use crate::btree::Value;

/// The most bitmaps one metadata index block can list.
pub const MAX_METADATA_BITMAPS: usize = 255;
/// The most blocks a metadata space map manages: 255 × 16 320.
pub const METADATA_BLOCKS_MAX: u64 = MAX_METADATA_BITMAPS as u64 * core::ENTRIES_PER_BITMAP;

/// A space map's root, as stored in the superblock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SpaceMapRoot {
    /// Blocks managed.
    pub block_count: u64,
    /// Blocks with a count above zero.
    pub allocated_count: u64,
    /// Metadata map: the index block; data map: the index btree's root.
    pub bitmap_root: u64,
    /// Root of the overflow (ref-count) btree.
    pub ref_count_root: u64,
}

/// Size of an encoded root.
pub const SPACE_MAP_ROOT_SIZE: usize = 32;

impl SpaceMapRoot {
    /// Decode from the first 32 bytes of a superblock slot.
    pub fn decode(bytes: &[u8]) -> SpaceMapRoot {
        let word =
            |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        SpaceMapRoot {
            block_count: word(0),
            allocated_count: word(1),
            bitmap_root: word(2),
            ref_count_root: word(3),
        }
    }

    /// Encode into the first 32 bytes of `out`.
    pub fn encode(&self, out: &mut [u8]) {
        out[0..8].copy_from_slice(&self.block_count.to_le_bytes());
        out[8..16].copy_from_slice(&self.allocated_count.to_le_bytes());
        out[16..24].copy_from_slice(&self.bitmap_root.to_le_bytes());
        out[24..32].copy_from_slice(&self.ref_count_root.to_le_bytes());
    }

    /// Whether the slot is all zero (a metadata-snapshot superblock has no space maps).
    pub fn is_empty(&self) -> bool {
        *self == SpaceMapRoot::default()
    }
}

/// One index entry: where a bitmap lives and a summary of it (spec §7.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct IndexEntry {
    /// Location of the bitmap block.
    pub blocknr: u64,
    /// Free entries (kernel convention: 16 320 − used).
    pub free_count: u32,
    /// Every entry below this index is in use.
    pub none_free_before: u32,
}

impl Value for IndexEntry {
    const SIZE: usize = 16;
    fn unpack(bytes: &[u8]) -> IndexEntry {
        IndexEntry {
            blocknr: u64::from_le_bytes(bytes[0..8].try_into().expect("8 bytes")),
            free_count: u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes")),
            none_free_before: u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes")),
        }
    }
    fn pack(&self, out: &mut [u8]) {
        out[0..8].copy_from_slice(&self.blocknr.to_le_bytes());
        out[8..12].copy_from_slice(&self.free_count.to_le_bytes());
        out[12..16].copy_from_slice(&self.none_free_before.to_le_bytes());
    }
}
