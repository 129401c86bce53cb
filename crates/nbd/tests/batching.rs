//! Goal: a connection's reading thread serves the quick requests it finds queued (small
//! READs, WRITEs without FUA, BLOCK_STATUS) itself and sends their replies together, and this
//! changes nothing a client can see but the order of replies: every request gets exactly one
//! reply, matched by cookie, with the right data or error, in every reply style; slow
//! requests (FLUSH, FUA writes, TRIM, large READs) mixed in are still answered; a refused
//! request in the middle of a queue is answered with its error and the queue goes on; a
//! client that does not read its replies holds up only itself.
//! Method: the raw client pipelines seeded mixes of requests (sent back to back, replies read
//! only afterwards) against a MemoryExport and checks each reply against a local model of
//! the disk; a second connection runs round trips while the first one's replies pile up.
#![allow(clippy::big_endian_bytes)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use nbd::{Config, MemoryExport};
use rand::{Rng, SeedableRng};

const SIZE: u64 = 16 * MIB;
/// Requests a client sends before it reads their replies; their payloads and replies (at
/// most 64 KiB + 11 * 8 KiB) stay within the socket buffers.
const PIPELINE_DEPTH: usize = 12;

/// What the reply to a pipelined request must be.
enum Expect {
    /// Success, with these bytes for a READ (empty for other commands).
    Data(Vec<u8>),
    /// This NBD error.
    Error(u32),
    /// A BLOCK_STATUS reply covering at least the first byte of the range.
    Status,
}

/// Reads replies until every expected cookie is answered, checking each.
fn check_replies(client: &mut Client, expected: &mut HashMap<u64, Expect>, mode: Mode) {
    while !expected.is_empty() {
        let reply = client.read_completed();
        let expect = expected
            .remove(&reply.cookie)
            .unwrap_or_else(|| panic!("reply to cookie {} not expected", reply.cookie));
        match expect {
            Expect::Data(data) => {
                assert_eq!(
                    reply.error, 0,
                    "cookie {}: {}",
                    reply.cookie, reply.error_message
                );
                assert!(reply.data == data, "cookie {}: wrong data", reply.cookie);
            }
            Expect::Error(error) => assert_eq!(reply.error, error, "cookie {}", reply.cookie),
            Expect::Status => {
                assert_eq!(
                    reply.error, 0,
                    "cookie {}: {}",
                    reply.cookie, reply.error_message
                );
                if mode != Mode::Simple {
                    assert_eq!(reply.block_status.len(), 1, "cookie {}", reply.cookie);
                    assert!(!reply.block_status[0].1.is_empty());
                }
            }
        }
    }
}

#[test]
fn pipelined_mixes_are_answered_once_each_by_cookie() {
    let report = seed_report();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(report.seed());
    // With batches, and with every request handed off (`Config::batch_replies` off).
    let settings = [Mode::Simple, Mode::Structured, Mode::Extended]
        .into_iter()
        .flat_map(|mode| [(mode, true), (mode, false)]);
    for (mode, batch_replies) in settings {
        let config = Config {
            batch_replies,
            ..Config::default()
        };
        let disk = Arc::new(MemoryExport::new("disk", SIZE));
        let server = TestServer::start_with(vec![disk], config);
        let meta = mode != Mode::Simple;
        let (mut client, _, _, _) = Client::negotiate(&server.socket, "disk", mode, meta);
        let mut model = vec![0u8; SIZE as usize];
        for round in 0..6u64 {
            // Each round writes only to its own half of the disk and reads only the other
            // half, so that replies may come in any order without changing what a READ sees.
            let half = SIZE / 2;
            let (write_base, read_base) = if round % 2 == 0 { (0, half) } else { (half, 0) };
            let mut expected = HashMap::new();
            // Writes of a round may run in any order: keep them apart.
            let mut written: Vec<(u64, u64)> = Vec::new();
            for index in 0..400usize {
                // Replies are read after every few requests: a client that sends more than
                // the socket buffers hold without reading deadlocks against any server.
                if index % PIPELINE_DEPTH == 0 {
                    check_replies(&mut client, &mut expected, mode);
                }
                let length = 512 * rng.gen_range(1..=16u64);
                let kind = rng.gen_range(0..100);
                let (mut command, flags, base) = match kind {
                    0..=49 => (CMD_READ, 0, read_base),
                    50..=84 => (CMD_WRITE, 0, write_base),
                    85..=89 => (CMD_WRITE, FLAG_FUA, write_base),
                    90..=93 => (CMD_FLUSH, 0, 0),
                    94..=95 => (CMD_READ, 0, read_base),
                    _ if meta => (CMD_BLOCK_STATUS, 0, read_base),
                    _ => (CMD_READ, 0, read_base),
                };
                // Now and then a READ larger than a batch takes, served by another thread.
                let length = if kind == 94 { 64 * 1024 } else { length };
                let mut offset = base + rng.gen_range(0..(half - length) / 512) * 512;
                let overlaps = written
                    .iter()
                    .any(|&(start, end)| offset < end && start < offset + length);
                if command == CMD_WRITE && overlaps {
                    command = CMD_READ;
                    offset = offset - write_base + read_base;
                }
                let range = offset as usize..(offset + length) as usize;
                let cookie = match command {
                    CMD_FLUSH => {
                        let cookie = client.send_request(CMD_FLUSH, 0, 0, 0, &[]);
                        expected.insert(cookie, Expect::Data(Vec::new()));
                        continue;
                    }
                    CMD_WRITE => {
                        let data = pattern(rng.gen(), length as usize);
                        model[range.clone()].copy_from_slice(&data);
                        written.push((offset, offset + length));
                        let cookie = client.send_request(CMD_WRITE, flags, offset, length, &data);
                        expected.insert(cookie, Expect::Data(Vec::new()));
                        continue;
                    }
                    _ => client.send_request(command, 0, offset, length, &[]),
                };
                let expect = match command {
                    CMD_READ => Expect::Data(model[range].to_vec()),
                    _ => Expect::Status,
                };
                expected.insert(cookie, expect);
            }
            check_replies(&mut client, &mut expected, mode);
        }
        for start in (0..SIZE).step_by(MIB as usize) {
            let data = client.read(start, MIB);
            assert!(
                data == model[start as usize..(start + MIB) as usize],
                "{mode:?}: disk differs from the model at {start}"
            );
        }
        client.disconnect();
    }
}

