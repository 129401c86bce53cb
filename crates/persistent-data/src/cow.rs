//! What btrees and the data space map need from the layer that owns the metadata blocks:
//! reading blocks ([`BlockSource`]) and changing them copy-on-write ([`CopyOnWrite`]).
//!
//! The traits sit below both their users and their implementor, so that `btree` and
//! `space_map` never name the transaction manager, and the transaction manager (which keeps
//! the metadata space map's overflow counts in a btree whose nodes it counts itself) calls
//! the btree with itself as the `CopyOnWrite`. That is the one knot of the crate, and it
//! runs through these traits only.

use crate::block::{Block, MetadataBlock};
use crate::block_manager::BlockManager;
use crate::checksum::BlockKind;
use crate::error::Result;
use std::sync::Arc;

/// Something btree code can read nodes from: the committed state (a `BlockManager`) or the
/// state of the current transaction (a `TransactionManager`).
pub trait BlockSource {
    /// Read and validate a block of `kind`.
    fn read_block(&self, block: MetadataBlock, kind: BlockKind) -> Result<Arc<Block>>;
    /// Number of blocks on the metadata device.
    fn block_count(&self) -> u64;
}

impl BlockSource for BlockManager {
    fn read_block(&self, block: MetadataBlock, kind: BlockKind) -> Result<Arc<Block>> {
        self.read(block, kind)
    }
    fn block_count(&self) -> u64 {
        BlockManager::block_count(self)
    }
}

/// The copy-on-write discipline of a transaction (spec §8.1), as btree code uses it: blocks
/// reachable from the last commit are never changed in place; a block is shadowed (copied
/// to a block of this transaction) before it changes, and every block carries a reference
/// count. `read_block` sees the blocks as they are in the transaction.
///
/// Implemented by `TransactionManager`.
pub trait CopyOnWrite: BlockSource {
    /// Allocate a new metadata block (count 1), zero-filled, owned by this transaction.
    fn new_block(&mut self) -> Result<MetadataBlock>;

    /// Prepare `block` for change. Returns the block to write the change to, its contents
    /// (taken out of the transaction: hand them back with `write`), and whether the original
    /// was shared (count > 1), in which case the caller must take a reference to everything
    /// it points to.
    fn shadow(
        &mut self,
        block: MetadataBlock,
        kind: BlockKind,
    ) -> Result<(MetadataBlock, Arc<Block>, bool)>;

    /// Store the new contents of a block owned by this transaction (one returned by
    /// `new_block` or `shadow`).
    fn write(&mut self, block: MetadataBlock, data: Arc<Block>, kind: BlockKind);

    /// Whether `block` was allocated in this transaction (and so may be changed in place).
    fn is_shadowed(&self, block: MetadataBlock) -> bool;

    /// Reference count of a metadata block.
    fn count(&self, block: MetadataBlock) -> u32;

    /// Take one more reference to a metadata block.
    fn inc(&mut self, block: MetadataBlock) -> Result<()>;

    /// Drop a reference to a metadata block; returns the references left (at zero the block
    /// is free after this transaction).
    fn dec(&mut self, block: MetadataBlock) -> Result<u32>;
}
