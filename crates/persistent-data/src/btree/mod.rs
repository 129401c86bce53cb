//! dm-thin's btree (spec §5): u64 keys, fixed-size values, copy-on-write through a
//! [`CopyOnWrite`] (the transaction manager implements it; this module never names it).
//!
//! Every modifying operation takes the root and returns the new root: nodes on the path are
//! shadowed, so the committed tree is never touched. Trees may share nodes (snapshots);
//! shadowing a shared node takes a reference to everything the copy points to, through the
//! node's children (internal nodes) or through a [`RefCounter`] for leaf values (a mapping
//! leaf's data blocks, a top-level leaf's subtrees). That rule is what makes snapshots O(1).
//!
//! Shape invariants kept by insert and remove (and checked by [`check`]):
//! - keys strictly increase within a node and across the leaves of a tree;
//! - an internal key is a lower bound of its child's keys (equal at split time);
//! - all leaves are at the same depth;
//! - every non-root node holds at least `max_entries / 3` entries (full nodes split in two
//!   halves on the way down an insert; on the way down a remove, a child at the minimum is
//!   merged with or refilled from a sibling first).
//!
//! Depth is bounded by [`MAX_DEPTH`]: a corrupt child pointer gives an error, never endless
//! recursion.

pub mod builder;
pub mod node;

#[cfg(test)]
mod tests;

mod check;
mod modify;

pub use check::{check, CheckOptions, TreeStats};
pub use modify::{delete_tree, insert, remove, remove_range};

use crate::block::MetadataBlock;
use crate::checksum::BlockKind;
use crate::cow::{BlockSource, CopyOnWrite};
use crate::error::{Error, Result};
use node::{Node, NodeBuf};
use std::fmt::Debug;
use std::sync::Arc;

/// Deepest tree accepted. A tree of 2^64 keys at minimum occupancy is 11 levels deep.
pub const MAX_DEPTH: usize = 16;

/// A fixed-size value stored in btree leaves.
pub trait Value: Copy + Debug {
    /// Encoded size in bytes.
    const SIZE: usize;
    /// Decode from exactly `SIZE` bytes.
    fn unpack(bytes: &[u8]) -> Self;
    /// Encode into exactly `SIZE` bytes.
    fn pack(&self, out: &mut [u8]);
}

impl Value for u64 {
    const SIZE: usize = 8;
    #[inline]
    fn unpack(bytes: &[u8]) -> u64 {
        u64::from_le_bytes(bytes.try_into().expect("8 bytes"))
    }
    fn pack(&self, out: &mut [u8]) {
        out.copy_from_slice(&self.to_le_bytes());
    }
}

impl Value for u32 {
    const SIZE: usize = 4;
    fn unpack(bytes: &[u8]) -> u32 {
        u32::from_le_bytes(bytes.try_into().expect("4 bytes"))
    }
    fn pack(&self, out: &mut [u8]) {
        out.copy_from_slice(&self.to_le_bytes());
    }
}

/// What leaf values reference, and how to count those references.
///
/// `inc` is called for each value of a shared leaf when it is copied (the copy is a new
/// owner). `dec` is called for a value removed, overwritten by a different value, or in a
/// leaf being deleted.
pub trait RefCounter<V> {
    /// Take a reference to what `value` points at.
    fn inc(&mut self, tm: &mut dyn CopyOnWrite, value: &V) -> Result<()>;
    /// Drop a reference to what `value` points at.
    fn dec(&mut self, tm: &mut dyn CopyOnWrite, value: &V) -> Result<()>;
}

/// For plain values that reference nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoRefs;

impl<V> RefCounter<V> for NoRefs {
    fn inc(&mut self, _: &mut dyn CopyOnWrite, _: &V) -> Result<()> {
        Ok(())
    }
    fn dec(&mut self, _: &mut dyn CopyOnWrite, _: &V) -> Result<()> {
        Ok(())
    }
}

fn too_deep(block: MetadataBlock) -> Error {
    Error::corrupt(
        block,
        format!("btree deeper than {MAX_DEPTH} levels (a cycle?)"),
    )
}

fn encode_value<V: Value>(value: &V) -> Vec<u8> {
    let mut bytes = vec![0u8; V::SIZE];
    value.pack(&mut bytes);
    bytes
}

