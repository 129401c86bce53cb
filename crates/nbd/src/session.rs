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
//! is under half used. A request reaches the export only with a
//! range inside the export, aligned to [`BLOCK_SIZE_MIN`], and a payload of at most
//! [`PAYLOAD_LENGTH_MAX`]; every reply is written whole while holding the writer lock, so
//! replies never interleave byte-wise. Out-of-range, misaligned, unknown or badly flagged
//! requests get an error reply and the connection goes on; a bad magic, an oversize WRITE
//! payload or a socket error ends the connection after in-flight requests are answered.

use std::io::{self, IoSlice, Read};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::error::{nbd_error_code, Error, ErrorKind, Result};
use crate::export::{Export, ZeroOptions};
use crate::handshake::{Negotiated, ReplyStyle};
use crate::protocol::{
    self, chunk, command, command_flags, encode_simple_reply, state, ChunkHeader, Descriptor,
    HeaderStyle, Request, BLOCK_SIZE_MIN, EXTENTS_PER_REPLY_MAX, PAYLOAD_LENGTH_MAX,
    REPLY_FLAG_DONE,
};
use crate::stream::{write_all_vectored, Stream};
use crate::sync;

/// Size of each connection's input buffer: room for the headers of many queued requests in
/// one `recv`. Bytes of a WRITE payload that land in it are copied out once.
const INPUT_BUFFER_BYTES: usize = 64 * 1024;

/// Longest socket read timeout of a session (it is a quarter of the idle timeout up to
/// this): how long a surplus thread may stay blocked on a quiet connection before it leaves,
/// and the resolution of the idle timeout.
const IDLE_TICK_MAX: Duration = Duration::from_secs(30);

/// Largest payload buffer a thread keeps between requests; bigger READs and WRITEs get a
/// buffer of their own, freed after the reply, so idle connections hold little memory.
pub(crate) const RETAINED_BUFFER_BYTES: usize = 256 * 1024;

/// How much of the server's byte budget one connection may hold beyond half of it: the
/// budget's 1/`FAIR_SHARE_DIVISOR`. While the server budget is at most half used, a connection
/// may take up to its own limit; past half, only connections under their share get more.
/// So fewer than `FAIR_SHARE_DIVISOR / 2` connections can never fill the server budget.
pub(crate) const FAIR_SHARE_DIVISOR: u64 = 64;

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
}

/// Called once, by the last thread of a session to leave, with the session's result.
pub(crate) type OnEnd = Box<dyn FnOnce(Result<()>) + Send>;

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

    fn acquire(&self, bytes: u64) {
        let mut used = sync::lock(&self.used);
        // A single request larger than the byte budget still runs, alone.
        while used.requests >= self.requests_max
            || (used.requests > 0 && used.bytes + bytes > self.bytes_max)
        {
            used.waiters += 1;
            used = sync::wait(&self.released, used);
            used.waiters -= 1;
        }
        used.requests += 1;
        used.bytes += bytes;
    }

    /// Takes `bytes` from the server's budget for a connection that holds `held` bytes of it
    /// already: up to the whole budget while at most half of it is used, past that only up
    /// to `share` per connection (see [`FAIR_SHARE_DIVISOR`]).
    fn acquire_fair(&self, bytes: u64, held: &AtomicU64, share: u64) {
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

    fn release(&self, bytes: u64) {
        let mut used = sync::lock(&self.used);
        assert!(
            used.requests > 0,
            "budget released more requests than acquired"
        );
        assert!(
            used.bytes >= bytes,
            "budget released more bytes than acquired"
        );
        used.requests -= 1;
        used.bytes -= bytes;
        if used.waiters > 0 {
            self.released.notify_all();
        }
    }
}

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

/// The read side of the socket, buffered, shared by the connection's threads under a lock.
struct Input {
    stream: Stream,
    buffer: Box<[u8]>,
    /// Unconsumed bytes are `buffer[start..end]`.
    start: usize,
    end: usize,
    /// Reading has stopped; every thread that takes the input from now on leaves.
    ended: bool,
    /// Why reading stopped, if not cleanly.
    error: Option<Error>,
    /// Read timeouts in a row with nothing received (and, between requests, nothing in
    /// flight); reset by every byte received.
    quiet_ticks: u32,
    idle_ticks_max: u32,
}

