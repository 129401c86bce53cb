//! What the server's connection table sees of a session: whether a request is in flight,
//! and since when none has been, so that a peer at its connection limit can give up its
//! connection idle the longest (see `server::table`).
//!
//! Invariant: `busy` counts the session's 0 → 1 transitions of its requests in flight less
//! its 1 → 0 transitions, so it is above 0 while requests are in flight (a count, not a
//! flag: another thread's 0 → 1 may be marked before a 1 → 0 just before it); each 1 → 0
//! is marked after the 0 → 1 that began its busy period, so it never goes below 0.
//! `idle_since` is the last time a 1 → 0 was marked (or the start of transmission).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The instant all `idle_since` values count from.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_nanos() -> u64 {
    u64::try_from(epoch().elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// A connection's activity in transmission, shared by its session and the server's table.
#[derive(Debug)]
pub(crate) struct Activity {
    busy: AtomicUsize,
    /// Nanoseconds from [`epoch`] to the last 1 → 0 transition marked.
    idle_since_nanos: AtomicU64,
}

impl Activity {
    /// An idle connection, idle from now.
    pub(crate) fn new() -> Self {
        Activity {
            busy: AtomicUsize::new(0),
            idle_since_nanos: AtomicU64::new(now_nanos()),
        }
    }

    /// The first request in flight was taken.
    pub(super) fn busy(&self) {
        self.busy.fetch_add(1, Ordering::SeqCst);
    }

    /// The last request in flight was answered.
    pub(super) fn idle(&self) {
        self.idle_since_nanos.store(now_nanos(), Ordering::SeqCst);
        let before = self.busy.fetch_sub(1, Ordering::SeqCst);
        assert!(before > 0, "connection marked idle more often than busy");
    }

    /// How long the connection has had no request in flight; `None` while it has some.
    pub(crate) fn idle_for(&self) -> Option<Duration> {
        if self.busy.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let since = self.idle_since_nanos.load(Ordering::SeqCst);
        Some(Duration::from_nanos(now_nanos().saturating_sub(since)))
    }
}

impl Default for Activity {
    fn default() -> Self {
        Activity::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_only_between_requests() {
        let activity = Activity::new();
        assert!(activity.idle_for().is_some());
        activity.busy();
        assert_eq!(activity.idle_for(), None);
        activity.idle();
        let first = activity.idle_for().unwrap();
        std::thread::sleep(Duration::from_millis(2));
        assert!(activity.idle_for().unwrap() > first);
    }
}
