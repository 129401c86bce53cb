//! The adaptive spin before a connection's thread sleeps in `recv` between requests.
//!
//! At queue depth 1 a request's round trip is mostly two wake-ups: the server thread's in
//! `recv` and the client's in `poll` (see `docs/performance.md`, "Front end: syscalls per
//! request"). A thread that has just answered the only request in flight, with nothing
//! buffered, first tries non-blocking receives for a short window; a client that sends its
//! next request within it finds the server awake, and one wake-up per request is gone.
//!
//! Spinning pays only where the wake-up it saves is slow and the CPU it burns is idle: on a quiet
//! VM, where waking a halted vCPU takes tens of microseconds, it does; on a busy machine, where
//! wake-ups are quick and the spinning thread takes a CPU the client needs, it makes requests come
//! later. So [`Spin`] measures rather than guesses. The wait of a request is the time from the
//! thread starting to wait for it to having its first bytes (spin, sleep and wake-up included).
//! Requests are counted in epochs of [`EPOCH_REQUESTS`], each run spinning or sleeping, and now and
//! then an epoch (a probe) runs the mode not preferred: after [`PROBE_EVERY`] epochs, then after
//! twice as many each time the preference holds, up to [`PROBE_EVERY_MAX`], and again after
//! [`PROBE_EVERY`] once it changes, so a steady state pays for few probes. Two adjacent epochs of
//! different modes saw nearly the same load, so each such pair gives the fraction of the wait that
//! spinning saved (negative if it cost); a smoothed mean of these fractions decides, and spinning
//! is preferred only while it saves at least [`SPIN_GAIN_PERCENT`]. (Comparing each mode's own mean
//! instead let the load's swings between epochs decide: on a busy machine, a quarter of the epochs
//! spun although spinning lengthened the wait.)
//!
//! Within spinning epochs the window adapts to each request:
//! - a request caught by the spin keeps the window (and widens it to twice the wait, if
//!   that is more), up to `max`;
//! - a request that arrived in a blocking read within `max` (so a long enough spin would
//!   have caught it) sets the window to twice that wait;
//! - a request that came later halves the window, and below [`WINDOW_MIN`] it is 0: a
//!   client that pauses stops the spinning within a few requests, each miss costing at most
//!   the window, and a connection that stays quiet costs at most one window in all;
//! - a read timeout (the connection is quiet) sets it to 0.
//!
//! Spinning threads are limited process-wide to half the CPUs ([`Slot`]), so spinning
//! connections never take every CPU from the clients and the threads that serve; and a
//! thread spins for its next request only while no other connection has requests in flight
//! ([`others_busy`]): the measurement above sees only its own connection's wait, not the CPU
//! its spin takes from the others.
//!
//! A thread spins only for a client that waits for each reply before it sends its next
//! request ([`Bursts`]): one whose requests come several per wait (queue depth 32) shares a
//! wake-up among them, and the spin's failing receives then cost more CPU than the wake-up
//! they save (at queue depth 32 on two connections on the event loop, 2.5 empty `recv`s per
//! read, with the machine loaded by other work).
//!
//! Configuration: `Config::spin_max` (`thinpool serve --spin-us`, 50 µs by default, 0 turns
//! spinning off) is the widest window. The same spin waits for a WRITE payload that trails its
//! header. The process-wide limits came from measurement: with 16 busy connections on 2 CPUs,
//! spinning had taken a quarter of the server's CPU.

use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// Narrowest window worth spinning: a few non-blocking `recv` calls.
const WINDOW_MIN: Duration = Duration::from_micros(2);

/// Requests per epoch of one mode.
const EPOCH_REQUESTS: u32 = 256;

/// Epochs between probes of the mode that is not preferred, after the preference changed...
const PROBE_EVERY: u32 = 16;
/// ...and at most, while it holds.
const PROBE_EVERY_MAX: u32 = 256;

/// Spinning is preferred only if its mean wait is at least this much shorter.
const SPIN_GAIN_PERCENT: u32 = 10;

/// Longest wait counted in a mean: a client's pauses say nothing about wake-ups.
const WAIT_COUNTED_MAX: Duration = Duration::from_millis(1);

/// Largest burst counted in [`Bursts`]' mean (one large burst says enough).
const BURST_COUNTED_MAX: u32 = 16;

/// How many requests a reader reads per wait (a *burst*: from a wait with nothing
/// buffered to the next), as a running mean in sixteenths of a request; new bursts weigh a
/// quarter. A client that keeps one request in flight sends bursts of one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Bursts {
    requests: u32,
    mean_sixteenths: u32,
}

