//! Goal: several connections to one export run concurrently with many requests in flight,
//! each connection's writes are visible on every other connection once answered, and a FLUSH
//! on one connection reaches the shared export (CAN_MULTI_CONN).
//! Method: four raw clients in threads, each owning a quarter of the export, pipeline seeded
//! random writes (up to 64 in flight, never two overlapping ones: the server may apply
//! requests in flight in any order) and keep a model; then each client reads and checks a
//! quarter it does not own, and one client's FLUSH is counted by the export.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use nbd::MemoryExport;
use rand::{Rng, SeedableRng};

const SIZE: u64 = 32 * MIB;
const CLIENTS: u64 = 4;

#[test]
fn four_connections_share_one_export() {
    let report = seed_report();
    let seed = report.seed();
    let disk = Arc::new(MemoryExport::new("disk", SIZE));
    let server = TestServer::start(vec![disk.clone()]);
    // A barrier that gives up: if one client panics, the others fail instead of hanging.
    let arrived = Arc::new(AtomicUsize::new(0));
    let quarter = SIZE / CLIENTS;
    let threads: Vec<_> = (0..CLIENTS)
        .map(|index| {
            let socket = server.socket.clone();
            let arrived = arrived.clone();
            std::thread::spawn(move || {
                let mode = if index % 2 == 0 {
                    Mode::Structured
                } else {
                    Mode::Extended
                };
                let (mut client, _, flags, _) = Client::negotiate(&socket, "disk", mode, false);
                assert_ne!(flags & TF_CAN_MULTI_CONN, 0);
                let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ index);
                let base = index * quarter;
                let mut model = vec![0u8; quarter as usize];
                let mut in_flight = HashMap::new();
                for operation in 0..400u64 {
                    let offset = rng.gen_range(0..quarter / 512) * 512;
                    let length = (rng.gen_range(1..=64u64) * 512).min(quarter - offset);
                    let data = pattern(seed ^ (index << 32) ^ operation, length as usize);
                    model[offset as usize..(offset + length) as usize].copy_from_slice(&data);
                    // Requests in flight may be applied in any order (NBD orders nothing
                    // between them), so never have two overlapping writes in flight.
                    while in_flight
                        .values()
                        .any(|&(o, l): &(u64, u64)| o < offset + length && offset < o + l)
                    {
                        let reply = client.read_completed();
                        assert_eq!(reply.error, 0);
                        in_flight.remove(&reply.cookie);
                    }
                    let cookie = client.send_request(CMD_WRITE, 0, base + offset, length, &data);
                    in_flight.insert(cookie, (offset, length));
                    if in_flight.len() == 64 {
                        let reply = client.read_completed();
                        assert_eq!(reply.error, 0);
                        in_flight.remove(&reply.cookie);
                    }
                }
                while !in_flight.is_empty() {
                    let reply = client.read_completed();
                    assert_eq!(reply.error, 0);
                    in_flight.remove(&reply.cookie);
                }
                assert_eq!(client.read(base, quarter), model);
                arrived.fetch_add(1, Ordering::SeqCst);
                wait_for(
                    "every client (another one failed)",
                    Duration::from_secs(60),
                    || arrived.load(Ordering::SeqCst) == CLIENTS as usize,
                );
                // Another connection's writes are visible here.
                let other = (index + 1) % CLIENTS;
                let theirs = client.read(other * quarter, quarter);
                if index == 0 {
                    assert_eq!(client.request(CMD_FLUSH, 0, 0, 0, &[]).error, 0);
                }
                client.disconnect();
                (model, theirs)
            })
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    for index in 0..CLIENTS as usize {
        let other = (index + 1) % CLIENTS as usize;
        assert!(
            results[index].1 == results[other].0,
            "connection {index} saw stale data of {other}"
        );
    }
    assert!(disk.flush_count() >= 1);
}
