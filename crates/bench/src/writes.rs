//! Write comparisons: writes that provision a block (first writes, and writes breaking sharing
//! after a snapshot) against overwrites of the same blocks, which go straight to the data
//! device.
//!
//! Every pass writes each block of a volume once, in a fixed-seed random order: 64 KiB writes
//! cover whole blocks, 4 KiB writes land at a random 4 KiB slot of each block. A pass ends
//! with `Volume::flush` (a commit), inside the timing: provisioning is done when its mappings
//! are durable. First writes necessarily run before the overwrites of the same blocks, so
//! these pairs cannot alternate order; every repetition uses a new volume.

use super::dir::BenchDir;
use super::report::{Row, Target};
use super::{create_pool, fill, progress, time, Sizes, BLOCK_SIZE_BYTES, IO_SIZE_BYTES, SEED};
use anyhow::Context;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
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
}

/// First writes vs overwrites, 64 KiB and 4 KiB; bytes written per client byte.
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
    let counters = pool.data_device().counters();
    let large = Pass::whole_blocks(block_count);
    let small = Pass::small(block_count);
    let (mut first_large, mut over_large) = (Vec::new(), Vec::new());
    let (mut first_small, mut over_small) = (Vec::new(), Vec::new());
    let mut written = Vec::new();
    let (large_megabytes, small_kilo_writes) = (
        large.client_bytes() as f64 / 1e6,
        small.writes.len() as f64 / 1e3,
    );
    for repetition in 0..sizes.repetition_count {
        dir.check_interrupted()?;
        let name = format!("first-large-{repetition}");
        pool.create_volume(&name, volume_bytes)?;
        let volume = pool.volume(&name)?;
        first_large.push(large_megabytes / large.run(&volume)?);
        over_large.push(large_megabytes / large.run(&volume)?);
        drop(volume);
        pool.delete_volume(&name)?;

        let name = format!("first-small-{repetition}");
        pool.create_volume(&name, volume_bytes)?;
        let volume = pool.volume(&name)?;
        let (written_before, zeroed_before) = (
            counters.written(),
            counters.zeroed_bytes.load(Ordering::Relaxed),
        );
        first_small.push(small_kilo_writes / small.run(&volume)?);
        written.push((counters.written() - written_before) as f64);
        let zeroed = counters.zeroed_bytes.load(Ordering::Relaxed) - zeroed_before;
        over_small.push(small_kilo_writes / small.run(&volume)?);
        drop(volume);
        pool.delete_volume(&name)?;
        progress(&format!(
            "first writes {}/{}: 64 KiB {:.0} vs {:.0} MB/s, 4 KiB {:.1} vs {:.1} kIOPS \
             (first vs over); 4 KiB first writes wrote {} MiB, zeroed {} MiB",
            repetition + 1,
            sizes.repetition_count,
            first_large[repetition],
            over_large[repetition],
            first_small[repetition],
            over_small[repetition],
            written[repetition] as u64 >> 20,
            zeroed >> 20,
        ));
    }
    let rows = vec![
        Row::new(
            "random 64 KiB writes: first writes vs overwrites",
            &first_large,
            &over_large,
            "MB/s",
        )
        .target(Target::RatioAtLeast(0.8)),
        Row::new(
            "random 4 KiB writes into 64 KiB blocks: first writes vs overwrites",
            &first_small,
            &over_small,
            "kIOPS",
        ),
        Row::new(
            "4 KiB first writes into 64 KiB blocks: data-device bytes written vs client bytes",
            &written,
            &vec![small.client_bytes() as f64; written.len()],
            "bytes",
        )
        .target(Target::RatioAtMost(1.25)),
    ];
    pool.close()?;
    drop(pool);
    dir.remove_pool(POOL)?;
    Ok(rows)
}

/// Writes breaking sharing after a snapshot vs overwrites, 64 KiB and 4 KiB.
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
    let (mut break_large, mut over_large) = (Vec::new(), Vec::new());
    let (mut break_small, mut over_small) = (Vec::new(), Vec::new());
    let (large_megabytes, small_kilo_writes) = (
        large.client_bytes() as f64 / 1e6,
        small.writes.len() as f64 / 1e3,
    );
    for repetition in 0..sizes.repetition_count {
        dir.check_interrupted()?;
        let origin = format!("origin-{repetition}");
        let snapshots = [format!("{origin}-snap-1"), format!("{origin}-snap-2")];
        pool.create_volume(&origin, volume_bytes)?;
        let volume = pool.volume(&origin)?;
        fill(dir, &volume)?;
        pool.snapshot(&origin, &snapshots[0], true)?;
        break_large.push(large_megabytes / large.run(&volume)?);
        over_large.push(large_megabytes / large.run(&volume)?);
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
            "breaking sharing {}/{}: 64 KiB {:.0} vs {:.0} MB/s, 4 KiB {:.1} vs {:.1} kIOPS \
             (breaking vs over); 4 KiB breaks copied {} MiB",
            repetition + 1,
            sizes.repetition_count,
            break_large[repetition],
            over_large[repetition],
            break_small[repetition],
            over_small[repetition],
            copied >> 20,
        ));
    }
    let rows = vec![
        Row::new(
            "random 64 KiB writes after a snapshot: breaking sharing vs overwrites",
            &break_large,
            &over_large,
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
