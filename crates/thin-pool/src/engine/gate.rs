//! A write gate: lets any number of writers through without a shared lock, and lets one
//! pauser (snapshot creation) stop new writers and wait for the ones inside to leave.
//!
//! Writers count themselves in one of several cache-line-padded counters picked by thread,
//! so concurrent writers on different cores touch different cache lines. A writer enters by
//! incrementing its counter and then checking the `paused` flag; a pauser sets the flag and
//! then waits for every counter to reach zero. Both use sequentially consistent ordering,
//! so either the writer sees the flag (and backs out) or the pauser sees the writer's count
//! (and waits for it): they cannot miss each other. Only paused writers and the pauser touch
//! the mutex.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

const SHARDS: usize = 16;

#[repr(align(128))]
#[derive(Default)]
struct Shard(AtomicUsize);

/// See the module documentation.
pub struct WriteGate {
    shards: [Shard; SHARDS],
    paused: AtomicBool,
    lock: Mutex<()>,
    changed: Condvar,
}

impl std::fmt::Debug for WriteGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteGate")
            .field("paused", &self.paused.load(Ordering::Relaxed))
            .finish()
    }
}

impl Default for WriteGate {
    fn default() -> WriteGate {
        WriteGate {
            shards: Default::default(),
            paused: AtomicBool::new(false),
            lock: Mutex::new(()),
            changed: Condvar::new(),
        }
    }
}

fn shard_index() -> usize {
    thread_local! {
        static SHARD: usize = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            std::thread::current().id().hash(&mut h);
            (h.finish() as usize) % SHARDS
        };
    }
    SHARD.with(|s| *s)
}

/// Proof of being inside the gate; leaving happens on drop.
pub struct Pass<'a> {
    gate: &'a WriteGate,
    shard: usize,
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        let before = self.gate.shards[self.shard]
            .0
            .fetch_sub(1, Ordering::SeqCst);
        debug_assert!(before > 0);
        if self.gate.paused.load(Ordering::SeqCst) {
            let _guard = self.gate.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.gate.changed.notify_all();
        }
    }
}

/// Holding this keeps writers out; resuming happens on drop.
pub struct Pause<'a> {
    gate: &'a WriteGate,
}

impl Drop for Pause<'_> {
    fn drop(&mut self) {
        let _guard = self.gate.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.gate.paused.store(false, Ordering::SeqCst);
        self.gate.changed.notify_all();
    }
}

impl WriteGate {
    /// Enter as a writer (waits only while paused).
    pub fn enter(&self) -> Pass<'_> {
        let shard = shard_index();
        loop {
            self.shards[shard].0.fetch_add(1, Ordering::SeqCst);
            if !self.paused.load(Ordering::SeqCst) {
                return Pass { gate: self, shard };
            }
            // Back out and wait for the pause to end.
            self.shards[shard].0.fetch_sub(1, Ordering::SeqCst);
            let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.changed.notify_all();
            while self.paused.load(Ordering::SeqCst) {
                guard = self.changed.wait(guard).unwrap_or_else(|e| e.into_inner());
            }
        }
    }

    /// Whether a pauser has stopped new writers (and waits for those inside to leave).
    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }

    /// Stop new writers and wait until none is inside. One pauser at a time (callers
    /// serialize pauses of a volume themselves).
    pub fn pause(&self) -> Pause<'_> {
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        while self.paused.load(Ordering::SeqCst) {
            guard = self.changed.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
        self.paused.store(true, Ordering::SeqCst);
        while self.shards.iter().any(|s| s.0.load(Ordering::SeqCst) > 0) {
            guard = self
                .changed
                .wait_timeout(guard, Duration::from_millis(1))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(guard);
        Pause { gate: self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    #[test]
    fn pause_waits_for_writers_and_blocks_new_ones() {
        let gate = Arc::new(WriteGate::default());
        let inside = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = (0..4)
            .map(|_| {
                let (gate, inside, stop) = (gate.clone(), inside.clone(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let _pass = gate.enter();
                        inside.fetch_add(1, Ordering::SeqCst);
                        std::hint::spin_loop();
                        inside.fetch_sub(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for _ in 0..200 {
            let _pause = gate.pause();
            assert_eq!(
                inside.load(Ordering::SeqCst),
                0,
                "a writer is inside a pause"
            );
        }
        stop.store(true, Ordering::Relaxed);
        for w in writers {
            w.join().unwrap();
        }
    }
}
