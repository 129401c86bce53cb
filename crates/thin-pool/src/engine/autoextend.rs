//! The autoextend worker: the thread that grows the data and the metadata when their use
//! crosses the autoextend threshold (or a write found no block), as `space` requests.
//!
//! ```text
//!   thinpool-space thread   on request (or every second): grow the data file by `by` up to
//!                           `max_bytes` and the host's free space, the metadata by the
//!                           same share (`grow::grow_data`, `grow::grow_metadata`)
//! ```
//!
//! Started by the pool, it holds a weak handle to the metadata owner and the handles it
//! needs (the watch, the data device, the health), so dropping the pool ends it. The growth
//! takes the commit lock on this thread, as a management operation does. When the pool
//! cannot grow (at `max_bytes`, the host file system full, a block device, an error) the
//! pool is `exhausted` (`SpaceWatch::exhausted`): writes that need space follow the
//! no-space policy, and the worker tries again every [`RETRY_INTERVAL`] while asked to.

use crate::engine::data_device::DataDevice;
use crate::engine::grow::{grow_data, grow_metadata};
use crate::engine::health::Health;
use crate::engine::meta::Meta;
use crate::engine::options::{Autoextend, ExtendBy, PoolMode, PoolOptions};
use crate::engine::space::{at_least, host_free_bytes, human_bytes, SpaceWatch};
use crate::error::{Error, Result};
use crate::format::metadata::Usage;
use persistent_data::space_map::METADATA_BLOCKS_MAX;
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

/// How often the thread looks at the usage when nobody asks.
const TICK: Duration = Duration::from_secs(1);
/// How long after a failed growth the thread tries again.
pub(crate) const RETRY_INTERVAL: Duration = Duration::from_secs(5);
/// The smallest metadata growth: 256 KiB.
const METADATA_GROWTH_MIN_BYTES: u64 = 64 * 4096;

/// What the growth thread holds.
pub(crate) struct Grower {
    pub(crate) meta: Weak<Meta>,
    pub(crate) watch: Arc<SpaceWatch>,
    pub(crate) data: Arc<dyn DataDevice>,
    pub(crate) health: Arc<Health>,
    pub(crate) options: Arc<PoolOptions>,
}

/// The pool's hold on the growth thread.
pub(crate) struct Autoextender {
    watch: Arc<SpaceWatch>,
    handle: Mutex<Option<JoinHandle<()>>>,
}

impl Autoextender {
    /// Start the thread if autoextend is on (`start`) and the watch asks for it.
    pub(crate) fn start(grower: Grower, start: bool) -> Result<Autoextender> {
        let watch = grower.watch.clone();
        let handle = if start && watch.autoextend().is_some() {
            let handle = std::thread::Builder::new()
                .name("thinpool-space".to_string())
                .spawn(move || grower.run())
                .map_err(|source| Error::Io {
                    what: "starting the autoextend thread".to_string(),
                    source,
                })?;
            Some(handle)
        } else {
            None
        };
        Ok(Autoextender {
            watch,
            handle: Mutex::new(handle),
        })
    }

    /// Stop the thread (if running) and wait for it.
    pub(crate) fn stop(&self) {
        self.watch.stop();
        let handle = self.handle.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }
}

/// One look's owners, alive for the look.
struct Look<'a> {
    meta: &'a Meta,
    grower: &'a Grower,
}

impl Grower {
    fn run(self) {
        while self.watch.wait_for_request(TICK) {
            let Some(meta) = self.meta.upgrade() else {
                return;
            };
            if !matches!(
                self.health.mode(),
                PoolMode::Write | PoolMode::OutOfDataSpace | PoolMode::OutOfMetadataSpace
            ) {
                continue;
            }
            let look = Look {
                meta: &meta,
                grower: &self,
            };
            // A panic here must not leave writes waiting for a growth that never comes.
            let grown =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| look.grow_if_needed()));
            if grown.is_err() {
                look.exhausted("the autoextend thread panicked".to_string());
                return;
            }
        }
    }
}

