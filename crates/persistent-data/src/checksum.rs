//! Block checksums: CRC-32C over bytes 4..4096 of a block, seeded with `0xFFFFFFFF`, no final
//! inversion, XORed with a salt that names the block's type (spec §2). The checksum is stored
//! little-endian at offset 0.
//!
//! Readers identify a block's type by which salt makes the checksum match.

use crate::block::{Block, BLOCK_SIZE};
use std::fmt;

/// The kinds of metadata block, each with its own checksum salt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockKind {
    /// The thin superblock (also a metadata-snapshot superblock).
    Superblock,
    /// A btree node of any tree.
    Node,
    /// A space-map bitmap.
    Bitmap,
    /// The metadata space map's index block.
    Index,
}

impl BlockKind {
    /// Every kind, for identifying an unknown block.
    pub const ALL: [BlockKind; 4] = [
        BlockKind::Superblock,
        BlockKind::Node,
        BlockKind::Bitmap,
        BlockKind::Index,
    ];

    /// The salt XORed into this kind's checksum.
    pub const fn salt(self) -> u32 {
        match self {
            BlockKind::Superblock => 160_774,
            BlockKind::Node => 121_107,
            BlockKind::Bitmap => 240_779,
            BlockKind::Index => 160_478,
        }
    }
}

impl fmt::Display for BlockKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BlockKind::Superblock => "superblock",
            BlockKind::Node => "btree node",
            BlockKind::Bitmap => "space-map bitmap",
            BlockKind::Index => "space-map index block",
        })
    }
}

/// The raw CRC-32C register after feeding `bytes` with initial value `0xFFFFFFFF` and no final
/// inversion.
pub fn crc32c_register(bytes: &[u8]) -> u32 {
    // The crc32c crate implements the standard variant (init !0, final xor !0); undo the final
    // inversion to get the register dm-thin stores.
    crc32c::crc32c(bytes) ^ 0xFFFF_FFFF
}

/// The checksum a block of `kind` must carry.
pub fn compute(block: &Block, kind: BlockKind) -> u32 {
    crc32c_register(&block[4..BLOCK_SIZE]) ^ kind.salt()
}

/// The checksum stored in a block.
pub fn stored(block: &Block) -> u32 {
    u32::from_le_bytes([block[0], block[1], block[2], block[3]])
}

/// Compute and store the checksum of a block of `kind`.
pub fn stamp(block: &mut Block, kind: BlockKind) {
    let sum = compute(block, kind);
    block[0..4].copy_from_slice(&sum.to_le_bytes());
}

/// Whether the stored checksum matches `kind`.
pub fn matches(block: &Block, kind: BlockKind) -> bool {
    stored(block) == compute(block, kind)
}

/// The kind whose salt makes the block's checksum match, if any.
pub fn identify(block: &Block) -> Option<BlockKind> {
    let register = crc32c_register(&block[4..BLOCK_SIZE]);
    let sum = stored(block);
    BlockKind::ALL
        .into_iter()
        .find(|kind| register ^ kind.salt() == sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_matches_spec_test_vectors() {
        assert_eq!(crc32c_register(b"123456789"), 0x1CF9_6D7C);
        assert_eq!(crc32c_register(&[0u8; 4092]), 0x58CD_A791);
    }

    #[test]
    fn salted_checksums_of_zero_block_match_spec() {
        let block = [0u8; BLOCK_SIZE];
        assert_eq!(compute(&block, BlockKind::Superblock), 0x58CF_D397);
        assert_eq!(compute(&block, BlockKind::Node), 0x58CC_7E82);
        assert_eq!(compute(&block, BlockKind::Bitmap), 0x58CE_0B1A);
        assert_eq!(compute(&block, BlockKind::Index), 0x58CF_D54F);
    }

    #[test]
    fn stamp_then_identify() {
        for kind in BlockKind::ALL {
            let mut block = [7u8; BLOCK_SIZE];
            stamp(&mut block, kind);
            assert!(matches(&block, kind));
            assert_eq!(identify(&block), Some(kind));
            block[100] ^= 1;
            assert_eq!(identify(&block), None);
        }
    }
}
