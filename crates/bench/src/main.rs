//! `thinpool-bench` (its own binary, so the production `thinpool` carries no benchmark code
//! and no `rand`): measure the engine against the raw data device, side by side, in one run.
//!
//! Each comparison builds its own pool in a scratch directory ([`dir::BenchDir`], default a
//! fresh folder under `/dev/shm`), runs the case under test (`a`) and its baseline (`b`) with
//! the same fixed-seed offsets, alternating which goes first where the measurement allows, in
//! pairs (A, B, A, B...), and reports the medians of `a` and `b`, the median of the per-pair
//! ratios and their spread (interquartile range over the median; see [`report`]). The
//! sections:
//!
//! - [`reads`]: random 4 KiB reads through `Volume::read` vs `pread` of the same data file,
//!   1 and 2 threads; sequential 4 KiB reads with 8 MiB data blocks; random reads through
//!   the NBD export with the request counting of `serve --metrics` and without.
//! - [`writes`]: 64 KiB first writes, and 64 KiB writes breaking sharing after a snapshot, vs
//!   the same first writes into a raw file; the 4 KiB ones vs overwrites; bytes written per
//!   client byte.
//! - [`cow`]: the copy-on-write pattern of `scripts/bench-compare` (a 4 KiB write at the start
//!   of each 64 KiB block after a snapshot, in order), 1 and 2 threads.
//! - [`mappings`]: snapshot, deletion and activation of a volume with 1M mappings.
//! - [`diff`]: `Pool::diff` of snapshots of a 1M-mapping volume differing in 1% and 10% of
//!   their blocks, against a full scan of both trees.
//! - [`scale`]: how snapshot creation, activation, resident memory and `thinpool check`
//!   (against `thin_check` 1.1.0) grow from 1K to 1M and 10M mappings. The full run leaves
//!   it out (it takes about 3 minutes); `--only scale` runs it, `--quick` runs it small.
//!
//! With `--metadata-device` and `--data-device` ([`devices`]) the pools are made on those
//! block devices and only the read comparisons run (engine vs `pread` of the device).
//!
//! Pools keep the engine's periodic commit thread at its default 1 s period, as dm-thin's
//! pool does. Timed writes end with a flush (a commit), so provisioning is measured up to
//! the point where its mappings are durable. `--quick` shrinks every size but takes 15 pairs
//! per row (the full run 5 larger ones), so the whole run aims at under 30 s and its ratios are
//! stable enough to compare between runs on an idle machine: check the `spread` column. Results go to stdout as a table, or as
//! JSON with `--json`; progress goes to stderr: a line per step, and one per row as it is
//! measured.
//!
//! `thinpool-bench vhost` ([`vhost`]) is the vhost-user-blk comparison: direct `pread`,
//! qemu-storage-daemon's vhost-user-blk export, the thin volume over vhost-user-blk and over
//! NBD, in interleaved rounds.
//!
//! **The one exception to the workspace's no-`unsafe` rule** is in this crate, in
//! [`vhost_load`]: the `blkio` crate (the vhost-user-blk load generator) returns completions
//! in a `&mut [MaybeUninit<Completion>]` slice, and reading the ones it filled needs
//! `assume_init_ref`. That one block (`vhost_load::completion_results`) carries a
//! `// SAFETY:` comment and `#[allow(unsafe_code)]`; everywhere else `unsafe` is denied
//! (`deny`, not `forbid`, so that the one `allow` is possible).
#![deny(unsafe_code)]

mod cow;
mod devices;
mod diff;
mod dir;
mod mappings;
mod reads;
mod report;
mod scale;
mod serve;
mod vhost;
mod vhost_load;
mod vhost_raw;
mod vhost_servers;
mod writes;

use anyhow::Context;
use dir::BenchDir;
use report::Row;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;
use thin_pool::{CreateOptions, Pool, PoolOptions, Volume};

/// thinpool-bench: the engine against the raw data device, side by side, in one run; or,
/// with `serve`, a pool served with the raw-file and null exports the NBD comparisons use.
#[derive(clap::Parser, Debug)]
#[command(
    name = "thinpool-bench",
    version,
    about,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: Args,
}

