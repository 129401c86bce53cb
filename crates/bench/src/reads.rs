//! Read comparisons: the engine's read path (`Volume::read`: index lookup, then `pread` of
//! the data block) against `pread` of the pool's data file at the same offsets.
//!
//! Each pool is fresh and its volume is filled in order by one writer, so virtual block `i`
//! lives in data block `i` and a volume offset is also a data-file offset: the baseline reads
//! exactly the bytes the engine reads. [`check_layout`] verifies that before measuring. The
//! baseline opens the data file on its own descriptor, read-only.

use super::dir::BenchDir;
use super::report::{Row, Target};
use super::{create_pool, fill, progress, Sizes, BLOCK_SIZE_BYTES, IO_SIZE_BYTES, SEED};
use anyhow::{bail, Context};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Barrier};
use thin_pool::DATA_FILE;
use thin_pool::{Pool, Volume};

use nbd::ExportRegistry;
use thinpool_daemon::export::PoolRegistry;
use thinpool_daemon::metrics::{CountingRegistry, Metrics, Op};

/// Data block size of the sequential-read pool: the first report's 8 MiB.
const SEQUENTIAL_BLOCK_SIZE_BYTES: u64 = 8 << 20;

/// Random reads at 1 and 2 threads, engine vs pread; the engine's added cost per read; and
/// how both scale from 1 to 2 threads.
pub fn random(dir: &BenchDir, sizes: &Sizes) -> anyhow::Result<Vec<Row>> {
    const POOL: &str = "random-reads";
    let volume_bytes = sizes.random_read_volume_bytes;
    progress(&format!(
        "random reads: filling a {} MiB volume (64 KiB blocks)",
        volume_bytes >> 20
    ));
    let (pool, volume, raw) = filled_volume(dir, POOL, volume_bytes, BLOCK_SIZE_BYTES, 16)?;
    let offsets: Vec<Vec<u64>> = (0..2)
        .map(|thread| random_offsets(volume_bytes, sizes.random_read_count, thread))
        .collect();

    // Per thread count: IOPS samples of the engine and of pread, and paired added costs.
    let mut engine = [Vec::new(), Vec::new()];
    let mut direct = [Vec::new(), Vec::new()];
    let mut added_ns = Vec::new();
    let reads = sizes.random_read_count as f64;
    let through_engine = |o: u64, buf: &mut [u8]| Ok(volume.read(o, buf)?);
    let through_pread = |o: u64, buf: &mut [u8]| Ok(raw.read_exact_at(buf, o)?);
    // Warm up both paths (CPU frequency, page tables of the data file).
    compare_reads(&offsets, through_engine, through_pread)?;
    for repetition in 0..sizes.repetition_count {
        dir.check_interrupted()?;
        // Alternate which thread count goes first, so the 2-vs-1 pairs see drift both ways.
        let counts = if repetition % 2 == 0 {
            [1usize, 2]
        } else {
            [2, 1]
        };
        for threads in counts {
            let seconds = compare_reads(&offsets[..threads], through_engine, through_pread)?;
            let total = reads * threads as f64;
            engine[threads - 1].push(total / seconds[0] / 1000.0);
            direct[threads - 1].push(total / seconds[1] / 1000.0);
            if threads == 1 {
                added_ns.push((seconds[0] - seconds[1]) / reads * 1e9);
            }
        }
        progress(&format!(
            "random reads {}/{}: engine {:.0}/{:.0} kIOPS, pread {:.0}/{:.0} kIOPS (1/2 threads)",
            repetition + 1,
            sizes.repetition_count,
            engine[0][repetition],
            engine[1][repetition],
            direct[0][repetition],
            direct[1][repetition]
        ));
    }
    let mut rows = random_rows(engine, direct, added_ns);
    rows.extend(many_threads(
        dir,
        sizes,
        volume_bytes,
        through_engine,
        through_pread,
    )?);
    drop(volume);
    pool.close()?;
    drop(pool);
    dir.remove_pool(POOL)?;
    Ok(rows)
}

