//! Goal: the session's threading keeps requests independent: a request stuck in the export
//! (a FLUSH waiting for a commit, a READ waiting for a disk) does not hold up requests the
//! client sent after it, and their replies overtake its reply; WRITE payloads arrive intact
//! whatever their size relative to the session's input and payload buffers.
//! Method: an export wrapping a MemoryExport whose FLUSH and READs at one offset wait on a
//! gate the test opens; the raw client pipelines requests behind the stuck one and checks the
//! order of replies, also after a pause long enough for the watchdog that finds stuck
//! threads to fall asleep. Then one send carries seeded WRITEs from 512 bytes to 600 KiB (smaller
//! and larger than the 64 KiB input buffer and the 256 KiB retained payload buffer), answered
//! by cookie, and every byte is read back against a local model.
#![allow(clippy::big_endian_bytes)]

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::*;
use nbd::{Export, MemoryExport, Result};
use rand::{Rng, SeedableRng};

const SIZE: u64 = 16 * MIB;
/// READs at this offset wait for the gate.
const SLOW_OFFSET: u64 = MIB;
/// Longest a gated call waits, so a broken test fails instead of hanging.
const GATE_WAIT_MAX: Duration = Duration::from_secs(20);

/// A MemoryExport whose FLUSH and READs at [`SLOW_OFFSET`] wait until the gate opens.
struct GatedExport {
    inner: MemoryExport,
    open: Mutex<bool>,
    opened: Condvar,
    waiting: Mutex<usize>,
    arrived: Condvar,
}

impl GatedExport {
    fn new() -> Self {
        GatedExport {
            inner: MemoryExport::new("gated", SIZE),
            open: Mutex::new(false),
            opened: Condvar::new(),
            waiting: Mutex::new(0),
            arrived: Condvar::new(),
        }
    }

    fn wait_for_gate(&self) {
        *self.waiting.lock().unwrap() += 1;
        self.arrived.notify_all();
        let open = self.open.lock().unwrap();
        let (open, timeout) = self
            .opened
            .wait_timeout_while(open, GATE_WAIT_MAX, |open| !*open)
            .unwrap();
        assert!(*open && !timeout.timed_out(), "gate never opened");
    }

    /// Waits until `count` calls are stuck at the gate.
    fn wait_for_waiters(&self, count: usize) {
        let waiting = self.waiting.lock().unwrap();
        let (waiting, _) = self
            .arrived
            .wait_timeout_while(waiting, GATE_WAIT_MAX, |waiting| *waiting < count)
            .unwrap();
        assert!(*waiting >= count, "requests never reached the gate");
    }

    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

impl Export for GatedExport {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }

    fn read_at(&self, offset: u64, buffer: &mut [u8]) -> Result<()> {
        if offset == SLOW_OFFSET {
            self.wait_for_gate();
        }
        self.inner.read_at(offset, buffer)
    }

    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.inner.write_at(offset, data, fua)
    }

    fn flush(&self) -> Result<()> {
        self.wait_for_gate();
        self.inner.flush()
    }
}

fn serve_gated() -> (TestServer, Arc<GatedExport>) {
    let server = TestServer::start(Vec::new());
    let export = Arc::new(GatedExport::new());
    server.exports.insert(export.clone());
    (server, export)
}

#[test]
fn stuck_flush_and_read_are_overtaken_by_later_requests() {
    let (server, export) = serve_gated();
    let (mut client, _, _, _) = Client::negotiate(&server.socket, "gated", Mode::Simple, false);
    client.write(0, &pattern(1, 4096));
    // A FLUSH alone, then a READ alone, each sent when nothing else is in flight: both get
    // stuck, and the connection still reads and answers the requests that follow.
    let flush = client.send_request(CMD_FLUSH, 0, 0, 0, &[]);
    export.wait_for_waiters(1);
    let slow_read = client.send_request(CMD_READ, 0, SLOW_OFFSET, 4096, &[]);
    export.wait_for_waiters(2);
    for _ in 0..3 {
        let read = client.send_request(CMD_READ, 0, 0, 4096, &[]);
        let reply = client.read_completed();
        assert_eq!(
            reply.cookie, read,
            "a later READ waited for a stuck request"
        );
        assert_eq!(reply.data, pattern(1, 4096));
    }
    export.open();
    let mut stuck = vec![
        client.read_completed().cookie,
        client.read_completed().cookie,
    ];
    stuck.sort_unstable();
    assert_eq!(stuck, vec![flush, slow_read]);
    client.disconnect();
}

#[test]
fn pipelined_behind_a_stuck_read_in_one_send() {
    let (server, export) = serve_gated();
    let (mut client, _, _, _) = Client::negotiate(&server.socket, "gated", Mode::Structured, false);
    client.write(0, &pattern(2, 8192));
    // The stuck READ and the requests after it arrive together: the thread that reads the
    // READ must leave the rest to the other threads.
    let slow_read = client.send_request(CMD_READ, 0, SLOW_OFFSET, 4096, &[]);
    let fast_write = client.send_request(CMD_WRITE, 0, 8192, 4096, &pattern(3, 4096));
    let fast_read = client.send_request(CMD_READ, 0, 0, 8192, &[]);
    let mut fast = [client.read_completed(), client.read_completed()];
    fast.sort_by_key(|reply| reply.cookie);
    assert_eq!(fast[0].cookie, fast_write);
    assert_eq!(fast[0].error, 0);
    assert_eq!(fast[1].cookie, fast_read);
    assert_eq!(fast[1].data, pattern(2, 8192));
    export.wait_for_waiters(1);
    export.open();
    assert_eq!(client.read_completed().cookie, slow_read);
    client.disconnect();
}

