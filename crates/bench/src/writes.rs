//! Write comparisons: writes that provision a block (first writes, and writes breaking sharing
//! after a snapshot), each against the baseline that does the same I/O without thin mapping.
//!
//! - Whole-block (64 KiB) writes that provision put their data in a block of the data file
//!   never written before: a hole. On tmpfs (and most file systems) a write into a hole costs
//!   about 2.5× an overwrite for any writer, so their baseline is the same pass of *first
//!   writes into a fresh sparse raw file* on the same file system ([`Pass::run_raw`]), not
//!   overwrites: the ratio is what thin mapping adds, not what the file system charges for
//!   allocating. Each pair alternates which runs first.
//! - 4 KiB writes into 64 KiB blocks provision a whole block (zeroing or copying the other
//!   60 KiB), which is what those rows measure: their baseline stays the overwrite of the
//!   same blocks, which goes straight to the data device. First writes necessarily run
//!   before the overwrites of the same blocks, so these pairs cannot alternate order.
//!
//! Every pass writes each block of a volume once, in a fixed-seed random order: 64 KiB writes
//! cover whole blocks, 4 KiB writes land at a random 4 KiB slot of each block. A pass ends
//! with `Volume::flush` (a commit; `fdatasync` for the raw file), inside the timing:
//! provisioning is done when its mappings are durable. Every repetition uses a new volume
//! and a new raw file.

use super::dir::BenchDir;
use super::report::{Row, Target};
use super::{create_pool, fill, progress, time, Sizes, BLOCK_SIZE_BYTES, IO_SIZE_BYTES, SEED};
use anyhow::Context;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::Ordering;
use thin_pool::Volume;

/// One write per block: (offset, length).
struct Pass {
    writes: Vec<u64>,
    length_bytes: usize,
}

impl Pass {
    /// Whole blocks in a random order.
    fn whole_blocks(block_count: u64) -> Pass {
        let mut blocks: Vec<u64> = (0..block_count).collect();
        blocks.shuffle(&mut SmallRng::seed_from_u64(SEED));
        Pass {
            writes: blocks.into_iter().map(|b| b * BLOCK_SIZE_BYTES).collect(),
            length_bytes: BLOCK_SIZE_BYTES as usize,
        }
    }

    /// One 4 KiB write at a random slot of each block, blocks in a random order.
    fn small(block_count: u64) -> Pass {
        let mut rng = SmallRng::seed_from_u64(SEED ^ 4096);
        let mut blocks: Vec<u64> = (0..block_count).collect();
        blocks.shuffle(&mut rng);
        let slots = BLOCK_SIZE_BYTES / IO_SIZE_BYTES as u64;
        Pass {
            writes: blocks
                .into_iter()
                .map(|b| b * BLOCK_SIZE_BYTES + rng.gen_range(0..slots) * IO_SIZE_BYTES as u64)
                .collect(),
            length_bytes: IO_SIZE_BYTES,
        }
    }

    fn client_bytes(&self) -> u64 {
        (self.writes.len() * self.length_bytes) as u64
    }

    /// Seconds to write the pass and flush.
    fn run(&self, volume: &Volume) -> anyhow::Result<f64> {
        let data = vec![0x5au8; self.length_bytes];
        let (seconds, ()) = time(|| {
            for &offset in &self.writes {
                volume
                    .write(offset, &data, false)
                    .with_context(|| format!("writing {} bytes at {offset}", data.len()))?;
            }
            volume.flush().context("flushing")?;
            Ok(())
        })?;
        Ok(seconds)
    }

    /// Seconds to write the pass into a new sparse file of `size_bytes` at `path` (every
    /// write lands in a hole, as a first write does in the data file) and `fdatasync` it;
    /// the file is removed afterwards.
    fn run_raw(&self, path: &Path, size_bytes: u64) -> anyhow::Result<f64> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .with_context(|| format!("creating {}", path.display()))?;
        file.set_len(size_bytes)
            .with_context(|| format!("sizing {}", path.display()))?;
        let data = vec![0x5au8; self.length_bytes];
        let (seconds, ()) = time(|| {
            for &offset in &self.writes {
                file.write_all_at(&data, offset)
                    .with_context(|| format!("writing {} bytes at {offset}", data.len()))?;
            }
            file.sync_data().context("fdatasync")?;
            Ok(())
        })?;
        drop(file);
        std::fs::remove_file(path).with_context(|| format!("removing {}", path.display()))?;
        Ok(seconds)
    }
}

