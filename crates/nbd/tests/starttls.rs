//! Goal: a connection upgraded with NBD_OPT_STARTTLS behaves as a plaintext one: pipelined
//! requests with megabyte payloads go both ways through the TLS pump, and the server's limits
//! hold over TLS: a client that stalls the TLS handshake is closed at the handshake deadline,
//! an idle TLS connection is closed at the idle timeout (with close_notify), and shutdown
//! ends TLS connections; none of them outlives its slot in the connection table.
//!
//! Method: a server in this process with a memory export and certificates made by `openssl`
//! (a CA and a server certificate for 127.0.0.1); a client written here from the protocol
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
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};
use testkit::{require_tool, run_ok, ScratchDir};

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

/// A CA and a server certificate for 127.0.0.1 in `dir`, nbdkit's layout.
fn make_certificates(dir: &Path) {
    require_tool("openssl", "openssl");
    let path = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let timeout = Duration::from_secs(60);
    run_ok(
        "openssl",
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=nbd test CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign",
            "-keyout",
            &path("ca-key.pem"),
            "-out",
            &path("ca-cert.pem"),
        ],
        timeout,
    );
    run_ok(
        "openssl",
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            &path("server-key.pem"),
            "-out",
            &path("server.csr"),
        ],
        timeout,
    );
    std::fs::write(
        dir.join("server.ext"),
        "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1\n",
    )
    .unwrap();
    run_ok(
        "openssl",
        &[
            "x509",
            "-req",
            "-days",
            "2",
            "-in",
            &path("server.csr"),
            "-CA",
            &path("ca-cert.pem"),
            "-CAkey",
            &path("ca-key.pem"),
            "-CAcreateserial",
            "-extfile",
            &path("server.ext"),
            "-out",
            &path("server-cert.pem"),
        ],
        timeout,
    );
}

struct Fixture {
    _dir: ScratchDir,
    server: Server,
    address: SocketAddr,
    client_config: Arc<ClientConfig>,
    events: Arc<Mutex<Vec<Event>>>,
}

fn start(tag: &str, config: Config) -> Fixture {
    let dir = ScratchDir::new(tag);
    make_certificates(dir.path());
    let tls = Tls::from_directory(dir.path(), TlsMode::Require, false).unwrap();
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
    let mut roots = RootCertStore::empty();
    for certificate in CertificateDer::pem_file_iter(dir.path().join("ca-cert.pem")).unwrap() {
        roots.add(certificate.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let client_config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Fixture {
        _dir: dir,
        server,
        address,
        client_config: Arc::new(client_config),
        events,
    }
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
    let mut header = [0u8; 20];
    stream.read_exact(&mut header).unwrap();
    assert_eq!(
        u64::from_be_bytes(header[0..8].try_into().unwrap()),
        OPTION_REPLY_MAGIC
    );
    assert_eq!(u32::from_be_bytes(header[8..12].try_into().unwrap()), code);
    let length = u32::from_be_bytes(header[16..20].try_into().unwrap());
    let mut data = vec![0u8; length as usize];
    stream.read_exact(&mut data).unwrap();
    u32::from_be_bytes(header[12..16].try_into().unwrap())
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
    let stream = connect_and_starttls(fixture.address);
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let connection = ClientConnection::new(Arc::clone(&fixture.client_config), name).unwrap();
    let mut tls = StreamOwned::new(connection, stream);
    let mut go = 4u32.to_be_bytes().to_vec();
    go.extend_from_slice(b"disk");
    go.extend_from_slice(&0u16.to_be_bytes());
    option(&mut tls, OPT_GO, &go);
    loop {
        match option_reply(&mut tls, OPT_GO) {
            REP_INFO => continue,
            REP_ACK => break,
            other => panic!("GO answered {other:#x}"),
        }
    }
    tls
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
