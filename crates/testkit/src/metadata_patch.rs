//! Seeded damage for metadata files: read, patch and re-stamp single blocks, the fields of
//! btree nodes and space-map bitmaps, and the locations of the space maps' first bitmaps.
//! The checkers' and the repair's tests break metadata with these, one rule at a time.
//!
//! Offsets are dm-thin's (docs/dm-thin-format.md): a superblock keeps the data space map's
//! root at byte 64 and the metadata space map's at 192 (each `nr_blocks`, `nr_allocated`,
//! `bitmap_root`, `ref_count_root`); a bitmap holds 2-bit counts after a 16-byte header.

use persistent_data::btree::node::{Node, HEADER_SIZE};
use persistent_data::btree::Value;
use persistent_data::checksum::{self, BlockKind};
use persistent_data::space_map::core::encode_field;
use persistent_data::space_map::disk::decode_index_block;
use persistent_data::space_map::IndexEntry;
use persistent_data::{Block, BlockDevice, FileDevice, MetadataBlock, BLOCK_SIZE};
use std::path::Path;

/// Read block `block` of the metadata file at `path`.
pub fn read_block(path: &Path, block: u64) -> Box<Block> {
    let device = FileDevice::open(path, false).unwrap();
    let mut data = Box::new([0u8; BLOCK_SIZE]);
    device.read(MetadataBlock::new(block), &mut data).unwrap();
    data
}

/// Write block `block` of the metadata file at `path` (and flush).
pub fn write_block(path: &Path, block: u64, data: &Block) {
    let device = FileDevice::open(path, true).unwrap();
    device.write(MetadataBlock::new(block), data).unwrap();
    device.flush().unwrap();
}

/// Patch `block` with `edit`, then re-stamp it as `restamp` (None: leave the checksum, so
/// the block reads as corrupt).
pub fn patch(path: &Path, block: u64, restamp: Option<BlockKind>, edit: impl FnOnce(&mut Block)) {
    let mut data = read_block(path, block);
    edit(&mut data);
    if let Some(kind) = restamp {
        checksum::stamp(&mut data, kind);
    }
    write_block(path, block, &data);
}

/// Write a little-endian u32 at byte `at`.
pub fn put_u32(data: &mut Block, at: usize, value: u32) {
    data[at..at + 4].copy_from_slice(&value.to_le_bytes());
}

/// Write a little-endian u64 at byte `at`.
pub fn put_u64(data: &mut Block, at: usize, value: u64) {
    data[at..at + 8].copy_from_slice(&value.to_le_bytes());
}

/// The little-endian u64 at byte `at`.
pub fn u64_at(data: &Block, at: usize) -> u64 {
    u64::from_le_bytes(data[at..at + 8].try_into().unwrap())
}

/// The stored 2-bit field of `entry` in a bitmap block.
pub fn bitmap_field(data: &Block, entry: u64) -> u64 {
    (u64_at(data, 16 + (entry / 32) as usize * 8) >> ((entry % 32) * 2)) & 3
}

/// Set the count of `entry` in a bitmap block (0..=2; 3 means "see the overflow tree").
pub fn set_bitmap_count(data: &mut Block, entry: u64, count: u32) {
    let at = 16 + (entry / 32) as usize * 8;
    let shift = (entry % 32) * 2;
    let word = (u64_at(data, at) & !(3 << shift)) | (encode_field(count) << shift);
    put_u64(data, at, word);
}

/// Offset of value `i` in a node with `max` entries of `value_size` bytes.
pub fn value_at(max: usize, value_size: usize, i: usize) -> usize {
    HEADER_SIZE + 8 * max + value_size * i
}

/// The location of the metadata space map's first bitmap (from its index block).
pub fn metadata_bitmap(path: &Path) -> u64 {
    let index_block = u64_at(&read_block(path, 0), 192 + 16);
    decode_index_block(&read_block(path, index_block))[0].blocknr
}

/// The location of the data space map's first bitmap (from its index tree's root leaf).
pub fn data_bitmap(path: &Path) -> u64 {
    let root = u64_at(&read_block(path, 0), 64 + 16);
    let data = read_block(path, root);
    let node = Node::parse(MetadataBlock::new(root), &data, 16).unwrap();
    assert!(node.is_leaf(), "a data space map of one index leaf");
    IndexEntry::unpack(node.value_bytes(0)).blocknr
}

/// Give block `entry` of the first bitmap at `bitmap` a count of one (a leak when nothing
/// references it), re-stamped. Panics if the block was not free.
pub fn leak(path: &Path, bitmap: u64, entry: u64) {
    patch(path, bitmap, Some(BlockKind::Bitmap), |d| {
        assert_eq!(bitmap_field(d, entry), 0, "block {entry} is in use");
        set_bitmap_count(d, entry, 1);
    });
}
