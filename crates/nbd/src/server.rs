//! Listeners, accept loops, a thread per connection, and graceful shutdown.
//!
//! Owns the listening sockets and the table of live connections. Each accepted connection
//! runs on its own thread (stack `thread_stack_bytes`): the handshake, which must finish
//! within `handshake_timeout` of the accept in total, then the session, which adds threads
//! only while requests queue up and closes after `idle_timeout` without a request. So an
//! idle or handshaking connection costs one thread with a small stack, and the connection
//! cap can be in the thousands.
//!
//! Invariants: at most `connections_max` connections are served at once, and at most
//! `connections_per_peer_max` from one peer (a uid on a Unix socket, an IPv4 address or an
//! IPv6 /64 on TCP); extra ones are closed at accept. Every live connection has an entry in
//! the table (removed by a drop guard when its last thread ends, even by a panic), so
//! shutdown can reach it. Payload buffers are bounded per connection
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

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
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
use crate::stream::{Deadline, Stream};
use crate::sync;
use crate::tls::{PumpSettings, ServerTransport, Tls, TlsFailure};

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
    /// Most threads per connection. The thread reading requests serves quick ones itself
    /// (see `batch_replies`) and hands slow ones (FLUSH, FUA, TRIM, large payloads) to the
    /// others. A connection starts with one and adds more as requests are handed off.
    pub workers_per_connection: usize,
    /// Requests in flight per connection (header read, reply not yet written), counting the
    /// requests whose replies wait in a thread's batch.
    pub requests_in_flight_max: usize,
    /// READ/WRITE payload bytes in flight per connection (a single larger request still
    /// runs); a connection that does not read its replies stops being read at this limit.
    pub bytes_in_flight_max: u64,
    /// Payload bytes in flight over all connections together, for payloads over 256 KiB
    /// (smaller ones use the buffers each thread keeps). Once half is used, a connection
    /// gets more only while it holds less than 1/64 of it, so a few connections cannot take
    /// it all.
    pub server_bytes_in_flight_max: u64,
    /// Connections served at once; more are closed at accept.
    pub connections_max: usize,
    /// Connections served at once from one peer (a uid on a Unix socket, an IPv4 address or
    /// an IPv6 /64 on TCP); more from that peer are closed at accept.
    pub connections_per_peer_max: usize,
    /// Longest time from accept to the end of the handshake, however the client paces it.
    pub handshake_timeout: Duration,
    /// After the handshake, a connection with no request in flight that receives nothing for
    /// this long is closed (checked every quarter of it, or every 30 s if that is less, so
    /// it may last up to that much longer).
    pub idle_timeout: Duration,
    /// Stack size of connection threads (their buffers are on the heap).
    pub thread_stack_bytes: usize,
    /// Longest wait for each reply write before the connection is dropped.
    pub write_timeout: Duration,
    /// How long shutdown waits for connections to finish before cutting them off.
    pub shutdown_grace: Duration,
    /// Optional observer of connection events.
    pub on_event: Option<EventHandler>,
    /// TLS offered or required through NBD_OPT_STARTTLS; `None` answers it `ERR_UNSUP`.
    pub tls: Option<Tls>,
    /// Which plaintext connections send large READ replies of exports that offer
    /// `Export::read_source` by `splice` instead of a copy (never with TLS configured).
    pub splice_reads: SpliceReads,
    /// Widest window a connection's thread spins (non-blocking receives) for the next
    /// request before it sleeps in `recv`, when nothing is in flight on the connection; it
    /// adapts to how soon the last requests came, is 0 while they come later, and at most
    /// half the CPUs spin at once. Saves one wake-up per request at queue depth 1 when the
    /// client answers quickly; `Duration::ZERO` never spins.
    pub spin_max: Duration,
    /// The thread reading a connection's requests serves the small quick ones it finds
    /// queued (READs and non-FUA WRITEs up to 32 KiB, BLOCK_STATUS) itself and sends their
    /// replies together, with no thread wake-up per request; `false` hands every request off
    /// to another thread unless it is alone on the connection. Measured with fio (4 KiB random
    /// reads of the raw export, Unix socket, 2 vCPUs, load average 1.6–2.9), against the
    /// hand-off model it replaced: QD64 over one connection 1.26× the IOPS at 0.53 of the
    /// server CPU per read, QD32 over two connections 1.40× at 0.54.
    pub batch_replies: bool,
}

