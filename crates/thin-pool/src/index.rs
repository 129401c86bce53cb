//! The in-memory mapping index: what the read path consults instead of the btree.
//!
//! One index per volume: a table of leaves, each 512 `AtomicU64` entries covering 512
//! consecutive virtual blocks, allocated the first time one of its blocks is mapped. An
//! entry is 0 for "unmapped", else `(data_block + 1) << 24 | time` (the btree's block_time
//! with the data block biased by one). A lookup is an atomic load of the published table
//! (arc-swap, lock-free) and one atomic load of the entry: no lock, no allocation.
//!
//! Writers (the engine, under its per-block provisioning order) store entries with release
//! ordering; growing the volume publishes a new table sharing the old leaves.
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

use arc_swap::ArcSwap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// Virtual blocks per leaf.
pub const LEAF_ENTRIES: usize = 512;
const TIME_BITS: u32 = 24;
const TIME_MASK: u64 = (1 << TIME_BITS) - 1;
/// The largest data block the index can hold.
pub const INDEX_DATA_BLOCK_MAX: u64 = (1 << 40) - 2;

type Leaf = [AtomicU64; LEAF_ENTRIES];

#[derive(Debug)]
struct Table {
    leaves: Vec<OnceLock<Arc<Leaf>>>,
    block_count: u64,
}

/// A mapping as the index holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexEntry {
    /// Data block.
    pub data_block: u64,
    /// Pool time when mapped.
    pub time: u32,
}

fn encode(entry: IndexEntry) -> u64 {
    assert!(
        entry.data_block <= INDEX_DATA_BLOCK_MAX,
        "data block beyond the index's range"
    );
    ((entry.data_block + 1) << TIME_BITS) | (u64::from(entry.time) & TIME_MASK)
}

fn decode(raw: u64) -> Option<IndexEntry> {
    (raw != 0).then(|| IndexEntry {
        data_block: (raw >> TIME_BITS) - 1,
        time: (raw & TIME_MASK) as u32,
    })
}

fn new_leaf() -> Arc<Leaf> {
    Arc::new(std::array::from_fn(|_| AtomicU64::new(0)))
}

/// A volume's mapping index.
#[derive(Debug)]
pub struct Index {
    table: ArcSwap<Table>,
}

impl Index {
    /// An empty index for a volume of `block_count` virtual blocks.
    pub fn new(block_count: u64) -> Index {
        let leaves = block_count.div_ceil(LEAF_ENTRIES as u64) as usize;
        Index {
            table: ArcSwap::from_pointee(Table {
                leaves: (0..leaves).map(|_| OnceLock::new()).collect(),
                block_count,
            }),
        }
    }

    /// Virtual blocks covered.
    pub fn block_count(&self) -> u64 {
        self.table.load().block_count
    }

    /// The mapping of `block`, if any. Lock-free.
    #[inline]
    pub fn lookup(&self, block: u64) -> Option<IndexEntry> {
        let table = self.table.load();
        let leaf = table
            .leaves
            .get((block / LEAF_ENTRIES as u64) as usize)?
            .get()?;
        decode(leaf[(block % LEAF_ENTRIES as u64) as usize].load(Ordering::Acquire))
    }

    /// Record a mapping. `block` must be inside the volume.
    pub fn set(&self, block: u64, entry: IndexEntry) {
        let table = self.table.load();
        let slot = table
            .leaves
            .get((block / LEAF_ENTRIES as u64) as usize)
            .expect("index set inside the volume");
        let leaf = slot.get_or_init(new_leaf);
        leaf[(block % LEAF_ENTRIES as u64) as usize].store(encode(entry), Ordering::Release);
    }

    /// Forget a mapping.
    pub fn clear(&self, block: u64) {
        let table = self.table.load();
        if let Some(leaf) = table
            .leaves
            .get((block / LEAF_ENTRIES as u64) as usize)
            .and_then(|s| s.get())
        {
            leaf[(block % LEAF_ENTRIES as u64) as usize].store(0, Ordering::Release);
        }
    }