impl Bursts {
    /// One more request read in this burst.
    pub(super) fn request(&mut self) {
        self.requests = self.requests.saturating_add(1);
    }

    /// The reader is about to wait with nothing buffered: the burst, if it read anything,
    /// ends.
    pub(super) fn waiting(&mut self) {
        if self.requests == 0 {
            return;
        }
        let burst_sixteenths = self.requests.min(BURST_COUNTED_MAX) * 16;
        self.mean_sixteenths = (self.mean_sixteenths * 3 + burst_sixteenths) / 4;
        self.requests = 0;
    }

    /// Bursts are of about one request (mean under 1.5, or none seen yet): the client
    /// waits for each reply, and a spin may save the wake-up of each.
    pub(super) fn lone(&self) -> bool {
        self.mean_sixteenths < 24
    }
}

/// The spin window of one connection's input, and the measurement that decides whether to
/// spin at all.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Spin {
    /// Longest window; zero turns spinning off.
    max: Duration,
    /// The window while spinning; zero spins not at all.
    window: Duration,
    /// Whether this epoch spins.
    spinning: bool,
    /// Requests counted in this epoch, and the sum of their waits.
    epoch_requests: u32,
    epoch_wait: Duration,
    /// Epochs since the last probe, and how many to run before the next.
    since_probe: u32,
    probe_every: u32,
    /// The mode preferred at the end of the last epoch.
    preferred: Option<bool>,
    /// The last epoch: whether it spun, and its mean wait.
    previous: Option<(bool, Duration)>,
    /// Smoothed fraction of the wait that spinning saved, over pairs of adjacent epochs of
    /// different modes; `None` until the first pair.
    gain: Option<f64>,
}

impl Spin {
    /// A connection starts with an epoch of spinning at full width, then one of sleeping:
    /// the first requests show whether spinning pays.
    pub(super) fn new(max: Duration) -> Self {
        Spin {
            max,
            window: max,
            spinning: !max.is_zero(),
            epoch_requests: 0,
            epoch_wait: Duration::ZERO,
            since_probe: 0,
            probe_every: PROBE_EVERY,
            preferred: None,
            previous: None,
            gain: None,
        }
    }

    pub(super) fn enabled(&self) -> bool {
        !self.max.is_zero()
    }

    /// How long to spin for the next request; zero to sleep at once.
    pub(super) fn window(&self) -> Duration {
        if self.spinning {
            self.window
        } else {
            Duration::ZERO
        }
    }

    /// A request arrived `waited` after the thread started waiting for it, during the spin.
    pub(super) fn caught(&mut self, waited: Duration) {
        self.window = self.window.max(waited.saturating_mul(2)).min(self.max);
        self.count(waited);
    }

    /// A request arrived `waited` after the thread started waiting, in a blocking read (the
    /// window had run out, was zero, or no spin slot was free).
    pub(super) fn slept(&mut self, waited: Duration) {
        if !self.enabled() {
            return;
        }
        if waited <= self.max {
            self.window = waited.saturating_mul(2).clamp(WINDOW_MIN, self.max);
        } else {
            self.window /= 2;
            if self.window < WINDOW_MIN {
                self.window = Duration::ZERO;
            }
        }
        self.count(waited);
    }

    /// The read timed out: the connection is quiet.
    pub(super) fn quiet(&mut self) {
        self.window = Duration::ZERO;
    }

    /// Counts one request's wait in the epoch; at the epoch's end, picks the next mode.
    fn count(&mut self, waited: Duration) {
        self.epoch_requests += 1;
        self.epoch_wait += waited.min(WAIT_COUNTED_MAX);
        if self.epoch_requests < EPOCH_REQUESTS {
            return;
        }
        let mean = self.epoch_wait / self.epoch_requests;
        if let Some((previous_spun, previous_mean)) = self.previous {
            if previous_spun != self.spinning {
                let (spinning, sleeping) = if self.spinning {
                    (mean, previous_mean)
                } else {
                    (previous_mean, mean)
                };
                let sleeping_s = sleeping.as_secs_f64().max(1e-9);
                let gain = (sleeping_s - spinning.as_secs_f64()) / sleeping_s;
                self.gain = Some(self.gain.map_or(gain, |old| 0.75 * old + 0.25 * gain));
            }
        }
        self.previous = Some((self.spinning, mean));
        self.epoch_requests = 0;
        self.epoch_wait = Duration::ZERO;
        let preferred = match self.gain {
            // Not compared yet: run the other mode.
            None => !self.spinning,
            Some(gain) => gain * 100.0 >= f64::from(SPIN_GAIN_PERCENT),
        };
        if self.gain.is_some() && self.preferred.is_some_and(|before| before != preferred) {
            self.probe_every = PROBE_EVERY;
            self.since_probe = 0;
        }
        self.preferred = Some(preferred);
        self.since_probe += 1;
        self.spinning = if self.since_probe >= self.probe_every {
            self.since_probe = 0;
            self.probe_every = (self.probe_every * 2).min(PROBE_EVERY_MAX);
            !preferred
        } else {
            preferred
        };
        if self.spinning && self.window.is_zero() {
            // A probe, or spinning won: give it a window to show what it does.
            self.window = self.max;
        }
        tracing::trace!(
            mean_wait_us = mean.as_secs_f64() * 1e6,
            gain_percent = self.gain.map(|gain| gain * 100.0),
            spinning_next = self.spinning,
            "spin epoch"
        );
    }
}

