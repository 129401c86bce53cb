//! The HTTP listener of `serve --metrics ADDR:PORT`: answers `GET /metrics` with the pool's
//! metrics in the Prometheus text format ([`crate::metrics`]) and nothing else.
//!
//! Each connection has a thread of its own, which serves one request, then closes it
//! (`Connection: close`). Requests are parsed with `httparse`. What a scraper can cost is
//! bounded: a request head of at most [`REQUEST_BYTES_MAX`], [`REQUEST_TIMEOUT`] in total to
//! send it and to take the answer, and at most [`CONNECTIONS_MAX`] connections at once; a
//! connection past that closes the oldest one open. So a hostile or stuck client delays no
//! other scrape (it used to: one connection at a time, 5 s each, so 10 idle connections
//! delayed a scrape by 51 s) and never touches the NBD path. Answers: 200 for `GET` (or
//! `HEAD`) `/metrics`, 404 for another path, 405 for another method, 400 for a malformed
//! request, 431 for one too large.
//!
//! The listener stops, and its connections are closed, at shutdown ([`MetricsListener::stop`]).

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::export::PoolRegistry;
use crate::metrics::{CountingRegistry, Metrics, CONTENT_TYPE};
use nbd::ExportRegistry;
use thin_pool::Pool;

/// Longest request head read (request line and headers); a request has no body.
const REQUEST_BYTES_MAX: usize = 8192;
/// Time a client has to send its request, and then to take the answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause after a failed accept.
const ACCEPT_RETRY_PAUSE: Duration = Duration::from_millis(100);
/// Most headers parsed.
const HEADERS_MAX: usize = 32;
/// Most connections served at once; one more closes the oldest.
const CONNECTIONS_MAX: usize = 16;
/// How often the listener looks whether it should stop.
const STOP_POLL: Duration = Duration::from_millis(200);
/// Longest wait at stop for the connections' threads to end (their sockets are shut down,
/// so they end at once unless the pool's metrics take that long to render).
const STOP_WAIT: Duration = Duration::from_secs(5);

/// Parses `--metrics`: `PORT` (on 127.0.0.1) or `ADDR:PORT` (`[ADDR]:PORT` for IPv6).
pub fn parse_metrics_address(text: &str) -> anyhow::Result<SocketAddr> {
    if let Ok(port) = text.parse::<u16>() {
        return Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port));
    }
    match text.parse::<SocketAddr>() {
        Ok(address) => Ok(address),
        Err(_) => bail!("--metrics {text:?}: expected PORT or ADDR:PORT (e.g. 127.0.0.1:9100)"),
    }
}

/// The registry the NBD servers should use, and the metrics to serve: with `address`, a
/// [`CountingRegistry`] over `registry` and new [`Metrics`] of `pool`, which also follow
/// `config`'s connection events (after the handler already there, if any); without it,
/// `registry` itself and no metrics.
pub fn counting(
    registry: &Arc<PoolRegistry>,
    pool: &Pool,
    address: Option<SocketAddr>,
    config: &mut nbd::Config,
) -> (Arc<dyn ExportRegistry>, Option<Arc<Metrics>>) {
    if address.is_none() {
        return (Arc::clone(registry) as _, None);
    }
    let metrics = Metrics::new(pool.clone(), registry.raw_names());
    let before = config.on_event.take();
    let counted = Arc::clone(&metrics);
    config.on_event = Some(Arc::new(move |event: &nbd::Event| {
        counted.on_event(event);
        if let Some(before) = &before {
            before(event);
        }
    }));
    let served = CountingRegistry::new(Arc::clone(registry) as _, Arc::clone(&metrics));
    (Arc::new(served), Some(metrics))
}

/// Binds `address` and serves `metrics` there on a thread of its own; the listener's
/// [`MetricsListener::address`] is the address bound (its port is the system's choice if
/// `address` asked for port 0).
pub fn start(address: SocketAddr, metrics: Arc<Metrics>) -> anyhow::Result<MetricsListener> {
    let listener = TcpListener::bind(address)
        .with_context(|| format!("cannot listen for metrics on {address}"))?;
    let bound = listener.local_addr().context("metrics listener address")?;
    // Not blocking: the accept loop polls, so that it sees a stop request.
    listener
        .set_nonblocking(true)
        .context("metrics listener: cannot make it non-blocking")?;
    if !bound.ip().is_loopback() {
        tracing::warn!(
            "metrics on {bound} are readable without authentication by \
             every host that reaches it (volume names, sizes, traffic)"
        );
    }
    let connections = Arc::new(Connections::default());
    let stop = Arc::new(AtomicBool::new(false));
    let thread = {
        let connections = Arc::clone(&connections);
        let stop = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("metrics-http".to_string())
            .spawn(move || accept_loop(&listener, &metrics, &connections, &stop))
            .context("cannot start the metrics thread")?
    };
    Ok(MetricsListener {
        address: bound,
        connections,
        stop,
        thread,
    })
}

