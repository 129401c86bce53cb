//! Goal: a connection upgraded with NBD_OPT_STARTTLS behaves as a plaintext one: pipelined
//! requests with megabyte payloads go both ways through the TLS pump, and the server's limits
//! hold over TLS: a client that stalls the TLS handshake is closed at the handshake deadline,
//! an idle TLS connection is closed at the idle timeout (with close_notify), and shutdown
//! ends TLS connections; none of them outlives its slot in the connection table. Under
//! verify-peer, a client certificate another CA signed is refused (rustls presents it
//! whatever CA names the server hints, unlike gnutls, so this is where that case is tested).
//!
//! Method: a server in this process with a memory export and certificates made by `openssl`
//! (a CA, a server certificate for 127.0.0.1, client certificates from the CA and from
//! another CA); a client written here from the protocol
//! notes (simple replies, NBD_OPT_GO) that speaks through a rustls client session after
//! STARTTLS, in one thread (write every request, then read every reply).
//!
//! NBD is big-endian on the wire, hence the explicit conversions here.
#![allow(clippy::big_endian_bytes)]

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nbd::{Config, Event, ExportMap, MemoryExport, Server, Tls, TlsMode};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};
use testkit::certificates::{make_ca, make_leaf};
use testkit::ScratchDir;

const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const OPT_STARTTLS: u32 = 5;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const MIB: usize = 1 << 20;
/// Longest wait for anything a test expects; far above what the server needs.
const PATIENCE: Duration = Duration::from_secs(20);

/// In `dir`, nbdkit's layout: the CA (`ca-*.pem`) and a server certificate for 127.0.0.1;
/// besides, a client certificate the CA signed (`client-*.pem`) and one another CA signed
/// (`intruder-*.pem`).
fn make_certificates(dir: &Path) {
    let other_ca = dir.join("other-ca");
    make_ca(dir, "nbd test CA");
    make_ca(&other_ca, "another CA");
    make_leaf(
        dir,
        dir,
        "server",
        "127.0.0.1",
        "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1",
    );
    make_leaf(dir, dir, "client", "client", "extendedKeyUsage=clientAuth");
    make_leaf(
        &other_ca,
        dir,
        "intruder",
        "intruder",
        "extendedKeyUsage=clientAuth",
    );
}

struct Fixture {
    dir: ScratchDir,
    server: Server,
    address: SocketAddr,
    client_config: Arc<ClientConfig>,
    events: Arc<Mutex<Vec<Event>>>,
}

fn start(tag: &str, config: Config) -> Fixture {
    start_with(tag, config, false)
}

fn start_with(tag: &str, config: Config, verify_peer: bool) -> Fixture {
    let dir = ScratchDir::new(tag);
    make_certificates(dir.path());
    let tls = Tls::from_directory(dir.path(), TlsMode::Require, verify_peer).unwrap();
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&events);
    let config = Config {
        tls: Some(tls),
        on_event: Some(Arc::new(move |event: &Event| {
            sink.lock().unwrap().push(event.clone())
        })),
        ..config
    };
    let exports = Arc::new(ExportMap::new());
    exports.insert(Arc::new(MemoryExport::new("disk", 64 << 20)));
    let mut server = Server::new(exports, config);
    let address = server.listen_tcp("127.0.0.1:0").unwrap();
    let client_config = client_builder(roots(dir.path())).with_no_client_auth();
    Fixture {
        dir,
        server,
        address,
        client_config: Arc::new(client_config),
        events,
    }
}

fn client_builder(
    roots: RootCertStore,
) -> rustls::ConfigBuilder<ClientConfig, rustls::client::WantsClientCert> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
}

fn roots(dir: &Path) -> RootCertStore {
    let mut roots = RootCertStore::empty();
    for certificate in CertificateDer::pem_file_iter(dir.join("ca-cert.pem")).unwrap() {
        roots.add(certificate.unwrap()).unwrap();
    }
    roots
}

/// A client configuration that presents `{prefix}-cert.pem` from `dir`.
fn client_with_certificate(dir: &Path, prefix: &str) -> Arc<ClientConfig> {
    let chain = CertificateDer::pem_file_iter(dir.join(format!("{prefix}-cert.pem")))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(dir.join(format!("{prefix}-key.pem"))).unwrap();
    Arc::new(
        client_builder(roots(dir))
            .with_client_auth_cert(chain, key)
            .unwrap(),
    )
}

fn option(stream: &mut impl Write, code: u32, data: &[u8]) {
    let mut bytes = IHAVEOPT.to_be_bytes().to_vec();
    bytes.extend_from_slice(&code.to_be_bytes());
    bytes.extend_from_slice(&(data.len() as u32).to_be_bytes());
    bytes.extend_from_slice(data);
    stream.write_all(&bytes).unwrap();
}

