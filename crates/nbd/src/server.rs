//! Listeners, accept loops, one thread per connection, and graceful shutdown.
//!
//! Owns the listening sockets and the table of live connections. Each accepted connection
//! runs on its own thread: handshake (bounded by a read timeout), then the session with its
//! request threads. Invariants: at most `connections_max` connections are served at once
//! (extra ones are closed at accept); every live connection has an entry in the table (removed
//! by a drop guard, even if its thread panics), so shutdown can reach it; payload buffers are
//! bounded per connection and over the whole server (`bytes_in_flight_max`,
//! `server_bytes_in_flight_max`), so buffer memory stays below the server limit plus one
//! maximum request per connection, plus a small retained buffer per connection thread
//! (input buffer per connection, payload buffer up to 256 KiB per thread); a Unix socket is created with mode 0600 (set right after
//! bind; put it in a private directory if that short window matters) and removed at shutdown.
//! Shutdown stops the accept loops, shuts the read half of every connection (clients see
//! in-flight requests answered, then EOF), waits for the connection threads, and after a
//! grace period shuts the sockets completely.

use std::collections::HashMap;
use std::fmt;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::export::ExportRegistry;
use crate::handshake::{self, Outcome};
use crate::session::{self, Budget, Limits};
use crate::stream::Stream;
use crate::sync;

/// Something that happened to a connection, for the embedding binary's logs.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// A client connected.
    Connected {
        /// Server-unique connection number.
        connection: u64,
        /// Peer address, or the socket path for Unix sockets.
        peer: String,
    },
    /// Negotiation finished and transmission started on `export`.
    Serving {
        /// Connection number.
        connection: u64,
        /// Export name as the client asked for it.
        export: String,
    },
    /// The connection ended; `error` says why if it was not a clean disconnect.
    Disconnected {
        /// Connection number.
        connection: u64,
        /// The error that ended the connection, if any, with its causes.
        error: Option<String>,
    },
}

/// Callback for [`Event`]s; called on connection threads, so it must be quick.
pub type EventHandler = Arc<dyn Fn(&Event) + Send + Sync>;

/// Server limits and hooks.
#[derive(Clone)]
pub struct Config {
    /// Threads per connection; each reads a request, runs it against the export and writes
    /// the reply, so this also bounds the requests in flight per connection.
    pub workers_per_connection: usize,
    /// Requests in flight per connection (header read, reply not yet written); also never
    /// more than `workers_per_connection`, since each thread serves one request at a time.
    pub requests_in_flight_max: usize,
    /// READ/WRITE payload bytes in flight per connection (a single larger request still runs).
    pub bytes_in_flight_max: u64,
    /// READ/WRITE payload bytes in flight over all connections together; with the per
    /// connection limit this bounds the server's buffer memory.
    pub server_bytes_in_flight_max: u64,
    /// Connections served at once; more are closed at accept.
    pub connections_max: usize,
    /// Longest wait for each read during the handshake.
    pub handshake_timeout: Duration,
    /// Longest wait for each reply write before the connection is dropped.
    pub write_timeout: Duration,
    /// How long shutdown waits for connections to finish before cutting them off.
    pub shutdown_grace: Duration,
    /// Optional observer of connection events.
    pub on_event: Option<EventHandler>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            workers_per_connection: 4,
            requests_in_flight_max: 64,
            bytes_in_flight_max: 64 * 1024 * 1024,
            server_bytes_in_flight_max: 512 * 1024 * 1024,
            connections_max: 256,
            handshake_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(10),
            on_event: None,
        }
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("Config")
            .field("workers_per_connection", &self.workers_per_connection)
            .field("requests_in_flight_max", &self.requests_in_flight_max)
            .field("bytes_in_flight_max", &self.bytes_in_flight_max)
            .field(
                "server_bytes_in_flight_max",
                &self.server_bytes_in_flight_max,
            )
            .field("connections_max", &self.connections_max)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("write_timeout", &self.write_timeout)
            .field("shutdown_grace", &self.shutdown_grace)
            .field("on_event", &self.on_event.is_some())
            .finish()
    }
}

/// Pause after a failed accept (EMFILE and the like) so the loop does not spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);
/// Longest wait for the accept loops to notice shutdown.
const ACCEPT_STOP_WAIT: Duration = Duration::from_secs(2);

/// How to wake a listener blocked in accept.
#[derive(Clone, Debug)]
enum Listening {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

struct Shared {
    registry: Arc<dyn ExportRegistry>,
    config: Config,
    shutting_down: AtomicBool,
    listening: Mutex<Vec<Listening>>,
    connections: Mutex<HashMap<u64, Stream>>,
    connection_ended: Condvar,
    next_connection: AtomicU64,
    server_bytes: Arc<Budget>,
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
        Server {
            shared: Arc::new(Shared {
                registry,
                shutting_down: AtomicBool::new(false),
                listening: Mutex::new(Vec::new()),
                connections: Mutex::new(HashMap::new()),
                connection_ended: Condvar::new(),
                next_connection: AtomicU64::new(1),
                server_bytes: Arc::new(Budget::new(usize::MAX, config.server_bytes_in_flight_max)),
                config,
            }),
            accept_threads: Vec::new(),
            stopped: false,
        }
    }

