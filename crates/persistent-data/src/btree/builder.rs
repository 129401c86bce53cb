//! Bottom-up btree building, for restoring metadata from a dump.
//!
//! A tree is built in two stages, as `thin_restore` 1.x does:
//!
//! 1. a [`NodeBuilder`] turns a stream of sorted values, and of *pre-built* nodes adopted by
//!    reference (shared leaves, from a dump's `<def>`), into a list of leaves;
//! 2. [`build_tree`] stacks internal levels on the leaves until one root is left.
//!
//! Internal nodes are never shared; only adopted leaves are. The packing follows
//! thin-provisioning-tools 1.x exactly (observed with 1.1.0), because which leaves end up
//! shared decides what `thin_dump` 1.x prints as `<def>`s:
//!
//! - values are buffered; when `2 × max_entries` are pending a full node is written;
//! - at the end, or before adopted nodes, pending values are written as one node, or as two
//!   halves when more than `max_entries` are pending;
//! - a node must hold at least `max_entries / 2` entries unless it is the only one: when fewer
//!   values are pending, the previous node is taken back ("unshifted") and its entries
//!   re-packed with them, or the first adopted node is copied in instead of being adopted;
//! - an adopted node that is under half full is copied, unless it would be the tree's root.
//!
//! Reference counting (spec §7.8): every pending value holds one reference (taken through the
//! [`RefCounter`] when pushed); a written node takes over the references of its values and
//! starts with metadata count 1 (the reference its future parent holds). Adopting a node
//! takes one more metadata reference to it. Taking a node back drops the builder's reference;
//! if the node survives (it is shared) its values get fresh references. A builder of shared
//! leaves (a `<def>`) keeps its own reference to them until [`release_nodes`].

use super::node::{Node, NodeBuf};
use super::{NoRefs, RefCounter, Value};
use crate::block::MetadataBlock;
use crate::checksum::BlockKind;
use crate::cow::CopyOnWrite;
use crate::error::{Error, Result};
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::sync::Arc;

/// What a builder knows about a node it wrote or adopted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeSummary {
    /// Where the node lives.
    pub block: MetadataBlock,
    /// Its first key (0 for an empty leaf).
    pub key: u64,
    /// Its number of entries.
    pub entry_count: usize,
}

/// Packs values and adopted nodes into a list of nodes of one level (see the module docs).
///
/// `V` is the value type of the level: the tree's value for leaves, `u64` child locations for
/// internal nodes.
#[derive(Debug)]
pub struct NodeBuilder<V: Value> {
    leaf: bool,
    max_entries: usize,
    values: VecDeque<(u64, V)>,
    nodes: Vec<NodeSummary>,
    last_key: Option<u64>,
}

impl<V: Value> NodeBuilder<V> {
    /// A builder of leaves.
    pub fn leaves() -> NodeBuilder<V> {
        NodeBuilder::new(true)
    }

    fn new(leaf: bool) -> NodeBuilder<V> {
        let value_size = if leaf { V::SIZE } else { 8 };
        NodeBuilder {
            leaf,
            max_entries: super::node::max_entries(value_size),
            values: VecDeque::new(),
            nodes: Vec::new(),
            last_key: None,
        }
    }

    fn half_full(&self) -> usize {
        self.max_entries / 2
    }

    /// Number of nodes written or adopted so far.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// Push one value; keys must strictly increase. Takes a reference for the value.
    pub fn push_value<C: RefCounter<V>>(
        &mut self,
        tm: &mut dyn CopyOnWrite,
        counter: &mut C,
        key: u64,
        value: V,
    ) -> Result<()> {
        if self.nodes.len() == 1 && self.nodes[0].entry_count < self.half_full() {
            // A lone small node cannot stay now that it will not be the root.
            self.unshift_node(tm, counter)?;
        } else if self.values.len() == 2 * self.max_entries {
            self.emit_values(tm, self.max_entries)?;
        }
        if let Some(last) = self.last_key {
            if key <= last {
                return Err(Error::Invalid(format!(
                    "btree builder: key {key} does not follow {last}"
                )));
            }
        }
        self.last_key = Some(key);
        counter.inc(tm, &value)?;
        self.values.push_back((key, value));
        Ok(())
    }

