//! The in-core form of a space map: reference counts packed exactly as in the on-disk
//! bitmaps (2 bits an entry, spec §7.3), plus the real counts of entries that hold 3 or more.
//!
//! Both space maps (metadata and data) keep their whole bitmap contents in memory: 4 MiB per
//! 16 million blocks. This makes `count`, `inc`, `dec` and `alloc` O(1) (amortised for
//! `alloc`) with no I/O, and committing a bitmap is a copy. What changed since the last
//! commit is tracked per bitmap (`dirty`) and per overflow entry.
//!
//! Invariants (checked by `verify`):
//! - an entry's 2-bit field is `min(count, 3)`;
//! - `overflow` holds exactly the entries with count >= 3, with their count;
//! - `allocated_count` is the number of entries with count > 0;
//! - `used[i]` is the number of entries with count > 0 in bitmap `i`.
//!
//! Allocation rule (spec §8.1): a block is handed out only if its count is zero now and it
//! was not released during the current transaction, so a block freed in a transaction is
//! never reused before that transaction commits.

use std::collections::{BTreeMap, BTreeSet, HashSet};

/// Entries (blocks) one bitmap block covers: (4096 − 16) × 4.
pub const ENTRIES_PER_BITMAP: u64 = 16_320;
/// 64-bit words of entries in one bitmap block.
pub const WORDS_PER_BITMAP: usize = 510;
const ENTRIES_PER_WORD: u64 = 32;

/// Decode a stored 2-bit field into a count (bit 2j is the high bit, spec §7.3).
pub fn decode_field(field: u64) -> u32 {
    (((field & 1) << 1) | (field >> 1)) as u32
}

/// Encode a count of 0..=3 into the stored 2-bit field.
#[inline]
pub fn encode_field(count: u32) -> u64 {
    let c = u64::from(count.min(3));
    ((c & 1) << 1) | (c >> 1)
}

/// Reference counts for `block_count` blocks.
#[derive(Clone, Debug)]
pub struct CoreSpaceMap {
    block_count: u64,
    words: Vec<u64>,
    overflow: BTreeMap<u64, u32>,
    /// Bitmaps changed since the last commit.
    dirty: Vec<bool>,
    /// Entries in use per bitmap.
    used: Vec<u32>,
    /// Overflow keys whose entry changed (added, changed or removed) since the last commit.
    overflow_changed: BTreeSet<u64>,
    /// Blocks whose count fell to zero during this transaction.
    released: HashSet<u64>,
    allocated_count: u64,
    cursor: u64,
}

/// Number of bitmaps needed for `block_count` entries.
pub fn bitmap_count(block_count: u64) -> usize {
    usize::try_from(block_count.div_ceil(ENTRIES_PER_BITMAP)).expect("bitmap count fits")
}

impl CoreSpaceMap {
    /// A space map of `block_count` free blocks. Every bitmap starts dirty.
    pub fn new(block_count: u64) -> CoreSpaceMap {
        let bitmaps = bitmap_count(block_count);
        CoreSpaceMap {
            block_count,
            words: vec![0; bitmaps * WORDS_PER_BITMAP],
            overflow: BTreeMap::new(),
            dirty: vec![true; bitmaps],
            used: vec![0; bitmaps],
            overflow_changed: BTreeSet::new(),
            released: HashSet::new(),
            allocated_count: 0,
            cursor: 0,
        }
    }

    /// Number of blocks the map covers.
    pub fn block_count(&self) -> u64 {
        self.block_count
    }

    /// Blocks with a count above zero.
    pub fn allocated_count(&self) -> u64 {
        self.allocated_count
    }

    /// Blocks with a count of zero (some may not be allocatable until the next commit).
    pub fn free_count(&self) -> u64 {
        self.block_count - self.allocated_count
    }

    /// Number of bitmaps.
    pub fn bitmap_count(&self) -> usize {
        self.dirty.len()
    }