/// Reads one option reply; returns its type.
fn option_reply(stream: &mut impl Read, code: u32) -> u32 {
    try_option_reply(stream, code).unwrap()
}

fn try_option_reply(stream: &mut impl Read, code: u32) -> std::io::Result<u32> {
    let mut header = [0u8; 20];
    stream.read_exact(&mut header)?;
    assert_eq!(
        u64::from_be_bytes(header[0..8].try_into().unwrap()),
        OPTION_REPLY_MAGIC
    );
    assert_eq!(u32::from_be_bytes(header[8..12].try_into().unwrap()), code);
    let length = u32::from_be_bytes(header[16..20].try_into().unwrap());
    let mut data = vec![0u8; length as usize];
    stream.read_exact(&mut data)?;
    Ok(u32::from_be_bytes(header[12..16].try_into().unwrap()))
}

/// Greeting, client flags, STARTTLS and its ACK in plaintext; the rest is up to the caller.
fn connect_and_starttls(address: SocketAddr) -> TcpStream {
    let mut stream = TcpStream::connect(address).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).unwrap();
    stream.write_all(&3u32.to_be_bytes()).unwrap();
    option(&mut stream, OPT_STARTTLS, &[]);
    assert_eq!(option_reply(&mut stream, OPT_STARTTLS), REP_ACK);
    stream
}

type TlsStream = StreamOwned<ClientConnection, TcpStream>;

/// A TLS client that has entered transmission on export `disk` (simple replies).
fn open_tls(fixture: &Fixture) -> TlsStream {
    try_open_tls(fixture.address, &fixture.client_config).unwrap()
}

/// STARTTLS with `config`, then GO; an error if the TLS handshake fails.
fn try_open_tls(address: SocketAddr, config: &Arc<ClientConfig>) -> std::io::Result<TlsStream> {
    let stream = connect_and_starttls(address);
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let connection = ClientConnection::new(Arc::clone(config), name).unwrap();
    let mut tls = StreamOwned::new(connection, stream);
    // Drive the handshake to its end (TLS 1.3 clients learn of a refused certificate only
    // from the server's next record).
    tls.flush()?;
    let mut go = 4u32.to_be_bytes().to_vec();
    go.extend_from_slice(b"disk");
    go.extend_from_slice(&0u16.to_be_bytes());
    option(&mut tls, OPT_GO, &go);
    tls.flush()?;
    loop {
        match try_option_reply(&mut tls, OPT_GO)? {
            REP_INFO => continue,
            REP_ACK => break,
            other => panic!("GO answered {other:#x}"),
        }
    }
    Ok(tls)
}

fn request(stream: &mut impl Write, command: u16, cookie: u64, offset: u64, length: usize) {
    let mut header = REQUEST_MAGIC.to_be_bytes().to_vec();
    header.extend_from_slice(&0u16.to_be_bytes());
    header.extend_from_slice(&command.to_be_bytes());
    header.extend_from_slice(&cookie.to_be_bytes());
    header.extend_from_slice(&offset.to_be_bytes());
    header.extend_from_slice(&(length as u32).to_be_bytes());
    stream.write_all(&header).unwrap();
}

/// Reads a simple reply; returns its cookie (the error must be 0).
fn simple_reply(stream: &mut impl Read) -> u64 {
    let mut reply = [0u8; 16];
    stream.read_exact(&mut reply).unwrap();
    assert_eq!(
        u32::from_be_bytes(reply[0..4].try_into().unwrap()),
        SIMPLE_REPLY_MAGIC
    );
    assert_eq!(
        u32::from_be_bytes(reply[4..8].try_into().unwrap()),
        0,
        "error"
    );
    u64::from_be_bytes(reply[8..16].try_into().unwrap())
}

/// True once `stream` reads its end (or a reset) within [`PATIENCE`], after at most a few
/// bytes (a raw socket may first get a TLS alert).
fn reads_end(stream: &mut impl Read) -> bool {
    let mut buffer = [0u8; 64];
    for _ in 0..16 {
        match stream.read(&mut buffer) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(error) => {
                return !matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
            }
        }
    }
    false
}

