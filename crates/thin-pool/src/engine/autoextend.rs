//! Space alerts and automatic growth: the low-water marks of the data and the metadata, and
//! the thread that grows both when their use crosses the autoextend threshold.
//!
//! ```text
//!   reservation (metadata lock held)   used ≥ low water?  → warn once per crossing
//!                                      used ≥ threshold?  → request a growth (one atomic swap)
//!   commit (metadata lock held)        data and metadata low water set or cleared;
//!                                      metadata ≥ threshold → request a growth
//!   thinpool-space thread              on request (or every second): grow the data file by
//!                                      `by` up to `max_bytes` and the host's free space,
//!                                      the metadata by the same share (`Shared::grow_data`, `grow_metadata`)
//!   alloc out of space                 growth possible → wait for it (any policy);
//!                                      not possible (`exhausted`) → the no-space policy
//! ```
//!
//! The write path pays arithmetic on the usage it already read under the metadata lock and,
//! above the threshold, one atomic swap; the growth itself takes the commit lock on this
//! thread, as a management operation does. When the pool cannot grow (at `max_bytes`, the
//! host file system full, a block device, an error) the pool is `exhausted`: an error line
//! says why, writes that need space follow the no-space policy (queue or error), and the
//! thread tries again every [`RETRY_INTERVAL`] while it is asked to.

use crate::engine::options::{Autoextend, ExtendBy, PoolMode, PoolOptions};
use crate::engine::pool::host_free_bytes;
use crate::engine::shared::{io_error, Shared};
use crate::error::Result;
use crate::format::metadata::Usage;
use persistent_data::space_map::METADATA_BLOCKS_MAX;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often the thread looks at the usage when nobody asks.
const TICK: Duration = Duration::from_secs(1);
/// How long after a failed growth the thread tries again.
pub(crate) const RETRY_INTERVAL: Duration = Duration::from_secs(5);
/// The smallest metadata growth: 256 KiB.
const METADATA_GROWTH_MIN_BYTES: u64 = 64 * 4096;

/// Low-water state and the growth thread's controls (part of [`Shared`]).
pub(crate) struct SpaceWatch {
    autoextend: Option<Autoextend>,
    low_water_percent: u32,
    low_water_mark_blocks: u64,
    /// Data use is at or above the low-water mark.
    pub(crate) data_low_water: AtomicBool,
    /// Metadata use is at or above the low-water mark.
    pub(crate) metadata_low_water: AtomicBool,
    /// A growth was asked for and the thread has not looked yet.
    requested: AtomicBool,
    /// The pool cannot grow now: writes follow the no-space policy.
    exhausted: AtomicBool,
    /// The last metadata growth failed (said once until one succeeds).
    metadata_blocked: AtomicBool,
    /// A write found no data block (whatever the usage says: free blocks may all be in
    /// their grace period): grow even below the threshold.
    starved: AtomicBool,
    /// Bytes of freed data blocks given back to the data device (passdown and trim).
    pub(crate) passed_down_bytes: AtomicU64,
    /// The directory whose file system holds the pool's files (for its free space).
    host_dir: OnceLock<PathBuf>,
    state: Mutex<WatchState>,
    wake: Condvar,
    thread: Mutex<Option<JoinHandle<()>>>,
}

#[derive(Default)]
struct WatchState {
    stop: bool,
    last_failure: Option<Instant>,
}

/// Whether `used` of `total` reaches `percent`.
fn at_least(used: u64, total: u64, percent: u32) -> bool {
    u128::from(used) * 100 >= u128::from(total) * u128::from(percent)
}

impl SpaceWatch {
    pub(crate) fn new(options: &PoolOptions) -> SpaceWatch {
        SpaceWatch {
            autoextend: options.autoextend,
            low_water_percent: options.low_water_percent,
            low_water_mark_blocks: options.low_water_mark_blocks,
            data_low_water: AtomicBool::new(false),
            metadata_low_water: AtomicBool::new(false),
            requested: AtomicBool::new(false),
            exhausted: AtomicBool::new(false),
            metadata_blocked: AtomicBool::new(false),
            starved: AtomicBool::new(false),
            passed_down_bytes: AtomicU64::new(0),
            host_dir: OnceLock::new(),
            state: Mutex::new(WatchState::default()),
            wake: Condvar::new(),
            thread: Mutex::new(None),
        }
    }

    /// Where the pool's files are (their file system's free space bounds the growth).
    pub(crate) fn set_host_dir(&self, dir: PathBuf) {
        let _ = self.host_dir.set(dir);
    }

    /// Start the growth thread if autoextend is on.
    pub(crate) fn start(shared: &Arc<Shared>) -> Result<()> {
        if shared.watch.autoextend.is_none() {
            return Ok(());
        }
        let weak = Arc::downgrade(shared);
        let handle = std::thread::Builder::new()
            .name("thinpool-space".to_string())
            .spawn(move || watch_loop(weak))
            .map_err(io_error("starting the autoextend thread".to_string()))?;
        *shared
            .watch
            .thread
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(handle);
        Ok(())
    }

