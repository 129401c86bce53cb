//! Goal: the provisioning write paths keep every byte: partial writes into shared blocks
//! (the rest of the block copied), writes spanning many blocks that are a mix of shared,
//! unshared and unprovisioned (whole blocks provisioned together: one reservation and one
//! mapping step for the run, one data write per stretch of consecutive data blocks), and
//! writers breaking sharing of different blocks at once; and a write without FUA never
//! commits, while an overwrite in place proceeds while a commit is stopped half-way.
//! Method: seeded random writes against a byte model per volume (a snapshot copies its
//! origin's bytes), every volume read whole and compared after each snapshot, at the end,
//! and after a reopen, with the index checked against the trees and the closed pool's
//! metadata checked. Threads write disjoint blocks of a freshly snapshotted volume and the
//! result is compared with the model. A fault hook holds a commit at its metadata write.

mod engine_kit;

use engine_kit::check_metadata;
use rand::{Rng, RngCore};
use std::collections::BTreeMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use thin_pool::data_device::DataDevice;
use thin_pool::testing::{deterministic_options as options, MemoryParts};
use thin_pool::{FaultHook, FaultPoint};
use thin_pool::{Pool, PoolOptions};

const BLOCK: u64 = 65536;
const SECTOR: u64 = 512;

fn read_whole(pool: &Pool, name: &str, size: usize) -> Vec<u8> {
    let mut buf = vec![0; size];
    pool.volume(name).unwrap().read(0, &mut buf).unwrap();
    buf
}

fn assert_matches(pool: &Pool, model: &BTreeMap<String, Vec<u8>>, when: &str) {
    for (name, bytes) in model {
        let actual = read_whole(pool, name, bytes.len());
        if let Some(i) = actual.iter().zip(bytes).position(|(a, b)| a != b) {
            panic!("{when}: {name} differs from the model first at byte {i}");
        }
    }
}

/// A write of random bytes, its offset and length drawn to hit every case: inside one
/// block, across a boundary, whole blocks (runs of up to 20), unaligned runs.
fn random_write(rng: &mut impl Rng, size: u64) -> (u64, Vec<u8>) {
    let sectors = size / SECTOR;
    let (start, count) = match rng.gen_range(0..4) {
        0 => {
            let start = rng.gen_range(0..sectors);
            (start, rng.gen_range(1..=(sectors - start).min(16)))
        }
        1 => {
            let blocks = size / BLOCK;
            let first = rng.gen_range(0..blocks);
            let count = rng.gen_range(1..=(blocks - first).min(20));
            (first * BLOCK / SECTOR, count * BLOCK / SECTOR)
        }
        _ => {
            let start = rng.gen_range(0..sectors);
            (
                start,
                rng.gen_range(1..=(sectors - start).min(20 * BLOCK / SECTOR)),
            )
        }
    };
    let mut bytes = vec![0; (count * SECTOR) as usize];
    rng.fill_bytes(&mut bytes);
    (start * SECTOR, bytes)
}

