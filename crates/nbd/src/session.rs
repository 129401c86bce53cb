//! The transmission phase of one connection: reading requests, running them on a few
//! threads, and writing replies in any order.
//!
//! Threading: one thread at a time holds the input lock, which guards the socket's read
//! side and a buffer ([`Input`]), so one `recv` picks up every request header already queued.
//! That thread, the reader, serves the quick requests it takes itself (READs and WRITEs up to
//! [`BATCH_REQUEST_BYTES_MAX`] without FUA, BLOCK_STATUS; or any READ, WRITE without FUA or
//! BLOCK_STATUS when it is alone on the connection) and puts their replies in its [`Batch`],
//! which goes out in one write when the next request is not buffered whole (and one
//! non-blocking receive, tried while such tries often find more, brought none:
//! [`Input::receive_more`]), after [`batch::BATCH_REQUESTS_MAX`] replies, or before anything
//! that may block; so at queue
//! depth 64 one `recv`, a `pread` per request and one `send` per batch serve many requests,
//! with no wake-up of another thread. The reader gives the input lock up during each export
//! call (nobody waits on the lock itself, so that costs two atomic operations) and takes it
//! back after. A slow request (FLUSH, FUA, TRIM, WRITE_ZEROES, CACHE, larger READs and
//! WRITEs) is handed off: the reader sends its batch, wakes a standby thread (or starts one)
//! to read on, serves the request and writes its reply by itself, and becomes a standby.
//! WRITE payloads are copied from what the buffer already holds and the rest is read
//! straight into the thread's payload buffer. Each thread reuses one payload buffer up to
//! [`RETAINED_BUFFER_BYTES`] (larger ones are allocated per request and freed after it; a
//! larger WRITE's is received into the spare capacity of a fresh vector, never zeroed) and
//! one batch buffer of [`batch::BATCH_BYTES_MAX`].
//!
//! Standby threads wait on a condition variable, not on the input lock. A reader serving
//! into its batch keeps one standby ready (started if there is none); a standby takes the
//! input when woken by a hand-off, when no reader is in an export call and the input is
//! free, or when the process's watchdog ([`watchdog`], one thread ticking every
//! [`STALL_TICK`] for all connections, asleep while none is busy) wakes it because a
//! reader has been in the same export call from one tick to the next: a READ stuck on a
//! disk or a gate holds up the replies already in its thread's batch, but not the requests
//! sent after it.
//!
//! Thread count: a session starts on the connection's thread alone, and grows (up to
//! `threads`) by hand-offs and standbys. The socket's read timeout is a tick (at most
//! [`IDLE_TICK_MAX`]): a reader that wakes on it with nothing in flight marks the connection
//! quiet and leaves unless it is the last thread; a standby leaves when woken by nothing for
//! [`STANDBY_QUIET`] with nothing in flight; so a quiet connection costs
//! one thread. Ticks in a row with nothing received and nothing in flight add up to the idle
//! timeout, which closes the connection. The last thread to leave reports the session's end
//! (`OnEnd`), so nothing waits for a join.
//!
//! Invariants: at most `requests_in_flight_max` requests and about `bytes_in_flight_max`
//! payload bytes are between "header read" and "reply written" at once (a batch holds the
//! slots of its requests until it is sent, and a reader sends its batch before it waits for
//! a slot, which may be one of its own); payloads over [`RETAINED_BUFFER_BYTES`] also draw on
//! the server-wide budget ([`Budget::acquire_fair`]), where a connection past its fair share
//! waits once the budget is half used. A connection whose client does not read replies
//! blocks in its own reply write, then in its own budget while holding its own input lock:
//! it stops reading requests, and of the server's budget it holds at most its own byte
//! limit, and only while the budget is under half used. A request reaches the export only
//! with a range inside the export and a payload of at most
//! [`PAYLOAD_LENGTH_MAX`](crate::protocol::PAYLOAD_LENGTH_MAX), aligned to
//! [`BLOCK_SIZE_MIN`](crate::protocol::BLOCK_SIZE_MIN) if the client asked for the block
//! sizes in its GO; the session calls the export through [`Unaligned`], which gives the
//! real export only whole sectors (read-modify-write for the rest); every reply is written whole,
//! alone or in a batch of whole replies, while holding the writer lock, so replies never
//! interleave byte-wise. Out-of-range, misaligned, unknown or badly flagged requests get an
//! error reply and the connection goes on; a bad magic, an oversize WRITE payload or a
//! socket error ends the connection after in-flight requests are answered.
//!
//! On the event loop (`Limits::reactor`, see `reactor`) the same loop runs on the loop's
//! workers instead of the connection's own threads: a reader that would block for the next
//! header parks the connection (and one that has just sent its batch with nothing more
//! expected parks it without trying), a worker lends its input buffer to the connection it
//! visits, a hand-off parks it for another worker to read on, the
//! watchdog parks a connection whose reader is stuck in an export call (no standby threads
//! are started), and the idle timeout is the reactor's sweep of parked connections.
//!
//! Files: this one holds the entry ([`serve`]), the state the threads share ([`Connection`])
//! and each thread's loop; `budget` the counters of requests and bytes in flight, with the
//! server-wide fair share; `input` the buffered read side and the reading of requests;
//! `check` their checks; `standby` waiting for the input; `payload` a thread's payload
//! buffer and where a WRITE payload is received; `activity` what the server's table sees of
//! the session; `dispatch` serving a checked request on the export and making its reply;
//! `batch` a thread's replies not yet sent; `more` when to look for more requests before a
//! send; `reactor` and `visit` the event loop; `splice` sending large READ replies from the
//! export's file without a copy (plaintext connections, exports that give
//! [`Export::read_source`]).

