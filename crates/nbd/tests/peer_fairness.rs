//! Goal: connections that only sit there, handshaking or idle, never keep their peer's next
//! client out (issue 20, finding 13: 256 of them from one uid refused every other client of
//! that uid for up to the idle timeout, silently). Past `handshakes_per_peer_max` the
//! peer's oldest handshake is closed, past `connections_per_peer_max` its connection idle
//! the longest; only a peer whose connections are all busy has a new one refused; every
//! refusal and eviction is reported (an [`Event`], and a rate-limited log line).
//!
//! Method: a server in this process on a Unix socket (every connection of the test is one
//! peer, its uid) with a memory export; hostile connections are raw sockets that never
//! answer the greeting, or clients that open the export and then send nothing; the
//! legitimate client is testkit's raw NBD client. Events are recorded through
//! `Config::on_event`.

mod common;

use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::*;
use nbd::{Config, Event, Export, ExportMap, MemoryExport};

/// Holds WRITEs in the export while closed, and counts those it holds.
#[derive(Default)]
struct Gate {
    /// (closed, writers held)
    state: Mutex<(bool, usize)>,
    changed: Condvar,
}

impl Gate {
    fn close(&self) {
        self.state.lock().unwrap().0 = true;
    }

    fn open(&self) {
        self.state.lock().unwrap().0 = false;
        self.changed.notify_all();
    }

    fn pass(&self) {
        let mut state = self.state.lock().unwrap();
        if !state.0 {
            return;
        }
        state.1 += 1;
        self.changed.notify_all();
        while state.0 {
            state = self.changed.wait(state).unwrap();
        }
        state.1 -= 1;
    }

    fn wait_for_writers(&self, count: usize) {
        let mut state = self.state.lock().unwrap();
        while state.1 < count {
            state = self.changed.wait(state).unwrap();
        }
    }
}

/// A memory export whose WRITEs wait at a [`Gate`].
struct Gated {
    inner: MemoryExport,
    gate: Arc<Gate>,
}

impl Export for Gated {
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
        self.gate.pass();
        self.inner.write_at(offset, data, fua)
    }
    fn flush(&self) -> nbd::Result<()> {
        self.inner.flush()
    }
}

/// A server whose events are recorded.
fn start(config: Config) -> (TestServer, Arc<Mutex<Vec<Event>>>) {
    start_with(config, Arc::new(Gate::default()))
}

/// A server whose events are recorded, with its export's WRITEs passing `gate`.
fn start_with(config: Config, gate: Arc<Gate>) -> (TestServer, Arc<Mutex<Vec<Event>>>) {
    let events = Arc::new(Mutex::new(Vec::new()));
    let recorded = Arc::clone(&events);
    let config = Config {
        on_event: Some(Arc::new(move |event: &Event| {
            recorded.lock().unwrap().push(event.clone())
        })),
        shutdown_grace: Duration::from_millis(500),
        ..config
    };
    let map = Arc::new(ExportMap::new());
    map.insert(Arc::new(Gated {
        inner: MemoryExport::new("disk", 4 * MIB),
        gate,
    }));
    (TestServer::start_registry(map, config), events)
}

