//! The btree walk of a repair: every entry that can be trusted, in ascending key order, past
//! whatever damage the tree holds.
//!
//! A node is trusted when its block is inside the metadata device, its checksum and location
//! are right, its header parses (flags, value size, `max_entries`, `nr_entries`), its keys are
//! strictly increasing and inside the range its parent gives, an internal node has at least
//! one entry, and it was not met before in the same tree (a cycle, or a child listed twice).
//! A node that is not trusted is skipped with everything below it, and counted; nothing is
//! guessed from it (a node with two keys swapped would otherwise attach a value to the wrong
//! key). Occupancy and equal leaf depth are not required: they say nothing about whether an
//! entry is right.

use persistent_data::block_manager::BlockManager;
use persistent_data::btree::node::Node;
use persistent_data::checksum::BlockKind;
use persistent_data::MetadataBlock;
use std::collections::HashSet;

/// Deeper than any real tree (a full 16 GiB metadata device holds trees of depth 5 or
/// less); a walk goes no deeper, whatever the nodes say.
pub const DEPTH_MAX: usize = 16;

/// What a walk (or several) left out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Skipped {
    /// Nodes skipped: unreadable, bad checksum or location, bad header, keys out of order
    /// or outside their parent's range, an empty internal node, too deep.
    pub bad_nodes: u64,
    /// Nodes met a second time in the same tree (a cycle, or a child listed twice).
    pub repeated_nodes: u64,
    /// References to blocks beyond the metadata device.
    pub out_of_range: u64,
    /// Entries of trusted leaves the caller refused (e.g. a mapping beyond the data device).
    pub bad_values: u64,
}

impl Skipped {
    /// Whether nothing was skipped.
    pub fn is_empty(&self) -> bool {
        *self == Skipped::default()
    }
}

/// Walks trees of one metadata device, counting what it skips.
pub struct Walker<'a> {
    bm: &'a BlockManager,
    /// What the walks so far skipped.
    pub skipped: Skipped,
}

/// One tree's walk: its visited nodes, its leaf value size and the caller's visitor.
struct Tree<'v> {
    value_size: usize,
    visited: HashSet<u64>,
    visit: &'v mut dyn FnMut(u64, &[u8]) -> bool,
}

impl<'a> Walker<'a> {
    /// A walker reading through `bm`.
    pub fn new(bm: &'a BlockManager) -> Walker<'a> {
        Walker {
            bm,
            skipped: Skipped::default(),
        }
    }

    /// The block manager it reads through.
    pub fn block_manager(&self) -> &'a BlockManager {
        self.bm
    }

    /// Whether `root` is a trusted node on its own (readable, well formed), without walking
    /// below it.
    pub fn root_is_readable(&self, root: MetadataBlock, value_size: usize) -> bool {
        if root.get() >= self.bm.block_count() {
            return false;
        }
        let Ok(data) = self.bm.read(root, BlockKind::Node) else {
            return false;
        };
        Node::parse(root, &data, value_size).is_ok_and(|node| keys_fit(&node, 0, None))
    }

    /// Call `visit(key, value)` for every entry of the tree at `root` (leaf values of
    /// `value_size` bytes) whose leaf and every ancestor are trusted, in ascending key order.
    /// `visit` returns whether it kept the entry (a refusal is counted as a bad value).
    /// Returns whether the root itself was trusted.
    pub fn entries(
        &mut self,
        root: MetadataBlock,
        value_size: usize,
        visit: &mut dyn FnMut(u64, &[u8]) -> bool,
    ) -> bool {
        let mut tree = Tree {
            value_size,
            visited: HashSet::new(),
            visit,
        };
        self.node(&mut tree, root, 0, None, 0)
    }

    /// Walk the node at `block`, whose keys must lie in `lo..hi` (`hi` None: unbounded).
    /// Returns whether the node was trusted.
    fn node(
        &mut self,
        tree: &mut Tree<'_>,
        block: MetadataBlock,
        lo: u64,
        hi: Option<u64>,
        depth: usize,
    ) -> bool {
        if block.get() >= self.bm.block_count() {
            self.skipped.out_of_range += 1;
            return false;
        }
        if !tree.visited.insert(block.get()) {
            self.skipped.repeated_nodes += 1;
            return false;
        }
        let Ok(data) = self.bm.read(block, BlockKind::Node) else {
            self.skipped.bad_nodes += 1;
            return false;
        };
        let node = match Node::parse(block, &data, tree.value_size) {
            Ok(node) if keys_fit(&node, lo, hi) && depth < DEPTH_MAX => node,
            _ => {
                self.skipped.bad_nodes += 1;
                return false;
            }
        };
        if node.is_leaf() {
            for i in 0..node.len() {
                if !(tree.visit)(node.key(i), node.value_bytes(i)) {
                    self.skipped.bad_values += 1;
                }
            }
            return true;
        }
        for i in 0..node.len() {
            let child_hi = if i + 1 < node.len() {
                Some(node.key(i + 1))
            } else {
                hi
            };
            self.node(tree, node.child(i), node.key(i), child_hi, depth + 1);
        }
        true
    }
}

/// Whether the node's keys are strictly increasing inside `lo..hi`, and an internal node has
/// an entry.
fn keys_fit(node: &Node<'_>, lo: u64, hi: Option<u64>) -> bool {
    if !node.is_leaf() && node.is_empty() {
        return false;
    }
    let mut previous: Option<u64> = None;
    for i in 0..node.len() {
        let key = node.key(i);
        if key < lo || hi.is_some_and(|hi| key >= hi) || previous.is_some_and(|p| key <= p) {
            return false;
        }
        previous = Some(key);
    }
    true
}
