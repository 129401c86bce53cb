//! Goal: `Pool::diff_bound`, what the NBD context `x-thinpool:diff:BASE` asks, (1) answers
//! a prefix of the blocks asked for when it hits its node budget, and the prefixes asked
//! for in turn add up to exactly `Pool::diff`; (2) fails with `VolumeChanged` once either
//! volume is not the generation it was bound by: after a revert, a delete and re-create
//! under the same thin id, or a rename, never after writes, resizes or snapshots of it;
//! (3) walks without the commit lock: a commit completes while a walk is stopped in the
//! middle, and a walk that two commits overtook is done again, with the right answer.
//!
//! Method: in-memory pools; the engine's test-only fault hook stops the walk at
//! `FaultPoint::DiffWalk` (roots read, trees not walked yet) until the test releases it.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use thin_pool::testing::MemoryParts;
use thin_pool::{DiffRange, FaultHook, FaultPoint, Pool, PoolOptions, Shrink, VirtualBlock};

const BLOCK: u64 = 65536;

/// How long a commit may wait before the test calls it a deadlock (the old diff held the
/// commit lock for its whole walk); never reached when the walk holds no lock.
const DEADLOCK: Duration = Duration::from_secs(60);

fn pool_with(options: PoolOptions) -> Pool {
    MemoryParts::new(4096, 4096 * BLOCK).format(
        BLOCK,
        PoolOptions {
            commit_interval: None,
            ..options
        },
    )
}

/// Writes 512 bytes of `byte` into each of `blocks` of `name`.
fn touch(pool: &Pool, name: &str, blocks: impl Iterator<Item = u64>, byte: u8) {
    let volume = pool.volume(name).unwrap();
    for block in blocks {
        volume.write(block * BLOCK, &[byte; 512], false).unwrap();
    }
}

fn blocks(range: std::ops::Range<u64>) -> std::ops::Range<VirtualBlock> {
    VirtualBlock::new(range.start)..VirtualBlock::new(range.end)
}

/// Ranges with neighbours of one kind merged (pieces of a bounded walk meet at the cuts).
fn merged(pieces: Vec<DiffRange>) -> Vec<DiffRange> {
    let mut out: Vec<DiffRange> = Vec::new();
    for range in pieces {
        match out.last_mut() {
            Some(last)
                if last.kind == range.kind
                    && last.begin.get() + last.length == range.begin.get() =>
            {
                last.length += range.length
            }
            _ => out.push(range),
        }
    }
    out
}

#[test]
fn bounded_diffs_answer_prefixes_that_add_up_to_the_whole_diff() {
    let pool = pool_with(PoolOptions::default());
    let size = 3000u64;
    pool.create_volume("empty", size * BLOCK).unwrap();
    pool.create_volume("full", (size + 500) * BLOCK).unwrap();
    touch(&pool, "full", 0..size + 500, 1);
    pool.snapshot("full", "snap", true).unwrap();
    touch(&pool, "full", (0..size).step_by(7), 2);
    for (base, target) in [("empty", "full"), ("snap", "full"), ("full", "empty")] {
        let whole = pool.diff(base, target, None).unwrap();
        let end = whole.base_size_blocks.max(whole.target_size_blocks);
        let bound = |name: &str| (name.to_string(), pool.generation(name).unwrap());
        let (base_bound, target_bound) = (bound(base), bound(target));
        let mut start = 0;
        let mut pieces = Vec::new();
        let mut calls = 0;
        while start < end {
            let part = pool
                .diff_bound(
                    (&base_bound.0, base_bound.1),
                    (&target_bound.0, target_bound.1),
                    blocks(start..end),
                    4,
                )
                .unwrap();
            let compared = part.compared_end.get();
            assert!(
                compared > start && compared <= end,
                "{base} vs {target}: {compared}"
            );
            assert!(part
                .ranges
                .iter()
                .all(|r| r.begin.get() >= start && r.begin.get() + r.length <= compared));
            pieces.extend(part.ranges);
            start = compared;
            calls += 1;
        }
        assert!(calls > 1, "{base} vs {target}: 4 nodes cover {end} blocks?");
        assert_eq!(merged(pieces), whole.ranges, "{base} vs {target}");
        // Unbounded enough, one call answers all of it.
        let all = pool
            .diff_bound(
                (&base_bound.0, base_bound.1),
                (&target_bound.0, target_bound.1),
                blocks(0..end),
                u64::MAX,
            )
            .unwrap();
        assert_eq!(all.compared_end.get(), end);
        assert_eq!(all.ranges, whole.ranges);
    }
}

