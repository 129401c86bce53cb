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
//!
//! A writer inside that must wait for something a pause may outlast (a write queued for data
//! space) sits the pause out ([`Pass::sit_out_pause`]): it leaves its counter, so the pauser
//! goes ahead, waits for the pause to end and enters again, holding the same pass. It must
//! hold no lock a writer inside may wait for while it is out (the caller drops its block
//! locks first), and must look again at what it read before: the pauser may have changed it
//! (a snapshot makes the volume's mappings shared).

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

impl Pass<'_> {
    /// If a pauser is stopping the writers, leave the gate, wait until the pause is over
    /// and enter again (see the module documentation); otherwise return at once. Whether it
    /// sat a pause out.
    pub fn sit_out_pause(&self) -> bool {
        let gate = self.gate;
        if !gate.is_paused() {
            return false;
        }
        let before = gate.shards[self.shard].0.fetch_sub(1, Ordering::SeqCst);
        debug_assert!(before > 0, "a pass is inside the gate");
        gate.wait_out_pause();
        gate.enter_shard(self.shard);
        true
    }
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
        self.enter_shard(shard);
        Pass { gate: self, shard }
    }

    /// Count a writer in `shard`, waiting while paused.
    fn enter_shard(&self, shard: usize) {
        loop {
            self.shards[shard].0.fetch_add(1, Ordering::SeqCst);
            if !self.paused.load(Ordering::SeqCst) {
                return;
            }
            // Back out and wait for the pause to end.
            self.shards[shard].0.fetch_sub(1, Ordering::SeqCst);
            self.wait_out_pause();
        }
    }

    /// Tell the pauser a writer left, and wait until no pause is on (a writer out of the
    /// gate).
    fn wait_out_pause(&self) {
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.changed.notify_all();
        while self.paused.load(Ordering::SeqCst) {
            guard = self.changed.wait(guard).unwrap_or_else(|e| e.into_inner());
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
    fn a_writer_sitting_a_pause_out_lets_it_proceed_and_is_inside_after() {
        let gate = Arc::new(WriteGate::default());
        let pass = gate.enter();
        assert!(!pass.sit_out_pause(), "no pause: nothing to sit out");
        let paused = Arc::new(AtomicBool::new(false));
        let pauser = {
            let (gate, paused) = (gate.clone(), paused.clone());
            std::thread::spawn(move || {
                let _pause = gate.pause();
                paused.store(true, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(20));
            })
        };
        while !gate.is_paused() {
            std::thread::yield_now();
        }
        // Without sitting out, the pauser would wait for this pass forever.
        assert!(pass.sit_out_pause());
        assert!(
            paused.load(Ordering::SeqCst),
            "the pause ran while the writer was out"
        );
        assert!(
            !gate.is_paused(),
            "the writer is back only once the pause ended"
        );
        pauser.join().unwrap();
        // Inside again: a new pause waits for this pass.
        let second = {
            let gate = gate.clone();
            std::thread::spawn(move || drop(gate.pause()))
        };
        while !gate.is_paused() {
            std::thread::yield_now();
        }
        assert!(!second.is_finished());
        drop(pass);
        second.join().unwrap();
    }

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
