//! The transmission phase of one connection: reading requests, running them on a few
//! threads, and writing replies in any order.
//!
//! Threading (nbdkit's model, plus inline serving): each thread loops on "take the input
//! lock, read one request, serve it, write its reply". The input lock guards the socket's read
//! side and a buffer ([`Input`]), so one `recv` picks up every request header already queued
//! and the next thread parses the following request from memory; a WRITE payload is copied
//! from what the buffer already holds and the rest is read straight into the thread's payload
//! buffer. A thread normally gives the input lock up before serving, so another thread reads
//! the next request meanwhile and many requests are in flight. It keeps the lock while serving
//! (and reads the next request itself afterwards) when nothing else is in flight on the
//! connection, nothing is buffered, and the request is a READ, a WRITE without FUA or a
//! BLOCK_STATUS, which on a page-cached export do not block long: at queue depth 1 one thread
//! then does everything, with no wake-up of another thread per request. Each thread reuses
//! one payload buffer for READ data and WRITE payloads up to [`RETAINED_BUFFER_BYTES`] (larger
//! ones are allocated per request and freed after it).
//!
//! Thread count: a session starts on the connection's thread alone. A thread that gives the
//! input up to serve starts another if no thread is waiting for the input and the limit
//! (`threads`) allows. The socket's read timeout is a tick (at most [`IDLE_TICK_MAX`]): a
//! reader that wakes on it with nothing in flight marks the connection quiet and leaves
//! unless it is the last thread, and every other thread leaves as it takes the input; so a
//! quiet connection costs one thread within a tick. Ticks in a row with nothing received and
//! nothing in flight add up to the idle timeout, which closes the connection. The last thread
//! to leave reports the session's end (`OnEnd`), so nothing waits for a join.
//!
//! Invariants: at most `requests_in_flight_max` requests (and never more than `threads`) and
//! about `bytes_in_flight_max` payload bytes are between "header read" and "reply written" at
//! once; payloads over [`RETAINED_BUFFER_BYTES`] also draw on the server-wide budget
//! ([`Budget::acquire_fair`]), where a connection past its fair share waits once the budget
//! is half used. A connection whose client does not read replies blocks in its own reply
//! write, then in its own budget while holding its own input lock: it stops reading requests,
//! and of the server's budget it holds at most its own byte limit, and only while the budget
//! is under half used. A request reaches the export only with a range inside the export,
//! aligned to [`BLOCK_SIZE_MIN`](crate::protocol::BLOCK_SIZE_MIN), and a payload of at most
//! [`PAYLOAD_LENGTH_MAX`](crate::protocol::PAYLOAD_LENGTH_MAX); every reply is written whole
//! while holding the writer lock, so replies never interleave byte-wise. Out-of-range,
//! misaligned, unknown or badly flagged requests get an error reply and the connection goes
//! on; a bad magic, an oversize WRITE payload or a socket error ends the connection after
//! in-flight requests are answered.
//!
//! Files: this one holds the entry ([`serve`]), the state the threads share ([`Connection`])
//! and each thread's loop; `budget` the counters of requests and bytes in flight, with the
//! server-wide fair share; `input` the buffered read side and the reading and checking of
//! requests; `dispatch` serving a checked request on the export and writing its reply;
//! `splice` sending large READ replies from the export's file without a copy (plaintext
//! connections, exports that give [`Export::read_source`]).

mod budget;
mod dispatch;
mod input;
mod spin;
mod splice;

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::export::Export;
use crate::handshake::{Negotiated, ReplyStyle, SelectedContext};
use crate::protocol::{command, command_flags, HeaderStyle, Request};
use crate::stream::Stream;

pub(crate) use budget::Budget;
use input::Input;

/// Longest socket read timeout of a session (it is a quarter of the idle timeout up to
/// this): how long a surplus thread may stay blocked on a quiet connection before it leaves,
/// and the resolution of the idle timeout.
const IDLE_TICK_MAX: Duration = Duration::from_secs(30);

/// Largest payload buffer a thread keeps between requests; bigger READs and WRITEs get a
/// buffer of their own, freed after the reply, so idle connections hold little memory.
pub(crate) const RETAINED_BUFFER_BYTES: usize = 256 * 1024;

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
    /// Served while the thread keeps the input lock, if nothing else is going on: commands
    /// that, on a page-cached export, finish in microseconds. FLUSH, FUA writes, TRIM,
    /// WRITE_ZEROES and CACHE may wait for the disk or a commit, so they always let another
    /// thread read on.
    fn may_run_inline(&self) -> bool {
        match self.request.command {
            command::READ | command::BLOCK_STATUS => true,
            command::WRITE => self.request.flags & command_flags::FUA == 0,
            _ => false,
        }
    }
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