    /// Push pre-built nodes (shared leaves) that follow every key pushed so far. They are
    /// adopted by reference, or copied when packing rules require it (module docs).
    pub fn push_nodes<C: RefCounter<V>>(
        &mut self,
        tm: &mut dyn CopyOnWrite,
        counter: &mut C,
        nodes: &[NodeSummary],
    ) -> Result<()> {
        let Some(first) = nodes.first() else {
            return Ok(());
        };
        let last = nodes[nodes.len() - 1];
        if nodes.len() == 1 && self.nodes.is_empty() && self.values.is_empty() {
            // Possibly the whole tree: a root may hold any number of entries.
            tm.inc(first.block)?;
            self.nodes.push(*first);
            self.last_key = Some(last.key);
            return Ok(());
        }
        let half_full = self.half_full();
        if nodes.len() > 1 {
            if let Some(small) = nodes.iter().find(|n| n.entry_count < half_full) {
                return Err(Error::Invalid(format!(
                    "btree builder: shared node {} of {} entries is under half full",
                    small.block, small.entry_count
                )));
            }
        }
        if let Some(previous) = self.last_key {
            if first.key <= previous {
                return Err(Error::Invalid(format!(
                    "btree builder: shared node {} starts at key {} after key {previous}",
                    first.block, first.key
                )));
            }
        }
        if self.nodes.len() == 1 && self.nodes[0].entry_count < half_full {
            self.unshift_node(tm, counter)?;
        }
        if !self.values.is_empty() && self.values.len() < half_full {
            // Too few values for a node of their own: copy the first shared node in.
            self.append_values(tm, counter, first.block)?;
            if nodes.len() > 1 {
                self.emit_all(tm)?;
                for node in &nodes[1..] {
                    tm.inc(node.block)?;
                    self.nodes.push(*node);
                }
            }
        } else {
            self.emit_all(tm)?;
            if first.entry_count < half_full {
                // Only possible for a single node: merge it into its neighbours.
                self.append_values(tm, counter, first.block)?;
            } else {
                for node in nodes {
                    tm.inc(node.block)?;
                    self.nodes.push(*node);
                }
            }
        }
        self.last_key = Some(last.key);
        Ok(())
    }

    /// Write what is pending and return the level's nodes (one empty leaf if nothing was
    /// pushed).
    pub fn complete<C: RefCounter<V>>(
        mut self,
        tm: &mut dyn CopyOnWrite,
        counter: &mut C,
    ) -> Result<Vec<NodeSummary>> {
        if !self.values.is_empty() && self.values.len() < self.half_full() && !self.nodes.is_empty()
        {
            self.unshift_node(tm, counter)?;
        }
        self.emit_all(tm)?;
        if self.nodes.is_empty() {
            self.emit_values(tm, 0)?;
        }
        Ok(self.nodes)
    }

    fn read_entries(&self, tm: &dyn CopyOnWrite, block: MetadataBlock) -> Result<Vec<(u64, V)>> {
        let data = tm.read_block(block, BlockKind::Node)?;
        let node = Node::parse(block, &data, V::SIZE)?;
        if node.is_leaf() != self.leaf {
            return Err(Error::corrupt(
                block,
                "btree builder: node of the wrong level (leaf/internal)",
            ));
        }
        Ok((0..node.len())
            .map(|i| (node.key(i), V::unpack(node.value_bytes(i))))
            .collect())
    }

    /// Copy the entries of a shared node into the pending values (with fresh references).
    fn append_values<C: RefCounter<V>>(
        &mut self,
        tm: &mut dyn CopyOnWrite,
        counter: &mut C,
        block: MetadataBlock,
    ) -> Result<()> {
        for (key, value) in self.read_entries(tm, block)? {
            counter.inc(tm, &value)?;
            self.values.push_back((key, value));
        }
        Ok(())
    }

    /// Take the last node back into the pending values.
    fn unshift_node<C: RefCounter<V>>(
        &mut self,
        tm: &mut dyn CopyOnWrite,
        counter: &mut C,
    ) -> Result<()> {
        let node = self.nodes.pop().expect("a node to take back");
        let entries = self.read_entries(tm, node.block)?;
        let survives = tm.dec(node.block)? > 0;
        for (key, value) in entries.into_iter().rev() {
            if survives {
                // Shared elsewhere: the node keeps its references, the copies need theirs.
                counter.inc(tm, &value)?;
            }
            self.values.push_front((key, value));
        }
        Ok(())
    }