/// Threads of the lock-convoy test, all on [`CONVOY_CPUS`] CPUs.
const CONVOY_THREADS: usize = 16;
/// CPUs the convoy test's threads are pinned to.
const CONVOY_CPUS: usize = 2;
/// Pairs of the convoy test with `--quick` (which must stay within 30 s): few, but each
/// long enough (twice the 1-thread reads) that the scheduler's time slices and the threads'
/// start even out; with half as many reads per run its ratio swung between 1.4 and 1.8 from
/// one idle run to the next.
const QUICK_CONVOY_REPETITIONS: usize = 5;

/// Random reads with 16 threads against 2, all pinned to the same 2 CPUs, through the
/// engine and through `pread`, the same total reads each time: with no lock on the read path
/// the 16 threads only time-share the CPUs and keep the 2-thread rate; a lock held across a
/// preemption would stall the other 15 (a convoy).
fn many_threads<A, B>(
    dir: &BenchDir,
    sizes: &Sizes,
    volume_bytes: u64,
    through_engine: A,
    through_pread: B,
) -> anyhow::Result<Vec<Row>>
where
    A: Fn(u64, &mut [u8]) -> anyhow::Result<()> + Sync,
    B: Fn(u64, &mut [u8]) -> anyhow::Result<()> + Sync,
{
    let cpus = first_cpus(CONVOY_CPUS)?;
    let (few_lists, many_lists) = (
        convoy_offsets(sizes, volume_bytes, CONVOY_CPUS),
        convoy_offsets(sizes, volume_bytes, CONVOY_THREADS),
    );
    let reads_of = |lists: &[Vec<u64>]| lists.iter().map(Vec::len).sum::<usize>() as f64;
    let (few_reads, many_reads) = (reads_of(&few_lists), reads_of(&many_lists));
    let few: Vec<&[u64]> = few_lists.iter().map(Vec::as_slice).collect();
    let many: Vec<&[u64]> = many_lists.iter().map(Vec::as_slice).collect();
    // kIOPS per repetition: [engine, pread] × [2 threads, 16 threads].
    let mut samples = [[Vec::new(), Vec::new()], [Vec::new(), Vec::new()]];
    run_reads_on(&few, &through_engine, Some(&cpus))?;
    let repetition_count = if sizes.quick {
        QUICK_CONVOY_REPETITIONS.min(sizes.repetition_count)
    } else {
        sizes.repetition_count
    };
    for repetition in 0..repetition_count {
        dir.check_interrupted()?;
        for turn in 0..4 {
            // Alternate the thread count inside each path, and the path first each time.
            let case = (turn + repetition) % 4;
            let (path, many_first) = (case / 2, case % 2);
            let seconds = |lists: &[&[u64]]| -> anyhow::Result<f64> {
                if path == 0 {
                    run_reads_on(lists, &through_engine, Some(&cpus))
                } else {
                    run_reads_on(lists, &through_pread, Some(&cpus))
                }
            };
            if many_first == 1 {
                samples[path][1].push(many_reads / seconds(&many)? / 1000.0);
            } else {
                samples[path][0].push(few_reads / seconds(&few)? / 1000.0);
            }
        }
        progress(&format!(
            "random reads on {CONVOY_CPUS} CPUs {}/{}: engine {:.0}/{:.0} kIOPS, pread {:.0}/{:.0} \
             kIOPS ({CONVOY_CPUS}/{CONVOY_THREADS} threads)",
            repetition + 1,
            repetition_count,
            samples[0][0][repetition],
            samples[0][1][repetition],
            samples[1][0][repetition],
            samples[1][1][repetition],
        ));
    }
    Ok(convoy_rows(&samples))
}