/// A thread's payload buffer for READ data and WRITE payloads, reused between requests.
#[derive(Default)]
struct Scratch {
    /// Grows to the largest payload up to [`RETAINED_BUFFER_BYTES`] and stays; never zeroed
    /// again (READs are filled completely by the export, WRITEs by the socket).
    retained: Vec<u8>,
    /// A larger payload's buffer, for one request only.
    large: Vec<u8>,
    /// The pipe spliced READ replies go through.
    pipe: splice::Pipe,
}

impl Scratch {
    /// A buffer of `length` bytes; its contents are left over from earlier requests.
    fn prepare(&mut self, length: usize) -> &mut [u8] {
        if length <= RETAINED_BUFFER_BYTES {
            if self.retained.len() < length {
                self.retained.resize(length, 0);
            }
            &mut self.retained[..length]
        } else {
            self.large = vec![0u8; length];
            &mut self.large
        }
    }

    /// The buffer [`Scratch::prepare`] gave out last, for `length` bytes.
    fn current(&self, length: usize) -> &[u8] {
        if length <= RETAINED_BUFFER_BYTES {
            &self.retained[..length]
        } else {
            &self.large[..length]
        }
    }

    /// Frees a large buffer once its request is answered.
    fn shrink(&mut self) {
        self.large = Vec::new();
    }
}

/// State shared by the threads of one connection.
struct Connection {
    export: Arc<dyn Export>,
    style: ReplyStyle,
    /// Metadata contexts selected in the handshake; BLOCK_STATUS answers one chunk for each.
    contexts: Vec<SelectedContext>,
    input: Mutex<Input>,
    writer: Mutex<Stream>,
    broken: AtomicBool,
    /// Requests taken and not yet answered (the same count as `budget` holds, without its
    /// lock); a thread serves inline only when its own request is the only one.
    in_flight: AtomicUsize,
    budget: Budget,
    server_bytes: Arc<Budget>,
    /// Bytes this connection holds of `server_bytes`.
    server_bytes_held: AtomicU64,
    /// Most bytes of `server_bytes` this connection may hold once it is half used.
    server_share_bytes: u64,
    /// Threads running this session; from 1 to `threads_max`.
    threads: AtomicUsize,
    /// Threads blocked on the input lock, ready to read the next request.
    waiting: AtomicUsize,
    threads_max: usize,
    stack_bytes: usize,
    thread_name: String,
    splice_reads: bool,
    /// Taken by the last thread to leave.
    on_end: Mutex<Option<OnEnd>>,
    idle_timeout: Duration,
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
    // The socket's read timeout is the tick at which a reader blocked on a quiet connection
    // wakes up, to hand its thread back and to count towards the idle timeout: a quarter of
    // the timeout, so a quiet connection closes between 1 and 1.25 times it.
    let idle_tick = (limits.idle_timeout / 4).clamp(Duration::from_millis(1), IDLE_TICK_MAX);
    let idle_ticks_max = u32::try_from(
        limits
            .idle_timeout
            .as_nanos()
            .div_ceil(idle_tick.as_nanos()),
    )
    .unwrap_or(u32::MAX);
    if let Err(error) = reader.set_read_timeout(Some(idle_tick)) {
        on_end(Err(Error::io("set idle timeout", error)), 0);
        return;
    }
    let server_share_bytes = limits.server_bytes.fair_share_bytes();
    let connection = Arc::new(Connection {
        export: negotiated.export,
        style: negotiated.style,
        contexts: negotiated.contexts,
        input: Mutex::new(Input::new(reader, idle_ticks_max, limits.spin_max)),
        idle_timeout: limits.idle_timeout,
        writer: Mutex::new(writer),
        broken: AtomicBool::new(false),
        in_flight: AtomicUsize::new(0),
        budget: Budget::new(limits.requests_in_flight_max, limits.bytes_in_flight_max),
        server_bytes: limits.server_bytes,
        server_bytes_held: AtomicU64::new(0),
        server_share_bytes,
        threads: AtomicUsize::new(1),
        waiting: AtomicUsize::new(0),
        threads_max: limits.threads,
        stack_bytes: limits.stack_bytes,
        thread_name: limits.thread_name,
        splice_reads: limits.splice_reads,
        on_end: Mutex::new(Some(on_end)),
    });
    connection.run_thread();
}

