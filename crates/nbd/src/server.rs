//! Listeners, accept loops, a thread per connection, and graceful shutdown.
//!
//! Owns the listening sockets, the table of live connections and (with
//! `Config::event_loop`, the default) the event loop that serves connections. The
//! handshake must finish within `handshake_timeout` of the accept in total. On the event
//! loop (`session`'s `reactor`: a few workers for all connections) the accept loop sends
//! the greeting and parks the connection, a worker runs the handshake once the client
//! answers and then parks the session, so a connection waiting for its client, in the
//! handshake or idle after it, costs no thread (see `connection`). Without the loop each
//! accepted connection runs the handshake on its own thread (stack `thread_stack_bytes`),
//! then the session on that thread, adding threads only while requests queue up. Either
//! way the session closes after `idle_timeout` without a request, and the connection cap
//! can be in the thousands.
//!
//! Invariants: at most `connections_max` connections are served at once, and at most
//! `connections_per_peer_max` from one peer (a uid on a Unix socket, an IPv4 address or an
//! IPv6 /64 on TCP), of which at most `handshakes_per_peer_max` are in the handshake; a peer
//! at a limit gives up its oldest handshake or its connection idle the longest for a new
//! one, and only a peer whose connections are all busy has new ones refused (see
//! `table`; refusals and evictions are logged, rate-limited, see `log_limit`). Every live
//! connection has an entry in the table (removed by a drop guard when its last thread ends,
//! even by a panic), so shutdown can reach it. Payload buffers are bounded per connection
//! (`bytes_in_flight_max`) and, for payloads over 256 KiB, over the whole server
//! (`server_bytes_in_flight_max`, of which one connection holds at most its fair share once
//! half is used, see `session`), so buffer memory stays below the server limit plus, per
//! connection, a 64 KiB input buffer and a retained payload buffer of up to 256 KiB per
//! running thread. A connection that stops reading replies blocks in its own writes and
//! stops reading its own requests; others go on. A Unix socket is created with mode 0600
//! (set right after bind; put it in a private directory if that short window matters) and
//! removed at shutdown.
//! Logs go through `tracing` (the embedding binary installs the subscriber): each
//! connection's thread runs in a `conn` span with its number and peer, and logs its open, the
//! export it serves and its close with the requests it read (at warn if the client broke
//! the protocol); shutdown logs the connections it closed.
//! With `Config::tls`, STARTTLS hands a connection's socket to a TLS pump thread (see
//! [`crate::tls`]), which holds the connection's table entry until its last record is out.
//! Shutdown stops the accept loops, shuts the read half of every connection (clients see
//! in-flight requests answered, then EOF), waits for the connection threads, and after a
//! grace period shuts the sockets completely.
//!
//! Files: this one holds [`Server`] and the state its threads share; `config` what the
//! embedding binary sets and hears; `listen` the listeners and their accept loops; `table`
//! the live connections and their admission; `connection` one connection's thread;
//! `log_limit` the rate limit on refusal and eviction lines.

mod config;
mod connection;
mod listen;
mod log_limit;
mod table;

use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use config::{Config, Event, EventHandler, SpliceReads};
use listen::{Listening, ACCEPT_STOP_WAIT};
use log_limit::LogLimit;
use table::Table;

use crate::export::ExportRegistry;
use crate::session::{Budget, Reactor};
use crate::sync;

struct Shared {
    registry: Arc<dyn ExportRegistry>,
    config: Config,
    shutting_down: AtomicBool,
    listening: Mutex<Vec<Listening>>,
    connections: Mutex<Table>,
    connection_ended: Condvar,
    next_connection: AtomicU64,
    server_bytes: Arc<Budget>,
    /// The connections open when shutdown was requested (count, description), for its log.
    closing: Mutex<Option<(usize, String)>>,
    /// How often refusals and evictions are logged.
    log_limit: LogLimit,
    /// The event loop serving sessions, with `Config::event_loop`.
    reactor: Option<Arc<Reactor>>,
}

/// An NBD server: serves the exports of a registry on any number of listeners.
pub struct Server {
    shared: Arc<Shared>,
    accept_threads: Vec<JoinHandle<()>>,
    stopped: bool,
}

/// Cloneable handle that asks a [`Server`] to stop (for signal handlers or other threads).
#[derive(Clone)]
pub struct ShutdownHandle {
    shared: Arc<Shared>,
}

impl ShutdownHandle {
    /// Stops accepting, refuses further options and shuts the read half of every connection.
    /// Returns at once; [`Server::shutdown`] waits for the connections.
    pub fn request(&self) {
        self.shared.request_shutdown();
    }

    /// Connections the server has open now (in handshake or transmission).
    pub fn connection_count(&self) -> usize {
        sync::lock(&self.shared.connections).len()
    }
}

