//! Goal: a panic inside the engine fails safe (issue 9, item 5; regression test for
//! reproduction 7, where a panic part-way through applying the queued ops left the trees
//! half-updated and the next commit made that durable). After the panic: the call that hit
//! it returns an error instead of unwinding into the caller; the pool is in fail mode with
//! the reason in its status and its events; reads, writes, flushes and management
//! operations of every thread get an answer (an error, EIO for I/O); nothing more is written
//! to the metadata, so the device holds exactly the last committed transaction, which our
//! checker and both thin_check versions accept and which reopens read-write.
//! Method: the engine's test-only fault hook (`PoolOptions::fault_hook`) panics at a chosen
//! point: between two applied ops of a commit, just before the metadata commit, inside
//! a management operation's change, and in a provisioning write holding the metadata lock
//! (a poisoned lock). Each run commits a known state, queues more writes,
//! arms the hook, triggers it, checks the failed pool, then reopens the metadata device and
//! compares every block with the committed state.

mod engine_kit;

use engine_kit::check_metadata;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use testkit::scratch::ScratchDir;
use testkit::tools::ThinTools;
use thin_pool::testing::{deterministic_options, MemoryParts};
use thin_pool::{FaultHook, FaultPoint};
use thin_pool::{PoolMode, PoolOptions};

const BLOCK: u64 = 65536;
const EIO: i32 = 5;

/// Where the hook panics.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Trigger {
    /// Before the 4th queued op of a commit is applied.
    ApplyOp,
    /// After the ops are applied, before the metadata commit.
    Commit,
    /// Inside a management operation's change to the metadata (a snapshot).
    Management,
    /// In a provisioning write holding the metadata lock, between queueing its mapping and
    /// publishing it: the panic reaches the writer, the lock is poisoned, and the next
    /// thread to take it must fail the pool.
    Map,
}

fn block_bytes(volume: u8, block: u64, generation: u8) -> Vec<u8> {
    let mut bytes = vec![generation; BLOCK as usize];
    bytes[0] = volume;
    bytes[1..9].copy_from_slice(&block.to_le_bytes());
    bytes
}

