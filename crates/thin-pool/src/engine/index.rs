//! The in-memory mapping index: what the read path consults instead of the btree.
//!
//! One index per volume: a radix tree of fixed height over the virtual block number. A
//! 44-bit block number splits into five 9-bit digits below a root digit:
//!
//! ```text
//!   root slot (bits 36..)  →  node3 (27..36)  →  node2 (18..27)  →  node1 (9..18)  →  leaf (0..9)
//! ```
//!
//! A leaf is 512 `AtomicU64` entries covering 512 consecutive virtual blocks; a node is 512
//! slots (`OnceLock<Box<_>>`, set once, never replaced). Nodes and leaves are allocated the
//! first time one of their blocks is mapped, so an unwritten region costs nothing. An entry is
//! 0 for "unmapped", else the mapping's packed [`BlockTime`] with the data block biased by one
//! (so no mapping packs to 0). A lookup reads four set-once slots and one atomic entry: no
//! lock, no reference counting, no allocation.
//!
//! Writers (the engine, under its per-block provisioning order) store entries with release
//! ordering; growing the volume appends a segment of root slots, never moving the old ones.
//! An index covers at most [`INDEX_BLOCKS_MAX`] virtual blocks (2^44: a 1 EiB volume of 64
//! KiB blocks).
//!
//! RAM: 4 KiB per leaf and 8 KiB per node in use, plus 16 bytes per root slot (one per 2^36
//! virtual blocks of volume size, at most 256):
//!
//! ```text
//!   bytes = 4096 × leaves + 8192 × nodes + 16 × ⌈virtual_blocks / 2^36⌉
//! ```
//!
//! An index exists only for a volume in use: it is built from the volume's mapping tree on
//! first use (`Shared::index`), never copied from another volume's.
//!
//! An unwritten volume of the largest size costs 4 KiB; a fully provisioned volume 8.03 bytes
//! per mapped block (≤ 16 whenever at least half of each touched 512-block region is
//! mapped); an isolated mapping at most 28 KiB (its leaf and three nodes), an isolated one
//! within 16 GiB (2^18 blocks of 64 KiB) of another 4 KiB.

use crate::ids::{BlockTime, Time, VirtualBlock, DATA_BLOCK_MAX};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The largest data block the index can hold (one less than the format's: the bias).
pub const INDEX_DATA_BLOCK_MAX: u64 = DATA_BLOCK_MAX - 1;
/// The most virtual blocks one index covers (2^44).
pub const INDEX_BLOCKS_MAX: u64 = 1 << 44;

/// Bits of the block number each level consumes (leaf entries and node slots: 512).
const DIGIT_BITS: u32 = 9;
const DIGIT_MASK: u64 = (1 << DIGIT_BITS) - 1;
const SLOTS: usize = 1 << DIGIT_BITS;
/// Virtual blocks below one root slot (a node3): 2^36.
const ROOT_SLOT_SHIFT: u32 = 4 * DIGIT_BITS;
/// Bytes of a leaf and of a node, for the RAM formula.
#[cfg(test)]
const LEAF_BYTES: u64 = 8 * SLOTS as u64;
#[cfg(test)]
const NODE_BYTES: u64 = 16 * SLOTS as u64;

type Leaf = [AtomicU64; SLOTS];

/// 512 set-once children.
#[derive(Debug)]
struct Node<C> {
    slots: [OnceLock<Box<C>>; SLOTS],
}

type Node1 = Node<Leaf>;
type Node2 = Node<Node1>;
type Node3 = Node<Node2>;

impl<C> Node<C> {
    fn boxed() -> Box<Node<C>> {
        Box::new(Node {
            slots: std::array::from_fn(|_| OnceLock::new()),
        })
    }

    #[inline]
    fn get(&self, block: u64, shift: u32) -> Option<&C> {
        self.slots[((block >> shift) & DIGIT_MASK) as usize]
            .get()
            .map(|c| &**c)
    }

    fn get_or_init(&self, block: u64, shift: u32, init: impl FnOnce() -> Box<C>) -> &C {
        self.slots[((block >> shift) & DIGIT_MASK) as usize].get_or_init(init)
    }

    /// The children present, with the first block each covers (`span` blocks each, the
    /// first child's first block being `base`).
    fn children(&self, base: u64, span: u64) -> impl Iterator<Item = (u64, &C)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(move |(i, slot)| slot.get().map(|c| (base + i as u64 * span, &**c)))
    }
}

