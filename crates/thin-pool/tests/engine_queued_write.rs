//! Goal: a management operation never waits behind a write queued for data space (issue 9,
//! item 6; regression test for reproduction 9, where a snapshot of a volume with a write
//! queued in queue mode blocked for the whole no-space timeout), and never fails that write
//! either (issue 20, finding 10: the write used to get ENOSPC as soon as a snapshot or
//! resize of its volume paused it, even with `no_space_timeout` 0, "queue forever"). The
//! queued write sits the pause out and lands after the operation, as any later write: a
//! snapshot taken meanwhile keeps the old data, and the write breaks the sharing. Its
//! no-space deadline still counts from its first wait.
//! Method: a 16-block pool in queue mode, filled by three volumes; a thread's write to a
//! block of `v` that a snapshot shares then queues. A snapshot or a grow of `v` or of
//! another volume must return while it waits (a 60 s deadline detects a hang), the write
//! must still be waiting afterwards, and complete once a delete frees space; then every
//! volume reads as its model says. With a finite timeout, snapshots one after the other
//! do not keep the write waiting past it.

use std::sync::Arc;
use std::time::{Duration, Instant};
use thin_pool::testing::MemoryParts;
use thin_pool::{Pool, PoolOptions};

const BLOCK: u64 = 65536;
const DATA_BLOCKS: u64 = 16;
const ENOSPC: i32 = 28;
/// Far beyond the no-space timeout of the old code path, far below the pool's timeout.
const HANG_DEADLINE: Duration = Duration::from_secs(60);

fn queue_mode_pool() -> Pool {
    queue_mode_pool_with(Duration::from_secs(600))
}

/// A pool whose writes wait `no_space_timeout` for space (zero: forever).
fn queue_mode_pool_with(no_space_timeout: Duration) -> Pool {
    let options = PoolOptions {
        commit_interval: None,
        error_if_no_space: false,
        no_space_timeout,
        ..PoolOptions::default()
    };
    MemoryParts::new(1024, DATA_BLOCKS * BLOCK).format(BLOCK, options)
}

/// Wait for `thread`, failing the test at the deadline instead of hanging.
fn join_by<T>(thread: std::thread::JoinHandle<T>, deadline: Instant, what: &str) -> T {
    while !thread.is_finished() {
        assert!(Instant::now() < deadline, "{what} hangs");
        std::thread::sleep(Duration::from_millis(10));
    }
    thread.join().unwrap()
}

/// Start a write of block `block` of `name` that queues for space; returns once it is
/// queued (the pool reports out of data space).
fn queued_write(pool: &Arc<Pool>, name: &str, block: u64) -> std::thread::JoinHandle<i32> {
    let volume = pool.volume(name).unwrap();
    let thread = std::thread::spawn(move || {
        volume
            .write(block * BLOCK, &vec![7u8; BLOCK as usize], false)
            .map_or_else(|e| e.errno(), |()| 0)
    });
    let deadline = Instant::now() + HANG_DEADLINE;
    while pool.mode() != thin_pool::PoolMode::OutOfDataSpace {
        assert!(Instant::now() < deadline, "the write never queued");
        assert!(!thread.is_finished(), "the write did not queue");
        std::thread::sleep(Duration::from_millis(5));
    }
    thread
}

fn block_of(value: u8) -> Vec<u8> {
    vec![value; BLOCK as usize]
}

fn read_block(pool: &Pool, name: &str, block: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK as usize];
    pool.volume(name)
        .unwrap()
        .read(block * BLOCK, &mut buf)
        .unwrap();
    buf
}

/// A full pool: `v` maps blocks 0..6 (1s), `other` 0..5 (2s), `spare` 0..5 (3s); `old`, a
/// snapshot of `v`, shares v's blocks.
fn full_pool(no_space_timeout: Duration) -> Arc<Pool> {
    let pool = Arc::new(queue_mode_pool_with(no_space_timeout));
    for (name, value, blocks) in [("v", 1, 6), ("other", 2, 5), ("spare", 3, 5)] {
        pool.create_volume(name, 64 * BLOCK).unwrap();
        let volume = pool.volume(name).unwrap();
        for block in 0..blocks {
            volume
                .write(block * BLOCK, &block_of(value), false)
                .unwrap();
        }
    }
    assert_eq!(pool.status().data_used_blocks, DATA_BLOCKS);
    pool.snapshot("v", "old", true).unwrap();
    pool.commit().unwrap();
    pool
}

