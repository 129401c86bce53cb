//! TLS for NBD: the server's certificates, and the connection after NBD_OPT_STARTTLS.
//!
//! A server whose [`Config`](crate::Config) holds a [`Tls`] answers STARTTLS with an ACK and
//! runs a TLS server session (rustls, the `ring` provider, TLS 1.2 and 1.3, X.509 only) on the
//! same socket; the option haggling then starts over inside TLS. [`TlsMode::Require`] refuses
//! every other option before TLS (`handshake.rs` owns those rules).
//!
//! Why a pump thread: the session reads requests on one thread and writes replies from
//! others, through two handles on one socket, and `server.rs` shuts that socket from outside.
//! A TLS connection is one state machine that both directions go through, so it cannot be cut
//! into a read half and a write half. After STARTTLS's ACK the raw socket therefore goes to a
//! *pump* thread that owns the rustls connection and moves plaintext between it and one end
//! of a Unix socketpair; the handshake and then the session carry on with the other end as
//! their socket, unchanged (deadlines, read and write timeouts, `try_clone`, idle ticks).
//! Costs: one more thread and one more copy per byte, on TLS connections only; a plaintext
//! connection never meets the pump, so its path does not change at all.
//!
//! The pump polls both sockets (both non-blocking on its side) and never buffers more than
//! 64 KiB of plaintext in each direction on top of the socket buffers, so a client
//! that stops reading still blocks the session's reply writes (their timeout) and the
//! session's request reading, as without TLS. It ends when the session closes its end (after
//! sending close_notify and what was queued), when the client's TLS stream ends (the session
//! then reads EOF after the last request), on a TLS error (the session then reads EOF; the
//! error is kept for the server's event), or when nothing moves for `stall_timeout` while
//! bytes wait to be sent. A server shutdown shuts the raw socket's read side, which the pump
//! passes on to the session as EOF, exactly as on a plaintext connection.
//!
//! Server keys: RSA of 2048, 3072 or 4096 bits (the sizes `ring` signs with), ECDSA P-256 and
//! P-384, and Ed25519; other keys are refused by type and size (`tls/key.rs` reads the DER).

use std::fmt;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustix::event::{PollFd, PollFlags, Timespec};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig, ServerConnection};

use crate::error::{Error, Result};
use crate::stream::{Deadline, Stream};

mod key;

/// The CA certificate(s) that client certificates must chain to (`--tls-verify-peer`).
pub const CA_CERT_FILE: &str = "ca-cert.pem";
/// The server's certificate chain, leaf first.
pub const SERVER_CERT_FILE: &str = "server-cert.pem";
/// The server's private key (PKCS#8, PKCS#1 or SEC1 PEM).
pub const SERVER_KEY_FILE: &str = "server-key.pem";

/// Most plaintext bytes the pump holds in each direction besides the socket buffers.
const CHUNK_BYTES: usize = 64 * 1024;

/// Whether TLS is offered or required (no TLS at all is `Config::tls == None`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsMode {
    /// Clients may start TLS or go on without it.
    On,
    /// Every option other than NBD_OPT_STARTTLS and NBD_OPT_ABORT gets
    /// `NBD_REP_ERR_TLS_REQD` before TLS, and NBD_OPT_EXPORT_NAME closes the connection.
    Require,
}

/// A server's TLS set-up: its mode and the rustls configuration (certificate, key, client
/// verification).
#[derive(Clone)]
pub struct Tls {
    mode: TlsMode,
    config: Arc<ServerConfig>,
}

impl fmt::Debug for Tls {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("Tls")
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl Tls {
    /// TLS with a ready rustls configuration.
    pub fn new(mode: TlsMode, config: Arc<ServerConfig>) -> Tls {
        Tls { mode, config }
    }

    /// Loads nbdkit's (and qemu's) directory layout: [`SERVER_CERT_FILE`] and
    /// [`SERVER_KEY_FILE`], and with `verify_peer` [`CA_CERT_FILE`], against which every
    /// client must then present a certificate. Errors name the file and what is wrong with it.
    pub fn from_directory(directory: &Path, mode: TlsMode, verify_peer: bool) -> Result<Tls> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let certificate_path = directory.join(SERVER_CERT_FILE);
        let chain = read_certificates(&certificate_path)?;
        let key_path = directory.join(SERVER_KEY_FILE);
        let key = PrivateKeyDer::from_pem_file(&key_path)
            .map_err(|error| tls_error(format!("cannot read {}", key_path.display()), error))?;
        let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|error| tls_error("no TLS protocol version available", error))?;
        let builder = if verify_peer {
            let ca_path = directory.join(CA_CERT_FILE);
            let mut roots = RootCertStore::empty();
            for certificate in read_certificates(&ca_path)? {
                roots.add(certificate).map_err(|error| {
                    tls_error(
                        format!("bad CA certificate in {}", ca_path.display()),
                        error,
                    )
                })?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|error| {
                    tls_error(
                        format!("cannot verify clients with {}", ca_path.display()),
                        error,
                    )
                })?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let described = key::describe(&key);
        let config = builder.with_single_cert(chain, key).map_err(|error| {
            let refused = !key::usable(&described);
            tls_error(
                format!(
                    "{} and {} ({described}) do not make a usable certificate{}",
                    certificate_path.display(),
                    key_path.display(),
                    if refused {
                        format!(
                            ": the TLS library cannot sign with this key ({})",
                            key::supported()
                        )
                    } else {
                        String::new()
                    }
                ),
                error,
            )
        })?;
        Ok(Tls::new(mode, Arc::new(config)))
    }