fn new_leaf() -> Box<Leaf> {
    Box::new(std::array::from_fn(|_| AtomicU64::new(0)))
}

/// A run of root slots. A volume's first segment covers its size at creation; growing it
/// appends a segment for the new blocks (set once, never replaced), so a lookup reads no
/// shared pointer that can change under it: no lock, no reference counting.
#[derive(Debug)]
struct Segment {
    /// First root slot this segment holds.
    first: usize,
    slots: Box<[OnceLock<Box<Node3>>]>,
    next: OnceLock<Box<Segment>>,
}

impl Segment {
    fn new(first: usize, count: usize) -> Segment {
        Segment {
            first,
            slots: (0..count).map(|_| OnceLock::new()).collect(),
            next: OnceLock::new(),
        }
    }

    #[inline]
    fn slot(&self, index: usize) -> Option<&OnceLock<Box<Node3>>> {
        let mut segment = self;
        loop {
            if let Some(slot) = segment.slots.get(index.wrapping_sub(segment.first)) {
                return Some(slot);
            }
            segment = segment.next.get()?;
        }
    }

    fn capacity(&self) -> usize {
        self.last().first + self.last().slots.len()
    }

    fn last(&self) -> &Segment {
        let mut segment = self;
        while let Some(next) = segment.next.get() {
            segment = next;
        }
        segment
    }

    /// Every node3 present, with its first block, in order.
    fn nodes(&self) -> impl Iterator<Item = (u64, &Node3)> {
        std::iter::successors(Some(self), |s| s.next.get().map(|n| &**n)).flat_map(|s| {
            s.slots.iter().enumerate().filter_map(move |(i, slot)| {
                slot.get()
                    .map(|n| (((s.first + i) as u64) << ROOT_SLOT_SHIFT, &**n))
            })
        })
    }
}

/// What one data block adds to a packed mapping (its time takes the bits below): the bias
/// that keeps every stored mapping nonzero.
const ONE_DATA_BLOCK: u64 = Time::MAX.get() as u64 + 1;

fn encode(mapping: BlockTime) -> u64 {
    let data_block = mapping.data_block().get();
    assert!(
        data_block <= INDEX_DATA_BLOCK_MAX,
        "data block {data_block} beyond the index's range"
    );
    mapping.pack() + ONE_DATA_BLOCK
}

#[inline]
fn decode(raw: u64) -> Option<BlockTime> {
    (raw != 0).then(|| BlockTime::unpack(raw - ONE_DATA_BLOCK))
}

fn root_slots_for(block_count: u64) -> usize {
    assert!(
        block_count <= INDEX_BLOCKS_MAX,
        "an index of {block_count} blocks: at most {INDEX_BLOCKS_MAX}"
    );
    block_count.div_ceil(1 << ROOT_SLOT_SHIFT) as usize
}

/// A volume's mapping index.
#[derive(Debug)]
pub struct Index {
    root: Segment,
    block_count: AtomicU64,
}

impl Index {
    /// An empty index for a volume of `block_count` virtual blocks (at most
    /// [`INDEX_BLOCKS_MAX`]).
    pub fn new(block_count: u64) -> Index {
        Index {
            root: Segment::new(0, root_slots_for(block_count)),
            block_count: AtomicU64::new(block_count),
        }
    }

    /// Virtual blocks covered.
    pub fn block_count(&self) -> u64 {
        self.block_count.load(Ordering::Acquire)
    }

    /// The leaf holding `block`, if allocated.
    #[inline]
    fn leaf(&self, block: u64) -> Option<&Leaf> {
        let root = usize::try_from(block >> ROOT_SLOT_SHIFT).ok()?;
        self.root
            .slot(root)?
            .get()?
            .get(block, 3 * DIGIT_BITS)?
            .get(block, 2 * DIGIT_BITS)?
            .get(block, DIGIT_BITS)
    }

    /// The mapping of `block`, if any. Lock-free.
    #[inline]
    pub fn lookup(&self, block: VirtualBlock) -> Option<BlockTime> {
        let block = block.get();
        let leaf = self.leaf(block)?;
        decode(leaf[(block & DIGIT_MASK) as usize].load(Ordering::Acquire))
    }

