//! Space alerts: the low-water marks of the data and the metadata, and the requests for
//! growth that the autoextend worker (`autoextend`) answers.
//!
//! ```text
//!   reservation (metadata lock held)   used ≥ low water?  → warn once per crossing
//!                                      used ≥ threshold?  → request a growth (one atomic swap)
//!   commit (metadata lock held)        data and metadata low water set or cleared;
//!                                      metadata ≥ threshold → request a growth
//!                                      (even while the data cannot grow)
//!   alloc out of space                 growth possible → wait for it (any policy);
//!                                      not possible (`exhausted`) → the no-space policy
//! ```
//!
//! [`SpaceWatch`] holds only what those callers and the worker share: flags, the wake-up
//! of the worker and the host directory. It knows neither the metadata nor the worker; it
//! logs through [`Health`]. The write path pays arithmetic on the usage it already read
//! under the metadata lock and, above the threshold, one atomic swap.

use crate::engine::health::Health;
use crate::engine::options::{Autoextend, PoolOptions};
use crate::format::metadata::Usage;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// Bytes an unprivileged writer may still allocate on the file system holding `path` (or its
/// nearest existing ancestor), if the file system says.
pub fn host_free_bytes(path: &Path) -> Option<u64> {
    let existing = path.ancestors().find(|p| p.exists())?;
    let stat = rustix::fs::statvfs(existing).ok()?;
    Some(stat.f_bavail.saturating_mul(stat.f_frsize))
}

/// Low-water state and the growth requests.
pub(crate) struct SpaceWatch {
    autoextend: Option<Autoextend>,
    low_water_percent: u32,
    low_water_mark_blocks: u64,
    health: Arc<Health>,
    /// Data use is at or above the low-water mark.
    data_low_water: AtomicBool,
    /// Metadata use is at or above the low-water mark.
    metadata_low_water: AtomicBool,
    /// A growth was asked for and the worker has not looked yet.
    requested: AtomicBool,
    /// The pool cannot grow now: writes follow the no-space policy.
    exhausted: AtomicBool,
    /// The last metadata growth failed (said once until one succeeds).
    metadata_blocked: AtomicBool,
    /// A write found no data block (whatever the usage says: free blocks may all be in
    /// their grace period): grow even below the threshold.
    starved: AtomicBool,
    /// Bytes of freed data blocks given back to the data device (passdown and trim), each
    /// block counted once per free.
    passed_down_bytes: AtomicU64,
    /// The data blocks given back since they were last freed (one bit each): a trim
    /// discards every free block again but counts only those not given back yet.
    given_back: Mutex<Vec<u64>>,
    /// The directory whose file system holds the pool's files (for its free space).
    host_dir: OnceLock<PathBuf>,
    state: Mutex<WatchState>,
    wake: Condvar,
}

#[derive(Default)]
struct WatchState {
    stop: bool,
    last_failure: Option<Instant>,
}

/// A byte count for the log: the bytes and the size for people, `1048576 bytes (1.00 MiB)`.
pub(crate) fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let (mut value, mut unit) = (bytes as f64, 0);
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} bytes")
    } else {
        format!("{bytes} bytes ({value:.2} {})", UNITS[unit])
    }
}

/// Whether `used` of `total` reaches `percent`.
pub(crate) fn at_least(used: u64, total: u64, percent: u32) -> bool {
    u128::from(used) * 100 >= u128::from(total) * u128::from(percent)
}

impl SpaceWatch {
    pub(crate) fn new(options: &PoolOptions, health: Arc<Health>) -> SpaceWatch {
        SpaceWatch {
            autoextend: options.autoextend,
            low_water_percent: options.low_water_percent,
            low_water_mark_blocks: options.low_water_mark_blocks,
            health,
            data_low_water: AtomicBool::new(false),
            metadata_low_water: AtomicBool::new(false),
            requested: AtomicBool::new(false),
            exhausted: AtomicBool::new(false),
            metadata_blocked: AtomicBool::new(false),
            starved: AtomicBool::new(false),
            passed_down_bytes: AtomicU64::new(0),
            given_back: Mutex::new(Vec::new()),
            host_dir: OnceLock::new(),
            state: Mutex::new(WatchState::default()),
            wake: Condvar::new(),
        }
    }

