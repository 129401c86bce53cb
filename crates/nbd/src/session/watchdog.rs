//! One thread for the whole process that notices a reading thread stuck in an export call
//! and wakes a standby of its connection to take the input over ([`Watch`]).
//!
//! Before, every connection's standby woke each [`STALL_TICK`] to look for itself: 500
//! wake-ups a second per busy connection. Now the standbys sleep until woken (by a hand-off,
//! by this thread, or after [`super::STANDBY_QUIET`] to leave), and this thread ticks for
//! all connections at once; after [`IDLE_TICKS_MAX`] ticks in which no connection's reader
//! was in or through a batched export call it sleeps too, until a reader entering such a
//! call finds it asleep ([`entering_call`]: one atomic load otherwise).
//!
//! Invariants: a reader that has been in the same export call (with its input free) since
//! the tick before the last is reported to its connection's standbys, so the requests
//! behind a stuck call wait at most about two ticks; the watchdog never sleeps while a
//! reader is in such a call (a reader stores that it is in a call before it looks whether
//! the watchdog sleeps, the watchdog stores that it sleeps before it looks at the readers
//! one last time, both sequentially consistent, so one of them sees the other); it holds a
//! connection's [`Watch`] only, never the connection, and lets go of it once the
//! connection is gone.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use super::STALL_TICK;
use crate::sync;

/// Ticks in a row with no reader in or through an export call after which the watchdog
/// sleeps until a reader wakes it: 100 ms.
const IDLE_TICKS_MAX: u32 = 50;

/// What the watchdog sees of one connection: its reading thread's export calls and its
/// standby threads.
#[derive(Default)]
pub(super) struct Watch {
    /// Export calls finished by reading threads serving into their batch...
    pub(super) calls: AtomicU64,
    /// ...and whether one is in such a call now (its input free).
    pub(super) in_call: AtomicBool,
    /// Standby threads wait on `wake` (under `standby`) for a hand-off or a stall.
    pub(super) standby: Mutex<()>,
    pub(super) wake: Condvar,
    pub(super) waiters: AtomicUsize,
    /// The watchdog's view at its last tick: `calls * 2 + in_call`.
    seen: AtomicU64,
    /// Handed to the watchdog already.
    registered: AtomicBool,
    /// On the event loop: what a stall does instead of waking a standby (it parks the
    /// connection, so that another worker reads on); called once per stuck call.
    pub(super) on_stall: OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// The view (`seen`, plus one) of the last stall reported to `on_stall`.
    stall_reported: AtomicU64,
}

impl Watch {
    /// Wakes one standby thread, if any waits.
    pub(super) fn wake_standby(&self) -> bool {
        if self.waiters.load(Ordering::SeqCst) == 0 {
            return false;
        }
        let _standby = sync::lock(&self.standby);
        self.wake.notify_one();
        true
    }

    /// Called by a reading thread that has just marked itself in an export call: puts the
    /// connection under watch the first time, and wakes the watchdog if it sleeps.
    pub(super) fn entering_call(self: &Arc<Self>) {
        if !self.registered.load(Ordering::Relaxed) && !self.registered.swap(true, Ordering::SeqCst)
        {
            register(Arc::clone(self));
        }
        let watchdog = watchdog();
        if watchdog.asleep.load(Ordering::SeqCst) {
            watchdog.kick();
        }
    }

    /// One tick's look: true if the reader is in or went through an export call since the
    /// last tick; a reader in the same call as at the last tick is stuck: a standby is woken.
    fn tick(&self) -> bool {
        let calls = self.calls.load(Ordering::SeqCst);
        let in_call = self.in_call.load(Ordering::SeqCst);
        let now = calls.wrapping_mul(2) | u64::from(in_call);
        let before = self.seen.swap(now, Ordering::Relaxed);
        if in_call && before == now {
            match self.on_stall.get() {
                Some(stalled) => {
                    if self.stall_reported.swap(now + 1, Ordering::SeqCst) != now + 1 {
                        stalled();
                    }
                }
                None => {
                    self.wake_standby();
                }
            }
        }
        in_call || before != now
    }
}

/// The process's watchdog: the connections it watches and whether it sleeps.
struct Watchdog {
    state: Mutex<State>,
    /// Wakes the watchdog's thread from its sleep.
    wake: Condvar,
    /// Mirrors `State::asleep`, so that readers look without the lock.
    asleep: AtomicBool,
}

#[derive(Default)]
struct State {
    watched: Vec<Arc<Watch>>,
    started: bool,
    asleep: bool,
}

fn watchdog() -> &'static Watchdog {
    static WATCHDOG: OnceLock<Watchdog> = OnceLock::new();
    WATCHDOG.get_or_init(|| Watchdog {
        state: Mutex::new(State::default()),
        wake: Condvar::new(),
        asleep: AtomicBool::new(false),
    })
}

/// Adds a connection's watch, starting the watchdog's thread the first time.
fn register(watch: Arc<Watch>) {
    let watchdog = watchdog();
    let mut state = sync::lock(&watchdog.state);
    state.watched.push(watch);
    if !state.started {
        let spawned = std::thread::Builder::new()
            .name("nbd-watchdog".to_owned())
            .stack_size(64 * 1024)
            .spawn(move || watchdog.run());
        match spawned {
            Ok(_) => state.started = true,
            // Tried again at the next connection; meanwhile stuck calls wait for the
            // standbys' quiet ticks.
            Err(error) => tracing::warn!(%error, "could not start the NBD watchdog thread"),
        }
    }
}

impl Watchdog {
    /// Wakes the watchdog's thread if it sleeps.
    fn kick(&self) {
        let mut state = sync::lock(&self.state);
        if state.asleep {
            state.asleep = false;
            self.asleep.store(false, Ordering::SeqCst);
            self.wake.notify_one();
        }
    }

    fn run(&self) {
        let mut idle_ticks = 0;
        loop {
            std::thread::sleep(STALL_TICK);
            let mut state = sync::lock(&self.state);
            // A watch only the watchdog holds belongs to a connection that has ended.
            state.watched.retain(|watch| Arc::strong_count(watch) > 1);
            let mut active = false;
            for watch in &state.watched {
                active |= watch.tick();
            }
            idle_ticks = if active { 0 } else { idle_ticks + 1 };
            if idle_ticks < IDLE_TICKS_MAX {
                continue;
            }
            state.asleep = true;
            self.asleep.store(true, Ordering::SeqCst);
            if state
                .watched
                .iter()
                .any(|watch| watch.in_call.load(Ordering::SeqCst))
            {
                state.asleep = false;
                self.asleep.store(false, Ordering::SeqCst);
                continue;
            }
            while state.asleep {
                state = sync::wait(&self.wake, state);
            }
            idle_ticks = 0;
        }
    }
}
