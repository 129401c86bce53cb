//! Goal: when the Nth I/O of the metadata or the data device fails, the caller gets the
//! error and the pool reacts as dm-thin does (spec §8.7, §10.5): a metadata I/O error
//! aborts the transaction and makes the pool read-only with needs_check set; a data I/O
//! error fails only that request. Either way, the metadata reopens consistent (our checker
//! and, sampled, both thin_check versions) and holds what was flushed.
//! Method: a fixed small workload (writes, flushes, a snapshot and writes breaking its
//! sharing, discard, zeroes, FUA, commit, delete, resize) runs once to count the I/Os, then
//! once per N with the Nth I/O (of any kind) failing, on testkit's `FaultDevice` for
//! metadata and `engine_kit::FaultDataDevice` for data. Every block written carries a header
//! (volume, block, generation); the model keeps the flushed and the since-written values.

mod engine_kit;

use engine_kit::{check_metadata, BlockHeader, FaultDataDevice};
use persistent_data::MemoryDevice;
use std::collections::BTreeMap;
use std::sync::Arc;
use testkit::fault::{FaultDevice, Ops};
use testkit::scratch::ScratchDir;
use testkit::tools::ThinTools;
use thin_pool::testing::{deterministic_options as options, MemoryParts};
use thin_pool::{Error, Pool, PoolMetadata, PoolMode};

const BLOCK: u64 = 65536;

