//! A session on the event loop (see `reactor`): parking the connection, and a worker's
//! visit, which runs the same reading loop as a connection thread (`Connection::lead`).
//!
//! Invariants: the visitors of a connection count in its `threads` while they visit (a
//! parked connection has none); a visit takes the input (waiting for it, since whoever
//! holds it is about to park the connection or is reading it), reads until the session
//! parks or ends, and if it gives the input up (a slow request it serves itself, or the
//! watchdog let another worker take over) takes it back only if it is free, since the
//! worker that holds it reads on.

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard, PoisonError};
use std::time::Duration;

use super::input::Input;
use super::{Connection, Guest, Led, Scratch};
use crate::error::Error;

impl Connection {
    /// The session's start on the loop: the connection thread parks it and returns; the
    /// watchdog parks it (so a worker reads on) when its reader is stuck in an export call.
    pub(super) fn start_on_loop(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let stalled: Box<dyn Fn() + Send + Sync> = Box::new(move || {
            if let Some(connection) = weak.upgrade() {
                connection.park(true);
            }
        });
        let _ = self.watch.on_stall.set(stalled);
        self.park(false);
    }

    /// Hands the connection to the event loop until its socket is readable, or to be
    /// visited at once if `now` (its input may hold requests received already).
    pub(super) fn park(self: &Arc<Self>, now: bool) {
        let reactor = self.reactor.as_ref().expect("parked off the event loop");
        reactor.park(
            self.key,
            &*self.socket,
            Arc::clone(self) as Arc<dyn Guest>,
            now,
        );
    }

    /// A thread with nothing to read leaves the input: on the loop the worker parks the
    /// connection (its empty buffer given to the worker's `spare`); otherwise a standby may
    /// take over.
    pub(super) fn stop_reading(
        self: &Arc<Self>,
        mut input: MutexGuard<'_, Input>,
        spare: &mut Vec<u8>,
    ) {
        if self.reactor.is_some() {
            input.release_buffer(spare);
            drop(input);
            self.threads.fetch_sub(1, Ordering::SeqCst);
            self.park(false);
        } else {
            drop(input);
            self.wake_standby();
        }
    }

    /// How long the connection has had no request in flight (zero while it has some).
    pub(super) fn idle_for(&self) -> Duration {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return Duration::ZERO;
        }
        self.activity.idle_for().unwrap_or(Duration::ZERO)
    }

    /// A worker's visit; `expired`: the reactor found it parked past the idle timeout, and
    /// unless something came meanwhile it is closed.
    pub(super) fn visit(self: Arc<Self>, scratch: &mut Scratch, expired: bool) {
        let span = self.span.clone();
        span.in_scope(move || self.visit_in_span(scratch, expired));
    }

    fn visit_in_span(self: Arc<Self>, scratch: &mut Scratch, expired: bool) {
        self.threads.fetch_add(1, Ordering::SeqCst);
        let mut input = self.lock_input();
        input.lend_buffer(&mut scratch.input_buffer);
        input.visit_requests = 0;
        // The socket was found readable (or the visit is for requests buffered already).
        input.nothing_expected = false;
        if expired
            && input.buffered() == 0
            && self.in_flight.load(Ordering::SeqCst) == 0
            && !input.try_receive()
        {
            input.stop(Err(Error::io(
                format!(
                    "closed after {} s without a request",
                    self.idle_timeout.as_secs_f64()
                ),
                std::io::ErrorKind::TimedOut.into(),
            )));
        }
        loop {
            match self.lead(input, scratch) {
                Led::Left => return,
                Led::GaveUp => match self.try_lock_input() {
                    Some(again) => input = again,
                    None => {
                        self.threads.fetch_sub(1, Ordering::SeqCst);
                        return;
                    }
                },
            }
        }
    }

    /// The input, waiting for it; a poisoned lock ends reading (see `try_lock_input`).
    fn lock_input(&self) -> MutexGuard<'_, Input> {
        match self.input.lock() {
            Ok(input) => input,
            Err(poisoned) => {
                let mut input = PoisonError::into_inner(poisoned);
                input.stop(Err(Error::Internal(
                    "a thread serving this connection panicked while reading".to_string(),
                )));
                input
            }
        }
    }
}