fn run(trigger: Trigger, scratch: &ScratchDir) {
    let armed = Arc::new(AtomicBool::new(false));
    let hook = {
        let armed = armed.clone();
        FaultHook::new(move |point| {
            let hit = match (trigger, point) {
                (Trigger::ApplyOp, FaultPoint::ApplyOp { applied }) => applied == 3,
                (Trigger::Commit, FaultPoint::Commit) => true,
                (Trigger::Management, FaultPoint::ManagementChange) => true,
                (Trigger::Map, FaultPoint::Map) => true,
                _ => false,
            };
            if hit && armed.swap(false, Ordering::SeqCst) {
                panic!("injected panic at {point:?}");
            }
        })
    };
    let options = PoolOptions {
        fault_hook: Some(hook),
        ..deterministic_options()
    };
    let parts = MemoryParts::default();
    let pool = parts.format(BLOCK, options);
    pool.create_volume("a", 32 * BLOCK).unwrap();
    pool.create_volume("b", 32 * BLOCK).unwrap();
    let a = pool.volume("a").unwrap();
    let b = pool.volume("b").unwrap();
    // The committed state: a 0..4 and b 0..2 at generation 1.
    for block in 0..4 {
        a.write(block * BLOCK, &block_bytes(1, block, 1), false)
            .unwrap();
    }
    for block in 0..2 {
        b.write(block * BLOCK, &block_bytes(2, block, 1), false)
            .unwrap();
    }
    pool.commit().unwrap();
    let committed_transaction = pool.status().transaction_id;

    // Queued, never committed: new blocks of a, an overwrite of a shared-free block of b
    // (in place), new blocks of b.
    for block in 4..12 {
        a.write(block * BLOCK, &block_bytes(1, block, 2), false)
            .unwrap();
    }
    for block in 2..6 {
        b.write(block * BLOCK, &block_bytes(2, block, 2), false)
            .unwrap();
    }
    armed.store(true, Ordering::SeqCst);
    let error = match trigger {
        Trigger::ApplyOp | Trigger::Commit => a.flush().unwrap_err(),
        Trigger::Management => pool.snapshot("a", "s", false).unwrap_err(),
        Trigger::Map => {
            let write = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                a.write(13 * BLOCK, &block_bytes(1, 13, 2), false)
            }));
            assert!(write.is_err(), "the provisioning write panics");
            b.flush().unwrap_err()
        }
    };
    assert!(!armed.load(Ordering::SeqCst), "{trigger:?}: the hook fired");
    assert_eq!(error.errno(), EIO, "{trigger:?}: {error}");

    // Fail mode, with the reason.
    let status = pool.status();
    assert_eq!(status.mode, PoolMode::Fail, "{trigger:?}");
    let reason = status.fail_reason.clone().expect("a fail reason");
    assert!(reason.contains("panic"), "{trigger:?}: {reason}");
    let logged = match trigger {
        Trigger::Map => "panicked holding the metadata lock",
        _ => "injected panic",
    };
    assert!(
        pool.events().iter().any(|e| e.contains(logged)),
        "{trigger:?}: {:?}",
        pool.events()
    );
    // Every caller gets an answer, on this thread and others.
    let deadline = Instant::now() + Duration::from_secs(30);
    let answers: Vec<_> = (0..4)
        .map(|i| {
            let volume = if i % 2 == 0 { a.clone() } else { b.clone() };
            std::thread::spawn(move || {
                let mut buf = vec![0u8; BLOCK as usize];
                let read = volume.read(0, &mut buf).map_err(|e| e.errno());
                let write = volume
                    .write(20 * BLOCK, &block_bytes(9, 20, 9), false)
                    .map_err(|e| e.errno());
                let flush = volume.flush().map_err(|e| e.errno());
                (read, write, flush)
            })
        })
        .collect();
    for answer in answers {
        while !answer.is_finished() {
            assert!(Instant::now() < deadline, "{trigger:?}: a caller hangs");
            std::thread::sleep(Duration::from_millis(10));
        }
        let (read, write, flush) = answer.join().expect("no panic reaches the caller");
        assert_eq!(read, Err(EIO), "{trigger:?}");
        assert_eq!(write, Err(EIO), "{trigger:?}");
        assert_eq!(flush, Err(EIO), "{trigger:?}");
    }
    assert!(pool.commit().is_err(), "{trigger:?}");
    assert!(pool.create_volume("c", BLOCK).is_err(), "{trigger:?}");
    assert!(pool.delete_volume("b").is_err(), "{trigger:?}");
    drop((a, b));
    drop(pool);

    // On disk: exactly the last commit, valid for every checker.
    let tools = ThinTools::all();
    let image = scratch.join(format!("{trigger:?}.metadata"));
    check_metadata(parts.metadata.clone(), Some((&tools, &image)))
        .unwrap_or_else(|e| panic!("{trigger:?}: {e}"));
    let pool = parts.reopen(deterministic_options());
    assert_eq!(pool.mode(), PoolMode::Write, "{trigger:?}");
    assert_eq!(pool.status().transaction_id, committed_transaction);
    let names: Vec<String> = pool.list().into_iter().map(|v| v.name).collect();
    assert_eq!(names, ["a", "b"], "{trigger:?}");
    for (name, tag, committed) in [("a", 1u8, 4u64), ("b", 2, 2)] {
        let volume = pool.volume(name).unwrap();
        assert_eq!(pool.info(name).unwrap().mapped_blocks, committed);
        for block in 0..32 {
            let mut buf = vec![0u8; BLOCK as usize];
            volume.read(block * BLOCK, &mut buf).unwrap();
            if block < committed {
                assert!(
                    buf == block_bytes(tag, block, 1),
                    "{trigger:?}: {name} block {block} lost its committed data"
                );
            } else {
                assert!(
                    buf.iter().all(|x| *x == 0),
                    "{trigger:?}: {name} block {block} was never committed"
                );
            }
        }
    }
    pool.verify_index().unwrap();
    // And it works again.
    let a = pool.volume("a").unwrap();
    a.write(30 * BLOCK, &block_bytes(1, 30, 3), true).unwrap();
    pool.snapshot("a", "s", false).unwrap();
}

#[test]
fn panic_between_applied_ops_commits_nothing() {
    run(Trigger::ApplyOp, &ScratchDir::new("engine-panic-apply"));
}

#[test]
fn panic_before_metadata_commit_commits_nothing() {
    run(Trigger::Commit, &ScratchDir::new("engine-panic-commit"));
}

#[test]
fn panic_holding_the_metadata_lock_fails_the_pool() {
    run(Trigger::Map, &ScratchDir::new("engine-panic-map"));
}

#[test]
fn panic_in_a_management_change_commits_nothing() {
    run(Trigger::Management, &ScratchDir::new("engine-panic-manage"));
}