/// The 64 KiB pass on `volume` (provisioning every block) and into a fresh raw file, in the
/// order `repetition` picks; returns (volume MB/s, raw file MB/s).
fn against_raw_first_writes(
    dir: &BenchDir,
    pass: &Pass,
    volume: &Volume,
    repetition: usize,
) -> anyhow::Result<(f64, f64)> {
    let megabytes = pass.client_bytes() as f64 / 1e6;
    let raw_path = dir.path().join("raw-first-writes");
    let size_bytes = volume.size_bytes();
    let (engine, raw) = if repetition.is_multiple_of(2) {
        let engine = pass.run(volume)?;
        (engine, pass.run_raw(&raw_path, size_bytes)?)
    } else {
        let raw = pass.run_raw(&raw_path, size_bytes)?;
        (pass.run(volume)?, raw)
    };
    Ok((megabytes / engine, megabytes / raw))
}

/// 64 KiB first writes vs the same first writes into a raw file; 4 KiB first writes vs
/// overwrites; bytes written per client byte.
pub fn first_and_over(dir: &BenchDir, sizes: &Sizes) -> anyhow::Result<Vec<Row>> {
    const POOL: &str = "first-writes";
    let volume_bytes = sizes.write_volume_bytes;
    let block_count = volume_bytes / BLOCK_SIZE_BYTES;
    let pool = create_pool(
        dir,
        POOL,
        2 * volume_bytes + 16 * BLOCK_SIZE_BYTES,
        BLOCK_SIZE_BYTES,
    )?;
    let large = Pass::whole_blocks(block_count);
    let small = Pass::small(block_count);
    let (mut first_large, mut raw_large) = (Vec::new(), Vec::new());
    let (mut first_small, mut over_small) = (Vec::new(), Vec::new());
    let mut written = Vec::new();
    for repetition in 0..sizes.repetition_count {
        dir.check_interrupted()?;
        let name = format!("first-large-{repetition}");
        pool.create_volume(&name, volume_bytes)?;
        let volume = pool.volume(&name)?;
        let (engine, raw) = against_raw_first_writes(dir, &large, &volume, repetition)?;
        first_large.push(engine);
        raw_large.push(raw);
        drop(volume);
        pool.delete_volume(&name)?;

        let name = format!("first-small-{repetition}");
        let (first, over, bytes, zeroed) =
            small_first_and_over(&pool, &small, &name, volume_bytes)?;
        first_small.push(first);
        over_small.push(over);
        written.push(bytes);
        progress(&format!(
            "first writes {}/{}: 64 KiB {:.0} vs {:.0} MB/s (vs raw file first writes), \
             4 KiB {:.1} vs {:.1} kIOPS (vs overwrites); 4 KiB first writes wrote {} MiB, \
             zeroed {} MiB",
            repetition + 1,
            sizes.repetition_count,
            first_large[repetition],
            raw_large[repetition],
            first_small[repetition],
            over_small[repetition],
            written[repetition] as u64 >> 20,
            zeroed >> 20,
        ));
    }
    let rows = first_write_rows(
        &first_large,
        &raw_large,
        &first_small,
        &over_small,
        &written,
        &small,
    );
    pool.close()?;
    drop(pool);
    dir.remove_pool(POOL)?;
    Ok(rows)
}

/// The rows of [`first_and_over`].
fn first_write_rows(
    first_large: &[f64],
    raw_large: &[f64],
    first_small: &[f64],
    over_small: &[f64],
    written: &[f64],
    small: &Pass,
) -> Vec<Row> {
    vec![
        Row::new(
            "random 64 KiB writes: first writes vs first writes into a raw file",
            first_large,
            raw_large,
            "MB/s",
        )
        .target(Target::RatioAtLeast(0.8)),
        Row::new(
            "random 4 KiB writes into 64 KiB blocks: first writes vs overwrites",
            first_small,
            over_small,
            "kIOPS",
        ),
        Row::new(
            "4 KiB first writes into 64 KiB blocks: data-device bytes written vs client bytes",
            written,
            &vec![small.client_bytes() as f64; written.len()],
            "bytes",
        )
        .target(Target::RatioAtMost(1.25)),
    ]
}