mod activity;
mod batch;
mod budget;
mod check;
mod dispatch;
mod input;
mod more;
mod payload;
mod reactor;
mod spin;
mod splice;
mod standby;
mod visit;
mod watchdog;

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::export::{Export, Unaligned, UnalignedContext};
use crate::handshake::{ContextSource, Negotiated, ReplyStyle, SelectedContext};
use crate::protocol::{command, command_flags, HeaderStyle, Request};
use crate::stream::Stream;

pub(crate) use activity::Activity;
use batch::{Batch, BATCH_REQUEST_BYTES_MAX};
pub(crate) use budget::Budget;
use input::Input;
use payload::Payload;
pub(crate) use reactor::{Guest, Reactor};

/// Longest socket read timeout of a session (it is a quarter of the idle timeout up to
/// this): how long a surplus thread may stay blocked on a quiet connection before it leaves,
/// and the resolution of the idle timeout.
const IDLE_TICK_MAX: Duration = Duration::from_secs(30);

/// Largest payload buffer a thread keeps between requests; bigger READs and WRITEs get a
/// buffer of their own, freed after the reply, so idle connections hold little memory.
pub(crate) const RETAINED_BUFFER_BYTES: usize = 256 * 1024;

/// How often the process's watchdog ([`watchdog`]) checks that reading threads still make
/// progress: a thread stuck in an export call with the input free from one tick to the next
/// is overtaken by a standby of its connection, which reads on.
const STALL_TICK: Duration = Duration::from_millis(2);

/// A standby thread woken by nothing for this long with nothing in flight leaves (unless it
/// is the last thread), so a quiet connection stops paying for it.
const STANDBY_QUIET: Duration = Duration::from_millis(100);

/// Limits of one connection's transmission phase.
#[derive(Clone)]
pub(crate) struct Limits {
    /// Most threads that read, serve and answer requests; started as requests queue up.
    pub(crate) threads: usize,
    pub(crate) requests_in_flight_max: usize,
    pub(crate) bytes_in_flight_max: u64,
    /// Payload bytes in flight over all connections of the server, for payloads larger than
    /// [`RETAINED_BUFFER_BYTES`] (smaller ones use the buffers the threads keep anyway).
    pub(crate) server_bytes: Arc<Budget>,
    /// Nothing received and no request in flight for this long closes the connection.
    pub(crate) idle_timeout: Duration,
    /// Stack size of the extra threads.
    pub(crate) stack_bytes: usize,
    /// Name of the extra threads.
    pub(crate) thread_name: String,
    /// Large READs of an export that offers [`Export::read_source`] are spliced from its file
    /// to the socket (plaintext sockets only).
    pub(crate) splice_reads: bool,
    /// Widest window a thread spins for the next request before it sleeps in `recv`
    /// (see `spin`); zero never spins.
    pub(crate) spin_max: Duration,
    /// The reading thread serves small quick requests itself, into its batch.
    pub(crate) batch_replies: bool,
    /// Whether requests are in flight, for the server's choice of a connection to evict.
    pub(crate) activity: Arc<Activity>,
    /// The event loop that serves the session (see `reactor`); `None`: its own threads.
    pub(crate) reactor: Option<Arc<Reactor>>,
    /// The connection's number, its key in the reactor.
    pub(crate) key: u64,
}

