//! Goal: the spin before sleeping between requests (`Config::spin_max`) changes nothing a
//! client can see but timing: requests that arrive during the spin, after it, or with their
//! WRITE payload trailing the header are all served and framed right; a client that hangs
//! up (cleanly, with DISC, or in the middle of a payload) during the spin ends its
//! connection as without spinning; the idle timeout still closes a quiet connection; and
//! shutdown still stops a connection whose thread spins.
//! Method: a raw client in simple-reply mode paces its requests (and splits WRITEs between
//! header and payload) around a wide spin window, against a memory export and a local model
//! of its bytes; no timing is asserted, only replies, contents and connection ends, with
//! deadlines to catch hangs.

mod common;

use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use nbd::{Config, Event, MemoryExport};

const SIZE: u64 = 4 * MIB;
/// A spin window far wider than the pauses below, so requests land inside it...
const WIDE: Duration = Duration::from_millis(20);
/// ...and a pause far longer than it, so they land after it.
const LONG_PAUSE: Duration = Duration::from_millis(60);
const SHORT_PAUSE: Duration = Duration::from_millis(1);
/// Longest wait for anything a test expects; only to turn a hang into a failure.
const DEADLINE: Duration = Duration::from_secs(20);

fn config(spin_max: Duration) -> (Config, Arc<Mutex<Vec<Event>>>) {
    let events = Arc::new(Mutex::new(Vec::new()));
    let recorded = Arc::clone(&events);
    let config = Config {
        spin_max,
        shutdown_grace: Duration::from_secs(2),
        on_event: Some(Arc::new(move |event: &Event| {
            recorded.lock().unwrap().push(event.clone())
        })),
        ..Config::default()
    };
    (config, events)
}

fn open(server: &TestServer) -> Client {
    let (client, _, _, _) = Client::negotiate(&server.socket, "disk", Mode::Simple, false);
    client
        .stream
        .set_read_timeout(Some(DEADLINE))
        .expect("read timeout");
    client
}

/// Reads one simple reply to `cookie`: its error, and `data_length` bytes of data if it
/// succeeded.
fn simple_reply(client: &mut Client, cookie: u64, data_length: usize) -> (u32, Vec<u8>) {
    let mut header = [0u8; 16];
    client.stream.read_exact(&mut header).expect("reply header");
    assert_eq!(be32(&header), 0x6744_6698, "simple reply magic");
    assert_eq!(be64(&header[8..]), cookie, "reply to another request");
    let error = be32(&header[4..]);
    let mut data = vec![0u8; if error == 0 { data_length } else { 0 }];
    client.stream.read_exact(&mut data).expect("reply data");
    (error, data)
}

/// A WRITE sent as its header, a pause, then its payload.
fn split_write(client: &mut Client, cookie: u64, offset: u64, data: &[u8], pause: Duration) {
    let header = request_header(
        Mode::Simple,
        CMD_WRITE,
        0,
        cookie,
        offset,
        data.len() as u64,
    );
    client.stream.write_all(&header).unwrap();
    std::thread::sleep(pause);
    client.stream.write_all(data).unwrap();
    assert_eq!(simple_reply(client, cookie, 0).0, 0, "split write failed");
}

fn read(client: &mut Client, cookie: u64, offset: u64, length: u64) -> Vec<u8> {
    let header = request_header(Mode::Simple, CMD_READ, 0, cookie, offset, length);
    client.stream.write_all(&header).unwrap();
    let (error, data) = simple_reply(client, cookie, length as usize);
    assert_eq!(error, 0, "read at {offset}");
    data
}

fn disconnected(events: &Mutex<Vec<Event>>) -> Vec<Option<String>> {
    events
        .lock()
        .unwrap()
        .iter()
        .filter_map(|event| match event {
            Event::Disconnected { error, .. } => Some(error.clone()),
            _ => None,
        })
        .collect()
}

fn wait_disconnects(events: &Mutex<Vec<Event>>, count: usize) -> Vec<Option<String>> {
    wait_for("connections to end", DEADLINE, || {
        disconnected(events).len() >= count
    });
    disconnected(events)
}

