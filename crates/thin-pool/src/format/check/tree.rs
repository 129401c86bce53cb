//! The checker's btree walk: validates every node of a tree (spec §11 rules 3-9), counts one
//! metadata reference per pointer followed, and walks each node once however many trees
//! share it.
//!
//! Memory is bounded by the metadata device, not by the number of mappings: per metadata
//! block it keeps the expected reference count (one byte, larger counts in a map), the
//! height of the subtree below a visited node (one byte) and its entry count (four bytes,
//! so a shared volume tree's `mapped_blocks` can be compared without walking it again).
//! The walk itself recurses at most [`MAX_DEPTH`] levels.

use super::counts::{zeroed, Counts};
use super::read_ahead::ReadAhead;
use super::report::{Problem, Report, Rule, Severity, Structure};
use super::{Phase, Progress};
use crate::ids::VolumeId;
use persistent_data::block_manager::BlockManager;
use persistent_data::btree::node::{self, Node, HEADER_SIZE};
use persistent_data::btree::MAX_DEPTH;
use persistent_data::checksum::BlockKind;
use persistent_data::{Error as PdError, MetadataBlock, BLOCK_SIZE};

/// The trees the checker walks, each with its leaf value size and rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TreeKind {
    /// Device details: 24-byte values.
    Details,
    /// Mapping top level: values are bottom-level roots.
    TopLevel,
    /// A volume's mappings: values are block_time.
    Bottom(VolumeId),
    /// Data space-map index: 16-byte index entries.
    DataIndex,
    /// An overflow (ref-count) tree of the data or metadata space map.
    Overflow(Structure),
}

impl TreeKind {
    fn value_size(self) -> usize {
        match self {
            TreeKind::Details => 24,
            TreeKind::TopLevel | TreeKind::Bottom(_) => 8,
            TreeKind::DataIndex => 16,
            TreeKind::Overflow(_) => 4,
        }
    }

    pub(super) fn structure(self) -> Structure {
        match self {
            TreeKind::Details => Structure::DetailsTree,
            TreeKind::TopLevel => Structure::MappingTopLevel,
            TreeKind::Bottom(_) => Structure::Mappings,
            TreeKind::DataIndex => Structure::DataSpaceMap,
            TreeKind::Overflow(structure) => structure,
        }
    }

    fn volume(self) -> Option<VolumeId> {
        match self {
            TreeKind::Bottom(volume) => Some(volume),
            _ => None,
        }
    }
}

/// A problem a leaf value visitor found: rule, detail, data block.
pub(super) type ValueProblem = (Rule, String, Option<u64>);

/// Sees each leaf entry (leaf block, key, value bytes) once; may report a problem.
pub(super) type ValueVisitor<'v> =
    dyn FnMut(MetadataBlock, u64, &[u8]) -> Option<ValueProblem> + 'v;

/// Sees each leaf (its block, the node) once; pushes the problems of its entries, in entry
/// order. For a tree with many entries, one call per leaf rather than per entry.
pub(super) type LeafVisitor<'v> = dyn FnMut(MetadataBlock, &Node<'_>, &mut Vec<ValueProblem>) + 'v;

/// `height` marks: not visited yet, being walked (a pointer back to it is a cycle), or
/// broken (already reported). Other values are height + 1.
const UNVISITED: u8 = 0;
// The marks start zeroed.
const _: () = assert!(UNVISITED == 0);
const IN_PROGRESS: u8 = 254;
const BROKEN: u8 = 255;

/// Progress is reported every this many nodes.
const PROGRESS_INTERVAL_NODES: u64 = 1024;

