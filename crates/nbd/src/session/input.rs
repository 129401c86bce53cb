//! The read side of a connection: the buffered socket ([`Input`]) and reading, checking and
//! taking the next request ([`Connection::next`]).
//!
//! Invariants: bytes are consumed from the socket only under the input lock, whole requests
//! at a time (header, then its payload or its discarding), so the stream stays framed
//! between requests; a request becomes a [`Job`] only after [`Connection::check`] passed it
//! (range inside the export, aligned, payload within [`PAYLOAD_LENGTH_MAX`], known command and
//! flags) and its budget is reserved, and the budget is released again if its payload cannot
//! be read. A refused request's payload is discarded and an error reply is written before the
//! next request is read.
//!
//! Between requests, with nothing in flight and nothing buffered, the thread spins for a
//! short adaptive window in non-blocking receives before it sleeps in `recv` ([`spin`]).

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::net::RecvFlags;

use super::check::Verdict;
use super::more::MoreProbe;
use super::payload::PayloadTarget;
use super::reactor::VISIT_REQUESTS_MAX;
use super::spin::{self, Bursts, Spin};
use super::{Connection, Job, Next, Scratch};
use crate::error::{Error, Result};
use crate::handshake::ReplyStyle;
use crate::protocol::{command, command_flags, Request, PAYLOAD_LENGTH_MAX};
use crate::stream::Stream;

/// Size of each connection's input buffer: room for the headers of many queued requests in
/// one `recv`. Bytes of a WRITE payload that land in it are copied out once.
const INPUT_BUFFER_BYTES: usize = 64 * 1024;

/// The read side of the socket, buffered, shared by the connection's threads under a lock.
pub(super) struct Input {
    stream: Arc<Stream>,
    /// Empty while released (a parked connection with nothing buffered holds none).
    buffer: Vec<u8>,
    /// Unconsumed bytes are `buffer[start..end]`.
    start: usize,
    end: usize,
    /// Reading has stopped; every thread that takes the input from now on leaves.
    pub(super) ended: bool,
    /// Why reading stopped, if not cleanly.
    pub(super) error: Option<Error>,
    /// Read timeouts in a row with nothing received (and, between requests, nothing in
    /// flight); reset by every byte received.
    pub(super) quiet_ticks: u32,
    idle_ticks_max: u32,
    /// Requests read so far (DISC not counted), for the connection's closing log line.
    pub(super) requests: u64,
    /// The spin before sleeping between requests.
    spin: Spin,
    /// Requests per wait: the spin is only for a client that waits for each reply.
    bursts: Bursts,
    /// Whether to look for more requests before sending a batch.
    more: MoreProbe,
    /// [`Input::receive_more`] found nothing, or did not look because such tries seldom
    /// find anything: a receive right after the batch goes out would find nothing either
    /// (see [`Connection::fill_header`]).
    pub(super) nothing_expected: bool,
    /// Requests read in this visit of an event-loop worker (see `reactor`).
    pub(super) visit_requests: u32,
    /// When the last receive found nothing and the connection was parked.
    parked_since: Option<Instant>,
}

impl Input {
    /// An input on `stream`; `spin_max` is the widest spin window (zero: never spin).
    pub(super) fn new(stream: Arc<Stream>, idle_ticks_max: u32, spin_max: Duration) -> Self {
        Input {
            stream,
            buffer: vec![0u8; INPUT_BUFFER_BYTES],
            start: 0,
            end: 0,
            ended: false,
            error: None,
            quiet_ticks: 0,
            idle_ticks_max,
            requests: 0,
            spin: Spin::new(spin_max),
            bursts: Bursts::default(),
            more: MoreProbe::default(),
            nothing_expected: false,
            visit_requests: 0,
            parked_since: None,
        }
    }

    /// Gives the buffer up if it holds nothing (a connection about to be parked): into
    /// `spare` (the worker's, for the next connection it visits) if that is empty, else it is
    /// freed. Allocating and zeroing 64 KiB per visit was 3% of the event loop's CPU at
    /// queue depth 32 (docs/performance.md).
    pub(super) fn release_buffer(&mut self, spare: &mut Vec<u8>) {
        if self.buffered() == 0 {
            let buffer = std::mem::take(&mut self.buffer);
            if spare.is_empty() {
                *spare = buffer;
            }
            self.start = 0;
            self.end = 0;
        }
    }

