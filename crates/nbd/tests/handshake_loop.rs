//! Goal: on the event loop (the default) a connection in the handshake costs no thread while
//! it waits for its client, the handshake deadline still holds from the accept, and a client
//! stalled in the middle of its options holds up no one else.
//! Method: one worker; 256 connections read the greeting and send nothing, one sends its flags
//! and half an option header and stops. The server process's thread count must stay far below
//! one per connection (a thread per handshake would add 257), a new client is served
//! meanwhile, and every stalled connection ends at the deadline (EOF at the client, and a
//! Disconnected event naming the handshake timeout for each).
#![allow(clippy::big_endian_bytes)]

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use nbd::{Config, Event, MemoryExport};

const SILENT: usize = 256;

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// Connects and reads the greeting.
fn greeted(server: &TestServer) -> UnixStream {
    let mut stream = UnixStream::connect(&server.socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).unwrap();
    assert_eq!(&greeting[..16], b"NBDMAGICIHAVEOPT");
    stream
}

#[test]
fn handshakes_waiting_for_their_clients_cost_no_thread_and_end_at_the_deadline() {
    // Client ends held here, plus the server's two descriptors per connection.
    let mut limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    limit.current = limit.maximum;
    let _ = rustix::process::setrlimit(rustix::process::Resource::Nofile, limit);
    let events = Arc::new(Mutex::new(Vec::new()));
    let recorded = Arc::clone(&events);
    let timeout = Duration::from_secs(2);
    let server = TestServer::start_with(
        vec![Arc::new(MemoryExport::new("disk", 16 * MIB))],
        Config {
            handshake_timeout: timeout,
            handshakes_per_peer_max: SILENT + 8,
            connections_per_peer_max: SILENT + 8,
            loop_threads: 1,
            on_event: Some(Arc::new(move |event: &Event| {
                recorded.lock().unwrap().push(event.clone());
            })),
            ..Config::default()
        },
    );
    let threads_before = threads();
    let accepted = Instant::now();
    let mut silent: Vec<UnixStream> = (0..SILENT).map(|_| greeted(&server)).collect();
    let mut half = greeted(&server);
    half.write_all(&3u32.to_be_bytes()).unwrap();
    half.write_all(b"IHAVEOPT").unwrap();
    // Served meanwhile, on the one worker or the one that replaced it.
    let mut client = Client::open(&server.socket, "disk");
    client.write(0, &pattern(1, 4096));
    assert_eq!(client.read(0, 4096), pattern(1, 4096));
    let held = threads();
    assert!(
        held <= threads_before + 8,
        "{held} threads with {} connections in the handshake (before them {threads_before})",
        SILENT + 1
    );
    client.disconnect();
    for stream in silent.iter_mut().chain(std::iter::once(&mut half)) {
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty(), "{rest:?} after the greeting");
    }
    assert!(accepted.elapsed() >= timeout, "closed before the deadline");
    let message = format!("handshake not finished within {} s", timeout.as_secs_f64());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let timed_out = events
            .lock()
            .unwrap()
            .iter()
            .filter(|event| {
                matches!(event, Event::Disconnected { error: Some(error), .. }
                    if error.contains(&message))
            })
            .count();
        if timed_out == SILENT + 1 {
            break;
        }
        assert!(
            timed_out < SILENT + 1 && Instant::now() < deadline,
            "{timed_out} handshakes ended with the timeout, not {}",
            SILENT + 1
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