#[test]
fn refused_requests_in_the_middle_of_a_queue_get_their_error() {
    for mode in [Mode::Simple, Mode::Structured, Mode::Extended] {
        let server = TestServer::start(vec![Arc::new(MemoryExport::new("disk", SIZE))]);
        let (mut client, _, _, _) = Client::negotiate(&server.socket, "disk", mode, false);
        let data = pattern(7, 64 * 1024);
        client.write(0, &data);
        let mut expected = HashMap::new();
        for index in 0..40u64 {
            let offset = (index % 16) * 4096;
            let (cookie, expect) = match index % 8 {
                3 => (
                    client.send_request(CMD_READ, 0, SIZE - 512, 4096, &[]),
                    Expect::Error(EINVAL),
                ),
                5 => (
                    client.send_request(CMD_READ, 0, 100, 4096, &[]),
                    Expect::Error(EINVAL),
                ),
                6 => (
                    // Refused with its payload, which must be skipped whole.
                    client.send_request(CMD_WRITE, 0, SIZE, 4096, &[0xee; 4096]),
                    Expect::Error(ENOSPC),
                ),
                _ => (
                    client.send_request(CMD_READ, 0, offset, 4096, &[]),
                    Expect::Data(data[offset as usize..offset as usize + 4096].to_vec()),
                ),
            };
            expected.insert(cookie, expect);
        }
        check_replies(&mut client, &mut expected, mode);
        // The stream stayed framed: the connection serves on.
        assert_eq!(client.read(4096, 4096), data[4096..8192]);
        client.disconnect();
    }
}

#[test]
fn a_client_that_does_not_read_replies_holds_up_only_itself() {
    let server = TestServer::start(vec![Arc::new(MemoryExport::new("disk", SIZE))]);
    let (mut stuck, _, _, _) = Client::negotiate(&server.socket, "disk", Mode::Structured, false);
    let data = pattern(9, MIB as usize);
    stuck.write(0, &data);
    // Far more reply bytes than the socket buffers hold (the server blocks sending them and
    // stops reading this connection), in few enough small sends that they all fit in the
    // socket even if the server reads none of them.
    let mut cookies = Vec::new();
    for index in 0..200u64 {
        let offset = (index % 256) * 4096;
        cookies.push((stuck.send_request(CMD_READ, 0, offset, 4096, &[]), offset));
    }
    // Meanwhile another connection is served promptly.
    let (mut other, _, _, _) = Client::negotiate(&server.socket, "disk", Mode::Extended, false);
    let started = Instant::now();
    for round in 0..200u64 {
        let offset = (round % 256) * 4096;
        assert_eq!(
            other.read(offset, 4096),
            data[offset as usize..offset as usize + 4096]
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the other connection was held up"
    );
    other.disconnect();
    // Once the stuck client reads, every reply arrives, whole and right.
    let mut by_cookie: HashMap<u64, u64> = cookies.into_iter().collect();
    while !by_cookie.is_empty() {
        let reply = stuck.read_completed();
        let offset = by_cookie.remove(&reply.cookie).expect("known cookie");
        assert_eq!(reply.error, 0);
        assert!(reply.data == data[offset as usize..offset as usize + 4096]);
    }
    stuck.disconnect();
}
