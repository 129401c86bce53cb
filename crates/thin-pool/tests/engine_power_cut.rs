//! Goal: a power cut at any write or flush of the metadata or data device loses nothing that
//! a completed flush (or FUA write, or management operation) made durable, never shows data
//! that was not written to that volume (stale data of another volume or a freed block), and
//! leaves metadata that both thin_check versions and `thinpool check` accept.
//!
//! Method: a seeded workload (writes, zeroes, discards, flushes, commits, snapshots,
//! creates, deletes, resizes, data growth) runs on a device pair sharing one power supply
//! (`engine_kit::Power`): testkit's metadata `CrashDevice` and a data device holding
//! unflushed writes volatile. A reference run counts the writes and flushes; then for each
//! cut point (every one for small workloads, a sample for a large one) the workload reruns
//! with the power cut there, and each crash mode (drop all unflushed writes, keep a random
//! subset — which reorders —, tear them per sector) gives a metadata image and a data image
//! at the same cut, which are reopened. Every sector carries a stamp (volume, sector,
//! generation); the model keeps per sector the value made durable by the last flush point
//! and the values written since; every sector read after reopen must be one of them.

mod engine_kit;

use engine_kit::{
    check_metadata, decode_sector, CrashDataDevice, CrashImage, CrashParts, SectorContent, Stamp,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use testkit::crash::CrashMode;
use testkit::scratch::ScratchDir;
use testkit::tools::ThinTools;
use thin_pool::{Pool, PoolOptions};

const BLOCK: u64 = 65536;
const SECTORS_PER_BLOCK: u64 = BLOCK / 512;
const DATA_BLOCKS: u64 = 96;
const METADATA_BLOCKS: u64 = 256;

/// Passdown discards wait for the commit that frees their blocks (regression:
/// `engine_regressions::crash_before_commit_keeps_blocks_discarded_by_passdown_intact`), so
/// the crashing data device honours discards.
const PASSDOWN_WAITS_FOR_COMMIT: bool = true;

fn options(discard_passdown: bool) -> PoolOptions {
    PoolOptions {
        commit_interval: None,
        error_if_no_space: true,
        discard_passdown,
        ..PoolOptions::default()
    }
}

#[derive(Clone, Debug)]
enum Op {
    Write {
        volume: String,
        sector: u64,
        count: u64,
        fua: bool,
    },
    Zeroes {
        volume: String,
        sector: u64,
        count: u64,
        may_unmap: bool,
    },
    Discard {
        volume: String,
        sector: u64,
        count: u64,
    },
    Flush {
        volume: String,
    },
    Commit,
    Create {
        name: String,
        size_bytes: u64,
    },
    Snapshot {
        origin: String,
        name: String,
    },
    Delete {
        volume: String,
    },
    Resize {
        volume: String,
        size_bytes: u64,
    },
    GrowData {
        size_bytes: u64,
    },
}

impl Op {
    fn is_management(&self) -> bool {
        matches!(
            self,
            Op::Create { .. } | Op::Snapshot { .. } | Op::Delete { .. } | Op::Resize { .. }
        )
    }
}

fn tag_of(name: &str) -> u32 {
    name[1..].parse::<u32>().expect("names are vN") + 1
}

/// A random workload over volumes `v0` and `v1` (made by the setup) and those it creates.
fn generate(rng: &mut StdRng, count: usize) -> Vec<Op> {
    let mut sizes: BTreeMap<String, u64> = BTreeMap::new();
    sizes.insert("v0".into(), 4 * BLOCK);
    sizes.insert("v1".into(), 3 * BLOCK);
    let mut next_name = 2;
    let mut data_size = DATA_BLOCKS * BLOCK;
    let mut ops = Vec::with_capacity(count);
    while ops.len() < count {
        let names: Vec<String> = sizes.keys().cloned().collect();
        let volume = names[rng.gen_range(0..names.len())].clone();
        let sectors = sizes[&volume] / 512;
        let (sector, count) = if rng.gen_bool(0.5) {
            let blocks = sectors / SECTORS_PER_BLOCK;
            let first = rng.gen_range(0..blocks);
            let n = rng.gen_range(1..=(blocks - first).min(2));
            (first * SECTORS_PER_BLOCK, n * SECTORS_PER_BLOCK)
        } else {
            let s = rng.gen_range(0..sectors);
            (s, rng.gen_range(1..=(sectors - s).min(200)))
        };
        let op = match rng.gen_range(0..100) {
            0..=44 => Op::Write {
                volume,
                sector,
                count,
                fua: rng.gen_bool(0.08),
            },
            45..=51 => Op::Zeroes {
                volume,
                sector,
                count,
                may_unmap: rng.gen_bool(0.5),
            },
            52..=59 => Op::Discard {
                volume,
                sector,
                count,
            },
            60..=71 => Op::Flush { volume },
            72..=75 => Op::Commit,
            76..=80 if sizes.len() < 5 => {
                let name = format!("v{next_name}");
                next_name += 1;
                sizes.insert(name.clone(), sizes[&volume]);
                Op::Snapshot {
                    origin: volume,
                    name,
                }
            }
            81..=83 if sizes.len() < 5 => {
                let name = format!("v{next_name}");
                next_name += 1;
                let size_bytes = rng.gen_range(1..=4) * BLOCK + rng.gen_range(0..2) * 4096;
                sizes.insert(name.clone(), size_bytes);
                Op::Create { name, size_bytes }
            }
            84..=87 if sizes.len() > 2 => {
                sizes.remove(&volume);
                Op::Delete { volume }
            }
            88..=90 => {
                let old = sizes[&volume];
                let mut size_bytes = rng.gen_range(1..=5) * BLOCK;
                if size_bytes == old {
                    size_bytes += 4096;
                }
                sizes.insert(volume.clone(), size_bytes);
                Op::Resize { volume, size_bytes }
            }
            91..=92 => {
                data_size += 8 * BLOCK;
                Op::GrowData {
                    size_bytes: data_size,
                }
            }
            _ => Op::Write {
                volume,
                sector,
                count,
                fua: false,
            },
        };
        ops.push(op);
    }
    ops
}

#[derive(Clone, Debug)]
struct SectorModel {
    durable: SectorContent,
    pending: Vec<SectorContent>,
}

impl SectorModel {
    fn live(&self) -> SectorContent {
        *self.pending.last().unwrap_or(&self.durable)
    }
}

type Model = BTreeMap<String, Vec<SectorModel>>;

fn zero_sectors(count: u64) -> Vec<SectorModel> {
    vec![
        SectorModel {
            durable: SectorContent::Zero,
            pending: vec![],
        };
        count as usize
    ]
}

/// Everything written so far is durable (a flush, commit or management operation completed).
fn flush_point(model: &mut Model) {
    for sectors in model.values_mut() {
        for s in sectors {
            s.durable = s.live();
            s.pending.clear();
        }
    }
}

fn resize_model(sectors: &mut Vec<SectorModel>, size_bytes: u64) {
    sectors.truncate((size_bytes / 512) as usize);
    let missing = (size_bytes / 512) as usize - sectors.len();
    sectors.extend(zero_sectors(missing as u64));
}

/// The model after a management operation that committed.
fn landed(model: &Model, op: &Op) -> Model {
    let mut m = model.clone();
    flush_point(&mut m);
    match op {
        Op::Create { name, size_bytes } => {
            m.insert(name.clone(), zero_sectors(size_bytes / 512));
        }
        Op::Snapshot { origin, name } => {
            let copy = m[origin].clone();
            m.insert(name.clone(), copy);
        }
        Op::Delete { volume } => {
            m.remove(volume);
        }
        Op::Resize { volume, size_bytes } => {
            resize_model(m.get_mut(volume).expect("volume"), *size_bytes);
        }
        _ => unreachable!("not a management operation"),
    }
    m
}

fn write_bytes(name: &str, sector: u64, count: u64, generation: u64) -> Vec<u8> {
    let mut bytes = Vec::with_capacity((count * 512) as usize);
    for s in sector..sector + count {
        let stamp = Stamp {
            tag: tag_of(name),
            sector: s,
            generation,
        };
        bytes.extend_from_slice(&stamp.bytes());
    }
    bytes
}

fn read_contents(pool: &Pool, name: &str, sector: u64, count: u64) -> Vec<SectorContent> {
    let volume = pool.volume(name).expect("volume");
    let mut buf = vec![0u8; (count * 512) as usize];
    volume.read(sector * 512, &mut buf).expect("read");
    buf.chunks(512).map(decode_sector).collect()
}

/// Where a run stopped.
struct Stopped {
    /// The operation that failed (the power went out during it), if one did.
    failed: Option<usize>,
    model: Model,
}

/// Run `ops` on `pool`, keeping the model, until the first error (the power cut).
fn execute(pool: &Pool, data: &CrashDataDevice, ops: &[Op], mut model: Model) -> Stopped {
    for (i, op) in ops.iter().enumerate() {
        if data.power_is_cut() {
            // The power went out during an operation that succeeded anyway: the passdown
            // of the blocks its durable commit freed, whose failure only costs space.
            return Stopped {
                failed: None,
                model,
            };
        }
        let generation = i as u64 + 1;
        let result = match op {
            Op::Write {
                volume,
                sector,
                count,
                fua,
            } => {
                let bytes = write_bytes(volume, *sector, *count, generation);
                let result = pool
                    .volume(volume)
                    .and_then(|v| v.write(sector * 512, &bytes, *fua));
                // Written (acknowledged or possibly, if it failed): a possible value.
                let sectors = model.get_mut(volume).expect("volume");
                for s in *sector..sector + count {
                    sectors[s as usize]
                        .pending
                        .push(SectorContent::Written(Stamp {
                            tag: tag_of(volume),
                            sector: s,
                            generation,
                        }));
                }
                if result.is_ok() && *fua {
                    flush_point(&mut model);
                }
                result
            }
            Op::Zeroes {
                volume,
                sector,
                count,
                ..
            }
            | Op::Discard {
                volume,
                sector,
                count,
            } => {
                let result = pool.volume(volume).and_then(|v| match op {
                    Op::Zeroes { may_unmap, .. } => {
                        v.write_zeroes(sector * 512, count * 512, *may_unmap, false)
                    }
                    _ => v.discard(sector * 512, count * 512),
                });
                let sectors = model.get_mut(volume).expect("volume");
                match &result {
                    Ok(()) => {
                        let actual = read_contents(pool, volume, *sector, *count);
                        for (k, a) in actual.into_iter().enumerate() {
                            let s = &mut sectors[*sector as usize + k];
                            let live = s.live();
                            let zeroes = matches!(op, Op::Zeroes { .. });
                            assert!(
                                a == SectorContent::Zero || (!zeroes && a == live),
                                "op {i} {op:?}: sector {} reads {a:?}, live {live:?}",
                                sector + k as u64
                            );
                            if a != live {
                                s.pending.push(a);
                            }
                        }
                    }
                    Err(_) => {
                        for s in *sector..sector + count {
                            sectors[s as usize].pending.push(SectorContent::Zero);
                        }
                    }
                }
                result
            }
            Op::Flush { volume } => {
                let result = pool.volume(volume).and_then(|v| v.flush());
                if result.is_ok() {
                    flush_point(&mut model);
                }
                result
            }
            Op::Commit => {
                let result = pool.commit();
                if result.is_ok() {
                    flush_point(&mut model);
                }
                result
            }
            Op::Create { name, size_bytes } => pool.create_volume(name, *size_bytes).map(|_| ()),
            Op::Snapshot { origin, name } => pool.snapshot(origin, name, false).map(|_| ()),
            Op::Delete { volume } => pool.delete_volume(volume),
            Op::Resize { volume, size_bytes } => pool
                .resize_volume(volume, *size_bytes, thin_pool::Shrink::DropData)
                .map(|_| ()),
            Op::GrowData { size_bytes } => {
                data.grow(*size_bytes);
                pool.grow_data(*size_bytes).map(|_| ())
            }
        };
        match result {
            Ok(()) => {
                if op.is_management() {
                    model = landed(&model, op);
                }
            }
            Err(e) => {
                assert!(
                    data_power_is_cut(pool),
                    "op {i} {op:?} failed without a power cut: {e}"
                );
                return Stopped {
                    failed: Some(i),
                    model,
                };
            }
        }
    }
    Stopped {
        failed: None,
        model,
    }
}

fn data_power_is_cut(pool: &Pool) -> bool {
    // A read of the data device fails once the power is out.
    let mut b = [0u8; 512];
    pool.data_device().read_at(0, &mut b).is_err()
}

/// A pool on a fresh device pair, formatted and set up (not counted as crash points).
struct Rig {
    parts: CrashParts,
    pool: Pool,
    model: Model,
}

fn rig(passdown: bool) -> Rig {
    let parts = CrashParts::new(METADATA_BLOCKS, DATA_BLOCKS * BLOCK);
    parts.data.set_discard_ignored(!PASSDOWN_WAITS_FOR_COMMIT);
    let pool = parts.format(BLOCK, options(passdown));
    pool.create_volume("v0", 4 * BLOCK).expect("create v0");
    pool.create_volume("v1", 3 * BLOCK).expect("create v1");
    let mut model = Model::new();
    model.insert("v0".into(), zero_sectors(4 * SECTORS_PER_BLOCK));
    model.insert("v1".into(), zero_sectors(3 * SECTORS_PER_BLOCK));
    Rig { parts, pool, model }
}

struct Checkers {
    tools: Vec<ThinTools>,
    dir: ScratchDir,
    tool_runs: u64,
}

/// Reopen one crash image and check it against the model. Returns an error message.
fn verify_image(
    image: CrashImage,
    stopped: &Stopped,
    ops: &[Op],
    passdown: bool,
    checkers: &mut Checkers,
    run_tools: bool,
) -> Result<(), String> {
    let tools = if run_tools {
        checkers.tool_runs += 1;
        Some((&checkers.tools[..], checkers.dir.join("image").clone()))
    } else {
        None
    };
    check_metadata(
        image.metadata.clone(),
        tools.as_ref().map(|(t, p)| (*t, p.as_path())),
    )
    .map_err(|e| format!("metadata of the crash image: {e}"))?;
    let pool = image
        .try_reopen(options(passdown))
        .map_err(|e| format!("reopen failed: {e}"))?;
    let listed: BTreeMap<String, u64> = pool
        .list()
        .into_iter()
        .map(|v| (v.name, v.size_bytes))
        .collect();
    let shape = |m: &Model| -> BTreeMap<String, u64> {
        m.iter()
            .map(|(n, s)| (n.clone(), s.len() as u64 * 512))
            .collect()
    };
    let mut candidates = vec![stopped.model.clone()];
    if let Some(op) = stopped
        .failed
        .map(|i| &ops[i])
        .filter(|op| op.is_management())
    {
        candidates.push(landed(&stopped.model, op));
    }
    let model = candidates
        .into_iter()
        .find(|m| shape(m) == listed)
        .ok_or_else(|| {
            format!(
                "volumes after reopen {listed:?} match neither {:?} nor the failed operation's result",
                shape(&stopped.model)
            )
        })?;
    for (name, sectors) in &model {
        let actual = read_contents(&pool, name, 0, sectors.len() as u64);
        for (i, (a, s)) in actual.iter().zip(sectors).enumerate() {
            if *a != s.durable && !s.pending.contains(a) {
                return Err(format!(
                    "{name} sector {i} (block {}) reads {a:?}; durable {:?}, written since {:?}",
                    i as u64 / SECTORS_PER_BLOCK,
                    s.durable,
                    s.pending
                ));
            }
        }
    }
    // Still usable: write, flush, and the index equals the trees.
    if let Some(name) = model.keys().next() {
        let v = pool.volume(name).map_err(|e| e.to_string())?;
        v.write(0, &write_bytes(name, 0, 8, u64::MAX), true)
            .map_err(|e| format!("write after reopen: {e}"))?;
    }
    pool.verify_index()
        .map_err(|e| format!("verify_index after reopen: {e}"))?;
    Ok(())
}

/// Crash `ops` at `points` (operation counts after the setup) in every mode.
fn crash_at(
    seed: u64,
    ops: &[Op],
    points: &[u64],
    passdown: bool,
    tool_samples: u64,
    checkers: &mut Checkers,
) -> u64 {
    let mut images = 0;
    let mut sample_rng = StdRng::seed_from_u64(seed ^ 0x7001);
    let total_images = points.len() as u64 * CrashMode::ALL.len() as u64;
    for &n in points {
        let rig = rig(passdown);
        rig.parts.power.set_cut_after(Some(n));
        let stopped = execute(&rig.pool, &rig.parts.data, ops, rig.model.clone());
        for (m, mode) in CrashMode::ALL.into_iter().enumerate() {
            let mut rng = StdRng::seed_from_u64(seed ^ n.wrapping_mul(0x9e37_79b9) ^ m as u64);
            let image = rig.parts.image(mode, &mut rng);
            let run_tools = sample_rng.gen_range(0..total_images) < tool_samples;
            images += 1;
            if let Err(e) = verify_image(image, &stopped, ops, passdown, checkers, run_tools) {
                if std::env::var("THINPOOL_TRACE").is_ok() {
                    for (i, op) in ops.iter().enumerate() {
                        eprintln!("op {i}: {op:?}");
                    }
                }
                panic!(
                    "seed {seed}, passdown {passdown}, cut after {n} device operations, {mode:?}, \
                     failed op {:?}: {e}",
                    stopped.failed.map(|i| (i, &ops[i]))
                );
            }
        }
        drop(rig);
    }
    images
}

/// The device operations of the setup and of the whole workload.
fn reference(ops: &[Op], passdown: bool) -> (u64, u64) {
    let rig = rig(passdown);
    let setup = rig.parts.power.operations();
    let stopped = execute(&rig.pool, &rig.parts.data, ops, rig.model.clone());
    assert!(stopped.failed.is_none());
    (setup, rig.parts.power.operations())
}

fn checkers(label: &str) -> Checkers {
    Checkers {
        tools: ThinTools::all(),
        dir: ScratchDir::new(label),
        tool_runs: 0,
    }
}

#[test]
fn power_cut_at_every_write_and_flush_of_small_workloads() {
    let (report, mut rng) = testkit::seed::seeded_rng();
    let workloads = testkit::seed::case_count(4);
    let mut checkers = checkers("engine-power-cut-small");
    let mut images = 0;
    for w in 0..workloads {
        let ops = generate(&mut rng, 24);
        let passdown = w % 2 == 0;
        let (setup, total) = reference(&ops, passdown);
        let points: Vec<u64> = (setup..=total).collect();
        images += crash_at(report.seed() ^ w, &ops, &points, passdown, 3, &mut checkers);
    }
    println!(
        "{workloads} workloads, {images} crash images, {} through both thin_check versions",
        checkers.tool_runs
    );
}

#[test]
fn power_cut_at_sampled_points_of_a_large_workload() {
    let (report, mut rng) = testkit::seed::seeded_rng();
    let mut checkers = checkers("engine-power-cut-large");
    let ops = generate(&mut rng, 300);
    let (setup, total) = reference(&ops, true);
    let samples = testkit::seed::case_count(40).min(total - setup + 1);
    let mut points: Vec<u64> = (0..samples).map(|_| rng.gen_range(setup..=total)).collect();
    points.sort_unstable();
    points.dedup();
    let images = crash_at(report.seed(), &ops, &points, true, 4, &mut checkers);
    println!(
        "{} device operations, {images} crash images, {} through both thin_check versions",
        total - setup,
        checkers.tool_runs
    );
}
