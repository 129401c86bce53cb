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
use std::sync::{Arc, MutexGuard, TryLockError};

use super::input::Input;
use super::{Connection, Led, Scratch, Start, STANDBY_QUIET};
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

impl Connection {
    /// Starts one more thread if the limit allows; `false` if none was started.
    pub(super) fn add_thread(self: &Arc<Self>, start: Start) -> bool {
        let grown = self
            .threads
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |threads| {
                (threads < self.threads_max).then_some(threads + 1)
            });
        if grown.is_err() {
            return false;
        }
        let connection = Arc::clone(self);
        // The connection's span (its number and peer) goes with its threads.
        let span = tracing::Span::current();
        let spawned = std::thread::Builder::new()
            .name(self.thread_name.clone())
            .stack_size(self.stack_bytes)
            .spawn(move || span.in_scope(|| connection.run_thread(start)));
        if spawned.is_err() {
            // Serve with the threads there are.
            self.threads.fetch_sub(1, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// Gives the input up so that another thread reads on: wakes a standby, or starts a
    /// thread if none waits.
    /// On the event loop the connection is parked instead, so that a worker reads on (if
    /// fewer than `threads_max` workers are in it).
    pub(super) fn hand_off(self: &Arc<Self>, input: MutexGuard<'_, Input>) {
        drop(input);
        if self.reactor.is_some() {
            if self.threads.load(Ordering::SeqCst) < self.threads_max {
                self.park(true);
            }
        } else if !self.wake_standby() {
            self.add_thread(Start::Read);
        }
    }

    /// Wakes one standby thread, if any waits; a thread that gives the input up calls it
    /// after unlocking the input. A standby registers before it last tries the input, so
    /// either it sees the input free or this sees it registered.
    pub(super) fn wake_standby(&self) -> bool {
        self.watch.wake_standby()
    }

    /// Lets this thread leave if it is not the last one; the others still read.
    pub(super) fn leave_if_not_last(&self) -> bool {
        self.threads
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |threads| {
                (threads > 1).then(|| threads - 1)
            })
            .is_ok()
    }

    /// One thread's life: wait for the input, read and serve requests while holding it
    /// ([`Connection::lead`]), and again, until the session ends or the thread is not needed.
    pub(super) fn run_thread(self: Arc<Self>, start: Start) {
        let mut scratch = Scratch::default();
        // Only a thread started for a hand-off takes the input regardless of a reading
        // thread in an export call; otherwise two threads would take it from each other
        // at every call.
        let mut take_now = start == Start::Read;
        loop {
            let Some(input) = self.wait_for_input(take_now) else {
                return;
            };
            take_now = false;
            match self.lead(input, &mut scratch) {
                Led::GaveUp => {}
                Led::Left => return,
            }
        }
    }
}