/// Offsets for `threads` threads reading at random: the same total as the 1-thread case,
/// split evenly (twice it with --quick, whose 1-thread runs are too short for 16 threads to
/// share 2 CPUs evenly), each thread with its own seed.
fn convoy_offsets(sizes: &Sizes, volume_bytes: u64, threads: usize) -> Vec<Vec<u64>> {
    let total = if sizes.quick {
        sizes.random_read_count * 2
    } else {
        sizes.random_read_count
    };
    (0..threads)
        .map(|thread| random_offsets(volume_bytes, total / threads, 100 + thread as u64))
        .collect()
}

/// The convoy rows from kIOPS samples `[engine, pread] × [2 threads, 16 threads]`.
fn convoy_rows(samples: &[[Vec<f64>; 2]; 2]) -> Vec<Row> {
    let [engine, direct] = samples;
    vec![
        Row::new(
            format!(
                "random 4 KiB reads through the engine on {CONVOY_CPUS} CPUs: \
                 {CONVOY_THREADS} threads vs {CONVOY_CPUS}"
            ),
            &engine[1],
            &engine[0],
            "kIOPS",
        )
        .target(Target::RatioAtLeast(0.9)),
        Row::new(
            format!(
                "random 4 KiB reads through pread on {CONVOY_CPUS} CPUs: \
                 {CONVOY_THREADS} threads vs {CONVOY_CPUS} (reference)"
            ),
            &direct[1],
            &direct[0],
            "kIOPS",
        ),
    ]
}

/// The first `count` CPUs this process may run on (fewer if it has fewer).
fn first_cpus(count: usize) -> anyhow::Result<rustix::thread::CpuSet> {
    let allowed = rustix::thread::sched_getaffinity(None).context("reading the CPU affinity")?;
    let mut chosen = rustix::thread::CpuSet::new();
    let mut taken = 0;
    for cpu in 0..rustix::thread::CpuSet::MAX_CPU {
        if taken == count {
            break;
        }
        if allowed.is_set(cpu) {
            chosen.set(cpu);
            taken += 1;
        }
    }
    Ok(chosen)
}

/// The random-read rows from the samples: IOPS of the engine and of pread at 1 and 2
/// threads (in thousands), and the engine's added cost per read in nanoseconds.
fn random_rows(engine: [Vec<f64>; 2], direct: [Vec<f64>; 2], added_ns: Vec<f64>) -> Vec<Row> {
    let [engine_1, engine_2] = &engine;
    let [direct_1, direct_2] = &direct;
    let direct_ns: Vec<f64> = direct_1.iter().map(|kiops| 1e6 / kiops).collect();
    vec![
        Row::new(
            "random 4 KiB reads, 1 thread: engine vs pread",
            engine_1,
            direct_1,
            "kIOPS",
        )
        .target(Target::RatioAtLeast(0.95)),
        Row::new(
            "random 4 KiB reads, 2 threads: engine vs pread",
            engine_2,
            direct_2,
            "kIOPS",
        )
        .target(Target::RatioAtLeast(0.95)),
        Row::new(
            "engine's added cost per random 4 KiB read (1 thread) vs a pread",
            &added_ns,
            &direct_ns,
            "ns/read",
        )
        .target(Target::RatioAtMost(0.05)),
        Row::new(
            "random 4 KiB reads through the engine: 2 threads vs 1",
            engine_2,
            engine_1,
            "kIOPS",
        )
        .target(Target::RatioAtLeast(1.9)),
        Row::new(
            "random 4 KiB reads through pread: 2 threads vs 1 (reference)",
            direct_2,
            direct_1,
            "kIOPS",
        ),
    ]
}