impl Server {
    /// A server for the exports in `registry`; it serves nothing until a `listen_*` call.
    pub fn new(registry: Arc<dyn ExportRegistry>, config: Config) -> Self {
        assert!(
            config.workers_per_connection > 0,
            "workers_per_connection is 0"
        );
        assert!(
            config.requests_in_flight_max > 0,
            "requests_in_flight_max is 0"
        );
        assert!(!config.idle_timeout.is_zero(), "idle_timeout is 0");
        let reactor = config.event_loop.then(|| new_reactor(&config)).flatten();
        Server {
            shared: Arc::new(Shared {
                registry,
                shutting_down: AtomicBool::new(false),
                listening: Mutex::new(Vec::new()),
                connections: Mutex::new(Table::new(table::Limits {
                    connections_max: config.connections_max,
                    connections_per_peer_max: config.connections_per_peer_max,
                    handshakes_per_peer_max: config.handshakes_per_peer_max,
                })),
                connection_ended: Condvar::new(),
                next_connection: AtomicU64::new(1),
                closing: Mutex::new(None),
                log_limit: LogLimit::new(),
                server_bytes: Arc::new(Budget::new(usize::MAX, config.server_bytes_in_flight_max)),
                reactor,
                config,
            }),
            accept_threads: Vec::new(),
            stopped: false,
        }
    }

    /// A handle that can request shutdown from elsewhere.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Connections currently open (in handshake or transmission).
    pub fn connection_count(&self) -> usize {
        sync::lock(&self.shared.connections).len()
    }

    /// Stops accepting, lets in-flight requests finish, waits for every connection (cutting
    /// them off after `shutdown_grace`), and removes Unix socket files.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        self.shared.request_shutdown();
        let (closing_count, closing) = sync::lock(&self.shared.closing).clone().unwrap_or_default();
        // An accept loop that the wake-up connection could not reach (its socket file was
        // removed, say) is left to end on its next accept rather than hang shutdown.
        let deadline = Instant::now() + ACCEPT_STOP_WAIT;
        for thread in self.accept_threads.drain(..) {
            while !thread.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            if thread.is_finished() {
                let _ = thread.join();
            }
        }
        let shared = &self.shared;
        if !shared.wait_for_connections(shared.config.shutdown_grace) {
            let table = sync::lock(&shared.connections);
            tracing::warn!(
                connections = %table.describe(),
                grace_seconds = shared.config.shutdown_grace.as_secs_f64(),
                "cutting off connections still open after the grace period"
            );
            table.shutdown_all(Shutdown::Both);
            drop(table);
            shared.wait_for_connections(shared.config.shutdown_grace);
        }
        if let Some(reactor) = &shared.reactor {
            reactor.stop(shared.config.shutdown_grace);
        }
        let listening = sync::lock(&shared.listening);
        for listening in listening.iter() {
            if let Listening::Unix {
                path: Some(path),
                owned: true,
            } = listening
            {
                let _ = std::fs::remove_file(path);
            }
        }
        let sockets: Vec<String> = listening.iter().map(ToString::to_string).collect();
        tracing::info!(
            sockets = %sockets.join(", "),
            connections_closed = closing_count,
            connections = %closing,
            "NBD server stopped"
        );
    }
}

/// The event loop for `config`, or `None` (connections get their own threads) if the
/// system refuses one.
fn new_reactor(config: &Config) -> Option<Arc<Reactor>> {
    let threads = match config.loop_threads {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        threads => threads,
    };
    let deadline_min = config.idle_timeout.min(config.handshake_timeout);
    match Reactor::new(threads, deadline_min, config.thread_stack_bytes) {
        Ok(reactor) => Some(Arc::new(reactor)),
        Err(error) => {
            tracing::warn!(%error, "no NBD event loop: each connection gets its own threads");
            None
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}
impl Shared {
    fn emit(&self, event: Event) {
        if let Some(handler) = &self.config.on_event {
            handler(&event);
        }
    }

    fn request_shutdown(&self) {
        if self.shutting_down.swap(true, Ordering::SeqCst) {
            return;
        }
        // Accepting stops now: these are the connections this shutdown closes.
        let closing = {
            let table = sync::lock(&self.connections);
            (table.len(), table.describe())
        };
        *sync::lock(&self.closing) = Some(closing);
        // Wake each accept loop with a throwaway connection; it sees the flag and stops.
        for listening in sync::lock(&self.listening).iter() {
            listening.wake();
        }
        sync::lock(&self.connections).shutdown_all(Shutdown::Read);
    }

    /// Waits until no connection is left or `timeout` passes; true if none is left.
    fn wait_for_connections(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut connections = sync::lock(&self.connections);
        while !connections.is_empty() {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            connections = sync::wait_timeout(&self.connection_ended, connections, deadline - now).0;
        }
        true
    }
}
