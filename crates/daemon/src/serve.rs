//! `thinpool serve`: serve every volume of a pool as an NBD export of the same name, on a Unix
//! socket (default `nbd.sock` in the pool directory, mode 0600) and, only when asked, on TCP
//! (127.0.0.1 unless an address is given), with the control socket beside it for management
//! while serving. With `--metrics ADDR:PORT`, Prometheus metrics over HTTP as well
//! (`serve/metrics.rs`, counted as `crate::metrics` describes).
//!
//! As a library: [`run`] is the command; [`Serving::start`] binds and serves without waiting
//! for a signal, so a test (or `thinpool-bench serve`, which adds its raw-file and null
//! exports as fixed exports) drives it in-process and stops it with [`Serving::stop`].
//!
//! The space options (`--low-water`, `--autoextend-*`, `--no-space-timeout`) override those
//! in `pool.json` for this run only.
//!
//! The default pool directory is created on first use, with one volume named `disk`, so that
//! `thinpool serve` works on a fresh machine.
//!
//! Who can reach the volumes: the Unix sockets are 0600, so only their owner (and root). TCP
//! has no authentication: on loopback every local user can read and write every volume (a
//! warning says so at start); a non-loopback address is refused before binding unless
//! `--insecure` is given. `--tcp-export NAME` limits what TCP serves (the Unix socket and TCP
//! are separate NBD servers, each with its own connection limits).
//! TLS (`--tls`, module `tls`) covers both sockets; with `--tls=require --tls-verify-peer`
//! only clients holding a certificate the configured CA signed get in, and TCP may then bind
//! any address without `--insecure`.
//!
//! Before the pool opens read-write its metadata is checked (thin_check's rules, as LVM runs
//! thin_check before activation): metadata that fails is not served, and the error lists
//! what the check found; `--skip-check` opens it regardless.
//!
//! Diagnostics go to the log (the binary's `logging`: stderr, timestamped, `-v`/`-q`/`RUST_LOG`);
//! the banner on stdout is the command's output. Under systemd (`systemd`): passed sockets
//! are served instead of new ones, readiness and stopping are notified; `--pid-file` and
//! `--read-only` (nothing written, every export read-only) serve other supervisors.
//!
//! `--vhost-user-blk VOLUME=PATH[,queues=N]` (module `vhost`) also attaches volumes to VMs
//! as vhost-user-blk devices, through the same front-end seam as NBD.
//!
//! SIGINT or SIGTERM stop the server within a bounded time whatever state the sockets are in:
//! the control socket closes (idle clients are cut, running requests get a few seconds), the
//! NBD listeners close and connections finish their requests (cut off after a grace period),
//! then the pool commits; each step says what it closed, and the last line says whether the
//! pool committed, could not (read-only), or failed to. A second signal, or a shutdown longer
//! than `SHUTDOWN_DEADLINE`, exits at once as a crash would.

use crate::control::{ControlServer, Target};
use crate::create::{create_pool, default_create_options};
use crate::export::{PoolRegistry, DEFAULT_VOLUME};
use crate::pool_dir::{format_size, PoolArg, PoolDir, StoredOptions};
use anyhow::{bail, Context};
use nbd::{Export, ExportRegistry};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use std::net::SocketAddr;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use thin_pool::Pool;

mod banner;
mod metrics;
mod served;
mod shutdown;
mod systemd;
mod tcp;
mod tls;
mod vhost;

use shutdown::*;
pub use tcp::parse_tcp_address;
use tcp::*;
use tls::TlsArgs;
pub use vhost::{parse_queues, parse_vhost_spec, VhostSpec};