/// Where zero-copy READ replies are used. Measured with fio's nbd engine (1 MiB reads, QD8,
/// raw export, `scripts/bench-compare`): over a Unix socket, splicing halved the server's CPU
/// per read but tripled the client's (it receives the spliced pages as many small buffers)
/// and cut throughput from 2.6 to 1.4 GB/s, so by default only TCP connections splice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SpliceReads {
    /// Always copy.
    Never,
    /// Splice on TCP connections only.
    #[default]
    TcpOnly,
    /// Splice on every connection (Unix sockets too).
    Always,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            workers_per_connection: 4,
            requests_in_flight_max: 64,
            bytes_in_flight_max: 32 * 1024 * 1024,
            server_bytes_in_flight_max: 512 * 1024 * 1024,
            connections_max: 4096,
            connections_per_peer_max: 256,
            handshake_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(600),
            thread_stack_bytes: 512 * 1024,
            write_timeout: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(10),
            on_event: None,
            tls: None,
            splice_reads: SpliceReads::default(),
            spin_max: Duration::from_micros(50),
            batch_replies: true,
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
            .field("connections_per_peer_max", &self.connections_per_peer_max)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("thread_stack_bytes", &self.thread_stack_bytes)
            .field("write_timeout", &self.write_timeout)
            .field("shutdown_grace", &self.shutdown_grace)
            .field("on_event", &self.on_event.is_some())
            .field("tls", &self.tls)
            .field("spin_max", &self.spin_max)
            .field("splice_reads", &self.splice_reads)
            .field("batch_replies", &self.batch_replies)
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
    /// A Unix socket: its path if it has one (a passed socket may not), and whether the
    /// server made it (and so removes it at shutdown) or was given it.
    Unix {
        path: Option<PathBuf>,
        owned: bool,
    },
    Tcp(SocketAddr),
}

impl fmt::Display for Listening {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Listening::Unix {
                path: Some(path), ..
            } => write!(formatter, "{}", path.display()),
            Listening::Unix { path: None, .. } => formatter.write_str("unnamed unix socket"),
            Listening::Tcp(address) => write!(formatter, "tcp {address}"),
        }
    }
}

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
}

/// Where a connection comes from, for the per-peer limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Peer {
    /// The uid of a Unix socket peer.
    User(u32),
    /// A TCP peer's IPv4 address, or its IPv6 address cut to the /64 (one host usually
    /// has a whole /64).
    Address(IpAddr),
    /// A peer whose identity could not be read; all such count as one.
    Unknown,
}

impl Peer {
    fn of_tcp(address: IpAddr) -> Self {
        match address {
            IpAddr::V4(_) => Peer::Address(address),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Peer::Address(IpAddr::V4(v4)),
                None => {
                    let prefix = u128::from(v6) & !((1u128 << 64) - 1);
                    Peer::Address(IpAddr::V6(prefix.into()))
                }
            },
        }
    }
}

/// Live connections and how many each peer has.
#[derive(Default)]
struct Table {
    streams: HashMap<u64, Stream>,
    per_peer: HashMap<Peer, usize>,
    /// The export each connection in transmission serves (as quoted for logs).
    exports: HashMap<u64, String>,
}

