//! The reference counts the checker recomputes while walking: one per metadata block and
//! one per data block, in arrays sized by the devices (never by the number of mappings).

use std::collections::HashMap;

/// Reference counts for every block of a device: one byte each, counts of 255 and more in
/// a map.
#[derive(Debug)]
pub(super) struct Counts {
    small: Vec<u8>,
    big: HashMap<u64, u32>,
}

impl Counts {
    pub(super) fn new(block_count: u64) -> Counts {
        Counts {
            small: vec![0; usize::try_from(block_count).expect("block count fits memory")],
            big: HashMap::new(),
        }
    }

    pub(super) fn len(&self) -> u64 {
        self.small.len() as u64
    }

    /// Add one reference to `block` (which must be below `len()`).
    pub(super) fn inc(&mut self, block: u64) {
        let slot = &mut self.small[block as usize];
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

    pub(super) fn get(&self, block: u64) -> u32 {
        match self.small[block as usize] {
            u8::MAX => self.big.get(&block).copied().unwrap_or(u32::from(u8::MAX)),
            small => u32::from(small),
        }
    }
}
