//! The difference of two volumes' mapping trees (what `thin_delta` prints), found by walking
//! both trees together and skipping every subtree they share.
//!
//! Each side is a cursor: a stack of *items* in key order, each either a subtree not read yet
//! (its block, its height above the leaves, and the key interval its parent gives it) or a
//! leaf entry (virtual block → packed data block and time). The walk looks at the front item
//! of each side:
//!
//! ```text
//!   subtree X  │ subtree X   same block: identical contents on both sides → skip both
//!   entry k    │ entry k     compare data blocks (not times): same or different
//!   entry k    │ entry j>k   k is left only (and the mirror case)
//!   entry k    │ subtree S   k below S's interval: left only; else read S (expand it)
//!   subtree A  │ subtree B   A's interval wholly below B's: expand A (the mirror case too);
//!                            overlapping: expand the taller (a shared block may be inside
//!                            it), at equal height the one starting first
//! ```
//!
//! Snapshots share subtrees by block (copy-on-write), and a block has the same height in
//! every tree that holds it, so both cursors reach a shared block as their front item at the
//! same time and it is skipped unread. Nodes read are those on paths to differing entries,
//! plus at most one spine per boundary where an interval was stale (a parent's key is only a
//! lower bound of its child's keys): the cost follows the difference, not the volume size.
//!
//! Listing `same` ranges (as `thin_delta` does) needs the keys of shared subtrees, so that
//! mode reads them: its cost is the mapped size of the shared part.
//!
//! Ranges are merged at block granularity: consecutive virtual blocks of one kind make one
//! range, whatever their data blocks (as `thin_delta` 1.1.0 merges them). Intervals are
//! checked as the walk reads nodes (keys increasing and inside the parent's interval, leaves
//! exactly at height 0, depth bounded): corrupt metadata gives an error, never a loop.
//!
//! [`write_xml`] prints the result as `thin_delta` 1.1.0 does, byte for byte. Used by the
//! engine (`engine/diff.rs`) on committed trees, and by the CLI's `thinpool diff`.

use crate::error::{Error, Result};
use crate::ids::BlockTime;
use persistent_data::btree::node::Node;
use persistent_data::btree::MAX_DEPTH;
use persistent_data::checksum::BlockKind;
use persistent_data::{BlockSource, MetadataBlock};
use std::ops::RangeInclusive;

/// How a run of virtual blocks compares between the left and the right volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeltaKind {
    /// Mapped in both, to the same data block.
    Same,
    /// Mapped in the left volume only.
    LeftOnly,
    /// Mapped in the right volume only.
    RightOnly,
    /// Mapped in both, to different data blocks.
    Different,
}

impl DeltaKind {
    /// The element name `thin_delta` gives it.
    pub fn xml_name(self) -> &'static str {
        match self {
            DeltaKind::Same => "same",
            DeltaKind::LeftOnly => "left_only",
            DeltaKind::RightOnly => "right_only",
            DeltaKind::Different => "different",
        }
    }
}

/// Consecutive virtual blocks `begin..begin + length` of one kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaRange {
    /// First virtual block.
    pub begin: u64,
    /// Number of blocks (at least 1).
    pub length: u64,
    /// How they compare.
    pub kind: DeltaKind,
    /// The data block the first block maps to in the left volume (None: unmapped there).
    /// The range's other blocks need not follow it (`thin_delta --verbose` prints this one).
    pub left_data_begin: Option<u64>,
    /// The same in the right volume.
    pub right_data_begin: Option<u64>,
}

/// What a diff walk reads and where.
#[derive(Clone, Debug)]
pub struct DiffRequest {
    /// Root of the left mapping tree (None: an empty volume).
    pub left: Option<MetadataBlock>,
    /// Root of the right mapping tree (None: an empty volume).
    pub right: Option<MetadataBlock>,
    /// Only virtual blocks in this range are compared.
    pub keys: RangeInclusive<u64>,
    /// Report [`DeltaKind::Same`] ranges too (reads the shared subtrees for their keys).
    pub list_same: bool,
    /// Stop once this many nodes were read and at least one key is decided: the result
    /// then covers the keys below [`Diff::stopped_at`] only. None: no limit.
    pub nodes_max: Option<u64>,
}

impl DiffRequest {
    /// Compare the whole of two trees, differences only.
    pub fn new(left: Option<MetadataBlock>, right: Option<MetadataBlock>) -> DiffRequest {
        DiffRequest {
            left,
            right,
            keys: 0..=u64::MAX,
            list_same: false,
            nodes_max: None,
        }
    }
}