/// Port used when `--tcp` names only an address.
pub const NBD_PORT: u16 = 10809;
/// Size of the volume made with a new default pool.
const DEFAULT_VOLUME_SIZE_BYTES: u64 = 16 << 30;
/// How long shutdown waits for NBD clients to finish before cutting them off.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// Arguments.
#[derive(clap::Args, Debug)]
/// `--help` ends with an example of TLS and one of space alerts and autoextend (flattened
/// argument groups cannot each add theirs: clap keeps one `after_help`).
#[command(after_help = format!("{}\n\n{}", tls::EXAMPLES, crate::space::SPACE_HELP_EXAMPLE))]
pub struct Args {
    #[command(flatten)]
    pool: PoolArg,
    /// NBD Unix socket to create [default: nbd.sock in the pool directory]. Under systemd, a
    /// Unix or TCP socket passed by socket activation (LISTEN_FDS) is served instead, and
    /// READY=1 / STOPPING=1 go to NOTIFY_SOCKET. Example: `systemd-socket-activate -l
    /// /run/thinpool/pool.sock thinpool serve --pool /srv/pool` (units in contrib/systemd).
    #[arg(long = "socket", value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Also listen on TCP: `PORT`, `ADDR:PORT` or `ADDR` (port 10809); a bare port binds
    /// 127.0.0.1 only. NBD over TCP has no authentication: every local user (and, on a
    /// non-loopback address, every host that reaches it) can read and write every volume.
    #[arg(long = "tcp", value_name = "ADDR:PORT")]
    tcp: Option<String>,
    /// Allow `--tcp` on a non-loopback address without TLS, so that anyone who can reach it
    /// can read and write every volume.
    #[arg(long = "insecure", requires = "tcp")]
    insecure: bool,
    /// Serve only export NAME on TCP (repeatable; a volume or raw export name, existing or
    /// not yet). Without it, TCP serves every export; the Unix socket always does.
    #[arg(long = "tcp-export", value_name = "NAME", requires = "tcp")]
    tcp_export: Vec<String>,
    /// Log only warnings and errors on stderr (the log's level is info otherwise; `RUST_LOG`,
    /// when set, replaces -v and -q). Example: `thinpool serve -q`.
    #[arg(short = 'q', long = "quiet", conflicts_with = "verbose")]
    pub quiet: bool,
    /// Log more: -v adds debug lines, -vv trace lines. Example: `thinpool serve -v`, or
    /// `RUST_LOG=info,nbd=debug thinpool serve` for one crate.
    #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Write the server's process id to FILE once its sockets listen, remove it on a clean
    /// shutdown; refused if FILE names a running process. Example:
    /// `--pid-file /run/thinpool/pool.pid`.
    #[arg(long = "pid-file", value_name = "FILE")]
    pid_file: Option<PathBuf>,
    /// Serve every export read-only, and open the pool without writing anything (no check,
    /// no commit, no catalog change); management requests are refused. Example:
    /// `thinpool serve --read-only --pool /srv/pool`.
    #[arg(long = "read-only")]
    pub read_only: bool,
    /// Log a commit (data flush included) that takes at least this long, at warn (0 logs
    /// every commit). Example: `--slow-commit-ms 250`.
    #[arg(
        long = "slow-commit-ms",
        value_name = "MILLISECONDS",
        default_value_t = 1000
    )]
    slow_commit_ms: u64,
    /// Most NBD connections served at once.
    #[arg(long = "connections-max", value_name = "N", default_value_t = nbd::Config::default().connections_max)]
    connections_max: usize,
    /// Most NBD connections from one peer (uid on the Unix socket, address on TCP).
    #[arg(long = "connections-per-peer-max", value_name = "N", default_value_t = nbd::Config::default().connections_per_peer_max)]
    connections_per_peer_max: usize,
    /// Open the pool without checking its metadata first (the check, thin_check's rules,
    /// refuses metadata that could make one volume's writes land on another's data; skip it
    /// only if you accept that risk).
    #[arg(long = "skip-check")]
    skip_check: bool,
    /// Close an NBD connection after this many seconds without a request.
    #[arg(long = "idle-timeout", value_name = "SECONDS", default_value_t = nbd::Config::default().idle_timeout.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    idle_timeout_seconds: u64,
    /// Longest time an NBD connection's thread spins, after answering the only request in
    /// flight, for the next one before it sleeps: saves a wake-up per request at queue depth
    /// one. A connection spins only while that measurably brings its requests sooner than
    /// sleeping does (compared every few thousand requests), never while they come later
    /// than this; at most half the CPUs spin at once; 0 turns it off. Example: `--spin-us 0`.
    #[arg(long = "spin-us", value_name = "MICROSECONDS", default_value_t = nbd::Config::default().spin_max.as_micros() as u64, value_parser = clap::value_parser!(u64).range(0..=10_000))]
    spin_us: u64,
    /// Hand every NBD request but a lone one to another thread instead of serving queued
    /// small ones in batches (`nbd::Config::batch_replies`; for measuring both).
    #[arg(long = "no-batch-replies", hide = true)]
    no_batch_replies: bool,
    /// Give each NBD connection its own threads (the old core) instead of the event loop's
    /// few workers for all (where an idle connection costs no thread; `nbd::Config::event_loop`).
    #[arg(long = "threads-per-connection")]
    threads_per_connection: bool,
    #[command(flatten)]
    tls: TlsArgs,
    /// Space alerts, autoextend and the no-space timeout for this run (over `pool.json`).
    #[command(flatten)]
    space: crate::space::SpaceArgs,
    /// Serve Prometheus metrics over HTTP at `http://ADDR:PORT/metrics`: `PORT` (binds
    /// 127.0.0.1) or `ADDR:PORT`; port 0 picks a free one (the banner shows it). Off unless
    /// given. Example: `thinpool serve --metrics 9100`, then
    /// `curl http://127.0.0.1:9100/metrics`.
    #[arg(long = "metrics", value_name = "ADDR:PORT")]
    metrics: Option<String>,
    /// Attach VOLUME to a VM as a vhost-user-blk device on a new Unix socket PATH (mode
    /// 0600; one front end at a time; repeatable). `,queues=N` sets this volume's queue
    /// count (each served by its own thread), over `--vhost-queues`. The volume counts as
    /// open while served. Example: `--vhost-user-blk disk=/run/vm/disk.sock,queues=4`.
    #[arg(long = "vhost-user-blk", value_name = "VOLUME=PATH[,queues=N]", value_parser = parse_vhost_spec)]
    vhost_user_blk: Vec<VhostSpec>,
    /// Queues of every `--vhost-user-blk` device that does not give its own (1 to 64).
    #[arg(long = "vhost-queues", value_name = "N", default_value_t = 1, value_parser = parse_queues)]
    vhost_queues: u16,
}