#[test]
fn a_write_queued_for_space_survives_a_snapshot_or_resize_of_any_volume() {
    for (operation, target) in [
        ("snapshot", "v"),
        ("resize", "v"),
        ("snapshot", "other"),
        ("resize", "other"),
    ] {
        let case = format!("{operation} of {target}");
        let pool = full_pool(Duration::ZERO);
        // Block 3 is shared with `old`: the write needs a new block, and queues.
        let write = queued_write(&pool, "v", 3);
        let deadline = Instant::now() + HANG_DEADLINE;
        let manage = {
            let pool = pool.clone();
            std::thread::spawn(move || match operation {
                "snapshot" => pool.snapshot(target, "taken", true).map(|_| ()),
                _ => pool
                    .resize_volume(target, 128 * BLOCK, thin_pool::Shrink::KeepData)
                    .map(|_| ()),
            })
        };
        join_by(manage, deadline, &case).unwrap();
        assert!(!write.is_finished(), "{case}: the queued write gave up");
        // Space comes: the write completes, after the operation.
        pool.delete_volume("spare").unwrap();
        assert_eq!(join_by(write, deadline, "the queued write"), 0, "{case}");
        assert_eq!(
            read_block(&pool, "v", 3),
            vec![7u8; BLOCK as usize],
            "{case}"
        );
        assert_eq!(
            read_block(&pool, "old", 3),
            block_of(1),
            "{case}: sharing broken"
        );
        if (operation, target) == ("snapshot", "v") {
            // The snapshot is v as it was before the queued write landed.
            assert_eq!(read_block(&pool, "taken", 3), block_of(1), "{case}");
        }
        for block in (0..6).filter(|b| *b != 3) {
            assert_eq!(read_block(&pool, "v", block), block_of(1), "{case}");
        }
        assert_eq!(read_block(&pool, "other", 4), block_of(2), "{case}");
        let size = if operation == "resize" { 128 } else { 64 };
        assert_eq!(
            pool.info(target).unwrap().size_bytes,
            size * BLOCK,
            "{case}"
        );
        pool.commit().unwrap();
        pool.verify_index().unwrap();
    }
}

#[test]
fn a_queued_write_keeps_its_deadline_across_pauses() {
    let pool = full_pool(Duration::from_secs(4));
    let write = queued_write(&pool, "v", 3);
    let deadline = Instant::now() + HANG_DEADLINE;
    let mut snapshots = 0;
    while !write.is_finished() {
        assert!(
            Instant::now() < deadline,
            "the write waits past its no-space timeout: each pause restarted it"
        );
        pool.snapshot("v", &format!("s{snapshots}"), true).unwrap();
        snapshots += 1;
        if snapshots == 1 {
            assert!(
                !write.is_finished(),
                "the queued write gave up at the first pause"
            );
        }
    }
    assert_eq!(join_by(write, deadline, "the queued write"), ENOSPC);
    assert!(snapshots >= 1);
    // It changed nothing.
    assert_eq!(read_block(&pool, "v", 3), block_of(1));
    pool.commit().unwrap();
    pool.verify_index().unwrap();
}

#[test]
fn delete_of_another_volume_proceeds_and_frees_space_for_a_queued_write() {
    let pool = Arc::new(queue_mode_pool());
    pool.create_volume("keep", 64 * BLOCK).unwrap();
    pool.create_volume("drop", 64 * BLOCK).unwrap();
    let (keep, other) = (pool.volume("keep").unwrap(), pool.volume("drop").unwrap());
    for block in 0..DATA_BLOCKS / 2 {
        keep.write(block * BLOCK, &vec![1u8; BLOCK as usize], false)
            .unwrap();
        other
            .write(block * BLOCK, &vec![2u8; BLOCK as usize], false)
            .unwrap();
    }
    drop(other);
    pool.commit().unwrap();
    let write = queued_write(&pool, "keep", 40);
    let deadline = Instant::now() + HANG_DEADLINE;
    let delete = {
        let pool = pool.clone();
        std::thread::spawn(move || pool.delete_volume("drop"))
    };
    join_by(delete, deadline, "the delete").unwrap();
    assert_eq!(join_by(write, deadline, "the queued write"), 0);
    let mut buf = vec![0u8; BLOCK as usize];
    keep.read(40 * BLOCK, &mut buf).unwrap();
    assert!(buf.iter().all(|b| *b == 7));
    pool.verify_index().unwrap();
}