/// The result of a diff walk.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Diff {
    /// Sorted, non-overlapping ranges; adjacent ranges of one kind are merged.
    pub ranges: Vec<DeltaRange>,
    /// Btree nodes read (the walk's cost).
    pub nodes_read: u64,
    /// Where a walk stopped at [`DiffRequest::nodes_max`]: the keys from this one on were
    /// not compared (the ranges cover the keys below it). None: every key was.
    pub stopped_at: Option<u64>,
}

/// Compare two mapping trees (bottom level: virtual block → packed [`BlockTime`]).
pub fn diff<S: BlockSource + ?Sized>(source: &S, request: &DiffRequest) -> Result<Diff> {
    let mut walk = Walk {
        source,
        nodes_read: 0,
        nodes_max: request.nodes_max.unwrap_or(u64::MAX),
        stopped_at: None,
        keys: (
            u128::from(*request.keys.start()),
            u128::from(*request.keys.end()) + 1,
        ),
        ranges: Ranges::new(request.list_same),
    };
    if request.keys.is_empty() {
        return Ok(Diff::default());
    }
    if let Some(root) = request.left.filter(|_| request.left == request.right) {
        // One tree: everything is shared.
        if request.list_same {
            let height = walk.height(root)?;
            walk.emit_shared(root, height, FULL)?;
        }
        return Ok(walk.finish());
    }
    let mut left = Vec::new();
    let mut right = Vec::new();
    for (root, side) in [(request.left, &mut left), (request.right, &mut right)] {
        if let Some(root) = root {
            let height = walk.height(root)?;
            walk.push_subtree(
                side,
                Subtree {
                    block: root,
                    height,
                    interval: FULL,
                },
            );
        }
    }
    walk.run(&mut left, &mut right)?;
    Ok(walk.finish())
}

/// Key interval `[lo, hi)`; `hi` may be 2^64.
type Interval = (u128, u128);

const FULL: Interval = (0, 1 << 64);

#[derive(Clone, Copy, Debug)]
struct Subtree {
    block: MetadataBlock,
    /// 0 for a leaf.
    height: usize,
    /// The keys its parent allows it.
    interval: Interval,
}

#[derive(Clone, Copy, Debug)]
enum Item {
    Subtree(Subtree),
    Entry { key: u64, value: u64 },
}

/// A side's pending items, the front last.
type Side = Vec<Item>;

struct Walk<'a, S: BlockSource + ?Sized> {
    source: &'a S,
    nodes_read: u64,
    nodes_max: u64,
    stopped_at: Option<u64>,
    /// The keys compared, `[lo, hi)`.
    keys: Interval,
    ranges: Ranges,
}

fn corrupt(block: MetadataBlock, rule: String) -> Error {
    Error::Metadata(persistent_data::Error::corrupt(block, rule))
}