/// Called once, by the last thread of a session to leave, with the session's result and
/// the number of requests it read.
pub(crate) type OnEnd = Box<dyn FnOnce(Result<()>, u64) + Send>;

/// A checked request taken by a thread; its WRITE payload is in the thread's [`Scratch`].
struct Job {
    request: Request,
    payload_length: usize,
    reserved_bytes: u64,
}

impl Job {
    /// Commands that, on a page-cached export, finish in microseconds: the reading thread
    /// may serve them itself, into its batch. FLUSH, FUA writes, TRIM, WRITE_ZEROES and
    /// CACHE may wait for the disk or a commit, so they always let another thread read on.
    fn is_quick(&self) -> bool {
        match self.request.command {
            command::READ | command::BLOCK_STATUS => true,
            command::WRITE => self.request.flags & command_flags::FUA == 0,
            _ => false,
        }
    }

    /// Small enough to batch: its reply (a READ's data) fits in a batch beside others.
    fn is_small(&self) -> bool {
        self.request.command == command::BLOCK_STATUS
            || self.request.length <= BATCH_REQUEST_BYTES_MAX
    }
}

/// How a new thread of a session begins.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Start {
    /// Take the input at once if it is free (a hand-off: a request waits to be read).
    Read,
    /// Wait as a standby first (started in case the reading thread gets stuck).
    Standby,
}

/// How a thread stopped reading.
enum Led {
    /// It gave the input up (to serve a slow request, or another thread took it over while
    /// it was in an export call): it waits for the input again.
    GaveUp,
    /// It leaves the session.
    Left,
}

/// What a thread got from the input.
enum Next {
    /// A checked request to serve, with its budget reserved.
    Run(Job),
    /// A request that was refused and answered already.
    Answered,
    /// Reading has stopped (disconnect, shutdown, protocol violation, socket error).
    End,
    /// The connection is quiet and another thread will read: this one leaves.
    Leave,
}

/// A thread's buffers, reused between requests.
#[derive(Default)]
pub(crate) struct Scratch {
    /// READ data (larger than a batch takes) and WRITE payloads.
    payload: Payload,
    /// The pipe spliced READ replies go through.
    pipe: splice::Pipe,
    /// Replies not yet sent.
    batch: Batch,
    /// On the event loop: the input buffer the last connection parked gave up, lent to the
    /// next one visited (see `Input::release_buffer`), so a visit allocates none.
    input_buffer: Vec<u8>,
}