    fn emit_all(&mut self, tm: &mut dyn CopyOnWrite) -> Result<()> {
        let n = self.values.len();
        if n == 0 {
            Ok(())
        } else if n <= self.max_entries {
            self.emit_values(tm, n)
        } else {
            assert!(
                n <= 2 * self.max_entries,
                "btree builder holds {n} values, more than two nodes"
            );
            let first = n / 2;
            self.emit_values(tm, first)?;
            self.emit_values(tm, n - first)
        }
    }

    fn emit_values(&mut self, tm: &mut dyn CopyOnWrite, count: usize) -> Result<()> {
        assert!(count <= self.values.len());
        assert!(count <= self.max_entries);
        let mut node = NodeBuf::new(self.leaf, if self.leaf { V::SIZE } else { 8 });
        let mut bytes = vec![0u8; node.value_size];
        for _ in 0..count {
            let (key, value) = self.values.pop_front().expect("counted");
            value.pack(&mut bytes);
            node.keys.push(key);
            node.values.extend_from_slice(&bytes);
        }
        let block = tm.new_block()?;
        tm.write(block, Arc::from(node.encode(block)), BlockKind::Node);
        self.nodes.push(NodeSummary {
            block,
            key: node.keys.first().copied().unwrap_or(0),
            entry_count: count,
        });
        Ok(())
    }
}

/// Stack internal levels on `nodes` (the leaves of one tree, in key order) until a single
/// root is left, and return it. Each leaf's reference passes to its parent.
pub fn build_tree(tm: &mut dyn CopyOnWrite, nodes: Vec<NodeSummary>) -> Result<MetadataBlock> {
    assert!(!nodes.is_empty(), "a tree has at least one leaf");
    let mut level = nodes;
    for _ in 0..super::MAX_DEPTH {
        if level.len() == 1 {
            return Ok(level[0].block);
        }
        let mut builder = NodeBuilder::<u64>::new(false);
        for node in &level {
            builder.push_value(tm, &mut NoRefs, node.key, node.block.get())?;
        }
        level = builder.complete(tm, &mut NoRefs)?;
    }
    Err(Error::Invalid(format!(
        "btree builder: more than {} levels",
        super::MAX_DEPTH
    )))
}

/// Drop a builder's own reference to shared nodes it wrote (a `<def>` once every device is
/// built): a node nobody adopted is freed together with its values' references.
pub fn release_nodes<V: Value, C: RefCounter<V>>(
    tm: &mut dyn CopyOnWrite,
    counter: &mut C,
    nodes: &[NodeSummary],
) -> Result<()> {
    for node in nodes {
        let data = tm.read_block(node.block, BlockKind::Node)?;
        let parsed = Node::parse(node.block, &data, V::SIZE)?;
        let values: Vec<V> = (0..parsed.len())
            .map(|i| V::unpack(parsed.value_bytes(i)))
            .collect();
        drop(data);
        if tm.dec(node.block)? == 0 {
            for value in &values {
                counter.dec(tm, value)?;
            }
        }
    }
    Ok(())
}

/// Builds a whole tree from values in ascending key order (no shared nodes).
#[derive(Debug)]
pub struct TreeBuilder<V: Value> {
    leaves: NodeBuilder<V>,
    _values: PhantomData<V>,
}

impl<V: Value> Default for TreeBuilder<V> {
    fn default() -> Self {
        TreeBuilder::new()
    }
}

impl<V: Value> TreeBuilder<V> {
    /// An empty builder.
    pub fn new() -> TreeBuilder<V> {
        TreeBuilder {
            leaves: NodeBuilder::leaves(),
            _values: PhantomData,
        }
    }

    /// Push the next value (keys strictly increasing).
    pub fn push_value<C: RefCounter<V>>(
        &mut self,
        tm: &mut dyn CopyOnWrite,
        counter: &mut C,
        key: u64,
        value: V,
    ) -> Result<()> {
        self.leaves.push_value(tm, counter, key, value)
    }

