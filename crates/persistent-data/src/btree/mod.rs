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

/// Shadow a node and decode it; if it was shared, take references to what it points at.
fn shadow_node<V: Value, C: RefCounter<V>>(
    tm: &mut dyn CopyOnWrite,
    counter: &mut C,
    block: MetadataBlock,
) -> Result<(MetadataBlock, NodeBuf)> {
    let (copy, data, shared) = tm.shadow(block, BlockKind::Node)?;
    let node = Node::parse(block, &data, V::SIZE)?;
    let buf = NodeBuf::from_node(&node);
    check_key_order(block, &buf.keys)?;
    if shared {
        for i in 0..buf.len() {
            if buf.leaf {
                counter.inc(tm, &V::unpack(buf.value(i)))?;
            } else {
                tm.inc(buf.child(i))?;
            }
        }
    }
    Ok((copy, buf))
}

/// Keys read from disk must strictly increase; corrupt ones are an error, not a panic in
/// the code that rearranges them.
fn check_key_order(block: MetadataBlock, keys: &[u64]) -> Result<()> {
    match keys.windows(2).position(|w| w[0] >= w[1]) {
        None => Ok(()),
        Some(i) => Err(Error::corrupt(
            block,
            format!(
                "btree keys not strictly increasing: {} at entry {} after {}",
                keys[i + 1],
                i + 1,
                keys[i]
            ),
        )),
    }
}

/// Store a changed node. A node whose keys are out of order here can only come from corrupt
/// neighbours (a child whose keys lie outside its parent's range): report it.
fn put(tm: &mut dyn CopyOnWrite, block: MetadataBlock, node: &NodeBuf) -> Result<()> {
    check_key_order(block, &node.keys)?;
    tm.write(block, Arc::from(node.encode(block)), BlockKind::Node);
    Ok(())
}

/// Insert or overwrite `key`. Returns the new root and the value replaced, if any (a
/// replaced value that differs from the new one is released through `counter`).
pub fn insert<V: Value + PartialEq, C: RefCounter<V>>(
    tm: &mut dyn CopyOnWrite,
    counter: &mut C,
    root: MetadataBlock,
    key: u64,
    value: &V,
) -> Result<(MetadataBlock, Option<V>)> {
    let value_bytes = encode_value(value);
    let (root_block, mut node) = shadow_node(tm, counter, root)?;
    if node.len() == node.max_entries() {
        // Split the root: its entries move into two new children and the root becomes an
        // internal node with two entries, keeping its location.
        let mut left = node;
        let right = left.split_off(left.len() / 2);
        let left_block = tm.new_block()?;
        let right_block = tm.new_block()?;
        let mut new_root = NodeBuf::new(false, 8);
        new_root.insert(0, left.keys[0], &left_block.get().to_le_bytes());
        new_root.insert(1, right.keys[0], &right_block.get().to_le_bytes());
        put(tm, left_block, &left)?;
        put(tm, right_block, &right)?;
        node = new_root;
    }
    let mut block = root_block;
    for _ in 0..MAX_DEPTH {
        if node.leaf {
            match node.keys.binary_search(&key) {
                Ok(i) => {
                    let old = V::unpack(node.value(i));
                    node.set_value(i, &value_bytes);
                    put(tm, block, &node)?;
                    if old != *value {
                        counter.dec(tm, &old)?;
                    }
                    return Ok((root_block, Some(old)));
                }
                Err(i) => {
                    node.insert(i, key, &value_bytes);
                    put(tm, block, &node)?;
                    return Ok((root_block, None));
                }
            }
        }
        if node.is_empty() {
            return Err(Error::corrupt(block, "internal btree node with no entries"));
        }
        let i = match node.keys.partition_point(|&k| k <= key) {
            0 => {
                // The new key is below every key: lower this node's first key.
                node.keys[0] = key;
                0
            }
            p => p - 1,
        };
        let (child_block, mut child) = shadow_node(tm, counter, node.child(i))?;
        node.set_child(i, child_block);
        let (next_block, next) = if child.len() == child.max_entries() {
            let right = child.split_off(child.len() / 2);
            let right_block = tm.new_block()?;
            node.insert(i + 1, right.keys[0], &right_block.get().to_le_bytes());
            if key >= right.keys[0] {
                put(tm, child_block, &child)?;
                (right_block, right)
            } else {
                put(tm, right_block, &right)?;
                (child_block, child)
            }
        } else {
            (child_block, child)
        };
        put(tm, block, &node)?;
        block = next_block;
        node = next;
    }
    Err(too_deep(root))
}