impl Table {
    /// "#3 \"disk\", #4 (handshake)": the live connections, for the shutdown log line.
    fn describe(&self) -> String {
        let mut ids: Vec<u64> = self.streams.keys().copied().collect();
        ids.sort_unstable();
        let described: Vec<String> = ids
            .iter()
            .map(|id| match self.exports.get(id) {
                Some(export) => format!("#{id} {export}"),
                None => format!("#{id} (handshake)"),
            })
            .collect();
        described.join(", ")
    }
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
        assert!(!config.idle_timeout.is_zero(), "idle_timeout is 0");
        Server {
            shared: Arc::new(Shared {
                registry,
                shutting_down: AtomicBool::new(false),
                listening: Mutex::new(Vec::new()),
                connections: Mutex::new(Table::default()),
                connection_ended: Condvar::new(),
                next_connection: AtomicU64::new(1),
                closing: Mutex::new(None),
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
        self.accept_unix(listener, Some(path), true)
    }

    /// Serves on a Unix socket listening already (one passed by systemd's socket
    /// activation, say). Its file, if any, is left in place at shutdown: whoever made it owns
    /// it. Returns the socket's path, if it has one.
    pub fn serve_unix_listener(&mut self, listener: UnixListener) -> Result<Option<PathBuf>> {
        let path = listener
            .local_addr()
            .map_err(|e| Error::io("unix listener address", e))?
            .as_pathname()
            .map(Path::to_path_buf);
        self.accept_unix(listener, path.clone(), false)?;
        Ok(path)
    }

    fn accept_unix(
        &mut self,
        listener: UnixListener,
        path: Option<PathBuf>,
        owned: bool,
    ) -> Result<()> {
        let listening = Listening::Unix { path, owned };
        let socket = listening.to_string();
        tracing::info!(socket = %listening, "NBD listening");
        sync::lock(&self.shared.listening).push(listening);
        let shared = Arc::clone(&self.shared);
        let thread = std::thread::Builder::new()
            .name("nbd-accept-unix".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if shared.shutting_down.load(Ordering::SeqCst) {
                        break;
                    }
                    match stream {
                        Ok(stream) => {
                            let peer = rustix::net::sockopt::socket_peercred(&stream)
                                .map_or(Peer::Unknown, |credentials| {
                                    Peer::User(credentials.uid.as_raw())
                                });
                            let name = match peer {
                                Peer::User(uid) => format!("{socket} (uid {uid})"),
                                _ => socket.clone(),
                            };
                            shared.start_connection(Stream::Unix(stream), peer, name)
                        }
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
        self.serve_tcp_listener(listener)
    }

    /// Serves on a TCP socket listening already (one passed by systemd's socket activation,
    /// say); returns its address.
    pub fn serve_tcp_listener(&mut self, listener: TcpListener) -> Result<SocketAddr> {
        let bound = listener
            .local_addr()
            .map_err(|e| Error::io("tcp listener address", e))?;
        tracing::info!(socket = %Listening::Tcp(bound), "NBD listening");
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
                    let (peer, name) = match stream.peer_addr() {
                        Ok(address) => (Peer::of_tcp(address.ip()), address.to_string()),
                        Err(_) => (Peer::Unknown, String::new()),
                    };
                    shared.start_connection(Stream::Tcp(stream), peer, name);
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
        sync::lock(&self.shared.connections).streams.len()
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
            for stream in table.streams.values() {
                let _ = stream.shutdown(Shutdown::Both);
            }
            drop(table);
            shared.wait_for_connections(shared.config.shutdown_grace);
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

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Removes a connection from the table when its last thread ends, however it ends.
struct ConnectionGuard {
    shared: Arc<Shared>,
    id: u64,
    peer: Peer,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        let mut table = sync::lock(&self.shared.connections);
        table.streams.remove(&self.id);
        table.exports.remove(&self.id);
        if let Some(count) = table.per_peer.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                table.per_peer.remove(&self.peer);
            }
        }
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
        // Accepting stops now: these are the connections this shutdown closes.
        let closing = {
            let table = sync::lock(&self.connections);
            (table.streams.len(), table.describe())
        };
        *sync::lock(&self.closing) = Some(closing);
        // Wake each accept loop with a throwaway connection; it sees the flag and stops.
        for listening in sync::lock(&self.listening).iter() {
            match listening {
                Listening::Unix {
                    path: Some(path), ..
                } => drop(UnixStream::connect(path)),
                // Nothing to connect to: the loop ends at its next accept.
                Listening::Unix { path: None, .. } => {}
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
        for stream in sync::lock(&self.connections).streams.values() {
            let _ = stream.shutdown(Shutdown::Read);
        }
    }

    /// Waits until no connection is left or `timeout` passes; true if none is left.
    fn wait_for_connections(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut connections = sync::lock(&self.connections);
        while !connections.streams.is_empty() {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            connections = sync::wait_timeout(&self.connection_ended, connections, deadline - now).0;
        }
        true
    }

    fn start_connection(self: &Arc<Self>, stream: Stream, peer: Peer, name: String) {
        let id = self.next_connection.fetch_add(1, Ordering::SeqCst);
        {
            let mut table = sync::lock(&self.connections);
            if table.streams.len() >= self.config.connections_max {
                return;
            }
            let from_peer = table.per_peer.get(&peer).copied().unwrap_or(0);
            if from_peer >= self.config.connections_per_peer_max {
                return;
            }
            let Ok(control) = stream.try_clone() else {
                return;
            };
            table.streams.insert(id, control);
            *table.per_peer.entry(peer).or_insert(0) += 1;
        }
        let guard = ConnectionGuard {
            shared: Arc::clone(self),
            id,
            peer,
        };
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-conn-{id}"))
            .stack_size(self.config.thread_stack_bytes)
            .spawn(move || {
                // Every line logged for this connection, on any of its threads, names it.
                let span = tracing::info_span!("conn", conn = id, peer = %name);
                let _entered = span.enter();
                tracing::info!("connection opened");
                let shared = Arc::clone(&guard.shared);
                shared.emit(Event::Connected {
                    connection: id,
                    peer: name,
                });
                shared.run_connection(id, stream, guard);
            });
        // If the thread could not start, the closure (and its guard) was dropped already.
        drop(spawned);
    }

    /// Runs the handshake, then the session; the guard (and the Disconnected event) goes
    /// with the connection's last thread.
    fn run_connection(self: &Arc<Self>, id: u64, stream: Stream, guard: ConnectionGuard) {
        let splice_reads = self.config.tls.is_none()
            && match self.config.splice_reads {
                SpliceReads::Never => false,
                SpliceReads::TcpOnly => matches!(stream, Stream::Tcp(_)),
                SpliceReads::Always => true,
            };
        // A TLS pump holds the guard too, until its last record is out.
        let guard = Arc::new(guard);
        let keep_alive = Arc::clone(&guard);
        let end = {
            let shared = Arc::clone(self);
            move |result: Result<()>, requests: u64| {
                let export = sync::lock(&shared.connections).exports.get(&id).cloned();
                log_end(export.as_deref(), requests, &result);
                shared.emit(Event::Disconnected {
                    connection: id,
                    error: result.err().map(|error| error.to_string()),
                });
                drop(guard);
            }
        };
        match self.negotiate(id, stream, keep_alive) {
            Ok(Some((negotiated, reader, tls_failure))) => {
                let export = handshake::quoted(&negotiated.requested_name);
                tracing::info!(export = %export, read_only = negotiated.export.read_only(), "serving export");
                sync::lock(&self.connections).exports.insert(id, export);
                self.emit(Event::Serving {
                    connection: id,
                    export: negotiated.requested_name.clone(),
                });
                // A TLS failure (a bad record, say) is why the session's socket ended.
                let end = move |result: Result<()>, requests: u64| {
                    let failure = sync::lock(&tls_failure).take();
                    end(failure.map_or(result, Err), requests)
                };
                let writer = match reader.try_clone() {
                    Ok(writer) => writer,
                    Err(error) => return end(Err(Error::io("clone connection", error)), 0),
                };
                let limits = Limits {
                    threads: self.config.workers_per_connection,
                    requests_in_flight_max: self.config.requests_in_flight_max,
                    bytes_in_flight_max: self.config.bytes_in_flight_max,
                    server_bytes: Arc::clone(&self.server_bytes),
                    idle_timeout: self.config.idle_timeout,
                    stack_bytes: self.config.thread_stack_bytes,
                    thread_name: format!("nbd-conn-{id}"),
                    // A TLS session's socket leads to the pump, which copies anyway.
                    splice_reads,
                    spin_max: self.config.spin_max,
                    batch_replies: self.config.batch_replies,
                };
                session::serve(negotiated, reader, writer, limits, Box::new(end));
            }
            Ok(None) => end(Ok(()), 0),
            Err(error) => end(Err(error), 0),
        }
    }

    /// The handshake, within `handshake_timeout` of now; `None` if the client left.
    /// After STARTTLS, `stream` becomes the session's end of the TLS pump's socketpair, and
    /// a failure of the pump during the handshake is what the handshake returns.
    fn negotiate(
        &self,
        id: u64,
        mut stream: Stream,
        keep_alive: Arc<ConnectionGuard>,
    ) -> Result<Option<(handshake::Negotiated, Stream, TlsFailure)>> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Ok(None);
        }
        let deadline = Instant::now() + self.config.handshake_timeout;
        let mut transport = ServerTransport::new(
            Deadline::new(&mut stream, deadline, self.config.write_timeout),
            PumpSettings {
                stack_bytes: self.config.thread_stack_bytes,
                thread_name: format!("nbd-conn-{id}"),
                stall_timeout: self.config.write_timeout,
                keep_alive,
            },
        );
        let negotiated = handshake::negotiate(
            &mut transport,
            self.registry.as_ref(),
            &self.shutting_down,
            self.config.tls.as_ref(),
        );
        let failure_slot = transport.failure_slot();
        let tls_failure = sync::lock(&failure_slot).take();
        drop(transport);
        let outcome = match (negotiated, tls_failure) {
            (Ok(Outcome::Transmission(negotiated)), _) => Outcome::Transmission(negotiated),
            (_, Some(failure)) => return Err(failure),
            (Ok(outcome), None) => outcome,
            (Err(_), None) if Instant::now() >= deadline => {
                return Err(Error::io(
                    format!(
                        "handshake not finished within {} s",
                        self.config.handshake_timeout.as_secs_f64()
                    ),
                    std::io::ErrorKind::TimedOut.into(),
                ))
            }
            (Err(error), None) => return Err(error),
        };
        match outcome {
            Outcome::Closed => Ok(None),
            Outcome::Transmission(negotiated) => {
                stream
                    .set_write_timeout(Some(self.config.write_timeout))
                    .map_err(|e| Error::io("set write timeout", e))?;
                Ok(Some((negotiated, stream, failure_slot)))
            }
        }
    }
}

/// The connection's closing line: info, or warn when the client broke the protocol.
fn log_end(export: Option<&str>, requests: u64, result: &Result<()>) {
    let export = export.unwrap_or("(none)");
    match result {
        Ok(()) => tracing::info!(export = %export, requests, "connection closed"),
        Err(error @ (Error::Protocol { .. } | Error::BadMagic { .. } | Error::TooLong { .. })) => {
            tracing::warn!(export = %export, requests, %error, "connection closed: protocol violation")
        }
        Err(error) => tracing::info!(export = %export, requests, %error, "connection closed"),
    }
}
