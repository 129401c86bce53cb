//! Goal: requests not aligned to 512 bytes are served when the client did not negotiate
//! block sizes (issue 20, finding 14: they got EINVAL, though the protocol says the server
//! SHOULD serve them, as nbdkit and qemu-nbd do), with the bytes around a sub-sector write
//! kept, also under concurrent overlapping writes; a client that did negotiate block sizes
//! keeps the strict checks.
//!
//! Method: testkit's raw client; `Client::open` sends NBD_OPT_GO without asking for
//! NBD_INFO_BLOCK_SIZE, `Client::negotiate` asks for it. A seeded random mix of READ,
//! WRITE, TRIM and WRITE_ZEROES at byte offsets runs against a byte model (a TRIM leaves its
//! range undefined in the model; the bytes around it must stay). Concurrent clients write
//! disjoint bytes inside shared sectors; every byte must be its writer's last value.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use nbd::{Config, Export, ExportMap, MemoryExport};
use rand::{Rng, SeedableRng};

const SIZE: u64 = 256 * 1024;
const EINVAL: u32 = 22;

/// A memory export whose reads take 200 µs more after reading.
struct SlowReads(MemoryExport);

impl Export for SlowReads {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn size_bytes(&self) -> u64 {
        self.0.size_bytes()
    }
    fn read_at(&self, offset: u64, buffer: &mut [u8]) -> nbd::Result<()> {
        self.0.read_at(offset, buffer)?;
        std::thread::sleep(Duration::from_micros(200));
        Ok(())
    }
    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> nbd::Result<()> {
        self.0.write_at(offset, data, fua)
    }
    fn flush(&self) -> nbd::Result<()> {
        self.0.flush()
    }
}

fn slow_reads() -> Arc<ExportMap> {
    let map = Arc::new(ExportMap::new());
    map.insert(Arc::new(SlowReads(MemoryExport::new("disk", SIZE))));
    map
}

fn server() -> TestServer {
    TestServer::start(vec![Arc::new(MemoryExport::new("disk", SIZE))])
}

/// The bytes of the export as far as the model knows them: `None` where a TRIM left them
/// undefined.
struct Model(Vec<Option<u8>>);

impl Model {
    fn check(&self, offset: u64, data: &[u8], what: &str) {
        for (index, byte) in data.iter().enumerate() {
            if let Some(expected) = self.0[offset as usize + index] {
                assert_eq!(*byte, expected, "{what}: byte {}", offset as usize + index);
            }
        }
    }

    fn set(&mut self, offset: u64, data: &[u8]) {
        for (index, byte) in data.iter().enumerate() {
            self.0[offset as usize + index] = Some(*byte);
        }
    }
}

#[test]
fn unaligned_requests_match_a_byte_model_without_block_size_negotiation() {
    let report = seed_report();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(report.seed());
    let server = server();
    let mut client = Client::open(&server.socket, "disk");
    let mut model = Model(vec![Some(0); SIZE as usize]);
    for step in 0..600u64 {
        let offset = rng.gen_range(0..SIZE - 1);
        let length = rng.gen_range(1..=(SIZE - offset).min(3000));
        let what = format!(
            "step {step} (seed {}): offset {offset} length {length}",
            report.seed()
        );
        match rng.gen_range(0..4) {
            0 => {
                let data = client.read(offset, length);
                model.check(offset, &data, &what);
            }
            1 => {
                let data = pattern(step, length as usize);
                client.write(offset, &data);
                model.set(offset, &data);
            }
            2 => {
                let reply = client.request(CMD_TRIM, 0, offset, length, &[]);
                assert_eq!(reply.error, 0, "trim, {what}");
                for byte in &mut model.0[offset as usize..(offset + length) as usize] {
                    *byte = None;
                }
            }
            _ => {
                let reply = client.request(CMD_WRITE_ZEROES, 0, offset, length, &[]);
                assert_eq!(reply.error, 0, "write zeroes, {what}");
                model.set(offset, &vec![0u8; length as usize]);
            }
        }
    }
    let all = client.read(0, SIZE);
    model.check(0, &all, "final read");
    client.disconnect();
}