    /// Whether TLS is required or only offered.
    pub fn mode(&self) -> TlsMode {
        self.mode
    }

    pub(crate) fn config(&self) -> &Arc<ServerConfig> {
        &self.config
    }
}

/// Every certificate in the PEM file at `path`; at least one.
fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let certificates = CertificateDer::pem_file_iter(path)
        .and_then(|certificates| certificates.collect::<std::result::Result<Vec<_>, _>>())
        .map_err(|error| tls_error(format!("cannot read {}", path.display()), error))?;
    if certificates.is_empty() {
        return Err(Error::Tls {
            context: format!("no certificate in {}", path.display()),
            source: None,
        });
    }
    Ok(certificates)
}

fn tls_error(
    context: impl Into<String>,
    source: impl std::error::Error + Send + Sync + 'static,
) -> Error {
    Error::Tls {
        context: context.into(),
        source: Some(Box::new(source)),
    }
}

/// What the handshake needs from its connection: bytes, and a way to switch them to TLS.
pub(crate) trait Transport: Read + Write {
    /// From now on every byte read and written goes through a TLS server session with
    /// `config`, whose handshake starts with the next bytes from the client. Called right
    /// after the ACK of NBD_OPT_STARTTLS was written.
    fn start_tls(&mut self, config: &Arc<ServerConfig>) -> Result<()>;
}

/// Why a connection's pump ended, if it failed: set before the pump closes its end of the
/// socketpair, so whoever reads that end's EOF finds it.
pub(crate) type TlsFailure = Arc<Mutex<Option<Error>>>;

/// How the server runs a pump thread.
pub(crate) struct PumpSettings {
    pub(crate) stack_bytes: usize,
    pub(crate) thread_name: String,
    /// Longest time with bytes waiting to be sent and none moving.
    pub(crate) stall_timeout: Duration,
    /// Held by the pump until it ends (the server's entry for the connection, so that the
    /// connection counts, and shutdown waits, until the last TLS record is out).
    pub(crate) keep_alive: Arc<dyn Send + Sync>,
}

/// The handshake's transport on a server connection: the deadline-bounded socket, which
/// STARTTLS replaces with the session's end of a socketpair served by a pump thread.
pub(crate) struct ServerTransport<'a> {
    deadline: Deadline<'a>,
    settings: PumpSettings,
    failure: TlsFailure,
}

impl<'a> ServerTransport<'a> {
    pub(crate) fn new(deadline: Deadline<'a>, settings: PumpSettings) -> Self {
        ServerTransport {
            deadline,
            settings,
            failure: Arc::new(Mutex::new(None)),
        }
    }

    /// Where the pump, if TLS is started, leaves its error.
    pub(crate) fn failure_slot(&self) -> TlsFailure {
        Arc::clone(&self.failure)
    }
}

impl Read for ServerTransport<'_> {
    fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        self.deadline.read(buffer)
    }
}

impl Write for ServerTransport<'_> {
    fn write(&mut self, buffer: &[u8]) -> io::Result<usize> {
        self.deadline.write(buffer)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.deadline.flush()
    }
}

