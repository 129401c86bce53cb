//! The commit thread: commits every `commit_interval` when something changed (queued ops,
//! or metadata changes such as a grown space map), like dm-thin's periodic commit.
//!
//! It holds only a weak reference to the pool's state, so dropping the last pool handle
//! ends it; [`Committer::stop`] wakes it and waits for it to leave.

use crate::engine::options::PoolMode;
use crate::engine::shared::{io_error, Shared};
use crate::error::Result;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

/// Wakes and stops the commit thread (part of the pool's shared state).
#[derive(Default)]
pub(crate) struct Signal {
    stop: AtomicBool,
    wake: Condvar,
    lock: Mutex<()>,
}

/// The pool handles' hold on the commit thread.
pub(crate) struct Committer {
    handle: Mutex<Option<JoinHandle<()>>>,
}

impl Committer {
    /// Start the thread, unless there is no interval.
    pub(crate) fn start(shared: &Arc<Shared>, interval: Option<Duration>) -> Result<Committer> {
        let handle = match interval {
            Some(interval) => {
                let weak = Arc::downgrade(shared);
                Some(
                    std::thread::Builder::new()
                        .name("thinpool-commit".to_string())
                        .spawn(move || commit_loop(weak, interval))
                        .map_err(io_error("starting the commit thread".to_string()))?,
                )
            }
            None => None,
        };
        Ok(Committer {
            handle: Mutex::new(handle),
        })
    }

    /// Stop the thread (if running) and wait for it.
    pub(crate) fn stop(&self, shared: &Shared) {
        let signal = &shared.committer;
        signal.stop.store(true, Ordering::Release);
        {
            let _guard = signal.lock.lock().unwrap_or_else(|e| e.into_inner());
            signal.wake.notify_all();
        }
        if let Some(handle) = self.handle.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = handle.join();
        }
    }
}

fn commit_loop(shared: Weak<Shared>, interval: Duration) {
    loop {
        let Some(strong) = shared.upgrade() else {
            return;
        };
        let signal = &strong.committer;
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
        let dirty = {
            let meta = strong.lock_meta();
            !meta.ops.is_empty() || meta.md.as_ref().is_some_and(|md| md.has_changes())
        };
        if dirty && matches!(strong.mode(), PoolMode::Write | PoolMode::OutOfDataSpace) {
            if let Err(e) = strong.commit() {
                strong.log_warn(format!("periodic commit failed: {e}"));
            }
        } else {
            // Freed blocks whose pinned I/O was still running at their commit: release
            // (and pass down) those it left since.
            let mut meta = strong.lock_meta();
            if !meta.limbo.is_empty() {
                strong.reclaim(&mut meta);
            }
        }
    }
}
