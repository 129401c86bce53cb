//! `thinpool serve`: serve every volume of a pool as an NBD export of the same name, on a Unix
//! socket (default `nbd.sock` in the pool directory, mode 0600) and, only when asked, on TCP
//! (127.0.0.1 unless an address is given), with the control socket beside it for management
//! while serving. Plain files can be served too (`--raw-export NAME=FILE`), without thin
//! mapping, and null exports (`--null-export NAME=SIZE`: zeroes, writes dropped) for
//! measuring the front end alone. With `--metrics ADDR:PORT`, Prometheus metrics over HTTP as well (`serve/metrics.rs`,
//! counted as `crate::metrics` describes).
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
//! SIGINT or SIGTERM stop the server within a bounded time whatever state the sockets are in:
//! the control socket closes (idle clients are cut, running requests get a few seconds), the
//! NBD listeners close and connections finish their requests (cut off after a grace period),
//! then the pool commits; each step says what it closed, and the last line says whether the
//! pool committed, could not (read-only), or failed to. A second signal, or a shutdown longer
//! than [`SHUTDOWN_DEADLINE`], exits at once as a crash would.

use anyhow::{bail, Context};
use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use thin_pool::Pool;

use crate::control::{ControlServer, Target};
use crate::create::{create_pool, default_create_options};
use crate::export::{NullExport, PoolRegistry, RawFileExport, DEFAULT_VOLUME};
use crate::pool_dir::{format_size, PoolArg, PoolDir, StoredOptions};
use nbd::ExportRegistry;

mod metrics;
mod shutdown;
mod systemd;
mod tcp;
mod tls;

use shutdown::*;
pub use tcp::parse_tcp_address;
use tcp::*;
use tls::TlsArgs;

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
    /// Also serve FILE, a plain file with no thin mapping, as export NAME (repeatable).
    #[arg(long = "raw-export", value_name = "NAME=FILE")]
    raw_export: Vec<String>,
    /// Also serve export NAME of SIZE bytes (K, M, G, T) with nothing behind it: READs give
    /// zeroes, WRITEs are accepted and dropped (repeatable). For measuring the NBD front end
    /// without I/O, like `nbdkit null`. Example: `--null-export null=1G`.
    #[arg(
        long = "null-export",
        value_name = "NAME=SIZE",
        conflicts_with = "read_only"
    )]
    null_export: Vec<String>,
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
    #[arg(long = "read-only", conflicts_with = "raw_export")]
    read_only: bool,
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
}

