//! Grace periods for data blocks: a data block freed while lock-free I/O may still hold a
//! lookup of it is not reused (nor discarded on the data device) until that I/O is done.
//!
//! Reads and in-place writes look a block up in the index and then `pread` / `pwrite` it
//! with no lock. A discard, a shrink or a broken sharing can unmap the block in between,
//! and the commit after it frees the data block; reused at once, the stale I/O would read
//! or overwrite another volume's data. So:
//!
//! ```text
//!   I/O path        pin ─ lookup ─ pread/pwrite ─ unpin          (two atomic adds, no lock)
//!   commit          blocks it freed → Limbo::pending              (held: not reservable)
//!   Limbo::poll     waiting drained? → release them (pass down, reservable again)
//!                   pending → waiting, advance the epoch
//! ```
//!
//! [`Readers`] counts pinned threads in cache-line-padded stripes (picked per thread), two
//! counters per stripe, one per epoch parity. A pin reads the epoch, counts itself under its
//! parity and checks that the epoch did not move meanwhile (else it retries); advancing the
//! epoch from `e` sends new pins to the other parity, so once the parity of `e` drains,
//! every thread pinned before the advance has left. Both sides use sequentially consistent
//! operations, so either the pin sees the new epoch or the advance's drain check sees the
//! pin, as in the write gate.
//!
//! A block enters `pending` after it was unmapped from every index (the unmap happened
//! before the commit that freed it, or, for a shrink, before the metadata lock was
//! released); the advance that moves it to `waiting` is made later, under the metadata
//! lock, so every pin taken after that advance looks the block up after the unmap and
//! cannot find it. The epoch advances again only after `waiting` was released, so at most
//! two epochs are ever in use and the two parities suffice.

use crate::ids::DataBlock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

const STRIPES: usize = 16;

#[repr(align(128))]
#[derive(Default)]
struct Stripe([AtomicUsize; 2]);

/// The pinned-thread counters and the epoch (see the module documentation).
#[derive(Default)]
pub(crate) struct Readers {
    epoch: AtomicU64,
    stripes: [Stripe; STRIPES],
}

impl std::fmt::Debug for Readers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Readers")
            .field("epoch", &self.epoch.load(Ordering::Relaxed))
            .finish()
    }
}

fn stripe_index() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
    }
    STRIPE.with(|s| *s)
}

/// A pinned thread: data blocks it looked up while pinned stay allocated to what they were
/// until it is dropped.
#[must_use]
pub(crate) struct Pin<'a> {
    counter: &'a AtomicUsize,
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        self.counter.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Readers {
    /// Pin the calling thread (lock-free; retries only if the epoch advances meanwhile).
    #[inline]
    pub(crate) fn pin(&self) -> Pin<'_> {
        let stripe = &self.stripes[stripe_index()];
        loop {
            let epoch = self.epoch.load(Ordering::SeqCst);
            let counter = &stripe.0[(epoch & 1) as usize];
            counter.fetch_add(1, Ordering::SeqCst);
            if self.epoch.load(Ordering::SeqCst) == epoch {
                return Pin { counter };
            }
            counter.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Advance the epoch; returns the epoch left, whose pins [`Readers::drained`] tracks.
    fn advance(&self) -> u64 {
        self.epoch.fetch_add(1, Ordering::SeqCst)
    }

    /// Whether every thread pinned at `epoch` has left (valid until the epoch advances
    /// twice more; [`Limbo`] advances only after this returned true).
    fn drained(&self, epoch: u64) -> bool {
        let parity = (epoch & 1) as usize;
        self.stripes
            .iter()
            .all(|s| s.0[parity].load(Ordering::SeqCst) == 0)
    }
}

/// A data block held back from reuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Held {
    pub(crate) block: DataBlock,
    /// Discard it on the data device when released (a discard freed it).
    pub(crate) pass_down: bool,
}