impl<S: BlockSource + ?Sized> Walk<'_, S> {
    fn finish(self) -> Diff {
        Diff {
            ranges: self.ranges.finish(),
            nodes_read: self.nodes_read,
            stopped_at: self.stopped_at,
        }
    }

    /// The height of the tree at `root`: levels below it down to the leaves (its leftmost
    /// spine; all leaves are at one depth).
    fn height(&mut self, root: MetadataBlock) -> Result<usize> {
        let mut block = root;
        for height in 0..MAX_DEPTH {
            let data = self.source.read_block(block, BlockKind::Node)?;
            self.nodes_read += 1;
            let node = Node::parse(block, &data, 8)?;
            if node.is_leaf() {
                return Ok(height);
            }
            if node.is_empty() {
                return Err(corrupt(block, "internal btree node without entries".into()));
            }
            block = node.child(0);
        }
        Err(corrupt(
            root,
            format!("btree deeper than {MAX_DEPTH} levels (a cycle?)"),
        ))
    }

    /// Push `subtree` on `side` if it may hold keys inside the compared range.
    fn push_subtree(&self, side: &mut Side, subtree: Subtree) {
        let (lo, hi) = subtree.interval;
        if hi > self.keys.0 && lo < self.keys.1 && lo < hi {
            side.push(Item::Subtree(subtree));
        }
    }

    /// Read `subtree` and put its items on `side` in its place (front first).
    fn expand(&mut self, side: &mut Side, subtree: Subtree) -> Result<()> {
        let Subtree {
            block,
            height,
            interval: (lo, hi),
        } = subtree;
        let data = self.source.read_block(block, BlockKind::Node)?;
        self.nodes_read += 1;
        let node = Node::parse(block, &data, 8)?;
        if node.is_leaf() != (height == 0) {
            return Err(corrupt(
                block,
                format!("btree node at height {height} is a leaf: leaves at different depths"),
            ));
        }
        check_keys(block, &node, (lo, hi))?;
        for i in (0..node.len()).rev() {
            let key = node.key(i);
            if node.is_leaf() {
                if u128::from(key) >= self.keys.0 && u128::from(key) < self.keys.1 {
                    let value =
                        u64::from_le_bytes(node.value_bytes(i).try_into().expect("8-byte values"));
                    side.push(Item::Entry { key, value });
                }
            } else {
                let child_lo = if i == 0 { lo } else { u128::from(key) };
                let child_hi = if i + 1 < node.len() {
                    u128::from(node.key(i + 1))
                } else {
                    hi
                };
                self.push_subtree(
                    side,
                    Subtree {
                        block: node.child(i),
                        height: height - 1,
                        interval: (child_lo, child_hi),
                    },
                );
            }
        }
        Ok(())
    }

    /// Record every entry of a subtree both sides share as [`DeltaKind::Same`].
    fn emit_shared(
        &mut self,
        block: MetadataBlock,
        height: usize,
        interval: Interval,
    ) -> Result<()> {
        let mut pending = Vec::new();
        self.push_subtree(
            &mut pending,
            Subtree {
                block,
                height,
                interval,
            },
        );
        while let Some(item) = pending.pop() {
            match item {
                Item::Subtree(subtree) => self.expand(&mut pending, subtree)?,
                Item::Entry { key, value } => {
                    let data = data_block(value);
                    self.ranges
                        .push(key, DeltaKind::Same, Some(data), Some(data))
                }
            }
        }
        Ok(())
    }

    fn run(&mut self, left: &mut Side, right: &mut Side) -> Result<()> {
        loop {
            if self.nodes_read >= self.nodes_max {
                // Every key below both fronts is decided (items are taken in key order, an
                // entry only once it is below the other side's front).
                let front = |side: &Side| match side.last() {
                    Some(Item::Entry { key, .. }) => u128::from(*key),
                    Some(Item::Subtree(s)) => s.interval.0,
                    None => self.keys.1,
                };
                let decided = front(left).min(front(right)).min(self.keys.1);
                if decided > self.keys.0 && decided < self.keys.1 {
                    self.stopped_at = Some(decided as u64);
                    return Ok(());
                }
            }
            match (left.last().copied(), right.last().copied()) {
                (None, None) => return Ok(()),
                (Some(l), None) => {
                    left.pop();
                    self.one_side(left, l, DeltaKind::LeftOnly)?;
                }
                (None, Some(r)) => {
                    right.pop();
                    self.one_side(right, r, DeltaKind::RightOnly)?;
                }
                (Some(l), Some(r)) => self.both_sides(left, right, l, r)?,
            }
        }
    }

    /// An item (already popped) of one side only: its entries are `kind`.
    fn one_side(&mut self, side: &mut Side, item: Item, kind: DeltaKind) -> Result<()> {
        match item {
            Item::Subtree(s) => self.expand(side, s)?,
            Item::Entry { key, value } => {
                let block = Some(data_block(value));
                match kind {
                    DeltaKind::LeftOnly => self.ranges.push(key, kind, block, None),
                    _ => self.ranges.push(key, kind, None, block),
                }
            }
        }
        Ok(())
    }

    /// The next items of both sides (still on their stacks): take the lower one, or both.
    fn both_sides(&mut self, left: &mut Side, right: &mut Side, l: Item, r: Item) -> Result<()> {
        match (l, r) {
            (Item::Entry { key: lk, value: lv }, Item::Entry { key: rk, value: rv }) => {
                let (ld, rd) = (data_block(lv), data_block(rv));
                if lk < rk {
                    left.pop();
                    self.ranges.push(lk, DeltaKind::LeftOnly, Some(ld), None);
                } else if rk < lk {
                    right.pop();
                    self.ranges.push(rk, DeltaKind::RightOnly, None, Some(rd));
                } else {
                    left.pop();
                    right.pop();
                    let kind = if ld == rd {
                        DeltaKind::Same
                    } else {
                        DeltaKind::Different
                    };
                    self.ranges.push(lk, kind, Some(ld), Some(rd));
                }
                Ok(())
            }
            (Item::Entry { key, .. }, Item::Subtree(s)) => {
                if u128::from(key) < s.interval.0 {
                    left.pop();
                    self.one_side(left, l, DeltaKind::LeftOnly)
                } else {
                    right.pop();
                    self.expand(right, s)
                }
            }
            (Item::Subtree(s), Item::Entry { key, .. }) => {
                if u128::from(key) < s.interval.0 {
                    right.pop();
                    self.one_side(right, r, DeltaKind::RightOnly)
                } else {
                    left.pop();
                    self.expand(left, s)
                }
            }
            (Item::Subtree(a), Item::Subtree(b)) => self.subtrees(left, right, a, b),
        }
    }

    /// Two subtrees: skip them if they are the same block, else expand the one that comes
    /// first (or, overlapping, the higher one).
    fn subtrees(
        &mut self,
        left: &mut Side,
        right: &mut Side,
        a: Subtree,
        b: Subtree,
    ) -> Result<()> {
        if a.block == b.block {
            // Shared: the same entries on both sides, and no other entry of either side
            // lies among their keys.
            left.pop();
            right.pop();
            if self.ranges.list_same {
                let interval = (
                    a.interval.0.max(b.interval.0),
                    a.interval.1.min(b.interval.1),
                );
                self.emit_shared(a.block, a.height, interval)?;
            }
            return Ok(());
        }
        let expand_left = if a.interval.1 <= b.interval.0 {
            true
        } else if b.interval.1 <= a.interval.0 {
            false
        } else if a.height != b.height {
            a.height > b.height
        } else {
            a.interval.0 <= b.interval.0
        };
        if expand_left {
            left.pop();
            self.expand(left, a)
        } else {
            right.pop();
            self.expand(right, b)
        }
    }
}