    fn field(&self, block: u64) -> u64 {
        let word = self.words[(block / ENTRIES_PER_WORD) as usize];
        (word >> ((block % ENTRIES_PER_WORD) * 2)) & 3
    }

    fn check_range(&self, block: u64) {
        assert!(
            block < self.block_count,
            "block {block} outside space map of {} blocks",
            self.block_count
        );
    }

    /// The reference count of `block`.
    pub fn count(&self, block: u64) -> u32 {
        self.check_range(block);
        match decode_field(self.field(block)) {
            3 => *self
                .overflow
                .get(&block)
                .expect("every entry marked 3 has an overflow count"),
            c => c,
        }
    }

    /// Set the count of `block`.
    pub fn set(&mut self, block: u64, count: u32) {
        let old = self.count(block);
        if old == count {
            return;
        }
        let word_index = (block / ENTRIES_PER_WORD) as usize;
        let shift = (block % ENTRIES_PER_WORD) * 2;
        let word = &mut self.words[word_index];
        *word = (*word & !(3u64 << shift)) | (encode_field(count) << shift);
        if old >= 3 || count >= 3 {
            if count >= 3 {
                self.overflow.insert(block, count);
            } else {
                self.overflow.remove(&block);
            }
            self.overflow_changed.insert(block);
        }
        let bitmap = (block / ENTRIES_PER_BITMAP) as usize;
        self.dirty[bitmap] = true;
        if old == 0 {
            self.allocated_count += 1;
            self.used[bitmap] += 1;
        } else if count == 0 {
            self.allocated_count -= 1;
            self.used[bitmap] -= 1;
            self.released.insert(block);
        }
    }

    /// Add one reference to `block`.
    pub fn inc(&mut self, block: u64) {
        let count = self.count(block);
        self.set(
            block,
            count.checked_add(1).expect("reference count overflow"),
        );
    }

    /// Drop one reference to `block`; `Err` with the block if its count is already zero.
    pub fn dec(&mut self, block: u64) -> Result<u32, u64> {
        let count = self.count(block);
        if count == 0 {
            return Err(block);
        }
        self.set(block, count - 1);
        Ok(count - 1)
    }

    /// Allocate a block: find one whose count is zero and that was not released in this
    /// transaction, give it a count of 1 and return it. `None` when there is none.
    ///
    /// The search starts at a cursor left after the previous allocation, so a run of
    /// allocations costs O(1) amortised; full bitmaps are skipped whole.
    pub fn alloc(&mut self) -> Option<u64> {
        if self.block_count == 0 {
            return None;
        }
        let start = self.cursor.min(self.block_count - 1);
        let found = self
            .search_free(start, self.block_count)
            .or_else(|| self.search_free(0, start))?;
        self.set(found, 1);
        self.cursor = found + 1;
        Some(found)
    }

    fn search_free(&self, begin: u64, end: u64) -> Option<u64> {
        let mut block = begin;
        while block < end {
            let bitmap = (block / ENTRIES_PER_BITMAP) as usize;
            let bitmap_end = ((bitmap as u64 + 1) * ENTRIES_PER_BITMAP).min(end);
            if u64::from(self.used[bitmap]) >= ENTRIES_PER_BITMAP {
                block = bitmap_end;
                continue;
            }
            while block < bitmap_end {
                let word_index = (block / ENTRIES_PER_WORD) as usize;
                let word = self.words[word_index];
                let first_in_word = block % ENTRIES_PER_WORD;
                // A set bit at 2j marks entry j as free: neither of its two bits is set.
                let mut free = !(word | (word >> 1)) & 0x5555_5555_5555_5555;
                free &= !0u64 << (first_in_word * 2);
                while free != 0 {
                    let entry = u64::from(free.trailing_zeros() / 2);
                    let candidate = block - first_in_word + entry;
                    if candidate >= bitmap_end {
                        break;
                    }
                    if !self.released.contains(&candidate) {
                        return Some(candidate);
                    }
                    free &= free - 1;
                }
                block = block - first_in_word + ENTRIES_PER_WORD;
            }
            block = block.max(bitmap_end);
        }
        None
    }