#[derive(clap::Subcommand, Debug)]
// Parsed once per process: the size of the largest variant (serve's arguments) costs nothing.
#[allow(clippy::large_enum_variant)]
enum Command {
    /// `thinpool serve` with the benchmark exports (--raw-export, --null-export) beside it.
    Serve(serve::ServeArgs),
    /// The vhost-user-blk comparison: direct pread, qemu-storage-daemon's vhost-user-blk
    /// export, the thin volume over vhost-user-blk (when `thinpool serve` has it) and NBD.
    Vhost(vhost::VhostArgs),
    /// The raw export over vhost-user-blk: the data file itself, for `vhost`'s thin ÷ raw.
    VhostRawServe(vhost_raw::RawServeArgs),
}

/// The benchmarks' arguments.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Build the pools inside this directory (default: a fresh folder under /dev/shm).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Small sizes, many pairs: the whole run aims at under 30 s (medians of 15 pairs per
    /// row on an idle machine).
    #[arg(long)]
    quick: bool,
    /// Print the rows as a JSON list instead of a table.
    #[arg(long)]
    json: bool,
    /// Pairs measured per row (default 5, 15 with --quick; a few sections take a multiple).
    /// Fewer pairs give wider spreads: `--quick --pairs 2` only shows that every row runs.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    pairs: Option<u16>,
    /// Run only the sections whose name starts with this (reads, writes, cow, mappings,
    /// diff, scale; the full run includes scale only when named).
    #[arg(long, value_name = "SECTION")]
    only: Option<String>,
    /// Size of the volumes the write sections (writes, cow) write (default 1G, 64M with
    /// --quick; a multiple of 64 KiB).
    #[arg(long = "write-size", value_name = "SIZE")]
    write_size: Option<String>,
    /// Run the read comparisons on a pool on this data block device (its contents are
    /// overwritten; --quick needs 160 MiB, else 2.1 GiB).
    #[arg(long = "data-device", value_name = "DEV", requires = "metadata_device")]
    data_device: Option<PathBuf>,
    /// The metadata block device for --data-device (overwritten).
    #[arg(long = "metadata-device", value_name = "DEV", requires = "data_device")]
    metadata_device: Option<PathBuf>,
    /// Open the data device with O_DIRECT (the pread baseline stays buffered).
    #[arg(long = "direct-io", requires = "data_device")]
    direct_io: bool,
    /// Internal: open the pool in DIR and its volume, print the time and memory it took as
    /// JSON, close it (the scale section runs this in a child process).
    #[arg(long = "probe-activation", value_name = "DIR", hide = true)]
    probe_activation: Option<PathBuf>,
}

/// How much work each section does.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sizes {
    /// `--quick`.
    pub quick: bool,
    /// Repetitions of every measurement (medians are reported).
    pub repetition_count: usize,
    /// Virtual size of the volume read at random.
    pub random_read_volume_bytes: u64,
    /// Random reads per thread per repetition.
    pub random_read_count: usize,
    /// Virtual size of the 8 MiB-block volume read sequentially.
    pub sequential_read_volume_bytes: u64,
    /// Virtual size of the volumes written.
    pub write_volume_bytes: u64,
    /// Mappings of the volume snapshotted, deleted and activated.
    pub mapping_count: u64,
    /// Mappings of the scale section's three volumes, smallest first.
    pub scale_mapping_counts: [u64; 3],
}

impl Sizes {
    fn new(quick: bool) -> Sizes {
        if quick {
            // Many small repetitions rather than a few large ones: the ratio is a median of
            // per-pair ratios, and its spread shrinks with the number of pairs.
            Sizes {
                quick,
                repetition_count: 15,
                random_read_volume_bytes: 128 << 20,
                random_read_count: 50_000,
                sequential_read_volume_bytes: 128 << 20,
                write_volume_bytes: 64 << 20,
                mapping_count: 1 << 15,
                scale_mapping_counts: [1 << 10, 1 << 14, 1 << 16],
            }
        } else {
            Sizes {
                quick,
                repetition_count: 5,
                random_read_volume_bytes: 2 << 30,
                random_read_count: 1_000_000,
                sequential_read_volume_bytes: 2 << 30,
                write_volume_bytes: 1 << 30,
                mapping_count: 1 << 20,
                scale_mapping_counts: [1 << 10, 1 << 20, 10 << 20],
            }
        }
    }
}

