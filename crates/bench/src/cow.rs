//! Copy-on-write writes as `scripts/bench-compare` sends them through NBD: right after a
//! snapshot of a fully written volume, one 4 KiB write at the start of each 64 KiB block, in
//! order (fio's `rw=write:60k`), with no flush in the timing (fio's nbd engine sends none).
//! Each such write breaks sharing: a new block, the other 60 KiB copied, a mapping queued.
//!
//! Rows: those writes from one thread against overwrites of the same pattern right after
//! (the blocks are no longer shared: a plain `pwrite` each), which is what the raw export's
//! reference row in bench-compare measures, in kIOPS and in CPU time of the writing thread
//! per write (`CLOCK_THREAD_CPUTIME_ID`; on a busy machine the wall clock mostly says
//! how much of a CPU the thread got); and the same writes from two threads, each
//! taking every other block, against one thread: writes breaking sharing of different blocks
//! run in parallel (no pool-wide lock across the copy). Every repetition takes a new snapshot
//! of the same origin, so every block is shared again, and deletes the one before, committing
//! both before the timing: the mappings the writes queue are committed with the next
//! snapshot, and the blocks the deletion frees are passed down (punched) outside any timed
//! pass.

use super::dir::BenchDir;
use super::report::Row;
use super::{create_pool, fill, progress, Sizes, BLOCK_SIZE_BYTES, IO_SIZE_BYTES};
use anyhow::Context;
use std::sync::Barrier;
use std::time::Instant;
use thin_pool::Volume;

/// CPU time of the calling thread so far, in nanoseconds (`CLOCK_THREAD_CPUTIME_ID`):
/// unlike the wall clock, not stretched by other work on the machine.
fn thread_cpu_nanoseconds() -> anyhow::Result<u64> {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Ok(now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64)
}

/// What a pass took: wall-clock seconds, and CPU seconds of its writer threads.
struct Took {
    seconds: f64,
    cpu_seconds: f64,
}

/// Time `threads` threads writing 4 KiB at the start of every block, thread `t` taking
/// blocks `t, t + threads, ...` in order, all started together.
fn pass(volume: &Volume, block_count: u64, threads: u64) -> anyhow::Result<Took> {
    let start = Barrier::new(threads as usize + 1);
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|thread| {
                let start = &start;
                scope.spawn(move || -> anyhow::Result<u64> {
                    let data = vec![0x3cu8; IO_SIZE_BYTES];
                    start.wait();
                    let cpu_before = thread_cpu_nanoseconds()?;
                    for block in (thread..block_count).step_by(threads as usize) {
                        let offset = block * BLOCK_SIZE_BYTES;
                        volume
                            .write(offset, &data, false)
                            .with_context(|| format!("writing 4 KiB at {offset}"))?;
                    }
                    Ok(thread_cpu_nanoseconds()? - cpu_before)
                })
            })
            .collect();
        start.wait();
        let started = Instant::now();
        let mut cpu_nanoseconds = 0;
        for worker in workers {
            cpu_nanoseconds += worker.join().expect("a writer thread panicked")?;
        }
        Ok(Took {
            seconds: started.elapsed().as_secs_f64(),
            cpu_seconds: cpu_nanoseconds as f64 / 1e9,
        })
    })
}

