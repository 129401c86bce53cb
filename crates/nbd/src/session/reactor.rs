//! The event loop that serves connections in transmission on a small fixed set of threads
//! ([`Reactor`], `Config::event_loop`), instead of a thread per connection.
//!
//! A connection with nothing to read is *parked*: its socket is armed in one `epoll`
//! (one-shot, level-triggered, so bytes that came before the arming still wake it) and the
//! connection is kept in the reactor's table by its key; no thread waits for it and its
//! empty input buffer goes to the worker that parked it, which lends it to the next
//! connection it visits (a parked connection holds none, a worker at most one). A worker
//! (`loop_threads` of them, by default one per CPU) waits in `epoll_wait` for one ready
//! connection at a time, takes it out of the table and *visits* it: it runs the session's
//! reading loop (`Connection::lead`: the same reading, checks, budgets, batching and replies
//! as a connection thread) until no whole request is buffered and a non-blocking receive
//! finds nothing (or, right after the batch went out, none is expected to: the arming
//! finds what came), or it has read [`VISIT_REQUESTS_MAX`] requests (then the connection
//! goes to the back of the kernel's ready list), and parks it again. A slow request (FLUSH,
//! FUA, TRIM, large payloads) parks the connection before the worker serves it, so another
//! worker reads on; a READ stuck in the export is reported by the session's watchdog, which
//! parks its connection the same way.
//!
//! What may block a worker is what blocks a connection thread today: an export call, a
//! reply write to a client that does not read (up to `write_timeout`), the rest of a WRITE
//! payload from a client that stalls inside it. So the reactor keeps `loop_threads`
//! workers *unblocked*: a supervisor thread looks at the workers every [`STUCK_TICK`] while
//! any is visiting, and a worker found in the same visit as at its last look is counted as
//! stuck and replaced by a new one; a stuck worker that comes back while enough others
//! run leaves. A stalled connection therefore holds one thread while it stalls (as before)
//! and never the connections parked behind it. The request header itself is never waited
//! for: a partial header stays in the input buffer and the connection is parked.
//!
//! What is parked is a [`Guest`]: a session, or a connection in the handshake (the server
//! parks it after sending the greeting; its visit runs the handshake and then parks the
//! session under the same key). Deadlines: every quarter of the shorter of the idle timeout
//! and the handshake timeout (at most 30 s) one worker sweeps the parked guests and visits
//! as expired those past theirs: a session parked that long with nothing in flight, idle
//! that long, and nothing readable is closed with the same error as a connection thread
//! gives; a handshake past its deadline ends with the handshake's timeout error.
//!
//! Invariants: a connection is in the table at most once, and only a thread that has just
//! let go of its input (after its last receive found nothing) or the watchdog parks it;
//! every visit either reads the socket or parks the connection again, so no readiness is
//! lost; a visit holds the connection, the table only parked ones, so a connection whose
//! session ended is dropped by its last visitor (and reports its end, see `session`).

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rustix::event::{epoll, eventfd, EventfdFlags, Timespec};

use super::{Connection, Scratch};
use crate::sync;

/// Requests a worker reads from one connection in one visit before it parks the
/// connection behind the others that are ready.
pub(super) const VISIT_REQUESTS_MAX: u32 = 64;

/// How often the supervisor looks for stuck workers while any visits.
const STUCK_TICK: Duration = Duration::from_millis(10);

/// How often the supervisor looks while no worker visits (it is not woken by a visit).
const QUIET_TICK: Duration = Duration::from_millis(100);

/// The epoll key of the reactor's wake-up eventfd (connection keys start at 1).
const WAKE_KEY: u64 = 0;

/// The epoll key of the eventfd that is readable while connections wait in `ready`.
const READY_KEY: u64 = u64::MAX;

/// A server's event loop; see the module doc.
pub(crate) struct Reactor {
    inner: Arc<Inner>,
}

struct Inner {
    epoll: OwnedFd,
    /// Readable once the reactor stops: wakes every worker.
    wake: OwnedFd,
    parked: Mutex<HashMap<u64, Parked>>,
    /// Parked connections to visit now, whatever their sockets say (their input holds
    /// requests already received); `ready_event` is readable while it is not empty.
    ready: Mutex<VecDeque<u64>>,
    ready_event: OwnedFd,
    workers: Mutex<Workers>,
    workers_changed: Condvar,
    /// Workers in a visit now.
    visiting: AtomicUsize,
    stopping: AtomicBool,
    /// Workers kept unblocked.
    target: usize,
    stack_bytes: usize,
    /// How often parked guests are checked against their deadlines.
    sweep_tick: Duration,
    last_sweep: Mutex<Instant>,
}

