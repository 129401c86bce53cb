//! Goal: a management operation never waits behind a write queued for data space (issue 9,
//! item 6; regression test for reproduction 9, where a snapshot of a volume with a write
//! queued in queue mode blocked for the whole no-space timeout, 60 s by default). The
//! queued write is failed with ENOSPC (what it gets at the timeout anyway; it has changed
//! nothing yet) so the snapshot or resize can pause the volume's writers; a delete of
//! another volume goes ahead while the write stays queued, and frees the space it waits for.
//! Method: a 16-block pool in queue mode with a no-space timeout of 10 minutes; one volume
//! fills it, a thread's write then queues; a snapshot (then a resize) of that volume must
//! return well before the timeout (a 60 s deadline detects the hang), and the queued write
//! must return ENOSPC. Then a queued write of one volume completes after a delete of
//! another frees blocks.

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
    let options = PoolOptions {
        commit_interval: None,
        error_if_no_space: false,
        no_space_timeout: Duration::from_secs(600),
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

#[test]
fn snapshot_and_resize_fail_a_write_queued_for_space_instead_of_waiting() {
    for operation in ["snapshot", "resize"] {
        let pool = Arc::new(queue_mode_pool());
        pool.create_volume("v", 64 * BLOCK).unwrap();
        let v = pool.volume("v").unwrap();
        for block in 0..DATA_BLOCKS {
            v.write(block * BLOCK, &vec![1u8; BLOCK as usize], false)
                .unwrap();
        }
        pool.commit().unwrap();
        let write = queued_write(&pool, "v", 40);
        let deadline = Instant::now() + HANG_DEADLINE;
        let manage = {
            let pool = pool.clone();
            std::thread::spawn(move || match operation {
                "snapshot" => pool.snapshot("v", "s", true).map(|_| ()),
                _ => pool.resize_volume("v", 128 * BLOCK).map(|_| ()),
            })
        };
        join_by(manage, deadline, operation).unwrap();
        assert_eq!(join_by(write, deadline, "the queued write"), ENOSPC);
        // Nothing was lost, and the queued write left no trace.
        let mut buf = vec![0u8; BLOCK as usize];
        v.read(0, &mut buf).unwrap();
        assert!(buf.iter().all(|b| *b == 1), "{operation}");
        v.read(40 * BLOCK, &mut buf).unwrap();
        assert!(buf.iter().all(|b| *b == 0), "{operation}");
        pool.verify_index().unwrap();
    }
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
