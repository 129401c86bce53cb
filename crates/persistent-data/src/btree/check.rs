//! Checking a whole tree against the shape rules (spec §11 rules 3-9).

use super::node::Node;
use super::{too_deep, Value, MAX_DEPTH};
use crate::block::MetadataBlock;
use crate::checksum::BlockKind;
use crate::cow::BlockSource;
use crate::error::{Error, Result};

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
    check_keys(block, &node, lower_bound, upper_bound)?;
    if node.is_leaf() {
        return check_leaf(block, &node, depth, state, stats, visit_value);
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

/// Keys within a node strictly increase and lie in `[lower_bound, upper_bound)`, the range
/// the parent gives the node.
fn check_keys(
    block: MetadataBlock,
    node: &Node<'_>,
    lower_bound: Option<u64>,
    upper_bound: Option<u64>,
) -> Result<()> {
    let n = node.len();
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
    Ok(())
}

/// A leaf is at the depth of every other leaf, and its keys continue the order of the
/// leaves before it; each entry goes to `visit_value`.
fn check_leaf<V: Value>(
    block: MetadataBlock,
    node: &Node<'_>,
    depth: usize,
    state: &mut CheckState,
    stats: &mut TreeStats,
    visit_value: &mut dyn FnMut(u64, V) -> Result<()>,
) -> Result<()> {
    let n = node.len();
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
    Ok(())
}
