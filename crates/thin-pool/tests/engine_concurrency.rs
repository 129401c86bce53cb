//! Goal: concurrent reads, writes and discards on several volumes, with the periodic commit
//! thread running and snapshots taken and deleted meanwhile, lose no acknowledged write,
//! never show one volume's data in another, and give snapshots a point-in-time copy.
//! Method: worker threads each own the blocks `b % WORKERS == id` of every base volume,
//! so each block has one writer and a total order; every write fills a whole block with a
//! header (volume, block, generation) and a checksummed body, and is logged with the
//! logical times it started and finished. A reader of its own block must see its last write.
//! A snapshot thread snapshots random base volumes, reads each snapshot whole and deletes
//! the oldest; a snapshot's block must hold a write that started before the snapshot ended
//! and was not superseded by one finished before the snapshot started. At the end every
//! block reads back as the log says, before and after a reopen, and the checkers pass.

mod engine_kit;

use engine_kit::{check_metadata, BlockHeader};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use testkit::scratch::ScratchDir;
use testkit::tools::ThinTools;
use thin_pool::testing::MemoryParts;
use thin_pool::{Pool, PoolOptions};

const BLOCK: u64 = 65536;
const VOLUMES: u32 = 3;
const BLOCKS: u64 = 24;
const WORKERS: u64 = 4;

/// One logged change of a block: its new value, and logical start and finish times.
#[derive(Clone, Copy, Debug)]
struct Change {
    value: Option<BlockHeader>,
    started: u64,
    finished: u64,
}

/// Per (volume, block), the changes in order (one writer per block).
type Log = HashMap<(u32, u64), Vec<Change>>;

fn volume_name(v: u32) -> String {
    format!("base{v}")
}

fn read_block(volume: &thin_pool::Volume, b: u64) -> Result<Option<BlockHeader>, String> {
    let mut buf = vec![0u8; BLOCK as usize];
    volume
        .read(b * BLOCK, &mut buf)
        .map_err(|e| format!("{} block {b}: read: {e}", volume.name()))?;
    BlockHeader::decode(&buf).map_err(|e| format!("{} block {b}: {e}", volume.name()))
}

fn worker(
    pool: Pool,
    id: u64,
    seed: u64,
    steps: u64,
    clock: Arc<AtomicU64>,
    generation: Arc<AtomicU64>,
) -> Result<Log, String> {
    let mut rng = StdRng::seed_from_u64(seed ^ (id + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let volumes: Vec<_> = (0..VOLUMES)
        .map(|v| pool.volume(&volume_name(v)).expect("base volume"))
        .collect();
    let mut log = Log::new();
    let own: Vec<u64> = (0..BLOCKS).filter(|b| b % WORKERS == id).collect();
    for step in 0..steps {
        let v = rng.gen_range(0..VOLUMES);
        let b = own[rng.gen_range(0..own.len())];
        let volume = &volumes[v as usize];
        let last = log
            .get(&(v, b))
            .and_then(|changes| changes.last())
            .and_then(|c| c.value);
        match rng.gen_range(0..100) {
            0..=54 => {
                let header = BlockHeader {
                    tag: v + 1,
                    block: b,
                    generation: generation.fetch_add(1, Ordering::Relaxed),
                };
                let started = clock.fetch_add(1, Ordering::SeqCst);
                volume
                    .write(b * BLOCK, &header.bytes(BLOCK as usize), rng.gen_bool(0.02))
                    .map_err(|e| format!("worker {id} step {step}: write: {e}"))?;
                let finished = clock.fetch_add(1, Ordering::SeqCst);
                log.entry((v, b)).or_default().push(Change {
                    value: Some(header),
                    started,
                    finished,
                });
            }
            55..=84 => {
                let found = read_block(volume, b)?;
                if found != last {
                    return Err(format!(
                        "worker {id} step {step}: base{v} block {b} reads {found:?}, last write {last:?}"
                    ));
                }
            }
            85..=95 => {
                let started = clock.fetch_add(1, Ordering::SeqCst);
                let r = if rng.gen_bool(0.5) {
                    volume.discard(b * BLOCK, BLOCK)
                } else {
                    volume.write_zeroes(b * BLOCK, BLOCK, true, false)
                };
                r.map_err(|e| format!("worker {id} step {step}: discard: {e}"))?;
                let finished = clock.fetch_add(1, Ordering::SeqCst);
                log.entry((v, b)).or_default().push(Change {
                    value: None,
                    started,
                    finished,
                });
            }
            _ => volume
                .flush()
                .map_err(|e| format!("worker {id} step {step}: flush: {e}"))?,
        }
    }
    Ok(log)
}

/// A snapshot's contents, with the logical times it started and finished.
struct Taken {
    origin: u32,
    name: String,
    started: u64,
    finished: u64,
    contents: Vec<Option<BlockHeader>>,
}

fn snapshotter(
    pool: Pool,
    seed: u64,
    clock: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    taken: Arc<Mutex<Vec<Taken>>>,
) -> Result<u64, String> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5a5a);
    let mut live: Vec<(u32, String, u64, u64)> = Vec::new();
    let mut count = 0u64;
    while !stop.load(Ordering::Acquire) {
        let origin = rng.gen_range(0..VOLUMES);
        let name = format!("snap{count}");
        let started = clock.fetch_add(1, Ordering::SeqCst);
        pool.snapshot(&volume_name(origin), &name, rng.gen_bool(0.5))
            .map_err(|e| format!("snapshot {name}: {e}"))?;
        let finished = clock.fetch_add(1, Ordering::SeqCst);
        count += 1;
        live.push((origin, name, started, finished));
        if live.len() > 2 {
            let (origin, name, started, finished) = live.remove(0);
            let contents = read_all(&pool, &name)?;
            taken.lock().unwrap().push(Taken {
                origin,
                name: name.clone(),
                started,
                finished,
                contents,
            });
            pool.delete_volume(&name)
                .map_err(|e| format!("delete {name}: {e}"))?;
        }
        std::thread::sleep(Duration::from_millis(rng.gen_range(0..4)));
    }
    for (origin, name, started, finished) in live {
        let contents = read_all(&pool, &name)?;
        taken.lock().unwrap().push(Taken {
            origin,
            name,
            started,
            finished,
            contents,
        });
    }
    Ok(count)
}