#[test]
fn multi_block_and_partial_writes_over_shared_unshared_and_unprovisioned_blocks_match_a_model() {
    let (_report, mut rng) = testkit::seed::seeded_rng();
    let steps = testkit::seed::case_count(400);
    // At most 5 volumes of 48 blocks live, on 600 data blocks: the allocator wraps around
    // and reuses blocks freed by deletes and broken sharing, so the blocks one write
    // reserves are often not consecutive.
    let parts = MemoryParts::new(2048, 600 * BLOCK);
    let pool = parts.format(BLOCK, options());
    let size = 48 * BLOCK;
    let mut model: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    pool.create_volume("origin", size).unwrap();
    model.insert("origin".to_string(), vec![0; size as usize]);
    let mut snapshots = 0;
    for step in 0..steps {
        let names: Vec<String> = model.keys().cloned().collect();
        let name = &names[rng.gen_range(0..names.len())];
        match rng.gen_range(0..100) {
            0..=79 => {
                let (offset, bytes) = random_write(&mut rng, size);
                pool.volume(name)
                    .unwrap()
                    .write(offset, &bytes, rng.gen_bool(0.05))
                    .unwrap_or_else(|e| panic!("step {step}: write {offset}+{}: {e}", bytes.len()));
                model.get_mut(name).unwrap()[offset as usize..][..bytes.len()]
                    .copy_from_slice(&bytes);
            }
            80..=89 if model.len() < 5 => {
                // Snapshots of snapshots too: blocks shared by three volumes.
                snapshots += 1;
                let snap = format!("snap-{snapshots}");
                pool.snapshot(name, &snap, false).unwrap();
                let copy = model[name].clone();
                model.insert(snap, copy);
                assert_matches(&pool, &model, &format!("step {step}: after a snapshot"));
            }
            80..=94 if model.len() > 2 && name != "origin" => {
                pool.delete_volume(name).unwrap();
                model.remove(name);
            }
            _ => pool.commit().unwrap(),
        }
    }
    assert_matches(&pool, &model, "at the end");
    pool.verify_index().unwrap();
    drop(pool);
    check_metadata(parts.metadata.clone(), None).unwrap();
    let pool = parts.reopen(options());
    assert_matches(&pool, &model, "after a reopen");
    pool.verify_index().unwrap();
}

#[test]
fn concurrent_writers_breaking_sharing_of_different_blocks_keep_every_byte() {
    let (_report, mut rng) = testkit::seed::seeded_rng();
    const THREADS: u64 = 4;
    const BLOCKS: u64 = 64;
    let parts = MemoryParts::new(2048, 1024 * BLOCK);
    let pool = parts.format(BLOCK, options());
    let size = BLOCKS * BLOCK;
    pool.create_volume("origin", size).unwrap();
    let mut origin = vec![0; size as usize];
    rng.fill_bytes(&mut origin);
    // Every other block written, the rest left unprovisioned.
    let volume = pool.volume("origin").unwrap();
    for block in (0..BLOCKS).step_by(2) {
        let at = (block * BLOCK) as usize;
        volume
            .write(at as u64, &origin[at..at + BLOCK as usize], false)
            .unwrap();
    }
    for block in (1..BLOCKS).step_by(2) {
        origin[(block * BLOCK) as usize..][..BLOCK as usize].fill(0);
    }
    for round in 0..testkit::seed::case_count(6) {
        let snap = format!("snap-{round}");
        pool.snapshot("origin", &snap, true).unwrap();
        let frozen = origin.clone();
        // Thread t owns the blocks b with b / 4 % THREADS == t: runs of four consecutive
        // blocks, so its whole-block writes span several blocks.
        let writes: Vec<Vec<(u64, Vec<u8>)>> = (0..THREADS)
            .map(|thread| {
                let mut list = Vec::new();
                for first in (0..BLOCKS).step_by(4).filter(|b| b / 4 % THREADS == thread) {
                    let (offset, length) = match rng.gen_range(0..3) {
                        0 => (first * BLOCK + rng.gen_range(0..128) * SECTOR, 8 * SECTOR),
                        1 => (first * BLOCK, 4 * BLOCK),
                        _ => {
                            let start = first * BLOCK + rng.gen_range(1..128) * SECTOR;
                            (start, (first + 4) * BLOCK - start - SECTOR)
                        }
                    };
                    let mut bytes = vec![0; length as usize];
                    rng.fill_bytes(&mut bytes);
                    list.push((offset, bytes));
                }
                list
            })
            .collect();
        std::thread::scope(|scope| {
            for list in &writes {
                let volume = pool.volume("origin").unwrap();
                scope.spawn(move || {
                    for (offset, bytes) in list {
                        volume.write(*offset, bytes, false).unwrap();
                    }
                });
            }
        });
        for (offset, bytes) in writes.iter().flatten() {
            origin[*offset as usize..][..bytes.len()].copy_from_slice(bytes);
        }
        let model: BTreeMap<String, Vec<u8>> =
            [("origin".to_string(), origin.clone()), (snap, frozen)].into();
        assert_matches(&pool, &model, &format!("round {round}"));
        pool.verify_index().unwrap();
    }
    drop(volume);
    drop(pool);
    check_metadata(parts.metadata.clone(), None).unwrap();
    let pool = parts.reopen(options());
    assert_eq!(read_whole(&pool, "origin", size as usize), origin);
}