fn wait_for_no_connections(server: &Server) {
    let deadline = Instant::now() + PATIENCE;
    while server.connection_count() > 0 {
        assert!(
            Instant::now() < deadline,
            "connections left: {}",
            server.connection_count()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn pipelined_megabyte_requests_go_both_ways_through_tls() {
    let fixture = start("nbd-starttls-bulk", Config::default());
    let mut tls = open_tls(&fixture);
    let blocks: Vec<Vec<u8>> = (0..8u8)
        .map(|index| {
            (0..4 * MIB)
                .map(|at| (at as u8) ^ index.wrapping_mul(37))
                .collect()
        })
        .collect();
    // All writes first, then all replies: the pump carries 32 MiB in while replies queue.
    for (index, block) in blocks.iter().enumerate() {
        request(
            &mut tls,
            CMD_WRITE,
            index as u64,
            (index * 4 * MIB) as u64,
            block.len(),
        );
        tls.write_all(block).unwrap();
    }
    let mut cookies: Vec<u64> = (0..blocks.len()).map(|_| simple_reply(&mut tls)).collect();
    cookies.sort_unstable();
    assert_eq!(cookies, (0..blocks.len() as u64).collect::<Vec<_>>());
    // Then all reads before any reply is read: 32 MiB out through the pump.
    for index in 0..blocks.len() {
        request(
            &mut tls,
            CMD_READ,
            100 + index as u64,
            (index * 4 * MIB) as u64,
            4 * MIB,
        );
    }
    for _ in 0..blocks.len() {
        let cookie = simple_reply(&mut tls);
        let mut data = vec![0u8; 4 * MIB];
        tls.read_exact(&mut data).unwrap();
        assert!(
            data == blocks[(cookie - 100) as usize],
            "read {cookie} differs"
        );
    }
    drop(tls);
    wait_for_no_connections(&fixture.server);
    fixture.server.shutdown();
}

#[test]
fn a_stalled_tls_handshake_is_closed_at_the_handshake_deadline() {
    let config = Config {
        handshake_timeout: Duration::from_secs(1),
        ..Config::default()
    };
    let fixture = start("nbd-starttls-stall", config);
    // STARTTLS is acknowledged, then the client never sends its ClientHello.
    let mut stream = connect_and_starttls(fixture.address);
    assert!(
        reads_end(&mut stream),
        "the server kept a stalled TLS handshake open"
    );
    wait_for_no_connections(&fixture.server);
    let events = fixture.events.lock().unwrap().clone();
    assert!(
        events.iter().any(
            |event| matches!(event, Event::Disconnected { error: Some(error), .. }
            if error.contains("handshake not finished"))
        ),
        "{events:?}"
    );
    fixture.server.shutdown();
}

#[test]
fn idle_tls_connections_are_closed_and_shutdown_ends_the_rest() {
    let config = Config {
        idle_timeout: Duration::from_secs(1),
        ..Config::default()
    };
    let fixture = start("nbd-starttls-idle", config);
    let mut idle = open_tls(&fixture);
    // The session's idle timeout closes the socketpair; the pump sends close_notify.
    assert!(reads_end(&mut idle), "an idle TLS connection stayed open");
    wait_for_no_connections(&fixture.server);

    // A busy one: shutdown answers its request, then ends it.
    let mut busy = open_tls(&fixture);
    request(&mut busy, CMD_READ, 7, 0, 4096);
    assert_eq!(simple_reply(&mut busy), 7);
    let mut data = vec![0u8; 4096];
    busy.read_exact(&mut data).unwrap();
    let started = Instant::now();
    fixture.server.shutdown();
    assert!(started.elapsed() < PATIENCE);
    assert!(reads_end(&mut busy), "shutdown left a TLS connection open");
}

#[test]
fn verify_peer_accepts_only_certificates_the_ca_signed() {
    let fixture = start_with("nbd-starttls-verify", Config::default(), true);
    let dir = fixture.dir.path().to_path_buf();
    // Signed by another CA: presented, and refused in the TLS handshake.
    let intruder = client_with_certificate(&dir, "intruder");
    assert!(try_open_tls(fixture.address, &intruder).is_err());
    // No certificate at all.
    assert!(try_open_tls(fixture.address, &fixture.client_config).is_err());
    // Signed by the CA: served.
    let client = client_with_certificate(&dir, "client");
    let mut tls = try_open_tls(fixture.address, &client).unwrap();
    request(&mut tls, CMD_READ, 1, 0, 512);
    assert_eq!(simple_reply(&mut tls), 1);
    let mut data = [0u8; 512];
    tls.read_exact(&mut data).unwrap();
    drop(tls);
    wait_for_no_connections(&fixture.server);
    let events = fixture.events.lock().unwrap().clone();
    let refusals: Vec<&String> = events
        .iter()
        .filter_map(|event| match event {
            Event::Disconnected {
                error: Some(error), ..
            } if error.starts_with("TLS session") => Some(error),
            _ => None,
        })
        .collect();
    assert_eq!(refusals.len(), 2, "{events:?}");
    assert!(
        refusals[0].contains("certificate"),
        "the refusal does not say why: {}",
        refusals[0]
    );
    fixture.server.shutdown();
}
