//! Modifying a tree: insert, remove (with the rebalancing that keeps minimum occupancy),
//! remove a key range, and delete a whole tree. Every node on the path is shadowed first.

use super::node::{Node, NodeBuf};
use super::{encode_value, lookup_ge, too_deep, RefCounter, Value, MAX_DEPTH};
use crate::block::MetadataBlock;
use crate::checksum::BlockKind;
use crate::cow::CopyOnWrite;
use crate::error::{Error, Result};
use std::sync::Arc;

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