    /// Stop the growth thread (if running) and wait for it.
    pub(crate) fn stop(&self) {
        self.lock_state().stop = true;
        self.wake.notify_all();
        let handle = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }

    fn lock_state(&self) -> std::sync::MutexGuard<'_, WatchState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a write that finds no space should wait for a growth: autoextend is on and
    /// the pool is not known to be unable to grow.
    pub(crate) fn may_grow(&self) -> bool {
        self.autoextend.is_some() && !self.exhausted.load(Ordering::Acquire)
    }

    /// Ask the thread for a growth (cheap when already asked; nothing when the pool cannot
    /// grow now: the thread retries on its own).
    pub(crate) fn request(&self) {
        if self.may_grow() && !self.requested.swap(true, Ordering::AcqRel) {
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

    /// After a reservation, with the data usage read under the metadata lock.
    pub(crate) fn after_reservation(&self, shared: &Shared, used: u64, total: u64) {
        self.check_data_low_water(shared, used, total);
        if let Some(autoextend) = &self.autoextend {
            if at_least(used, total, autoextend.threshold_percent) {
                self.request();
            }
        }
    }

    /// After a commit: the low-water marks of both devices (set or cleared), and a growth
    /// request when the metadata crosses the threshold.
    pub(crate) fn after_commit(&self, shared: &Shared, usage: &Usage) {
        self.check_data_low_water(shared, usage.data_used_blocks, usage.data_total_blocks);
        let (used, total) = (usage.metadata_used_blocks, usage.metadata_total_blocks);
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
            log_low_water(shared, reached, message);
        }
        if let Some(autoextend) = &self.autoextend {
            if at_least(used, total, autoextend.threshold_percent) {
                self.request();
            }
        }
    }

    fn check_data_low_water(&self, shared: &Shared, used: u64, total: u64) {
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
            log_low_water(shared, reached, message);
        }
    }

    /// Set `mark` when `above`, clear it when `below` (1% under the mark: use hovering at
    /// the mark does not flood the log). Returns the new state if it changed.
    fn crossing(&self, mark: &AtomicBool, above: bool, below: bool) -> Option<bool> {
        let now = mark.load(Ordering::Acquire);
        let wanted = if now { !below } else { above };
        (wanted != now && mark.swap(wanted, Ordering::AcqRel) != wanted).then_some(wanted)
    }

    /// The pool cannot grow: say why once, and let waiting writes apply the policy.
    fn exhausted(&self, shared: &Shared, why: String) {
        self.lock_state().last_failure = Some(Instant::now());
        if !self.exhausted.swap(true, Ordering::AcqRel) {
            tracing::error!(target: "thinpool::space", "autoextend: {why}; writes that need space now follow the no-space policy");
            shared.log(format!(
                "autoextend stopped: {why}; writes that need space follow the no-space policy"
            ));
        }
        shared.space.notify_all();
    }

    fn grew(&self, shared: &Shared) {
        if self.exhausted.swap(false, Ordering::AcqRel) {
            shared.log("autoextend resumed".to_string());
        }
        self.lock_state().last_failure = None;
        shared.space.notify_all();
    }
}

fn log_low_water(shared: &Shared, reached: bool, message: String) {
    if reached {
        tracing::warn!(target: "thinpool::space", "{message}");
    } else {
        tracing::info!(target: "thinpool::space", "{message}");
    }
    shared.log(message);
}

fn watch_loop(weak: Weak<Shared>) {
    loop {
        let Some(shared) = weak.upgrade() else { return };
        {
            let watch = &shared.watch;
            let state = watch.lock_state();
            if state.stop {
                return;
            }
            if !watch.requested.load(Ordering::Acquire) {
                let (state, _) = watch
                    .wake
                    .wait_timeout(state, TICK)
                    .unwrap_or_else(|e| e.into_inner());
                if state.stop {
                    return;
                }
            }
        }
        shared.watch.requested.store(false, Ordering::Release);
        if matches!(
            shared.mode(),
            PoolMode::Write | PoolMode::OutOfDataSpace | PoolMode::OutOfMetadataSpace
        ) {
            // A panic here must not leave writes waiting for a growth that never comes.
            let grown =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| grow_if_needed(&shared)));
            if grown.is_err() {
                shared
                    .watch
                    .exhausted(&shared, "the autoextend thread panicked".to_string());
                return;
            }
        }
    }
}