impl Transport for ServerTransport<'_> {
    fn start_tls(&mut self, config: &Arc<ServerConfig>) -> Result<()> {
        let connection = ServerConnection::new(Arc::clone(config))
            .map_err(|error| tls_error("start a TLS session", error))?;
        let (session_end, pump_end) =
            UnixStream::pair().map_err(|error| Error::io("create a socketpair for TLS", error))?;
        pump_end
            .set_nonblocking(true)
            .map_err(|error| Error::io("set the TLS socketpair non-blocking", error))?;
        let raw = std::mem::replace(self.deadline.stream_mut(), Stream::Unix(session_end));
        raw.set_nonblocking(true)
            .map_err(|error| Error::io("set the socket non-blocking for TLS", error))?;
        let mut pump = Pump {
            raw,
            local: pump_end,
            tls: connection,
            stall_timeout: self.settings.stall_timeout,
        };
        let failure = Arc::clone(&self.failure);
        let keep_alive = Arc::clone(&self.settings.keep_alive);
        std::thread::Builder::new()
            .name(format!("{}-tls", self.settings.thread_name))
            .stack_size(self.settings.stack_bytes)
            .spawn(move || {
                if let Err(error) = pump.run() {
                    *crate::sync::lock(&failure) = Some(error);
                }
                let _ = pump.raw.shutdown(Shutdown::Both);
                // The socketpair end closes with `pump`, then the keep-alive goes.
                drop(pump);
                drop(keep_alive);
            })
            .map_err(|error| Error::io("spawn the TLS thread", error))?;
        Ok(())
    }
}

/// One TLS connection's pump: the raw socket and the rustls session on one side, the
/// plaintext socketpair end on the other (both non-blocking).
struct Pump {
    raw: Stream,
    local: UnixStream,
    tls: ServerConnection,
    stall_timeout: Duration,
}

/// A failure of the pump, its cause in the message (connection events show only the
/// message): "TLS session: peer sent no certificates".
fn failed(stage: &str, cause: impl fmt::Display) -> Error {
    Error::Tls {
        context: format!("TLS {stage}: {cause}"),
        source: None,
    }
}