/// The 4 KiB pass on a new volume `name`, then again (overwrites); returns their kIOPS, and
/// the bytes the first pass wrote and zeroed on the data device.
fn small_first_and_over(
    pool: &thin_pool::Pool,
    small: &Pass,
    name: &str,
    volume_bytes: u64,
) -> anyhow::Result<(f64, f64, f64, u64)> {
    let counters = pool.data_device().counters();
    let small_kilo_writes = small.writes.len() as f64 / 1e3;
    pool.create_volume(name, volume_bytes)?;
    let volume = pool.volume(name)?;
    let (written_before, zeroed_before) = (
        counters.written(),
        counters.zeroed_bytes.load(Ordering::Relaxed),
    );
    let first = small_kilo_writes / small.run(&volume)?;
    let written = (counters.written() - written_before) as f64;
    let zeroed = counters.zeroed_bytes.load(Ordering::Relaxed) - zeroed_before;
    let over = small_kilo_writes / small.run(&volume)?;
    drop(volume);
    pool.delete_volume(name)?;
    Ok((first, over, written, zeroed))
}

/// 64 KiB writes breaking sharing after a snapshot vs the same first writes into a raw
/// file (each break writes a whole new block, into a hole of the data file); 4 KiB writes
/// breaking sharing vs overwrites.
pub fn sharing(dir: &BenchDir, sizes: &Sizes) -> anyhow::Result<Vec<Row>> {
    const POOL: &str = "sharing";
    let volume_bytes = sizes.write_volume_bytes;
    let block_count = volume_bytes / BLOCK_SIZE_BYTES;
    // The origin's blocks, their copies after the first snapshot, and after the second.
    let pool = create_pool(
        dir,
        POOL,
        3 * volume_bytes + 16 * BLOCK_SIZE_BYTES,
        BLOCK_SIZE_BYTES,
    )?;
    let counters = pool.data_device().counters();
    let large = Pass::whole_blocks(block_count);
    let small = Pass::small(block_count);
    let (mut break_large, mut raw_large) = (Vec::new(), Vec::new());
    let (mut break_small, mut over_small) = (Vec::new(), Vec::new());
    let small_kilo_writes = small.writes.len() as f64 / 1e3;
    for repetition in 0..sizes.repetition_count {
        dir.check_interrupted()?;
        let origin = format!("origin-{repetition}");
        let snapshots = [format!("{origin}-snap-1"), format!("{origin}-snap-2")];
        pool.create_volume(&origin, volume_bytes)?;
        let volume = pool.volume(&origin)?;
        fill(dir, &volume)?;
        pool.snapshot(&origin, &snapshots[0], true)?;
        let (engine, raw) = against_raw_first_writes(dir, &large, &volume, repetition)?;
        break_large.push(engine);
        raw_large.push(raw);
        pool.snapshot(&origin, &snapshots[1], true)?;
        let copied_before = counters.copied_bytes.load(Ordering::Relaxed);
        break_small.push(small_kilo_writes / small.run(&volume)?);
        let copied = counters.copied_bytes.load(Ordering::Relaxed) - copied_before;
        over_small.push(small_kilo_writes / small.run(&volume)?);
        drop(volume);
        for name in snapshots.iter().chain([&origin]) {
            pool.delete_volume(name)?;
        }
        progress(&format!(
            "breaking sharing {}/{}: 64 KiB {:.0} vs {:.0} MB/s (vs raw file first writes), \
             4 KiB {:.1} vs {:.1} kIOPS (vs overwrites); 4 KiB breaks copied {} MiB",
            repetition + 1,
            sizes.repetition_count,
            break_large[repetition],
            raw_large[repetition],
            break_small[repetition],
            over_small[repetition],
            copied >> 20,
        ));
    }
    let rows = vec![
        Row::new(
            "random 64 KiB writes after a snapshot: breaking sharing vs first writes into a raw file",
            &break_large,
            &raw_large,
            "MB/s",
        )
        .target(Target::RatioAtLeast(0.5)),
        Row::new(
            "random 4 KiB writes after a snapshot: breaking sharing (copies 60 KiB) vs overwrites",
            &break_small,
            &over_small,
            "kIOPS",
        ),
    ];
    pool.close()?;
    drop(pool);
    dir.remove_pool(POOL)?;
    Ok(rows)
}
