//! `thinpool serve`: serve every volume of a pool as an NBD export of the same name, on a Unix
//! socket (default `nbd.sock` in the pool directory, mode 0600) and, only when asked, on TCP
//! (127.0.0.1 unless an address is given), with the control socket beside it for management
//! while serving. Plain files can be served too (`--raw-export NAME=FILE`), without thin
//! mapping.
//!
//! The default pool directory is created on first use, with one volume named `disk`, so that
//! `thinpool serve` works on a fresh machine.
//!
//! Who can reach the volumes: the Unix sockets are 0600, so only their owner (and root). TCP
//! has no authentication: on loopback every local user can read and write every volume (a
//! warning says so at start); a non-loopback address is refused before binding unless
//! `--insecure` is given. `--tcp-export NAME` limits what TCP serves (the Unix socket and TCP
//! are separate NBD servers, each with its own connection limits).
//!
//! SIGINT or SIGTERM stop the server within a bounded time whatever state the sockets are in:
//! the control socket closes (idle clients are cut, running requests get a few seconds), the
//! NBD listeners close and connections finish their requests (cut off after a grace period),
//! then the pool commits; each step says what it closed, and the last line says whether the
//! pool committed, could not (read-only), or failed to. A second signal, or a shutdown longer
//! than [`SHUTDOWN_DEADLINE`], exits at once as a crash would.

use anyhow::{bail, Context};
use std::collections::BTreeSet;
use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use thin_pool::{Pool, PoolMode};

use crate::commands::create::{create_pool, default_create_options};
use crate::control::{ControlServer, Target};
use crate::export::{PoolRegistry, RawFileExport, DEFAULT_VOLUME};
use crate::pool_dir::{format_size, PoolArg, PoolDir, StoredOptions};
use nbd::{Export, ExportListing, ExportRegistry};

/// Port used when `--tcp` names only an address.
pub const NBD_PORT: u16 = 10809;
/// Size of the volume made with a new default pool.
const DEFAULT_VOLUME_SIZE_BYTES: u64 = 16 << 30;
/// How long shutdown waits for NBD clients to finish before cutting them off.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// Longest shutdown, commit included, before the process exits regardless. The steps are
/// bounded on their own (control socket 5 s, NBD accept 2 s plus twice the grace), so this
/// only fires if the final commit hangs in I/O.
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(60);
/// Exit status when shutdown was cut short (second signal or deadline).
const EXIT_FORCED: i32 = 2;

/// Arguments.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pool: PoolArg,
    /// NBD Unix socket to create [default: nbd.sock in the pool directory].
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
    /// Don't log connections on stderr.
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    /// Most NBD connections served at once.
    #[arg(long = "connections-max", value_name = "N", default_value_t = nbd::Config::default().connections_max)]
    connections_max: usize,
    /// Most NBD connections from one peer (uid on the Unix socket, address on TCP).
    #[arg(long = "connections-per-peer-max", value_name = "N", default_value_t = nbd::Config::default().connections_per_peer_max)]
    connections_per_peer_max: usize,
    /// Close an NBD connection after this many seconds without a request.
    #[arg(long = "idle-timeout", value_name = "SECONDS", default_value_t = nbd::Config::default().idle_timeout.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    idle_timeout_seconds: u64,
}