/// State shared by the threads of one connection.
struct Connection {
    /// The negotiated export, wrapped to serve unaligned requests (see [`Unaligned`]).
    export: Arc<dyn Export>,
    /// The client did not agree to the 512-byte minimum block size: requests of any
    /// alignment are served.
    any_alignment: bool,
    style: ReplyStyle,
    /// Metadata contexts selected in the handshake; BLOCK_STATUS answers one chunk for each.
    contexts: Vec<SelectedContext>,
    input: Mutex<Input>,
    writer: Mutex<Stream>,
    broken: AtomicBool,
    /// Requests taken and not yet answered (the same count as `budget` holds, without its
    /// lock); a thread serves inline only when its own request is the only one.
    in_flight: AtomicUsize,
    /// `in_flight`'s transitions to and from 0, seen by the server's connection table.
    activity: Arc<Activity>,
    budget: Budget,
    server_bytes: Arc<Budget>,
    /// Bytes this connection holds of `server_bytes`.
    server_bytes_held: AtomicU64,
    /// Most bytes of `server_bytes` this connection may hold once it is half used.
    server_share_bytes: u64,
    /// Threads running this session; from 1 to `threads_max`.
    threads: AtomicUsize,
    /// Standby threads: waiting on `watch.wake` to take the input when it is handed off or
    /// the reading thread is stuck in an export call (the watchdog wakes them then).
    watch: Arc<watchdog::Watch>,
    /// A thread started as a standby has not registered in `standby_waiters` yet: no
    /// other is started meanwhile.
    standby_starting: AtomicBool,
    threads_max: usize,
    stack_bytes: usize,
    thread_name: String,
    splice_reads: bool,
    batch_replies: bool,
    /// Taken by the last thread to leave.
    on_end: Mutex<Option<OnEnd>>,
    idle_timeout: Duration,
    /// The event loop serving the session, the connection's key in it, the socket it
    /// watches (the input's) and the connection's span, which its visits enter.
    reactor: Option<Arc<Reactor>>,
    key: u64,
    socket: Arc<Stream>,
    span: tracing::Span,
}

/// Serves requests on `reader`/`writer` until the client disconnects or stays idle too long.
/// Runs the first thread on the caller's; more threads start while requests queue up, and
/// leave again once the connection is quiet, so an idle connection costs one thread. The
/// caller's thread may return before the others: the last one to leave calls `on_end` with
/// an error if the connection ended because of a protocol violation, a socket failure or
/// the idle timeout.
pub(crate) fn serve(
    negotiated: Negotiated,
    reader: Stream,
    writer: Stream,
    limits: Limits,
    on_end: OnEnd,
) {
    assert!(limits.threads > 0, "a session needs a thread");
    assert!(
        limits.requests_in_flight_max > 0,
        "a session needs a request slot"
    );
    assert!(!limits.idle_timeout.is_zero(), "idle timeout is 0");
    let (idle_tick, idle_ticks_max) = idle_ticks(limits.idle_timeout);
    if let Err(error) = reader.set_read_timeout(Some(idle_tick)) {
        on_end(Err(Error::io("set idle timeout", error)), 0);
        return;
    }
    let server_share_bytes = limits.server_bytes.fair_share_bytes();
    let any_alignment = !negotiated.block_sizes;
    let contexts = unaligned_contexts(negotiated.contexts, any_alignment);
    let socket = Arc::new(reader);
    let on_loop = limits.reactor.is_some();
    let connection = Arc::new(Connection {
        export: Arc::new(Unaligned::new(negotiated.export, any_alignment)),
        any_alignment,
        style: negotiated.style,
        contexts,
        input: Mutex::new(Input::new(
            Arc::clone(&socket),
            idle_ticks_max,
            limits.spin_max,
        )),
        idle_timeout: limits.idle_timeout,
        writer: Mutex::new(writer),
        broken: AtomicBool::new(false),
        in_flight: AtomicUsize::new(0),
        activity: limits.activity,
        budget: Budget::new(limits.requests_in_flight_max, limits.bytes_in_flight_max),
        server_bytes: limits.server_bytes,
        server_bytes_held: AtomicU64::new(0),
        server_share_bytes,
        // On the event loop only the workers visiting it count.
        threads: AtomicUsize::new(usize::from(!on_loop)),
        watch: Arc::default(),
        standby_starting: AtomicBool::new(false),
        threads_max: limits.threads,
        stack_bytes: limits.stack_bytes,
        thread_name: limits.thread_name,
        splice_reads: limits.splice_reads,
        batch_replies: limits.batch_replies,
        on_end: Mutex::new(Some(on_end)),
        reactor: limits.reactor,
        key: limits.key,
        socket,
        span: tracing::Span::current(),
    });
    if on_loop {
        connection.start_on_loop();
    } else {
        connection.run_thread(Start::Read);
    }
}

