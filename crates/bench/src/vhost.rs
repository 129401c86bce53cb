//! `thinpool-bench vhost`: the vhost-user-blk front end side by side with its limit and its
//! peers, in one run (issue 23 item 6). The targets, each reading the same bytes (a raw file
//! filled with stamped 4 KiB sectors, and a thin volume holding a copy of it):
//!
//! - `pread`: direct `pread` of the raw file, a thread per queue, one read at a time each
//!   (the limit: no front end at all);
//! - `qsd vhost`: `qemu-storage-daemon`'s vhost-user-blk export of the raw file (the peer);
//! - `thin vhost`: the thin volume through `thinpool serve --vhost-user-blk` — only when the
//!   `thinpool` binary has that option (`thinpool serve --help`); otherwise the row is
//!   skipped with the reason printed;
//! - `raw vhost`: the raw export over vhost-user-blk, the data file itself served by the same
//!   front end (`thinpool-bench vhost-raw-serve`, [`vhost_raw`]): `÷ raw` of the thin rows is
//!   what thin mapping costs, as over NBD;
//! - `thin NBD`: the same volume through `thinpool serve`'s NBD socket (fio's nbd engine, a
//!   connection per queue, as `scripts/bench-compare` measures it).
//!
//! The vhost-user rows use the `blkio` crate as the load generator ([`vhost_load`]): one
//! connection per run, one thread per queue. Workloads: 4 KiB random and sequential reads at
//! QD1 and QD32, 1 MiB sequential reads at QD8, each on 1 and 2 queues (QD per queue).
//! Rounds are interleaved (every workload on every target in each round, the order of the
//! targets rotating per round); a row reports the medians over the rounds of IOPS, MB/s,
//! mean latency, the client's and the server's CPU time per I/O (user + system, from
//! `/proc/PID/stat`), the spread of its IOPS (interquartile range over the median) and the
//! median per-round ratio of its IOPS to `pread`'s; the thin-over-vhost rows also to the raw
//! export's (`÷ raw`) and to qemu-storage-daemon's (`÷ qsd`). The load average is printed
//! before and after: the machine is shared. The servers' poll time comes from
//! `THINPOOL_VHOST_POLL_US` (inherited by both thinpool servers).
//!
//! [`vhost_load`]: crate::vhost_load
//! [`vhost_raw`]: crate::vhost_raw

use crate::dir::BenchDir;
use crate::report::quantile;
use crate::vhost_load::{run_pread, run_vhost, Pattern, RunResult, Workload};
use crate::vhost_servers::{self as servers, Server, ThinPool};
use crate::{load_average, median, progress, SEED};
use anyhow::{bail, Context};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

/// Arguments of `thinpool-bench vhost`.
#[derive(clap::Args, Debug)]
pub struct VhostArgs {
    /// Put the files and sockets inside this directory (default: a fresh folder under /dev/shm).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Small sizes, short runs, 3 rounds.
    #[arg(long)]
    quick: bool,
    /// Print the rows as a JSON list instead of a table.
    #[arg(long)]
    json: bool,
    /// The targets to run (comma-separated): pread, qsd, raw-vhost, thin-vhost, thin-nbd.
    #[arg(
        long,
        value_name = "LIST",
        default_value = "pread,qsd,raw-vhost,thin-vhost,thin-nbd"
    )]
    targets: String,
    /// Interleaved rounds (default 5, 3 with --quick).
    #[arg(long, value_name = "N")]
    rounds: Option<usize>,
    /// Time of each run in milliseconds (default 1000, 200 with --quick).
    #[arg(long = "runtime-ms", value_name = "MS")]
    runtime_ms: Option<u64>,
    /// Size of the raw file and the volume (default 1G, 64M with --quick; whole MiB).
    #[arg(long, value_name = "SIZE")]
    size: Option<String>,
    /// Queue counts to run every workload with (comma-separated).
    #[arg(long, value_name = "LIST", default_value = "1,2")]
    queues: String,
    /// The `thinpool` binary for the thin targets (default: the one beside this binary).
    #[arg(long, value_name = "PATH")]
    thinpool: Option<PathBuf>,
    /// Use blkio's poll queues (busy-polling client) instead of completion eventfds.
    #[arg(long)]
    poll: bool,
}

