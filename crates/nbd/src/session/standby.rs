//! Waiting for the input: a thread takes it when it is free and handed off or unused, and
//! otherwise waits as a standby (see the `session` module doc).
//!
//! Numbers: the watchdog ticks every 2 ms ([`super::STALL_TICK`]) and sleeps after 100 ms
//! without a reader in an export call; a standby woken by nothing for 100 ms with nothing in
//! flight leaves, a surplus reader leaves on a quiet read-timeout tick (at most 30 s). So an
//! idle or handshaking connection costs one thread (512 KiB stack, mostly untouched), a
//! 64 KiB input buffer and its batch buffer. Replies go out of order, matched by cookie.
//! FLUSH calls `Export::flush`, which for a pool volume commits the pool and so covers the
//! writes of every connection (the server offers CAN_MULTI_CONN).

use std::sync::atomic::Ordering;
use std::sync::{MutexGuard, TryLockError};

use super::input::Input;
use super::{Connection, STANDBY_QUIET};
use crate::error::Error;
use crate::sync;

impl Connection {
    /// Waits for the input: takes it if it is free and either `take_now`, or no reading
    /// thread is in an export call (the input is free because nobody reads); otherwise waits
    /// as a standby, until a thread hands the input off or the watchdog finds the reading
    /// thread stuck in an export call (both wake it: it takes the input over). `None` if the
    /// thread should leave: woken by nothing for [`STANDBY_QUIET`] with nothing in flight.
    pub(super) fn wait_for_input(&self, take_now: bool) -> Option<MutexGuard<'_, Input>> {
        let watch = &*self.watch;
        let mut notified = take_now;
        let mut timed_out = false;
        let mut standby = sync::lock(&watch.standby);
        loop {
            watch.waiters.fetch_add(1, Ordering::SeqCst);
            // A thread started as a standby counts as one from here on.
            self.standby_starting.store(false, Ordering::SeqCst);
            // After a quiet wait the input is tried in any case: a thread that panicked
            // holding it woke nobody, and the poisoned lock ends the session (see
            // `try_lock_input`).
            if notified || timed_out || !watch.in_call.load(Ordering::SeqCst) {
                if let Some(input) = self.try_lock_input() {
                    watch.waiters.fetch_sub(1, Ordering::SeqCst);
                    // This thread reads now, and is in no export call.
                    watch.in_call.store(false, Ordering::SeqCst);
                    return Some(input);
                }
            }
            if timed_out && self.in_flight.load(Ordering::SeqCst) == 0 && self.leave_if_not_last() {
                watch.waiters.fetch_sub(1, Ordering::SeqCst);
                return None;
            }
            let (guard, wait) = sync::wait_timeout(&watch.wake, standby, STANDBY_QUIET);
            standby = guard;
            watch.waiters.fetch_sub(1, Ordering::SeqCst);
            timed_out = wait.timed_out();
            notified = !timed_out;
        }
    }

    /// The input, if no other thread holds it. A thread that panicked holding it may have
    /// left a request half-read, so the stream is no longer framed: reading stops for every
    /// thread (see [`crate::sync`]).
    pub(super) fn try_lock_input(&self) -> Option<MutexGuard<'_, Input>> {
        match self.input.try_lock() {
            Ok(input) => Some(input),
            Err(TryLockError::WouldBlock) => None,
            Err(TryLockError::Poisoned(poisoned)) => {
                let mut input = poisoned.into_inner();
                input.stop(Err(Error::Internal(
                    "a thread serving this connection panicked while reading".to_string(),
                )));
                Some(input)
            }
        }
    }
}