/// Run the command.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    // Taken at once, so that no later code mistakes them for its own.
    let activated = systemd::Activated::from_env()?;
    if let Some(path) = &args.pid_file {
        systemd::PidFile::check(path)?;
    }
    // Certificates are checked before the pool is touched: a bad file stops start-up.
    let tls = args.tls.load()?;
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
    let raw = args
        .raw_export
        .iter()
        .map(|spec| {
            let (name, file) = spec
                .split_once('=')
                .filter(|(name, file)| !name.is_empty() && !file.is_empty())
                .with_context(|| format!("--raw-export {spec:?}: expected NAME=FILE"))?;
            RawFileExport::open(name, Path::new(file))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let null = args
        .null_export
        .iter()
        .map(|spec| NullExport::parse(spec))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // Checked before anything is bound: a refused address is never opened.
    let tcp = args.tcp.as_deref().map(parse_tcp_address).transpose()?;
    if tcp.is_some() && !activated.tcp.is_empty() {
        bail!("--tcp and a TCP socket passed by socket activation: give one of them");
    }
    let passed_tcp = activated
        .tcp
        .iter()
        .map(|listener| listener.local_addr())
        .collect::<std::io::Result<Vec<_>>>()
        .context("cannot read a passed TCP socket's address")?;
    // Every TCP address is checked; the warning names the widest exposure. TLS required
    // with client certificates authenticates every client: any address is fine.
    let mut tcp_exposure = None;
    let checked = if args.tls.authenticates_clients() {
        &[][..]
    } else {
        &passed_tcp[..]
    };
    for address in tcp
        .iter()
        .filter(|_| !args.tls.authenticates_clients())
        .chain(checked)
    {
        let exposure = tcp::tcp_exposure(*address, args.insecure)?;
        if tcp_exposure.is_none() || exposure == TcpExposure::Network {
            tcp_exposure = Some(exposure);
        }
    }
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

    let registry = Arc::new(PoolRegistry::new(pool.clone(), raw)?.with_null_exports(null)?);
    let target = Arc::new(Target {
        pool: pool.clone(),
        options,
        reserved_names: registry.raw_names(),
    });
    let mut config = nbd::Config {
        shutdown_grace: SHUTDOWN_GRACE,
        connections_max: args.connections_max,
        connections_per_peer_max: args.connections_per_peer_max,
        idle_timeout: Duration::from_secs(args.idle_timeout_seconds),
        spin_max: Duration::from_micros(args.spin_us),
        batch_replies: !args.no_batch_replies,
        tls,
        ..nbd::Config::default()
    };
    // With metrics on, the servers look exports up through a registry that counts requests.
    let (served, metrics) = metrics::counting(&registry, &pool, metrics_address, &mut config);
    // Signals are caught from here on, so a stop request during start-up is not lost.
    let mut signals =
        Signals::new([SIGINT, SIGTERM]).context("cannot install the signal handlers")?;
    // The Unix socket and TCP are separate servers, so that each serves its own exports
    // (`--tcp-export`) and TCP clients cannot use up the Unix socket's connections.
    let mut servers = Vec::new();
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
    servers.push(server);
    let tcp_exports = (!args.tcp_export.is_empty()).then(|| args.tcp_export.clone());
    let tcp_bound = match tcp {
        None if !activated.tcp.is_empty() => {
            let tcp_registry: Arc<dyn ExportRegistry> = match &tcp_exports {
                Some(names) => Arc::new(AllowList::new(Arc::clone(&served), names)),
                None => Arc::clone(&served),
            };
            let mut server = nbd::Server::new(tcp_registry, config);
            let mut bound = None;
            for listener in activated.tcp {
                let address = server
                    .serve_tcp_listener(listener)
                    .context("cannot serve a passed TCP socket")?;
                bound.get_or_insert(address);
            }
            servers.push(server);
            bound
        }
        Some(address) => {
            let tcp_registry: Arc<dyn ExportRegistry> = match &tcp_exports {
                Some(names) => Arc::new(AllowList::new(Arc::clone(&served), names)),
                None => Arc::clone(&served),
            };
            let mut server = nbd::Server::new(tcp_registry, config);
            let bound = server
                .listen_tcp(address)
                .with_context(|| format!("cannot listen on TCP {address}"))?;
            servers.push(server);
            Some(bound)
        }
        None => None,
    };
    let control = ControlServer::start(&control_socket, Arc::clone(&target))?;
    let metrics_bound = match (metrics_address, metrics) {
        (Some(address), Some(metrics)) => Some(metrics::start(address, metrics)?),
        _ => None,
    };
    if let (Some(bound), Some(exposure)) = (tcp_bound, tcp_exposure) {
        tracing::warn!(
            "{}",
            exposure.warning(bound, tcp_exports.as_deref(), args.tls.posture())
        );
    }
    if let Some(line) = args.tls.banner_line() {
        tracing::info!("{line}");
    }
    let pid_file = args
        .pid_file
        .as_deref()
        .map(systemd::PidFile::write)
        .transpose()?;
    print_banner(
        &dir,
        &pool,
        &nbd_socket,
        &control_socket,
        tcp_bound.map(|bound| (bound, tcp_exports.as_deref())),
        metrics_bound,
    )?;

    let volumes: Vec<String> = pool.list().into_iter().map(|info| info.name).collect();
    tracing::info!(
        pool = %dir.path.display(),
        nbd_socket = %nbd_socket.display(),
        tcp = ?tcp_bound,
        control_socket = %control_socket.display(),
        volumes = %volumes.join(", "),
        read_only = args.read_only,
        "serving"
    );
    systemd::notify_ready(&format!("serving {} volumes", volumes.len()));

    let (stop_fail_watch, fail_watch) = start_fail_watch(pool.clone())?;

    let signal = signals.forever().next().unwrap_or(SIGTERM);
    systemd::notify_stopping();
    tracing::info!(signal = signal_name(signal), "stopping");
    drop(stop_fail_watch);
    let _ = fail_watch.join();
    start_shutdown_watchdog(signals)?;
    drop(target);
    let code = shut_down(control, servers, &pool);
    if let Some(pid_file) = pid_file {
        pid_file.remove();
    }
    Ok(code)
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

/// Percent-encodes an export name for the path of an NBD URI.
fn uri_escape(name: &str) -> String {
    let mut out = String::new();
    for byte in name.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

fn print_banner(
    dir: &PoolDir,
    pool: &Pool,
    nbd_socket: &Path,
    control_socket: &Path,
    tcp: Option<(SocketAddr, Option<&[String]>)>,
    metrics: Option<SocketAddr>,
) -> anyhow::Result<()> {
    let absolute = |path: &Path| std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let pool_path = absolute(&dir.path);
    let socket = absolute(nbd_socket);
    let volumes: Vec<String> = pool.list().into_iter().map(|info| info.name).collect();
    let example = if volumes.iter().any(|name| name == DEFAULT_VOLUME) {
        DEFAULT_VOLUME.to_string()
    } else {
        volumes
            .first()
            .cloned()
            .unwrap_or_else(|| "NAME".to_string())
    };
    let unix_uri = format!(
        "nbd+unix:///{}?socket={}",
        uri_escape(&example),
        socket.display()
    );
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "thinpool: serving pool {} ({} volume{}: {})",
        pool_path.display(),
        volumes.len(),
        if volumes.len() == 1 { "" } else { "s" },
        if volumes.is_empty() {
            "none yet".to_string()
        } else {
            volumes.join(", ")
        }
    )?;
    writeln!(out, "  NBD socket:     {}", socket.display())?;
    if let Some((address, exports)) = tcp {
        writeln!(out, "  NBD TCP:        {address}")?;
        if let Some(names) = exports {
            writeln!(out, "  TCP exports:    {}", names.join(", "))?;
        }
    }
    writeln!(
        out,
        "  control socket: {}",
        absolute(control_socket).display()
    )?;
    if let Some(address) = metrics {
        writeln!(out, "  metrics:        http://{address}/metrics")?;
    }
    writeln!(out, "connect with (every volume is an export of its name):")?;
    writeln!(out, "  nbdinfo '{unix_uri}'")?;
    writeln!(out, "  qemu-img info '{unix_uri}'")?;
    writeln!(
        out,
        "  mkdir -p /tmp/{0} && nbdfuse /tmp/{0} '{unix_uri}'",
        uri_escape(&example)
    )?;
    if let Some((address, exports)) = tcp {
        let example = match exports {
            Some(names) if !names.contains(&example) => names[0].clone(),
            _ => example.clone(),
        };
        let host = match address {
            SocketAddr::V6(v6) => format!("[{}]", v6.ip()),
            SocketAddr::V4(v4) => v4.ip().to_string(),
        };
        writeln!(
            out,
            "  nbdinfo 'nbd://{host}:{}/{}'",
            address.port(),
            uri_escape(&example)
        )?;
    }
    writeln!(
        out,
        "manage with: thinpool volume create|snapshot|delete|resize ... --pool {}",
        pool_path.display()
    )?;
    writeln!(out, "thinpool: ready (SIGINT or SIGTERM stops)")?;
    out.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_names_are_escaped_in_uris() {
        assert_eq!(uri_escape("disk-1.img"), "disk-1.img");
        assert_eq!(uri_escape("a b/c?"), "a%20b%2Fc%3F");
    }
}