/// The socket's read timeout and how many in a row are the idle timeout. The timeout is
/// the tick at which a reader blocked on a quiet connection wakes up, to hand its thread
/// back and to count towards the idle timeout: a quarter of the timeout, so a quiet
/// connection closes between 1 and 1.25 times it.
fn idle_ticks(idle_timeout: Duration) -> (Duration, u32) {
    let idle_tick = (idle_timeout / 4).clamp(Duration::from_millis(1), IDLE_TICK_MAX);
    let ticks =
        u32::try_from(idle_timeout.as_nanos().div_ceil(idle_tick.as_nanos())).unwrap_or(u32::MAX);
    (idle_tick, ticks)
}

/// The selected contexts, each wrapped to answer unaligned requests if `any_alignment`.
fn unaligned_contexts(contexts: Vec<SelectedContext>, any_alignment: bool) -> Vec<SelectedContext> {
    contexts
        .into_iter()
        .map(|context| match context.source {
            ContextSource::Export(source) if any_alignment => SelectedContext {
                id: context.id,
                source: ContextSource::Export(Arc::new(UnalignedContext(source))),
            },
            _ => context,
        })
        .collect()
}

impl Drop for Connection {
    /// The last thread has left (or unwound): report how the connection ended.
    fn drop(&mut self) {
        if let Some(reactor) = &self.reactor {
            reactor.forget(&*self.socket);
        }
        let input = self.input.get_mut().unwrap_or_else(|e| e.into_inner());
        let result = match (input.ended, input.error.take()) {
            (_, Some(error)) => Err(error),
            (true, None) => Ok(()),
            (false, None) => Err(Error::io(
                "a connection thread panicked",
                io::Error::other("connection thread panicked"),
            )),
        };
        let on_end = self
            .on_end
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(on_end) = on_end {
            on_end(result, input.requests);
        }
    }
}

impl Connection {
    fn header_style(&self) -> HeaderStyle {
        match self.style {
            ReplyStyle::Extended => HeaderStyle::Extended,
            ReplyStyle::Simple | ReplyStyle::Structured => HeaderStyle::Compact,
        }
    }

    /// Takes a request slot and `bytes` from this connection's budget, then (for payloads
    /// too large for the threads' retained buffers) `bytes` from the server's; always in this
    /// order, and released together, so waits cannot form a cycle. A thread holding a batch
    /// sends it before it waits, since the slots it waits for may be its own.
    fn acquire(&self, bytes: u64, batch: &mut Batch) {
        let large = bytes > RETAINED_BUFFER_BYTES as u64;
        let taken = !batch.is_empty() && !large && self.budget.try_acquire(bytes);
        if !taken {
            self.flush(batch);
            self.budget.acquire(bytes);
        }
        if large {
            self.server_bytes
                .acquire_fair(bytes, &self.server_bytes_held, self.server_share_bytes);
        }
        if self.in_flight.fetch_add(1, Ordering::SeqCst) == 0 {
            spin::connection_busy();
            self.activity.busy();
        }
    }

    fn release(&self, bytes: u64) {
        let before = self.in_flight.fetch_sub(1, Ordering::SeqCst);
        assert!(before > 0, "released a request that was not in flight");
        if before == 1 {
            spin::connection_idle();
            self.activity.idle();
        }
        if bytes > RETAINED_BUFFER_BYTES as u64 {
            self.server_bytes_held.fetch_sub(bytes, Ordering::SeqCst);
            self.server_bytes.release(bytes);
        }
        self.budget.release(bytes);
    }

    /// Releases the requests of a sent batch (none of them drew on the server's budget).
    fn release_many(&self, requests: usize, bytes: u64) {
        let before = self.in_flight.fetch_sub(requests, Ordering::SeqCst);
        assert!(
            before >= requests,
            "released requests that were not in flight"
        );
        if before == requests && requests > 0 {
            spin::connection_idle();
            self.activity.idle();
        }
        self.budget.release_many(requests, bytes);
    }