/// Raises the soft limit on open files to the hard limit; panics if `needed` is above it.
fn ensure_open_files(needed: u64) {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current.unwrap_or(u64::MAX) >= needed {
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

/// A connection that stays in the handshake: it never answers the greeting.
fn handshaking(server: &TestServer) -> UnixStream {
    let stream = UnixStream::connect(&server.socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    stream
}

/// Returns once the server has counted the connection's last request answered (idle from
/// then on): a request refused by the checks (a READ past the end) is read by the same
/// thread after it released the earlier one, and takes no slot itself.
fn settle(client: &mut Client) {
    let past_the_end = client.request(CMD_READ, 0, 4 * MIB, 512, &[]);
    assert_ne!(past_the_end.error, 0, "a READ past the end succeeded");
}

/// True if the server closed `stream` (whatever it sent before, a greeting perhaps); false
/// if it is still open after the read timeout.
fn closed(stream: &mut UnixStream) -> bool {
    let mut sent = Vec::new();
    std::io::Read::read_to_end(stream, &mut sent).is_ok()
}

/// Reasons of the recorded evictions and refusals.
fn reasons(events: &Mutex<Vec<Event>>) -> (Vec<String>, Vec<String>) {
    let mut evicted = Vec::new();
    let mut refused = Vec::new();
    for event in events.lock().unwrap().iter() {
        match event {
            Event::Evicted { peer, reason, .. } => evicted.push(format!("{peer}: {reason}")),
            Event::Refused { peer, reason } => refused.push(format!("{peer}: {reason}")),
            _ => {}
        }
    }
    (evicted, refused)
}

/// The reproduction of finding 13 at the default limits: 256 connections of one uid that
/// never finish their handshake and 300 that open the export and stay idle; a legitimate
/// client of the same uid connects, writes and reads 20 times, each time while the hostile
/// client opens more idle connections in between, and is served every time.
#[test]
fn legitimate_client_is_served_past_its_peers_handshakes_and_idle_connections() {
    const HANDSHAKING: usize = 256;
    const IDLE: usize = 300;
    // Client ends held here, plus the server's two descriptors per live connection.
    ensure_open_files(3 * (HANDSHAKING + IDLE) as u64 + 256);
    let (server, events) = start(Config::default());
    let mut hostile = Vec::new();
    for _ in 0..HANDSHAKING {
        hostile.push(handshaking(&server));
    }
    let mut idle = Vec::new();
    for _ in 0..IDLE {
        // On the old server these fail: the peer is full of handshakes.
        if let Ok(client) = Client::try_open(&server.socket, "disk") {
            idle.push(client);
        }
    }
    for round in 0..20u64 {
        let mut client = Client::try_open(&server.socket, "disk")
            .unwrap_or_else(|error| panic!("legitimate client refused in round {round}: {error}"));
        let data = pattern(round, 4096);
        client.write(round * 4096, &data);
        assert_eq!(client.read(round * 4096, 4096), data, "round {round}");
        client.disconnect();
        for _ in 0..5 {
            if let Ok(client) = Client::try_open(&server.socket, "disk") {
                idle.push(client);
            }
        }
    }
    assert_eq!(idle.len(), IDLE + 100, "a hostile idle open was refused");
    let (evicted, refused) = reasons(&events);
    assert!(refused.is_empty(), "refused: {refused:?}");
    let uid = rustix::process::getuid().as_raw();
    let handshakes = evicted
        .iter()
        .filter(|reason| {
            reason.starts_with(&format!("uid {uid}: the peer's oldest of 32 handshakes"))
        })
        .count();
    let idle_evicted = evicted
        .iter()
        .filter(|reason| reason.contains("idle the longest of 256"))
        .count();
    // The raw handshakes past 32 gave way (the last 31 or so stay until the handshake
    // timeout), and of the idle connections all but the 256 the peer may hold.
    assert!(
        handshakes >= HANDSHAKING - 32,
        "{handshakes} handshakes evicted"
    );
    assert!(
        idle_evicted >= IDLE + 100 - 256,
        "{idle_evicted} idle connections evicted"
    );
    // The oldest of each kind was the one closed.
    // Its end comes after the greeting, or before it if the eviction came first (the
    // connection's thread or its greeting's write was slower than 32 more connects).
    let mut first_handshake = hostile.remove(0);
    let mut sent = Vec::new();
    std::io::Read::read_to_end(&mut first_handshake, &mut sent).unwrap();
    assert!(
        sent.len() <= 18 && b"NBDMAGICIHAVEOPT".starts_with(&sent[..sent.len().min(16)]),
        "the oldest handshake got {sent:?}, not (part of) a greeting then its end"
    );
    assert!(
        idle[0].is_closed(),
        "the longest idle connection is still open"
    );
    let mut newest = idle.pop().unwrap();
    newest.write(0, &[7u8; 512]);
    assert_eq!(newest.read(0, 512), vec![7u8; 512]);
    drop((hostile, idle, newest));
}

/// The two limits and the refusal, small: one handshake per peer, two connections per peer.
/// A second handshake closes the first; a third connection closes the one idle the longest,
/// not the newer idle one; with both connections busy (a WRITE whose payload has not come)
/// a new connection is refused and reported.
#[test]
fn peer_limits_evict_the_oldest_handshake_then_the_longest_idle_then_refuse() {
    let config = Config {
        connections_per_peer_max: 2,
        handshakes_per_peer_max: 1,
        ..Config::default()
    };
    let gate = Arc::new(Gate::default());
    let (server, events) = start_with(config, Arc::clone(&gate));
    let mut first = handshaking(&server);
    let mut second = Client::start(&server.socket);
    assert!(closed(&mut first), "the older handshake was not closed");
    second.go("disk");
    // A request answered: the server counts `second` in transmission (it may count it in
    // the handshake until just after its GO reply).
    second.write(512, &[3u8; 512]);
    settle(&mut second);
    let mut third = Client::open(&server.socket, "disk");
    third.write(0, &[1u8; 512]);
    settle(&mut third);
    // `second` is idle the longest now.
    let mut fourth = Client::open(&server.socket, "disk");
    assert!(
        second.is_closed(),
        "the longest idle connection was not closed"
    );
    assert_eq!(third.read(0, 512), vec![1u8; 512]);

    // Both connections busy: each has a WRITE held in the export.
    gate.close();
    for client in [&mut third, &mut fourth] {
        client.send_request(CMD_WRITE, 0, 4096, 512, &[2u8; 512]);
    }
    gate.wait_for_writers(2);
    let mut newcomer = UnixStream::connect(&server.socket).unwrap();
    newcomer
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut greeting = Vec::new();
    std::io::Read::read_to_end(&mut newcomer, &mut greeting).unwrap();
    assert!(
        greeting.is_empty(),
        "a third connection was greeted while both were busy"
    );
    gate.open();
    for client in [&mut third, &mut fourth] {
        assert_eq!(client.read_completed().error, 0);
        assert_eq!(client.read(4096, 512), vec![2u8; 512]);
    }
    let (evicted, refused) = reasons(&events);
    assert_eq!(evicted.len(), 2, "{evicted:?}");
    assert!(evicted[0].contains("oldest of 1 handshakes"), "{evicted:?}");
    assert!(evicted[1].contains("idle the longest of 2"), "{evicted:?}");
    assert!(!refused.is_empty());
    assert!(
        refused[0]
            .contains("the peer has 2 connections (connections_per_peer_max), none of them idle"),
        "{refused:?}"
    );
    drop((third, fourth));
}
