//! Counters of requests and payload bytes in flight: one [`Budget`] per connection, and one
//! for the whole server that payloads over [`super::RETAINED_BUFFER_BYTES`] also draw on.
//!
//! Invariants: a budget never counts more requests than `requests_max`, nor more bytes than
//! `bytes_max` except for one request alone (a request larger than the whole budget still
//! runs, by itself); every acquire is matched by exactly one release of the same bytes
//! (release asserts it does not go below zero). On the server's budget, once it is half
//! used, a connection gets more only while it holds less than its fair share
//! ([`FAIR_SHARE_DIVISOR`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};

use crate::sync;

/// How much of the server's byte budget one connection may hold beyond half of it: the
/// budget's 1/`FAIR_SHARE_DIVISOR`. While the server budget is at most half used, a connection
/// may take up to its own limit; past half, only connections under their share get more.
/// So fewer than `FAIR_SHARE_DIVISOR / 2` connections can never fill the server budget.
const FAIR_SHARE_DIVISOR: u64 = 64;

/// Counts requests and payload bytes in flight; the thread reading a request waits here
/// (holding the input lock) when either is full.
///
/// Released twice per READ or WRITE (the connection's budget and the server's), so release
/// is kept cheap: it takes an uncontended mutex and makes a wake-up call only when a thread
/// is registered as waiting (a condvar notify is a futex syscall even with no waiter).
pub(crate) struct Budget {
    used: Mutex<Used>,
    released: Condvar,
    requests_max: usize,
    bytes_max: u64,
}

#[derive(Default)]
struct Used {
    requests: usize,
    bytes: u64,
    /// Threads blocked in [`Budget::acquire`]; release notifies only if nonzero.
    waiters: usize,
}

impl Budget {
    pub(crate) fn new(requests_max: usize, bytes_max: u64) -> Self {
        Budget {
            used: Mutex::new(Used::default()),
            released: Condvar::new(),
            requests_max,
            bytes_max,
        }
    }

    /// The most bytes of this (server) budget one connection may hold once it is half used.
    pub(super) fn fair_share_bytes(&self) -> u64 {
        self.bytes_max / FAIR_SHARE_DIVISOR
    }

    /// True if one more request of `bytes` fits now (a request alone always fits).
    fn fits(&self, used: &Used, bytes: u64) -> bool {
        // A single request larger than the byte budget still runs, alone.
        used.requests < self.requests_max
            && (used.requests == 0 || used.bytes + bytes <= self.bytes_max)
    }

    pub(super) fn acquire(&self, bytes: u64) {
        let mut used = sync::lock(&self.used);
        while !self.fits(&used, bytes) {
            used.waiters += 1;
            used = sync::wait(&self.released, used);
            used.waiters -= 1;
        }
        used.requests += 1;
        used.bytes += bytes;
    }

    /// Takes a request slot and `bytes` if they are free now; `false` (nothing taken)
    /// otherwise. For a thread that holds replies not yet sent, which must not wait for
    /// slots it holds itself.
    pub(super) fn try_acquire(&self, bytes: u64) -> bool {
        let mut used = sync::lock(&self.used);
        if !self.fits(&used, bytes) {
            return false;
        }
        used.requests += 1;
        used.bytes += bytes;
        true
    }

    /// Takes `bytes` from the server's budget for a connection that holds `held` bytes of it
    /// already: up to the whole budget while at most half of it is used, past that only up
    /// to `share` per connection (see [`FAIR_SHARE_DIVISOR`]).
    pub(super) fn acquire_fair(&self, bytes: u64, held: &AtomicU64, share: u64) {
        let mut used = sync::lock(&self.used);
        loop {
            let total = used.bytes + bytes;
            let within_share = held.load(Ordering::SeqCst) + bytes <= share;
            let fits = total <= self.bytes_max && (within_share || total <= self.bytes_max / 2);
            if used.requests == 0 || fits {
                break;
            }
            used.waiters += 1;
            used = sync::wait(&self.released, used);
            used.waiters -= 1;
        }
        used.requests += 1;
        used.bytes += bytes;
        held.fetch_add(bytes, Ordering::SeqCst);
    }

    pub(super) fn release(&self, bytes: u64) {
        self.release_many(1, bytes);
    }

    /// Releases `requests` requests holding `bytes` in all (a batch of replies sent at once).
    pub(super) fn release_many(&self, requests: usize, bytes: u64) {
        let mut used = sync::lock(&self.used);
        assert!(
            used.requests >= requests,
            "budget released more requests than acquired"
        );
        assert!(
            used.bytes >= bytes,
            "budget released more bytes than acquired"
        );
        used.requests -= requests;
        used.bytes -= bytes;
        if used.waiters > 0 {
            self.released.notify_all();
        }
    }
}