/// Data blocks freed by commits, held back until no pinned I/O can reach them (guarded by
/// the metadata mutex).
#[derive(Debug, Default)]
pub(crate) struct Limbo {
    /// Freed since the last advance.
    pending: Vec<Held>,
    /// Freed before the advance from `waiting_epoch`: released once it drained.
    waiting: Vec<Held>,
    waiting_epoch: u64,
}

impl Limbo {
    /// Hold `blocks`, unmapped from every index already.
    pub(crate) fn add(&mut self, blocks: impl IntoIterator<Item = Held>) {
        self.pending.extend(blocks);
    }

    /// Whether nothing is held.
    pub(crate) fn is_empty(&self) -> bool {
        self.pending.is_empty() && self.waiting.is_empty()
    }

    /// Every block held (to hold them again in reopened metadata).
    pub(crate) fn blocks(&self) -> impl Iterator<Item = DataBlock> + '_ {
        self.waiting
            .iter()
            .chain(self.pending.iter())
            .map(|held| held.block)
    }

    /// Without waiting: return the blocks no pinned thread can reach any more, and start
    /// a grace period for those freed since the last one.
    pub(crate) fn poll(&mut self, readers: &Readers) -> Vec<Held> {
        let mut released = Vec::new();
        if !self.waiting.is_empty() {
            if !readers.drained(self.waiting_epoch) {
                return released;
            }
            released = std::mem::take(&mut self.waiting);
        }
        if !self.pending.is_empty() {
            self.waiting_epoch = readers.advance();
            self.waiting = std::mem::take(&mut self.pending);
        }
        released
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    fn held(block: u64) -> Held {
        Held {
            block: DataBlock::new(block),
            pass_down: false,
        }
    }

    #[test]
    fn a_block_is_released_only_after_the_pins_before_its_grace_period_leave() {
        let readers = Readers::default();
        let mut limbo = Limbo::default();
        let early = readers.pin();
        limbo.add([held(1)]);
        assert!(limbo.poll(&readers).is_empty(), "starts the grace period");
        let late = readers.pin();
        assert!(
            limbo.poll(&readers).is_empty(),
            "a pin from before is alive"
        );
        limbo.add([held(2)]);
        assert!(limbo.poll(&readers).is_empty());
        drop(early);
        assert_eq!(limbo.poll(&readers), vec![held(1)]);
        // Block 2's grace period started with `late` pinned.
        assert!(limbo.poll(&readers).is_empty());
        drop(late);
        assert_eq!(limbo.poll(&readers), vec![held(2)]);
        assert!(limbo.is_empty());
    }

    #[test]
    fn no_pin_taken_before_a_release_outlives_it() {
        // Pinned threads record the highest release they saw at pin time; each release
        // checks that nobody pinned before it is still inside.
        let readers = Arc::new(Readers::default());
        let stop = Arc::new(AtomicBool::new(false));
        let inside: Arc<[AtomicU64; 4]> = Arc::new(Default::default());
        let released = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let (readers, stop, inside, released) = (
                    readers.clone(),
                    stop.clone(),
                    inside.clone(),
                    released.clone(),
                );
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let _pin = readers.pin();
                        // Seen at pin time + 1 (0: outside).
                        inside[t].store(released.load(Ordering::SeqCst) + 1, Ordering::SeqCst);
                        std::hint::spin_loop();
                        inside[t].store(0, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        let mut limbo = Limbo::default();
        let mut next = 0u64;
        let mut releases = 0;
        while releases < 2000 {
            limbo.add([held(next)]);
            // The block's "unmap" is the counter value `next`: pins from before it see
            // a smaller value.
            released.store(next, Ordering::SeqCst);
            next += 1;
            for h in limbo.poll(&readers) {
                releases += 1;
                for slot in inside.iter() {
                    let seen = slot.load(Ordering::SeqCst);
                    assert!(
                        seen == 0 || seen > h.block.get(),
                        "block {} released while a thread pinned before its free is inside",
                        h.block.get()
                    );
                }
            }
            std::thread::yield_now();
        }
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            t.join().unwrap();
        }
    }
}