    /// Listens on a new Unix socket at `path` (mode 0600). Fails if `path` exists.
    pub fn listen_unix(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref().to_path_buf();
        let listener = UnixListener::bind(&path)
            .map_err(|e| Error::io(format!("bind unix socket {}", path.display()), e))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| Error::io(format!("chmod 0600 {}", path.display()), e))?;
        sync::lock(&self.shared.listening).push(Listening::Unix(path.clone()));
        let shared = Arc::clone(&self.shared);
        let peer = path.display().to_string();
        let thread = std::thread::Builder::new()
            .name("nbd-accept-unix".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if shared.shutting_down.load(Ordering::SeqCst) {
                        break;
                    }
                    match stream {
                        Ok(stream) => shared.start_connection(Stream::Unix(stream), peer.clone()),
                        Err(_) => std::thread::sleep(ACCEPT_ERROR_PAUSE),
                    }
                }
            })
            .map_err(|e| Error::io("spawn accept thread", e))?;
        self.accept_threads.push(thread);
        Ok(())
    }

    /// Listens on TCP `address` (port 0 picks a free port); returns the bound address.
    pub fn listen_tcp(&mut self, address: impl ToSocketAddrs) -> Result<SocketAddr> {
        let listener = TcpListener::bind(address).map_err(|e| Error::io("bind tcp listener", e))?;
        let bound = listener
            .local_addr()
            .map_err(|e| Error::io("tcp listener address", e))?;
        sync::lock(&self.shared.listening).push(Listening::Tcp(bound));
        let shared = Arc::clone(&self.shared);
        let thread = std::thread::Builder::new()
            .name("nbd-accept-tcp".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if shared.shutting_down.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(stream) = stream else {
                        std::thread::sleep(ACCEPT_ERROR_PAUSE);
                        continue;
                    };
                    // Replies are whole messages; Nagle would only delay them.
                    let _ = stream.set_nodelay(true);
                    let peer = stream
                        .peer_addr()
                        .map(|address| address.to_string())
                        .unwrap_or_default();
                    shared.start_connection(Stream::Tcp(stream), peer);
                }
            })
            .map_err(|e| Error::io("spawn accept thread", e))?;
        self.accept_threads.push(thread);
        Ok(bound)
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
            for stream in sync::lock(&shared.connections).values() {
                let _ = stream.shutdown(Shutdown::Both);
            }
            shared.wait_for_connections(shared.config.shutdown_grace);
        }
        for listening in sync::lock(&shared.listening).iter() {
            if let Listening::Unix(path) = listening {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Removes a connection from the table when its thread ends, however it ends.
struct ConnectionGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        let mut connections = sync::lock(&self.shared.connections);
        connections.remove(&self.id);
        self.shared.connection_ended.notify_all();
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
        // Wake each accept loop with a throwaway connection; it sees the flag and stops.
        for listening in sync::lock(&self.listening).iter() {
            match listening {
                Listening::Unix(path) => drop(UnixStream::connect(path)),
                Listening::Tcp(address) => {
                    let mut target = *address;
                    if target.ip().is_unspecified() {
                        target.set_ip(match target {
                            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
                        });
                    }
                    drop(TcpStream::connect_timeout(&target, Duration::from_secs(1)));
                }
            }
        }
        for stream in sync::lock(&self.connections).values() {
            let _ = stream.shutdown(Shutdown::Read);
        }
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

    fn start_connection(self: &Arc<Self>, stream: Stream, peer: String) {
        let id = self.next_connection.fetch_add(1, Ordering::SeqCst);
        {
            let mut connections = sync::lock(&self.connections);
            if connections.len() >= self.config.connections_max {
                return;
            }
            let Ok(control) = stream.try_clone() else {
                return;
            };
            connections.insert(id, control);
        }
        let guard = ConnectionGuard {
            shared: Arc::clone(self),
            id,
        };
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-conn-{id}"))
            .spawn(move || {
                let shared = Arc::clone(&guard.shared);
                shared.emit(Event::Connected {
                    connection: id,
                    peer,
                });
                let result = shared.run_connection(id, stream);
                shared.emit(Event::Disconnected {
                    connection: id,
                    error: result.err().map(|error| error.report().to_string()),
                });
                drop(guard);
            });
        // If the thread could not start, the closure (and its guard) was dropped already.
        drop(spawned);
    }

    fn run_connection(&self, id: u64, mut stream: Stream) -> Result<()> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Ok(());
        }
        stream
            .set_read_timeout(Some(self.config.handshake_timeout))
            .map_err(|e| Error::io("set handshake timeout", e))?;
        stream
            .set_write_timeout(Some(self.config.write_timeout))
            .map_err(|e| Error::io("set write timeout", e))?;
        let negotiated =
            match handshake::negotiate(&mut stream, self.registry.as_ref(), &self.shutting_down)? {
                Outcome::Closed => return Ok(()),
                Outcome::Transmission(negotiated) => negotiated,
            };
        self.emit(Event::Serving {
            connection: id,
            export: negotiated.requested_name.clone(),
        });
        // Clients may stay idle for as long as they like once transmission starts.
        stream
            .set_read_timeout(None)
            .map_err(|e| Error::io("clear read timeout", e))?;
        let writer = stream
            .try_clone()
            .map_err(|e| Error::io("clone connection", e))?;
        let limits = Limits {
            threads: self.config.workers_per_connection,
            requests_in_flight_max: self.config.requests_in_flight_max,
            bytes_in_flight_max: self.config.bytes_in_flight_max,
            server_bytes: Arc::clone(&self.server_bytes),
        };
        session::serve(negotiated, stream, writer, limits)
    }
}