/// A target, in the order of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    Pread,
    Qsd,
    RawVhost,
    ThinVhost,
    ThinNbd,
}

impl Target {
    const ALL: [Target; 5] = [
        Target::Pread,
        Target::Qsd,
        Target::RawVhost,
        Target::ThinVhost,
        Target::ThinNbd,
    ];

    fn key(self) -> &'static str {
        match self {
            Target::Pread => "pread",
            Target::Qsd => "qsd",
            Target::RawVhost => "raw-vhost",
            Target::ThinVhost => "thin-vhost",
            Target::ThinNbd => "thin-nbd",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Target::Pread => "direct pread of the file",
            Target::Qsd => "qemu-storage-daemon vhost-user-blk",
            Target::RawVhost => "raw export, vhost-user-blk",
            Target::ThinVhost => "thin volume, vhost-user-blk",
            Target::ThinNbd => "thin volume, NBD (fio)",
        }
    }
}

/// One run's figures.
#[derive(Clone, Copy, Debug)]
struct Sample {
    iops: f64,
    mb_per_s: f64,
    latency_us: f64,
    client_us_per_io: f64,
    server_us_per_io: Option<f64>,
}

/// The running servers and the files they serve.
struct Setup {
    image: PathBuf,
    file: File,
    qsd: Option<(Server, PathBuf)>,
    raw: Option<(Server, PathBuf)>,
    thin: Option<Server>,
    thin_vhost: Option<PathBuf>,
    thin_nbd: Option<PathBuf>,
    scratch: PathBuf,
}

/// The workloads, for each queue count.
fn workloads(queue_counts: &[usize]) -> Vec<Workload> {
    let shapes = [
        (Pattern::Random, 4096, 1),
        (Pattern::Random, 4096, 32),
        (Pattern::Sequential, 4096, 1),
        (Pattern::Sequential, 4096, 32),
        (Pattern::Sequential, 1 << 20, 8),
    ];
    let mut list = Vec::new();
    for &queues in queue_counts {
        for (pattern, request_bytes, depth) in shapes {
            list.push(Workload {
                pattern,
                request_bytes,
                depth,
                queues,
            });
        }
    }
    list
}

fn parse_list<T>(
    text: &str,
    what: &str,
    parse: impl Fn(&str) -> Option<T>,
) -> anyhow::Result<Vec<T>> {
    text.split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| parse(item).with_context(|| format!("{what}: unknown {item:?}")))
        .collect()
}