/// The running metrics listener: stopped, its connections closed, by
/// [`MetricsListener::stop`].
pub struct MetricsListener {
    address: SocketAddr,
    connections: Arc<Connections>,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl MetricsListener {
    /// The address bound.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Stops accepting, closes the connections open and waits (at most [`STOP_WAIT`]) for
    /// their threads to end.
    pub fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.thread.join();
        let unfinished = self.connections.close_all(STOP_WAIT);
        tracing::info!(unfinished, "metrics listener closed");
    }
}

/// The connections being served, oldest first, each with a handle to shut it down.
#[derive(Default)]
struct Connections {
    open: Mutex<VecDeque<(u64, TcpStream)>>,
    /// Signalled when a connection ends.
    ended: Condvar,
}

impl Connections {
    /// Adds connection `id`; at [`CONNECTIONS_MAX`], first shuts the oldest down (its
    /// thread then ends on its own).
    fn add(&self, id: u64, stream: TcpStream) {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        while open.len() >= CONNECTIONS_MAX {
            if let Some((_, oldest)) = open.pop_front() {
                let _ = oldest.shutdown(std::net::Shutdown::Both);
            }
        }
        open.push_back((id, stream));
    }

    /// Connection `id` ended.
    fn remove(&self, id: u64) {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.retain(|(open_id, _)| *open_id != id);
        self.ended.notify_all();
    }

    /// Shuts every connection down and waits up to `wait` for their threads to say they
    /// ended; returns how many did not.
    fn close_all(&self, wait: Duration) -> usize {
        let deadline = Instant::now() + wait;
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        for (_, stream) in open.iter() {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        while !open.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            open = self
                .ended
                .wait_timeout(open, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        open.len()
    }
}

/// Accepts connections until `stop`, each served on a thread of its own.
fn accept_loop(
    listener: &TcpListener,
    metrics: &Arc<Metrics>,
    connections: &Arc<Connections>,
    stop: &AtomicBool,
) {
    let mut next_id = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                let mut fds = [rustix::event::PollFd::new(
                    listener,
                    rustix::event::PollFlags::IN,
                )];
                let timeout = rustix::time::Timespec {
                    tv_sec: 0,
                    tv_nsec: STOP_POLL.as_nanos() as _,
                };
                let _ = rustix::event::poll(&mut fds, Some(&timeout));
                continue;
            }
            // A failed accept (e.g. out of file descriptors) costs only that client; the
            // pause keeps a lasting failure from spinning.
            Err(_) => {
                std::thread::sleep(ACCEPT_RETRY_PAUSE);
                continue;
            }
        };
        // Accepted sockets do not inherit the listener's non-blocking mode on Linux; made
        // sure of, as the reads rely on their timeouts.
        let Ok(handle) = stream
            .set_nonblocking(false)
            .and_then(|()| stream.try_clone())
        else {
            continue;
        };
        let id = next_id;
        next_id += 1;
        connections.add(id, handle);
        let metrics = Arc::clone(metrics);
        let ended = Arc::clone(connections);
        let spawned = std::thread::Builder::new()
            .name("metrics-conn".to_string())
            .spawn(move || {
                serve_one(stream, &metrics);
                ended.remove(id);
            });
        if spawned.is_err() {
            // Out of threads: this client is closed (its socket, moved into the failed
            // closure, is dropped), the others go on.
            connections.remove(id);
        }
    }
}

