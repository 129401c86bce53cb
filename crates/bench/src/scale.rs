//! How costs grow with the number of mappings: three pools, each holding one volume of 64 KiB
//! blocks with 1K, 1M and 10M mappings (`--quick`: 1K, 16K and 64K), provisioned like the
//! [`super::mappings`] volume (`write_zeroes` without unmapping: real mappings, sparse data).
//! The 10M-mapping volume is 640 GiB virtual; its pool's metadata takes a few hundred MiB of
//! the scratch directory (`/dev/shm` by default) for the length of the section.
//!
//! - **Snapshot creation** of each volume, in turns (the order rotating every repetition),
//!   then, timed apart, the snapshot's **first open** (`Pool::volume`, which builds its
//!   index from its mapping tree: the per-mapping cost a snapshot no longer pays when it is
//!   made, paid only if it is used), each snapshot deleted again untimed; rows: the larger
//!   volumes against the 1K one.
//! - **Activation and resident memory**, in a child process per sample (`thinpool-bench
//!   --probe-activation DIR`, [`probe_activation`]): `Pool::open` (which runs the metadata
//!   check before a read-write open and walks every mapping tree to check it, building no
//!   index), then `Pool::volume` (the volume's first open, which builds its index), each
//!   timed, with `VmRSS` and `VmHWM` from `/proc/self/status` before, between and after. A
//!   fresh process holds nothing freed by earlier work, so the growth of `VmRSS` is what the
//!   open pool keeps. Rows: `Pool::open` alone and with the first open, against the 1K pool;
//!   the resident growth once the volume is open (its index in use) per mapped block
//!   against ARCHITECTURE.md's "Index memory" formula ([`index_formula_bytes`]); the
//!   largest pool's whole growth against that formula plus a full metadata block cache
//!   (`CACHE_BLOCKS_DEFAULT` blocks of 4 KiB: 64 MiB), the other thing that grows with the
//!   mappings, up to its bound; and what `Pool::open` alone keeps (the cache, no index).
//! - **`thinpool check` against `thin_check` 1.1.0** (`$THINPOOL_TOOLS_DIR/thin_check`) on
//!   the closed pools' metadata files, both as child processes under `/usr/bin/time` (for
//!   their peak RSS, `%M`), wall time measured here, which one goes first alternating. Both
//!   must exit 0. Skipped, with a note on stderr, without `THINPOOL_TOOLS_DIR` or
//!   `/usr/bin/time`.

mod check;

use super::dir::BenchDir;
use super::mappings::{mapping_label, provision};
use super::report::{Row, Target};
use super::{create_pool, progress, time, Sizes, BLOCK_SIZE_BYTES};
use anyhow::{bail, ensure, Context};
use std::path::Path;
use std::process::Command;
use std::time::Instant;
use thin_pool::{Pool, PoolOptions};

/// The volume in each pool.
const VOLUME: &str = "v";

/// Snapshot creation of the largest volume against the smallest: "flat" within this factor.
/// A snapshot's metadata work is O(1) (a new reference to the shared tree root, a commit),
/// and it gets no index until it is opened.
const SNAPSHOT_GROWTH_MAX: f64 = 2.0;

/// Activation of the 1M-mapping pool: well under a second (as the mappings section).
const ACTIVATION_1M_MAX_MS: f64 = 500.0;
/// Activation of the 10M-mapping pool: a linear cost may take ten times that, no more.
const ACTIVATION_10M_MAX_MS: f64 = 5000.0;

/// The metadata block cache of an open pool, at most: its blocks are 4 KiB.
const METADATA_CACHE_BYTES: u64 =
    persistent_data::block_manager::CACHE_BLOCKS_DEFAULT as u64 * 4096;

/// The resident growth of the largest pool's activation may exceed its index (the formula)
/// plus a full metadata cache by this factor (the rest of the open pool: threads, the
/// catalog, allocator slack).
const RSS_OVER_BOUND_MAX: f64 = 1.1;

/// `thinpool check` must take at most this share of `thin_check`'s time.
const CHECK_TIME_SHARE_MAX: f64 = 0.5;

