//! libblkio's virtio-blk-vhost-user driver against the backend serving a real thin volume
//! (a memory pool): every request type, on two queues at once, many requests in flight,
//! compared with a byte model; then read-only and geometry.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::{Client, Model, Op, Rng, SLOT, SLOTS};
use thin_pool::testing::{deterministic_options, dir_pool, memory_pool};
use thinpool_frontend::VolumeTarget;
use thinpool_vhost::VhostBlkServer;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 32 * MIB;
/// Each request of a round gets its own region, so requests in flight never overlap.
const REGION: u64 = 2 * MIB;

fn socket(name: &str) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("vhost-blk-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    (dir.join("sock"), dir)
}

fn random_op(rng: &mut Rng, region: u64) -> Op {
    let base = region * REGION;
    let sectors = |rng: &mut Rng, max: u64| (1 + rng.below(max / 512)) * 512;
    match rng.below(10) {
        0..=2 => {
            let len = sectors(rng, SLOT as u64);
            let offset = base + rng.below((REGION - len) / 512 + 1) * 512;
            Op::Read {
                offset,
                len: len as usize,
            }
        }
        3..=6 => {
            let len = sectors(rng, SLOT as u64);
            let offset = base + rng.below((REGION - len) / 512 + 1) * 512;
            let seed = rng.next() as u8 | 1;
            let data = (0..len).map(|i| seed.wrapping_add(i as u8)).collect();
            Op::Write {
                offset,
                data,
                fua: rng.below(4) == 0,
            }
        }
        7 => {
            let len = sectors(rng, REGION);
            let offset = base + rng.below((REGION - len) / 512 + 1) * 512;
            Op::Zero {
                offset,
                len,
                unmap: rng.below(2) == 0,
            }
        }
        8 => {
            let len = sectors(rng, REGION);
            let offset = base + rng.below((REGION - len) / 512 + 1) * 512;
            Op::Discard { offset, len }
        }
        _ => Op::Flush,
    }
}

/// On a memory pool (reads through the worker's buffer).
#[test]
fn every_request_type_on_two_queues_at_once_matches_a_byte_model() {
    every_request_type_against_a_model(memory_pool(), "model");
}

/// On a pool on files: reads are lent, `preadv`ed straight into the client's memory.
#[test]
fn lent_reads_on_a_pool_on_files_match_the_byte_model() {
    let dir = std::env::temp_dir().join(format!("vhost-blk-pool-on-files-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let pool = dir_pool(&dir.join("pool"), 2 * SIZE, deterministic_options());
    assert!(pool.create_volume("probe", MIB).is_ok());
    assert!(pool.volume("probe").unwrap().can_lend());
    pool.delete_volume("probe").unwrap();
    every_request_type_against_a_model(pool, "files");
    std::fs::remove_dir_all(dir).unwrap();
}

fn every_request_type_against_a_model(pool: thin_pool::Pool, name: &str) {
    pool.create_volume("disk", SIZE).unwrap();
    let target = Arc::new(VolumeTarget::new(pool.volume("disk").unwrap()));
    let (path, dir) = socket(name);
    let server = VhostBlkServer::start(target, &path, 2).unwrap();
    let mut client = Client::connect(&path, 2).unwrap();
    assert_eq!(client.capacity(), SIZE);
    let mut model = Model(vec![0u8; SIZE as usize]);
    let mut rng = Rng(0x5eed_1234);
    let regions = SIZE / REGION;
    for round in 0..60 {
        // Up to 8 requests per queue, each in its own region.
        let mut order: Vec<u64> = (0..regions).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let count = 2 + rng.below(14) as usize;
        let ops: Vec<Op> = order[..count]
            .iter()
            .map(|&region| random_op(&mut rng, region))
            .collect();
        assert!(ops.len() <= SLOTS);
        let mut per_queue = [0usize; 2];
        for (slot, op) in ops.iter().enumerate() {
            client.submit(slot % 2, slot, op);
            per_queue[slot % 2] += 1;
        }
        for (queue, &count) in per_queue.iter().enumerate() {
            for (slot, ret) in client.wait(queue, count) {
                let op = &ops[slot];
                assert_eq!(ret, 0, "round {round}: {op:?} failed");
                if let Op::Read { offset, len } = op {
                    let got = client.slot_bytes(slot, *len);
                    assert!(
                        got == model.bytes(*offset, *len),
                        "round {round}: read at {offset} length {len} differs from the model"
                    );
                }
            }
        }
        ops.iter().for_each(|op| model.apply(op));
    }
    // The whole device, through the client and through the engine directly.
    for offset in (0..SIZE).step_by(SLOT) {
        let (ret, got) = client.run(0, &Op::Read { offset, len: SLOT });
        assert_eq!(ret, 0);
        assert!(got == model.bytes(offset, SLOT), "client read at {offset}");
    }
    assert_eq!(client.run(1, &Op::Flush).0, 0);
    drop(client);
    server.stop();
    let volume = pool.volume("disk").unwrap();
    let mut all = vec![0u8; SIZE as usize];
    volume.read(0, &mut all).unwrap();
    assert!(all == model.0, "the engine's bytes differ from the model");
    drop(volume);
    pool.close().unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_read_only_volume_is_offered_read_only_and_serves_reads() {
    let pool = memory_pool();
    pool.create_volume("disk", 4 * MIB).unwrap();
    let writable = pool.volume("disk").unwrap();
    writable.write(0, &[0x5a; 4096], true).unwrap();
    drop(writable);
    pool.snapshot("disk", "frozen", true).unwrap();
    let target = Arc::new(VolumeTarget::new(pool.volume("frozen").unwrap()));
    let (path, dir) = socket("ro");
    let server = VhostBlkServer::start(target, &path, 1).unwrap();
    // The device says it is read-only: libblkio refuses to open it read-write.
    let refused = Client::connect(&path, 1)
        .err()
        .expect("a read-write connection");
    assert_eq!(refused.errno().raw_os_error(), libc::EROFS, "{refused:?}");
    let mut client = Client::connect_with(&path, 1, true).unwrap();
    assert!(client.get_u64("capacity") == 4 * MIB);
    let (ret, got) = client.run(
        0,
        &Op::Read {
            offset: 0,
            len: 8192,
        },
    );
    assert_eq!(ret, 0);
    assert!(got[..4096].iter().all(|&b| b == 0x5a) && got[4096..].iter().all(|&b| b == 0));
    drop(client);
    server.stop();
    let mut back = vec![0u8; 4096];
    pool.volume("frozen").unwrap().read(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0x5a));
    pool.close().unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_served_volume_is_open_and_the_socket_is_private() {
    use std::os::unix::fs::PermissionsExt;
    let pool = memory_pool();
    pool.create_volume("disk", 4 * MIB).unwrap();
    let target = Arc::new(VolumeTarget::new(pool.volume("disk").unwrap()));
    let (path, dir) = socket("open");
    let server = VhostBlkServer::start(target, &path, 1).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "socket mode {mode:o}");
    let error = pool.delete_volume("disk").unwrap_err();
    assert_eq!(error.errno(), libc::EBUSY, "{error}");
    // Reconnects: a second front end after the first went away.
    for _ in 0..2 {
        let mut client = Client::connect(&path, 1).unwrap();
        assert_eq!(client.run(0, &Op::Flush).0, 0);
    }
    server.stop();
    assert!(!path.exists(), "the socket file is left after stop");
    pool.delete_volume("disk").unwrap();
    pool.close().unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}