#[derive(Clone, Copy, Debug)]
enum Op {
    Write(&'static str, u64, bool),
    Discard(&'static str, u64),
    Zeroes(&'static str, u64),
    Flush(&'static str),
    Commit,
    Snapshot(&'static str, &'static str),
    Delete(&'static str),
    Grow(&'static str, u64),
}

const WORKLOAD: &[Op] = &[
    Op::Write("v0", 0, false),
    Op::Write("v0", 1, false),
    Op::Write("v0", 2, false),
    Op::Write("v1", 0, false),
    Op::Flush("v0"),
    Op::Snapshot("v0", "s"),
    Op::Write("v0", 1, false),
    Op::Write("s", 2, false),
    Op::Discard("v0", 0),
    Op::Write("v1", 1, true),
    Op::Zeroes("v0", 2),
    Op::Commit,
    Op::Write("v0", 3, false),
    Op::Delete("s"),
    Op::Write("v0", 3, false),
    Op::Flush("v1"),
    Op::Grow("v1", 6),
    Op::Write("v1", 5, false),
    Op::Flush("v1"),
];

fn tag(name: &str) -> u32 {
    match name {
        "v0" => 1,
        "v1" => 2,
        _ => 3,
    }
}

type Value = Option<BlockHeader>;

#[derive(Clone, Debug, Default)]
struct BlockModel {
    durable: Value,
    pending: Vec<Value>,
    /// Values of failed writes: they may or may not have reached the block, until it is
    /// written again.
    maybe: Vec<Value>,
}

impl BlockModel {
    fn live(&self) -> Value {
        *self.pending.last().unwrap_or(&self.durable)
    }
}

type Model = BTreeMap<&'static str, Vec<BlockModel>>;

fn flush_point(model: &mut Model) {
    for blocks in model.values_mut() {
        for b in blocks {
            b.durable = b.live();
            b.pending.clear();
        }
    }
}

struct Outcome {
    /// The operation that failed and its error.
    failed: Option<(usize, Error)>,
    /// What each block may read as.
    model: Model,
    /// If a management operation failed: the model had it taken effect (a failed flush
    /// does not mean the superblock write was lost).
    landed: Option<Model>,
}

fn execute(pool: &Pool, stop_at_error: bool) -> Outcome {
    let mut model = Model::new();
    model.insert("v0", vec![BlockModel::default(); 6]);
    model.insert("v1", vec![BlockModel::default(); 4]);
    let mut failed = None;
    let mut landed = None;
    for (i, &op) in WORKLOAD.iter().enumerate() {
        let name = match op {
            Op::Write(n, ..)
            | Op::Discard(n, _)
            | Op::Zeroes(n, _)
            | Op::Flush(n)
            | Op::Snapshot(n, _)
            | Op::Delete(n)
            | Op::Grow(n, _) => Some(n),
            Op::Commit => None,
        };
        if name.is_some_and(|n| !model.contains_key(n)) {
            continue; // its volume never came to be (an earlier failure)
        }
        if let Op::Write(n, b, _) | Op::Discard(n, b) | Op::Zeroes(n, b) = op {
            if b as usize >= model[n].len() {
                continue; // the resize that made room failed
            }
        }
        let volume = name.map(|n| pool.volume(n).expect("volume"));
        let generation = i as u64 + 1;
        let result = match op {
            Op::Write(n, b, fua) => {
                let header = BlockHeader {
                    tag: tag(n),
                    block: b,
                    generation,
                };
                let r =
                    volume
                        .as_ref()
                        .unwrap()
                        .write(b * BLOCK, &header.bytes(BLOCK as usize), fua);
                let m = &mut model.get_mut(n).unwrap()[b as usize];
                if r.is_ok() {
                    m.pending.push(Some(header));
                    m.maybe.clear();
                } else {
                    m.maybe.push(Some(header));
                }
                if r.is_ok() && fua {
                    flush_point(&mut model);
                }
                r
            }
            Op::Discard(n, b) | Op::Zeroes(n, b) => {
                let v = volume.as_ref().unwrap();
                let r = match op {
                    Op::Discard(..) => v.discard(b * BLOCK, BLOCK),
                    _ => v.write_zeroes(b * BLOCK, BLOCK, false, false),
                };
                let m = &mut model.get_mut(n).unwrap()[b as usize];
                if r.is_ok() {
                    m.pending.push(None);
                    m.maybe.clear();
                } else {
                    m.maybe.push(None);
                }
                r
            }
            Op::Flush(_) | Op::Commit => {
                let r = match &volume {
                    Some(v) => v.flush(),
                    None => pool.commit(),
                };
                if r.is_ok() {
                    flush_point(&mut model);
                }
                r
            }
            Op::Snapshot(..) | Op::Delete(_) | Op::Grow(..) => {
                drop(volume);
                let r = match op {
                    Op::Snapshot(origin, name) => pool.snapshot(origin, name, false).map(|_| ()),
                    Op::Delete(n) => pool.delete_volume(n),
                    Op::Grow(n, blocks) => pool
                        .resize_volume(n, blocks * BLOCK, thin_pool::Shrink::DropData)
                        .map(|_| ()),
                    _ => unreachable!(),
                };
                let after = management_landed(&model, op);
                match r {
                    Ok(()) => model = after,
                    Err(_) => landed = Some(after),
                }
                r
            }
        };
        if let Err(e) = result {
            assert!(
                failed.is_none(),
                "op {i} {op:?} failed after an earlier fault: {e}"
            );
            failed = Some((i, e));
            if stop_at_error {
                break;
            }
        }
    }
    Outcome {
        failed,
        model,
        landed,
    }
}

/// The model after a management operation that committed.
fn management_landed(model: &Model, op: Op) -> Model {
    let mut m = model.clone();
    flush_point(&mut m);
    match op {
        Op::Snapshot(origin, name) => {
            let copy = m[origin].clone();
            m.insert(name, copy);
        }
        Op::Delete(n) => {
            m.remove(n);
        }
        Op::Grow(n, blocks) => {
            m.get_mut(n)
                .unwrap()
                .resize(blocks as usize, BlockModel::default());
        }
        _ => unreachable!("not a management operation"),
    }
    m
}

/// Contents as the model allows, or as the landed model allows.
fn verify_outcome(pool: &Pool, outcome: &Outcome) -> Result<(), String> {
    match (verify_contents(pool, &outcome.model), &outcome.landed) {
        (Ok(()), _) => Ok(()),
        (Err(e), None) => Err(e),
        (Err(e), Some(landed)) => verify_contents(pool, landed)
            .map_err(|f| format!("{e}; had the failed operation taken effect: {f}")),
    }
}

/// Every block of every volume reads as the model allows.
fn verify_contents(pool: &Pool, model: &Model) -> Result<(), String> {
    let names: Vec<String> = pool.list().into_iter().map(|v| v.name).collect();
    let expected: Vec<&str> = model.keys().copied().collect();
    if names != expected {
        return Err(format!("volumes {names:?}, expected {expected:?}"));
    }
    for (name, blocks) in model {
        let v = pool.volume(name).map_err(|e| e.to_string())?;
        for (b, m) in blocks.iter().enumerate() {
            let mut buf = vec![0u8; BLOCK as usize];
            v.read(b as u64 * BLOCK, &mut buf)
                .map_err(|e| format!("{name} block {b}: {e}"))?;
            let found = BlockHeader::decode(&buf).map_err(|e| format!("{name} block {b}: {e}"))?;
            if found != m.durable && !m.pending.contains(&found) && !m.maybe.contains(&found) {
                return Err(format!(
                    "{name} block {b} reads {found:?}; flushed {:?}, written since {:?}, failed writes {:?}",
                    m.durable, m.pending, m.maybe
                ));
            }
        }
    }
    Ok(())
}

/// The pool's memory parts (what survives a failure, to reopen) and the wrappers that fail
/// the Nth I/O, the pool runs on.
struct Devices {
    inner: MemoryParts,
    metadata: Arc<FaultDevice<Arc<MemoryDevice>>>,
    data: Arc<FaultDataDevice>,
}

fn setup() -> (Devices, Pool) {
    let inner = MemoryParts::new(512, 64 * BLOCK);
    let metadata = Arc::new(FaultDevice::new(inner.metadata.clone()));
    let data = Arc::new(FaultDataDevice::new(inner.data.clone()));
    let pool = inner
        .with_metadata(metadata.clone())
        .with_data(data.clone())
        .format(BLOCK, options());
    pool.create_volume("v0", 6 * BLOCK).unwrap();
    pool.create_volume("v1", 4 * BLOCK).unwrap();
    let d = Devices {
        inner,
        metadata,
        data,
    };
    (d, pool)
}

fn reopen(d: &Devices) -> thin_pool::Result<Pool> {
    d.inner.try_reopen(options())
}

fn io_counts() -> (u64, u64, u64, u64) {
    let (d, pool) = setup();
    let (m0, d0) = (d.metadata.counts().total(), d.data.counts().total());
    let outcome = execute(&pool, false);
    assert!(outcome.failed.is_none());
    (m0, d.metadata.counts().total(), d0, d.data.counts().total())
}

#[test]
fn nth_metadata_io_failure_makes_the_pool_read_only_with_needs_check() {
    let (_report, _rng) = testkit::seed::seeded_rng();
    let (start, end, _, _) = io_counts();
    let tools = ThinTools::all();
    let dir = ScratchDir::new("engine-faults-metadata");
    let mut failures = 0;
    for n in start + 1..=end {
        let (d, pool) = setup();
        d.metadata.fail_nth(Ops::ANY, n);
        let outcome = execute(&pool, true);
        let what = format!("metadata I/O {n} (of {start}..{end}) fails");
        if d.metadata.faults_injected() == 0 {
            continue;
        }
        let Some((i, e)) = &outcome.failed else {
            panic!("{what}: no operation reported it");
        };
        failures += 1;
        let what = format!("{what}: op {i} {:?}: {e}", WORKLOAD[*i]);
        assert_eq!(pool.mode(), PoolMode::ReadOnly, "{what}");
        assert!(pool.status().needs_check, "{what}: needs_check");
        assert!(
            pool.create_volume("x", BLOCK).is_err(),
            "{what}: management refused"
        );
        drop(pool);
        let sample = (n - start) % 8 == 1;
        check_metadata(
            d.inner.metadata.clone(),
            sample.then_some((&tools[..], &dir.join("metadata"))),
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        // Reopened: still read-only until the check flag is cleared.
        let pool = reopen(&d).unwrap_or_else(|e| panic!("{what}: reopen: {e}"));
        assert_eq!(pool.mode(), PoolMode::ReadOnly, "{what}: reopened");
        assert!(pool.status().needs_check, "{what}: reopened needs_check");
        verify_outcome(&pool, &outcome).unwrap_or_else(|e| panic!("{what}: {e}"));
        drop(pool);
        PoolMetadata::open(d.inner.metadata.clone())
            .and_then(|mut md| md.clear_needs_check())
            .unwrap_or_else(|e| panic!("{what}: clearing needs_check: {e}"));
        let pool = reopen(&d).unwrap_or_else(|e| panic!("{what}: reopen: {e}"));
        assert_eq!(pool.mode(), PoolMode::Write, "{what}: after the check");
        verify_outcome(&pool, &outcome).unwrap_or_else(|e| panic!("{what}: {e}"));
        pool.volume("v0")
            .unwrap()
            .write(5 * BLOCK, &vec![7u8; BLOCK as usize], true)
            .unwrap_or_else(|e| panic!("{what}: write after recovery: {e}"));
        pool.verify_index().unwrap();
        drop(pool);
        check_metadata(d.inner.metadata.clone(), None).unwrap_or_else(|e| panic!("{what}: {e}"));
    }
    println!(
        "{} metadata I/Os, {failures} failures injected",
        end - start
    );
}

#[test]
fn nth_data_io_failure_fails_only_that_request() {
    let (_, _, start, end) = io_counts();
    let mut failures = 0;
    for n in start + 1..=end {
        let (d, pool) = setup();
        d.data.fail_nth(Ops::ANY, n);
        let outcome = execute(&pool, false);
        let what = format!("data I/O {n} (of {start}..{end}) fails");
        assert_eq!(d.data.injected(), 1, "{what}: the workload reaches it");
        failures += 1;
        if let Some((i, e)) = &outcome.failed {
            assert!(
                matches!(e, Error::Io { .. }),
                "{what}: op {i} {:?} fails with {e}, not an I/O error",
                WORKLOAD[*i]
            );
        }
        // Passdown discards are the only data I/O whose failure no request sees.
        assert_eq!(pool.mode(), PoolMode::Write, "{what}: mode");
        assert!(!pool.status().needs_check, "{what}: needs_check");
        verify_outcome(&pool, &outcome).unwrap_or_else(|e| panic!("{what}: {e}"));
        pool.close()
            .unwrap_or_else(|e| panic!("{what}: close: {e}"));
        drop(pool);
        check_metadata(d.inner.metadata.clone(), None).unwrap_or_else(|e| panic!("{what}: {e}"));
        let pool = reopen(&d).unwrap_or_else(|e| panic!("{what}: reopen: {e}"));
        verify_outcome(&pool, &outcome).unwrap_or_else(|e| panic!("{what}: {e}"));
        pool.verify_index().unwrap();
    }
    println!("{} data I/Os, {failures} failures injected", end - start);
}