/// The rows of the scale section.
pub fn run(dir: &BenchDir, sizes: &Sizes) -> anyhow::Result<Vec<Row>> {
    let counts = sizes.scale_mapping_counts;
    let names: Vec<String> = counts
        .iter()
        .map(|&count| format!("scale-{}", mapping_label(count)))
        .collect();
    let mut pools = Vec::new();
    for (&count, name) in counts.iter().zip(&names) {
        pools.push(provisioned_pool(dir, name, count)?);
    }
    let (snapshot_ms, first_open_ms) = measure_snapshots(dir, sizes, &pools, &counts)?;
    for pool in pools {
        pool.close()?;
    }
    let activation = measure_activations(dir, sizes, &names, &counts)?;

    // With --quick, only the largest pool and a few pairs: thin_check takes half a second
    // even on a small pool.
    let checked = if sizes.quick { counts.len() - 1 } else { 1 };
    let checks = match check::check_tools() {
        Some(tools) => Some(check::compare_checks(
            dir,
            sizes,
            &names[checked..],
            &counts[checked..],
            &tools,
        )?),
        None => None,
    };
    for name in &names {
        dir.remove_pool(name)?;
    }

    let mut rows = snapshot_rows(&counts, &snapshot_ms, &first_open_ms);
    rows.extend(activation_rows(&counts, &activation));
    rows.extend(memory_rows(&counts, &activation));
    if let Some(checks) = checks {
        rows.extend(check::rows(&counts[checked..], &checks));
    }
    Ok(rows)
}

/// Milliseconds per pool (in `counts`' order) per repetition.
type Samples = Vec<Vec<f64>>;

/// Snapshot creation of each pool's volume, in turns rotating every repetition, then the
/// snapshot's first open (which builds its index); the snapshot is deleted again untimed.
fn measure_snapshots(
    dir: &BenchDir,
    sizes: &Sizes,
    pools: &[Pool],
    counts: &[u64],
) -> anyhow::Result<(Samples, Samples)> {
    let mut snapshot_ms: Vec<Vec<f64>> = vec![Vec::new(); counts.len()];
    let mut first_open_ms: Vec<Vec<f64>> = vec![Vec::new(); counts.len()];
    for repetition in 0..sizes.repetition_count {
        dir.check_interrupted()?;
        for turn in 0..counts.len() {
            let which = (turn + repetition) % counts.len();
            let pool = &pools[which];
            let name = format!("snap-{repetition}");
            let (seconds, _) = time(|| Ok(pool.snapshot(VOLUME, &name, false)?))?;
            snapshot_ms[which].push(seconds * 1e3);
            ensure!(
                !pool.index_built(&name)?,
                "a new snapshot has its index built"
            );
            let (seconds, volume) = time(|| Ok(pool.volume(&name)?))?;
            first_open_ms[which].push(seconds * 1e3);
            drop(volume);
            pool.delete_volume(&name)?;
        }
        progress(&format!(
            "scale {}/{}: snapshot, first open {}",
            repetition + 1,
            sizes.repetition_count,
            per_count(counts, |i| format!(
                "{:.2} ms, {:.2} ms",
                snapshot_ms[i][repetition], first_open_ms[i][repetition]
            ))
        ));
    }
    Ok((snapshot_ms, first_open_ms))
}

/// Activation of each pool, each sample in a fresh process, in turns.
fn measure_activations(
    dir: &BenchDir,
    sizes: &Sizes,
    names: &[String],
    counts: &[u64],
) -> anyhow::Result<Vec<Vec<Activation>>> {
    let mut activation: Vec<Vec<Activation>> = vec![Vec::new(); counts.len()];
    for repetition in 0..sizes.repetition_count {
        dir.check_interrupted()?;
        for turn in 0..counts.len() {
            let which = (turn + repetition) % counts.len();
            activation[which].push(spawn_activation(&dir.pool_path(&names[which]))?);
        }
        progress(&format!(
            "scale {}/{}: activation {}",
            repetition + 1,
            sizes.repetition_count,
            per_count(counts, |i| {
                let a = &activation[i][repetition];
                format!(
                    "open {:.1} ms (+{:.1} MiB), with the volume {:.1} ms, +{:.1} MiB resident (peak +{:.1})",
                    a.open_ms,
                    a.open_rss_growth_bytes() as f64 / (1 << 20) as f64,
                    a.ms,
                    a.rss_growth_bytes() as f64 / (1 << 20) as f64,
                    a.peak_growth_bytes() as f64 / (1 << 20) as f64
                )
            })
        ));
    }

    Ok(activation)
}