/// Remove `key`. Returns the new root and the removed value (released through `counter`).
pub fn remove<V: Value, C: RefCounter<V>>(
    tm: &mut dyn CopyOnWrite,
    counter: &mut C,
    root: MetadataBlock,
    key: u64,
) -> Result<(MetadataBlock, Option<V>)> {
    let (mut root_block, mut node) = shadow_node(tm, counter, root)?;
    let mut block = root_block;
    for _ in 0..MAX_DEPTH {
        if node.leaf {
            return match node.keys.binary_search(&key) {
                Ok(i) => {
                    let old = V::unpack(node.value(i));
                    node.remove(i);
                    put(tm, block, &node)?;
                    counter.dec(tm, &old)?;
                    Ok((root_block, Some(old)))
                }
                Err(_) => {
                    put(tm, block, &node)?;
                    Ok((root_block, None))
                }
            };
        }
        let p = node.keys.partition_point(|&k| k <= key);
        if p == 0 {
            put(tm, block, &node)?;
            return Ok((root_block, None));
        }
        let i = p - 1;
        let (child_block, child) = shadow_node(tm, counter, node.child(i))?;
        node.set_child(i, child_block);
        let (next_block, next) = if child.len() <= child.max_entries() / 3 && node.len() > 1 {
            rebalance(tm, counter, &mut node, i, child_block, child, key)?
        } else {
            (child_block, child)
        };
        if block == root_block && node.len() == 1 {
            // A root with one child: the child becomes the root. The root copy is ours
            // (count 1); its reference to the child passes to the caller.
            tm.dec(block)?;
            root_block = next_block;
        } else {
            put(tm, block, &node)?;
        }
        block = next_block;
        node = next;
    }
    Err(too_deep(root))
}

/// Make sure the child at `i` (already shadowed, at the minimum fill) can lose an entry:
/// merge it with a sibling when both fit in one node, else even out the two. Returns the
/// node (and its block) that now covers `key`.
fn rebalance<V: Value, C: RefCounter<V>>(
    tm: &mut dyn CopyOnWrite,
    counter: &mut C,
    parent: &mut NodeBuf,
    i: usize,
    child_block: MetadataBlock,
    child: NodeBuf,
    key: u64,
) -> Result<(MetadataBlock, NodeBuf)> {
    let (right_index, left_block, mut left, right_block, mut right) = if i + 1 < parent.len() {
        let (sibling_block, sibling) = shadow_node(tm, counter, parent.child(i + 1))?;
        parent.set_child(i + 1, sibling_block);
        (i + 1, child_block, child, sibling_block, sibling)
    } else {
        let (sibling_block, sibling) = shadow_node(tm, counter, parent.child(i - 1))?;
        parent.set_child(i - 1, sibling_block);
        (i, sibling_block, sibling, child_block, child)
    };
    if left.leaf != right.leaf || left.value_size != right.value_size {
        return Err(Error::corrupt(
            right_block,
            "sibling btree nodes of different kinds",
        ));
    }
    if let (Some(&last), Some(&first)) = (left.keys.last(), right.keys.first()) {
        if last >= first {
            return Err(Error::corrupt(
                right_block,
                format!("sibling btree nodes overlap: key {first} follows {last}"),
            ));
        }
    }
    if left.len() + right.len() <= left.max_entries() {
        left.append(&mut right);
        parent.remove(right_index);
        // The emptied copy is ours (count 1); its references moved into `left`.
        tm.dec(right_block)?;
        return Ok((left_block, left));
    }
    let target_left = (left.len() + right.len()) / 2;
    if left.len() > target_left {
        let mut moved = left.split_off(target_left);
        moved.append(&mut right);
        right = moved;
    } else {
        let rest = right.split_off(target_left - left.len());
        let mut head = std::mem::replace(&mut right, rest);
        left.append(&mut head);
    }
    parent.keys[right_index] = right.keys[0];
    if key >= right.keys[0] {
        put(tm, left_block, &left)?;
        Ok((right_block, right))
    } else {
        put(tm, right_block, &right)?;
        Ok((left_block, left))
    }
}