    /// Publish a mapping (release ordering: a reader that sees it sees the data written
    /// before). `block` must be inside the volume.
    pub fn set(&self, block: VirtualBlock, mapping: BlockTime) {
        let block = block.get();
        assert!(
            block < self.block_count(),
            "index set of block {block} beyond the volume's {} blocks",
            self.block_count()
        );
        let leaf = self
            .root
            .slot((block >> ROOT_SLOT_SHIFT) as usize)
            .expect("a block inside the volume has a root slot")
            .get_or_init(Node::boxed)
            .get_or_init(block, 3 * DIGIT_BITS, Node::boxed)
            .get_or_init(block, 2 * DIGIT_BITS, Node::boxed)
            .get_or_init(block, DIGIT_BITS, new_leaf);
        leaf[(block & DIGIT_MASK) as usize].store(encode(mapping), Ordering::Release);
    }

    /// Forget a mapping.
    pub fn clear(&self, block: VirtualBlock) {
        let block = block.get();
        if let Some(leaf) = self.leaf(block) {
            leaf[(block & DIGIT_MASK) as usize].store(0, Ordering::Release);
        }
    }

    /// Forget every mapping at or beyond `begin` (before a shrink). Costs what is allocated
    /// there, not the size.
    pub fn clear_from(&self, begin: VirtualBlock) {
        self.visit_leaves(begin.get(), u64::MAX, &mut |first, leaf| {
            let from = begin.get().saturating_sub(first) as usize;
            for entry in &leaf[from.min(SLOTS)..] {
                entry.store(0, Ordering::Release);
            }
        });
    }

    /// Resize to `block_count` virtual blocks (at most [`INDEX_BLOCKS_MAX`]). Growing beyond
    /// the capacity appends a segment of root slots; shrinking keeps the capacity (the caller
    /// clears the entries beyond the end first, [`Index::clear_from`]). Callers serialize
    /// resizes of one index.
    pub fn resize(&self, block_count: u64) {
        let capacity = self.root.capacity();
        let needed = root_slots_for(block_count);
        if needed > capacity {
            let segment = Segment::new(capacity, needed - capacity);
            let appended = self.root.last().next.set(Box::new(segment)).is_ok();
            assert!(appended, "index resizes are serialized");
        }
        self.block_count.store(block_count, Ordering::Release);
    }

    /// Every allocated leaf that may hold blocks of `begin..end`, with its first block, in
    /// order. Skips unallocated subtrees whole.
    fn visit_leaves(&self, begin: u64, end: u64, visit: &mut dyn FnMut(u64, &Leaf)) {
        const SPAN1: u64 = 1 << DIGIT_BITS;
        const SPAN2: u64 = 1 << (2 * DIGIT_BITS);
        const SPAN3: u64 = 1 << (3 * DIGIT_BITS);
        const SPAN4: u64 = 1 << (4 * DIGIT_BITS);
        let overlaps = |first: u64, span: u64| first < end && first.saturating_add(span) > begin;
        for (base3, node3) in self.root.nodes() {
            if !overlaps(base3, SPAN4) {
                continue;
            }
            for (base2, node2) in node3.children(base3, SPAN3) {
                if !overlaps(base2, SPAN3) {
                    continue;
                }
                for (base1, node1) in node2.children(base2, SPAN2) {
                    if !overlaps(base1, SPAN2) {
                        continue;
                    }
                    for (first, leaf) in node1.children(base1, SPAN1) {
                        if overlaps(first, SPAN1) {
                            visit(first, leaf);
                        }
                    }
                }
            }
        }
    }

    /// Visit every mapping in `begin..end` in order.
    pub fn for_each_in(
        &self,
        begin: VirtualBlock,
        end: VirtualBlock,
        visit: &mut dyn FnMut(VirtualBlock, BlockTime),
    ) {
        let (begin, end) = (begin.get(), end.get().min(self.block_count()));
        self.visit_leaves(begin, end, &mut |first, leaf| {
            let from = begin.saturating_sub(first).min(SLOTS as u64) as usize;
            let to = (end - first.min(end)).min(SLOTS as u64) as usize;
            for (i, entry) in leaf.iter().enumerate().take(to).skip(from) {
                if let Some(mapping) = decode(entry.load(Ordering::Acquire)) {
                    visit(VirtualBlock::new(first + i as u64), mapping);
                }
            }
        });
    }

