//! Goal: hostile clients cannot take the service from others (issue 10, item 3): idle and
//! slow connections cannot fill the server, a client that stops reading replies cannot
//! exhaust the server's memory budget, and client-supplied strings cannot flood the log.
//!
//! Method: a server in this process with a memory export; raw clients written here from the
//! protocol notes (simple replies, NBD_OPT_GO). TCP clients bind source addresses 127.0.0.N
//! so that each hostile group is its own peer. One regression test per reproduction, and a
//! load test that runs them all at once while a legitimate client reads and writes; it prints
//! the client's worst latency, the process's threads and RSS. Every socket and server is
//! closed before a test returns.
//!
//! NBD is big-endian on the wire, hence the explicit conversions here.
#![allow(clippy::big_endian_bytes)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nbd::{Config, Event, Export, ExportMap, MemoryExport, Server};

const MIB: u64 = 1024 * 1024;
const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const OPT_EXPORT_NAME: u32 = 1;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_FLUSH: u16 = 3;
/// Longest wait for anything a test expects; far above what the server needs.
const PATIENCE: Duration = Duration::from_secs(20);
/// Longest a legitimate request may take under attack (the goal is well under a second).
const LEGITIMATE_DEADLINE: Duration = Duration::from_secs(5);

/// The tests measure the whole process (threads, RSS) and open many sockets: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A temporary directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "nbd-fair-{tag}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&path).unwrap();
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A server on a Unix socket (and TCP 127.0.0.1 if asked).
struct TestServer {
    server: Option<Server>,
    socket: PathBuf,
    tcp: Option<SocketAddr>,
    _dir: TempDir,
}

impl TestServer {
    fn start(exports: Vec<Arc<dyn Export>>, config: Config, tcp: bool) -> Self {
        let map = Arc::new(ExportMap::new());
        for export in exports {
            map.insert(export);
        }
        let dir = TempDir::new("srv");
        let socket = dir.0.join("nbd.sock");
        let mut server = Server::new(map, config);
        server.listen_unix(&socket).unwrap();
        let tcp = tcp.then(|| server.listen_tcp("127.0.0.1:0").unwrap());
        TestServer {
            server: Some(server),
            socket,
            tcp,
            _dir: dir,
        }
    }

    fn connection_count(&self) -> usize {
        self.server.as_ref().unwrap().connection_count()
    }