/// Connections of the process with requests in flight now: counted up when a connection's
/// count of requests in flight leaves 0 and down when it returns to 0 (the two may be seen
/// in either order, so the count may dip below 0 for a moment).
static BUSY_CONNECTIONS: AtomicIsize = AtomicIsize::new(0);

/// A connection's first request in flight (its count left 0).
pub(super) fn connection_busy() {
    BUSY_CONNECTIONS.fetch_add(1, Ordering::AcqRel);
}

/// A connection's last request in flight answered (its count returned to 0).
pub(super) fn connection_idle() {
    BUSY_CONNECTIONS.fetch_sub(1, Ordering::AcqRel);
}

/// True while some connection has requests in flight. A thread whose own connection has
/// none spins for its next request only if this is false: the CPU a spin burns is then
/// idle, whereas with other connections busy it is theirs and their clients' (with 16
/// busy connections on 2 CPUs, spinning took a quarter of the server's CPU).
pub(super) fn others_busy() -> bool {
    BUSY_CONNECTIONS.load(Ordering::Acquire) > 0
}

/// Threads spinning now, over the whole process.
static SPINNING: AtomicUsize = AtomicUsize::new(0);

/// Most threads that may spin at once: half the CPUs, at least one.
fn spinning_max() -> usize {
    static MAX: OnceLock<usize> = OnceLock::new();
    *MAX.get_or_init(|| {
        std::thread::available_parallelism()
            .map(|count| count.get() / 2)
            .unwrap_or(1)
            .max(1)
    })
}

/// The right to spin, held while spinning; released on drop.
pub(super) struct Slot(());