    /// Number of mapped blocks.
    pub fn mapped_count(&self) -> u64 {
        let mut count = 0;
        self.for_each_in(
            VirtualBlock::new(0),
            VirtualBlock::new(u64::MAX),
            &mut |_, _| count += 1,
        );
        count
    }

    #[cfg(test)]
    /// Leaves allocated (for the RAM formula).
    pub fn leaves_in_use(&self) -> usize {
        let mut leaves = 0;
        self.visit_leaves(0, u64::MAX, &mut |_, _| leaves += 1);
        leaves
    }

    #[cfg(test)]
    /// Nodes allocated (for the RAM formula).
    fn nodes_in_use(&self) -> usize {
        let mut nodes = 0;
        for (base3, node3) in self.root.nodes() {
            nodes += 1;
            for (base2, node2) in node3.children(base3, 0) {
                nodes += 1;
                nodes += node2.children(base2, 0).count();
            }
        }
        nodes
    }

    #[cfg(test)]
    /// RAM used by the index, per the module's formula.
    pub fn ram_bytes(&self) -> u64 {
        LEAF_BYTES * self.leaves_in_use() as u64
            + NODE_BYTES * self.nodes_in_use() as u64
            + 16 * self.root.capacity() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::DataBlock;

    #[test]
    fn set_lookup_clear_resize() {
        let b = VirtualBlock::new;
        let time = |t| Time::new(t).unwrap();
        let index = Index::new(2000);
        assert_eq!(index.lookup(b(5)), None);
        let e = BlockTime::new(DataBlock::new(0), time(0));
        index.set(b(5), e);
        let last = BlockTime::new(DataBlock::new(INDEX_DATA_BLOCK_MAX), Time::MAX);
        index.set(b(1999), last);
        assert_eq!(index.lookup(b(5)), Some(e));
        assert_eq!(index.lookup(b(1999)), Some(last));
        assert_eq!(index.lookup(b(5000)), None);
        assert_eq!(index.lookup(b(u64::MAX)), None);
        index.clear(b(5));
        assert_eq!(index.lookup(b(5)), None);
        index.resize(10_000);
        assert_eq!(index.lookup(b(1999)), Some(last));
        index.set(b(9999), e);
        let mut seen = vec![];
        index.for_each_in(b(0), b(10_000), &mut |block, _| seen.push(block.get()));
        assert_eq!(seen, vec![1999, 9999]);
        let mut seen = vec![];
        index.for_each_in(b(1999), b(9999), &mut |block, _| seen.push(block.get()));
        assert_eq!(seen, vec![1999]);
        index.clear_from(b(2000));
        assert_eq!(index.mapped_count(), 1);
    }

    /// The largest index costs a few KiB until written, and a few nodes per mapping; every
    /// walk skips what is not allocated (these would take hours over 2^44 blocks).
    #[test]
    fn the_largest_index_is_sparse() {
        let b = VirtualBlock::new;
        let e = BlockTime::new(DataBlock::new(7), Time::new(1).unwrap());
        let index = Index::new(INDEX_BLOCKS_MAX);
        assert_eq!(index.ram_bytes(), 16 * 256);
        let blocks = [0, 1 << 20, (1 << 36) + 5, INDEX_BLOCKS_MAX - 1];
        for block in blocks {
            index.set(b(block), e);
        }
        for block in blocks {
            assert_eq!(index.lookup(b(block)), Some(e));
            assert_eq!(index.lookup(b(block ^ 1)), None);
        }
        assert_eq!(index.mapped_count(), 4);
        assert_eq!(index.leaves_in_use(), 4);
        // Blocks 0 and 2^20 share their node3 and node2: 3 + 1 + 3 + 3 nodes.
        assert_eq!(index.ram_bytes(), 4 * 4096 + 10 * 8192 + 16 * 256);
        let mut seen = vec![];
        index.for_each_in(b(1), b(INDEX_BLOCKS_MAX - 1), &mut |block, _| {
            seen.push(block.get())
        });
        assert_eq!(seen, vec![1 << 20, (1 << 36) + 5]);
        index.clear_from(b(1 << 20));
        index.resize(1 << 20);
        assert_eq!(index.mapped_count(), 1);
        index.resize(INDEX_BLOCKS_MAX);
        assert_eq!(index.lookup(b(INDEX_BLOCKS_MAX - 1)), None);
    }
}