/// Data block size of every pool but the sequential-read one: dm-thin's common 64 KiB.
pub(crate) const BLOCK_SIZE_BYTES: u64 = 64 << 10;
/// The size of the reads and small writes.
pub(crate) const IO_SIZE_BYTES: usize = 4096;
/// Seed of every offset sequence, so each run does the same I/O.
pub(crate) const SEED: u64 = 0x7468_696e_706f_6f6c;

fn main() -> ExitCode {
    let cli = <Cli as clap::Parser>::parse();
    let result = match cli.command {
        Some(Command::Serve(args)) => serve::run(args),
        Some(Command::Vhost(args)) => vhost::run(args),
        Some(Command::VhostRawServe(args)) => vhost_raw::run(args),
        None => run(cli.run),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("thinpool-bench: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Run the benchmarks.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if let Some(pool_dir) = &args.probe_activation {
        scale::probe_activation(pool_dir)?;
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(only) = &args.only {
        check_only(only)?;
    }
    let mut dir = BenchDir::create(args.dir.as_deref())?;
    if let (Some(metadata), Some(data)) = (&args.metadata_device, &args.data_device) {
        dir.devices = Some(thin_pool::block_device::DevicePaths::new(
            metadata,
            data,
            args.direct_io,
        ));
    }
    let mut sizes = Sizes::new(args.quick);
    if let Some(pairs) = args.pairs {
        sizes.repetition_count = pairs.into();
    }
    if let Some(text) = &args.write_size {
        let bytes = thinpool_daemon::pool_dir::parse_size(text)?;
        if bytes == 0 || !bytes.is_multiple_of(BLOCK_SIZE_BYTES) {
            anyhow::bail!("--write-size {text}: a multiple of 64 KiB is needed");
        }
        sizes.write_volume_bytes = bytes;
    }
    let started = Instant::now();
    progress(&format!(
        "pools in {}, {} repetitions each; load average {}",
        dir.path().display(),
        sizes.repetition_count,
        load_average()
    ));
    let rows = run_sections(&args, &dir, &sizes)?;
    progress(&format!(
        "done in {:.1?}; load average {}",
        started.elapsed(),
        load_average()
    ));
    if args.json {
        println!("{}", report::json(&rows));
    } else {
        print!("{}", report::table(&rows));
    }
    drop(dir);
    Ok(ExitCode::SUCCESS)
}

/// The sections, in the order they run (`--only` names one of them, or a prefix).
const SECTIONS: [&str; 6] = ["reads", "writes", "cow", "mappings", "diff", "scale"];

/// Refuses an `--only` that selects no section (it would print an empty table and
/// succeed), naming the sections there are.
fn check_only(only: &str) -> anyhow::Result<()> {
    if only.is_empty() || !SECTIONS.iter().any(|section| section.starts_with(only)) {
        anyhow::bail!(
            "--only {only:?} names no section; the sections are: {}",
            SECTIONS.join(", ")
        );
    }
    Ok(())
}

/// The sections `--only` selects (all but scale by default; only the reads on block
/// devices), in order.
fn run_sections(args: &Args, dir: &BenchDir, sizes: &Sizes) -> anyhow::Result<Vec<Row>> {
    let mut rows: Vec<Row> = Vec::new();
    let wanted = |section: &str| {
        args.only
            .as_ref()
            .is_none_or(|only| section.starts_with(only.as_str()))
    };
    if wanted("reads") {
        finished(
            &mut rows,
            reads::random(dir, sizes).context("random reads")?,
        );
        finished(
            &mut rows,
            reads::sequential(dir, sizes).context("sequential reads")?,
        );
    }
    if wanted("reads") && dir.devices.is_none() {
        finished(
            &mut rows,
            reads::counted(dir, sizes).context("reads with metrics")?,
        );
    }
    if dir.devices.is_some() {
        progress("block devices: only the read comparisons run");
    } else {
        if wanted("writes") {
            finished(
                &mut rows,
                writes::first_and_over(dir, sizes).context("first writes")?,
            );
            finished(
                &mut rows,
                writes::sharing(dir, sizes).context("writes breaking sharing")?,
            );
        }
        if wanted("cow") {
            finished(
                &mut rows,
                cow::run(dir, sizes).context("copy-on-write writes")?,
            );
        }
        if wanted("mappings") {
            finished(
                &mut rows,
                mappings::run(dir, sizes).context("large volumes")?,
            );
        }
        if wanted("diff") {
            finished(&mut rows, diff::run(dir, sizes).context("diffs")?);
        }
        // At full size the scale section provisions 10M mappings (about 2.5 minutes, 1.4 GiB
        // of metadata): only when asked for by name; --quick runs it small.
        if wanted("scale") && (args.quick || args.only.is_some()) {
            finished(&mut rows, scale::run(dir, sizes).context("scale")?);
        }
    }
    Ok(rows)
}

/// Appends a section's rows to `rows`, with a progress line for each (a line per row as it
/// is measured: a long run is never silent between sections).
fn finished(rows: &mut Vec<Row>, new: Vec<Row>) {
    for (index, row) in new.iter().enumerate() {
        progress(&format!(
            "row {}: {} ({} vs {} {}, ratio {}, spread {:.1}%)",
            rows.len() + index + 1,
            row.name,
            report::figure(row.a),
            report::figure(row.b),
            row.unit,
            report::figure(row.ratio),
            row.spread * 100.0
        ));
    }
    rows.extend(new);
}

/// A progress line on stderr.
pub(crate) fn progress(message: &str) {
    eprintln!("bench: {message}");
}

/// The 1, 5 and 15-minute load averages: other work on the machine skews every figure.
pub(crate) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|text| {
            text.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|_| "unknown".to_string())
}

/// The median of some samples.
pub(crate) fn median(mut samples: Vec<f64>) -> f64 {
    assert!(!samples.is_empty(), "a median of no samples");
    samples.sort_by(f64::total_cmp);
    let middle = samples.len() / 2;
    if samples.len() % 2 == 1 {
        samples[middle]
    } else {
        (samples[middle - 1] + samples[middle]) / 2.0
    }
}

/// Seconds taken by `f`.
pub(crate) fn time<T>(f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<(f64, T)> {
    let started = Instant::now();
    let value = f()?;
    Ok((started.elapsed().as_secs_f64(), value))
}

/// Create a pool of `data_size_bytes` in the scratch directory, with default options (the
/// periodic commit thread on).
pub(crate) fn create_pool(
    dir: &BenchDir,
    name: &str,
    data_size_bytes: u64,
    block_size_bytes: u64,
) -> anyhow::Result<Pool> {
    if let Some(devices) = &dir.devices {
        return devices::create_pool_on(dir, devices, name, data_size_bytes, block_size_bytes);
    }
    let path = dir.pool_path(name);
    Pool::create(
        &path,
        &CreateOptions {
            data_size_bytes,
            block_size_bytes,
            metadata_size_bytes: None,
        },
        PoolOptions::default(),
    )
    .with_context(|| format!("creating a pool in {}", path.display()))
}

/// Write every byte of `volume` in order with 1 MiB writes of non-zero data (each 4 KiB
/// sector starts with its offset), then flush. One writer in order, so on a fresh pool
/// virtual block `i` gets data block `i`.
pub(crate) fn fill(dir: &BenchDir, volume: &Volume) -> anyhow::Result<()> {
    const CHUNK_BYTES: u64 = 1 << 20;
    let size = volume.size_bytes();
    let mut buf = vec![0xa5u8; CHUNK_BYTES as usize];
    let mut offset = 0;
    while offset < size {
        if offset % (1 << 30) == 0 {
            dir.check_interrupted()?;
        }
        let n = CHUNK_BYTES.min(size - offset);
        for (i, sector) in buf[..n as usize].chunks_mut(IO_SIZE_BYTES).enumerate() {
            let stamp = offset + (i * IO_SIZE_BYTES) as u64;
            sector[..8].copy_from_slice(&stamp.to_le_bytes());
        }
        volume
            .write(offset, &buf[..n as usize], false)
            .with_context(|| format!("writing {n} bytes at {offset}"))?;
        offset += n;
    }
    volume.flush().context("flushing")?;
    Ok(())
}