    pub(crate) fn autoextend(&self) -> Option<Autoextend> {
        self.autoextend
    }

    /// Where the pool's files are (their file system's free space bounds the growth).
    pub(crate) fn set_host_dir(&self, dir: PathBuf) {
        let _ = self.host_dir.set(dir);
    }

    pub(crate) fn host_dir(&self) -> Option<&Path> {
        self.host_dir.get().map(PathBuf::as_path)
    }

    pub(crate) fn data_low_water(&self) -> bool {
        self.data_low_water.load(Ordering::Acquire)
    }

    pub(crate) fn metadata_low_water(&self) -> bool {
        self.metadata_low_water.load(Ordering::Acquire)
    }

    /// Count bytes given back to the data device.
    pub(crate) fn passed_down(&self, bytes: u64) {
        self.passed_down_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// These data blocks were freed (released from their grace period): whatever was
    /// given back of them before is not any more.
    pub(crate) fn freed(&self, blocks: impl Iterator<Item = u64>) {
        let mut given = self.given_back.lock().unwrap_or_else(|e| e.into_inner());
        for block in blocks {
            if let Some(word) = given.get_mut((block / 64) as usize) {
                *word &= !(1u64 << (block % 64));
            }
        }
    }

    /// Blocks `first..first + count` were given back to the data device; returns how many
    /// of them had not been since they were last freed (what the counters count).
    pub(crate) fn given_back(&self, first: u64, count: u64) -> u64 {
        let mut given = self.given_back.lock().unwrap_or_else(|e| e.into_inner());
        let end = first + count;
        let words = end.div_ceil(64) as usize;
        if given.len() < words {
            given.resize(words, 0);
        }
        let mut new = 0;
        for block in first..end {
            let (word, bit) = ((block / 64) as usize, 1u64 << (block % 64));
            if given[word] & bit == 0 {
                given[word] |= bit;
                new += 1;
            }
        }
        new
    }

    pub(crate) fn passed_down_bytes(&self) -> u64 {
        self.passed_down_bytes.load(Ordering::Relaxed)
    }

    fn lock_state(&self) -> MutexGuard<'_, WatchState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a write that finds no space should wait for a growth: autoextend is on and
    /// the pool is not known to be unable to grow.
    pub(crate) fn may_grow(&self) -> bool {
        self.autoextend.is_some() && !self.exhausted.load(Ordering::Acquire)
    }

    pub(crate) fn is_exhausted(&self) -> bool {
        self.exhausted.load(Ordering::Acquire)
    }

    /// Ask the worker for a growth (cheap when already asked; nothing when the pool cannot
    /// grow now: the worker retries on its own).
    pub(crate) fn request(&self) {
        if self.may_grow() {
            self.wake_worker();
        }
    }

    /// Ask the worker for a metadata growth: whether the data can grow or not (a pool
    /// whose data reached `max_bytes` still grows its metadata), but not after the last
    /// metadata growth failed (the worker retries that at each look on its own).
    fn request_metadata(&self) {
        if self.autoextend.is_some() && !self.metadata_blocked.load(Ordering::Acquire) {
            self.wake_worker();
        }
    }

    /// Set the request and wake the worker (cheap when already asked).
    fn wake_worker(&self) {
        if !self.requested.swap(true, Ordering::AcqRel) {
            let _guard = self.lock_state();
            self.wake.notify_all();
        }
    }

    /// A write found no free data block: ask for a growth whatever the usage.
    pub(crate) fn request_space(&self) {
        if self.may_grow() {
            self.starved.store(true, Ordering::Release);
            self.request();
        }
    }

    /// The worker: wait up to `tick` for a request. False once stopped.
    pub(crate) fn wait_for_request(&self, tick: Duration) -> bool {
        let state = self.lock_state();
        if state.stop {
            return false;
        }
        if !self.requested.load(Ordering::Acquire) {
            let (state, _) = self
                .wake
                .wait_timeout(state, tick)
                .unwrap_or_else(|e| e.into_inner());
            if state.stop {
                return false;
            }
        }
        self.requested.store(false, Ordering::Release);
        true
    }

    /// Tell the worker to stop (it leaves at its next look).
    pub(crate) fn stop(&self) {
        self.lock_state().stop = true;
        self.wake.notify_all();
    }

    /// The worker: whether a write found no block since the last look (and forget it).
    pub(crate) fn take_starved(&self) -> bool {
        self.starved.swap(false, Ordering::AcqRel)
    }

    /// When the last data growth failed, while the pool is exhausted.
    pub(crate) fn last_failure(&self) -> Option<Instant> {
        self.lock_state().last_failure
    }

    /// After a reservation, with the data usage read under the metadata lock.
    pub(crate) fn after_reservation(&self, used: u64, total: u64) {
        debug_assert!(used <= total, "{used} of {total} data blocks used");
        self.check_data_low_water(used, total);
        if let Some(autoextend) = &self.autoextend {
            if at_least(used, total, autoextend.threshold_percent) {
                self.request();
            }
        }
    }

    /// After a commit: the low-water marks of both devices (set or cleared), and a growth
    /// request when the metadata crosses the threshold.
    pub(crate) fn after_commit(&self, usage: &Usage) {
        self.check_data_low_water(usage.data_used_blocks, usage.data_total_blocks);
        let (used, total) = (usage.metadata_used_blocks, usage.metadata_total_blocks);
        debug_assert!(used <= total, "{used} of {total} metadata blocks used");
        let reached = self.crossing(
            &self.metadata_low_water,
            at_least(used, total, self.low_water_percent),
            !at_least(used, total, self.low_water_percent.saturating_sub(1)),
        );
        if let Some(reached) = reached {
            let message = if reached {
                format!(
                    "metadata low water mark reached: {used} of {total} metadata blocks used (mark {}%)",
                    self.low_water_percent
                )
            } else {
                format!("metadata use back below the low water mark: {used} of {total} blocks")
            };
            self.log_low_water(reached, message);
        }
        if let Some(autoextend) = &self.autoextend {
            if at_least(used, total, autoextend.threshold_percent) {
                self.request_metadata();
            }
        }
    }

    fn check_data_low_water(&self, used: u64, total: u64) {
        let free = total.saturating_sub(used);
        let reached = self.crossing(
            &self.data_low_water,
            at_least(used, total, self.low_water_percent) || free <= self.low_water_mark_blocks,
            !at_least(used, total, self.low_water_percent.saturating_sub(1))
                && free > self.low_water_mark_blocks,
        );
        if let Some(reached) = reached {
            let message = if reached {
                format!(
                    "low water mark reached: {used} of {total} data blocks used, {} free (mark {}%)",
                    total - used.min(total),
                    self.low_water_percent
                )
            } else {
                format!("data use back below the low water mark: {used} of {total} blocks")
            };
            self.log_low_water(reached, message);
        }
    }

    /// Set `mark` when `above`, clear it when `below` (1% under the mark: use hovering at
    /// the mark does not flood the log). Returns the new state if it changed.
    fn crossing(&self, mark: &AtomicBool, above: bool, below: bool) -> Option<bool> {
        let now = mark.load(Ordering::Acquire);
        let wanted = if now { !below } else { above };
        (wanted != now && mark.swap(wanted, Ordering::AcqRel) != wanted).then_some(wanted)
    }

    /// Logged once (here, not again by `Health`). While autoextend is on and working the
    /// mark is crossed on every growth step: those crossings are debug lines, the growth
    /// itself is what the log says; without autoextend, or once it stopped, a warning.
    fn log_low_water(&self, reached: bool, message: String) {
        let autoextending = self.autoextend.is_some() && !self.is_exhausted();
        if autoextending {
            tracing::debug!(target: "thinpool::space", "{message}");
        } else if reached {
            tracing::warn!(target: "thinpool::space", "{message}");
        } else {
            tracing::info!(target: "thinpool::space", "{message}");
        }
        self.health.record(message);
    }

    /// The pool cannot grow: say why once. The caller wakes the writes waiting for space,
    /// so they apply the no-space policy.
    pub(crate) fn exhausted(&self, why: String) {
        self.lock_state().last_failure = Some(Instant::now());
        if !self.exhausted.swap(true, Ordering::AcqRel) {
            tracing::error!(target: "thinpool::space", "autoextend: {why}; writes that need space now follow the no-space policy");
            self.health.record(format!(
                "autoextend stopped: {why}; writes that need space follow the no-space policy"
            ));
        }
        debug_assert!(self.is_exhausted());
    }

    /// The pool grew (or space came back another way). The caller wakes waiting writes.
    pub(crate) fn grew(&self) {
        if self.exhausted.swap(false, Ordering::AcqRel) {
            self.health.log("autoextend resumed".to_string());
        }
        self.lock_state().last_failure = None;
    }

    /// A metadata growth succeeded.
    pub(crate) fn metadata_grew(&self) {
        self.metadata_blocked.store(false, Ordering::Release);
    }

    /// A metadata growth could not be made: say why, once until one succeeds.
    pub(crate) fn metadata_blocked(&self, why: String) {
        if !self.metadata_blocked.swap(true, Ordering::AcqRel) {
            tracing::error!(target: "thinpool::space", "autoextend: metadata not grown: {why}");
            self.health
                .record(format!("autoextend: metadata not grown: {why}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{at_least, SpaceWatch};
    use crate::engine::health::Health;
    use crate::engine::options::{Autoextend, ExtendBy, PoolMode, PoolOptions};
    use crate::format::metadata::Usage;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    fn watch() -> SpaceWatch {
        let options = PoolOptions {
            autoextend: Some(Autoextend {
                threshold_percent: 50,
                by: ExtendBy::Percent(50),
                max_bytes: 1 << 30,
            }),
            ..PoolOptions::default()
        };
        SpaceWatch::new(&options, Arc::new(Health::new(PoolMode::Write, false)))
    }

    /// Regression: a commit that took the metadata over the threshold asked the worker
    /// through the data's gate, so while the data could not grow (at `max_bytes`) the
    /// request was dropped and the metadata waited for the worker's next tick.
    #[test]
    fn a_metadata_crossing_asks_for_growth_while_the_data_cannot_grow() {
        let watch = watch();
        watch.exhausted("the data is at the autoextend maximum".to_string());
        assert!(!watch.may_grow());
        let usage = |metadata_used_blocks| Usage {
            data_used_blocks: 10,
            data_total_blocks: 10,
            metadata_used_blocks,
            metadata_total_blocks: 100,
        };
        watch.after_commit(&usage(49));
        assert!(
            !watch.requested.load(Ordering::Acquire),
            "below the threshold"
        );
        watch.after_commit(&usage(50));
        assert!(watch.requested.load(Ordering::Acquire), "at the threshold");
        // After a failed metadata growth the worker retries at each look by itself.
        assert!(watch.wait_for_request(std::time::Duration::ZERO));
        watch.metadata_blocked("the host file system is full".to_string());
        watch.after_commit(&usage(60));
        assert!(
            !watch.requested.load(Ordering::Acquire),
            "blocked: not at each commit"
        );
        watch.metadata_grew();
        watch.after_commit(&usage(60));
        assert!(
            watch.requested.load(Ordering::Acquire),
            "unblocked by a growth"
        );
    }

    #[test]
    fn log_sizes_have_a_human_form() {
        assert_eq!(super::human_bytes(512), "512 bytes");
        assert_eq!(super::human_bytes(3 << 29), "1610612736 bytes (1.50 GiB)");
    }

    #[test]
    fn thresholds_compare_without_rounding() {
        assert!(at_least(80, 100, 80));
        assert!(!at_least(79, 100, 80));
        assert!(at_least(4, 5, 80));
        assert!(!at_least(3, 5, 80));
        assert!(at_least(5, 5, 100));
        assert!(at_least(u64::MAX, u64::MAX, 100));
    }
}