    /// Reads requests and serves the quick ones into the thread's batch, giving the input
    /// lock up only for the export call itself (no other thread waits on it, so that costs
    /// no wake-up); a slow request is handed off: the batch is sent, another thread gets
    /// the input, and this one serves the request and answers it by itself. The batch goes
    /// out whenever the thread would otherwise block (see [`batch`]).
    fn lead<'a>(
        self: &'a Arc<Self>,
        mut input: MutexGuard<'a, Input>,
        scratch: &mut Scratch,
    ) -> Led {
        loop {
            // A quiet connection needs one reader; the others leave as they get here.
            if self.reactor.is_none()
                && input.quiet_ticks > 0
                && input.buffered() == 0
                && self.in_flight.load(Ordering::SeqCst) == 0
                && self.leave_if_not_last()
            {
                drop(input);
                self.wake_standby();
                return Led::Left;
            }
            if !scratch.batch.is_empty()
                && (scratch.batch.is_full()
                    || !(self.holds_whole_request(&input)
                        || input.receive_more() && self.holds_whole_request(&input)))
            {
                self.flush(&mut scratch.batch);
            }
            let job = match self.next(&mut input, scratch) {
                Next::Run(job) => job,
                Next::Answered => continue,
                Next::End => {
                    self.flush(&mut scratch.batch);
                    // Parked meanwhile by another worker: the table lets go of it.
                    let parked = self.reactor.as_ref().and_then(|r| r.unpark(self.key));
                    // Whoever leaves last reports, in `drop`.
                    self.threads.fetch_sub(1, Ordering::SeqCst);
                    drop(input);
                    drop(parked);
                    self.wake_standby();
                    return Led::Left;
                }
                Next::Leave => {
                    self.flush(&mut scratch.batch);
                    self.stop_reading(input, &mut scratch.input_buffer);
                    return Led::Left;
                }
            };
            let alone = input.buffered() == 0
                && self.in_flight.load(Ordering::SeqCst) == scratch.batch.requests() + 1;
            let batched = job.is_quick() && (alone || (self.batch_replies && job.is_small()));
            if !batched {
                self.flush(&mut scratch.batch);
                self.hand_off(input);
                self.serve(&job, scratch);
                self.flush(&mut scratch.batch);
                self.release(job.reserved_bytes);
                scratch.payload.shrink();
                return Led::GaveUp;
            }
            match self.serve_batched(input, &job, scratch) {
                Some(again) => input = again,
                None => return Led::GaveUp,
            }
        }
    }

    /// Serves a quick `job` into the thread's batch with the input given up during the
    /// export call (a standby kept ready in case the call gets stuck); the input again, or
    /// `None` if a standby took it over meanwhile (the batch is then sent).
    fn serve_batched<'a>(
        self: &'a Arc<Self>,
        input: MutexGuard<'a, Input>,
        job: &Job,
        scratch: &mut Scratch,
    ) -> Option<MutexGuard<'a, Input>> {
        // On the event loop the watchdog parks the connection instead (see `visit`).
        if self.reactor.is_none()
            && self.watch.waiters.load(Ordering::SeqCst) == 0
            && !self.standby_starting.swap(true, Ordering::SeqCst)
        {
            // Requests sent after this one must not wait if this call gets stuck: keep a
            // thread ready to take over.
            if !self.add_thread(Start::Standby) {
                self.standby_starting.store(false, Ordering::SeqCst);
            }
        }
        self.watch.in_call.store(true, Ordering::SeqCst);
        self.watch.entering_call();
        drop(input);
        self.serve(job, scratch);
        self.watch.calls.fetch_add(1, Ordering::SeqCst);
        if job.reserved_bytes > RETAINED_BUFFER_BYTES as u64 {
            // A lone large request also holds some of the server's budget.
            self.flush(&mut scratch.batch);
            self.release(job.reserved_bytes);
            scratch.payload.shrink();
        } else {
            scratch.batch.add_request(job.reserved_bytes);
        }
        match self.try_lock_input() {
            Some(again) => {
                self.watch.in_call.store(false, Ordering::SeqCst);
                Some(again)
            }
            None => {
                // A standby took over while this thread was in the export.
                self.flush(&mut scratch.batch);
                None
            }
        }
    }

    /// Runs `job`, unless the connection is broken.
    fn serve(&self, job: &Job, scratch: &mut Scratch) {
        if !self.broken.load(Ordering::SeqCst) {
            self.run(job, scratch);
        }
    }
}