/// Sequential 4 KiB reads of a volume with 8 MiB data blocks (the first report's `dd`), engine
/// vs pread.
pub fn sequential(dir: &BenchDir, sizes: &Sizes) -> anyhow::Result<Vec<Row>> {
    const POOL: &str = "sequential-reads";
    let volume_bytes = sizes.sequential_read_volume_bytes;
    progress(&format!(
        "sequential reads: filling a {} MiB volume (8 MiB blocks)",
        volume_bytes >> 20
    ));
    let (pool, volume, raw) =
        filled_volume(dir, POOL, volume_bytes, SEQUENTIAL_BLOCK_SIZE_BYTES, 2)?;
    let offsets = vec![(0..volume_bytes)
        .step_by(IO_SIZE_BYTES)
        .collect::<Vec<u64>>()];
    let mut engine = Vec::new();
    let mut direct = Vec::new();
    let megabytes = volume_bytes as f64 / 1e6;
    let through_engine = |o: u64, buf: &mut [u8]| Ok(volume.read(o, buf)?);
    let through_pread = |o: u64, buf: &mut [u8]| Ok(raw.read_exact_at(buf, o)?);
    compare_reads(&offsets, through_engine, through_pread)?;
    for repetition in 0..sizes.repetition_count {
        dir.check_interrupted()?;
        let seconds = compare_reads(&offsets, through_engine, through_pread)?;
        engine.push(megabytes / seconds[0]);
        direct.push(megabytes / seconds[1]);
        progress(&format!(
            "sequential reads {}/{}: engine {:.0} MB/s, pread {:.0} MB/s",
            repetition + 1,
            sizes.repetition_count,
            engine[repetition],
            direct[repetition]
        ));
    }
    let row = Row::new(
        "sequential 4 KiB reads, 8 MiB blocks: engine vs pread",
        &engine,
        &direct,
        "MB/s",
    )
    .target(Target::RatioAtLeast(0.95));
    drop(volume);
    pool.close()?;
    drop(pool);
    dir.remove_pool(POOL)?;
    Ok(vec![row])
}

/// A fresh pool named `pool_name` with one volume of `volume_bytes`, in data blocks of
/// `block_size_bytes` (and `spare_blocks` more), filled in order; and the pool's data file,
/// open for the pread baseline, its layout checked.
fn filled_volume(
    dir: &BenchDir,
    pool_name: &str,
    volume_bytes: u64,
    block_size_bytes: u64,
    spare_blocks: u64,
) -> anyhow::Result<(Pool, Volume, File)> {
    let data_size_bytes = volume_bytes + spare_blocks * block_size_bytes;
    let pool = create_pool(dir, pool_name, data_size_bytes, block_size_bytes)?;
    pool.create_volume("reads", volume_bytes)?;
    let volume = pool.volume("reads")?;
    fill(dir, &volume)?;
    let raw = open_data_file(dir, pool_name)?;
    check_layout(&volume, &raw)?;
    Ok((pool, volume, raw))
}

fn open_data_file(dir: &BenchDir, pool: &str) -> anyhow::Result<File> {
    let path = match &dir.devices {
        Some(devices) => super::devices::data_path(devices),
        None => dir.pool_path(pool).join(DATA_FILE),
    };
    File::open(&path).with_context(|| format!("opening {}", path.display()))
}

/// `count` 4 KiB-aligned offsets in `0..size_bytes`, from a seed per thread.
fn random_offsets(size_bytes: u64, count: usize, thread: u64) -> Vec<u64> {
    let mut rng = SmallRng::seed_from_u64(SEED ^ thread);
    let slots = size_bytes / IO_SIZE_BYTES as u64;
    (0..count)
        .map(|_| rng.gen_range(0..slots) * IO_SIZE_BYTES as u64)
        .collect()
}

/// Check that the volume and the data file hold the same bytes at the same offsets, so the
/// baseline reads what the engine reads.
fn check_layout(volume: &Volume, raw: &File) -> anyhow::Result<()> {
    let mut through_engine = vec![0u8; IO_SIZE_BYTES];
    let mut direct = vec![0u8; IO_SIZE_BYTES];
    for offset in random_offsets(volume.size_bytes(), 64, 99) {
        volume.read(offset, &mut through_engine)?;
        raw.read_exact_at(&mut direct, offset)
            .with_context(|| format!("reading the data file at {offset}"))?;
        if through_engine != direct || through_engine[..8] != offset.to_le_bytes() {
            bail!("volume offset {offset} is not at the same data-file offset: cannot compare");
        }
    }
    Ok(())
}