/// Run the command: serve until SIGINT or SIGTERM, then shut down.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    run_with(args, Vec::new())
}

/// [`run`], with `fixed` exports served beside the volumes under their own names (the
/// benchmarks' raw-file and null exports; volumes may not be created with their names).
pub fn run_with(args: Args, fixed: Vec<Arc<dyn Export>>) -> anyhow::Result<ExitCode> {
    // Caught from before the pool opens, so a stop request during start-up is not lost.
    let mut signals =
        Signals::new([SIGINT, SIGTERM]).context("cannot install the signal handlers")?;
    let serving = Serving::start(&args, fixed)?;
    let signal = signals.forever().next().unwrap_or(SIGTERM);
    systemd::notify_stopping();
    tracing::info!(signal = signal_name(signal), "stopping");
    start_shutdown_watchdog(signals)?;
    Ok(serving.stop())
}

/// A pool being served: its NBD servers, control socket and metrics bound, its banner
/// printed. [`Serving::stop`] shuts it down as a signal does.
pub struct Serving {
    pool: Pool,
    target: Arc<Target>,
    control: ControlServer,
    servers: Vec<nbd::Server>,
    vhost: Vec<thinpool_vhost::VhostBlkServer>,
    nbd_socket: PathBuf,
    control_socket: PathBuf,
    tcp: Option<SocketAddr>,
    metrics: Option<SocketAddr>,
    metrics_listener: Option<metrics::MetricsListener>,
    pid_file: Option<systemd::PidFile>,
    fail_watch: (std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>),
}

/// What start-up decided about TCP before anything is bound.
struct TcpPlan {
    /// `--tcp`, parsed.
    address: Option<SocketAddr>,
    /// The widest exposure of any TCP address served, for the warning.
    exposure: Option<TcpExposure>,
    /// `--tcp-export`.
    exports: Option<Vec<String>>,
}

