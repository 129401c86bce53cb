//! How far a long operation (trim, the check before an import) has come: two counters the
//! operation stores into and another thread (the binary's progress bar) reads.
//!
//! The engine only stores relaxed atomics, once per chunk of work (trim: once per chunk of
//! `TRIM_CHUNK_BLOCKS` data blocks), so the hook costs nothing measurable on the paths it
//! sits on; it knows nothing of terminals (the binary draws, with indicatif). `done` never
//! passes `total`; a reader may see the two from different updates (a bar only).

use std::sync::atomic::{AtomicU64, Ordering};

/// Units done out of a total, for one operation at a time.
#[derive(Debug, Default)]
pub struct Progress {
    done: AtomicU64,
    total: AtomicU64,
}

impl Progress {
    /// Nothing done, no total known.
    pub fn new() -> Progress {
        Progress::default()
    }

    /// Sets the units done and the total (which may change as the operation learns more,
    /// e.g. a pool grown during a trim).
    pub fn set(&self, done: u64, total: u64) {
        assert!(done <= total, "progress {done} past its total {total}");
        self.total.store(total, Ordering::Relaxed);
        self.done.store(done, Ordering::Relaxed);
    }

    /// Units done so far.
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// Units to do (0: not known yet).
    pub fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_holds_what_was_set_last() {
        let progress = Progress::new();
        assert_eq!((progress.done(), progress.total()), (0, 0));
        progress.set(4, 10);
        assert_eq!((progress.done(), progress.total()), (4, 10));
        progress.set(12, 20);
        assert_eq!((progress.done(), progress.total()), (12, 20));
    }

    #[test]
    #[should_panic(expected = "past its total")]
    fn progress_past_its_total_is_a_bug() {
        let progress = Progress::new();
        progress.set(3, 2);
    }
}