/// Reads per thread in one slice of [`compare_reads`]: about 10 ms of work.
const SLICE_READS: usize = 10_000;

/// Seconds taken by `a` and by `b` to read 4 KiB at every offset, one thread per offset
/// list. The lists are cut into slices run alternately by `a` and `b` (which one goes first
/// alternates too), so drift in the machine's speed (frequency, other tenants) hits both
/// paths alike.
fn compare_reads<A, B>(offsets: &[Vec<u64>], a: A, b: B) -> anyhow::Result<[f64; 2]>
where
    A: Fn(u64, &mut [u8]) -> anyhow::Result<()> + Sync,
    B: Fn(u64, &mut [u8]) -> anyhow::Result<()> + Sync,
{
    let length = offsets.iter().map(Vec::len).min().unwrap_or(0);
    let mut seconds = [0.0; 2];
    for (slice, start) in (0..length).step_by(SLICE_READS).enumerate() {
        let end = (start + SLICE_READS).min(length);
        let lists: Vec<&[u64]> = offsets.iter().map(|l| &l[start..end]).collect();
        for turn in 0..2 {
            if (turn + slice) % 2 == 0 {
                seconds[0] += run_reads(&lists, &a)?;
            } else {
                seconds[1] += run_reads(&lists, &b)?;
            }
        }
    }
    Ok(seconds)
}

/// Seconds for one thread per offset list to read 4 KiB at each of its offsets, all threads
/// started together.
fn run_reads<F>(offsets: &[&[u64]], read: &F) -> anyhow::Result<f64>
where
    F: Fn(u64, &mut [u8]) -> anyhow::Result<()> + Sync,
{
    run_reads_on(offsets, read, None)
}

/// [`run_reads`], every thread pinned to `cpus` if given.
fn run_reads_on<F>(
    offsets: &[&[u64]],
    read: &F,
    cpus: Option<&rustix::thread::CpuSet>,
) -> anyhow::Result<f64>
where
    F: Fn(u64, &mut [u8]) -> anyhow::Result<()> + Sync,
{
    let start = Barrier::new(offsets.len() + 1);
    std::thread::scope(|scope| {
        let workers: Vec<_> = offsets
            .iter()
            .map(|&list| {
                let start = &start;
                scope.spawn(move || -> anyhow::Result<()> {
                    let mut buf = vec![0u8; IO_SIZE_BYTES];
                    let pinned = cpus.map(|cpus| rustix::thread::sched_setaffinity(None, cpus));
                    start.wait();
                    pinned.transpose().context("pinning a reader thread")?;
                    for &offset in list {
                        read(offset, &mut buf)
                            .with_context(|| format!("reading 4 KiB at {offset}"))?;
                    }
                    Ok(())
                })
            })
            .collect();
        start.wait();
        let started = std::time::Instant::now();
        for worker in workers {
            worker.join().expect("a reader thread panicked")?;
        }
        Ok(started.elapsed().as_secs_f64())
    })
}