/// Reads one request from `stream`, answers it and closes the connection.
fn serve_one(mut stream: TcpStream, metrics: &Metrics) {
    let deadline = Instant::now() + REQUEST_TIMEOUT;
    let answer = match read_request(&mut stream, deadline) {
        Ok(Some(request)) => answer(&request, metrics),
        Ok(None) => return,
        Err(status) => Answer::status(status),
    };
    let _ = stream.set_write_timeout(Some(REQUEST_TIMEOUT));
    let _ = stream.write_all(&answer.encode());
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

/// The parts of a request that decide the answer.
#[derive(Debug, PartialEq, Eq)]
struct Request {
    method: String,
    path: String,
}

/// Reads a request head until it is complete; `Ok(None)` if the client went away or ran out
/// of time, `Err(status)` for a request to refuse.
fn read_request(stream: &mut TcpStream, deadline: Instant) -> Result<Option<Request>, u16> {
    let mut buffer = vec![0u8; REQUEST_BYTES_MAX];
    let mut filled = 0;
    loop {
        match parse_request(&buffer[..filled]) {
            Ok(Some(request)) => return Ok(Some(request)),
            Ok(None) if filled == buffer.len() => return Err(431),
            Ok(None) => {}
            Err(status) => return Err(status),
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return Ok(None);
        }
        match stream.read(&mut buffer[filled..]) {
            Ok(0) | Err(_) => return Ok(None),
            Ok(read) => filled += read,
        }
    }
}

/// Parses a request head: `Ok(None)` while incomplete.
fn parse_request(head: &[u8]) -> Result<Option<Request>, u16> {
    let mut headers = [httparse::EMPTY_HEADER; HEADERS_MAX];
    let mut request = httparse::Request::new(&mut headers);
    match request.parse(head) {
        Ok(httparse::Status::Complete(_)) => Ok(Some(Request {
            method: request.method.unwrap_or_default().to_string(),
            path: request.path.unwrap_or_default().to_string(),
        })),
        Ok(httparse::Status::Partial) => Ok(None),
        Err(httparse::Error::TooManyHeaders) => Err(431),
        Err(_) => Err(400),
    }
}

/// An HTTP answer.
struct Answer {
    status: u16,
    body: String,
    content_type: &'static str,
    /// `HEAD`: the headers of the GET answer, without its body.
    head_only: bool,
}

impl Answer {
    /// An error answer with its reason as the body.
    fn status(status: u16) -> Answer {
        Answer {
            status,
            body: format!("{}\n", reason(status)),
            content_type: "text/plain; charset=utf-8",
            head_only: false,
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.status,
            reason(self.status),
            self.content_type,
            self.body.len()
        );
        if self.status == 405 {
            out.push_str("Allow: GET, HEAD\r\n");
        }
        out.push_str("\r\n");
        if !self.head_only {
            out.push_str(&self.body);
        }
        out.into_bytes()
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        _ => "Error",
    }
}

fn answer(request: &Request, metrics: &Metrics) -> Answer {
    // The query string, if any, is ignored (Prometheus sends none by default).
    let path = request.path.split('?').next().unwrap_or_default();
    if path != "/metrics" {
        return Answer::status(404);
    }
    let head_only = match request.method.as_str() {
        "GET" => false,
        "HEAD" => true,
        _ => return Answer::status(405),
    };
    Answer {
        status: 200,
        body: metrics.render(),
        content_type: CONTENT_TYPE,
        head_only,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_ports_on_loopback_or_full() {
        assert_eq!(
            parse_metrics_address("9100").unwrap(),
            "127.0.0.1:9100".parse().unwrap()
        );
        assert_eq!(
            parse_metrics_address("0.0.0.0:9100").unwrap(),
            "0.0.0.0:9100".parse().unwrap()
        );
        assert_eq!(
            parse_metrics_address("[::1]:0").unwrap(),
            "[::1]:0".parse().unwrap()
        );
        for bad in ["", "localhost", "127.0.0.1", "70000", "::1:9100"] {
            assert!(parse_metrics_address(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn requests_parse_once_complete() {
        let full = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
        for cut in 0..full.len() {
            assert_eq!(parse_request(&full[..cut]), Ok(None), "cut at {cut}");
        }
        assert_eq!(
            parse_request(full),
            Ok(Some(Request {
                method: "GET".into(),
                path: "/metrics".into()
            }))
        );
        assert_eq!(
            parse_request(b"GET /metrics HTTP/1.1\r\nbad header\r\n\r\n"),
            Err(400)
        );
        let many: String = (0..=HEADERS_MAX).map(|i| format!("h{i}: v\r\n")).collect();
        let request = format!("GET / HTTP/1.1\r\n{many}\r\n");
        assert_eq!(parse_request(request.as_bytes()), Err(431));
    }

    #[test]
    fn answers_encode_status_length_and_allow() {
        let answer = Answer::status(405).encode();
        let text = String::from_utf8(answer).unwrap();
        assert!(
            text.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"),
            "{text}"
        );
        assert!(text.contains("Allow: GET, HEAD\r\n"), "{text}");
        assert!(text.contains("Content-Length: 19\r\n"), "{text}");
        assert!(text.ends_with("\r\n\r\nMethod Not Allowed\n"), "{text}");
    }
}