/// Remove every key in `begin..end`. Returns the new root and how many keys were removed.
pub fn remove_range<V: Value, C: RefCounter<V>>(
    tm: &mut dyn CopyOnWrite,
    counter: &mut C,
    root: MetadataBlock,
    begin: u64,
    end: u64,
) -> Result<(MetadataBlock, u64)> {
    let mut root = root;
    let mut removed = 0;
    let mut next = begin;
    while next < end {
        match lookup_ge::<V, _>(tm, root, next)? {
            Some((key, _)) if key < end => {
                root = remove::<V, C>(tm, counter, root, key)?.0;
                removed += 1;
                match key.checked_add(1) {
                    Some(k) => next = k,
                    None => break,
                }
            }
            _ => break,
        }
    }
    Ok((root, removed))
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

/// Release a whole tree: drop one reference to its root; a node whose count falls to zero
/// releases its children (internal) or its values through `counter` (leaf). A node still
/// shared elsewhere just loses one reference.
pub fn delete_tree<V: Value, C: RefCounter<V>>(
    tm: &mut dyn CopyOnWrite,
    counter: &mut C,
    root: MetadataBlock,
) -> Result<()> {
    delete_below(tm, counter, root, 0)
}

fn delete_below<V: Value, C: RefCounter<V>>(
    tm: &mut dyn CopyOnWrite,
    counter: &mut C,
    block: MetadataBlock,
    depth: usize,
) -> Result<()> {
    if depth >= MAX_DEPTH {
        return Err(too_deep(block));
    }
    // A pointer read from disk may be corrupt: check it before asking its count.
    let block_count = tm.block_count();
    if block.get() >= block_count {
        return Err(Error::corrupt(
            block,
            format!("reference beyond the metadata space map ({block_count} blocks)"),
        ));
    }
    if tm.count(block) > 1 {
        tm.dec(block)?;
        return Ok(());
    }
    let data = tm.read_block(block, BlockKind::Node)?;
    let node = NodeBuf::from_node(&Node::parse(block, &data, V::SIZE)?);
    drop(data);
    for i in 0..node.len() {
        if node.leaf {
            counter.dec(tm, &V::unpack(node.value(i)))?;
        } else {
            delete_below(tm, counter, node.child(i), depth + 1)?;
        }
    }
    tm.dec(block)?;
    Ok(())
}

/// What [`check`] reports about a valid tree.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct TreeStats {
    /// Entries in the leaves.
    pub entry_count: u64,
    /// Nodes, internal and leaf.
    pub node_count: u64,
    /// Levels (1 for a lone leaf).
    pub depth: usize,
}

/// Rules [`check`] applies beyond the always-checked ones.
#[derive(Debug, Clone, Copy)]
pub struct CheckOptions {
    /// Require non-root leaves to be at least a third full (thin_check 1.x skips this for
    /// the bottom level of the mapping tree; 0.9.0 and the kernel keep it everywhere).
    pub leaf_occupancy: bool,
}

impl Default for CheckOptions {
    fn default() -> CheckOptions {
        CheckOptions {
            leaf_occupancy: true,
        }
    }
}