/// Snapshot creation and a snapshot's first open, the larger volumes against the smallest.
fn snapshot_rows(counts: &[u64], snapshot_ms: &Samples, first_open_ms: &Samples) -> Vec<Row> {
    let mut rows = Vec::new();
    let label = |i: usize| mapping_label(counts[i]);
    for i in 1..counts.len() {
        let row = Row::new(
            format!(
                "snapshot creation: {}-mapping volume vs {}-mapping volume",
                label(i),
                label(0)
            ),
            &snapshot_ms[i],
            &snapshot_ms[0],
            "ms",
        );
        // The target is on the largest volume: flat from the smallest to the largest.
        rows.push(if i == counts.len() - 1 {
            row.target(Target::RatioAtMost(SNAPSHOT_GROWTH_MAX))
        } else {
            row
        });
    }
    for i in 1..counts.len() {
        rows.push(Row::new(
            format!(
                "first open of a new snapshot (builds its index): {}-mapping volume vs {}",
                label(i),
                label(0)
            ),
            &first_open_ms[i],
            &first_open_ms[0],
            "ms",
        ));
    }
    rows
}

/// Activation alone and with the volume's first open, against the smallest pool.
fn activation_rows(counts: &[u64], activation: &[Vec<Activation>]) -> Vec<Row> {
    let mut rows = Vec::new();
    let label = |i: usize| mapping_label(counts[i]);
    for i in 1..counts.len() {
        let open_ms = |i: usize| -> Vec<f64> { activation[i].iter().map(|a| a.open_ms).collect() };
        rows.push(Row::new(
            format!(
                "activation in a new process (Pool::open alone: check and tree walk, no index): {}-mapping pool vs {}",
                label(i),
                label(0)
            ),
            &open_ms(i),
            &open_ms(0),
            "ms",
        ));
        let ms = |i: usize| -> Vec<f64> { activation[i].iter().map(|a| a.ms).collect() };
        let max_ms = if i == counts.len() - 1 {
            ACTIVATION_10M_MAX_MS
        } else {
            ACTIVATION_1M_MAX_MS
        };
        rows.push(
            Row::new(
                format!(
                    "activation in a new process (Pool::open + the volume's first open, building its index): {}-mapping pool vs {}",
                    label(i),
                    label(0)
                ),
                &ms(i),
                &ms(0),
                "ms",
            )
            .target(Target::ABelow(max_ms)),
        );
    }
    rows
}

/// What an activation keeps resident, against the index formula and the metadata cache.
fn memory_rows(counts: &[u64], activation: &[Vec<Activation>]) -> Vec<Row> {
    let mut rows = Vec::new();
    let label = |i: usize| mapping_label(counts[i]);
    // Memory per mapped block beyond the smallest pool, once its volume is open: what the
    // fixed part of an open pool (threads, the catalog) costs cancels out, leaving the cost
    // per mapping: the index of the volume in use, and the metadata blocks the open read
    // into its cache (bounded).
    for i in 1..counts.len() {
        let extra_blocks = (counts[i] - counts[0]) as f64;
        let measured: Vec<f64> = activation[i]
            .iter()
            .zip(&activation[0])
            .map(|(large, small)| {
                (large.rss_growth_bytes() as f64 - small.rss_growth_bytes() as f64).max(0.0)
                    / extra_blocks
            })
            .collect();
        let formula_bytes =
            (index_formula_bytes(counts[i]) - index_formula_bytes(counts[0])) as f64;
        let formula = vec![formula_bytes / extra_blocks; measured.len()];
        rows.push(Row::new(
            format!(
                "resident memory kept after activation and the volume's first open, per mapped \
                 block: {}-mapping pool (beyond the {} one) vs the index formula",
                label(i),
                label(0)
            ),
            &measured,
            &formula,
            "bytes/block",
        ));
    }
    rows.extend(largest_memory_rows(counts, activation));
    rows
}

