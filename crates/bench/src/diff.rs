//! Diffs of snapshots of a volume with 1M mappings (64 GiB virtual, 64 KiB blocks;
//! `--quick` uses fewer): `Pool::diff` when 1% and 10% of the blocks differ, against a full
//! scan of both trees (`Pool::delta`, which lists `same` ranges too and so reads every leaf,
//! as `thin_delta` does).
//!
//! Three snapshots of the provisioned volume are changed after they are taken:
//!
//! - 1% and 10% of the blocks in 16 MiB extents (256 blocks) at seeded random places, as
//!   file writes change a disk: the trees differ in about as many leaves as extents, so the
//!   diff's time should follow the difference (1% at about a tenth of 10%);
//! - 1% scattered, every 100th block: then nearly every leaf differs, and the diff costs
//!   about what the full scan does. This row shows what "proportional to the parts of the
//!   trees that differ" means.
//!
//! Changed blocks are rewritten with whole-block zero writes that allocate (no copy), so a
//! snapshot's change costs one provisioning per block.

use super::dir::BenchDir;
use super::report::{Row, Target};
use super::{create_pool, progress, time, Sizes, BLOCK_SIZE_BYTES, SEED};
use anyhow::{ensure, Context};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use thin_pool::Pool;

/// Blocks in one changed extent: 16 MiB of 64 KiB blocks.
const EXTENT_BLOCKS: u64 = 256;

/// The 1% diff must take at most this share of the 10% one.
const PROPORTION_MAX: f64 = 0.25;

/// Diffs are short (a 1% diff takes about a millisecond), so a busy machine's preemptions
/// weigh on one sample: take this many times the other sections' repetitions.
const REPETITION_FACTOR: usize = 5;

/// The rows of the diff section.
pub fn run(dir: &BenchDir, sizes: &Sizes) -> anyhow::Result<Vec<Row>> {
    const POOL: &str = "diff";
    let block_count = sizes.mapping_count;
    let volume_bytes = block_count * BLOCK_SIZE_BYTES;
    // The volume, and room for the changed blocks of the three snapshots (22%).
    let data_bytes = volume_bytes + volume_bytes / 4 + 16 * BLOCK_SIZE_BYTES;
    let pool = create_pool(dir, POOL, data_bytes, BLOCK_SIZE_BYTES)?;
    pool.create_volume("base", volume_bytes)?;
    progress(&format!("diff: provisioning {block_count} mappings"));
    super::mappings::provision(dir, &pool, "base")?;
    let cases = changed_blocks(block_count);
    for (name, blocks) in &cases {
        progress(&format!(
            "diff: snapshot {name:?}, {} blocks changed",
            blocks.len()
        ));
        pool.snapshot("base", name, false)?;
        change(dir, &pool, name, blocks)?;
    }
    let [one, ten, scattered, full] = measure(dir, sizes, &pool, &cases)?;
    // The diff lists exactly the changed blocks.
    for (name, blocks) in &cases {
        let diff = pool.diff("base", name, None)?;
        let listed: u64 = diff.ranges.iter().map(|r| r.length).sum();
        ensure!(
            listed == blocks.len() as u64,
            "diff base {name}: {listed} blocks listed, {} changed",
            blocks.len()
        );
    }
    pool.close()?;
    drop(pool);
    dir.remove_pool(POOL)?;
    Ok(rows(block_count, &one, &ten, &scattered, &full))
}