struct Parked {
    guest: Arc<dyn Guest>,
    since: Instant,
}

/// What the reactor parks and visits: a session in transmission (`Connection`) or a
/// connection in the handshake (the server's).
pub(crate) trait Guest: Send + Sync {
    /// A worker's visit, with the worker's scratch buffers; `expired`: the sweep found
    /// [`Guest::expired`] true, and the guest ends unless something came meanwhile.
    fn visit(self: Arc<Self>, scratch: &mut Scratch, expired: bool);
    /// Whether the guest, parked since `since`, is past its deadline (a sweep then visits
    /// it with `expired`).
    fn expired(&self, since: Instant) -> bool;
}

impl Guest for Connection {
    fn visit(self: Arc<Self>, scratch: &mut Scratch, expired: bool) {
        Connection::visit(self, scratch, expired);
    }

    fn expired(&self, since: Instant) -> bool {
        since.elapsed() >= self.idle_timeout && self.idle_for() >= self.idle_timeout
    }
}

#[derive(Default)]
struct Workers {
    /// Workers running, stuck or not.
    total: usize,
    /// Workers not counted as stuck.
    live: usize,
    slots: Vec<Arc<Slot>>,
}

/// What the supervisor sees of one worker.
#[derive(Default)]
struct Slot {
    /// Visits begun plus visits ended: odd while in a visit.
    visits: AtomicU64,
    /// `visits` at the supervisor's last look.
    seen: AtomicU64,
    /// Counted as stuck (not in `live`); changed under the workers' lock.
    stuck: AtomicBool,
}

impl Reactor {
    /// A reactor with `threads` workers (at least 1) whose parked guests are checked
    /// against their deadlines every quarter of `deadline_min` (at most 30 s).
    pub(crate) fn new(
        threads: usize,
        deadline_min: Duration,
        stack_bytes: usize,
    ) -> std::io::Result<Reactor> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        let wake = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        let ready_event = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        for (fd, key) in [(&wake, WAKE_KEY), (&ready_event, READY_KEY)] {
            epoll::add(
                &epoll,
                fd,
                epoll::EventData::new_u64(key),
                epoll::EventFlags::IN,
            )?;
        }
        let inner = Arc::new(Inner {
            epoll,
            wake,
            parked: Mutex::new(HashMap::new()),
            ready: Mutex::new(VecDeque::new()),
            ready_event,
            workers: Mutex::new(Workers::default()),
            workers_changed: Condvar::new(),
            visiting: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
            target: threads.max(1),
            stack_bytes,
            sweep_tick: (deadline_min / 4).clamp(Duration::from_millis(1), Duration::from_secs(30)),
            last_sweep: Mutex::new(Instant::now()),
        });
        {
            let mut workers = sync::lock(&inner.workers);
            for _ in 0..inner.target {
                inner.spawn_worker(&mut workers);
            }
        }
        let supervised = Arc::clone(&inner);
        std::thread::Builder::new()
            .name("nbd-loop-watch".to_owned())
            .stack_size(64 * 1024)
            .spawn(move || supervised.supervise())?;
        Ok(Reactor { inner })
    }

    /// Parks `guest` (key `key`, socket `socket`): a worker visits it once the socket is
    /// readable (or closed), or at once if `now` (it may hold requests received already).
    pub(crate) fn park(&self, key: u64, socket: impl AsFd, guest: Arc<dyn Guest>, now: bool) {
        assert!(
            key != WAKE_KEY && key != READY_KEY,
            "connection key {key} is the reactor's own"
        );
        let since = Instant::now();
        sync::lock(&self.inner.parked).insert(key, Parked { guest, since });
        if now {
            let mut ready = sync::lock(&self.inner.ready);
            ready.push_back(key);
            if ready.len() == 1 {
                signal(&self.inner.ready_event);
            }
            return;
        }
        let data = epoll::EventData::new_u64(key);
        let flags = epoll::EventFlags::IN | epoll::EventFlags::RDHUP | epoll::EventFlags::ONESHOT;
        let armed = match epoll::modify(&self.inner.epoll, &socket, data, flags) {
            Err(rustix::io::Errno::NOENT) => epoll::add(&self.inner.epoll, &socket, data, flags),
            other => other,
        };
        if let Err(error) = armed {
            // The socket cannot be watched: close it, and a visit ends the session.
            tracing::warn!(%error, "could not watch a connection's socket; closing it");
            let _ = rustix::net::shutdown(&socket, rustix::net::Shutdown::Both);
            if let Some(parked) = self.inner.take(key) {
                parked.visit(&mut Scratch::default(), false);
            }
        }
    }

    /// Takes the guest `key` out of the table if it is parked: its session has ended (a
    /// worker parked it while the one stuck in an export call read on).
    pub(super) fn unpark(&self, key: u64) -> Option<Arc<dyn Guest>> {
        self.inner.take(key).map(|parked| parked.guest)
    }

    /// Stops watching `socket` (its connection has ended).
    pub(crate) fn forget(&self, socket: impl AsFd) {
        let _ = epoll::delete(&self.inner.epoll, &socket);
    }

    /// Stops the workers (after the server's connections have ended) and drops the
    /// connections still parked; waits up to `timeout` for the workers to leave.
    pub(crate) fn stop(&self, timeout: Duration) {
        let inner = &self.inner;
        inner.stopping.store(true, Ordering::SeqCst);
        signal(&inner.wake);
        let left = std::mem::take(&mut *sync::lock(&inner.parked));
        drop(left);
        let deadline = Instant::now() + timeout;
        let mut workers = sync::lock(&inner.workers);
        while workers.total > 0 {
            let now = Instant::now();
            if now >= deadline {
                tracing::warn!(workers = workers.total, "NBD event loop workers still busy");
                return;
            }
            workers = sync::wait_timeout(&inner.workers_changed, workers, deadline - now).0;
        }
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        if !self.inner.stopping.load(Ordering::SeqCst) {
            self.stop(Duration::from_secs(1));
        }
    }
}