#[test]
fn clients_that_negotiated_block_sizes_keep_the_strict_checks() {
    let server = server();
    let (mut strict, _, _, _) = Client::negotiate(&server.socket, "disk", Mode::Simple, false);
    assert_eq!(strict.write_errno(1, &[1u8; 100]), EINVAL);
    assert_eq!(strict.request(CMD_READ, 0, 0, 100, &[]).error, EINVAL);
    assert_eq!(strict.request(CMD_TRIM, 0, 512, 100, &[]).error, EINVAL);
    // The same requests from a client that did not negotiate are served.
    let mut lenient = Client::open(&server.socket, "disk");
    lenient.write(1, &[1u8; 100]);
    assert_eq!(
        lenient.read(0, 102),
        [&[0u8][..], &[1u8; 100], &[0u8]].concat()
    );
    strict.disconnect();
    lenient.disconnect();
}

/// Eight clients, each on its own connection, write their own 37-byte pieces into the same
/// four sectors, 30 times each (each round pipelined), all at once; after each round its
/// pieces hold its value, and at the end every piece holds its writer's last value.
/// The export's reads take a while, which widens the window in which an unlocked
/// read-modify-write would write back a neighbour's stale bytes (it then fails at once).
#[test]
fn concurrent_unaligned_writes_into_shared_sectors_keep_every_writer_s_bytes() {
    const WRITERS: u64 = 8;
    const PIECE: u64 = 37;
    const ROUNDS: u64 = 30;
    let server = TestServer::start_registry(slow_reads(), Config::default());
    std::thread::scope(|scope| {
        for writer in 0..WRITERS {
            let socket = server.socket.clone();
            scope.spawn(move || {
                let mut client = Client::open(&socket, "disk");
                for round in 0..ROUNDS {
                    // Pieces interleave: writer w owns pieces w, w + 8, ... of the first 2 KiB.
                    // A round's writes are pipelined, so the server may run them at once.
                    let pieces: Vec<u64> =
                        (writer..2048 / PIECE).step_by(WRITERS as usize).collect();
                    for piece in &pieces {
                        let value = (writer * ROUNDS + round) as u8;
                        client.send_request(
                            CMD_WRITE,
                            0,
                            piece * PIECE,
                            PIECE,
                            &[value; PIECE as usize],
                        );
                    }
                    for _ in &pieces {
                        assert_eq!(client.read_completed().error, 0);
                    }
                    // Only this writer writes its pieces: they hold its value now.
                    let data = client.read(0, 2048);
                    let value = (writer * ROUNDS + round) as u8;
                    for piece in &pieces {
                        let range = (piece * PIECE) as usize..((piece + 1) * PIECE) as usize;
                        assert!(
                            data[range].iter().all(|&byte| byte == value),
                            "writer {writer} round {round}: piece {piece} lost its bytes"
                        );
                    }
                }
                client.disconnect();
            });
        }
    });
    let mut client = Client::open(&server.socket, "disk");
    let data = client.read(0, 2048);
    for piece in 0..2048 / PIECE {
        let writer = piece % WRITERS;
        let last = (writer * ROUNDS + ROUNDS - 1) as u8;
        let range = (piece * PIECE) as usize..((piece + 1) * PIECE) as usize;
        assert!(
            data[range.clone()].iter().all(|&byte| byte == last),
            "piece {piece} (writer {writer}): {:?}",
            &data[range]
        );
    }
    client.disconnect();
}

/// An aligned writer (which negotiated block sizes) rewrites a whole sector while an
/// unaligned writer changes ten bytes inside it, both at once, 300 times: the sector is
/// always the aligned write's value outside those ten bytes, never older bytes written back
/// by the read-modify-write (the export's slow reads widen the window).
#[test]
fn read_modify_write_never_writes_back_over_a_concurrent_aligned_write() {
    let server = TestServer::start_registry(slow_reads(), Config::default());
    let (mut aligned, _, _, _) = Client::negotiate(&server.socket, "disk", Mode::Simple, false);
    let mut unaligned = Client::open(&server.socket, "disk");
    for round in 1..=300u64 {
        let value = round as u8;
        let unaligned_cookie = unaligned.send_request(CMD_WRITE, 0, 4196, 10, &[0xee; 10]);
        let aligned_cookie = aligned.send_request(CMD_WRITE, 0, 4096, 512, &[value; 512]);
        assert_eq!(aligned.read_completed().cookie, aligned_cookie);
        let reply = unaligned.read_completed();
        assert_eq!((reply.cookie, reply.error), (unaligned_cookie, 0));
        let sector = aligned.read(4096, 512);
        for (index, byte) in sector.iter().enumerate() {
            if !(100..110).contains(&index) {
                assert_eq!(*byte, value, "round {round}: byte {index} of the sector");
            }
        }
    }
    aligned.disconnect();
    unaligned.disconnect();
}
