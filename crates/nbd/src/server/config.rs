//! What an embedding binary sets ([`Config`], [`SpliceReads`]) and what it hears
//! ([`Event`]).
//!
//! The defaults ([`Config::default`]): 4096 connections, 256 per peer, of them at most 32 in
//! the handshake, which must finish within 30 s of the accept; an idle timeout of 10 minutes
//! after GO (no request in flight, nothing received); the event loop, one worker per CPU
//! (else up to 4 threads per connection), 512 KiB stacks; 64 requests and 32 MiB of payload in flight per connection, and a
//! server-wide 512 MiB for payloads over 256 KiB (a connection's fair share of it is 1/64);
//! reply writes time out after 60 s; a shutdown waits 10 s before it closes the sockets. Each
//! refusal and eviction is an [`Event`] and a `warn` line naming the peer and the reason (at
//! most 20 lines a minute, then a count of those left out: `server/log_limit.rs`).
//! `crates/nbd/tests/fair_service.rs` holds the regression and load tests of these limits,
//! `peer_fairness.rs` those of the per-peer evictions.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::tls::Tls;

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
    /// A connection was closed at accept, before its greeting: the server or its peer is
    /// at a limit and the peer has no idle connection to give up.
    Refused {
        /// The peer ("uid 1000", "address 127.0.0.1").
        peer: String,
        /// Which limit, with its value.
        reason: String,
    },
    /// A connection was closed to make room for a newer one of the same peer: its oldest
    /// handshake (past `handshakes_per_peer_max`), or its connection idle the longest (past
    /// `connections_per_peer_max`).
    Evicted {
        /// Connection number.
        connection: u64,
        /// The peer, as in [`Event::Refused`].
        peer: String,
        /// Which limit, and how long the connection had been handshaking or idle.
        reason: String,
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
    /// an IPv6 /64 on TCP). A new connection past it closes the peer's connection idle the
    /// longest (no request in flight); if none is idle, the new one is closed at accept.
    pub connections_per_peer_max: usize,
    /// Connections of one peer in the handshake at once (counted within
    /// `connections_per_peer_max`). A new connection past it closes the peer's oldest
    /// handshake, so a client that opens connections and never finishes their handshakes
    /// holds at most this many, and only until the peer's next connection.
    pub handshakes_per_peer_max: usize,
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
    /// Serve connections on an event loop: `loop_threads` workers wait for any
    /// connection's bytes in one `epoll`, so a connection waiting for its client (in the
    /// handshake or idle after it) costs no thread and many busy ones share a few (see the
    /// `session` module's `reactor`); the default.
    /// `false` gives each connection its own threads, the older core (`thinpool serve
    /// --threads-per-connection`).
    pub event_loop: bool,
    /// Workers of the event loop that are not blocked (more are started while some are
    /// stuck in an export call or a write); 0 is one per available CPU.
    pub loop_threads: usize,
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
            handshakes_per_peer_max: 32,
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
            event_loop: true,
            loop_threads: 0,
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
            .field("handshakes_per_peer_max", &self.handshakes_per_peer_max)
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
            .field("event_loop", &self.event_loop)
            .field("loop_threads", &self.loop_threads)
            .finish()
    }
}