impl Serving {
    /// Opens the pool `args` name (creating the default pool on first use), binds every
    /// socket and serves the pool's volumes and `fixed`; returns once clients can connect.
    pub fn start(args: &Args, fixed: Vec<Arc<dyn Export>>) -> anyhow::Result<Serving> {
        // Taken at once, so that no later code mistakes them for its own.
        let activated = systemd::Activated::from_env()?;
        if let Some(path) = &args.pid_file {
            systemd::PidFile::check(path, &args.pool.resolve().path)?;
        }
        // Certificates are checked before the pool is touched: a bad file stops start-up.
        let tls = args.tls.load()?;
        let (dir, pool, options) = open_pool(args)?;
        // Checked before anything is bound: a refused address is never opened.
        let tcp = plan_tcp(args, &activated)?;
        let metrics_address = args
            .metrics
            .as_deref()
            .map(metrics::parse_metrics_address)
            .transpose()?;
        let nbd_socket = args.socket.clone().unwrap_or_else(|| dir.nbd_socket());
        let control_socket = dir.control_socket();
        if activated.unix.is_empty() {
            remove_stale_socket(&nbd_socket)?;
        }
        remove_stale_socket(&control_socket)?;

        let registry = Arc::new(PoolRegistry::new(pool.clone(), fixed)?);
        let mut config = nbd_config(args, tls);
        // With metrics on, the servers look exports up through a registry that counts requests.
        let (served, metrics) = metrics::counting(&registry, &pool, metrics_address, &mut config);
        if let Some(metrics) = &metrics {
            metrics.read_replication_from(dir.path.clone());
        }
        let (servers, nbd_socket, tcp_bound) = listen(served, config, activated, nbd_socket, &tcp)?;
        let vhost = vhost::start(&pool, &args.vhost_user_blk, args.vhost_queues)?;
        let target = served::control_target(&pool, options, &registry, &servers, &vhost);
        let control = ControlServer::start(&control_socket, Arc::clone(&target))?;
        let metrics_listener = match (metrics_address, metrics) {
            (Some(address), Some(metrics)) => Some(metrics::start(address, metrics)?),
            _ => None,
        };
        let metrics_bound = metrics_listener
            .as_ref()
            .map(metrics::MetricsListener::address);
        if let (Some(bound), Some(exposure)) = (tcp_bound, tcp.exposure) {
            let warning = exposure.warning(bound, tcp.exports.as_deref(), args.tls.posture());
            tracing::warn!("{warning}");
        }
        if let Some(line) = args.tls.banner_line() {
            tracing::info!("{line}");
        }
        let pid_file = args
            .pid_file
            .as_deref()
            .map(|path| systemd::PidFile::write(path, &dir.path))
            .transpose()?;
        let serving = Serving {
            fail_watch: start_fail_watch(pool.clone())?,
            vhost,
            pool,
            target,
            control,
            servers,
            nbd_socket,
            control_socket,
            tcp: tcp_bound,
            metrics: metrics_bound,
            metrics_listener,
            pid_file,
        };
        serving.announce(&dir, args, tcp.exports.as_deref())?;
        Ok(serving)
    }

    /// The NBD Unix socket (the first passed one under socket activation).
    pub fn nbd_socket(&self) -> &Path {
        &self.nbd_socket
    }

    /// The control socket.
    pub fn control_socket(&self) -> &Path {
        &self.control_socket
    }

    /// The TCP address NBD listens on, if any.
    pub fn tcp_address(&self) -> Option<SocketAddr> {
        self.tcp
    }

    /// The address metrics are served on, if any.
    pub fn metrics_address(&self) -> Option<SocketAddr> {
        self.metrics
    }

    /// The banner on stdout, the "serving" log line and systemd's READY=1.
    fn announce(
        &self,
        dir: &PoolDir,
        args: &Args,
        tcp_exports: Option<&[String]>,
    ) -> anyhow::Result<()> {
        let read_only = args.read_only;
        banner::print(
            dir,
            &self.pool,
            &self.nbd_socket,
            &self.control_socket,
            self.tcp.map(|bound| (bound, tcp_exports)),
            self.metrics,
            args.tls.banner(),
        )?;
        let volumes: Vec<String> = self.pool.list().into_iter().map(|info| info.name).collect();
        tracing::info!(
            pool = %dir.path.display(),
            nbd_socket = %self.nbd_socket.display(),
            tcp = ?self.tcp,
            control_socket = %self.control_socket.display(),
            volumes = %volumes.join(", "),
            read_only,
            "serving"
        );
        systemd::notify_ready(&format!("serving {} volumes", volumes.len()));
        Ok(())
    }