/// 4 KiB writes breaking sharing, in order, 1 and 2 threads; kIOPS.
pub fn run(dir: &BenchDir, sizes: &Sizes) -> anyhow::Result<Vec<Row>> {
    const POOL: &str = "cow";
    let volume_bytes = sizes.write_volume_bytes;
    let block_count = volume_bytes / BLOCK_SIZE_BYTES;
    // The origin's blocks, and the copies of the live repetitions: a snapshot is deleted
    // (its blocks freed at the next commit) two repetitions after it was taken.
    let pool = create_pool(
        dir,
        POOL,
        4 * volume_bytes + 16 * BLOCK_SIZE_BYTES,
        BLOCK_SIZE_BYTES,
    )?;
    pool.create_volume("origin", volume_bytes)?;
    let volume = pool.volume("origin")?;
    progress(&format!(
        "copy-on-write: filling a {} MiB volume",
        volume_bytes >> 20
    ));
    fill(dir, &volume)?;
    let kilo_writes = block_count as f64 / 1e3;
    let (mut cow_1, mut over_1, mut cow_2) = (Vec::new(), Vec::new(), Vec::new());
    let (mut cow_cpu, mut over_cpu) = (Vec::new(), Vec::new());
    let per_write_microseconds = |took: &Took| took.cpu_seconds * 1e6 / block_count as f64;
    let mut snapshot = 0;
    for repetition in 0..sizes.repetition_count {
        dir.check_interrupted()?;
        snap(&pool, &mut snapshot)?;
        let (cow, over) = (
            pass(&volume, block_count, 1)?,
            pass(&volume, block_count, 1)?,
        );
        cow_1.push(kilo_writes / cow.seconds);
        over_1.push(kilo_writes / over.seconds);
        cow_cpu.push(per_write_microseconds(&cow));
        over_cpu.push(per_write_microseconds(&over));
        snap(&pool, &mut snapshot)?;
        cow_2.push(kilo_writes / pass(&volume, block_count, 2)?.seconds);
        progress(&format!(
            "copy-on-write {}/{}: 1 thread {:.1} kIOPS, {:.1} CPU µs per write (overwrites \
             {:.1}, {:.1} µs), 2 threads {:.1} kIOPS",
            repetition + 1,
            sizes.repetition_count,
            cow_1[repetition],
            cow_cpu[repetition],
            over_1[repetition],
            over_cpu[repetition],
            cow_2[repetition],
        ));
    }
    volume.flush().context("flushing")?;
    let rows = rows(&cow_1, &over_1, &cow_2, &cow_cpu, &over_cpu);
    drop(volume);
    pool.close()?;
    drop(pool);
    dir.remove_pool(POOL)?;
    Ok(rows)
}

/// The section's rows from its samples: kIOPS with 1 thread (breaking sharing and
/// overwrites) and 2, and CPU µs per write.
fn rows(
    cow_1: &[f64],
    over_1: &[f64],
    cow_2: &[f64],
    cow_cpu: &[f64],
    over_cpu: &[f64],
) -> Vec<Row> {
    vec![
        Row::new(
            "4 KiB copy-on-write writes in order, 1 thread: breaking sharing vs overwrites",
            cow_1,
            over_1,
            "kIOPS",
        ),
        Row::new(
            "4 KiB copy-on-write writes in order, 1 thread: CPU per write, breaking sharing vs \
             overwrites",
            cow_cpu,
            over_cpu,
            "µs",
        ),
        Row::new(
            "4 KiB copy-on-write writes in order: 2 threads vs 1",
            cow_2,
            cow_1,
            "kIOPS",
        ),
    ]
}

/// Takes snapshot number `*snapshot + 1` of the origin and deletes the one before, so one
/// snapshot shares every block of the origin; commits, untimed.
fn snap(pool: &thin_pool::Pool, snapshot: &mut usize) -> anyhow::Result<()> {
    // Keep one snapshot: the new one shares every block, the older one is deleted.
    *snapshot += 1;
    pool.snapshot("origin", &format!("snap-{}", *snapshot), true)?;
    if *snapshot > 1 {
        pool.delete_volume(&format!("snap-{}", *snapshot - 1))?;
    }
    // Commit now, untimed: the deletion frees the blocks the last pass copied away from,
    // and passing them down (holes punched in the data file) inside the next timed pass
    // would contend with its copies for the file's lock, which no NBD run of this
    // pattern does.
    pool.volume("origin")?
        .flush()
        .context("committing the deletion")?;
    Ok(())
}