impl Parked {
    fn visit(self, scratch: &mut Scratch, expired: bool) {
        self.guest.visit(scratch, expired);
    }
}

impl Inner {
    fn take(&self, key: u64) -> Option<Parked> {
        sync::lock(&self.parked).remove(&key)
    }

    /// The next connection to visit at once, if any (`ready_event` is reset once none is
    /// left).
    fn next_ready(&self) -> Option<Parked> {
        loop {
            let key = {
                let mut ready = sync::lock(&self.ready);
                let key = ready.pop_front()?;
                if ready.is_empty() {
                    let mut count = [0u8; 8];
                    let _ = rustix::io::read(&self.ready_event, &mut count);
                }
                key
            };
            // No entry: a worker took it already, woken by its socket.
            if let Some(parked) = self.take(key) {
                return Some(parked);
            }
        }
    }

    fn spawn_worker(self: &Arc<Self>, workers: &mut Workers) {
        let slot = Arc::new(Slot::default());
        let inner = Arc::clone(self);
        let worker_slot = Arc::clone(&slot);
        let spawned = std::thread::Builder::new()
            .name("nbd-loop".to_owned())
            .stack_size(self.stack_bytes)
            .spawn(move || inner.run_worker(&worker_slot));
        match spawned {
            Ok(_) => {
                workers.total += 1;
                workers.live += 1;
                workers.slots.push(slot);
            }
            Err(error) => tracing::warn!(%error, "could not start an NBD event loop worker"),
        }
    }