/// Runs the section.
pub fn run(args: VhostArgs) -> anyhow::Result<ExitCode> {
    let mut targets = parse_list(&args.targets, "--targets", |key| {
        Target::ALL.into_iter().find(|t| t.key() == key)
    })?;
    let queue_counts = parse_list(&args.queues, "--queues", |n| {
        n.parse().ok().filter(|&n| n >= 1)
    })?;
    let rounds = args.rounds.unwrap_or(if args.quick { 3 } else { 5 }).max(1);
    let runtime =
        Duration::from_millis(
            args.runtime_ms
                .unwrap_or(if args.quick { 200 } else { 1000 }),
        );
    let size = match &args.size {
        Some(text) => thinpool_daemon::pool_dir::parse_size(text)?,
        None if args.quick => 64 << 20,
        None => 1 << 30,
    };
    if size == 0 || size % (1 << 20) != 0 {
        bail!("--size: a whole number of MiB is needed");
    }
    let dir = BenchDir::create(args.dir.as_deref())?;
    let thinpool = args.thinpool.clone().unwrap_or_else(default_thinpool);
    available(&mut targets, &thinpool);
    let max_queues = queue_counts.iter().copied().max().unwrap_or(1);
    let mut setup = set_up(&dir, &targets, size, max_queues, &thinpool)?;
    let workloads = workloads(&queue_counts);
    progress(&format!(
        "vhost: {} workloads × {} targets, {rounds} rounds of {runtime:?} runs, {} MiB; load average {}",
        workloads.len(),
        targets.len(),
        size >> 20,
        load_average()
    ));
    let mut samples = vec![vec![Vec::new(); targets.len()]; workloads.len()];
    for round in 0..rounds {
        dir.check_interrupted()?;
        for (w, workload) in workloads.iter().enumerate() {
            for k in 0..targets.len() {
                let index = (k + round) % targets.len();
                let target = targets[index];
                let sample = measure(&mut setup, target, workload, runtime, args.poll)
                    .with_context(|| format!("{} on {}", workload.describe(), target.label()))?;
                samples[w][index].push(sample);
            }
        }
        progress(&format!(
            "round {} of {rounds} done; load average {}",
            round + 1,
            load_average()
        ));
    }
    tear_down(setup)?;
    let rows = summarize(&workloads, &targets, &samples);
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&rows)?)?;
    } else {
        write!(out, "{}", table(&rows))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Drops the thin targets this `thinpool` cannot run, printing why.
fn available(targets: &mut Vec<Target>, thinpool: &Path) {
    let wants_thin = targets
        .iter()
        .any(|t| matches!(t, Target::ThinVhost | Target::ThinNbd));
    if wants_thin && !thinpool.is_file() {
        progress(&format!(
            "no thinpool binary at {}: thin targets skipped",
            thinpool.display()
        ));
        targets.retain(|t| !matches!(t, Target::ThinVhost | Target::ThinNbd));
    }
    if targets.contains(&Target::ThinVhost) {
        if let Err(reason) = servers::thinpool_vhost_support(thinpool) {
            progress(&format!(
                "thin volume over vhost-user-blk skipped: {reason}"
            ));
            targets.retain(|&t| t != Target::ThinVhost);
        }
    }
}

/// `thinpool` beside this binary (both are built into the same target directory).
fn default_thinpool() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join("thinpool")))
        .unwrap_or_else(|| PathBuf::from("thinpool"))
}

/// Writes the raw file (every 4 KiB sector stamped with its offset) and starts the servers
/// the targets need; the thin volume gets the file's bytes through NBD.
fn set_up(
    dir: &BenchDir,
    targets: &[Target],
    size: u64,
    queues: usize,
    thinpool: &Path,
) -> anyhow::Result<Setup> {
    let image = dir.path().join("raw.img");
    write_stamped(&image, size)?;
    let file = File::open(&image).context("opening the raw file")?;
    let scratch = dir.path().to_path_buf();
    let qsd = if targets.contains(&Target::Qsd) {
        let socket = scratch.join("qsd.sock");
        let server = servers::start_qsd(&image, &socket, queues, &scratch.join("qsd.log"))?;
        Some((server, socket))
    } else {
        None
    };
    let raw = if targets.contains(&Target::RawVhost) {
        let socket = scratch.join("raw-vhost.sock");
        let log = scratch.join("raw-vhost.log");
        let server = servers::start_raw_vhost(&image, &socket, queues, &log)?;
        Some((server, socket))
    } else {
        None
    };
    let mut setup = Setup {
        image,
        file,
        qsd,
        raw,
        thin: None,
        thin_vhost: None,
        thin_nbd: None,
        scratch,
    };
    if targets
        .iter()
        .any(|t| matches!(t, Target::ThinVhost | Target::ThinNbd))
    {
        let pool = ThinPool::create(thinpool, &dir.pool_path("vhost"), size)?;
        let nbd = setup.scratch.join("thin-nbd.sock");
        let vhost = targets
            .contains(&Target::ThinVhost)
            .then(|| setup.scratch.join("thin-vhost.sock"));
        let server = pool.serve(
            &nbd,
            vhost.as_deref(),
            queues,
            &setup.scratch.join("serve.log"),
        )?;
        progress("filling the thin volume with the raw file's bytes (nbdcopy)");
        servers::nbdcopy_into(&setup.image, &servers::nbd_uri(&nbd))?;
        setup.thin = Some(server);
        setup.thin_vhost = vhost;
        setup.thin_nbd = Some(nbd);
    }
    Ok(setup)
}