/// Run the command.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let dir = args.pool.resolve();
    if !Pool::exists(&dir.path) {
        if !dir.is_default {
            dir.require_pool()?;
        }
        create_default_pool(&dir)?;
    }
    // Before anything is opened or bound in it: the directory is the caller's alone.
    dir.require_pool()?;
    let options = StoredOptions::load(&dir)?;
    let pool = match Pool::open(&dir.path, options.pool_options()) {
        Ok(pool) => pool,
        Err(thin_pool::Error::Locked { .. }) => bail!(
            "the pool in {} is held by another process (is it served already? try `thinpool status --pool {}`)",
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
    // Checked before anything is bound: a refused address is never opened.
    let tcp = args.tcp.as_deref().map(parse_tcp_address).transpose()?;
    let tcp_exposure = tcp
        .map(|address| tcp_exposure(address, args.insecure))
        .transpose()?;
    let nbd_socket = args.socket.clone().unwrap_or_else(|| dir.nbd_socket());
    let control_socket = dir.control_socket();
    remove_stale_socket(&nbd_socket)?;
    remove_stale_socket(&control_socket)?;

    let registry = Arc::new(PoolRegistry::new(pool.clone(), raw)?);
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
        ..nbd::Config::default()
    };
    if !args.quiet {
        config.on_event = Some(Arc::new(log_event));
    }
    // Signals are caught from here on, so a stop request during start-up is not lost.
    let mut signals =
        Signals::new([SIGINT, SIGTERM]).context("cannot install the signal handlers")?;
    // The Unix socket and TCP are separate servers, so that each serves its own exports
    // (`--tcp-export`) and TCP clients cannot use up the Unix socket's connections.
    let mut servers = Vec::new();
    let mut server = nbd::Server::new(
        Arc::clone(&registry) as Arc<dyn ExportRegistry>,
        config.clone(),
    );
    server
        .listen_unix(&nbd_socket)
        .with_context(|| format!("cannot listen on {}", nbd_socket.display()))?;
    servers.push(server);
    let tcp_exports = (!args.tcp_export.is_empty()).then(|| args.tcp_export.clone());
    let tcp_bound = match tcp {
        Some(address) => {
            let tcp_registry: Arc<dyn ExportRegistry> = match &tcp_exports {
                Some(names) => Arc::new(AllowList::new(Arc::clone(&registry) as _, names)),
                None => Arc::clone(&registry) as _,
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
    if let (Some(bound), Some(exposure)) = (tcp_bound, tcp_exposure) {
        eprintln!(
            "thinpool: warning: {}",
            exposure.warning(bound, tcp_exports.as_deref())
        );
    }
    print_banner(
        &dir,
        &pool,
        &nbd_socket,
        &control_socket,
        tcp_bound.map(|bound| (bound, tcp_exports.as_deref())),
    )?;

    let signal = signals.forever().next().unwrap_or(SIGTERM);
    eprintln!("thinpool: {}: stopping", signal_name(signal));
    start_shutdown_watchdog(signals)?;
    drop(target);
    Ok(shut_down(control, servers, &pool))
}

/// Closes the control socket, then the NBD servers, then commits the pool, saying what each
/// step did. Every step is bounded (see the module notes).
fn shut_down(control: ControlServer, servers: Vec<nbd::Server>, pool: &Pool) -> ExitCode {
    let control_report = control.shutdown();
    eprintln!(
        "thinpool: control socket closed ({} client{} disconnected{})",
        control_report.clients_closed,
        plural(control_report.clients_closed),
        if control_report.requests_unfinished > 0 {
            format!(
                "; {} request{} still running after {} s",
                control_report.requests_unfinished,
                plural(control_report.requests_unfinished),
                crate::control::STOP_WAIT.as_secs()
            )
        } else {
            String::new()
        }
    );
    let nbd_connections: usize = servers.iter().map(nbd::Server::connection_count).sum();
    // Ask every server first, so their grace periods run at the same time.
    for server in &servers {
        server.shutdown_handle().request();
    }
    for server in servers {
        server.shutdown();
    }
    eprintln!(
        "thinpool: NBD listeners closed ({nbd_connections} connection{} closed)",
        plural(nbd_connections)
    );
    let close = pool.close();
    let status = pool.status();
    match close {
        Ok(()) => match status.mode {
            PoolMode::Write | PoolMode::OutOfDataSpace => {
                eprintln!(
                    "thinpool: stopped; pool committed at transaction {}",
                    status.transaction_id
                );
                ExitCode::SUCCESS
            }
            mode => {
                eprintln!(
                    "thinpool: stopped; {}: nothing committed (the pool stays at transaction {})",
                    uncommittable(mode, status.needs_check),
                    status.transaction_id
                );
                ExitCode::SUCCESS
            }
        },
        Err(error) => {
            eprintln!(
                "thinpool: stopped; commit failed: {error}; the pool stays at transaction {}",
                status.transaction_id
            );
            ExitCode::FAILURE
        }
    }
}

fn signal_name(signal: i32) -> &'static str {
    if signal == SIGINT {
        "SIGINT"
    } else {
        "SIGTERM"
    }
}

fn plural(count: usize) -> &'static str {
    if count == 1 {
        ""
    } else {
        "s"
    }
}

/// Why a pool in `mode` takes no commit.
fn uncommittable(mode: PoolMode, needs_check: bool) -> &'static str {
    match mode {
        PoolMode::ReadOnly if needs_check => "pool read-only (needs_check)",
        PoolMode::ReadOnly => "pool read-only",
        PoolMode::OutOfMetadataSpace => "pool out of metadata space",
        PoolMode::Fail => "pool failed",
        PoolMode::Write | PoolMode::OutOfDataSpace => "pool writable",
    }
}

