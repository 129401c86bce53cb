//! Crash consistency: a power cut at any write or flush leaves a committed state.
//!
//! Goal: whatever write or flush the power fails at, and whatever the disk then keeps of the
//! unflushed writes (nothing; any subset, in any order; torn at sector boundaries), the
//! metadata reopens to exactly the last commit that completed, or to the commit in progress
//! if its superblock write completed (only possible when the disk kept unflushed writes);
//! every tree passes `btree::check`, a full reference recount matches both space maps, and
//! the recovered pool keeps working (a further transaction commits and verifies).
//!
//! Method: a seeded workload of several transactions (inserts, overwrites, removals, range
//! removals, cloned trees, a two-level tree with shared subtrees) runs once on a
//! `testkit::CrashDevice` to record each commit's contents and the device operation count
//! at which it completed. Then, for every write/flush index N (small workload) or a sample of
//! them (large workload), the workload reruns on a fresh device that cuts the power after
//! N operations; the crash image is taken in every `CrashMode` and reopened.

mod common;

use common::{Contents, Pool, TreeKind};
use persistent_data::{BlockDevice, MemoryDevice};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use testkit::{CrashDevice, CrashMode};

const KINDS: [TreeKind; 4] = [
    TreeKind::Data,
    TreeKind::Data,
    TreeKind::Plain(24),
    TreeKind::TwoLevel,
];
const DATA_BLOCKS: u64 = 20_000;
const METADATA_BLOCKS: u64 = 1024;

#[derive(Clone, Copy, Debug)]
enum Op {
    Insert {
        tree: usize,
        key: u64,
    },
    Remove {
        tree: usize,
        key: u64,
    },
    RemoveRange {
        tree: usize,
        begin: u64,
        end: u64,
    },
    /// Tree `to` becomes a clone of tree `from`.
    Share {
        from: usize,
        to: usize,
    },
    Details {
        key: u64,
        value: u64,
    },
    DetailsRemove {
        key: u64,
    },
    Mapping {
        top: u64,
        key: u64,
    },
    Snapshot {
        from: u64,
        to: u64,
    },
    RemoveSubtree {
        top: u64,
    },
}

/// Transactions of operations, made up from a seed.
fn workload(
    rng: &mut StdRng,
    transactions: usize,
    ops_per_transaction: usize,
    key_space: u64,
) -> Vec<Vec<Op>> {
    (0..transactions)
        .map(|_| {
            let count = rng.gen_range(ops_per_transaction / 2..=ops_per_transaction);
            (0..count)
                .map(|_| {
                    let tree = rng.gen_range(0..2);
                    let key = rng.gen_range(0..key_space);
                    match rng.gen_range(0..100) {
                        0..=44 => Op::Insert { tree, key },
                        45..=59 => Op::Remove { tree, key },
                        60..=61 => Op::RemoveRange {
                            tree,
                            begin: key,
                            end: key + rng.gen_range(1..key_space / 4),
                        },
                        62 => Op::Share {
                            from: tree,
                            to: 1 - tree,
                        },
                        63..=70 => Op::Details {
                            key: key % 300,
                            value: rng.gen(),
                        },
                        71..=73 => Op::DetailsRemove { key: key % 300 },
                        74..=93 => Op::Mapping {
                            top: rng.gen_range(0..4),
                            key,
                        },
                        94..=96 => Op::Snapshot {
                            from: rng.gen_range(0..4),
                            to: rng.gen_range(0..4),
                        },
                        _ => Op::RemoveSubtree {
                            top: rng.gen_range(0..4),
                        },
                    }
                })
                .collect()
        })
        .collect()
}