/// Random reads through the export `serve` hands the NBD server for a volume, with the
/// request counting of `serve --metrics` ([`thinpool_daemon::metrics::CountingRegistry`]) and
/// without,
/// and against `pread`: what counting adds to the read path. Both threads of the 2-thread
/// case share one export, so they count into the same per-connection counters, as the
/// threads of one NBD connection do.
pub fn counted(dir: &BenchDir, sizes: &Sizes) -> anyhow::Result<Vec<Row>> {
    const POOL: &str = "counted-reads";
    let volume_bytes = sizes.random_read_volume_bytes;
    progress(&format!(
        "reads with metrics: filling a {} MiB volume (64 KiB blocks)",
        volume_bytes >> 20
    ));
    let (pool, volume, raw) = filled_volume(dir, POOL, volume_bytes, BLOCK_SIZE_BYTES, 16)?;
    drop(volume);
    let registry = Arc::new(PoolRegistry::new(pool.clone(), Vec::new())?);
    let metrics = Metrics::new(pool.clone(), Vec::new());
    let counting = CountingRegistry::new(Arc::clone(&registry) as _, Arc::clone(&metrics));
    let plain = registry.open("reads")?.context("no volume \"reads\"")?;
    let counted = counting.open("reads")?.context("no volume \"reads\"")?;
    let offsets: Vec<Vec<u64>> = (0..2)
        .map(|thread| random_offsets(volume_bytes, sizes.random_read_count, thread))
        .collect();
    let reads = sizes.random_read_count as f64;
    let through_counted = |o: u64, buf: &mut [u8]| Ok(counted.read_at(o, buf)?);
    let through_plain = |o: u64, buf: &mut [u8]| Ok(plain.read_at(o, buf)?);
    let through_pread = |o: u64, buf: &mut [u8]| Ok(raw.read_exact_at(buf, o)?);
    // Warm up both paths (two threads: both offset lists).
    compare_reads(&offsets, through_counted, through_plain)?;
    // kIOPS samples: counted vs pread (1 thread), counted vs plain (1 and 2 threads).
    let (mut counted_1, mut pread_1) = (Vec::new(), Vec::new());
    let mut counted_n = [Vec::new(), Vec::new()];
    let mut plain_n = [Vec::new(), Vec::new()];
    let mut counted_reads = reads * 2.0;
    for repetition in 0..sizes.repetition_count {
        dir.check_interrupted()?;
        let seconds = compare_reads(&offsets[..1], through_counted, through_pread)?;
        counted_1.push(reads / seconds[0] / 1000.0);
        pread_1.push(reads / seconds[1] / 1000.0);
        for threads in [1usize, 2] {
            let seconds = compare_reads(&offsets[..threads], through_counted, through_plain)?;
            let total = reads * threads as f64;
            counted_n[threads - 1].push(total / seconds[0] / 1000.0);
            plain_n[threads - 1].push(total / seconds[1] / 1000.0);
        }
        counted_reads += reads * 4.0;
        progress(&format!(
            "reads with metrics {}/{}: counted {:.0} kIOPS, pread {:.0}; counted {:.0}/{:.0}, \
             not counted {:.0}/{:.0} (1/2 threads)",
            repetition + 1,
            sizes.repetition_count,
            counted_1[repetition],
            pread_1[repetition],
            counted_n[0][repetition],
            counted_n[1][repetition],
            plain_n[0][repetition],
            plain_n[1][repetition]
        ));
    }
    // The counting really ran: every read through `counted` is in the metrics.
    let sample = metrics.sample();
    let seen = sample.volumes.get("reads").map_or(0, |volume| {
        volume.totals.durations[Op::Read as usize].count()
    });
    if seen != counted_reads as u64 {
        bail!("the metrics counted {seen} reads of {counted_reads}");
    }
    let rows = counted_rows(&counted_1, &pread_1, &counted_n, &plain_n);
    drop((counted, plain, counting, registry, metrics));
    pool.close()?;
    drop(pool);
    dir.remove_pool(POOL)?;
    Ok(rows)
}

/// The rows of [`counted`] from its kIOPS samples (`counted_n`, `plain_n`: 1 and 2 threads).
fn counted_rows(
    counted_1: &[f64],
    pread_1: &[f64],
    counted_n: &[Vec<f64>; 2],
    plain_n: &[Vec<f64>; 2],
) -> Vec<Row> {
    vec![
        Row::new(
            "random 4 KiB reads, 1 thread: NBD export with metrics vs pread",
            counted_1,
            pread_1,
            "kIOPS",
        ),
        Row::new(
            "random 4 KiB reads, 1 thread: NBD export with metrics vs without",
            &counted_n[0],
            &plain_n[0],
            "kIOPS",
        )
        .target(Target::RatioAtLeast(0.95)),
        Row::new(
            "random 4 KiB reads, 2 threads: NBD export with metrics vs without",
            &counted_n[1],
            &plain_n[1],
            "kIOPS",
        )
        .target(Target::RatioAtLeast(0.95)),
    ]
}