fn would_block(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

/// Where a pump's two directions stand, between turns of its loop.
struct Progress {
    /// Client plaintext waiting for the session: `to_local[sent..filled]`.
    to_local: Vec<u8>,
    filled: usize,
    sent: usize,
    from_local: Vec<u8>,
    /// read_tls saw the end of the raw stream (or close_notify).
    raw_closed: bool,
    /// The client's plaintext has ended; the session is told once all of it is delivered.
    client_done: bool,
    local_shut: bool,
    /// The session closed its end: send close_notify, flush, finish.
    session_done: bool,
    raw_hung_up: bool,
    local_hung_up: bool,
}

/// What a step of the pump's loop says to do next.
enum Flow {
    /// Go on with the next step of this turn.
    Next,
    /// Start the next turn of the loop at once.
    Again,
    /// The pump is done.
    Done,
}

impl Pump {
    /// Moves bytes until either side is done; see the module docs.
    fn run(&mut self) -> Result<()> {
        self.tls.set_buffer_limit(None);
        let mut progress = Progress {
            to_local: vec![0u8; CHUNK_BYTES],
            filled: 0,
            sent: 0,
            from_local: vec![0u8; CHUNK_BYTES],
            raw_closed: false,
            client_done: false,
            local_shut: false,
            session_done: false,
            raw_hung_up: false,
            local_hung_up: false,
        };
        let timeout = Timespec::try_from(self.stall_timeout)
            .map_err(|_| Error::Internal("TLS stall timeout out of range".into()))?;
        loop {
            self.send_records()?;
            if let Flow::Done = self.deliver_to_session(&mut progress)? {
                return Ok(());
            }
            match self.forward_replies(&mut progress)? {
                Flow::Next => {}
                Flow::Again => continue,
                Flow::Done => return Ok(()),
            }
            match self.wait(&mut progress, &timeout)? {
                Flow::Next => {}
                Flow::Again => continue,
                Flow::Done => return Ok(()),
            }
        }
    }

    /// Sends the TLS records rustls has ready, until the socket would block.
    fn send_records(&mut self) -> Result<()> {
        while self.tls.wants_write() {
            match self.tls.write_tls(&mut self.raw) {
                Ok(_) => {}
                Err(error) if would_block(&error) => break,
                Err(error) => return Err(failed("send", error)),
            }
        }
        Ok(())
    }

    /// Client plaintext to the session, until either side would block; shuts the session's
    /// read side once the client's plaintext has ended and all of it is delivered.
    fn deliver_to_session(&mut self, progress: &mut Progress) -> Result<Flow> {
        while !progress.client_done || progress.sent < progress.filled {
            if progress.sent == progress.filled {
                progress.sent = 0;
                progress.filled = 0;
                match self.tls.reader().read(&mut progress.to_local) {
                    Ok(0) => progress.client_done = true,
                    Ok(count) => progress.filled = count,
                    Err(error) => match error.kind() {
                        io::ErrorKind::WouldBlock => break,
                        // Closed without close_notify: most clients just hang up.
                        io::ErrorKind::UnexpectedEof => progress.client_done = true,
                        _ => return Err(failed("read", error)),
                    },
                }
                continue;
            }
            match self
                .local
                .write(&progress.to_local[progress.sent..progress.filled])
            {
                Ok(0) => {
                    return Err(failed(
                        "pass plaintext on",
                        io::Error::from(io::ErrorKind::WriteZero),
                    ))
                }
                Ok(count) => progress.sent += count,
                Err(error) if would_block(&error) => break,
                // The session has closed its end: nothing is left to serve.
                Err(_) => return Ok(Flow::Done),
            }
        }
        if progress.client_done && progress.sent == progress.filled && !progress.local_shut {
            let _ = self.local.shutdown(Shutdown::Write);
            progress.local_shut = true;
        }
        Ok(Flow::Next)
    }

    /// Session plaintext to the client, once earlier records are out. Before the TLS
    /// handshake ends rustls keeps what is written and sends it after; the NBD handshake
    /// writes nothing then anyway (the client speaks first).
    fn forward_replies(&mut self, progress: &mut Progress) -> Result<Flow> {
        if !progress.session_done && !self.tls.wants_write() {
            match self.local.read(&mut progress.from_local) {
                Ok(0) => {
                    progress.session_done = true;
                    self.tls.send_close_notify();
                    return Ok(Flow::Again);
                }
                Ok(count) => {
                    self.tls
                        .writer()
                        .write_all(&progress.from_local[..count])
                        .map_err(|error| failed("encrypt", error))?;
                    return Ok(Flow::Again);
                }
                Err(error) if would_block(&error) => {}
                Err(error) => return Err(failed("read the replies", error)),
            }
        }
        if progress.session_done && !self.tls.wants_write() {
            return Ok(Flow::Done);
        }
        Ok(Flow::Next)
    }

    /// Polls both sockets for what the pump waits for, then takes in the client's records;
    /// fails if nothing moved for the stall timeout while something waits to go out.
    fn wait(&mut self, progress: &mut Progress, timeout: &Timespec) -> Result<Flow> {
        let mut raw_events = PollFlags::empty();
        if !progress.raw_closed && self.tls.wants_read() {
            raw_events |= PollFlags::IN;
        }
        if self.tls.wants_write() {
            raw_events |= PollFlags::OUT;
        }
        let mut local_events = PollFlags::empty();
        if progress.sent < progress.filled {
            local_events |= PollFlags::OUT;
        }
        if !progress.session_done && !self.tls.wants_write() {
            local_events |= PollFlags::IN;
        }
        // A socket that hung up reports it on every poll: watch it again only for what
        // we want of it (which then fails or reads the end), or the loop would spin.
        let watch_raw = !progress.raw_hung_up || !raw_events.is_empty();
        let watch_local = !progress.local_hung_up || !local_events.is_empty();
        let mut fds = [
            PollFd::new(&self.raw, raw_events),
            PollFd::new(&self.local, local_events),
        ];
        let watched = match (watch_raw, watch_local) {
            (true, true) => &mut fds[..],
            (true, false) => &mut fds[..1],
            (false, true) => &mut fds[1..],
            (false, false) => return Ok(Flow::Done),
        };
        let ready = match rustix::event::poll(watched, Some(timeout)) {
            Ok(ready) => ready,
            Err(rustix::io::Errno::INTR) => return Ok(Flow::Again),
            Err(errno) => return Err(failed("poll", errno)),
        };
        let hung_up = PollFlags::HUP | PollFlags::ERR;
        let raw_ready = watch_raw && !fds[0].revents().is_empty();
        progress.raw_hung_up |= watch_raw && fds[0].revents().intersects(hung_up);
        progress.local_hung_up |= watch_local && fds[1].revents().intersects(hung_up);
        if ready == 0 {
            if self.tls.wants_write() || progress.sent < progress.filled {
                return Err(failed(
                    "stalled",
                    format!("nothing moved for {} s", self.stall_timeout.as_secs_f64()),
                ));
            }
            return Ok(Flow::Again);
        }
        if raw_ready && !progress.raw_closed && self.tls.wants_read() {
            self.receive_records(progress)?;
        }
        Ok(Flow::Next)
    }

    /// Reads the client's TLS records and has rustls process them.
    fn receive_records(&mut self, progress: &mut Progress) -> Result<()> {
        match self.tls.read_tls(&mut self.raw) {
            Ok(0) => progress.raw_closed = true,
            Ok(_) => {
                if let Err(error) = self.tls.process_new_packets() {
                    // Best effort: the alert rustls queued tells the client why.
                    let _ = self.tls.write_tls(&mut self.raw);
                    return Err(failed("session", error));
                }
            }
            Err(error) if would_block(&error) => {}
            Err(error) => return Err(failed("receive", error)),
        }
        Ok(())
    }
}