/// The blocks each snapshot changes: 1% and 10% of the volume in 16 MiB extents at
/// fixed-seed random places, and 1% as every 100th block.
fn changed_blocks(block_count: u64) -> [(&'static str, Vec<u64>); 3] {
    let extents = block_count.div_ceil(EXTENT_BLOCKS);
    let mut slots: Vec<u64> = (0..extents).collect();
    slots.shuffle(&mut SmallRng::seed_from_u64(SEED));
    let extent_blocks = |share: u64| -> Vec<u64> {
        let count = (extents * share / 100).max(1) as usize;
        let mut chosen = slots[..count].to_vec();
        chosen.sort_unstable();
        chosen
            .into_iter()
            .flat_map(|slot| slot * EXTENT_BLOCKS..((slot + 1) * EXTENT_BLOCKS).min(block_count))
            .collect()
    };
    [
        ("one", extent_blocks(1)),
        ("ten", extent_blocks(10)),
        ("scattered", (0..block_count).step_by(100).collect()),
    ]
}

/// Milliseconds per repetition of the three diffs and of the full scan (`Pool::delta`),
/// the order reversed every other repetition.
fn measure(
    dir: &BenchDir,
    sizes: &Sizes,
    pool: &Pool,
    cases: &[(&'static str, Vec<u64>); 3],
) -> anyhow::Result<[Vec<f64>; 4]> {
    let (mut one, mut ten, mut scattered, mut full) = (vec![], vec![], vec![], vec![]);
    let repetition_count = sizes.repetition_count * REPETITION_FACTOR;
    for repetition in 0..repetition_count {
        dir.check_interrupted()?;
        let mut measured = [0.0f64; 4];
        let mut order = [0usize, 1, 2, 3];
        if repetition % 2 == 1 {
            order.reverse();
        }
        for case in order {
            let (seconds, differing) = time(|| {
                Ok(match case {
                    3 => pool.delta("base", "one")?.ranges.len(),
                    _ => pool.diff("base", cases[case].0, None)?.ranges.len(),
                })
            })?;
            ensure!(differing > 0, "the diff found no difference");
            measured[case] = seconds * 1e3;
        }
        one.push(measured[0]);
        ten.push(measured[1]);
        scattered.push(measured[2]);
        full.push(measured[3]);
        progress(&format!(
            "diff {}/{}: 1% {:.2} ms, 10% {:.2} ms, 1% scattered {:.2} ms, full scan {:.2} ms",
            repetition + 1,
            repetition_count,
            measured[0],
            measured[1],
            measured[2],
            measured[3],
        ));
    }
    Ok([one, ten, scattered, full])
}

/// The section's rows.
fn rows(block_count: u64, one: &[f64], ten: &[f64], scattered: &[f64], full: &[f64]) -> Vec<Row> {
    let count = if block_count.is_multiple_of(1 << 20) {
        format!("{}M", block_count >> 20)
    } else {
        block_count.to_string()
    };
    vec![
        Row::new(
            format!("diff of {count}-mapping snapshots: 1% differ (16 MiB extents) vs full scan"),
            one,
            full,
            "ms",
        ),
        Row::new(
            format!("diff of {count}-mapping snapshots: 10% differ (16 MiB extents) vs full scan"),
            ten,
            full,
            "ms",
        ),
        Row::new(
            format!("diff of {count}-mapping snapshots: 1% vs 10% differ (16 MiB extents)"),
            one,
            ten,
            "ms",
        )
        .target(Target::RatioAtMost(PROPORTION_MAX)),
        Row::new(
            format!(
                "diff of {count}-mapping snapshots: 1% differ, every 100th block, vs full scan"
            ),
            scattered,
            full,
            "ms",
        ),
    ]
}

/// Rewrite `blocks` of snapshot `name` (breaking their sharing), in runs of consecutive
/// blocks, then flush.
fn change(dir: &BenchDir, pool: &Pool, name: &str, blocks: &[u64]) -> anyhow::Result<()> {
    let volume = pool.volume(name)?;
    let mut i = 0;
    while i < blocks.len() {
        if i % 65536 == 0 {
            dir.check_interrupted()?;
        }
        let mut end = i + 1;
        while end < blocks.len() && blocks[end] == blocks[end - 1] + 1 {
            end += 1;
        }
        let length = (end - i) as u64 * BLOCK_SIZE_BYTES;
        volume
            .write_zeroes(blocks[i] * BLOCK_SIZE_BYTES, length, false, false)
            .with_context(|| format!("rewriting {length} bytes at block {}", blocks[i]))?;
        i = end;
    }
    volume.flush().context("flushing")?;
    Ok(())
}
