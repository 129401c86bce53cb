//! The unit of metadata I/O: a 4 KiB block, addressed by [`MetadataBlock`].

use std::fmt;

/// Size of one metadata block in bytes (dm-thin fixes it at 8 sectors).
pub const BLOCK_SIZE: usize = 4096;

/// Contents of one metadata block.
pub type Block = [u8; BLOCK_SIZE];

/// Index of a 4 KiB block on the metadata device (byte offset = index × 4096).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct MetadataBlock(u64);

impl MetadataBlock {
    /// The superblock always lives at block 0.
    pub const SUPERBLOCK: MetadataBlock = MetadataBlock(0);

    /// Metadata block `index`.
    pub const fn new(index: u64) -> MetadataBlock {
        MetadataBlock(index)
    }

    /// The raw block index, for encoding.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// Byte offset of this block on the metadata device.
    pub fn byte_offset(self) -> u64 {
        self.0 * BLOCK_SIZE as u64
    }
}

impl fmt::Display for MetadataBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A zeroed block on the heap (4 KiB is too large to pass around on the stack freely).
pub fn zeroed_block() -> Box<Block> {
    Box::new([0u8; BLOCK_SIZE])
}