    /// Waits until the server counts `count` connections.
    fn wait_for_connections(&self, count: usize) {
        let deadline = Instant::now() + PATIENCE;
        while self.connection_count() != count {
            assert!(
                Instant::now() < deadline,
                "server has {} connections, expected {count}",
                self.connection_count()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn stop(mut self) {
        self.server.take().unwrap().shutdown();
    }
}

fn quick_shutdown(config: Config) -> Config {
    Config {
        shutdown_grace: Duration::from_millis(500),
        ..config
    }
}

fn unix(server: &TestServer) -> UnixStream {
    let stream = UnixStream::connect(&server.socket).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    stream.set_write_timeout(Some(PATIENCE)).unwrap();
    stream
}

/// A TCP connection to `server` from source address `source` (any 127.0.0.0/8 address
/// reaches the loopback listener).
fn tcp_from(source: Ipv4Addr, server: SocketAddr) -> TcpStream {
    use rustix::net::{bind, connect, socket, AddressFamily, SocketType};
    let fd = socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
    bind(&fd, &SocketAddrV4::new(source, 0)).unwrap();
    connect(&fd, &server).unwrap();
    let stream = TcpStream::from(fd);
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    stream.set_write_timeout(Some(PATIENCE)).unwrap();
    stream
}

/// Reads the greeting and answers with the fixed-newstyle flag; false if the server closed.
fn greet(stream: &mut impl ReadWrite) -> bool {
    let mut greeting = [0u8; 18];
    if stream.read_exact(&mut greeting).is_err() {
        return false;
    }
    assert_eq!(
        u64::from_be_bytes(greeting[..8].try_into().unwrap()),
        NBDMAGIC
    );
    assert_eq!(
        u64::from_be_bytes(greeting[8..16].try_into().unwrap()),
        IHAVEOPT
    );
    stream.write_all(&1u32.to_be_bytes()).unwrap();
    true
}

fn send_option(stream: &mut impl ReadWrite, option: u32, data: &[u8]) {
    let mut bytes = IHAVEOPT.to_be_bytes().to_vec();
    bytes.extend_from_slice(&option.to_be_bytes());
    bytes.extend_from_slice(&(data.len() as u32).to_be_bytes());
    bytes.extend_from_slice(data);
    stream.write_all(&bytes).unwrap();
}

/// NBD_OPT_GO for `name`; panics unless the server agrees.
fn go(stream: &mut impl ReadWrite, name: &str) {
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&0u16.to_be_bytes());
    send_option(stream, OPT_GO, &data);
    loop {
        let mut header = [0u8; 20];
        stream.read_exact(&mut header).unwrap();
        assert_eq!(
            u64::from_be_bytes(header[..8].try_into().unwrap()),
            OPTION_REPLY_MAGIC
        );
        let reply_type = u32::from_be_bytes(header[12..16].try_into().unwrap());
        let length = u32::from_be_bytes(header[16..20].try_into().unwrap());
        let mut payload = vec![0u8; length as usize];
        stream.read_exact(&mut payload).unwrap();
        assert!(
            reply_type < 0x8000_0000,
            "GO {name:?} refused: {reply_type:#x}"
        );
        if reply_type == REP_ACK {
            return;
        }
    }
}

fn request(command: u16, cookie: u64, offset: u64, length: u32) -> Vec<u8> {
    let mut bytes = REQUEST_MAGIC.to_be_bytes().to_vec();
    bytes.extend_from_slice(&0u16.to_be_bytes());
    bytes.extend_from_slice(&command.to_be_bytes());
    bytes.extend_from_slice(&cookie.to_be_bytes());
    bytes.extend_from_slice(&offset.to_be_bytes());
    bytes.extend_from_slice(&length.to_be_bytes());
    bytes
}

/// Reads a simple reply; returns (error, cookie).
fn reply(stream: &mut impl ReadWrite) -> (u32, u64) {
    let mut header = [0u8; 16];
    stream.read_exact(&mut header).unwrap();
    assert_eq!(
        u32::from_be_bytes(header[..4].try_into().unwrap()),
        SIMPLE_REPLY_MAGIC
    );
    (
        u32::from_be_bytes(header[4..8].try_into().unwrap()),
        u64::from_be_bytes(header[8..].try_into().unwrap()),
    )
}

fn read_at(stream: &mut impl ReadWrite, offset: u64, length: u32) -> Vec<u8> {
    stream
        .write_all(&request(CMD_READ, 7, offset, length))
        .unwrap();
    assert_eq!(reply(stream), (0, 7), "read failed");
    let mut data = vec![0u8; length as usize];
    stream.read_exact(&mut data).unwrap();
    data
}

fn write_at(stream: &mut impl ReadWrite, offset: u64, data: &[u8]) {
    let mut bytes = request(CMD_WRITE, 8, offset, data.len() as u32);
    bytes.extend_from_slice(data);
    stream.write_all(&bytes).unwrap();
    assert_eq!(reply(stream), (0, 8), "write failed");
}

/// True once the server has closed `stream` (EOF or reset), waiting up to [`PATIENCE`].
fn closed_by_server(stream: &mut impl ReadWrite) -> bool {
    let mut buffer = [0u8; 4096];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(error)
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return false
            }
            Err(_) => return true,
        }
    }
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// A field of /proc/self/status, in its own unit (kB for memory).
fn status(field: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = text
        .lines()
        .find(|line| line.starts_with(&format!("{field}:")))
        .unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Threads of this process that serve connections (the server names them `nbd-conn-N`).
fn connection_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("nbd-conn-"))
        .count()
}