/// One look at the usage: grow what crossed the threshold.
fn grow_if_needed(shared: &Shared) {
    let watch = &shared.watch;
    let Some(autoextend) = watch.autoextend else {
        return;
    };
    // After a failed data growth, the next try waits a while (the metadata's does not).
    let data_may_try = !watch.exhausted.load(Ordering::Acquire)
        || watch
            .lock_state()
            .last_failure
            .is_none_or(|at| at.elapsed() >= RETRY_INTERVAL);
    let usage = {
        let mut meta = shared.lock_meta();
        match meta.md() {
            Ok(md) => md.usage(),
            Err(_) => return,
        }
    };
    let data_full = usage.data_used_blocks >= usage.data_total_blocks
        || watch.starved.swap(false, Ordering::AcqRel);
    if at_least(
        usage.data_used_blocks,
        usage.data_total_blocks,
        autoextend.threshold_percent,
    ) || data_full
    {
        if data_may_try {
            grow_data_step(shared, &autoextend, &usage);
        }
    } else if watch.exhausted.load(Ordering::Acquire) {
        // Space came back another way (frees, a manual grow).
        watch.grew(shared);
    }
    if at_least(
        usage.metadata_used_blocks,
        usage.metadata_total_blocks,
        autoextend.threshold_percent,
    ) {
        grow_metadata_step(shared, &autoextend, &usage);
    }
}

fn host_free(shared: &Shared) -> Option<u64> {
    match &shared.options.host_free_probe {
        Some(probe) => probe.call(),
        None => shared
            .watch
            .host_dir
            .get()
            .and_then(|dir| host_free_bytes(dir)),
    }
}

fn grow_data_step(shared: &Shared, autoextend: &Autoextend, usage: &Usage) {
    let watch = &shared.watch;
    let block = shared.block_size_bytes;
    let current = usage.data_total_blocks * block;
    let step = match autoextend.by {
        ExtendBy::Percent(percent) => current.saturating_mul(u64::from(percent)) / 100,
        ExtendBy::Bytes(bytes) => bytes,
    }
    .max(block);
    let mut target = current.saturating_add(step).min(autoextend.max_bytes);
    target -= target % block;
    if target <= current {
        watch.exhausted(
            shared,
            format!(
                "the data is at the autoextend maximum ({current} bytes, max {})",
                autoextend.max_bytes
            ),
        );
        return;
    }
    if let Some(free) = host_free(shared) {
        let room = free / block * block;
        if target - current > room {
            if room == 0 {
                watch.exhausted(
                    shared,
                    format!(
                        "the host file system is full ({free} bytes free, the data needs {} more)",
                        target - current
                    ),
                );
                return;
            }
            target = current + room;
        }
    }
    match shared.grow_data(target) {
        Ok(blocks) if blocks * block > current => {
            tracing::info!(target: "thinpool::space", "autoextend: data grew from {current} to {} bytes", blocks * block);
            shared.log(format!(
                "autoextend: data grew from {current} to {} bytes",
                blocks * block
            ));
            watch.grew(shared);
        }
        Ok(_) => watch.exhausted(
            shared,
            "the data device did not grow (a block device grows only from outside)".to_string(),
        ),
        Err(e) => watch.exhausted(shared, format!("growing the data failed: {e}")),
    }
}

fn grow_metadata_step(shared: &Shared, autoextend: &Autoextend, usage: &Usage) {
    let current = usage.metadata_total_blocks * 4096;
    let max = METADATA_BLOCKS_MAX * 4096;
    let data = (usage.data_total_blocks * shared.block_size_bytes).max(1);
    let step = match autoextend.by {
        ExtendBy::Percent(percent) => current.saturating_mul(u64::from(percent)) / 100,
        ExtendBy::Bytes(bytes) => {
            (u128::from(current) * u128::from(bytes) / u128::from(data)).min(u128::from(max)) as u64
        }
    }
    .max(METADATA_GROWTH_MIN_BYTES);
    let target = current.saturating_add(step).min(max) / 4096 * 4096;
    if target <= current {
        return;
    }
    if let Some(free) = host_free(shared) {
        if target - current > free {
            metadata_blocked(
                shared,
                format!(
                    "the host file system has {free} bytes free, growing the metadata needs {} (it is preallocated)",
                    target - current
                ),
            );
            return;
        }
    }
    match shared.grow_metadata(Some(target)) {
        Ok(blocks) => {
            shared
                .watch
                .metadata_blocked
                .store(false, Ordering::Release);
            tracing::info!(target: "thinpool::space", "autoextend: metadata grew from {} to {blocks} blocks", usage.metadata_total_blocks);
            shared.log(format!(
                "autoextend: metadata grew from {} to {blocks} blocks",
                usage.metadata_total_blocks
            ));
        }
        Err(e) => metadata_blocked(shared, format!("growing the metadata failed: {e}")),
    }
}

/// A metadata growth could not be made: say why, once until one succeeds.
fn metadata_blocked(shared: &Shared, why: String) {
    if !shared.watch.metadata_blocked.swap(true, Ordering::AcqRel) {
        tracing::error!(target: "thinpool::space", "autoextend: metadata not grown: {why}");
        shared.log(format!("autoextend: metadata not grown: {why}"));
    }
}

#[cfg(test)]
mod tests {
    use super::at_least;

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