#[test]
fn requests_during_and_after_the_spin_and_split_writes_are_served() {
    for spin_max in [WIDE, Duration::from_micros(50), Duration::ZERO] {
        let (config, _) = config(spin_max);
        let server =
            TestServer::start_with(vec![Arc::new(MemoryExport::new("disk", SIZE))], config);
        let mut client = open(&server);
        let mut model = vec![0u8; SIZE as usize];
        let pauses = [
            Duration::ZERO,
            SHORT_PAUSE,
            LONG_PAUSE,
            SHORT_PAUSE,
            Duration::ZERO,
            LONG_PAUSE,
        ];
        let mut cookie = 1;
        for (index, &pause) in pauses.iter().enumerate() {
            let offset = index as u64 * 65536;
            let data = pattern(index as u64 + 1, 4096 * (index + 1));
            // The header arrives after `pause` (inside or beyond the spin), the payload after
            // another pause: the payload's wait spins or sleeps too.
            std::thread::sleep(pause);
            split_write(&mut client, cookie, offset, &data, pause);
            model[offset as usize..offset as usize + data.len()].copy_from_slice(&data);
            cookie += 1;
            std::thread::sleep(pause);
            let back = read(&mut client, cookie, offset, 8192);
            assert_eq!(
                back,
                model[offset as usize..offset as usize + 8192],
                "{spin_max:?}"
            );
            cookie += 1;
        }
        // Many requests back to back, each sent as soon as the last reply came: the case
        // the spin is for.
        for index in 0..200u64 {
            let offset = (index % 64) * 4096;
            let data = pattern(1000 + index, 4096);
            client.write(offset, &data);
            model[offset as usize..offset as usize + 4096].copy_from_slice(&data);
            assert_eq!(
                client.read(offset, 4096),
                model[offset as usize..offset as usize + 4096]
            );
        }
        assert_eq!(client.read(0, SIZE), model, "{spin_max:?}");
        client.disconnect();
    }
}

#[test]
fn hanging_up_during_the_spin_ends_the_connection_as_without_it() {
    let (config, events) = config(Duration::from_millis(200));
    let server = TestServer::start_with(vec![Arc::new(MemoryExport::new("disk", SIZE))], config);
    // DISC right behind a reply, while the thread spins.
    let mut client = open(&server);
    client.write(0, &[7u8; 4096]);
    client.disconnect();
    // Each end is awaited before the next connection opens: ends of separate connections
    // are reported in the order their threads see them, which a loaded machine reorders.
    wait_disconnects(&events, 1);
    // A plain close right behind a reply.
    let mut client = open(&server);
    assert_eq!(client.read(0, 4096), vec![7u8; 4096]);
    drop(client);
    wait_disconnects(&events, 2);
    // A close in the middle of a WRITE payload, which the thread spins for.
    let mut client = open(&server);
    client.write(4096, &[8u8; 4096]);
    let header = request_header(Mode::Simple, CMD_WRITE, 0, 99, 0, 4096);
    client.stream.write_all(&header).unwrap();
    client.stream.write_all(&[9u8; 1000]).unwrap();
    drop(client);
    let ends = wait_disconnects(&events, 3);
    assert_eq!(ends[..2], [None, None], "clean ends: {ends:?}");
    assert!(ends[2].is_some(), "a cut payload is an error: {ends:?}");
    // The cut WRITE changed nothing; the server serves on.
    let mut client = open(&server);
    assert_eq!(client.read(0, 4096), vec![7u8; 4096]);
    assert_eq!(client.read(4096, 4096), vec![8u8; 4096]);
    client.disconnect();
}

#[test]
fn the_idle_timeout_closes_a_connection_whose_thread_spun() {
    let (config, events) = config(WIDE);
    let config = Config {
        idle_timeout: Duration::from_secs(1),
        ..config
    };
    let server = TestServer::start_with(vec![Arc::new(MemoryExport::new("disk", SIZE))], config);
    let mut client = open(&server);
    for index in 0..50u64 {
        client.write(index * 4096, &[1u8; 4096]);
    }
    let started = Instant::now();
    assert!(client.is_closed(), "idle connection not closed");
    assert!(started.elapsed() < DEADLINE);
    let ends = wait_disconnects(&events, 1);
    assert!(
        ends[0]
            .as_deref()
            .is_some_and(|e| e.contains("without a request")),
        "{ends:?}"
    );
}

#[test]
fn shutdown_stops_connections_that_spin() {
    let (config, _) = config(Duration::from_millis(200));
    let mut server =
        TestServer::start_with(vec![Arc::new(MemoryExport::new("disk", SIZE))], config);
    // One client keeps the spin busy, one has just been answered and is quiet.
    let mut quiet = open(&server);
    quiet.write(0, &[3u8; 4096]);
    let mut busy = open(&server);
    let worker = std::thread::spawn(move || {
        let mut served = 0u64;
        let started = Instant::now();
        while started.elapsed() < DEADLINE {
            match busy.try_request(CMD_WRITE, 4096, &[5u8; 4096]) {
                Ok(reply) if reply.error == 0 => served += 1,
                _ => break,
            }
        }
        served
    });
    std::thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    server.server.take().unwrap().shutdown();
    assert!(started.elapsed() < DEADLINE, "shutdown hung");
    let served = worker.join().unwrap();
    assert!(served > 0, "the busy client got no reply before shutdown");
    assert!(quiet.is_closed(), "quiet connection left open");
}