/// Waits until exactly `count` connection threads run; returns the last count seen.
fn wait_for_connection_threads(count: usize, patience: Duration) -> usize {
    let deadline = Instant::now() + patience;
    loop {
        let seen = connection_threads();
        if seen == count || Instant::now() >= deadline {
            return seen;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Raises the soft limit on open files to the hard limit; panics if `needed` is above it.
fn ensure_open_files(needed: u64) {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut limit = getrlimit(Resource::Nofile);
    let soft = limit.current.unwrap_or(u64::MAX);
    if soft >= needed {
        return;
    }
    limit.current = limit.maximum;
    setrlimit(Resource::Nofile, limit).unwrap();
    let soft = getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX);
    assert!(
        soft >= needed,
        "open file limit {soft}, test needs {needed}"
    );
}

/// A memory export whose FLUSH takes `delay`, to hold a request in flight.
struct SlowFlush {
    inner: MemoryExport,
    delay: Duration,
}

impl Export for SlowFlush {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read_at(&self, offset: u64, buffer: &mut [u8]) -> nbd::Result<()> {
        self.inner.read_at(offset, buffer)
    }
    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> nbd::Result<()> {
        self.inner.write_at(offset, data, fua)
    }
    fn flush(&self) -> nbd::Result<()> {
        std::thread::sleep(self.delay);
        self.inner.flush()
    }
}

fn memory(name: &str, size_bytes: u64) -> Arc<dyn Export> {
    Arc::new(MemoryExport::new(name, size_bytes))
}

/// Regression (issue 10): 256 idle connections held 1028 threads. An idle connection, in
/// the handshake or after GO, now costs one thread; a connection whose session grew for a
/// queue of requests shrinks back to one thread once quiet (within a quarter of the idle
/// timeout), before the idle timeout closes it.
#[test]
fn idle_connections_cost_one_thread_each() {
    let _serial = serial();
    let config = Config {
        idle_timeout: Duration::from_secs(8),
        // 100 handshakes of one uid held at once (past the default, its oldest would close).
        handshakes_per_peer_max: 200,
        // The thread-per-connection path; the event loop's idle connections cost no thread
        // at all (`event_loop.rs`).
        event_loop: false,
        ..quick_shutdown(Config::default())
    };
    let server = TestServer::start(vec![memory("disk", MIB)], config, false);
    // Threads of earlier tests' connections may still be on their way out.
    assert_eq!(wait_for_connection_threads(0, PATIENCE), 0);
    let mut streams = Vec::new();
    for index in 0..200 {
        let mut stream = unix(&server);
        if index % 2 == 0 {
            assert!(greet(&mut stream));
            go(&mut stream, "disk");
        }
        streams.push(stream);
    }
    server.wait_for_connections(200);
    let threads = wait_for_connection_threads(200, Duration::from_secs(2));
    eprintln!("200 connections (100 in handshake, 100 after GO): {threads} connection threads");
    assert_eq!(threads, 200, "threads for 200 idle connections");

    // One connection works through a queue of requests, so its session grows.
    let mut busy = unix(&server);
    assert!(greet(&mut busy));
    go(&mut busy, "disk");
    let mut pipeline = Vec::new();
    for cookie in 0..64 {
        pipeline.extend(request(CMD_WRITE, cookie, 0, 4096));
        pipeline.extend(vec![cookie as u8; 4096]);
        pipeline.extend(request(CMD_FLUSH, cookie, 0, 0));
    }
    busy.write_all(&pipeline).unwrap();
    for _ in 0..128 {
        assert_eq!(reply(&mut busy).0, 0);
    }
    let grown = connection_threads();
    // Within a quarter of the 8 s idle timeout, plus scheduling slack.
    let shrunk = wait_for_connection_threads(201, Duration::from_secs(5));
    eprintln!(
        "after a queue of 128 requests: {grown} connection threads, then {shrunk} once quiet"
    );
    assert_eq!(shrunk, 201, "threads for 201 quiet connections");
    // Still connected: the threads left, the connections did not.
    assert_eq!(server.connection_count(), 201);
    drop(streams);
    drop(busy);
    server.wait_for_connections(0);
    server.stop();
}

/// Regression (issue 10): the handshake timeout applied per read, so one byte every 20 s
/// kept a connection in the handshake forever. The deadline is now for the whole handshake.
#[test]
fn handshake_deadline_is_total_not_per_read() {
    let _serial = serial();
    let events = Arc::new(Mutex::new(Vec::new()));
    let recorded = Arc::clone(&events);
    let config = Config {
        handshake_timeout: Duration::from_secs(2),
        on_event: Some(Arc::new(move |event: &Event| {
            recorded.lock().unwrap().push(event.clone())
        })),
        ..quick_shutdown(Config::default())
    };
    let server = TestServer::start(vec![memory("disk", MIB)], config, false);
    let mut stream = unix(&server);
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).unwrap();
    // Client flags and an option header: 20 bytes, one every 250 ms (5 s in all).
    let mut bytes = 1u32.to_be_bytes().to_vec();
    bytes.extend_from_slice(&IHAVEOPT.to_be_bytes());
    bytes.extend_from_slice(&OPT_GO.to_be_bytes());
    bytes.extend_from_slice(&64u32.to_be_bytes());
    let start = Instant::now();
    let mut cut_off = false;
    for byte in bytes {
        if stream.write_all(&[byte]).is_err() {
            cut_off = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    assert!(
        cut_off || closed_by_server(&mut stream),
        "a handshake trickling one byte per 250 ms outlived a 2 s deadline"
    );
    eprintln!("trickling handshake closed after {:?}", start.elapsed());
    server.wait_for_connections(0);
    let ended = events.lock().unwrap().iter().any(|event| {
        matches!(event, Event::Disconnected { error: Some(error), .. }
            if error == "handshake not finished within 2 s")
    });
    assert!(ended, "{:?}", events.lock().unwrap());
    server.stop();
}

/// An idle timeout after GO: a connection with nothing in flight that sends nothing is
/// closed; one whose request takes longer than the timeout is not, nor is one that keeps
/// sending requests.
#[test]
fn idle_connections_are_closed_after_the_idle_timeout() {
    let _serial = serial();
    let config = Config {
        idle_timeout: Duration::from_secs(2),
        ..quick_shutdown(Config::default())
    };
    let slow: Arc<dyn Export> = Arc::new(SlowFlush {
        inner: MemoryExport::new("slow", MIB),
        delay: Duration::from_secs(4),
    });
    let events = Arc::new(Mutex::new(Vec::new()));
    let recorded = Arc::clone(&events);
    let config = Config {
        on_event: Some(Arc::new(move |event: &Event| {
            recorded.lock().unwrap().push(event.clone())
        })),
        ..config
    };
    let server = TestServer::start(vec![memory("disk", MIB), slow], config, false);

    let mut idle = unix(&server);
    assert!(greet(&mut idle));
    go(&mut idle, "disk");
    let mut waiting = unix(&server);
    assert!(greet(&mut waiting));
    go(&mut waiting, "slow");
    let mut active = unix(&server);
    assert!(greet(&mut active));
    go(&mut active, "disk");

    // A FLUSH that takes 4 s: in flight, so not idle.
    waiting.write_all(&request(CMD_FLUSH, 1, 0, 0)).unwrap();
    // Requests every 250 ms for 4 s.
    for round in 0..16u8 {
        write_at(&mut active, 0, &[round; 512]);
        std::thread::sleep(Duration::from_millis(250));
    }
    assert_eq!(reply(&mut waiting), (0, 1), "slow flush not answered");
    assert!(closed_by_server(&mut idle), "idle connection not closed");
    assert_eq!(read_at(&mut active, 0, 512), vec![15u8; 512]);
    assert!(
        closed_by_server(&mut waiting),
        "connection not closed once idle"
    );
    assert!(
        closed_by_server(&mut active),
        "connection not closed once idle"
    );
    server.wait_for_connections(0);
    let events = events.lock().unwrap();
    let idle_closes = events
        .iter()
        .filter(|event| {
            matches!(event, Event::Disconnected { error: Some(error), .. }
                if error.contains("without a request"))
        })
        .count();
    assert_eq!(idle_closes, 3, "{events:?}");
    drop(events);
    server.stop();
}

/// The per-peer limit: one uid on the Unix socket, one address on TCP, cannot take more
/// than `connections_per_peer_max` connections (none of these is idle, so a new one is
/// refused; `peer_fairness.rs` tests evictions), and other peers are still served.
#[test]
fn per_peer_limit_leaves_room_for_other_peers() {
    let _serial = serial();
    let config = Config {
        connections_per_peer_max: 3,
        connections_max: 100,
        ..quick_shutdown(Config::default())
    };
    let server = TestServer::start(vec![memory("disk", MIB)], config, true);
    let tcp = server.tcp.unwrap();
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut stream = unix(&server);
        assert!(greet(&mut stream));
        held.push(stream);
    }
    server.wait_for_connections(3);
    let mut refused = unix(&server);
    assert!(!greet(&mut refused), "fourth connection of one uid served");

    let hostile = Ipv4Addr::new(127, 0, 0, 2);
    let mut held_tcp = Vec::new();
    for _ in 0..3 {
        let mut stream = tcp_from(hostile, tcp);
        assert!(greet(&mut stream));
        held_tcp.push(stream);
    }
    server.wait_for_connections(6);
    let mut refused = tcp_from(hostile, tcp);
    assert!(
        !greet(&mut refused),
        "fourth connection of one address served"
    );
    let mut other = tcp_from(Ipv4Addr::new(127, 0, 0, 3), tcp);
    assert!(greet(&mut other), "another address refused");
    go(&mut other, "disk");
    write_at(&mut other, 512, &[5u8; 512]);
    assert_eq!(read_at(&mut other, 512, 512), vec![5u8; 512]);

    // A slot freed by a hang-up is the peer's again.
    drop(held.pop());
    server.wait_for_connections(6);
    let mut again = unix(&server);
    assert!(greet(&mut again), "freed slot not reusable");
    drop((held, held_tcp, other, again));
    server.wait_for_connections(0);
    server.stop();
}

/// Client-supplied strings reach events and error messages bounded and escaped.
#[test]
fn client_strings_in_log_lines_are_bounded_and_escaped() {
    let _serial = serial();
    let events = Arc::new(Mutex::new(Vec::new()));
    let recorded = Arc::clone(&events);
    let config = Config {
        on_event: Some(Arc::new(move |event: &Event| {
            recorded.lock().unwrap().push(event.clone())
        })),
        ..quick_shutdown(Config::default())
    };
    let long_name = "n".repeat(4000);
    let server = TestServer::start(
        vec![memory(&long_name, MIB), memory("disk", MIB)],
        config,
        false,
    );
    let mut served = unix(&server);
    assert!(greet(&mut served));
    go(&mut served, &long_name);
    // NBD_OPT_EXPORT_NAME of an unknown export ends the connection with an error quoting it.
    let mut unknown = unix(&server);
    assert!(greet(&mut unknown));
    let hostile = format!("\u{202e}\u{1b}[2J{}", "x".repeat(4000));
    send_option(&mut unknown, OPT_EXPORT_NAME, hostile.as_bytes());
    assert!(closed_by_server(&mut unknown));
    drop(served);
    server.wait_for_connections(0);
    let events = events.lock().unwrap();
    let serving = events
        .iter()
        .find_map(|event| match event {
            Event::Serving { export, .. } => Some(export.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(serving, "n".repeat(64));
    let error = events
        .iter()
        .find_map(|event| match event {
            Event::Disconnected {
                error: Some(error), ..
            } if error.contains("no export") => Some(error.clone()),
            _ => None,
        })
        .unwrap();
    assert!(error.len() < 256, "{} bytes: {error}", error.len());
    assert!(error.contains("\\u{202e}\\u{1b}[2J"), "{error}");
    assert!(!error.contains('\u{202e}') && !error.contains('\u{1b}'));
    drop(events);
    server.stop();
}

/// Starts `count` connections from `source` that each pipeline READs of `length` bytes
/// on `export` and never read a reply. Returns them (kept open by the caller).
fn non_reading_pipelines(
    server: SocketAddr,
    source: Ipv4Addr,
    count: usize,
    export: &str,
    length: u32,
    requests: u64,
) -> Vec<TcpStream> {
    (0..count)
        .map(|_| {
            let mut stream = tcp_from(source, server);
            assert!(greet(&mut stream));
            go(&mut stream, export);
            let mut pipeline = Vec::new();
            for cookie in 0..requests {
                pipeline.extend(request(CMD_READ, cookie, 0, length));
            }
            // The headers fit the socket buffer; the replies pile up unread.
            stream.write_all(&pipeline).unwrap();
            stream
        })
        .collect()
}

/// The legitimate client's round: a 4 KiB write, a 4 KiB read and a 1 MiB read (large
/// enough to draw on the server-wide budget), each timed. Returns the slowest.
fn legitimate_round(stream: &mut UnixStream, round: u64) -> Duration {
    let data = vec![(round % 251) as u8; 4096];
    let offset = (round % 64) * 4096;
    let start = Instant::now();
    write_at(stream, offset, &data);
    let write = start.elapsed();
    let start = Instant::now();
    assert_eq!(read_at(stream, offset, 4096), data);
    let read = start.elapsed();
    let start = Instant::now();
    let large = read_at(stream, 0, MIB as u32);
    let read_large = start.elapsed();
    assert_eq!(&large[offset as usize..offset as usize + 4096], &data[..]);
    for latency in [write, read, read_large] {
        assert!(
            latency < LEGITIMATE_DEADLINE,
            "legitimate request took {latency:?}"
        );
    }
    write.max(read).max(read_large)
}

/// Regression (issue 10): 16 connections pipelining 32 MiB READs without reading the replies
/// filled the server-wide 512 MiB budget, and a 4 KiB read of another export did not
/// complete within 25 s. Each such connection now stops at its own limit, and a few of them
/// cannot fill the server budget.
#[test]
fn clients_that_do_not_read_replies_starve_only_themselves() {
    let _serial = serial();
    let server = TestServer::start(
        vec![memory("big", 64 * MIB), memory("disk", 4 * MIB)],
        quick_shutdown(Config::default()),
        true,
    );
    let rss_before = status("VmRSS");
    let hostile = non_reading_pipelines(
        server.tcp.unwrap(),
        Ipv4Addr::new(127, 0, 0, 9),
        16,
        "big",
        32 * MIB as u32,
        8,
    );
    // Let the server take whatever it will from them.
    std::thread::sleep(Duration::from_secs(2));
    let mut client = unix(&server);
    assert!(greet(&mut client));
    go(&mut client, "disk");
    let mut worst = Duration::ZERO;
    for round in 0..20 {
        worst = worst.max(legitimate_round(&mut client, round));
    }
    let rss_added_mib = status("VmRSS").saturating_sub(rss_before) / 1024;
    eprintln!(
        "16 non-reading 32 MiB READ pipelines: legitimate worst latency {worst:?}, \
         RSS +{rss_added_mib} MiB, {} threads",
        status("Threads")
    );
    // Half the 512 MiB budget, plus retained buffers and slack.
    assert!(rss_added_mib < 400, "RSS grew by {rss_added_mib} MiB");
    drop(client);
    drop(hostile);
    server.stop();
}

/// The load test of issue 10: 1000 idle connections, 256 slow-loris handshakes and 16
/// non-reading READ pipelines at once, against the default limits; a legitimate client's
/// reads and writes complete promptly and the process's threads and RSS stay bounded.
#[test]
fn legitimate_client_is_served_under_attack() {
    let _serial = serial();
    const IDLE: usize = 1000;
    const LORIS: usize = 256;
    const PIPELINES: usize = 16;
    // Client and server ends, plus the server's clones of each connection.
    ensure_open_files(4 * (IDLE + LORIS + PIPELINES) as u64 + 256);
    let server = TestServer::start(
        vec![memory("big", 64 * MIB), memory("disk", 4 * MIB)],
        quick_shutdown(Config::default()),
        true,
    );
    let tcp = server.tcp.unwrap();
    let threads_before = status("Threads");
    let rss_before = status("VmRSS");

    // 1000 idle connections after GO, 200 from each of five addresses (the per-peer limit
    // is 256).
    let idle: Vec<TcpStream> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..5u8)
            .map(|peer| {
                scope.spawn(move || {
                    (0..IDLE / 5)
                        .map(|_| {
                            let mut stream = tcp_from(Ipv4Addr::new(127, 0, 0, 2 + peer), tcp);
                            assert!(greet(&mut stream));
                            go(&mut stream, "disk");
                            stream
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|worker| worker.join().unwrap())
            .collect()
    });
    // 256 slow-loris handshakes from eight addresses, 32 each (the per-peer handshake
    // limit: past it an address's oldest handshake would close): one byte every 2 s.
    let loris: Vec<TcpStream> = (0..LORIS)
        .map(|index| {
            let source = Ipv4Addr::new(127, 0, 0, 10 + (index % 8) as u8);
            tcp_from(source, tcp)
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let trickle = {
        let stop = Arc::clone(&stop);
        let mut loris: Vec<TcpStream> = loris
            .iter()
            .map(|stream| stream.try_clone().unwrap())
            .collect();
        std::thread::spawn(move || {
            let message: Vec<u8> =
                [1u32.to_be_bytes().as_slice(), &IHAVEOPT.to_be_bytes()].concat();
            let mut position = 0;
            while !stop.load(Ordering::SeqCst) {
                for stream in &mut loris {
                    let _ = stream.write_all(&message[position % message.len()..][..1]);
                }
                position += 1;
                for _ in 0..20 {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        })
    };
    let pipelines = non_reading_pipelines(
        tcp,
        Ipv4Addr::new(127, 0, 0, 9),
        PIPELINES,
        "big",
        32 * MIB as u32,
        8,
    );
    server.wait_for_connections(IDLE + LORIS + PIPELINES);
    std::thread::sleep(Duration::from_secs(1));

    let mut client = unix(&server);
    let start = Instant::now();
    assert!(greet(&mut client));
    go(&mut client, "disk");
    let connect = start.elapsed();
    let mut worst = Duration::ZERO;
    for round in 0..50 {
        worst = worst.max(legitimate_round(&mut client, round));
    }
    let threads = status("Threads") - threads_before;
    let serving_threads = connection_threads();
    let rss_added_mib = status("VmRSS").saturating_sub(rss_before) / 1024;
    eprintln!(
        "under attack ({IDLE} idle, {LORIS} slow-loris, {PIPELINES} non-reading pipelines): \
         legitimate connect+GO {connect:?}, worst request {worst:?} (4 KiB write, 4 KiB read, \
         1 MiB read; 50 rounds); {threads} threads added, {serving_threads} of them serving \
         connections; RSS +{rss_added_mib} MiB"
    );
    assert!(connect < LEGITIMATE_DEADLINE, "handshake took {connect:?}");
    // One thread per connection, a second for each pipeline (blocked in its own budget
    // while the first is blocked writing), and the legitimate one's session may have grown.
    let connections = IDLE + LORIS + PIPELINES + 1;
    assert!(
        serving_threads <= connections + PIPELINES + 3,
        "{serving_threads} threads for {connections} connections"
    );
    assert!(rss_added_mib < 600, "RSS grew by {rss_added_mib} MiB");

    stop.store(true, Ordering::SeqCst);
    trickle.join().unwrap();
    drop((client, idle, loris, pipelines));
    server.stop();
}