    /// Shuts down: the control socket, the NBD servers, then the pool's commit (each step
    /// bounded; see `shutdown`); removes the pid file. The exit status says whether the pool
    /// committed.
    pub fn stop(self) -> ExitCode {
        let (stop_fail_watch, fail_watch) = self.fail_watch;
        drop(stop_fail_watch);
        let _ = fail_watch.join();
        drop(self.target);
        // Before the pool closes: no scrape renders a closed pool.
        if let Some(listener) = self.metrics_listener {
            listener.stop();
        }
        // Before the pool's last commit: the attached volumes close.
        vhost::stop(self.vhost);
        let code = shut_down(self.control, self.servers, &self.pool);
        if let Some(pid_file) = self.pid_file {
            pid_file.remove();
        }
        code
    }
}

/// Opens the pool in `args`'s directory for serving: created first if it is the default
/// directory and holds none; its restored volumes named; its stored options with this
/// run's space options over them.
fn open_pool(args: &Args) -> anyhow::Result<(PoolDir, Pool, StoredOptions)> {
    let dir = args.pool.resolve();
    if !Pool::exists(&dir.path) {
        if !dir.is_default || args.read_only {
            dir.require_pool()?;
        }
        create_default_pool(&dir)?;
    }
    // Before anything is opened or bound in it: the directory is the caller's alone.
    dir.require_pool()?;
    if !args.read_only {
        crate::restored::name_restored_volumes(&dir.path)?;
    }
    let mut options = StoredOptions::load(&dir)?;
    options.space = args.space.apply(options.space)?;
    // Pool::open checks the metadata before opening it read-write (as LVM runs thin_check
    // before activation), unless told not to.
    let pool_options = thin_pool::PoolOptions {
        skip_check: args.skip_check,
        read_only: args.read_only,
        slow_commit_threshold: Some(Duration::from_millis(args.slow_commit_ms)),
        ..options.pool_options()
    };
    let pool = match Pool::open(&dir.path, pool_options) {
        Ok(pool) => pool,
        Err(thin_pool::Error::Locked { path }) => bail!(
            "the pool in {} is held by another process (is it served already? try `thinpool status --pool {}`): {path}",
            dir.path.display(),
            dir.path.display()
        ),
        Err(error) => {
            return Err(error)
                .with_context(|| format!("cannot open the pool in {}", dir.path.display()))
        }
    };
    Ok((dir, pool, options))
}

/// `--tcp` and the passed TCP sockets checked: one or the other; every address allowed
/// (see [`tcp::tcp_exposure`]) and the widest exposure kept for the warning.
fn plan_tcp(args: &Args, activated: &systemd::Activated) -> anyhow::Result<TcpPlan> {
    let address = args.tcp.as_deref().map(parse_tcp_address).transpose()?;
    if address.is_some() && !activated.tcp.is_empty() {
        bail!("--tcp and a TCP socket passed by socket activation: give one of them");
    }
    let passed = activated
        .tcp
        .iter()
        .map(|listener| listener.local_addr())
        .collect::<std::io::Result<Vec<_>>>()
        .context("cannot read a passed TCP socket's address")?;
    // TLS required with client certificates authenticates every client: any address is fine.
    let mut exposure = None;
    if !args.tls.authenticates_clients() {
        for address in address.iter().chain(&passed) {
            let this = tcp::tcp_exposure(*address, args.insecure)?;
            if exposure.is_none() || this == TcpExposure::Network {
                exposure = Some(this);
            }
        }
    }
    Ok(TcpPlan {
        address,
        exposure,
        exports: (!args.tcp_export.is_empty()).then(|| args.tcp_export.clone()),
    })
}

/// The NBD servers' configuration from the arguments.
fn nbd_config(args: &Args, tls: Option<nbd::Tls>) -> nbd::Config {
    nbd::Config {
        shutdown_grace: SHUTDOWN_GRACE,
        connections_max: args.connections_max,
        connections_per_peer_max: args.connections_per_peer_max,
        // A legitimate client opens all its connections at once (fio's `numjobs=256`,
        // multi-conn clients), and each is in the handshake for a moment: nbd's small default
        // would close the oldest of such a burst. Past the per-peer limit the connection idle
        // the longest gives way anyway, so a client that only holds handshakes still keeps no
        // newcomer out (`peer_fairness`). An age-aware handshake limit is a follow-up.
        handshakes_per_peer_max: args.connections_per_peer_max,
        idle_timeout: Duration::from_secs(args.idle_timeout_seconds),
        spin_max: Duration::from_micros(args.spin_us),
        batch_replies: !args.no_batch_replies,
        event_loop: !args.threads_per_connection,
        tls,
        ..nbd::Config::default()
    }
}