impl Slot {
    /// A slot if fewer than [`spinning_max`] threads spin now.
    pub(super) fn take() -> Option<Slot> {
        SPINNING
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |spinning| {
                (spinning < spinning_max()).then_some(spinning + 1)
            })
            .ok()
            .map(|_| Slot(()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let before = SPINNING.fetch_sub(1, Ordering::AcqRel);
        assert!(before > 0, "released a spin slot that was not taken");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_micros(50);

    fn us(micros: u64) -> Duration {
        Duration::from_micros(micros)
    }

    /// Runs one whole epoch of requests, each waiting `waited`: caught by the spin if the
    /// window covers it, else after a blocking read, as the input would report them.
    fn epoch(spin: &mut Spin, waited: Duration) {
        for _ in 0..EPOCH_REQUESTS {
            if waited <= spin.window() {
                spin.caught(waited);
            } else {
                spin.slept(waited);
            }
        }
    }

    #[test]
    fn requests_caught_keep_the_window_and_late_ones_shrink_it_to_zero() {
        let mut spin = Spin::new(MAX);
        assert_eq!(spin.window(), MAX);
        spin.caught(us(10));
        assert_eq!(spin.window(), MAX, "a catch keeps the window");
        // A client that pauses for 1 ms between requests: the window halves each time
        // and reaches zero.
        let mut misses = 0;
        while spin.window() > Duration::ZERO {
            spin.slept(us(1000));
            misses += 1;
            assert!(misses < 10, "the window never reached zero");
        }
        assert!(misses >= 2, "one miss closed the window");
        spin.slept(us(1000));
        assert_eq!(
            spin.window(),
            Duration::ZERO,
            "stays closed while requests come late"
        );
    }

    #[test]
    fn a_request_a_longer_spin_would_have_caught_opens_the_window() {
        let mut spin = Spin::new(MAX);
        spin.quiet();
        assert_eq!(spin.window(), Duration::ZERO);
        spin.slept(us(15));
        assert_eq!(spin.window(), us(30));
        spin.caught(us(20));
        assert_eq!(spin.window(), us(40));
        spin.slept(us(40));
        assert_eq!(spin.window(), MAX, "never wider than the maximum");
        spin.slept(Duration::ZERO);
        assert_eq!(spin.window(), WINDOW_MIN);
    }

    #[test]
    fn the_mode_with_the_shorter_wait_wins_and_the_other_is_probed() {
        // Spinning catches requests after 10 µs; sleeping gets them after 40 µs (slow
        // wake-ups): after one epoch of each, spinning wins.
        let mut spin = Spin::new(MAX);
        epoch(&mut spin, us(10));
        assert_eq!(spin.window(), Duration::ZERO, "the second epoch sleeps");
        epoch(&mut spin, us(40));
        assert!(spin.window() > Duration::ZERO, "spinning won");
        // The load changes: spinning now makes requests come after 45 µs, sleeping after
        // 30 µs. The probes (sleeping epochs) show it, and within a few sleeping wins.
        let mut sleeping_epochs = 0;
        for _ in 0..6 * PROBE_EVERY {
            if spin.window() > Duration::ZERO {
                epoch(&mut spin, us(45));
            } else {
                sleeping_epochs += 1;
                epoch(&mut spin, us(30));
            }
        }
        assert!(spin.window().is_zero(), "sleeping did not win");
        assert!(sleeping_epochs > PROBE_EVERY, "{sleeping_epochs}");
        // While sleeping wins, spinning is still tried now and then, less and less often.
        let mut spinning_epochs = 0;
        for _ in 0..PROBE_EVERY_MAX + PROBE_EVERY {
            if spin.window() > Duration::ZERO {
                spinning_epochs += 1;
                epoch(&mut spin, us(45));
            } else {
                epoch(&mut spin, us(30));
            }
        }
        assert!((1..=5).contains(&spinning_epochs), "{spinning_epochs}");
    }

    #[test]
    fn a_client_that_pauses_gets_no_spin_beyond_a_few_misses() {
        let mut spin = Spin::new(MAX);
        let mut spun = Duration::ZERO;
        for _ in 0..20 * EPOCH_REQUESTS {
            let window = spin.window();
            spun += window;
            spin.slept(us(5000));
        }
        // Each spinning epoch (the first, then probes) spins a halving window a few times.
        assert!(spun < MAX * 2 * 4, "spun {spun:?}");
    }

    #[test]
    fn bursts_of_one_request_allow_the_spin_and_larger_ones_stop_it() {
        let mut bursts = Bursts::default();
        assert!(bursts.lone(), "nothing seen yet");
        let burst = |bursts: &mut Bursts, requests: u32| {
            for _ in 0..requests {
                bursts.request();
            }
            bursts.waiting();
        };
        for _ in 0..100 {
            burst(&mut bursts, 1);
            assert!(bursts.lone());
        }
        // A wait that brings nothing is no burst.
        bursts.waiting();
        assert!(bursts.lone());
        // Queue depth 32: a few requests per wait stop the spin within a few bursts...
        let mut bursts_until_stopped = 0;
        while bursts.lone() {
            burst(&mut bursts, 4);
            bursts_until_stopped += 1;
            assert!(bursts_until_stopped <= 3, "still spinning");
        }
        // ...and, once they go on, one lone request among them does not start it again.
        for _ in 0..4 {
            burst(&mut bursts, 4);
        }
        burst(&mut bursts, 1);
        assert!(!bursts.lone());
        // Back to queue depth 1: it spins again within a few requests.
        let mut lone_bursts = 0;
        while !bursts.lone() {
            burst(&mut bursts, 1);
            lone_bursts += 1;
            assert!(lone_bursts <= 8, "never spun again");
        }
    }

    #[test]
    fn a_zero_maximum_never_spins() {
        let mut spin = Spin::new(Duration::ZERO);
        assert!(!spin.enabled());
        spin.slept(Duration::ZERO);
        spin.caught(us(1));
        assert_eq!(spin.window(), Duration::ZERO);
    }

    #[test]
    fn slots_are_limited_and_returned() {
        let max = spinning_max();
        let mut held = Vec::new();
        // Other tests may hold slots for a moment: take what is free, at most `max`.
        while let Some(slot) = Slot::take() {
            held.push(slot);
            assert!(held.len() <= max, "more than {max} slots taken");
        }
        drop(held);
        assert!(SPINNING.load(Ordering::Acquire) <= max);
    }
}
