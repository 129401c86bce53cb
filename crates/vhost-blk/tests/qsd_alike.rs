//! The same libblkio client and the same request sequence against two vhost-user-blk
//! backends: thinpool's (a thin volume) and `qemu-storage-daemon --export
//! type=vhost-user-blk` of a plain file (the reference; `qemu-utils`). Every request type both
//! support (read, write with and without FUA, write-zeroes with and without unmap, discard,
//! flush), several in flight on two queues, must give the same result codes and the same
//! bytes as a byte model on both, and the devices must end byte-identical. Where the two
//! differ the difference is asserted and said here:
//!
//! - limits (libblkio's properties, from each device's config space): both take 512-byte
//!   requests and 126 segments; thinpool says `size_max` 1 MiB (so `max-transfer` 126 MiB),
//!   qsd sets neither (0: no limit); thinpool's discard alignment is the pool's block
//!   (64 KiB here) and its optimal I/O alignment 4 KiB, qsd's both a sector (a plain file has
//!   no blocks); thinpool's discard and write-zeroes segments go up to 1 GiB, qsd's up to the
//!   device's capacity;
//! - requests past or over the end: both fail them with the same code (asserted as part of
//!   the sequence).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Client, Model, Op, Rng, SLOT};
use thin_pool::testing::memory_pool;
use thinpool_frontend::VolumeTarget;
use thinpool_vhost::VhostBlkServer;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 16 * MIB;
/// Each request in flight gets its own region, so concurrent requests never overlap.
const REGION: u64 = MIB;

fn require_qsd() {
    let found = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|d| d.join("qemu-storage-daemon").is_file()))
        .unwrap_or(false);
    assert!(
        found,
        "qemu-storage-daemon is missing: apt-get install -y qemu-utils (scripts/test installs it)"
    );
}

/// qemu-storage-daemon serving `image` on `socket` (2 queues, discards passed down), stopped
/// by its PID when dropped.
struct Qsd(Child);