    /// Finish the tree and return its root.
    pub fn complete<C: RefCounter<V>>(
        self,
        tm: &mut dyn CopyOnWrite,
        counter: &mut C,
    ) -> Result<MetadataBlock> {
        let leaves = self.leaves.complete(tm, counter)?;
        build_tree(tm, leaves)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_manager::BlockManager;
    use crate::btree::{self, CheckOptions};
    use crate::io::MemoryDevice;
    use crate::transaction::TransactionManager;

    fn tm() -> TransactionManager {
        let device = Arc::new(MemoryDevice::new(4096));
        let bm = Arc::new(BlockManager::new(device, 1024));
        TransactionManager::format(bm, 4096).unwrap()
    }

    fn entries(tm: &TransactionManager, root: MetadataBlock) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        btree::check::<u64, _>(
            tm,
            root,
            CheckOptions::default(),
            &mut |_| {},
            &mut |k, v| {
                out.push((k, v));
                Ok(())
            },
        )
        .unwrap();
        out
    }

    #[test]
    fn built_trees_hold_every_value_and_pass_the_checker() {
        for count in [0u64, 1, 125, 252, 253, 504, 505, 1000, 70_000] {
            let mut tm = tm();
            let mut builder = TreeBuilder::<u64>::new();
            for k in 0..count {
                builder.push_value(&mut tm, &mut NoRefs, k * 3, k).unwrap();
            }
            let root = builder.complete(&mut tm, &mut NoRefs).unwrap();
            let got = entries(&tm, root);
            assert_eq!(got.len() as u64, count);
            assert!(got
                .iter()
                .enumerate()
                .all(|(i, &(k, v))| k == 3 * i as u64 && v == i as u64));
        }
    }

    #[test]
    fn adopted_leaves_are_shared_with_the_right_counts() {
        let mut tm = tm();
        let mut def = NodeBuilder::<u64>::leaves();
        for k in 100..400 {
            def.push_value(&mut tm, &mut NoRefs, k, k).unwrap();
        }
        let shared = def.complete(&mut tm, &mut NoRefs).unwrap();
        assert_eq!(shared.len(), 2);
        let mut roots = Vec::new();
        for _ in 0..3 {
            let mut dev = NodeBuilder::<u64>::leaves();
            dev.push_nodes(&mut tm, &mut NoRefs, &shared).unwrap();
            for k in 1000..1300 {
                dev.push_value(&mut tm, &mut NoRefs, k, k).unwrap();
            }
            let leaves = dev.complete(&mut tm, &mut NoRefs).unwrap();
            roots.push(build_tree(&mut tm, leaves).unwrap());
        }
        release_nodes::<u64, _>(&mut tm, &mut NoRefs, &shared).unwrap();
        assert_eq!(tm.count(shared[0].block), 3);
        assert_eq!(tm.count(shared[1].block), 3);
        for root in roots {
            let got = entries(&tm, root);
            assert_eq!(got.len(), 600);
        }
    }

    #[test]
    fn small_pending_values_copy_the_first_shared_leaf() {
        let mut tm = tm();
        let mut def = NodeBuilder::<u64>::leaves();
        for k in 100..400 {
            def.push_value(&mut tm, &mut NoRefs, k, k).unwrap();
        }
        let shared = def.complete(&mut tm, &mut NoRefs).unwrap();
        let mut dev = NodeBuilder::<u64>::leaves();
        dev.push_value(&mut tm, &mut NoRefs, 1, 1).unwrap();
        dev.push_nodes(&mut tm, &mut NoRefs, &shared).unwrap();
        let leaves = dev.complete(&mut tm, &mut NoRefs).unwrap();
        assert_eq!(leaves.len(), 2);
        assert_ne!(leaves[0].block, shared[0].block);
        assert_eq!(leaves[1].block, shared[1].block);
        release_nodes::<u64, _>(&mut tm, &mut NoRefs, &shared).unwrap();
        assert_eq!(tm.count(shared[0].block), 0);
        assert_eq!(tm.count(shared[1].block), 1);
    }

    #[test]
    fn keys_out_of_order_are_an_error() {
        let mut tm = tm();
        let mut builder = TreeBuilder::<u64>::new();
        builder.push_value(&mut tm, &mut NoRefs, 5, 0).unwrap();
        assert!(builder.push_value(&mut tm, &mut NoRefs, 5, 0).is_err());
    }
}
