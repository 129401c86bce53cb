//! The commit worker: commits every `commit_interval` when something changed (queued ops,
//! or metadata changes such as a grown space map), like dm-thin's periodic commit.
//!
//! Started by the pool, it holds a weak handle to the metadata owner and the pool's health
//! (volumes keep the owner alive, not the worker), so dropping the last handle ends it;
//! [`Committer::stop`] wakes it and waits for it to leave.

use crate::engine::health::Health;
use crate::engine::meta::Meta;
use crate::engine::options::PoolMode;
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

/// Wakes and stops the commit thread.
#[derive(Default)]
struct Signal {
    stop: AtomicBool,
    wake: Condvar,
    lock: Mutex<()>,
}

/// The pool's hold on the commit thread.
pub(crate) struct Committer {
    signal: Arc<Signal>,
    handle: Mutex<Option<JoinHandle<()>>>,
}

impl Committer {
    /// Start the thread, unless there is no interval.
    pub(crate) fn start(
        meta: &Arc<Meta>,
        health: &Arc<Health>,
        interval: Option<Duration>,
    ) -> Result<Committer> {
        let signal = Arc::new(Signal::default());
        let handle = match interval {
            Some(interval) => {
                assert!(!interval.is_zero(), "a commit interval is positive");
                let worker = Worker {
                    meta: Arc::downgrade(meta),
                    health: health.clone(),
                    signal: signal.clone(),
                };
                Some(
                    std::thread::Builder::new()
                        .name("thinpool-commit".to_string())
                        .spawn(move || worker.run(interval))
                        .map_err(|source| Error::Io {
                            what: "starting the commit thread".to_string(),
                            source,
                        })?,
                )
            }
            None => None,
        };
        Ok(Committer {
            signal,
            handle: Mutex::new(handle),
        })
    }

    /// Stop the thread (if running) and wait for it.
    pub(crate) fn stop(&self) {
        let signal = &self.signal;
        signal.stop.store(true, Ordering::Release);
        {
            let _guard = signal.lock.lock().unwrap_or_else(|e| e.into_inner());
            signal.wake.notify_all();
        }
        if let Some(handle) = self.handle.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = handle.join();
        }
        assert!(self.stopped());
    }

    /// Whether the thread was told to stop and has left (or never ran).
    pub(crate) fn stopped(&self) -> bool {
        self.signal.stop.load(Ordering::Acquire)
            && self
                .handle
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_none()
    }
}

/// What the commit thread holds.
struct Worker {
    meta: Weak<Meta>,
    health: Arc<Health>,
    signal: Arc<Signal>,
}

impl Worker {
    fn run(self, interval: Duration) {
        let signal = &*self.signal;
        loop {
            {
                let guard = signal.lock.lock().unwrap_or_else(|e| e.into_inner());
                if signal.stop.load(Ordering::Acquire) {
                    return;
                }
                let _ = signal.wake.wait_timeout(guard, interval);
            }
            if signal.stop.load(Ordering::Acquire) {
                return;
            }
            let Some(meta) = self.meta.upgrade() else {
                return;
            };
            let mode = self.health.mode();
            if meta.is_dirty() && matches!(mode, PoolMode::Write | PoolMode::OutOfDataSpace) {
                if let Err(e) = meta.commit() {
                    self.health.log_warn(format!("periodic commit failed: {e}"));
                }
            } else {
                // Freed blocks whose pinned I/O was still running at their commit: release
                // (and pass down) those it left since.
                meta.reclaim_now();
            }
        }
    }
}