fn tear_down(setup: Setup) -> anyhow::Result<()> {
    for (server, _) in setup.qsd.into_iter().chain(setup.raw) {
        server.stop()?;
    }
    if let Some(server) = setup.thin {
        server.stop()?;
    }
    Ok(())
}

/// Every 4 KiB sector starts with its offset (little-endian), the rest 0xa5: no zero pages,
/// and a misplaced read shows.
fn write_stamped(path: &Path, size: u64) -> anyhow::Result<()> {
    const CHUNK: u64 = 1 << 20;
    let mut file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut buffer = vec![0xa5u8; CHUNK as usize];
    let mut offset = 0;
    while offset < size {
        for (i, sector) in buffer.chunks_mut(4096).enumerate() {
            sector[..8].copy_from_slice(&(offset + i as u64 * 4096).to_le_bytes());
        }
        file.write_all(&buffer)?;
        offset += CHUNK;
    }
    file.sync_all()?;
    Ok(())
}

/// One run of `workload` on `target`.
fn measure(
    setup: &mut Setup,
    target: Target,
    workload: &Workload,
    runtime: Duration,
    poll: bool,
) -> anyhow::Result<Sample> {
    let size = setup.file.metadata()?.len();
    let server_pid = match target {
        Target::Pread => None,
        Target::Qsd => setup.qsd.as_ref().map(|(server, _)| server.pid()),
        Target::RawVhost => setup.raw.as_ref().map(|(server, _)| server.pid()),
        Target::ThinVhost | Target::ThinNbd => setup.thin.as_ref().map(Server::pid),
    };
    let server_before = server_pid
        .map(|pid| servers::cpu_seconds(Some(pid)))
        .transpose()?;
    let result: RunResult = match target {
        Target::Pread => run_pread(&setup.file, workload, runtime, SEED)?,
        Target::Qsd | Target::RawVhost => {
            let server = match target {
                Target::Qsd => &setup.qsd,
                _ => &setup.raw,
            };
            let socket = &server.as_ref().context("server not started")?.1;
            run_vhost(socket, &setup.file, workload, runtime, poll, SEED)?
        }
        Target::ThinVhost => {
            let socket = setup
                .thin_vhost
                .as_ref()
                .context("thin vhost not started")?;
            run_vhost(socket, &setup.file, workload, runtime, poll, SEED)?
        }
        Target::ThinNbd => {
            let socket = setup.thin_nbd.as_ref().context("thin NBD not started")?;
            let uri = servers::nbd_uri(socket);
            servers::run_fio_nbd(&uri, size, workload, runtime, &setup.scratch)?
        }
    };
    let server_cpu = match (server_pid, server_before) {
        (Some(pid), Some(before)) => Some(servers::cpu_seconds(Some(pid))? - before),
        _ => None,
    };
    let ios = result.ios.max(1) as f64;
    Ok(Sample {
        iops: result.ios as f64 / result.seconds,
        mb_per_s: result.bytes as f64 / result.seconds / 1e6,
        latency_us: result.latency_sum_s / ios * 1e6,
        client_us_per_io: result.client_cpu_s / ios * 1e6,
        server_us_per_io: server_cpu.map(|cpu| cpu / ios * 1e6),
    })
}