/// Create an empty tree (one empty leaf) for values of type `V`.
pub fn create_empty<V: Value>(tm: &mut dyn CopyOnWrite) -> Result<MetadataBlock> {
    let block = tm.new_block()?;
    let node = NodeBuf::new(true, V::SIZE);
    tm.write(block, Arc::from(node.encode(block)), BlockKind::Node);
    Ok(block)
}

/// Look `key` up.
pub fn lookup<V: Value, S: BlockSource + ?Sized>(
    source: &S,
    root: MetadataBlock,
    key: u64,
) -> Result<Option<V>> {
    let mut block = root;
    for _ in 0..MAX_DEPTH {
        let data = source.read_block(block, BlockKind::Node)?;
        let node = Node::parse(block, &data, V::SIZE)?;
        if node.is_leaf() {
            let i = node.lower_bound(key);
            return Ok(
                (i < node.len() && node.key(i) == key).then(|| V::unpack(node.value_bytes(i)))
            );
        }
        match node.last_at_or_below(key) {
            None => return Ok(None),
            Some(i) => block = node.child(i),
        }
    }
    Err(too_deep(root))
}

/// The first entry whose key is `key` or greater.
pub fn lookup_ge<V: Value, S: BlockSource + ?Sized>(
    source: &S,
    root: MetadataBlock,
    key: u64,
) -> Result<Option<(u64, V)>> {
    lookup_ge_below(source, root, key, 0)
}

fn lookup_ge_below<V: Value, S: BlockSource + ?Sized>(
    source: &S,
    block: MetadataBlock,
    key: u64,
    depth: usize,
) -> Result<Option<(u64, V)>> {
    if depth >= MAX_DEPTH {
        return Err(too_deep(block));
    }
    let data = source.read_block(block, BlockKind::Node)?;
    let node = Node::parse(block, &data, V::SIZE)?;
    if node.is_leaf() {
        let i = node.lower_bound(key);
        return Ok((i < node.len()).then(|| (node.key(i), V::unpack(node.value_bytes(i)))));
    }
    let start = node.last_at_or_below(key).unwrap_or(0);
    for i in start..node.len() {
        if let Some(found) = lookup_ge_below(source, node.child(i), key, depth + 1)? {
            return Ok(Some(found));
        }
    }
    Ok(None)
}

/// The entry with the greatest key.
pub fn last<V: Value, S: BlockSource + ?Sized>(
    source: &S,
    root: MetadataBlock,
) -> Result<Option<(u64, V)>> {
    let mut block = root;
    for _ in 0..MAX_DEPTH {
        let data = source.read_block(block, BlockKind::Node)?;
        let node = Node::parse(block, &data, V::SIZE)?;
        if node.is_empty() {
            return Ok(None);
        }
        let i = node.len() - 1;
        if node.is_leaf() {
            return Ok(Some((node.key(i), V::unpack(node.value_bytes(i)))));
        }
        block = node.child(i);
    }
    Err(too_deep(root))
}

/// Visit every entry in ascending key order. Keys must strictly increase across the whole
/// tree (a corrupt tree that repeats a subtree fails here instead of looping).
pub fn walk<V: Value, S: BlockSource + ?Sized>(
    source: &S,
    root: MetadataBlock,
    visit: &mut dyn FnMut(u64, V) -> Result<()>,
) -> Result<()> {
    let mut last_key = None;
    walk_below(source, root, 0, &mut last_key, visit)
}

fn walk_below<V: Value, S: BlockSource + ?Sized>(
    source: &S,
    block: MetadataBlock,
    depth: usize,
    last_key: &mut Option<u64>,
    visit: &mut dyn FnMut(u64, V) -> Result<()>,
) -> Result<()> {
    if depth >= MAX_DEPTH {
        return Err(too_deep(block));
    }
    let data = source.read_block(block, BlockKind::Node)?;
    let node = Node::parse(block, &data, V::SIZE)?;
    for i in 0..node.len() {
        if node.is_leaf() {
            let key = node.key(i);
            if last_key.is_some_and(|last| key <= last) {
                return Err(Error::corrupt(
                    block,
                    format!(
                        "btree keys out of order: {key} after {}",
                        last_key.unwrap_or(0)
                    ),
                ));
            }
            *last_key = Some(key);
            visit(key, V::unpack(node.value_bytes(i)))?;
        } else {
            walk_below(source, node.child(i), depth + 1, last_key, visit)?;
        }
    }
    Ok(())
}