    /// Takes `spare` (a worker's buffer from [`Input::release_buffer`]) as the buffer if
    /// this input has none; its old bytes lie outside the unconsumed range and are never
    /// read.
    pub(super) fn lend_buffer(&mut self, spare: &mut Vec<u8>) {
        if self.buffer.is_empty() && spare.len() == INPUT_BUFFER_BYTES {
            self.buffer = std::mem::take(spare);
        }
    }

    /// Allocates the buffer again after [`Input::release_buffer`].
    fn ensure_buffer(&mut self) {
        if self.buffer.is_empty() {
            self.buffer = vec![0u8; INPUT_BUFFER_BYTES];
        }
    }

    /// One non-blocking receive of whatever the client sent; true if bytes came (end of
    /// stream and errors are met by the next read).
    pub(super) fn try_receive(&mut self) -> bool {
        self.ensure_buffer();
        if self.buffered() == 0 {
            self.start = 0;
            self.end = 0;
        } else if self.end == self.buffer.len() {
            self.buffer.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        match receive(
            &self.stream,
            &mut self.buffer[self.end..],
            RecvFlags::DONTWAIT,
        ) {
            Ok(count) if count > 0 => {
                self.end += count;
                self.quiet_ticks = 0;
                true
            }
            _ => false,
        }
    }

    pub(super) fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Stops reading; the first reason given is kept.
    pub(super) fn stop(&mut self, result: Result<()>) {
        if !self.ended {
            self.ended = true;
            self.error = result.err();
        }
    }

    /// Buffers at least `length` bytes, reading as much as the socket has; `Ok(false)` if the
    /// peer closed with nothing buffered. A read timeout comes back as an error (see
    /// [`is_timeout`]) with what arrived so far kept, so the caller can decide to wait on.
    /// With `may_spin` and nothing buffered, the first read spins before it sleeps.
    /// Without `wait`, a read that would block returns `WouldBlock` at once instead (the
    /// event loop parks the connection then, keeping what arrived).
    fn fill(&mut self, length: usize, may_spin: bool, wait: bool) -> io::Result<bool> {
        self.ensure_buffer();
        let spin_first = may_spin && self.spin.enabled() && self.buffered() == 0;
        assert!(length <= self.buffer.len(), "fill beyond the input buffer");
        if self.buffered() == 0 {
            self.start = 0;
            self.end = 0;
        } else if self.start + length > self.buffer.len() {
            self.buffer.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let mut first = true;
        while self.buffered() < length {
            let flags = if wait {
                RecvFlags::empty()
            } else {
                RecvFlags::DONTWAIT
            };
            let result = if first && spin_first {
                self.receive_spinning(wait)
            } else {
                receive(&self.stream, &mut self.buffer[self.end..], flags).map_err(io::Error::from)
            };
            first = false;
            match result {
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

    /// One read into the free part of the buffer: non-blocking receives for the spin window
    /// (if a spin slot is free), then a blocking read; adapts the window to when the bytes
    /// came (see [`spin`]). End of stream, errors and timeouts come back as from a read.
    /// On the event loop (`wait` false) a receive that would block parks the connection:
    /// the wait is counted from then to the next receive, which does not spin.
    fn receive_spinning(&mut self, wait: bool) -> io::Result<usize> {
        if let Some(since) = self.parked_since.take() {
            let result = receive(
                &self.stream,
                &mut self.buffer[self.end..],
                RecvFlags::DONTWAIT,
            )
            .map_err(io::Error::from);
            match &result {
                Ok(_) => self.spin.slept(since.elapsed()),
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                    self.parked_since = Some(since);
                }
                Err(_) => {}
            }
            return result;
        }
        let start = Instant::now();
        let window = self.spin.window();
        let (stream, free) = (&self.stream, &mut self.buffer[self.end..]);
        if let Some(result) =
            spin_receive(window, || receive(stream, &mut *free, RecvFlags::DONTWAIT))
        {
            if result.is_ok() {
                self.spin.caught(start.elapsed());
            }
            return result;
        }
        let flags = if wait {
            RecvFlags::empty()
        } else {
            RecvFlags::DONTWAIT
        };
        let result =
            receive(&self.stream, &mut self.buffer[self.end..], flags).map_err(io::Error::from);
        match &result {
            Ok(_) => self.spin.slept(start.elapsed()),
            Err(error) if !wait && error.kind() == io::ErrorKind::WouldBlock => {
                self.parked_since = Some(start);
            }
            Err(error) if is_timeout(error) => self.spin.quiet(),
            Err(_) => {}
        }
        result
    }

    /// Before a thread sends its batch because the next request is not buffered whole: one
    /// non-blocking receive of whatever the client sent meanwhile, if recent ones found
    /// something often enough ([`MoreProbe`]); true if bytes came. Each one that succeeds
    /// lets the batch grow instead of going out (a `send`, and a wake-up of the client, per
    /// request saved at queue depth 32); one that finds nothing costs a `recv`, so at queue
    /// depth 1, where the client waits for the reply, few are tried.
    pub(super) fn receive_more(&mut self) -> bool {
        if !self.more.should_try() {
            self.nothing_expected = true;
            return false;
        }
        let came = self.try_receive();
        self.more.record(came);
        self.nothing_expected = !came;
        came
    }

    /// The next `length` buffered bytes, not consumed; `None` if fewer are buffered.
    fn peek(&self, length: usize) -> Option<&[u8]> {
        (self.buffered() >= length).then(|| &self.buffer[self.start..self.start + length])
    }

    /// Counts one quiet tick; an error once the connection has been quiet for too long.
    fn count_quiet_tick(&mut self) -> io::Result<()> {
        self.quiet_ticks += 1;
        if self.quiet_ticks >= self.idle_ticks_max {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "idle timeout"));
        }
        Ok(())
    }

    /// One receive into `target`, or into the whole input buffer if `None` (for discarding),
    /// waiting through read timeouts until the connection has been quiet for the idle timeout
    /// (a client may pause inside a payload, but not for longer than between requests); end
    /// of stream is an error, since a request is incomplete.
    fn read_patiently(&mut self, mut target: Option<&mut PayloadTarget<'_>>) -> io::Result<usize> {
        loop {
            let result = match target.as_deref_mut() {
                Some(target) => target.receive(&self.stream, RecvFlags::empty()),
                None => {
                    self.ensure_buffer();
                    receive(&self.stream, &mut self.buffer, RecvFlags::empty())
                }
            };
            match result.map_err(io::Error::from) {
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

    /// Fills `payload` from the buffer, then straight from the socket. While the spin is on,
    /// the rest of a payload whose header came alone is waited for by spinning too (it is
    /// on its way: the client sends it right behind the header), so a WRITE does not cost a
    /// second wake-up.
    fn read_payload(&mut self, mut payload: PayloadTarget<'_>) -> io::Result<()> {
        let from_buffer = self.buffered().min(payload.remaining());
        payload.push(&self.buffer[self.start..self.start + from_buffer]);
        self.start += from_buffer;
        while payload.remaining() > 0 {
            let window = self.spin.window();
            let stream = &self.stream;
            match spin_receive(window, || payload.receive(stream, RecvFlags::DONTWAIT)) {
                Some(Ok(0)) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Some(result) => {
                    result?;
                }
                None => {
                    self.read_patiently(Some(&mut payload))?;
                }
            }
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

impl Connection {
    /// Reads and checks the next request; a WRITE payload goes into `scratch`.
    pub(super) fn next(&self, input: &mut Input, scratch: &mut Scratch) -> Next {
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
    /// On the event loop (see `reactor`) the header is never waited for: `Ok(None)` when it
    /// is not all here (or the visit has read its share of requests), and the worker parks
    /// the connection.
    fn fill_header(&self, input: &mut Input, size: usize) -> Result<Option<bool>> {
        let on_loop = self.reactor.is_some();
        loop {
            // Spinning only while nothing is in flight, here or on another connection (the
            // other threads' requests need the CPU more than this one's next), and only for
            // a client that sends one request per reply (see `spin`).
            if input.buffered() == 0 {
                input.bursts.waiting();
            }
            let may_spin = self.in_flight.load(Ordering::SeqCst) == 0
                && !spin::others_busy()
                && input.bursts.lone();
            // On the loop, right after a batch went out with nothing more expected (see
            // `Input::receive_more`), the connection is parked without a receive: its socket
            // is armed level-triggered, so what came meanwhile wakes a worker at once. That
            // saves the `recv` that would find nothing; a reader that may spin (queue depth
            // 1) looks on as before.
            let nothing_expected = std::mem::take(&mut input.nothing_expected);
            if on_loop && nothing_expected && !may_spin && input.buffered() == 0 {
                return Ok(None);
            }
            if on_loop && input.buffered() < size && input.visit_requests >= VISIT_REQUESTS_MAX {
                return Ok(None);
            }
            match input.fill(size, may_spin, !on_loop) {
                Err(error) if on_loop && error.kind() == io::ErrorKind::WouldBlock => {
                    return Ok(None)
                }
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
        input.requests += 1;
        input.visit_requests += 1;
        input.bursts.request();
        let payload_length = self.payload_length(&request);
        if payload_length > u64::from(PAYLOAD_LENGTH_MAX) {
            // The payload cannot be skipped safely: answer, then hang up.
            let error = Error::TooLong {
                what: "request payload",
                length: payload_length,
                maximum: u64::from(PAYLOAD_LENGTH_MAX),
            };
            self.reply_error(&request, &error, &mut scratch.batch);
            return Err(error);
        }
        match self.check(&request, payload_length) {
            Verdict::Refuse(error) => {
                // Per request, so not above debug: a client could flood the log.
                tracing::debug!(command = request.command, %error, "request refused");
                input
                    .discard(payload_length)
                    .map_err(|e| Error::io("discard payload", e))?;
                self.reply_error(&request, &error, &mut scratch.batch);
                Ok(Next::Answered)
            }
            Verdict::Run => {
                let reserved_bytes = match request.command {
                    command::READ | command::WRITE => request.length,
                    _ => 0,
                };
                self.acquire(reserved_bytes, &mut scratch.batch);
                let payload_length =
                    usize::try_from(payload_length).expect("payload length checked above");
                if payload_length > 0 {
                    if let Err(error) = input.read_payload(scratch.payload.target(payload_length)) {
                        self.release(reserved_bytes);
                        scratch.payload.shrink();
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

    /// True if the next request, header and payload, is buffered whole (or is unreadable,
    /// which ends the connection), so taking it does not wait for the socket.
    pub(super) fn holds_whole_request(&self, input: &Input) -> bool {
        let style = self.header_style();
        let size = style.request_size();
        let Some(header) = input.peek(size) else {
            return false;
        };
        let Ok(request) = Request::parse(style, header) else {
            return true;
        };
        let whole = (size as u64).saturating_add(self.payload_length(&request));
        input.buffered() as u64 >= whole
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
}

/// One receive into `target`.
pub(super) fn receive(
    stream: &Stream,
    target: &mut [u8],
    flags: RecvFlags,
) -> rustix::io::Result<usize> {
    rustix::net::recv(stream, target, flags).map(|(count, _)| count)
}

/// Non-blocking receives (`attempt`) for up to `window`, if a spin slot is free: the
/// result of the first that gets bytes, end of stream or an error; `None` if nothing came
/// (or `window` is zero, or no slot was free) and the caller is to block.
fn spin_receive(
    window: Duration,
    mut attempt: impl FnMut() -> rustix::io::Result<usize>,
) -> Option<io::Result<usize>> {
    if window.is_zero() {
        return None;
    }
    let _slot = spin::Slot::take()?;
    let start = Instant::now();
    loop {
        match attempt() {
            Ok(count) => return Some(Ok(count)),
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => {}
            Err(error) => return Some(Err(error.into())),
        }
        if start.elapsed() >= window {
            return None;
        }
        std::hint::spin_loop();
    }
}

/// True for the error a read gives when the socket's read timeout passes.
fn is_timeout(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

#[cfg(test)]
mod tests;