/// The data block of a packed mapping value.
fn data_block(value: u64) -> u64 {
    BlockTime::unpack(value).data_block().get()
}

/// A node's keys strictly increase and lie inside the interval its parent gives it (the
/// first key of an internal node may be below it: the parent's key bounds that child).
fn check_keys(block: MetadataBlock, node: &Node<'_>, (lo, hi): Interval) -> Result<()> {
    let mut previous: Option<u64> = None;
    for i in 0..node.len() {
        let key = node.key(i);
        if previous.is_some_and(|p| key <= p) {
            return Err(corrupt(
                block,
                format!(
                    "btree keys out of order: {key} after {}",
                    previous.unwrap_or(0)
                ),
            ));
        }
        let bounded_below = (i == 0 && !node.is_leaf()) || u128::from(key) >= lo;
        if !bounded_below || u128::from(key) >= hi {
            return Err(corrupt(
                block,
                format!("btree key {key} outside the range its parent gives ({lo}..{hi})"),
            ));
        }
        previous = Some(key);
    }
    Ok(())
}

/// Entries in key order, merged into ranges.
struct Ranges {
    list_same: bool,
    current: Option<DeltaRange>,
    done: Vec<DeltaRange>,
}

impl Ranges {
    fn new(list_same: bool) -> Ranges {
        Ranges {
            list_same,
            current: None,
            done: Vec::new(),
        }
    }

    /// Add virtual block `key`, greater than every key added before, mapped to `left` and
    /// `right` data blocks.
    fn push(&mut self, key: u64, kind: DeltaKind, left: Option<u64>, right: Option<u64>) {
        if let Some(current) = &mut self.current {
            let end = u128::from(current.begin) + u128::from(current.length);
            assert!(
                u128::from(key) >= end,
                "diff keys in order: {key} after {end}"
            );
            if current.kind == kind && u128::from(key) == end {
                current.length += 1;
                return;
            }
        }
        if let Some(finished) = self.current.take() {
            self.done.push(finished);
        }
        if kind != DeltaKind::Same || self.list_same {
            self.current = Some(DeltaRange {
                begin: key,
                length: 1,
                kind,
                left_data_begin: left,
                right_data_begin: right,
            });
        }
    }

    fn finish(mut self) -> Vec<DeltaRange> {
        self.done.extend(self.current.take());
        self.done
    }
}

/// The superblock fields `thin_delta` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaHeader {
    /// The pool time.
    pub time: u32,
    /// The transaction id.
    pub transaction_id: u64,
    /// Data block size in 512-byte sectors.
    pub data_block_size_sectors: u32,
    /// Data blocks in the pool (the data space map's size).
    pub data_block_count: u64,
}

mod xml;

pub use xml::write_xml;

#[cfg(test)]
mod tests;