/// Bounds shutdown as a whole: after [`SHUTDOWN_DEADLINE`], or at a second SIGINT/SIGTERM,
/// the process exits at once, as a crash would (the pool keeps its last commit; the commit
/// protocol makes that safe at any point). Each step of shutdown is bounded on its own; this
/// covers what is not, such as a data device that stops answering during the final commit.
fn start_shutdown_watchdog(mut signals: Signals) -> anyhow::Result<()> {
    std::thread::Builder::new()
        .name("shutdown-signals".into())
        .spawn(move || {
            if let Some(signal) = signals.forever().next() {
                eprintln!(
                    "thinpool: {} again: exiting now; the pool keeps its last commit",
                    signal_name(signal)
                );
                std::process::exit(EXIT_FORCED);
            }
        })
        .context("cannot start the signal thread")?;
    std::thread::Builder::new()
        .name("shutdown-deadline".into())
        .spawn(move || {
            std::thread::sleep(SHUTDOWN_DEADLINE);
            eprintln!(
                "thinpool: shutdown did not finish within {} s: exiting now; the pool keeps its last commit",
                SHUTDOWN_DEADLINE.as_secs()
            );
            std::process::exit(EXIT_FORCED);
        })
        .context("cannot start the shutdown deadline thread")?;
    Ok(())
}

/// Who can reach the volumes through a TCP listener without TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TcpExposure {
    /// Bound to a loopback address: every local user.
    LocalUsers,
    /// Bound to another address, allowed with `--insecure`: every host that reaches it.
    Network,
}

impl TcpExposure {
    /// The start-up warning; `exports` is the `--tcp-export` list, if any.
    fn warning(self, bound: SocketAddr, exports: Option<&[String]>) -> String {
        let what = match exports {
            Some(names) => format!("the exports {}", names.join(", ")),
            None => "every volume".to_string(),
        };
        match self {
            TcpExposure::LocalUsers => format!(
                "NBD on TCP {bound} has no TLS and no authentication: every local user can read and write {what} (the Unix socket is private to its owner)"
            ),
            TcpExposure::Network => format!(
                "NBD on TCP {bound} has no TLS and no authentication (--insecure): every local user and every host that reaches this address can read and write {what}"
            ),
        }
    }
}

/// The exports of another registry whose names are on a list (`--tcp-export`): others are
/// neither listed nor opened, exactly as if they did not exist.
struct AllowList {
    inner: Arc<dyn ExportRegistry>,
    names: BTreeSet<String>,
}

impl AllowList {
    fn new(inner: Arc<dyn ExportRegistry>, names: &[String]) -> Self {
        AllowList {
            inner,
            names: names.iter().cloned().collect(),
        }
    }
}

impl ExportRegistry for AllowList {
    fn list(&self) -> Vec<ExportListing> {
        let mut listing = self.inner.list();
        listing.retain(|export| self.names.contains(&export.name));
        listing
    }

    fn open(&self, name: &str) -> nbd::Result<Option<Arc<dyn Export>>> {
        // A name off the list is not even opened (opening a volume counts as a user of it).
        if !name.is_empty() && !self.names.contains(name) {
            return Ok(None);
        }
        // The empty name means the default export, allowed only if its own name is listed.
        Ok(self
            .inner
            .open(name)?
            .filter(|export| self.names.contains(export.name())))
    }
}

/// Decides whether a TCP listener on `address` may be opened, before it is bound. Without TLS
/// (not implemented yet; `--tls-cert`/`--tls-key` will add a third case here), only loopback
/// addresses are allowed unless `insecure`; the wildcard addresses (0.0.0.0, ::) are not
/// loopback.
fn tcp_exposure(address: SocketAddr, insecure: bool) -> anyhow::Result<TcpExposure> {
    if address.ip().to_canonical().is_loopback() {
        return Ok(TcpExposure::LocalUsers);
    }
    if insecure {
        return Ok(TcpExposure::Network);
    }
    bail!(
        "--tcp {address}: refusing to serve every volume without TLS or authentication on a non-loopback address; \
         use a loopback address (127.0.0.1, ::1), or add --insecure if every host that reaches {} may read and write every volume",
        address.ip()
    )
}