/// The largest pool's whole resident growth against the index formula plus a full metadata
/// cache, and what `Pool::open` alone keeps.
fn largest_memory_rows(counts: &[u64], activation: &[Vec<Activation>]) -> Vec<Row> {
    let mut rows = Vec::new();
    let label = |i: usize| mapping_label(counts[i]);
    // The whole growth of the largest pool against the index formula plus a full metadata
    // block cache: nothing else may grow with the mappings.
    let last = counts.len() - 1;
    let mib = |bytes: f64| bytes / (1 << 20) as f64;
    let grown: Vec<f64> = activation[last]
        .iter()
        .map(|a| mib(a.rss_growth_bytes() as f64))
        .collect();
    let bound = mib((index_formula_bytes(counts[last]) + METADATA_CACHE_BYTES) as f64);
    rows.push(
        Row::new(
            format!(
                "resident memory kept after activation and the volume's first open: {}-mapping \
                 pool vs its index formula + a full metadata cache ({} MiB)",
                label(last),
                METADATA_CACHE_BYTES >> 20
            ),
            &grown,
            &vec![bound; grown.len()],
            "MiB",
        )
        .target(Target::RatioAtMost(RSS_OVER_BOUND_MAX)),
    );
    // What `Pool::open` alone keeps: no index, so at most the metadata cache and the fixed
    // part of an open pool.
    let opened: Vec<f64> = activation[last]
        .iter()
        .map(|a| mib(a.open_rss_growth_bytes() as f64))
        .collect();
    let cache = mib(METADATA_CACHE_BYTES as f64);
    rows.push(Row::new(
        format!(
            "resident memory kept by Pool::open alone (no index built): {}-mapping pool vs \
             a full metadata cache ({} MiB)",
            label(last),
            METADATA_CACHE_BYTES >> 20
        ),
        &opened,
        &vec![cache; opened.len()],
        "MiB",
    ));
    rows
}

/// A fresh pool `name` with one volume of `count` mapped blocks.
fn provisioned_pool(dir: &BenchDir, name: &str, count: u64) -> anyhow::Result<Pool> {
    let volume_bytes = count * BLOCK_SIZE_BYTES;
    // Room for the volume and for a few blocks more.
    let pool = create_pool(
        dir,
        name,
        volume_bytes + 16 * BLOCK_SIZE_BYTES,
        BLOCK_SIZE_BYTES,
    )?;
    pool.create_volume(VOLUME, volume_bytes)?;
    progress(&format!("scale: provisioning {count} mappings"));
    let (seconds, ()) = time(|| provision(dir, &pool, VOLUME))?;
    let mapped = pool.info(VOLUME)?.mapped_blocks;
    ensure!(
        mapped == count,
        "the volume maps {mapped} blocks, expected {count}"
    );
    progress(&format!(
        "scale: {count} mappings in {seconds:.1} s ({:.0} provisions/s)",
        count as f64 / seconds
    ));
    Ok(pool)
}

