//! Goal: on the event loop (`Config::event_loop`) connections in transmission
//! cost no thread: thousands of idle ones are held by a few workers and still served, and a
//! connection that stalls in the middle of a request does not hold up the others sharing
//! its worker.
//! Method: (1) as many idle connections as the open-file limit allows, up to 4096 (the soft
//! limit raised to the hard one first), each through the handshake; the process's thread
//! count must stay far below one per connection, and requests on a spread of them (and on a
//! new one) are answered with the right data. (2) One worker only: one connection stops
//! halfway through a WRITE's payload, another halfway through a request header; a third
//! connection's requests are still answered, then the stalled two finish their requests and
//! get correct replies.
#![allow(clippy::big_endian_bytes)]

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::*;
use nbd::{Config, MemoryExport};
use std::sync::Arc;

const SIZE: u64 = 16 * MIB;

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

fn rss_kib() -> u64 {
    let text = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = text.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Raises the soft open-file limit to the hard one; returns the soft limit then.
fn raise_open_files() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut limit = getrlimit(Resource::Nofile);
    limit.current = limit.maximum;
    let _ = setrlimit(Resource::Nofile, limit);
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

fn server(config: Config) -> TestServer {
    TestServer::start_with(vec![Arc::new(MemoryExport::new("disk", SIZE))], config)
}

#[test]
fn thousands_of_idle_connections_cost_no_thread_each_and_are_served() {
    // Each connection holds a client socket and three server descriptors.
    let limit = raise_open_files();
    let count = usize::try_from(limit.saturating_sub(256) / 4)
        .unwrap_or(usize::MAX)
        .min(4096);
    assert!(
        count >= 256,
        "open file limit {limit} is too low for this test"
    );
    let server = server(Config {
        connections_max: count + 16,
        connections_per_peer_max: count + 16,
        handshakes_per_peer_max: count + 16,
        event_loop: true,
        loop_threads: 2,
        ..Config::default()
    });
    let mut writer = Client::open(&server.socket, "disk");
    for index in 0..64u64 {
        writer.write(index * 4096, &pattern(index, 4096));
    }
    let threads_before = threads();
    let rss_before = rss_kib();
    let mut clients: Vec<Client> = (0..count)
        .map(|_| Client::open(&server.socket, "disk"))
        .collect();
    // The handshakes' threads end as their sessions go to the event loop.
    let deadline = Instant::now() + Duration::from_secs(20);
    let bound = threads_before + 16;
    while threads() > bound && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let held = threads();
    eprintln!(
        "{count} idle connections: {held} threads (before them {threads_before}), RSS +{} KiB",
        rss_kib().saturating_sub(rss_before)
    );
    assert!(
        held <= bound,
        "{held} threads for {count} idle connections (bound {bound})"
    );
    for (index, client) in clients.iter_mut().enumerate().step_by(61) {
        let block = index as u64 % 64;
        assert_eq!(client.read(block * 4096, 4096), pattern(block, 4096));
    }
    let mut late = Client::open(&server.socket, "disk");
    assert_eq!(late.read(5 * 4096, 4096), pattern(5, 4096));
    assert!(threads() <= bound + 2, "threads grew while serving");
    late.disconnect();
    for client in clients {
        client.disconnect();
    }
    writer.disconnect();
}

/// A simple-reply request header.
fn header(command: u16, cookie: u64, offset: u64, length: u32) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(28);
    bytes.extend(0x2560_9513u32.to_be_bytes());
    bytes.extend(0u16.to_be_bytes());
    bytes.extend(command.to_be_bytes());
    bytes.extend(cookie.to_be_bytes());
    bytes.extend(offset.to_be_bytes());
    bytes.extend(length.to_be_bytes());
    bytes
}

#[test]
fn a_connection_stalled_mid_request_does_not_hold_up_its_worker() {
    let server = server(Config {
        event_loop: true,
        loop_threads: 1,
        ..Config::default()
    });
    let mut seed = Client::open(&server.socket, "disk");
    seed.write(8 * 4096, &pattern(8, 4096));

    // Halfway through a WRITE's payload: its worker waits in the payload's read.
    let mut mid_payload = Client::open(&server.socket, "disk");
    let payload = pattern(21, 4096);
    let write = mid_payload.send_request(CMD_WRITE, 0, 4096, 4096, &payload[..2048]);
    // Halfway through a READ's header: parked with the half in its buffer.
    let mut mid_header = Client::open(&server.socket, "disk");
    let read_header = header(CMD_READ, 77, 8 * 4096, 4096);
    mid_header.stream.write_all(&read_header[..13]).unwrap();
    std::thread::sleep(Duration::from_millis(50));

    // Others are served meanwhile, new connections and old ones alike.
    let mut other = Client::open(&server.socket, "disk");
    for round in 0..20u64 {
        other.write(32 * 4096 + round * 4096, &pattern(100 + round, 4096));
        assert_eq!(other.read(8 * 4096, 4096), pattern(8, 4096));
    }
    assert_eq!(seed.read(8 * 4096, 4096), pattern(8, 4096));

    mid_payload.send(&payload[2048..]);
    let reply = mid_payload.read_completed();
    assert_eq!((reply.cookie, reply.error), (write, 0));
    assert_eq!(mid_payload.read(4096, 4096), payload);

    mid_header.stream.write_all(&read_header[13..]).unwrap();
    let mut reply = [0u8; 16];
    mid_header.stream.read_exact(&mut reply).unwrap();
    assert_eq!(reply[0..4], 0x6744_6698u32.to_be_bytes());
    assert_eq!(reply[4..8], [0; 4], "READ error");
    assert_eq!(reply[8..16], 77u64.to_be_bytes());
    let mut data = vec![0u8; 4096];
    mid_header.stream.read_exact(&mut data).unwrap();
    assert_eq!(data, pattern(8, 4096));
    for (round, block) in (0..20u64).zip(32..) {
        assert_eq!(other.read(block * 4096, 4096), pattern(100 + round, 4096));
    }
    other.disconnect();
    seed.disconnect();
    mid_payload.disconnect();
}
