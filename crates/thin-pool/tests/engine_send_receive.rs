//! Goal: `stream::send` / `stream::receive` copy a read-only snapshot to another pool
//! exactly (bytes, holes), full or incremental, whatever the two block sizes, and an
//! incremental shares every block it does not change with its base.
//! Method: seeded random writes and discards on a volume mirrored in a byte model
//! (`engine_send_receive_kit`); snapshots sent full, then as increments, to pools of
//! smaller, equal and larger block sizes; each received volume compared with the model
//! byte for byte, its mapped blocks with the ones the model's mapped blocks overlap, and
//! (same block size) the receiver's diff of two received snapshots with the sender's.
//! Then a chain of 20 increments, and a send while another thread writes the origin.

mod engine_send_receive_kit;

use engine_send_receive_kit::{mapped, pool, read_all, receive, send, Model, SIZE};
use rand::Rng;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

const SENDER_BLOCK: u64 = 128 << 10;

/// Sender at 128 KiB; receivers at 64 KiB, 128 KiB and 512 KiB.
#[test]
fn full_and_incremental_between_block_sizes() {
    let (_report, mut rng) = testkit::seeded_rng();
    let (_sp, sender) = pool(SENDER_BLOCK, 64);
    sender.create_volume("vm", SIZE).unwrap();
    let mut model = Model::new(SIZE, SENDER_BLOCK);
    model.mutate(&sender, "vm", &mut rng, 60);
    sender.snapshot("vm", "s1", true).unwrap();
    let s1 = model.clone();
    model.mutate(&sender, "vm", &mut rng, 8);
    sender.snapshot("vm", "s2", true).unwrap();
    let full = send(&sender, "s1", None);
    let increment = send(&sender, "s2", Some("s1"));
    assert!(
        increment.len() < full.len(),
        "an increment carries only the changes"
    );
    for block in [64 << 10, SENDER_BLOCK, 512 << 10] {
        let (_rp, receiver) = pool(block, 64);
        let info = receive(&receiver, "r1", &full).unwrap();
        assert!(info.read_only && info.origin.is_none(), "{info:?}");
        assert!(
            read_all(&receiver, "r1") == s1.bytes,
            "block {block}: full stream bytes"
        );
        assert_eq!(
            mapped(&receiver, "r1"),
            s1.expected_mapped(block),
            "block {block}"
        );
        let info = receive(&receiver, "r2", &increment).unwrap();
        assert_eq!(
            info.origin.as_deref(),
            Some("r1"),
            "the increment snapshots its base"
        );
        let got = read_all(&receiver, "r2");
        let first = got.iter().zip(&model.bytes).position(|(a, b)| a != b);
        assert!(
            first.is_none(),
            "block {block}: increment bytes differ from {first:?}"
        );
        assert_eq!(
            mapped(&receiver, "r2"),
            model.expected_mapped(block),
            "block {block}"
        );
        if block == SENDER_BLOCK {
            let here = receiver.diff("r1", "r2", None).unwrap().ranges;
            let there = sender.diff("s1", "s2", None).unwrap().ranges;
            assert_eq!(here, there, "the increment shares every unchanged block");
        }
        receiver.verify_index().unwrap();
        // Reopened, the volumes are there with the same content.
        drop(receiver);
        let receiver = _rp.reopen(thin_pool::testing::deterministic_options());
        assert!(read_all(&receiver, "r2") == model.bytes);
    }
}

/// 20 increments in a row, each applied on the one before.
#[test]
fn chain_of_twenty_increments() {
    let (_report, mut rng) = testkit::seeded_rng();
    let (_sp, sender) = pool(SENDER_BLOCK, 96);
    let (_rp, receiver) = pool(SENDER_BLOCK, 96);
    sender.create_volume("vm", SIZE).unwrap();
    let mut model = Model::new(SIZE, SENDER_BLOCK);
    model.mutate(&sender, "vm", &mut rng, 30);
    sender.snapshot("vm", "s0", true).unwrap();
    receive(&receiver, "s0", &send(&sender, "s0", None)).unwrap();
    for i in 1..=20 {
        let steps = rng.gen_range(1..12);
        model.mutate(&sender, "vm", &mut rng, steps);
        let (base, snap) = (format!("s{}", i - 1), format!("s{i}"));
        sender.snapshot("vm", &snap, true).unwrap();
        receive(&receiver, &snap, &send(&sender, &snap, Some(&base))).unwrap();
        assert!(read_all(&receiver, &snap) == model.bytes, "increment {i}");
        assert_eq!(
            receiver.diff(&base, &snap, None).unwrap().ranges,
            sender.diff(&base, &snap, None).unwrap().ranges,
            "increment {i} shares what it did not change"
        );
        if i >= 2 {
            // Keep the last two snapshots on both sides, as replication does.
            let old = format!("s{}", i - 2);
            sender.delete_volume(&old).unwrap();
            receiver.delete_volume(&old).unwrap();
        }
    }
    assert_eq!(receiver.list().len(), 2);
    receiver.verify_index().unwrap();
}

/// The stream is the snapshot, however much the origin is written during the send.
#[test]
fn send_while_writers_write_the_origin() {
    let (_report, mut rng) = testkit::seeded_rng();
    let (_sp, sender) = pool(SENDER_BLOCK, 64);
    let (_rp, receiver) = pool(64 << 10, 64);
    sender.create_volume("vm", SIZE).unwrap();
    let mut model = Model::new(SIZE, SENDER_BLOCK);
    model.mutate(&sender, "vm", &mut rng, 80);
    sender.snapshot("vm", "s1", true).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (pool, stop) = (sender.clone(), stop.clone());
        std::thread::spawn(move || {
            let volume = pool.volume("vm").unwrap();
            let mut writes = 0u64;
            while !stop.load(Ordering::Relaxed) || writes < 200 {
                let offset = (writes * 7919 * 4096) % (SIZE - 65536);
                volume
                    .write(offset, &[0xEE; 65536], writes.is_multiple_of(16))
                    .unwrap();
                writes += 1;
            }
            writes
        })
    };
    let stream = send(&sender, "s1", None);
    stop.store(true, Ordering::Relaxed);
    let writes = writer.join().unwrap();
    assert!(writes >= 200);
    receive(&receiver, "s1", &stream).unwrap();
    assert!(
        read_all(&receiver, "s1") == model.bytes,
        "the stream is the snapshot"
    );
    assert!(
        read_all(&sender, "vm") != model.bytes,
        "the origin was written meanwhile"
    );
}

/// Writable volumes have no content identity: sending one is refused.
#[test]
fn a_writable_volume_is_not_sent() {
    let (_sp, sender) = pool(SENDER_BLOCK, 16);
    sender.create_volume("vm", SIZE).unwrap();
    let error = thin_pool::stream::send(&sender, "vm", None, Vec::new(), &mut |_| {}).unwrap_err();
    assert!(error.to_string().contains("read-only"), "{error}");
}