impl Input {
    fn new(stream: Stream, idle_ticks_max: u32) -> Self {
        Input {
            stream,
            buffer: vec![0u8; INPUT_BUFFER_BYTES].into_boxed_slice(),
            start: 0,
            end: 0,
            ended: false,
            error: None,
            quiet_ticks: 0,
            idle_ticks_max,
        }
    }

    fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Stops reading; the first reason given is kept.
    fn stop(&mut self, result: Result<()>) {
        if !self.ended {
            self.ended = true;
            self.error = result.err();
        }
    }

    /// Buffers at least `length` bytes, reading as much as the socket has; `Ok(false)` if the
    /// peer closed with nothing buffered. A read timeout comes back as an error (see
    /// [`is_timeout`]) with what arrived so far kept, so the caller can decide to wait on.
    fn fill(&mut self, length: usize) -> io::Result<bool> {
        assert!(length <= self.buffer.len(), "fill beyond the input buffer");
        if self.buffered() == 0 {
            self.start = 0;
            self.end = 0;
        } else if self.start + length > self.buffer.len() {
            self.buffer.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        while self.buffered() < length {
            match self.stream.read(&mut self.buffer[self.end..]) {
                Ok(0) if self.buffered() == 0 => return Ok(false),
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(count) => {
                    self.end += count;
                    self.quiet_ticks = 0;
                }
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(error),
            }
        }
        Ok(true)
    }

    /// Counts one quiet tick; an error once the connection has been quiet for too long.
    fn count_quiet_tick(&mut self) -> io::Result<()> {
        self.quiet_ticks += 1;
        if self.quiet_ticks >= self.idle_ticks_max {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "idle timeout"));
        }
        Ok(())
    }

    /// One read into `target`, or into the whole input buffer if `None` (for discarding),
    /// waiting through read timeouts until the connection has been quiet for the idle timeout
    /// (a client may pause inside a payload, but not for longer than between requests); end
    /// of stream is an error, since a request is incomplete.
    fn read_patiently(&mut self, mut target: Option<&mut [u8]>) -> io::Result<usize> {
        loop {
            let result = match target.as_deref_mut() {
                Some(target) => self.stream.read(target),
                None => self.stream.read(&mut self.buffer),
            };
            match result {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(count) => {
                    self.quiet_ticks = 0;
                    return Ok(count);
                }
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) if is_timeout(&error) => self.count_quiet_tick()?,
                Err(error) => return Err(error),
            }
        }
    }

    /// The next `length` buffered bytes, consumed; [`Input::fill`] must have buffered them.
    fn consume(&mut self, length: usize) -> &[u8] {
        assert!(
            length <= self.buffered(),
            "consume beyond the buffered bytes"
        );
        let bytes = &self.buffer[self.start..self.start + length];
        self.start += length;
        bytes
    }

    /// Fills `payload` from the buffer, then straight from the socket.
    fn read_payload(&mut self, payload: &mut [u8]) -> io::Result<()> {
        let from_buffer = self.buffered().min(payload.len());
        payload[..from_buffer].copy_from_slice(&self.buffer[self.start..self.start + from_buffer]);
        self.start += from_buffer;
        let mut filled = from_buffer;
        while filled < payload.len() {
            filled += self.read_patiently(Some(&mut payload[filled..]))?;
        }
        Ok(())
    }

    /// Reads and drops `length` payload bytes.
    fn discard(&mut self, length: u64) -> io::Result<()> {
        let from_buffer = (self.buffered() as u64).min(length);
        self.start += from_buffer as usize;
        let mut rest = length - from_buffer;
        // Everything buffered is consumed now, so the buffer is free for the rest.
        while rest > 0 {
            self.start = 0;
            self.end = 0;
            let count = self.read_patiently(None)? as u64;
            if count > rest {
                // The bytes after the payload are the next requests: keep them.
                self.start = rest as usize;
                self.end = count as usize;
            }
            rest -= count.min(rest);
        }
        Ok(())
    }
}