/// A row of the result: one workload on one target.
#[derive(serde::Serialize, Debug)]
struct Row {
    workload: String,
    target: &'static str,
    key: &'static str,
    rounds: usize,
    iops: f64,
    /// Interquartile range of the IOPS over their median.
    spread: f64,
    mb_per_s: f64,
    latency_us: f64,
    client_cpu_us_per_io: f64,
    server_cpu_us_per_io: Option<f64>,
    /// Median per-round ratio of IOPS to `pread`'s (null without a `pread` target).
    vs_pread: Option<f64>,
    /// Thin over vhost-user-blk only: the same ratio to the raw export over vhost-user-blk.
    vs_raw: Option<f64>,
    /// Thin over vhost-user-blk only: the same ratio to qemu-storage-daemon's export.
    vs_qsd: Option<f64>,
}

/// Median over the rounds of `runs`' IOPS over `other`'s (same round, same workload).
fn ratio(runs: &[Sample], other: &[Sample]) -> f64 {
    median(
        runs.iter()
            .zip(other)
            .map(|(a, b)| a.iops / b.iops)
            .collect(),
    )
}

fn summarize(workloads: &[Workload], targets: &[Target], samples: &[Vec<Vec<Sample>>]) -> Vec<Row> {
    let index = |wanted: Target| targets.iter().position(|&t| t == wanted);
    let (pread, raw, qsd) = (
        index(Target::Pread),
        index(Target::RawVhost),
        index(Target::Qsd),
    );
    let mut rows = Vec::new();
    for (w, workload) in workloads.iter().enumerate() {
        for (k, &target) in targets.iter().enumerate() {
            let runs = &samples[w][k];
            let figure = |f: fn(&Sample) -> f64| median(runs.iter().map(f).collect());
            let iops: Vec<f64> = runs.iter().map(|s| s.iops).collect();
            let iops_median = median(iops.clone());
            let spread = if iops_median > 0.0 {
                (quantile(&iops, 0.75) - quantile(&iops, 0.25)) / iops_median
            } else {
                0.0
            };
            let server: Vec<f64> = runs.iter().filter_map(|s| s.server_us_per_io).collect();
            let vs = |other: Option<usize>| other.map(|o| ratio(runs, &samples[w][o]));
            let thin_vhost = |other| {
                if target == Target::ThinVhost {
                    vs(other)
                } else {
                    None
                }
            };
            rows.push(Row {
                workload: workload.describe(),
                target: target.label(),
                key: target.key(),
                rounds: runs.len(),
                iops: iops_median,
                spread,
                mb_per_s: figure(|s| s.mb_per_s),
                latency_us: figure(|s| s.latency_us),
                client_cpu_us_per_io: figure(|s| s.client_us_per_io),
                server_cpu_us_per_io: (!server.is_empty()).then(|| median(server)),
                vs_pread: vs(pread),
                vs_raw: thin_vhost(raw),
                vs_qsd: thin_vhost(qsd),
            });
        }
    }
    rows
}

/// A Markdown table.
fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| workload | target | kIOPS (spread) | MB/s | mean latency µs | client CPU µs/I/O \
         | server CPU µs/I/O | ÷ pread | ÷ raw | ÷ qsd |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    let show = |value: Option<f64>, digits: usize| {
        value.map_or_else(|| "–".to_string(), |v| format!("{v:.digits$}"))
    };
    for row in rows {
        out.push_str(&format!(
            "| {} | {} | {:.1} ({:.2}) | {:.0} | {:.1} | {:.2} | {} | {} | {} | {} |\n",
            row.workload,
            row.target,
            row.iops / 1000.0,
            row.spread,
            row.mb_per_s,
            row.latency_us,
            row.client_cpu_us_per_io,
            show(row.server_cpu_us_per_io, 2),
            show(row.vs_pread, 3),
            show(row.vs_raw, 3),
            show(row.vs_qsd, 2),
        ));
    }
    out
}