fn apply(pool: &mut Pool, op: Op) -> persistent_data::Result<()> {
    match op {
        Op::Insert { tree, key } => {
            let value = pool.data.alloc()?;
            pool.insert_data(tree, key, value)?;
        }
        Op::Remove { tree, key } => {
            pool.remove_data(tree, key)?;
        }
        Op::RemoveRange { tree, begin, end } => {
            pool.remove_range_data(tree, begin, end)?;
        }
        Op::Share { from, to } => pool.share(from, to)?,
        Op::Details { key, value } => {
            let details = common::Details {
                mapped_blocks: value,
                transaction_id: key,
                creation_time: value as u32,
                snapshotted_time: (value >> 32) as u32,
            };
            pool.insert_plain(2, key, &details)?;
        }
        Op::DetailsRemove { key } => {
            pool.remove_plain::<common::Details>(2, key)?;
        }
        Op::Mapping { top, key } => {
            let value = pool.data.alloc()?;
            pool.insert_mapping(3, top, key, value)?;
        }
        Op::Snapshot { from, to } => {
            let top = persistent_data::btree::lookup::<u64, _>(&pool.tm, pool.roots[3], from)?;
            if from != to && top.is_some() {
                pool.remove_subtree(3, to)?;
                pool.snapshot_subtree(3, from, to)?;
            }
        }
        Op::RemoveSubtree { top } => {
            pool.remove_subtree(3, top)?;
        }
    }
    Ok(())
}

/// What the reference run recorded: the contents after each commit (commit 0 is the
/// format) and the device operation count when that commit returned.
struct Reference {
    states: Vec<Vec<Contents>>,
    end_operations: Vec<u64>,
}

/// Run the workload on `device`; stops at the first error (the power cut).
fn run(
    device: &Arc<CrashDevice>,
    transactions: &[Vec<Op>],
    mut record: Option<&mut Reference>,
) -> persistent_data::Result<()> {
    let mut pool = Pool::format(device.clone(), DATA_BLOCKS, &KINDS)?;
    if let Some(reference) = record.as_deref_mut() {
        reference.states.push(pool.contents()?);
        reference.end_operations.push(device.operation_count());
    }
    for ops in transactions {
        for &op in ops {
            apply(&mut pool, op)?;
        }
        pool.commit()?;
        if let Some(reference) = record.as_deref_mut() {
            pool.verify()
                .unwrap_or_else(|e| panic!("reference run: {e}"));
            reference.states.push(pool.contents()?);
            reference.end_operations.push(device.operation_count());
        }
    }
    Ok(())
}

fn reference(transactions: &[Vec<Op>]) -> Reference {
    let device = Arc::new(CrashDevice::new(METADATA_BLOCKS));
    let mut reference = Reference {
        states: Vec::new(),
        end_operations: Vec::new(),
    };
    run(&device, transactions, Some(&mut reference)).expect("reference run");
    reference
}

/// Crash after `n` operations and check every crash image.
fn crash_at(
    n: u64,
    transactions: &[Vec<Op>],
    reference: &Reference,
    rng: &mut StdRng,
) -> Result<(), String> {
    let device = Arc::new(CrashDevice::new(METADATA_BLOCKS));
    device.set_power_cut_after(Some(n));
    let outcome = run(&device, transactions, None);
    let total = *reference
        .end_operations
        .last()
        .expect("at least the format");
    if n < total {
        let error = outcome.err().ok_or_else(|| {
            format!("cut after {n} of {total} operations, yet the workload finished")
        })?;
        if !matches!(error, persistent_data::Error::Io { .. }) {
            return Err(format!("power cut gave a non-I/O error: {error}"));
        }
    }
    // Commit `durable` completed (superblock flushed); the next one's superblock write may
    // have completed without its flush.
    let durable = reference.end_operations.iter().rposition(|&end| end <= n);
    let next = durable.map_or(0, |d| d + 1);
    let next_written = reference
        .end_operations
        .get(next)
        .is_some_and(|&end| n + 1 >= end);
    for mode in CrashMode::ALL {
        let image = Arc::new(device.crash_image(mode, rng));
        let mut acceptable: Vec<usize> = durable.into_iter().collect();
        if mode != CrashMode::DropAll && next_written {
            acceptable.push(next);
        }
        check_image(image, &acceptable, durable.is_none(), reference, rng)
            .map_err(|e| format!("cut after {n} operations, {mode:?}: {e}"))?;
    }
    Ok(())
}