    /// Grow to `block_count` blocks (never shrinks). New bitmaps start dirty.
    pub fn extend(&mut self, block_count: u64) {
        assert!(block_count >= self.block_count, "space maps never shrink");
        let bitmaps = bitmap_count(block_count);
        self.words.resize(bitmaps * WORDS_PER_BITMAP, 0);
        let old_bitmaps = self.dirty.len();
        if old_bitmaps > 0 && self.block_count < block_count {
            // The last old bitmap gains entries (still zero, but its extent changed).
            self.dirty[old_bitmaps - 1] = true;
        }
        self.dirty.resize(bitmaps, true);
        self.used.resize(bitmaps, 0);
        self.block_count = block_count;
    }

    /// Forget the per-transaction state: called when a transaction commits.
    pub fn end_transaction(&mut self) {
        self.released.clear();
        self.overflow_changed.clear();
        self.dirty.fill(false);
    }

    /// Whether bitmap `index` changed since the last commit.
    pub fn is_dirty(&self, index: usize) -> bool {
        self.dirty[index]
    }

    /// Indexes of the bitmaps changed since the last commit.
    pub fn dirty_bitmaps(&self) -> Vec<usize> {
        (0..self.dirty.len()).filter(|&i| self.dirty[i]).collect()
    }

    /// Mark bitmap `index` written.
    pub fn mark_clean(&mut self, index: usize) {
        self.dirty[index] = false;
    }

    /// Take the overflow keys changed since the last call, with their current count (`None`
    /// means the entry no longer exists).
    pub fn take_overflow_changes(&mut self) -> Vec<(u64, Option<u32>)> {
        let keys = std::mem::take(&mut self.overflow_changed);
        keys.into_iter()
            .map(|k| (k, self.overflow.get(&k).copied()))
            .collect()
    }

    /// Whether overflow changes are waiting.
    pub fn has_overflow_changes(&self) -> bool {
        !self.overflow_changed.is_empty()
    }

    /// The entry words of bitmap `index`, as stored on disk.
    pub fn bitmap_words(&self, index: usize) -> &[u64] {
        &self.words[index * WORDS_PER_BITMAP..(index + 1) * WORDS_PER_BITMAP]
    }

    /// Free entries of bitmap `index` in the kernel's convention: 16 320 − used, also for
    /// the last, partial bitmap (spec §7.7).
    pub fn bitmap_free_count(&self, index: usize) -> u32 {
        ENTRIES_PER_BITMAP as u32 - self.used[index]
    }

    /// Index within bitmap `index` of its first free entry (16 320 if none).
    pub fn bitmap_first_free(&self, index: usize) -> u32 {
        let words = self.bitmap_words(index);
        for (w, &word) in words.iter().enumerate() {
            let free = !(word | (word >> 1)) & 0x5555_5555_5555_5555;
            if free != 0 {
                return (w as u32) * 32 + free.trailing_zeros() / 2;
            }
        }
        ENTRIES_PER_BITMAP as u32
    }

    /// Load bitmap `index` from its on-disk words, as committed state. The caller then loads
    /// the overflow counts with `load_overflow`.
    pub fn load_bitmap(&mut self, index: usize, words: &[u64]) {
        assert_eq!(words.len(), WORDS_PER_BITMAP);
        let first = index * WORDS_PER_BITMAP;
        self.words[first..first + WORDS_PER_BITMAP].copy_from_slice(words);
        let base = index as u64 * ENTRIES_PER_BITMAP;
        let mut used = 0u32;
        for (w, &word) in words.iter().enumerate() {
            let in_use = (word | (word >> 1)) & 0x5555_5555_5555_5555;
            let mut bits = in_use;
            // Entries beyond the map's end must be zero; callers validate that first.
            while bits != 0 {
                let entry = u64::from(bits.trailing_zeros() / 2);
                let block = base + w as u64 * ENTRIES_PER_WORD + entry;
                debug_assert!(block < self.block_count);
                used += 1;
                bits &= bits - 1;
            }
        }
        self.allocated_count -= u64::from(self.used[index]);
        self.used[index] = used;
        self.allocated_count += u64::from(used);
        self.dirty[index] = false;
    }

