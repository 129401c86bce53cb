//! The reference counts the checker recomputes while walking: one per metadata block and
//! one per data block. Storage is bounded by what is present, never by a number read from
//! disk alone: a dense array (one byte a block) when the block count is plausible, else a
//! sparse map holding only the blocks a reference was found for (bounded by the mappings,
//! and so by the metadata device).

use std::collections::HashMap;

/// Largest block count given a dense array (one byte a block: 64 MiB).
pub(super) const DENSE_MAX: u64 = 1 << 26;

/// Reference counts for every block of a device: one byte each, counts of 255 and more in
/// a map.
#[derive(Debug)]
pub(super) struct Counts {
    /// Blocks counted (references at or beyond are the caller's to refuse).
    len: u64,
    small: Small,
    big: HashMap<u64, u32>,
}

#[derive(Debug)]
enum Small {
    Dense(Vec<u8>),
    Sparse(HashMap<u64, u8>),
}

/// A zeroed vector of `n` elements for a walk that will write to about `in_use` of them
/// (a count read from disk). When that is at least half, it is written through up front,
/// so that each page faults in once, for writing: a page read first maps the zero page,
/// and the write that follows faults again and, with the read-ahead thread running,
/// flushes the other CPU's TLB (by interrupt). Otherwise pages stay untouched until used,
/// so that a large, mostly empty device costs no memory for its empty part.
pub(super) fn zeroed<T: Copy + Default>(n: usize, in_use: u64) -> Vec<T> {
    if in_use.saturating_mul(2) >= n as u64 {
        let mut v = Vec::with_capacity(n);
        v.resize(n, T::default());
        v
    } else {
        vec![T::default(); n]
    }
}

impl Counts {
    /// Counts for `block_count` blocks: dense up to `dense_max` blocks, sparse beyond;
    /// about `in_use` of them will be counted (see [`zeroed`]).
    pub(super) fn new(block_count: u64, dense_max: u64, in_use: u64) -> Counts {
        let small = match usize::try_from(block_count) {
            Ok(n) if block_count <= dense_max => Small::Dense(zeroed(n, in_use)),
            _ => Small::Sparse(HashMap::new()),
        };
        Counts {
            len: block_count,
            small,
            big: HashMap::new(),
        }
    }

    pub(super) fn len(&self) -> u64 {
        self.len
    }

    /// Add one reference to `block` (ignored at or beyond `len()`: callers refuse those).
    #[inline]
    pub(super) fn inc(&mut self, block: u64) {
        // The walk's innermost step, once per mapping: a dense count below 254 (nothing to
        // record in the map) inline, everything else out of line.
        if let Small::Dense(v) = &mut self.small {
            if block < self.len {
                if let Some(slot) = v.get_mut(block as usize) {
                    if *slot < u8::MAX - 1 {
                        *slot += 1;
                        return;
                    }
                }
            }
        }
        self.inc_rest(block);
    }

    #[cold]
    #[inline(never)]
    fn inc_rest(&mut self, block: u64) {
        if block >= self.len {
            return;
        }
        let slot = match &mut self.small {
            Small::Dense(v) => match v.get_mut(block as usize) {
                Some(slot) => slot,
                None => return,
            },
            Small::Sparse(map) => map.entry(block).or_insert(0),
        };
        if *slot < u8::MAX {
            *slot += 1;
            if *slot == u8::MAX {
                self.big.insert(block, u32::from(u8::MAX));
            }
        } else {
            let count = self.big.entry(block).or_insert(u32::from(u8::MAX));
            *count = count.saturating_add(1);
        }
    }

    #[inline]
    pub(super) fn get(&self, block: u64) -> u32 {
        let small = match &self.small {
            Small::Dense(v) => v.get(block as usize).copied().unwrap_or(0),
            Small::Sparse(map) => map.get(&block).copied().unwrap_or(0),
        };
        match small {
            u8::MAX => self.big.get(&block).copied().unwrap_or(u32::from(u8::MAX)),
            small => u32::from(small),
        }
    }
}

impl Counts {
    /// The one-byte counts of blocks `block..block + n` when stored densely (a byte of 255
    /// means "look in the map": callers treat counts above 2 one by one).
    pub(super) fn dense(&self, block: u64, n: usize) -> Option<&[u8]> {
        let Small::Dense(v) = &self.small else {
            return None;
        };
        let start = usize::try_from(block).ok()?;
        v.get(start..start.checked_add(n)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_and_sparse_count_alike() {
        for dense_max in [0, 1 << 20] {
            let mut counts = Counts::new(1000, dense_max, 0);
            for _ in 0..300 {
                counts.inc(7);
            }
            counts.inc(999);
            counts.inc(1000);
            assert_eq!(counts.get(7), 300);
            assert_eq!(counts.get(999), 1);
            assert_eq!(counts.get(1000), 0);
            assert_eq!(counts.get(3), 0);
            if dense_max > 0 {
                assert_eq!(counts.dense(6, 2), Some(&[0, u8::MAX][..]));
                assert_eq!(counts.dense(999, 2), None);
            } else {
                assert_eq!(counts.dense(6, 2), None);
            }
        }
    }

    #[test]
    fn zeroed_vectors_are_zero_either_way() {
        for in_use in [0, 10, 1000] {
            assert_eq!(zeroed::<u8>(20, in_use), vec![0u8; 20]);
            assert_eq!(zeroed::<u32>(20, in_use), vec![0u32; 20]);
        }
        let mut counts = Counts::new(100, DENSE_MAX, 100);
        counts.inc(99);
        assert_eq!((counts.get(99), counts.get(98)), (1, 0));
    }

    #[test]
    fn a_huge_count_allocates_nothing_up_front() {
        let mut counts = Counts::new(u64::MAX, DENSE_MAX, u64::MAX);
        counts.inc(1 << 40);
        assert_eq!(counts.get(1 << 40), 1);
        assert_eq!(counts.len(), u64::MAX);
    }
}