#[test]
fn a_read_stuck_in_the_middle_of_a_batch_is_overtaken_by_the_requests_after_it() {
    let (server, export) = serve_gated();
    let (mut client, _, _, _) = Client::negotiate(&server.socket, "gated", Mode::Extended, false);
    client.write(0, &pattern(4, 16 * 4096));
    // Quick requests queued around a READ that gets stuck: the thread serving the queue
    // gets stuck with it, and another thread takes the input over and serves the rest.
    for index in 0..4u64 {
        client.send_request(CMD_READ, 0, index * 4096, 4096, &[]);
    }
    let slow_read = client.send_request(CMD_READ, 0, SLOW_OFFSET, 4096, &[]);
    let mut after = Vec::new();
    for index in 4..16u64 {
        after.push(client.send_request(CMD_READ, 0, index * 4096, 4096, &[]));
    }
    export.wait_for_waiters(1);
    let mut answered = Vec::new();
    while !after.is_empty() {
        let reply = client.read_completed();
        assert_ne!(reply.cookie, slow_read, "the stuck READ was answered");
        assert_eq!(reply.error, 0);
        after.retain(|&cookie| cookie != reply.cookie);
        answered.push(reply.cookie);
    }
    export.open();
    // What is left: the stuck READ, and replies of requests served before it that wait in
    // the stuck thread's batch.
    let mut left = 17 - answered.len();
    let mut saw_slow = false;
    while left > 0 {
        let reply = client.read_completed();
        assert_eq!(reply.error, 0);
        saw_slow |= reply.cookie == slow_read;
        left -= 1;
    }
    assert!(saw_slow);
    client.disconnect();
}

#[test]
fn a_read_stuck_after_a_quiet_spell_is_overtaken_too() {
    // The process's watchdog, which finds stuck reading threads, sleeps once no connection
    // has been busy for 100 ms; a READ that gets stuck after a longer pause must wake it.
    // (Other tests of this binary may keep it awake: then this is the ordinary case.)
    for mode in [Mode::Simple, Mode::Extended] {
        let (server, export) = serve_gated();
        let (mut client, _, _, _) = Client::negotiate(&server.socket, "gated", mode, false);
        client.write(0, &pattern(6, 4 * 4096));
        std::thread::sleep(Duration::from_millis(400));
        let slow_read = client.send_request(CMD_READ, 0, SLOW_OFFSET, 4096, &[]);
        export.wait_for_waiters(1);
        for index in 0..4u64 {
            let read = client.send_request(CMD_READ, 0, index * 4096, 4096, &[]);
            let reply = client.read_completed();
            assert_eq!(reply.cookie, read, "a later READ waited for the stuck one");
            assert_eq!(
                reply.data,
                pattern(6, 4 * 4096)[index as usize * 4096..][..4096]
            );
        }
        export.open();
        assert_eq!(client.read_completed().cookie, slow_read);
        client.disconnect();
    }
}

#[test]
fn pipelined_writes_of_every_size_arrive_intact() {
    let report = seed_report();
    let seed = report.seed();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    for mode in [Mode::Simple, Mode::Extended] {
        let server = TestServer::start(vec![Arc::new(MemoryExport::new("disk", SIZE))]);
        let (mut client, _, _, _) = Client::negotiate(&server.socket, "disk", mode, false);
        let mut model = vec![0u8; SIZE as usize];
        let mut cookies = HashMap::new();
        for index in 0..120u64 {
            let length = match index % 4 {
                0 => rng.gen_range(1..=8u64) * 512,
                1 => rng.gen_range(100..=140u64) * 512,
                2 => rng.gen_range(500..=520u64) * 512,
                _ => rng.gen_range(1100..=1200u64) * 512,
            };
            let offset = rng.gen_range(0..(SIZE - length) / 512) * 512;
            let data = pattern(rng.gen(), length as usize);
            // Requests are sent in one go, so later ones may be served first: keep only
            // writes that do not overlap an earlier one in this batch.
            let overlaps = cookies
                .values()
                .any(|&(start, end)| offset < end && start < offset + length);
            if overlaps {
                continue;
            }
            // Sent back to back; replies are read only after the last one.
            let cookie = client.send_request(CMD_WRITE, 0, offset, length, &data);
            cookies.insert(cookie, (offset, offset + length));
            model[offset as usize..(offset + length) as usize].copy_from_slice(&data);
        }
        for _ in 0..cookies.len() {
            let reply = client.read_completed();
            assert_eq!(reply.error, 0);
            assert!(cookies.remove(&reply.cookie).is_some());
        }
        for start in (0..SIZE).step_by(MIB as usize) {
            let data = client.read(start, MIB);
            assert!(
                data == model[start as usize..(start + MIB) as usize],
                "data differs in the MiB at {start} ({mode:?})"
            );
        }
        client.disconnect();
    }
}