#[test]
fn a_generation_changes_with_revert_recreate_and_rename_only() {
    let pool = pool_with(PoolOptions::default());
    pool.create_volume("base", 64 * BLOCK).unwrap();
    pool.create_volume("target", 64 * BLOCK).unwrap();
    touch(&pool, "base", 0..8, 1);
    let changed = |pool: &Pool, bound| {
        let result = pool.diff_bound(
            ("base", bound),
            ("target", pool.generation("target").unwrap()),
            blocks(0..64),
            64,
        );
        match result {
            Ok(_) => false,
            Err(thin_pool::Error::VolumeChanged { name }) => {
                assert_eq!(name, "base");
                true
            }
            Err(e) => panic!("{e}"),
        }
    };
    let generation = pool.generation("base").unwrap();
    // Writes, a snapshot of it, a resize and a commit keep it.
    touch(&pool, "base", 8..16, 2);
    pool.snapshot("base", "snap", true).unwrap();
    pool.resize_volume("base", 128 * BLOCK, Shrink::KeepData)
        .unwrap();
    pool.commit().unwrap();
    assert_eq!(pool.generation("base").unwrap(), generation);
    assert!(!changed(&pool, generation));
    // A revert gives it another content history.
    pool.revert_volume("base", "snap", false).unwrap();
    assert!(changed(&pool, generation));
    // Deleted and re-created: the same thin id (reused at once), another volume.
    let generation = pool.generation("base").unwrap();
    let id = pool.info("base").unwrap().id;
    pool.delete_volume("base").unwrap();
    pool.create_volume("base", 64 * BLOCK).unwrap();
    assert_eq!(pool.info("base").unwrap().id, id, "the id is reused");
    assert!(changed(&pool, generation));
    // Renamed away and back.
    let generation = pool.generation("base").unwrap();
    pool.rename_volume("base", "elsewhere").unwrap();
    assert!(changed(&pool, generation));
    pool.rename_volume("elsewhere", "base").unwrap();
    assert!(changed(&pool, generation));
}

/// A pool whose hook stops walks at `FaultPoint::DiffWalk` while `stop` holds a channel pair:
/// it reports each stop on the first and waits for a release on the second.
type Stop = Arc<Mutex<Option<(mpsc::Sender<()>, mpsc::Receiver<()>)>>>;

fn stopping_pool() -> (Pool, Stop, Arc<Mutex<usize>>) {
    let stop: Stop = Arc::default();
    let walks = Arc::new(Mutex::new(0usize));
    let (hook_stop, hook_walks) = (stop.clone(), walks.clone());
    let pool = pool_with(PoolOptions {
        fault_hook: Some(FaultHook::new(move |point| {
            if point == FaultPoint::DiffWalk {
                *hook_walks.lock().unwrap() += 1;
                let taken = hook_stop.lock().unwrap().take();
                if let Some((reached, release)) = taken {
                    reached.send(()).unwrap();
                    release.recv().unwrap();
                }
            }
        })),
        ..PoolOptions::default()
    });
    (pool, stop, walks)
}

/// Runs `commits` commits (each after a write to `other`) on another thread; true if they
/// completed before [`DEADLOCK`].
fn commits_complete(pool: &Pool, commits: usize) -> bool {
    let (done_tx, done_rx) = mpsc::channel();
    let pool = pool.clone();
    std::thread::spawn(move || {
        for i in 0..commits {
            touch(&pool, "other", i as u64..i as u64 + 1, 9);
            pool.commit().unwrap();
        }
        let _ = done_tx.send(());
    });
    done_rx.recv_timeout(DEADLOCK).is_ok()
}

#[test]
fn a_commit_completes_while_a_diff_walk_is_stopped_and_an_overtaken_walk_is_redone() {
    for commits in [1, 2] {
        let (pool, stop, walks) = stopping_pool();
        pool.create_volume("base", 256 * BLOCK).unwrap();
        pool.create_volume("other", 256 * BLOCK).unwrap();
        touch(&pool, "base", 0..256, 1);
        pool.snapshot("base", "target", false).unwrap();
        touch(&pool, "target", (0..256).step_by(3), 2);
        let expected = pool.diff("base", "target", None).unwrap().ranges;
        *walks.lock().unwrap() = 0;
        let (reached_tx, reached_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel();
        *stop.lock().unwrap() = Some((reached_tx, release_rx));
        let walker = {
            let pool = pool.clone();
            let bound = [
                ("base", pool.generation("base").unwrap()),
                ("target", pool.generation("target").unwrap()),
            ];
            std::thread::spawn(move || {
                pool.diff_bound(bound[0], bound[1], blocks(0..256), u64::MAX)
            })
        };
        reached_rx.recv().unwrap();
        // The walk is stopped with the roots read: commits go on.
        let completed = commits_complete(&pool, commits);
        release_tx.send(()).unwrap();
        let diff = walker.join().unwrap().unwrap();
        assert!(
            completed,
            "{commits} commit(s) waited for a diff walk (the commit lock)"
        );
        assert_eq!(diff.ranges, expected);
        // One commit cannot have reused a block the walk read; two may: walked again.
        assert_eq!(*walks.lock().unwrap(), commits, "{commits} commit(s)");
    }
}