#[test]
fn writes_without_fua_never_commit_and_overwrites_proceed_during_a_commit() {
    // The hook stops the first commit that reaches its metadata write until released.
    let (reached_tx, reached_rx) = mpsc::channel::<()>();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let hold = Arc::new(Mutex::new(None::<(mpsc::Sender<()>, mpsc::Receiver<()>)>));
    let hook_hold = hold.clone();
    let options = PoolOptions {
        fault_hook: Some(FaultHook::new(move |point| {
            if point == FaultPoint::Commit {
                let taken = hook_hold.lock().unwrap().take();
                if let Some((reached, release)) = taken {
                    reached.send(()).unwrap();
                    release.recv().unwrap();
                }
            }
        })),
        ..options()
    };
    let parts = MemoryParts::default();
    let data = &parts.data;
    let pool = parts.format(BLOCK, options);
    pool.create_volume("v", 64 * BLOCK).unwrap();
    let volume = pool.volume("v").unwrap();
    volume
        .write(0, &vec![1; 32 * BLOCK as usize], false)
        .unwrap();
    pool.snapshot("v", "s", true).unwrap();
    // Provisioning writes, first writes and writes breaking sharing, without FUA: no
    // commit, not even a flush of the data device.
    let commits = pool.commit_stats();
    let flushes = data
        .counters()
        .flushes
        .load(std::sync::atomic::Ordering::Relaxed);
    volume
        .write(32 * BLOCK, &vec![2; 16 * BLOCK as usize], false)
        .unwrap();
    volume.write(4096, &[3; 4096], false).unwrap();
    volume
        .write(BLOCK, &vec![4; 4 * BLOCK as usize], false)
        .unwrap();
    assert_eq!(
        pool.commit_stats(),
        commits,
        "a write without FUA committed"
    );
    assert_eq!(
        data.counters()
            .flushes
            .load(std::sync::atomic::Ordering::Relaxed),
        flushes,
        "a write without FUA flushed the data device"
    );
    // With FUA: committed when it returns.
    volume.write(8 * BLOCK, &[5; 4096], true).unwrap();
    assert_ne!(pool.commit_stats(), commits, "a FUA write did not commit");
    // A commit held at its metadata write: overwrites of unshared blocks go on.
    volume.write(40 * BLOCK, &[6; 4096], false).unwrap();
    *hold.lock().unwrap() = Some((reached_tx, release_rx));
    let pool = Arc::new(pool);
    let committer = {
        let pool = pool.clone();
        std::thread::spawn(move || pool.commit())
    };
    reached_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the commit reaches its metadata write");
    let deadline = Instant::now() + Duration::from_secs(60);
    let overwriter = {
        let volume = volume.clone();
        std::thread::spawn(move || {
            volume.write(0, &[7; 4096], false).unwrap();
            volume
                .write(33 * BLOCK + 4096, &vec![7; 2 * BLOCK as usize], false)
                .unwrap();
        })
    };
    while !overwriter.is_finished() {
        assert!(Instant::now() < deadline, "overwrites wait for the commit");
        std::thread::sleep(Duration::from_millis(5));
    }
    overwriter.join().unwrap();
    release_tx.send(()).unwrap();
    committer.join().unwrap().unwrap();
    let mut buf = vec![0; 4096];
    volume.read(0, &mut buf).unwrap();
    assert_eq!(buf, vec![7; 4096]);
    volume.read(8 * BLOCK, &mut buf).unwrap();
    assert_eq!(buf, vec![5; 4096]);
}