/// "1K: x, 1M: y, 10M: z".
fn per_count(counts: &[u64], figure: impl Fn(usize) -> String) -> String {
    (0..counts.len())
        .map(|i| format!("{}: {}", mapping_label(counts[i]), figure(i)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// RAM of the index of a volume whose blocks `0..count` are mapped, by ARCHITECTURE.md's
/// formula: `4096 × leaves + 8192 × nodes + 16 × root slots`. The leaves hold 512 blocks
/// each; each of the three node levels 512 children; one root slot per 2^36 blocks.
pub(crate) fn index_formula_bytes(count: u64) -> u64 {
    let leaves = count.div_ceil(512);
    let node1 = leaves.div_ceil(512);
    let node2 = node1.div_ceil(512);
    let node3 = node2.div_ceil(512);
    let roots = count.div_ceil(1 << 36);
    4096 * leaves + 8192 * (node1 + node2 + node3) + 16 * roots
}

/// One activation measured in a child process.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Activation {
    /// Milliseconds for `Pool::open` alone.
    open_ms: f64,
    /// Milliseconds for `Pool::open` and `Pool::volume` (the volume's first open, which
    /// builds its index).
    ms: f64,
    /// `VmRSS` before, after `Pool::open` and after `Pool::volume`, in KiB.
    rss_before_kib: u64,
    rss_open_kib: u64,
    rss_after_kib: u64,
    /// `VmHWM` (peak resident) before and after, in KiB.
    hwm_before_kib: u64,
    hwm_after_kib: u64,
}

impl Activation {
    fn rss_growth_bytes(&self) -> u64 {
        self.rss_after_kib.saturating_sub(self.rss_before_kib) << 10
    }

    /// Growth by `Pool::open` alone (no index built).
    fn open_rss_growth_bytes(&self) -> u64 {
        self.rss_open_kib.saturating_sub(self.rss_before_kib) << 10
    }

    /// Growth of the peak: above [`Activation::rss_growth_bytes`] if the open freed memory
    /// (the check's cache, the load's bitmaps) that it did not reuse.
    fn peak_growth_bytes(&self) -> u64 {
        self.hwm_after_kib.saturating_sub(self.rss_before_kib) << 10
    }
}

/// `thinpool-bench --probe-activation DIR`: open the pool in `dir`, then its volume (which
/// builds the volume's index), print one [`Activation`] as JSON on stdout, close the pool.
pub(crate) fn probe_activation(dir: &Path) -> anyhow::Result<()> {
    let (rss_before_kib, hwm_before_kib) = memory_status()?;
    let started = Instant::now();
    let pool = Pool::open(dir, PoolOptions::default())
        .with_context(|| format!("opening {}", dir.display()))?;
    let open_ms = started.elapsed().as_secs_f64() * 1e3;
    let (rss_open_kib, _) = memory_status()?;
    ensure!(
        !pool.index_built(VOLUME)?,
        "Pool::open built the volume's index"
    );
    // Timed apart: the reads of /proc in between are not the pool's.
    let started = Instant::now();
    let volume = pool.volume(VOLUME)?;
    let ms = open_ms + started.elapsed().as_secs_f64() * 1e3;
    let (rss_after_kib, hwm_after_kib) = memory_status()?;
    drop(volume);
    pool.close()?;
    let activation = Activation {
        open_ms,
        ms,
        rss_before_kib,
        rss_open_kib,
        rss_after_kib,
        hwm_before_kib,
        hwm_after_kib,
    };
    println!("{}", serde_json::to_string(&activation)?);
    Ok(())
}

/// `VmRSS` and `VmHWM` of this process, in KiB.
fn memory_status() -> anyhow::Result<(u64, u64)> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let field = |name: &str| -> anyhow::Result<u64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .with_context(|| format!("no {name} in /proc/self/status"))?;
        let kib = line[name.len()..]
            .split_whitespace()
            .next()
            .with_context(|| format!("no figure in {line:?}"))?;
        Ok(kib.parse()?)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// Run [`probe_activation`] in a child process on the pool in `pool_dir`.
fn spawn_activation(pool_dir: &Path) -> anyhow::Result<Activation> {
    let exe = std::env::current_exe().context("finding the thinpool-bench binary")?;
    let output = Command::new(exe)
        .arg("--probe-activation")
        .arg(pool_dir)
        .output()
        .context("running the activation probe")?;
    if !output.status.success() {
        bail!(
            "the activation probe failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    serde_json::from_slice(&output.stdout).context("reading the activation probe's output")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_formula_matches_architecture_md() {
        // 1M mappings: 2048 leaves, 4 node1, 1 node2, 1 node3, one root slot.
        assert_eq!(index_formula_bytes(1 << 20), 2048 * 4096 + 6 * 8192 + 16);
        // About 8.03 bytes per block when full.
        let per_block = index_formula_bytes(10 << 20) as f64 / (10 << 20) as f64;
        assert!((8.0..8.1).contains(&per_block), "{per_block}");
    }
}