    /// Record the committed overflow count of `block`.
    pub fn load_overflow(&mut self, block: u64, count: u32) {
        self.overflow.insert(block, count);
    }

    /// Blocks whose field says 3 (count in the overflow tree) but have no overflow entry, or
    /// the reverse: the first mismatch found, for validating a loaded map.
    pub fn overflow_mismatch(&self) -> Option<(u64, String)> {
        for (&block, &count) in &self.overflow {
            if block >= self.block_count {
                return Some((
                    block,
                    format!("overflow count for block {block} beyond the map"),
                ));
            }
            if decode_field(self.field(block)) != 3 {
                return Some((
                    block,
                    format!("overflow count {count} for block {block} whose bitmap entry is not 3"),
                ));
            }
            if count < 3 {
                return Some((
                    block,
                    format!("overflow count {count} for block {block} is below 3"),
                ));
            }
        }
        for (w, &word) in self.words.iter().enumerate() {
            let three = word & (word >> 1) & 0x5555_5555_5555_5555;
            let mut bits = three;
            while bits != 0 {
                let block = w as u64 * ENTRIES_PER_WORD + u64::from(bits.trailing_zeros() / 2);
                if !self.overflow.contains_key(&block) {
                    return Some((
                        block,
                        format!("block {block} has bitmap entry 3 but no overflow count"),
                    ));
                }
                bits &= bits - 1;
            }
        }
        None
    }

    /// Check every invariant (expensive: for tests).
    pub fn verify(&self) {
        let mut allocated = 0u64;
        let mut used = vec![0u32; self.used.len()];
        for block in 0..self.block_count {
            let c = self.count(block);
            if c > 0 {
                allocated += 1;
                used[(block / ENTRIES_PER_BITMAP) as usize] += 1;
            }
        }
        assert_eq!(allocated, self.allocated_count, "allocated count");
        assert_eq!(used, self.used, "per-bitmap used counts");
        assert!(
            self.overflow_mismatch().is_none(),
            "{:?}",
            self.overflow_mismatch()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_encoding_matches_spec_bit_order() {
        // Spec §7.3: stored 2 = count 1, stored 1 = count 2.
        assert_eq!(decode_field(0), 0);
        assert_eq!(decode_field(2), 1);
        assert_eq!(decode_field(1), 2);
        assert_eq!(decode_field(3), 3);
        for c in 0..=3 {
            assert_eq!(decode_field(encode_field(c)), c);
        }
        let mut sm = CoreSpaceMap::new(64);
        sm.set(5, 1);
        sm.set(10, 7);
        assert_eq!(sm.bitmap_words(0)[0], 0x0000_0000_0030_0800);
    }

    #[test]
    fn freed_block_is_not_reused_before_commit() {
        let mut sm = CoreSpaceMap::new(4);
        let a = sm.alloc().unwrap();
        sm.dec(a).unwrap();
        let mut got = vec![];
        while let Some(b) = sm.alloc() {
            got.push(b);
        }
        assert_eq!(got.len(), 3);
        assert!(!got.contains(&a));
        sm.end_transaction();
        assert_eq!(sm.alloc(), Some(a));
    }

    #[test]
    fn alloc_spans_bitmaps_and_wraps() {
        let mut sm = CoreSpaceMap::new(ENTRIES_PER_BITMAP * 2 + 5);
        for b in 0..ENTRIES_PER_BITMAP * 2 + 5 {
            assert_eq!(sm.alloc(), Some(b));
        }
        assert_eq!(sm.alloc(), None);
        sm.dec(7).unwrap();
        sm.end_transaction();
        assert_eq!(sm.alloc(), Some(7));
        sm.verify();
    }
}