/// What a walk keeps: expected metadata counts and per-node memos.
pub(super) struct Walker<'a> {
    pub(super) bm: &'a BlockManager,
    /// Blocks read ahead by another thread, if one runs.
    read_ahead: Option<&'a ReadAhead>,
    /// Blocks the walk is done with, for the reader to reuse.
    spares: Vec<std::sync::Arc<persistent_data::Block>>,
    /// Expected metadata reference counts, sized by the metadata space map.
    pub(super) counts: Counts,
    height: Vec<u8>,
    entries: Vec<u32>,
    /// Require bottom-level leaves to be a third full (thin_check 0.9.0).
    bottom_leaf_occupancy: bool,
    pub(super) report: Report,
    progress: &'a mut dyn FnMut(Progress),
    pub(super) phase: Phase,
    pub(super) total_blocks: u64,
}

impl<'a> Walker<'a> {
    pub(super) fn new(
        bm: &'a BlockManager,
        read_ahead: Option<&'a ReadAhead>,
        block_count: u64,
        in_use: u64,
        bottom_leaf_occupancy: bool,
        report: Report,
        progress: &'a mut dyn FnMut(Progress),
    ) -> Walker<'a> {
        // The caller bounds `block_count` by the metadata device (and METADATA_BLOCKS_MAX).
        let n = usize::try_from(block_count).unwrap_or(0);
        Walker {
            bm,
            read_ahead,
            spares: Vec::new(),
            counts: Counts::new(block_count, u64::MAX, in_use),
            height: zeroed(n, in_use),
            entries: zeroed(n, in_use),
            bottom_leaf_occupancy,
            report,
            progress,
            phase: Phase::Superblock,
            total_blocks: 0,
        }
    }

    /// Report progress for a new phase.
    pub(super) fn start_phase(&mut self, phase: Phase) {
        self.phase = phase;
        (self.progress)(Progress {
            phase,
            done_blocks: self.report.summary.node_count,
            total_blocks: self.total_blocks,
        });
    }

    pub(super) fn problem(
        &mut self,
        severity: Severity,
        structure: Structure,
        volume: Option<VolumeId>,
        block: Option<u64>,
        rule: Rule,
        detail: String,
    ) {
        self.report.push(Problem {
            severity,
            structure,
            volume,
            block,
            data_block: None,
            rule,
            detail,
        });
    }

    /// Count one reference to metadata block `block` from `structure`. Returns whether the
    /// block is inside the metadata space map (so it can be read).
    pub(super) fn reference(
        &mut self,
        block: u64,
        structure: Structure,
        volume: Option<VolumeId>,
        from: Option<u64>,
    ) -> bool {
        if block >= self.counts.len() {
            let detail = format!(
                "reference to block {block} beyond the metadata space map ({} blocks){}",
                self.counts.len(),
                from.map(|f| format!(" from block {f}")).unwrap_or_default()
            );
            self.problem(
                Severity::Fatal,
                structure,
                volume,
                from.or(Some(block)),
                Rule::BlockOutOfRange,
                detail,
            );
            return false;
        }
        self.counts.inc(block);
        true
    }

    /// Have the trees under `roots` read ahead (if a reader runs), in the order they will
    /// be walked.
    pub(super) fn read_ahead_trees(&self, roots: Vec<u64>) {
        if let Some(read_ahead) = self.read_ahead {
            read_ahead.trees(roots);
        }
    }

    /// Have `blocks` read ahead as `kind` (if a reader runs), in the order they will be
    /// read.
    pub(super) fn read_ahead_blocks(&self, blocks: Vec<u64>, kind: BlockKind) {
        if let Some(read_ahead) = self.read_ahead {
            read_ahead.blocks(blocks, kind);
        }
    }

    /// Read `block` as `kind` (from the blocks read ahead, if it is there), turning
    /// failures into problems.
    pub(super) fn read(
        &mut self,
        block: u64,
        kind: BlockKind,
        structure: Structure,
        volume: Option<VolumeId>,
    ) -> Option<std::sync::Arc<persistent_data::Block>> {
        if let Some(read_ahead) = self.read_ahead {
            if let Some(data) = read_ahead.take(block, kind, &mut self.spares) {
                return Some(data);
            }
        }
        match self.bm.read(MetadataBlock::new(block), kind) {
            Ok(data) => Some(data),
            Err(error) => {
                let (rule, detail) = match &error {
                    PdError::Checksum { .. } => (
                        Rule::Checksum(kind),
                        format!("bad checksum: not a valid {kind} ({error})"),
                    ),
                    PdError::Corrupt { rule, .. } if rule.contains("lives at") => {
                        (Rule::Location(kind), rule.clone())
                    }
                    PdError::Corrupt { rule, .. } => (Rule::BlockOutOfRange, rule.clone()),
                    other => (Rule::Io, other.to_string()),
                };
                self.problem(
                    Severity::Fatal,
                    structure,
                    volume,
                    Some(block),
                    rule,
                    detail,
                );
                None
            }
        }
    }

    /// Walk the tree rooted at `root` (whose reference the caller has counted). `visit`
    /// sees every leaf entry the first time its leaf is walked. Returns the number of
    /// entries in the tree (shared subtrees included), or `None` if the root is unusable.
    pub(super) fn walk(
        &mut self,
        root: u64,
        kind: TreeKind,
        visit: &mut ValueVisitor<'_>,
    ) -> Option<u64> {
        let mut each_entry = |block: MetadataBlock, node: &Node<'_>, problems: &mut Vec<_>| {
            for i in 0..node.len() {
                if let Some(problem) = visit(block, node.key(i), node.value_bytes(i)) {
                    problems.push(problem);
                }
            }
        };
        self.walk_leaves(root, kind, &mut each_entry)
    }

    /// [`Walker::walk`], `visit` seeing each leaf whole.
    pub(super) fn walk_leaves(
        &mut self,
        root: u64,
        kind: TreeKind,
        visit: &mut LeafVisitor<'_>,
    ) -> Option<u64> {
        self.node(root, kind, None, None, 0, visit)
            .map(|(_, entries)| entries)
    }

    /// Check a node reached again through another pointer: its keys must fit the range
    /// this parent gives.
    fn revisit(&mut self, block: u64, kind: TreeKind, lower: Option<u64>, upper: Option<u64>) {
        if lower.is_none() && upper.is_none() {
            return;
        }
        let Some(data) = self.read(block, BlockKind::Node, kind.structure(), kind.volume()) else {
            return;
        };
        let Ok(node) = Node::parse(MetadataBlock::new(block), &data, kind.value_size()) else {
            return;
        };
        if node.is_empty() {
            return;
        }
        self.check_bounds(block, kind, &node, lower, upper);
    }

    fn check_bounds(
        &mut self,
        block: u64,
        kind: TreeKind,
        node: &Node<'_>,
        lower: Option<u64>,
        upper: Option<u64>,
    ) {
        let first = node.key(0);
        let last = node.key(node.len() - 1);
        if let Some(lower) = lower.filter(|&lower| first < lower) {
            self.node_problem(
                block,
                kind,
                Rule::ParentKey,
                format!("first key {first} is below its parent's key {lower}"),
            );
        }
        if let Some(upper) = upper.filter(|&upper| last >= upper) {
            self.node_problem(
                block,
                kind,
                Rule::ParentKey,
                format!("key {last} is not below the parent's next key {upper}"),
            );
        }
    }

    /// Check the header fields `Node::parse` insists on, one problem per broken rule.
    fn check_header(&mut self, block: u64, kind: TreeKind, data: &persistent_data::Block) -> bool {
        let u32_at = |at: usize| u32::from_le_bytes(data[at..at + 4].try_into().expect("4"));
        let flags = u32_at(4);
        let nr_entries = u32_at(16) as usize;
        let max = u32_at(20) as usize;
        let value_size = u32_at(24) as usize;
        let (rule, detail) = if flags != node::INTERNAL_FLAG && flags != node::LEAF_FLAG {
            (
                Rule::NodeFlags,
                format!("node flags {flags:#x} are neither internal (1) nor leaf (2)"),
            )
        } else if value_size
            != if flags == node::LEAF_FLAG {
                kind.value_size()
            } else {
                8
            }
        {
            (
                Rule::ValueSize,
                format!(
                    "value size is {value_size}, expected {}",
                    if flags == node::LEAF_FLAG {
                        kind.value_size()
                    } else {
                        8
                    }
                ),
            )
        } else if max == 0 || HEADER_SIZE + max * (8 + value_size) > BLOCK_SIZE {
            (
                Rule::MaxEntries,
                format!("max_entries {max} does not fit a block with {value_size}-byte values"),
            )
        } else if !max.is_multiple_of(3) {
            (
                Rule::MaxEntries,
                format!("max_entries {max} is not a multiple of 3"),
            )
        } else if nr_entries > max {
            (
                Rule::EntryCount,
                format!("nr_entries {nr_entries} is more than max_entries {max}"),
            )
        } else {
            return true;
        };
        self.node_problem(block, kind, rule, detail);
        false
    }

    fn node(
        &mut self,
        block: u64,
        kind: TreeKind,
        lower: Option<u64>,
        upper: Option<u64>,
        depth: usize,
        visit: &mut LeafVisitor<'_>,
    ) -> Option<(u8, u64)> {
        let index = block as usize;
        match self.height[index] {
            UNVISITED => {}
            BROKEN => return None,
            IN_PROGRESS => {
                self.node_problem(
                    block,
                    kind,
                    Rule::LeafDepth,
                    "node is its own ancestor (a cycle)".to_string(),
                );
                return None;
            }
            height => {
                self.revisit(block, kind, lower, upper);
                return Some((height - 1, u64::from(self.entries[index])));
            }
        }
        if depth >= MAX_DEPTH {
            self.node_problem(
                block,
                kind,
                Rule::LeafDepth,
                format!("tree deeper than {MAX_DEPTH} levels"),
            );
            return None;
        }
        self.height[index] = IN_PROGRESS;
        let result = self.first_visit(block, kind, lower, upper, depth, visit);
        match result {
            Some((height, entries)) => {
                self.height[index] = height + 1;
                self.entries[index] = u32::try_from(entries).unwrap_or(u32::MAX);
            }
            None => self.height[index] = BROKEN,
        }
        result
    }

    fn first_visit(
        &mut self,
        block: u64,
        kind: TreeKind,
        lower: Option<u64>,
        upper: Option<u64>,
        depth: usize,
        visit: &mut LeafVisitor<'_>,
    ) -> Option<(u8, u64)> {
        let data = self.read(block, BlockKind::Node, kind.structure(), kind.volume())?;
        self.count_node();
        if !self.check_header(block, kind, &data) {
            return None;
        }
        let node = match Node::parse(MetadataBlock::new(block), &data, kind.value_size()) {
            Ok(node) => node,
            Err(error) => {
                let detail = error.to_string();
                self.node_problem(block, kind, Rule::EntryCount, detail);
                return None;
            }
        };
        if !self.check_entries(block, kind, &node, lower, upper, depth) {
            return None;
        }
        if node.is_leaf() {
            self.visit_leaf(block, kind, &node, visit);
            let entries = node.len() as u64;
            self.give_back(data);
            return Some((0, entries));
        }
        // Copy the children out: the block's buffer is released before descending, so the
        // walk holds at most one block per level.
        let children: Vec<(u64, u64)> = (0..node.len())
            .map(|i| (node.key(i), node.child(i).get()))
            .collect();
        self.give_back(data);
        self.descend(block, kind, &children, upper, depth, visit)
    }

    /// Done with `data`: the reader may read into it again, if nobody else holds it.
    fn give_back(&mut self, data: std::sync::Arc<persistent_data::Block>) {
        if self.read_ahead.is_some() && std::sync::Arc::strong_count(&data) == 1 {
            self.spares.push(data);
        }
    }

    /// One more node read: report progress every [`PROGRESS_INTERVAL_NODES`].
    fn count_node(&mut self) {
        let summary = &mut self.report.summary;
        summary.node_count += 1;
        if summary.node_count.is_multiple_of(PROGRESS_INTERVAL_NODES) {
            (self.progress)(Progress {
                phase: self.phase,
                done_blocks: summary.node_count,
                total_blocks: self.total_blocks,
            });
        }
    }

    fn node_problem(&mut self, block: u64, kind: TreeKind, rule: Rule, detail: String) {
        let (structure, volume) = (kind.structure(), kind.volume());
        self.problem(
            Severity::Fatal,
            structure,
            volume,
            Some(block),
            rule,
            detail,
        );
    }

    /// The rules on a parsed node's entries: occupancy, an internal node not empty, keys
    /// increasing and inside the parent's range. Returns whether the node can be walked
    /// further (an occupancy or range problem is reported but does not stop the walk).
    fn check_entries(
        &mut self,
        block: u64,
        kind: TreeKind,
        node: &Node<'_>,
        lower: Option<u64>,
        upper: Option<u64>,
        depth: usize,
    ) -> bool {
        let n = node.len();
        let occupancy_applies =
            !node.is_leaf() || self.bottom_leaf_occupancy || !matches!(kind, TreeKind::Bottom(_));
        if depth > 0 && occupancy_applies && n < node.max_entries() / 3 {
            let detail = format!(
                "non-root node has {n} entries, fewer than a third of {}",
                node.max_entries()
            );
            self.node_problem(block, kind, Rule::Occupancy, detail);
        }
        if !node.is_leaf() && n == 0 {
            let detail = "internal node with no entries".to_string();
            self.node_problem(block, kind, Rule::EntryCount, detail);
            return false;
        }
        if let Some(i) = (1..n).find(|&i| node.key(i) <= node.key(i - 1)) {
            let detail = format!(
                "keys not strictly increasing: {} at entry {i} after {}",
                node.key(i),
                node.key(i - 1)
            );
            self.node_problem(block, kind, Rule::KeyOrder, detail);
            return false;
        }
        if n > 0 {
            self.check_bounds(block, kind, node, lower, upper);
        }
        true
    }

    /// Show a leaf to `visit`, reporting what it finds.
    fn visit_leaf(
        &mut self,
        block: u64,
        kind: TreeKind,
        node: &Node<'_>,
        visit: &mut LeafVisitor<'_>,
    ) {
        let mut problems = Vec::new();
        visit(MetadataBlock::new(block), node, &mut problems);
        for (rule, detail, data_block) in problems {
            self.report.push(Problem {
                severity: Severity::Fatal,
                structure: kind.structure(),
                volume: kind.volume(),
                block: Some(block),
                data_block,
                rule,
                detail,
            });
        }
    }

    /// Walk the children (key, block) of internal node `block`; all must have the same
    /// height. Returns (height of `block`, entries below it).
    fn descend(
        &mut self,
        block: u64,
        kind: TreeKind,
        children: &[(u64, u64)],
        upper: Option<u64>,
        depth: usize,
        visit: &mut LeafVisitor<'_>,
    ) -> Option<(u8, u64)> {
        let (structure, volume) = (kind.structure(), kind.volume());
        let mut height: Option<u8> = None;
        let mut entries = 0u64;
        for (i, &(key, child)) in children.iter().enumerate() {
            if !self.reference(child, structure, volume, Some(block)) {
                continue;
            }
            let child_upper = children.get(i + 1).map(|&(k, _)| k).or(upper);
            let Some((child_height, child_entries)) =
                self.node(child, kind, Some(key), child_upper, depth + 1, visit)
            else {
                continue;
            };
            entries += child_entries;
            match height {
                None => height = Some(child_height),
                Some(h) if h != child_height => {
                    let detail = format!(
                        "child {child} has height {child_height}, its siblings have height {h}"
                    );
                    self.node_problem(block, kind, Rule::LeafDepth, detail);
                }
                Some(_) => {}
            }
        }
        Some((height.map_or(1, |h| h + 1), entries))
    }
}