impl Look<'_> {
    /// The pool cannot grow: say why once, and let waiting writes apply the policy.
    fn exhausted(&self, why: String) {
        self.grower.watch.exhausted(why);
        self.meta.notify_space();
    }

    fn grew(&self) {
        self.grower.watch.grew();
        self.meta.notify_space();
    }

    /// One look at the usage: grow what crossed the threshold.
    fn grow_if_needed(&self) {
        let watch = &*self.grower.watch;
        let Some(autoextend) = watch.autoextend() else {
            return;
        };
        // After a failed data growth, the next try waits a while (the metadata's does not).
        let data_may_try = !watch.is_exhausted()
            || watch
                .last_failure()
                .is_none_or(|at| at.elapsed() >= RETRY_INTERVAL);
        let Ok(usage) = self.meta.read(|view| view.md().map(|md| md.usage())) else {
            return;
        };
        let data_full = usage.data_used_blocks >= usage.data_total_blocks || watch.take_starved();
        if at_least(
            usage.data_used_blocks,
            usage.data_total_blocks,
            autoextend.threshold_percent,
        ) || data_full
        {
            if data_may_try {
                self.grow_data_step(&autoextend, &usage);
            }
        } else if watch.is_exhausted() {
            // Space came back another way (frees, a manual grow).
            self.grew();
        }
        if at_least(
            usage.metadata_used_blocks,
            usage.metadata_total_blocks,
            autoextend.threshold_percent,
        ) {
            self.grow_metadata_step(&autoextend, &usage);
        }
    }

    fn host_free(&self) -> Option<u64> {
        match &self.grower.options.host_free_probe {
            Some(probe) => probe.call(),
            None => self.grower.watch.host_dir().and_then(host_free_bytes),
        }
    }

    fn grow_data_step(&self, autoextend: &Autoextend, usage: &Usage) {
        let block = self.meta.block_size_bytes();
        let current = usage.data_total_blocks * block;
        let step = match autoextend.by {
            ExtendBy::Percent(percent) => current.saturating_mul(u64::from(percent)) / 100,
            ExtendBy::Bytes(bytes) => bytes,
        }
        .max(block);
        let mut target = current.saturating_add(step).min(autoextend.max_bytes);
        target -= target % block;
        if target <= current {
            self.exhausted(format!(
                "the data is at the autoextend maximum ({current} bytes, max {})",
                autoextend.max_bytes
            ));
            return;
        }
        if let Some(free) = self.host_free() {
            let room = free / block * block;
            if target - current > room {
                if room == 0 {
                    self.exhausted(format!(
                        "the host file system is full ({free} bytes free, the data needs {} more)",
                        target - current
                    ));
                    return;
                }
                target = current + room;
            }
        }
        match grow_data(self.meta, &*self.grower.data, &self.grower.health, target) {
            Ok(blocks) if blocks * block > current => {
                let message = format!(
                    "autoextend: data grew from {} to {}",
                    human_bytes(current),
                    human_bytes(blocks * block)
                );
                // Logged once, under the space target; kept for `Pool::events`.
                tracing::info!(target: "thinpool::space", "{message}");
                self.grower.health.record(message);
                self.grew();
            }
            Ok(_) => self.exhausted(
                "the data device did not grow (a block device grows only from outside)".to_string(),
            ),
            Err(e) => self.exhausted(format!("growing the data failed: {e}")),
        }
    }

    fn grow_metadata_step(&self, autoextend: &Autoextend, usage: &Usage) {
        let current = usage.metadata_total_blocks * 4096;
        let max = METADATA_BLOCKS_MAX * 4096;
        let data = (usage.data_total_blocks * self.meta.block_size_bytes()).max(1);
        let step = match autoextend.by {
            ExtendBy::Percent(percent) => current.saturating_mul(u64::from(percent)) / 100,
            ExtendBy::Bytes(bytes) => (u128::from(current) * u128::from(bytes) / u128::from(data))
                .min(u128::from(max)) as u64,
        }
        .max(METADATA_GROWTH_MIN_BYTES);
        let target = current.saturating_add(step).min(max) / 4096 * 4096;
        if target <= current {
            // Said once; commits no longer wake the worker for it.
            self.grower.watch.metadata_blocked(format!(
                "the metadata is at the format's maximum ({current} bytes)"
            ));
            return;
        }
        if let Some(free) = self.host_free() {
            if target - current > free {
                self.grower.watch.metadata_blocked(format!(
                    "the host file system has {free} bytes free, growing the metadata needs {} (it is preallocated)",
                    target - current
                ));
                return;
            }
        }
        match grow_metadata(self.meta, Some(target)) {
            Ok(blocks) => {
                self.grower.watch.metadata_grew();
                let message = format!(
                    "autoextend: metadata grew from {} to {blocks} blocks ({} to {})",
                    usage.metadata_total_blocks,
                    human_bytes(usage.metadata_total_blocks * 4096),
                    human_bytes(blocks * 4096)
                );
                tracing::info!(target: "thinpool::space", "{message}");
                self.grower.health.record(message);
            }
            Err(e) => self
                .grower
                .watch
                .metadata_blocked(format!("growing the metadata failed: {e}")),
        }
    }
}