fn check_image(
    image: Arc<MemoryDevice>,
    acceptable: &[usize],
    unformatted_ok: bool,
    reference: &Reference,
    rng: &mut StdRng,
) -> Result<(), String> {
    let device: Arc<dyn BlockDevice> = image;
    let mut pool = match Pool::open(device.clone(), &KINDS) {
        Ok(pool) => pool,
        Err(e) if unformatted_ok => {
            // No commit is durable: an unformatted device is a right answer.
            return if e.is_corruption() {
                Ok(())
            } else {
                Err(format!("unformatted device: {e}"))
            };
        }
        Err(e) => return Err(format!("reopen failed: {e}")),
    };
    let contents = pool
        .contents()
        .map_err(|e| format!("reading the trees: {e}"))?;
    let Some(&found) = acceptable
        .iter()
        .find(|&&i| reference.states[i] == contents)
    else {
        let closest = reference.states.iter().position(|s| *s == contents);
        return Err(format!(
            "contents are not commit {acceptable:?} (they equal commit {closest:?})"
        ));
    };
    pool.verify()
        .map_err(|e| format!("commit {found} reopened: {e}"))?;
    // The recovered pool keeps working: blocks the lost transaction wrote are free again,
    // and reusing them must not disturb the recovered state.
    for _ in 0..40 {
        let op = match rng.gen_range(0..3) {
            0 => Op::Insert {
                tree: rng.gen_range(0..2),
                key: rng.gen_range(0..5000),
            },
            1 => Op::Remove {
                tree: rng.gen_range(0..2),
                key: rng.gen_range(0..5000),
            },
            _ => Op::Mapping {
                top: rng.gen_range(0..4),
                key: rng.gen_range(0..5000),
            },
        };
        apply(&mut pool, op).map_err(|e| format!("after recovery: {e}"))?;
    }
    pool.commit()
        .map_err(|e| format!("commit after recovery: {e}"))?;
    pool.reopen()
        .map_err(|e| format!("reopen after recovery: {e}"))?;
    pool.verify()
        .map_err(|e| format!("after a commit on the recovered pool: {e}"))?;
    Ok(())
}

fn crash_everywhere(transactions: &[Vec<Op>], points: Option<usize>, rng: &mut StdRng) {
    let reference = reference(transactions);
    let total = *reference.end_operations.last().unwrap();
    let mut cut_points: Vec<u64> = (0..=total).collect();
    if let Some(points) = points {
        // Always the operations around each commit point, plus a random sample.
        let mut chosen: Vec<u64> = reference
            .end_operations
            .iter()
            .flat_map(|&end| end.saturating_sub(3)..=end)
            .collect();
        cut_points.shuffle(rng);
        chosen.extend(cut_points.iter().take(points));
        chosen.sort_unstable();
        chosen.dedup();
        cut_points = chosen;
    }
    let mut failures = Vec::new();
    for &n in &cut_points {
        if let Err(message) = crash_at(n, transactions, &reference, rng) {
            failures.push(message);
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} crash points failed:\n{}",
        failures.len(),
        cut_points.len(),
        failures
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn crash_at_every_write_and_flush_of_a_small_workload_recovers_a_commit() {
    let (_report, mut rng) = common::seeded();
    // Each workload is crashed at every point; THINPOOL_CASES runs more workloads.
    for _ in 0..testkit::case_count(2) {
        let transactions = workload(&mut rng, 8, 50, 3000);
        crash_everywhere(&transactions, None, &mut rng);
    }
}

#[test]
fn crash_at_sampled_points_of_a_large_workload_recovers_a_commit() {
    let (_report, mut rng) = common::seeded();
    let transactions = workload(&mut rng, 8, 1500, 200_000);
    let points = testkit::case_count(150) as usize;
    crash_everywhere(&transactions, Some(points), &mut rng);
}

#[test]
fn torn_superblock_is_the_old_or_the_new_one() {
    // The test superblock (like dm-thin's) keeps everything in its first 512-byte sector,
    // so a write torn at a sector boundary gives the old or the new block, never a mix.
    let mut rng = StdRng::seed_from_u64(1);
    let device = Arc::new(CrashDevice::new(METADATA_BLOCKS));
    let mut pool = Pool::format(device.clone(), DATA_BLOCKS, &KINDS).unwrap();
    let value = pool.data.alloc().unwrap();
    pool.insert_data(0, 1, value).unwrap();
    pool.commit().unwrap();
    let mut sb = [0u8; persistent_data::BLOCK_SIZE];
    device
        .read(persistent_data::MetadataBlock::new(0), &mut sb)
        .unwrap();
    assert!(
        sb[512..].iter().all(|&b| b == 0),
        "superblock contents beyond the first sector"
    );
    let _ = rng.gen::<u64>();
}
