//! The in-memory mapping index: what the read path consults instead of the btree.
//!
//! One index per volume: a table of leaves, each 512 `AtomicU64` entries covering 512
//! consecutive virtual blocks, allocated the first time one of its blocks is mapped. An
//! entry is 0 for "unmapped", else the mapping's packed [`BlockTime`] with the data block
//! biased by one (so no mapping packs to 0). A lookup reads the leaf's slot (a `OnceLock`, set
//! once) and one atomic entry: no lock, no reference counting, no allocation.
//!
//! Writers (the engine, under its per-block provisioning order) store entries with release
//! ordering; growing the volume appends a segment of slots, never moving the old ones.
//!
//! RAM: 8 bytes per virtual block of every 512-block region holding at least one mapping,
//! plus 16 bytes per 512 virtual blocks of volume size (the table slot) and 16 bytes per
//! leaf (its Arc header):
//!
//! ```text
//!   bytes = 4112 × leaves_in_use + 16 × ⌈virtual_blocks / 512⌉
//! ```
//!
//! so a fully provisioned volume costs 8.06 bytes per mapped block (≤ 16 whenever at least
//! half of each touched region is mapped); an isolated mapping costs at most 4 KiB.

use crate::ids::{BlockTime, Time, VirtualBlock, DATA_BLOCK_MAX};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// Virtual blocks per leaf.
pub const LEAF_ENTRIES: usize = 512;
/// The largest data block the index can hold (one less than the format's: the bias).
pub const INDEX_DATA_BLOCK_MAX: u64 = DATA_BLOCK_MAX - 1;

type Leaf = [AtomicU64; LEAF_ENTRIES];

/// A run of leaf slots. A volume's first segment covers its size at creation; growing it
/// appends a segment for the new blocks (set once, never replaced), so a lookup reads no
/// shared pointer that can change under it: no lock, no reference counting.
#[derive(Debug)]
struct Segment {
    /// First leaf this segment holds.
    first_leaf: usize,
    leaves: Box<[OnceLock<Arc<Leaf>>]>,
    next: OnceLock<Box<Segment>>,
}

impl Segment {
    fn new(first_leaf: usize, leaf_count: usize) -> Segment {
        Segment {
            first_leaf,
            leaves: (0..leaf_count).map(|_| OnceLock::new()).collect(),
            next: OnceLock::new(),
        }
    }

    #[inline]
    fn slot(&self, leaf: usize) -> Option<&OnceLock<Arc<Leaf>>> {
        let mut segment = self;
        loop {
            if let Some(slot) = segment.leaves.get(leaf - segment.first_leaf) {
                return Some(slot);
            }
            segment = segment.next.get()?;
        }
    }

    fn capacity_leaves(&self) -> usize {
        let mut segment = self;
        loop {
            match segment.next.get() {
                Some(next) => segment = next,
                None => return segment.first_leaf + segment.leaves.len(),
            }
        }
    }