fn read_all(pool: &Pool, name: &str) -> Result<Vec<Option<BlockHeader>>, String> {
    let volume = pool.volume(name).map_err(|e| e.to_string())?;
    (0..BLOCKS).map(|b| read_block(&volume, b)).collect()
}

/// Whether `found` is a value the block may have held at some instant of `started..finished`.
fn allowed_in_window(
    changes: &[Change],
    started: u64,
    finished: u64,
    found: Option<BlockHeader>,
) -> bool {
    // The last change finished before the window began (or the initial zeros) ...
    let base = changes.iter().rposition(|c| c.finished < started);
    let mut allowed = vec![base.and_then(|i| changes[i].value)];
    // ... or any change that started before the window ended and came after it.
    let from = base.map_or(0, |i| i + 1);
    allowed.extend(
        changes[from..]
            .iter()
            .filter(|c| c.started < finished)
            .map(|c| c.value),
    );
    allowed.contains(&found)
}

fn verify_bases(pool: &Pool, log: &Log, when: &str) {
    for v in 0..VOLUMES {
        let volume = pool.volume(&volume_name(v)).unwrap();
        for b in 0..BLOCKS {
            let expected = log
                .get(&(v, b))
                .and_then(|c| c.last())
                .and_then(|c| c.value);
            let found = read_block(&volume, b).unwrap_or_else(|e| panic!("{when}: {e}"));
            assert_eq!(found, expected, "{when}: base{v} block {b}");
        }
    }
}

#[test]
fn concurrent_io_with_snapshots_keeps_every_acknowledged_write() {
    let (report, _rng) = testkit::seed::seeded_rng();
    let seed = report.seed();
    let steps = testkit::seed::case_count(1500);
    let parts = MemoryParts::new(4096, 512 * BLOCK);
    let options = PoolOptions {
        commit_interval: Some(Duration::from_millis(15)),
        error_if_no_space: true,
        ..PoolOptions::default()
    };
    let pool = parts.format(BLOCK, options.clone());
    for v in 0..VOLUMES {
        pool.create_volume(&volume_name(v), BLOCKS * BLOCK).unwrap();
    }
    let clock = Arc::new(AtomicU64::new(1));
    let generation = Arc::new(AtomicU64::new(1));
    let stop = Arc::new(AtomicBool::new(false));
    let taken = Arc::new(Mutex::new(Vec::new()));
    let snap = {
        let (pool, clock, stop, taken) = (pool.clone(), clock.clone(), stop.clone(), taken.clone());
        std::thread::spawn(move || snapshotter(pool, seed, clock, stop, taken))
    };
    let workers: Vec<_> = (0..WORKERS)
        .map(|id| {
            let (pool, clock, generation) = (pool.clone(), clock.clone(), generation.clone());
            std::thread::spawn(move || worker(pool, id, seed, steps, clock, generation))
        })
        .collect();
    let mut log = Log::new();
    let mut errors = Vec::new();
    for w in workers {
        match w.join().expect("worker panicked") {
            Ok(l) => log.extend(l),
            Err(e) => errors.push(e),
        }
    }
    stop.store(true, Ordering::Release);
    let snapshots = snap.join().expect("snapshotter panicked");
    assert!(errors.is_empty(), "seed {seed}: {errors:#?}");
    let snapshots = snapshots.unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    let taken = std::mem::take(&mut *taken.lock().unwrap());
    for t in &taken {
        for (b, found) in t.contents.iter().enumerate() {
            let changes = log.get(&(t.origin, b as u64)).map_or(&[][..], |c| &c[..]);
            assert!(
                allowed_in_window(changes, t.started, t.finished, *found),
                "seed {seed}: snapshot {} of base{} block {b} holds {found:?}, not a value of \
                 the origin during the snapshot ({}..{})",
                t.name,
                t.origin,
                t.started,
                t.finished
            );
        }
    }
    verify_bases(&pool, &log, "before reopen");
    pool.verify_index().unwrap();
    pool.close().unwrap();
    drop(pool);
    let dir = ScratchDir::new("engine-concurrency");
    check_metadata(
        parts.metadata.clone(),
        Some((&ThinTools::all()[..], &dir.join("metadata"))),
    )
    .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    let pool = parts.reopen(options);
    verify_bases(&pool, &log, "after reopen");
    for t in taken.iter().filter(|t| pool.volume(&t.name).is_ok()) {
        assert_eq!(
            read_all(&pool, &t.name).unwrap(),
            t.contents,
            "seed {seed}: snapshot {} changed across the reopen",
            t.name
        );
    }
    pool.verify_index().unwrap();
    println!(
        "{WORKERS} workers x {steps} steps, {snapshots} snapshots, {} checked",
        taken.len()
    );
}