/// Creates the default pool with its `disk` volume.
fn create_default_pool(dir: &PoolDir) -> anyhow::Result<()> {
    create_pool(dir, &default_create_options(), StoredOptions::default())?;
    let pool = Pool::open(&dir.path, StoredOptions::default().pool_options())
        .with_context(|| format!("cannot open the new pool in {}", dir.path.display()))?;
    pool.create_volume(DEFAULT_VOLUME, DEFAULT_VOLUME_SIZE_BYTES)
        .with_context(|| format!("cannot create volume {DEFAULT_VOLUME:?}"))?;
    pool.close().context("cannot close the new pool")?;
    eprintln!(
        "thinpool: created pool {} with volume {DEFAULT_VOLUME:?} ({})",
        dir.path.display(),
        format_size(DEFAULT_VOLUME_SIZE_BYTES)
    );
    Ok(())
}

/// Parses `--tcp`: `PORT` (on 127.0.0.1), `ADDR:PORT`, `[V6]:PORT`, or `ADDR` (port 10809).
pub fn parse_tcp_address(text: &str) -> anyhow::Result<SocketAddr> {
    if let Ok(port) = text.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    if let Some(port) = text.strip_prefix(':') {
        let port: u16 = port
            .parse()
            .with_context(|| format!("--tcp {text:?}: bad port"))?;
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    if let Ok(address) = text.parse::<SocketAddr>() {
        return Ok(address);
    }
    if let Ok(ip) = text.parse::<std::net::IpAddr>() {
        return Ok(SocketAddr::new(ip, NBD_PORT));
    }
    let with_port = if text.contains(':') {
        text.to_string()
    } else {
        format!("{text}:{NBD_PORT}")
    };
    with_port
        .to_socket_addrs()
        .with_context(|| format!("--tcp {text:?}: cannot resolve"))?
        .next()
        .with_context(|| format!("--tcp {text:?}: no address"))
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

fn log_event(event: &nbd::Event) {
    match event {
        nbd::Event::Serving { connection, export } => {
            eprintln!("thinpool: connection {connection}: serving {export:?}");
        }
        nbd::Event::Disconnected {
            connection,
            error: Some(error),
        } => {
            eprintln!("thinpool: connection {connection} ended: {error}");
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_addresses_default_to_loopback() {
        assert_eq!(
            parse_tcp_address("10810").unwrap(),
            "127.0.0.1:10810".parse().unwrap()
        );
        assert_eq!(
            parse_tcp_address(":0").unwrap(),
            "127.0.0.1:0".parse().unwrap()
        );
        assert_eq!(
            parse_tcp_address("0.0.0.0:99").unwrap(),
            "0.0.0.0:99".parse().unwrap()
        );
        assert_eq!(
            parse_tcp_address("[::1]:5").unwrap(),
            "[::1]:5".parse().unwrap()
        );
        assert_eq!(
            parse_tcp_address("127.0.0.2").unwrap(),
            "127.0.0.2:10809".parse().unwrap()
        );
    }

    #[test]
    fn tcp_off_loopback_needs_insecure() {
        let exposure = |text: &str, insecure| tcp_exposure(text.parse().unwrap(), insecure);
        for loopback in [
            "127.0.0.1:1",
            "127.1.2.3:1",
            "[::1]:1",
            "[::ffff:127.0.0.1]:1",
        ] {
            assert_eq!(exposure(loopback, false).unwrap(), TcpExposure::LocalUsers);
        }
        for open in ["0.0.0.0:1", "[::]:1", "192.0.2.1:1", "[2001:db8::1]:1"] {
            let error = exposure(open, false).unwrap_err().to_string();
            assert!(error.contains("--insecure"), "{open}: {error}");
            assert_eq!(exposure(open, true).unwrap(), TcpExposure::Network);
        }
    }

    #[test]
    fn export_names_are_escaped_in_uris() {
        assert_eq!(uri_escape("disk-1.img"), "disk-1.img");
        assert_eq!(uri_escape("a b/c?"), "a%20b%2Fc%3F");
    }
}