/// A thread's payload buffer for READ data and WRITE payloads, reused between requests.
#[derive(Default)]
struct Scratch {
    /// Grows to the largest payload up to [`RETAINED_BUFFER_BYTES`] and stays; never zeroed
    /// again (READs are filled completely by the export, WRITEs by the socket).
    retained: Vec<u8>,
    /// A larger payload's buffer, for one request only.
    large: Vec<u8>,
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
    base_allocation_id: Option<u32>,
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
    /// Taken by the last thread to leave.
    on_end: Mutex<Option<OnEnd>>,
    idle_timeout: Duration,
}

/// What the checks decided about one request.
enum Verdict {
    /// Serve it.
    Run,
    /// Answer at once with this error (after discarding any payload).
    Refuse(Error),
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
        on_end(Err(Error::io("set idle timeout", error)));
        return;
    }
    let server_share_bytes = limits.server_bytes.bytes_max / FAIR_SHARE_DIVISOR;
    let connection = Arc::new(Connection {
        export: negotiated.export,
        style: negotiated.style,
        base_allocation_id: negotiated.base_allocation_id,
        input: Mutex::new(Input::new(reader, idle_ticks_max)),
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
            on_end(result);
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
        let spawned = std::thread::Builder::new()
            .name(self.thread_name.clone())
            .stack_size(self.stack_bytes)
            .spawn(move || connection.run_thread());
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

    /// Reads and checks the next request; a WRITE payload goes into `scratch`.
    fn next(&self, input: &mut Input, scratch: &mut Scratch) -> Next {
        if input.ended {
            return Next::End;
        }
        match self.read_request(input, scratch) {
            Ok(next) => next,
            Err(error) => {
                input.stop(Err(error));
                Next::End
            }
        }
    }

    /// Buffers the next request header, waiting through the socket's read timeouts: with
    /// requests in flight the connection is busy, not idle; otherwise each timeout is a quiet
    /// tick, on which a thread other than the last leaves, and enough of them in a row end
    /// the connection. `Ok(None)` if this thread should leave, `Ok(Some(false))` on a clean
    /// hang-up.
    fn fill_header(&self, input: &mut Input, size: usize) -> Result<Option<bool>> {
        loop {
            match input.fill(size) {
                Ok(open) => return Ok(Some(open)),
                Err(error) if is_timeout(&error) => {
                    if self.in_flight.load(Ordering::SeqCst) > 0 {
                        input.quiet_ticks = 0;
                        continue;
                    }
                    if input.buffered() == 0 && self.leave_if_not_last() {
                        input.quiet_ticks = input.quiet_ticks.max(1);
                        return Ok(None);
                    }
                    input.count_quiet_tick().map_err(|e| {
                        Error::io(
                            format!(
                                "closed after {} s without a request",
                                self.idle_timeout.as_secs_f64()
                            ),
                            e,
                        )
                    })?;
                }
                Err(error) => return Err(Error::io("read request", error)),
            }
        }
    }

    fn read_request(&self, input: &mut Input, scratch: &mut Scratch) -> Result<Next> {
        if self.broken.load(Ordering::SeqCst) {
            return Err(Error::protocol("reply could not be sent"));
        }
        let style = self.header_style();
        let size = style.request_size();
        let Some(open) = self.fill_header(input, size)? else {
            return Ok(Next::Leave);
        };
        if !open {
            input.stop(Ok(()));
            return Ok(Next::End);
        }
        let request = Request::parse(style, input.consume(size))?;
        if request.command == command::DISC {
            input.stop(Ok(()));
            return Ok(Next::End);
        }
        let payload_length = self.payload_length(&request);
        if payload_length > u64::from(PAYLOAD_LENGTH_MAX) {
            // The payload cannot be skipped safely: answer, then hang up.
            let error = Error::TooLong {
                what: "request payload",
                length: payload_length,
                maximum: u64::from(PAYLOAD_LENGTH_MAX),
            };
            self.reply_error(&request, &error);
            return Err(error);
        }
        match self.check(&request, payload_length) {
            Verdict::Refuse(error) => {
                input
                    .discard(payload_length)
                    .map_err(|e| Error::io("discard payload", e))?;
                self.reply_error(&request, &error);
                Ok(Next::Answered)
            }
            Verdict::Run => {
                let reserved_bytes = match request.command {
                    command::READ | command::WRITE => request.length,
                    _ => 0,
                };
                self.acquire(reserved_bytes);
                let payload_length =
                    usize::try_from(payload_length).expect("payload length checked above");
                if payload_length > 0 {
                    if let Err(error) = input.read_payload(scratch.prepare(payload_length)) {
                        self.release(reserved_bytes);
                        scratch.shrink();
                        return Err(Error::io("read write payload", error));
                    }
                }
                Ok(Next::Run(Job {
                    request,
                    payload_length,
                    reserved_bytes,
                }))
            }
        }
    }

    /// Bytes of payload that follow the header of `request`.
    fn payload_length(&self, request: &Request) -> u64 {
        let flagged = request.flags & command_flags::PAYLOAD_LEN != 0;
        match self.style {
            ReplyStyle::Extended if flagged => request.length,
            _ if request.command == command::WRITE => request.length,
            _ => 0,
        }
    }

    /// Checks a request before it may reach the export.
    fn check(&self, request: &Request, payload_length: u64) -> Verdict {
        let refuse =
            |kind: ErrorKind, message: String| Verdict::Refuse(Error::export(kind, message));
        let command = request.command;
        let extended = self.style == ReplyStyle::Extended;
        let mut flags_allowed = command_flags::FUA;
        match command {
            command::READ => flags_allowed |= command_flags::DF,
            command::WRITE if extended => flags_allowed |= command_flags::PAYLOAD_LEN,
            command::WRITE_ZEROES => {
                flags_allowed |= command_flags::NO_HOLE;
                if self.export.can_fast_zero() {
                    flags_allowed |= command_flags::FAST_ZERO;
                }
            }
            command::BLOCK_STATUS => flags_allowed |= command_flags::REQ_ONE,
            command::WRITE | command::FLUSH | command::TRIM | command::CACHE => {}
            _ => {
                return refuse(
                    ErrorKind::InvalidArgument,
                    format!("unknown command {command}"),
                )
            }
        }
        if request.flags & !flags_allowed != 0 {
            return refuse(
                ErrorKind::InvalidArgument,
                format!("flags {:#x} not valid for command {command}", request.flags),
            );
        }
        if command != command::WRITE && payload_length > 0 {
            return refuse(
                ErrorKind::InvalidArgument,
                format!("command {command} takes no payload"),
            );
        }
        if command == command::FLUSH {
            return Verdict::Run;
        }
        let writes = matches!(
            command,
            command::WRITE | command::TRIM | command::WRITE_ZEROES
        );
        if writes && self.export.read_only() {
            return refuse(
                ErrorKind::PermissionDenied,
                "export is read-only".to_owned(),
            );
        }
        let size = self.export.size_bytes();
        let inside = request
            .offset
            .checked_add(request.length)
            .is_some_and(|end| end <= size);
        if !inside {
            let kind = match command {
                command::WRITE | command::WRITE_ZEROES => ErrorKind::NoSpace,
                _ => ErrorKind::InvalidArgument,
            };
            return refuse(
                kind,
                format!(
                    "offset {} length {} is outside the export of {size} bytes",
                    request.offset, request.length
                ),
            );
        }
        let block = u64::from(BLOCK_SIZE_MIN);
        if !request.offset.is_multiple_of(block) || !request.length.is_multiple_of(block) {
            return refuse(
                ErrorKind::InvalidArgument,
                format!(
                    "offset {} length {} not aligned to {block} bytes",
                    request.offset, request.length
                ),
            );
        }
        if command == command::READ && request.length > u64::from(PAYLOAD_LENGTH_MAX) {
            return refuse(
                ErrorKind::Overflow,
                format!(
                    "read length {} exceeds the maximum {PAYLOAD_LENGTH_MAX}",
                    request.length
                ),
            );
        }
        if command == command::BLOCK_STATUS {
            if self.base_allocation_id.is_none() {
                return refuse(
                    ErrorKind::InvalidArgument,
                    "no metadata context selected".to_owned(),
                );
            }
            if request.length == 0 {
                return refuse(
                    ErrorKind::InvalidArgument,
                    "block status of zero length".to_owned(),
                );
            }
        }
        Verdict::Run
    }

    fn run(&self, job: &Job, scratch: &mut Scratch) {
        let request = &job.request;
        let fua = request.flags & command_flags::FUA != 0;
        let export = self.export.as_ref();
        let result = match request.command {
            command::READ => return self.run_read(request, scratch),
            command::BLOCK_STATUS => return self.run_block_status(request),
            command::WRITE => call_export(request, || {
                export.write_at(request.offset, scratch.current(job.payload_length), fua)
            }),
            command::FLUSH => call_export(request, || export.flush()),
            command::TRIM => {
                call_export(request, || export.trim(request.offset, request.length, fua))
            }
            command::CACHE => call_export(request, || export.cache(request.offset, request.length)),
            command::WRITE_ZEROES => {
                let fast = request.flags & command_flags::FAST_ZERO != 0;
                let options = ZeroOptions {
                    may_trim: request.flags & command_flags::NO_HOLE == 0,
                    fast,
                    fua,
                };
                call_export(request, || {
                    export.write_zeroes(request.offset, request.length, options)
                })
                .map_err(|error| {
                    if !fast && error.kind() == ErrorKind::NotSupported {
                        // ENOTSUP is reserved for refused fast zeroes.
                        Error::Export {
                            kind: ErrorKind::Io,
                            context: "write zeroes failed".to_owned(),
                            source: Some(Box::new(error)),
                        }
                    } else {
                        error
                    }
                })
            }
            other => unreachable!("command {other} passed the checks"),
        };
        match result {
            Ok(()) => self.reply_done(request),
            Err(error) => self.reply_error(request, &error),
        }
    }

    fn run_read(&self, request: &Request, scratch: &mut Scratch) {
        let length = usize::try_from(request.length).expect("read length checked");
        let buffer = scratch.prepare(length);
        let export = self.export.as_ref();
        match call_export(request, || export.read_at(request.offset, buffer)) {
            Ok(()) => self.reply_data(request, buffer),
            Err(error) => self.reply_error(request, &error),
        }
    }

    fn run_block_status(&self, request: &Request) {
        let id = self
            .base_allocation_id
            .expect("checked before dispatch: context selected");
        let one = request.flags & command_flags::REQ_ONE != 0;
        let extents_max = if one { 1 } else { EXTENTS_PER_REPLY_MAX };
        let export = self.export.as_ref();
        let result = call_export(request, || {
            export.block_status(request.offset, request.length, extents_max)
        })
        .and_then(|extents| {
            descriptors(
                &extents,
                request.length,
                extents_max,
                self.export.as_ref().name(),
            )
        });
        match result {
            Ok(descriptors) => {
                let chunk_type = match self.style {
                    ReplyStyle::Extended => chunk::BLOCK_STATUS_EXT,
                    _ => chunk::BLOCK_STATUS,
                };
                let payload = protocol::encode_block_status(self.header_style(), id, &descriptors);
                self.reply_chunk(request, chunk_type, &[&payload]);
            }
            Err(error) => self.reply_error(request, &error),
        }
    }

    /// Writes one reply with a single vectored write; a failure marks the connection broken
    /// and shuts the socket so the reader stops too.
    fn send(&self, buffers: &mut [IoSlice<'_>]) {
        let mut writer = match self.writer.lock() {
            Ok(writer) => writer,
            Err(poisoned) => {
                // A thread panicked mid-reply: the stream may hold half a reply, so nothing
                // more can be framed on it (see [`crate::sync`]).
                self.broken.store(true, Ordering::SeqCst);
                let _ = poisoned.into_inner().shutdown(Shutdown::Both);
                return;
            }
        };
        if self.broken.load(Ordering::SeqCst) {
            return;
        }
        if write_all_vectored(&mut *writer, buffers).is_err() {
            self.broken.store(true, Ordering::SeqCst);
            let _ = writer.shutdown(Shutdown::Both);
        }
    }

    fn reply_chunk(&self, request: &Request, chunk_type: u16, payload: &[&[u8]]) {
        let header = ChunkHeader {
            flags: REPLY_FLAG_DONE,
            chunk_type,
            cookie: request.cookie,
            offset: request.offset,
            payload_length: payload.iter().map(|part| part.len() as u64).sum(),
        }
        .encode(self.header_style());
        let mut buffers = [IoSlice::new(&[]); 3];
        buffers[0] = IoSlice::new(header.as_slice());
        assert!(payload.len() < buffers.len(), "too many payload parts");
        for (slot, part) in buffers[1..].iter_mut().zip(payload) {
            *slot = IoSlice::new(part);
        }
        self.send(&mut buffers[..1 + payload.len()]);
    }

    /// Success without data.
    fn reply_done(&self, request: &Request) {
        match self.style {
            ReplyStyle::Simple | ReplyStyle::Structured => {
                let header = encode_simple_reply(0, request.cookie);
                self.send(&mut [IoSlice::new(&header)]);
            }
            ReplyStyle::Extended => self.reply_chunk(request, chunk::NONE, &[]),
        }
    }

    fn reply_data(&self, request: &Request, data: &[u8]) {
        match self.style {
            ReplyStyle::Simple => {
                let header = encode_simple_reply(0, request.cookie);
                self.send(&mut [IoSlice::new(&header), IoSlice::new(data)]);
            }
            _ if data.is_empty() => self.reply_chunk(request, chunk::NONE, &[]),
            _ => {
                let offset = protocol::encode_offset(request.offset);
                self.reply_chunk(request, chunk::OFFSET_DATA, &[&offset, data]);
            }
        }
    }

    fn reply_error(&self, request: &Request, error: &Error) {
        let code = nbd_error_code(error);
        match self.style {
            ReplyStyle::Simple => {
                let header = encode_simple_reply(code, request.cookie);
                self.send(&mut [IoSlice::new(&header)]);
            }
            ReplyStyle::Structured | ReplyStyle::Extended => {
                let payload = protocol::encode_error_payload(code, &error.to_string());
                self.reply_chunk(request, chunk::ERROR, &[&payload]);
            }
        }
    }
}

/// Turns the export's extents into wire descriptors for a request of `length` bytes: drops
/// empty extents, merges neighbours with equal flags, stops at the request end (clipping the
/// last one) and at `descriptors_max`.
fn descriptors(
    extents: &[crate::export::Extent],
    length: u64,
    descriptors_max: usize,
    export_name: &str,
) -> Result<Vec<Descriptor>> {
    let mut out: Vec<Descriptor> = Vec::new();
    let mut covered = 0u64;
    for extent in extents {
        if covered >= length {
            break;
        }
        if extent.length_bytes == 0 {
            continue;
        }
        let flags =
            if extent.hole { state::HOLE } else { 0 } | if extent.zero { state::ZERO } else { 0 };
        let piece = extent.length_bytes.min(length - covered);
        covered += piece;
        let full = out.len() >= descriptors_max;
        match out.last_mut() {
            Some(last) if last.flags == flags => last.length += piece,
            _ if full => break,
            _ => out.push(Descriptor {
                length: piece,
                flags,
            }),
        }
    }
    if out.is_empty() {
        return Err(Error::export(
            ErrorKind::Io,
            format!("export {export_name} returned no extents"),
        ));
    }
    Ok(out)
}

/// True for the error a read gives when the socket's read timeout passes.
fn is_timeout(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Calls the export for `request`, turning a panic in it into an I/O error for that request
/// alone: the request is answered and its budget released like any failed request, and the
/// threads and locks of the session stay usable (the export's own state is its business; an
/// export that cannot go on after a panic fails its later requests itself).
fn call_export<T>(request: &Request, call: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
        Ok(result) => result,
        Err(_) => Err(Error::Export {
            kind: ErrorKind::Io,
            context: format!(
                "the export panicked serving command {} at offset {}",
                request.command, request.offset
            ),
            source: None,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::Extent;

    fn extent(length_bytes: u64, hole: bool) -> Extent {
        Extent {
            length_bytes,
            hole,
            zero: hole,
        }
    }

    #[test]
    fn descriptors_merge_clip_and_cap() {
        let extents = [
            extent(512, true),
            extent(512, true),
            extent(0, false),
            extent(1024, false),
            extent(4096, true),
        ];
        let out = descriptors(&extents, 2048 + 512, 100, "e").unwrap();
        assert_eq!(
            out,
            vec![
                Descriptor {
                    length: 1024,
                    flags: 3
                },
                Descriptor {
                    length: 1024,
                    flags: 0
                },
                Descriptor {
                    length: 512,
                    flags: 3
                },
            ]
        );
        let one = descriptors(&extents, 4096, 1, "e").unwrap();
        assert_eq!(one.len(), 1);
        assert!(descriptors(&[], 512, 1, "e").is_err());
    }
}