/// Check a whole tree (spec §11 rules 3-9): every node's checksum, location and layout; key
/// order within nodes, against parent keys and across leaves; uniform leaf depth; minimum
/// occupancy of non-root nodes. `visit_node` sees every node, `visit_value` every entry, in
/// order (for reference counting by the caller).
pub fn check<V: Value, S: BlockSource + ?Sized>(
    source: &S,
    root: MetadataBlock,
    options: CheckOptions,
    visit_node: &mut dyn FnMut(MetadataBlock),
    visit_value: &mut dyn FnMut(u64, V) -> Result<()>,
) -> Result<TreeStats> {
    let mut stats = TreeStats::default();
    let mut state = CheckState {
        options,
        leaf_depth: None,
        last_key: None,
    };
    check_below(
        source,
        root,
        None,
        None,
        0,
        &mut state,
        &mut stats,
        visit_node,
        visit_value,
    )?;
    stats.depth = state.leaf_depth.map_or(0, |d| d + 1);
    Ok(stats)
}

struct CheckState {
    options: CheckOptions,
    leaf_depth: Option<usize>,
    last_key: Option<u64>,
}

#[allow(clippy::too_many_arguments)]
fn check_below<V: Value, S: BlockSource + ?Sized>(
    source: &S,
    block: MetadataBlock,
    lower_bound: Option<u64>,
    upper_bound: Option<u64>,
    depth: usize,
    state: &mut CheckState,
    stats: &mut TreeStats,
    visit_node: &mut dyn FnMut(MetadataBlock),
    visit_value: &mut dyn FnMut(u64, V) -> Result<()>,
) -> Result<()> {
    if depth >= MAX_DEPTH {
        return Err(too_deep(block));
    }
    let data = source.read_block(block, BlockKind::Node)?;
    let node = Node::parse(block, &data, V::SIZE)?;
    visit_node(block);
    stats.node_count += 1;
    let is_root = depth == 0;
    let n = node.len();
    if !is_root && (!node.is_leaf() || state.options.leaf_occupancy) && n < node.max_entries() / 3 {
        return Err(Error::corrupt(
            block,
            format!(
                "non-root btree node has {n} entries, fewer than a third of {}",
                node.max_entries()
            ),
        ));
    }
    if !node.is_leaf() && n == 0 {
        return Err(Error::corrupt(block, "internal btree node with no entries"));
    }
    for i in 0..n {
        let key = node.key(i);
        if i > 0 && key <= node.key(i - 1) {
            return Err(Error::corrupt(
                block,
                format!(
                    "btree keys not strictly increasing: {key} at entry {i} after {}",
                    node.key(i - 1)
                ),
            ));
        }
        if lower_bound.is_some_and(|lo| key < lo) {
            return Err(Error::corrupt(
                block,
                format!(
                    "key {key} is below its parent's key {}",
                    lower_bound.unwrap_or(0)
                ),
            ));
        }
        if upper_bound.is_some_and(|hi| key >= hi) {
            return Err(Error::corrupt(
                block,
                format!(
                    "key {key} is not below the next parent key {}",
                    upper_bound.unwrap_or(0)
                ),
            ));
        }
    }
    if node.is_leaf() {
        match state.leaf_depth {
            None => state.leaf_depth = Some(depth),
            Some(d) if d != depth => {
                return Err(Error::corrupt(
                    block,
                    format!("leaf at depth {depth}, other leaves at depth {d}"),
                ));
            }
            Some(_) => {}
        }
        for i in 0..n {
            let key = node.key(i);
            if state.last_key.is_some_and(|last| key <= last) {
                return Err(Error::corrupt(
                    block,
                    format!(
                        "btree keys out of order across leaves: {key} after {}",
                        state.last_key.unwrap_or(0)
                    ),
                ));
            }
            state.last_key = Some(key);
            stats.entry_count += 1;
            visit_value(key, V::unpack(node.value_bytes(i)))?;
        }
        return Ok(());
    }
    for i in 0..n {
        let hi = if i + 1 < n {
            Some(node.key(i + 1))
        } else {
            upper_bound
        };
        check_below(
            source,
            node.child(i),
            Some(node.key(i)),
            hi,
            depth + 1,
            state,
            stats,
            visit_node,
            visit_value,
        )?;
    }
    Ok(())
}