    /// Resize to `block_count` virtual blocks. Growing shares the existing leaves; shrinking
    /// drops the entries beyond the end (the caller unmaps them first).
    pub fn resize(&self, block_count: u64) {
        let old = self.table.load();
        let leaves_needed = block_count.div_ceil(LEAF_ENTRIES as u64) as usize;
        let leaves = (0..leaves_needed)
            .map(|i| {
                let slot = OnceLock::new();
                if let Some(leaf) = old.leaves.get(i).and_then(|s| s.get()) {
                    let _ = slot.set(leaf.clone());
                }
                slot
            })
            .collect();
        self.table.store(Arc::new(Table {
            leaves,
            block_count,
        }));
    }

    /// A deep copy (for a snapshot's own index).
    pub fn duplicate(&self) -> Index {
        let table = self.table.load();
        let leaves = table
            .leaves
            .iter()
            .map(|slot| {
                let copy = OnceLock::new();
                if let Some(leaf) = slot.get() {
                    let new = new_leaf();
                    for (dst, src) in new.iter().zip(leaf.iter()) {
                        dst.store(src.load(Ordering::Acquire), Ordering::Relaxed);
                    }
                    let _ = copy.set(new);
                }
                copy
            })
            .collect();
        Index {
            table: ArcSwap::from_pointee(Table {
                leaves,
                block_count: table.block_count,
            }),
        }
    }

    /// Visit every mapping in `begin..end` in order.
    pub fn for_each_in(&self, begin: u64, end: u64, visit: &mut dyn FnMut(u64, IndexEntry)) {
        let table = self.table.load();
        let end = end.min(table.block_count);
        let mut block = begin;
        while block < end {
            let leaf_index = (block / LEAF_ENTRIES as u64) as usize;
            let leaf_end = ((leaf_index as u64 + 1) * LEAF_ENTRIES as u64).min(end);
            if let Some(leaf) = table.leaves.get(leaf_index).and_then(|s| s.get()) {
                for b in block..leaf_end {
                    if let Some(entry) =
                        decode(leaf[(b % LEAF_ENTRIES as u64) as usize].load(Ordering::Acquire))
                    {
                        visit(b, entry);
                    }
                }
            }
            block = leaf_end;
        }
    }

    /// Leaves allocated (for the RAM formula).
    pub fn leaves_in_use(&self) -> usize {
        self.table
            .load()
            .leaves
            .iter()
            .filter(|s| s.get().is_some())
            .count()
    }

    /// RAM used by the index, per the module's formula.
    pub fn ram_bytes(&self) -> u64 {
        let table = self.table.load();
        4112 * self.leaves_in_use() as u64 + 16 * table.leaves.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_lookup_clear_resize() {
        let index = Index::new(2000);
        assert_eq!(index.lookup(5), None);
        let e = IndexEntry {
            data_block: 0,
            time: 0,
        };
        index.set(5, e);
        index.set(
            1999,
            IndexEntry {
                data_block: INDEX_DATA_BLOCK_MAX,
                time: 0xFF_FFFF,
            },
        );
        assert_eq!(index.lookup(5), Some(e));
        assert_eq!(index.lookup(1999).unwrap().data_block, INDEX_DATA_BLOCK_MAX);
        assert_eq!(index.lookup(5000), None);
        let copy = index.duplicate();
        index.clear(5);
        assert_eq!(index.lookup(5), None);
        assert_eq!(copy.lookup(5), Some(e));
        index.resize(10_000);
        assert_eq!(index.lookup(1999).unwrap().time, 0xFF_FFFF);
        index.set(9999, e);
        let mut seen = vec![];
        index.for_each_in(0, 10_000, &mut |b, _| seen.push(b));
        assert_eq!(seen, vec![1999, 9999]);
    }
}