/// Binds the NBD servers: the Unix socket (or the passed ones) and TCP (`--tcp` or the
/// passed sockets). They are separate servers, so that each serves its own exports
/// (`--tcp-export`) and TCP clients cannot use up the Unix socket's connections. Returns
/// the servers, the Unix socket served and the TCP address bound.
fn listen(
    served: Arc<dyn ExportRegistry>,
    config: nbd::Config,
    activated: systemd::Activated,
    nbd_socket: PathBuf,
    tcp: &TcpPlan,
) -> anyhow::Result<(Vec<nbd::Server>, PathBuf, Option<SocketAddr>)> {
    let mut server = nbd::Server::new(Arc::clone(&served), config.clone());
    let mut nbd_socket = nbd_socket;
    if activated.unix.is_empty() {
        server
            .listen_unix(&nbd_socket)
            .with_context(|| format!("cannot listen on {}", nbd_socket.display()))?;
    }
    for (index, listener) in activated.unix.into_iter().enumerate() {
        let path = server
            .serve_unix_listener(listener)
            .context("cannot serve a passed Unix socket")?;
        if let (0, Some(path)) = (index, path) {
            nbd_socket = path;
        }
    }
    let mut servers = vec![server];
    if tcp.address.is_none() && activated.tcp.is_empty() {
        return Ok((servers, nbd_socket, None));
    }
    let tcp_registry: Arc<dyn ExportRegistry> = match &tcp.exports {
        Some(names) => Arc::new(AllowList::new(Arc::clone(&served), names)),
        None => served,
    };
    let mut server = nbd::Server::new(tcp_registry, config);
    let bound = match tcp.address {
        Some(address) => Some(
            server
                .listen_tcp(address)
                .with_context(|| format!("cannot listen on TCP {address}"))?,
        ),
        None => {
            let mut bound = None;
            for listener in activated.tcp {
                let address = server
                    .serve_tcp_listener(listener)
                    .context("cannot serve a passed TCP socket")?;
                bound.get_or_insert(address);
            }
            bound
        }
    };
    servers.push(server);
    Ok((servers, nbd_socket, bound))
}

/// Creates the default pool with its `disk` volume.
fn create_default_pool(dir: &PoolDir) -> anyhow::Result<()> {
    create_pool(dir, &default_create_options(), StoredOptions::default())?;
    let pool = Pool::open(&dir.path, StoredOptions::default().pool_options())
        .with_context(|| format!("cannot open the new pool in {}", dir.path.display()))?;
    pool.create_volume(DEFAULT_VOLUME, DEFAULT_VOLUME_SIZE_BYTES)
        .with_context(|| format!("cannot create volume {DEFAULT_VOLUME:?}"))?;
    pool.close().context("cannot close the new pool")?;
    tracing::info!(
        "created pool {} with volume {DEFAULT_VOLUME:?} ({})",
        dir.path.display(),
        format_size(DEFAULT_VOLUME_SIZE_BYTES)
    );
    Ok(())
}

/// Removes a socket file of ours nobody listens on (left by a server that was killed);
/// refuses to touch anything else.
fn remove_stale_socket(path: &Path) -> anyhow::Result<()> {
    let Ok(metadata) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !metadata.file_type().is_socket() {
        bail!("{} exists and is not a socket", path.display());
    }
    if std::os::unix::fs::MetadataExt::uid(&metadata) != crate::pool_dir::current_uid() {
        bail!(
            "{} is a socket of another user (uid {}): not removing it",
            path.display(),
            std::os::unix::fs::MetadataExt::uid(&metadata)
        );
    }
    match UnixStream::connect(path) {
        Ok(_) => bail!("another server listens on {}", path.display()),
        Err(_) => std::fs::remove_file(path)
            .with_context(|| format!("cannot remove stale socket {}", path.display())),
    }
}