impl Qsd {
    fn start(image: &Path, socket: &Path) -> Qsd {
        let child = Command::new("qemu-storage-daemon")
            .arg("--blockdev")
            .arg(format!(
                "driver=file,node-name=f,filename={},discard=unmap",
                image.display()
            ))
            .arg("--export")
            .arg(format!(
                "type=vhost-user-blk,id=e,node-name=f,addr.type=unix,addr.path={},\
                 writable=on,num-queues=2",
                socket.display()
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("start qemu-storage-daemon");
        let mut qsd = Qsd(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !socket.exists() {
            assert!(
                qsd.0.try_wait().unwrap().is_none(),
                "qemu-storage-daemon exited"
            );
            assert!(
                Instant::now() < deadline,
                "qemu-storage-daemon never listened"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        qsd
    }
}

impl Drop for Qsd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn random_op(rng: &mut Rng, region: u64) -> Op {
    let base = region * REGION;
    let sectors = |rng: &mut Rng, max: u64| (1 + rng.below(max / 512)) * 512;
    let place = |rng: &mut Rng, len: u64| base + rng.below((REGION - len) / 512 + 1) * 512;
    match rng.below(10) {
        0..=2 => {
            let len = sectors(rng, SLOT as u64);
            Op::Read {
                offset: place(rng, len),
                len: len as usize,
            }
        }
        3..=5 => {
            let len = sectors(rng, SLOT as u64);
            let seed = rng.next() as u8 | 1;
            Op::Write {
                offset: place(rng, len),
                data: (0..len).map(|i| seed.wrapping_add(i as u8)).collect(),
                fua: rng.below(3) == 0,
            }
        }
        6 | 7 => {
            let len = sectors(rng, REGION);
            Op::Zero {
                offset: place(rng, len),
                len,
                unmap: rng.below(2) == 0,
            }
        }
        8 => {
            let len = sectors(rng, REGION);
            Op::Discard {
                offset: place(rng, len),
                len,
            }
        }
        _ => Op::Flush,
    }
}

/// Result codes of each request, and the bytes of each read, for one run of the sequence.
type Outcome = Vec<(i32, Vec<u8>)>;

/// Runs the seeded sequence on `socket`: rounds of up to 8 requests on two queues at once,
/// every read compared with the model; returns the outcome and the device's final bytes.
fn run_sequence(socket: &Path) -> (Outcome, Vec<u8>) {
    let mut client = Client::connect(socket, 2).unwrap();
    assert_eq!(client.capacity(), SIZE);
    let mut model = Model(vec![0u8; SIZE as usize]);
    let mut rng = Rng(0xa11c_e5ed);
    let mut outcome = Vec::new();
    for round in 0..40 {
        let count = 2 + rng.below(7) as usize;
        let mut regions: Vec<u64> = (0..SIZE / REGION).collect();
        for i in (1..regions.len()).rev() {
            regions.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let ops: Vec<Op> = regions[..count]
            .iter()
            .map(|&r| random_op(&mut rng, r))
            .collect();
        let mut per_queue = [0usize; 2];
        for (slot, op) in ops.iter().enumerate() {
            client.submit(slot % 2, slot, op);
            per_queue[slot % 2] += 1;
        }
        let mut results = vec![(i32::MIN, Vec::new()); count];
        for (queue, &n) in per_queue.iter().enumerate() {
            for (slot, ret) in client.wait(queue, n) {
                let bytes = match &ops[slot] {
                    Op::Read { offset, len } if ret == 0 => {
                        let got = client.slot_bytes(slot, *len);
                        assert!(got == model.bytes(*offset, *len), "round {round}: read");
                        got
                    }
                    _ => Vec::new(),
                };
                results[slot] = (ret, bytes);
            }
        }
        ops.iter().for_each(|op| model.apply(op));
        outcome.extend(results);
    }
    // Requests both must refuse: past the end, and reaching over the end.
    for op in [
        Op::Read {
            offset: SIZE,
            len: 4096,
        },
        Op::Read {
            offset: SIZE - 512,
            len: 4096,
        },
        Op::Write {
            offset: SIZE - 512,
            data: vec![1; 1024],
            fua: false,
        },
    ] {
        outcome.push(client.run(0, &op));
    }
    let mut bytes = Vec::with_capacity(SIZE as usize);
    for offset in (0..SIZE).step_by(SLOT) {
        let (ret, got) = client.run(1, &Op::Read { offset, len: SLOT });
        assert_eq!(ret, 0);
        bytes.extend(got);
    }
    assert!(bytes == model.0, "the device's bytes differ from the model");
    (outcome, bytes)
}

/// The limits a client sees, by libblkio property name.
fn limits(socket: &Path) -> Vec<(&'static str, i64)> {
    let client = Client::connect(socket, 1).unwrap();
    let mut out = Vec::new();
    for name in ["max-discard-len", "max-write-zeroes-len"] {
        out.push((name, client.get_u64(name) as i64));
    }
    for name in [
        "request-alignment",
        "optimal-io-alignment",
        "discard-alignment",
        "max-segments",
        "max-segment-len",
        "max-transfer",
    ] {
        out.push((name, i64::from(client.get_i32(name))));
    }
    out
}

fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vhost-qsd-alike-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn thinpool_and_qemu_storage_daemon_answer_the_same_requests_alike() {
    require_qsd();
    let dir = scratch();
    let image = dir.join("plain.img");
    std::fs::write(&image, vec![0u8; SIZE as usize]).unwrap();
    let qsd_socket = dir.join("qsd.sock");
    let qsd = Qsd::start(&image, &qsd_socket);
    let pool = memory_pool();
    pool.create_volume("disk", SIZE).unwrap();
    let target = Arc::new(VolumeTarget::new(pool.volume("disk").unwrap()));
    let thin_socket = dir.join("thin.sock");
    let server = VhostBlkServer::start(target, &thin_socket, 2).unwrap();

    let (thin, thin_bytes) = run_sequence(&thin_socket);
    let (reference, qsd_bytes) = run_sequence(&qsd_socket);
    assert_eq!(thin.len(), reference.len());
    for (i, (a, b)) in thin.iter().zip(&reference).enumerate() {
        assert_eq!(a.0, b.0, "request {i}: thinpool {} qsd {}", a.0, b.0);
        assert!(a.1 == b.1, "request {i}: the bytes read differ");
    }
    assert!(thin_bytes == qsd_bytes, "the devices ended different");
    let errors: Vec<i32> = thin[thin.len() - 3..].iter().map(|r| r.0).collect();
    assert!(
        errors.iter().all(|&r| r < 0),
        "requests past the end succeeded: {errors:?}"
    );
    // The file qsd served holds what the client wrote.
    assert!(std::fs::read(&image).unwrap() == qsd_bytes);

    let (ours, theirs) = (limits(&thin_socket), limits(&qsd_socket));
    eprintln!("limits thinpool {ours:?}\nlimits qsd      {theirs:?}");
    // Where they agree, and where they differ (as documented at the top).
    let expected = [
        ("max-discard-len", 1 << 30, SIZE as i64),
        ("max-write-zeroes-len", 1 << 30, SIZE as i64),
        ("request-alignment", 512, 512),
        ("optimal-io-alignment", 4096, 512),
        ("discard-alignment", 64 << 10, 512),
        ("max-segments", 126, 126),
        ("max-segment-len", 1 << 20, 0),
        ("max-transfer", 126 << 20, 0),
    ];
    for (((name, a), (_, b)), (expected_name, ours, qsd)) in ours.iter().zip(&theirs).zip(expected)
    {
        assert_eq!(*name, expected_name);
        assert_eq!((*a, *b), (ours, qsd), "{name}: thinpool, qsd");
    }
    drop(qsd);
    server.stop();
    pool.close().unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}