    fn run_worker(self: &Arc<Self>, slot: &Arc<Slot>) {
        let mut scratch = Scratch::default();
        let mut events = Vec::with_capacity(1);
        let timeout = Timespec::try_from(self.sweep_tick).unwrap_or(Timespec {
            tv_sec: 30,
            tv_nsec: 0,
        });
        while !self.stopping.load(Ordering::SeqCst) {
            if let Some(parked) = self.next_ready() {
                self.visit(slot, parked, &mut scratch, false);
                if !self.stay(slot) {
                    return;
                }
                continue;
            }
            events.clear();
            match epoll::wait(
                &self.epoll,
                rustix::buffer::spare_capacity(&mut events),
                Some(&timeout),
            ) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(error) => {
                    tracing::warn!(%error, "epoll_wait failed");
                    std::thread::sleep(self.sweep_tick);
                }
            }
            for event in events.drain(..) {
                let key = event.data.u64();
                if key == WAKE_KEY || key == READY_KEY {
                    continue;
                }
                // No entry: the connection was taken by a sweep, or was parked twice.
                if let Some(parked) = self.take(key) {
                    self.visit(slot, parked, &mut scratch, false);
                }
            }
            self.sweep(slot, &mut scratch);
            if !self.stay(slot) {
                return;
            }
        }
        let mut workers = sync::lock(&self.workers);
        self.leave(&mut workers, slot);
    }

    /// One visit, watched by the supervisor; a panic ends the connection, not the worker.
    fn visit(&self, slot: &Slot, parked: Parked, scratch: &mut Scratch, expired: bool) {
        slot.visits.fetch_add(1, Ordering::SeqCst);
        self.visiting.fetch_add(1, Ordering::SeqCst);
        let visited = panic::catch_unwind(AssertUnwindSafe(|| parked.visit(scratch, expired)));
        if visited.is_err() {
            // The batch may hold replies of the connection that panicked.
            *scratch = Scratch::default();
        }
        self.visiting.fetch_sub(1, Ordering::SeqCst);
        slot.visits.fetch_add(1, Ordering::SeqCst);
    }

    /// After a worker's visits: false if it was counted as stuck and enough others run, so
    /// it leaves (and has left the count).
    fn stay(&self, slot: &Arc<Slot>) -> bool {
        if !slot.stuck.load(Ordering::SeqCst) {
            return true;
        }
        let mut workers = sync::lock(&self.workers);
        slot.stuck.store(false, Ordering::SeqCst);
        if workers.live >= self.target {
            workers.live += 1;
            self.leave(&mut workers, slot);
            return false;
        }
        workers.live += 1;
        true
    }

    fn leave(&self, workers: &mut Workers, slot: &Arc<Slot>) {
        workers.slots.retain(|other| !Arc::ptr_eq(other, slot));
        workers.total -= 1;
        if !slot.stuck.load(Ordering::SeqCst) {
            workers.live -= 1;
        }
        self.workers_changed.notify_all();
    }

    /// Visits, as expired, the guests parked past their deadlines (sessions parked and
    /// idle for the idle timeout, handshakes past theirs), at most once per sweep tick, by
    /// one worker.
    fn sweep(&self, slot: &Slot, scratch: &mut Scratch) {
        {
            let Ok(mut last) = self.last_sweep.try_lock() else {
                return;
            };
            if last.elapsed() < self.sweep_tick {
                return;
            }
            *last = Instant::now();
        }
        let expired: Vec<Parked> = {
            let mut parked = sync::lock(&self.parked);
            let keys: Vec<u64> = parked
                .iter()
                .filter(|(_, entry)| entry.guest.expired(entry.since))
                .map(|(key, _)| *key)
                .collect();
            keys.iter().filter_map(|key| parked.remove(key)).collect()
        };
        for parked in expired {
            self.visit(slot, parked, scratch, true);
        }
    }

    /// The supervisor: counts workers that stay in one visit from one look to the next as
    /// stuck and starts others so that `target` are not stuck.
    fn supervise(self: &Arc<Self>) {
        while !self.stopping.load(Ordering::SeqCst) {
            let tick = if self.visiting.load(Ordering::SeqCst) > 0 {
                STUCK_TICK
            } else {
                QUIET_TICK
            };
            let workers = sync::lock(&self.workers);
            let (mut workers, _) = sync::wait_timeout(&self.workers_changed, workers, tick);
            if self.stopping.load(Ordering::SeqCst) {
                return;
            }
            let mut newly_stuck = 0;
            for slot in &workers.slots {
                let visits = slot.visits.load(Ordering::SeqCst);
                let seen = slot.seen.swap(visits, Ordering::SeqCst);
                if visits % 2 == 1 && visits == seen && !slot.stuck.load(Ordering::SeqCst) {
                    slot.stuck.store(true, Ordering::SeqCst);
                    newly_stuck += 1;
                }
            }
            workers.live -= newly_stuck;
            while workers.live < self.target {
                let before = workers.total;
                self.spawn_worker(&mut workers);
                if workers.total == before {
                    break;
                }
            }
        }
    }
}

/// Adds one to an eventfd's counter, making it readable.
#[allow(
    clippy::host_endian_bytes,
    reason = "an eventfd counter is a host-endian u64"
)]
fn signal(eventfd: &OwnedFd) {
    let _ = rustix::io::write(eventfd, &1u64.to_ne_bytes());
}