impl Drop for Connection {
    /// The last thread has left (or unwound): report how the connection ended.
    fn drop(&mut self) {
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
    /// order, and released together, so waits cannot form a cycle.
    fn acquire(&self, bytes: u64) {
        self.budget.acquire(bytes);
        if bytes > RETAINED_BUFFER_BYTES as u64 {
            self.server_bytes
                .acquire_fair(bytes, &self.server_bytes_held, self.server_share_bytes);
        }
        self.in_flight.fetch_add(1, Ordering::SeqCst);
    }

    fn release(&self, bytes: u64) {
        let before = self.in_flight.fetch_sub(1, Ordering::SeqCst);
        assert!(before > 0, "released a request that was not in flight");
        if bytes > RETAINED_BUFFER_BYTES as u64 {
            self.server_bytes_held.fetch_sub(bytes, Ordering::SeqCst);
            self.server_bytes.release(bytes);
        }
        self.budget.release(bytes);
    }

    /// Starts one more thread if none is waiting to read and the limit allows: called by a
    /// thread that gives the input up to serve a request.
    fn add_reader(self: &Arc<Self>) {
        if self.waiting.load(Ordering::SeqCst) > 0 {
            return;
        }
        let grown = self
            .threads
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |threads| {
                (threads < self.threads_max).then_some(threads + 1)
            });
        if grown.is_err() {
            return;
        }
        let connection = Arc::clone(self);
        // The connection's span (its number and peer) goes with its threads.
        let span = tracing::Span::current();
        let spawned = std::thread::Builder::new()
            .name(self.thread_name.clone())
            .stack_size(self.stack_bytes)
            .spawn(move || span.in_scope(|| connection.run_thread()));
        if spawned.is_err() {
            // Serve with the threads there are.
            self.threads.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Lets this thread leave if it is not the last one; the others still read.
    fn leave_if_not_last(&self) -> bool {
        self.threads
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |threads| {
                (threads > 1).then(|| threads - 1)
            })
            .is_ok()
    }

    /// One thread's loop: take the input, read a request, serve it, answer; until reading
    /// stops or the connection is quiet and other threads remain. See the module docs for
    /// when the input lock is kept while serving.
    fn run_thread(self: Arc<Self>) {
        let mut scratch = Scratch::default();
        let mut kept: Option<MutexGuard<'_, Input>> = None;
        loop {
            let mut input = match kept.take() {
                Some(input) => input,
                None => {
                    self.waiting.fetch_add(1, Ordering::SeqCst);
                    let input = self.lock_input();
                    self.waiting.fetch_sub(1, Ordering::SeqCst);
                    input
                }
            };
            // A quiet connection needs one reader; the others leave as they get here.
            if input.quiet_ticks > 0
                && input.buffered() == 0
                && self.in_flight.load(Ordering::SeqCst) == 0
                && self.leave_if_not_last()
            {
                return;
            }
            let job = match self.next(&mut input, &mut scratch) {
                Next::Run(job) => job,
                Next::Answered => {
                    kept = Some(input);
                    continue;
                }
                Next::End => {
                    // Whoever leaves last reports, in `drop`.
                    self.threads.fetch_sub(1, Ordering::SeqCst);
                    return;
                }
                Next::Leave => return,
            };
            let inline = job.may_run_inline()
                && input.buffered() == 0
                && self.in_flight.load(Ordering::SeqCst) == 1;
            if inline {
                kept = Some(input);
            } else {
                drop(input);
                self.add_reader();
            }
            if !self.broken.load(Ordering::SeqCst) {
                self.run(&job, &mut scratch);
            }
            self.release(job.reserved_bytes);
            scratch.shrink();
        }
    }

    /// The input, locked. A thread that panicked holding it may have left a request half-read,
    /// so the stream is no longer framed: reading stops for every thread (see [`crate::sync`]).
    fn lock_input(&self) -> MutexGuard<'_, Input> {
        match self.input.lock() {
            Ok(input) => input,
            Err(poisoned) => {
                let mut input = poisoned.into_inner();
                input.stop(Err(Error::Internal(
                    "a thread serving this connection panicked while reading".to_string(),
                )));
                input
            }
        }
    }
}