    fn last(&self) -> &Segment {
        let mut segment = self;
        while let Some(next) = segment.next.get() {
            segment = next;
        }
        segment
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

/// Leaf holding `block`, and the entry's position in it.
fn position(block: VirtualBlock) -> (usize, usize) {
    let block = block.get();
    (
        (block / LEAF_ENTRIES as u64) as usize,
        (block % LEAF_ENTRIES as u64) as usize,
    )
}

fn new_leaf() -> Arc<Leaf> {
    Arc::new(std::array::from_fn(|_| AtomicU64::new(0)))
}

fn leaves_for(block_count: u64) -> usize {
    block_count.div_ceil(LEAF_ENTRIES as u64) as usize
}

/// A volume's mapping index.
#[derive(Debug)]
pub struct Index {
    first: Segment,
    block_count: AtomicU64,
}

impl Index {
    /// An empty index for a volume of `block_count` virtual blocks.
    pub fn new(block_count: u64) -> Index {
        Index {
            first: Segment::new(0, leaves_for(block_count)),
            block_count: AtomicU64::new(block_count),
        }
    }

    /// Virtual blocks covered.
    pub fn block_count(&self) -> u64 {
        self.block_count.load(Ordering::Acquire)
    }

    /// The mapping of `block`, if any. Lock-free.
    #[inline]
    pub fn lookup(&self, block: VirtualBlock) -> Option<BlockTime> {
        let (leaf, entry) = position(block);
        let leaf = self.first.slot(leaf)?.get()?;
        decode(leaf[entry].load(Ordering::Acquire))
    }

    /// Publish a mapping (release ordering: a reader that sees it sees the data written
    /// before). `block` must be inside the volume.
    pub fn set(&self, block: VirtualBlock, mapping: BlockTime) {
        assert!(
            block.get() < self.block_count(),
            "index set of block {block} beyond the volume's {} blocks",
            self.block_count()
        );
        let (leaf, entry) = position(block);
        let slot = self
            .first
            .slot(leaf)
            .expect("a block inside the volume has a leaf slot");
        slot.get_or_init(new_leaf)[entry].store(encode(mapping), Ordering::Release);
    }

    /// Forget a mapping.
    pub fn clear(&self, block: VirtualBlock) {
        let (leaf, entry) = position(block);
        if let Some(leaf) = self.first.slot(leaf).and_then(|s| s.get()) {
            leaf[entry].store(0, Ordering::Release);
        }
    }

    /// Resize to `block_count` virtual blocks. Growing beyond the capacity appends a
    /// segment; shrinking keeps the capacity (the caller clears the entries beyond the end
    /// first). Callers serialize resizes of one index.
    pub fn resize(&self, block_count: u64) {
        let capacity = self.first.capacity_leaves();
        let needed = leaves_for(block_count);
        if needed > capacity {
            let segment = Segment::new(capacity, needed - capacity);
            let appended = self.first.last().next.set(Box::new(segment)).is_ok();
            assert!(appended, "index resizes are serialized");
        }
        self.block_count.store(block_count, Ordering::Release);
    }

    /// A deep copy (for a snapshot's own index).
    pub fn duplicate(&self) -> Index {
        let block_count = self.block_count();
        let copy = Index::new(block_count);
        for (i, slot) in copy.first.leaves.iter().enumerate() {
            if let Some(leaf) = self.first.slot(i).and_then(|s| s.get()) {
                let new = new_leaf();
                for (dst, src) in new.iter().zip(leaf.iter()) {
                    dst.store(src.load(Ordering::Acquire), Ordering::Relaxed);
                }
                let _ = slot.set(new);
            }
        }
        copy
    }

    /// Visit every mapping in `begin..end` in order.
    pub fn for_each_in(
        &self,
        begin: VirtualBlock,
        end: VirtualBlock,
        visit: &mut dyn FnMut(VirtualBlock, BlockTime),
    ) {
        let end = end.get().min(self.block_count());
        let mut block = begin.get();
        while block < end {
            let leaf_index = (block / LEAF_ENTRIES as u64) as usize;
            let leaf_end = ((leaf_index as u64 + 1) * LEAF_ENTRIES as u64).min(end);
            if let Some(leaf) = self.first.slot(leaf_index).and_then(|s| s.get()) {
                for b in block..leaf_end {
                    let raw = leaf[(b % LEAF_ENTRIES as u64) as usize].load(Ordering::Acquire);
                    if let Some(mapping) = decode(raw) {
                        visit(VirtualBlock::new(b), mapping);
                    }
                }
            }
            block = leaf_end;
        }
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

    /// Leaves allocated (for the RAM formula).
    pub fn leaves_in_use(&self) -> usize {
        (0..self.first.capacity_leaves())
            .filter(|&i| self.first.slot(i).is_some_and(|s| s.get().is_some()))
            .count()
    }

    /// RAM used by the index, per the module's formula.
    pub fn ram_bytes(&self) -> u64 {
        4112 * self.leaves_in_use() as u64 + 16 * self.first.capacity_leaves() as u64
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
        let copy = index.duplicate();
        index.clear(b(5));
        assert_eq!(index.lookup(b(5)), None);
        assert_eq!(copy.lookup(b(5)), Some(e));
        index.resize(10_000);
        assert_eq!(index.lookup(b(1999)), Some(last));
        index.set(b(9999), e);
        let mut seen = vec![];
        index.for_each_in(b(0), b(10_000), &mut |block, _| seen.push(block.get()));
        assert_eq!(seen, vec![1999, 9999]);
    }
}
