//! The kernel's NBD client inside User-Mode Linux against `thinpool serve` running in the same
//! guest: Debian's `nbd-client` (3.24 on Debian 12) and the binary under test both come from
//! the host through hostfs, and they meet on a Unix socket in the guest's `/run` tmpfs, so no
//! network is needed (the guest's loopback interface carries only `serve --metrics`).
//!
//! [`GuestServe::prelude`] gives a guest script shell functions to start, kill and stop the
//! server (by its pid, inside the guest) and to connect and disconnect `/dev/nbdN`; the
//! parsers read what the guest brought out: the connections the server served with the options
//! each sent (its debug log), the requests it refused, and the requests per command from its
//! metrics.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::shell_quote;

/// The module the kernel's NBD client needs.
pub const NBD_MODULES: [&str; 1] = ["nbd"];

/// Where Debian's `nbd-client` package puts the program.
const NBD_CLIENT_PATHS: [&str; 2] = ["/usr/sbin/nbd-client", "/sbin/nbd-client"];

/// The host's `nbd-client` (which the guest sees at the same path). Panics naming the Debian
/// package if it is missing: a kernel NBD test must not pass because the client was missing.
pub fn nbd_client() -> PathBuf {
    NBD_CLIENT_PATHS
        .iter()
        .map(PathBuf::from)
        .find(|path| path.is_file())
        .unwrap_or_else(|| {
            panic!(
                "nbd-client is missing (none of {NBD_CLIENT_PATHS:?}): install the Debian \
                 package nbd-client (scripts/test does)"
            )
        })
}

/// `thinpool serve` as a guest script runs it.
#[derive(Clone, Debug)]
pub struct GuestServe {
    thinpool: PathBuf,
    pool: PathBuf,
    socket: PathBuf,
    client: PathBuf,
    extra: Vec<String>,
}

impl GuestServe {
    /// `THINPOOL serve --pool POOL --socket SOCKET -v` (debug lines: the options received),
    /// with the host's [`nbd_client`].
    pub fn new(thinpool: &Path, pool: &Path, socket: &Path) -> GuestServe {
        GuestServe {
            thinpool: thinpool.to_path_buf(),
            pool: pool.to_path_buf(),
            socket: socket.to_path_buf(),
            client: nbd_client(),
            extra: Vec::new(),
        }
    }

    /// Adds serve arguments (e.g. `--metrics 127.0.0.1:9100`).
    pub fn args(mut self, args: &[&str]) -> GuestServe {
        self.extra.extend(args.iter().map(|arg| arg.to_string()));
        self
    }

    /// Shell functions for a guest script (which runs with `sh -e` in the result directory):
    ///
    /// - `serve_start LOG`: starts the server in the background, its stderr and stdout to
    ///   `LOG`, its pid in `$SERVE_PID`; returns once it printed its ready line (fails if it
    ///   exited or took more than 60 s).
    /// - `serve_kill`: SIGKILL to `$SERVE_PID` (a crash), reaped.
    /// - `serve_stop`: SIGTERM to `$SERVE_PID`; fails unless it exits with status 0.
    /// - `nbd_up DEVICE EXPORT [NBD-CLIENT ARGS...]`: `nbd-client -unix SOCKET DEVICE -N
    ///   EXPORT ARGS...`, then waits until the device is connected (`nbd-client -c`).
    /// - `nbd_down DEVICE`: `nbd-client -d DEVICE`, then waits until it is not connected.
    /// - `nbd_connected DEVICE`: whether it is connected (its `pid` attribute exists: a
    ///   device whose server went away stays "connected", failing every I/O, until
    ///   `nbd-client -d`).
    /// - `nbd_fsync DEVICE`: `fsync(2)` on the device, which the kernel sends as
    ///   NBD_CMD_FLUSH (`sync` and `blockdev --flushbufs` write back the page cache but send
    ///   no flush).
    pub fn prelude(&self) -> String {
        let extra: Vec<String> = self.extra.iter().map(|arg| shell_quote(arg)).collect();
        format!(
            r#"
THINPOOL={thinpool}
POOL={pool}
NBD_SOCKET={socket}
NBD_CLIENT={client}
serve_start() {{
    "$THINPOOL" serve --pool "$POOL" --socket "$NBD_SOCKET" -v {extra} > "$1" 2>&1 &
    SERVE_PID=$!
    waited=0
    until grep -q '^thinpool: ready' "$1"; do
        kill -0 $SERVE_PID 2>/dev/null || {{ echo "thinpool serve exited:"; cat "$1"; return 1; }}
        [ $waited -lt 600 ] || {{ echo "thinpool serve not ready in 60 s"; return 1; }}
        waited=$((waited + 1))
        sleep 0.1
    done
}}
serve_kill() {{ kill -KILL $SERVE_PID; wait $SERVE_PID || true; }}
serve_stop() {{ kill -TERM $SERVE_PID; wait $SERVE_PID; }}
nbd_connected() {{ "$NBD_CLIENT" -c "$1" > /dev/null 2>&1; }}
nbd_fsync() {{ /usr/bin/python3 -c 'import os, sys; fd = os.open(sys.argv[1], os.O_WRONLY); os.fsync(fd)' "$1"; }}
nbd_up() {{
    device=$1 export=$2
    shift 2
    "$NBD_CLIENT" -unix "$NBD_SOCKET" "$device" -N "$export" "$@"
    waited=0
    until nbd_connected "$device"; do
        [ $waited -lt 300 ] || {{ echo "$device not connected in 30 s"; return 1; }}
        waited=$((waited + 1))
        sleep 0.1
    done
}}
nbd_down() {{
    "$NBD_CLIENT" -d "$1"
    waited=0
    while nbd_connected "$1"; do
        [ $waited -lt 300 ] || {{ echo "$1 still connected 30 s after nbd-client -d"; return 1; }}
        waited=$((waited + 1))
        sleep 0.1
    done
}}
"#,
            thinpool = shell_quote(&self.thinpool.display().to_string()),
            pool = shell_quote(&self.pool.display().to_string()),
            socket = shell_quote(&self.socket.display().to_string()),
            client = shell_quote(&self.client.display().to_string()),
            extra = extra.join(" "),
        )
    }
}

/// One NBD connection as the server's log shows it (lines in its `conn{conn=N ...}` span).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Connection {
    /// The server's connection number.
    pub id: u64,
    /// The export it served (`serving export export="NAME"`), if it got that far.
    pub export: Option<String>,
    /// The option codes it received, in order (`option received option=N`, debug level).
    pub options: Vec<u32>,
    /// How it ended (`connection closed`), if it did.
    pub closed: Option<Close>,
}

/// How a connection ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Close {
    /// The client disconnected (NBD_CMD_DISC, or end of input between requests).
    Clean,
    /// The session ended with this error (the log's `error=` field).
    Error(String),
}

/// Every connection in the server's log, by connection number.
pub fn connections(log: &str) -> Vec<Connection> {
    let mut found: BTreeMap<u64, Connection> = BTreeMap::new();
    for line in log.lines() {
        let Some(id) = field(line, "conn{conn=").and_then(|id| id.parse().ok()) else {
            continue;
        };
        let connection = found.entry(id).or_insert_with(|| Connection {
            id,
            ..Connection::default()
        });
        if line.contains("option received") {
            if let Some(option) = field(line, " option=").and_then(|code| code.parse().ok()) {
                connection.options.push(option);
            }
        }
        if line.contains("connection closed") && !line.contains("to make room") {
            connection.closed = Some(match line.find(" error=") {
                Some(start) => Close::Error(line[start + " error=".len()..].to_string()),
                None => Close::Clean,
            });
        }
        if line.contains("serving export") {
            connection.export =
                field(line, " export=").map(|name| name.trim_matches('"').to_string());
        }
    }
    found.into_values().collect()
}

/// The log lines of requests the server refused (`request refused`, at debug level).
pub fn refused_requests(log: &str) -> Vec<String> {
    log.lines()
        .filter(|line| line.contains("request refused"))
        .map(str::to_string)
        .collect()
}

/// `thinpool_volume_requests_total{volume="V",op="OP"} N` from `serve --metrics`: N by (V, OP).
pub fn request_counts(metrics: &str) -> BTreeMap<(String, String), u64> {
    let mut counts = BTreeMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("thinpool_volume_requests_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|pair| {
                    pair.strip_prefix(name)?
                        .strip_prefix("=\"")?
                        .strip_suffix('"')
                })
                .map(str::to_string)
        };
        if let (Some(volume), Some(op), Ok(value)) =
            (label("volume"), label("op"), value.trim().parse())
        {
            counts.insert((volume, op), value);
        }
    }
    counts
}

/// The value of `name` (`name=VALUE`, up to the next space) in a log line.
fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let start = line.find(name)? + name.len();
    let rest = &line[start..];
    Some(rest.split_whitespace().next().unwrap_or(rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "\
2026-12-02T00:39:38.660053Z  INFO conn{conn=1 peer=/run/nbd.sock (uid 0)}: nbd::server::connection: connection opened
2026-12-02T00:39:38.661479Z DEBUG conn{conn=1 peer=/run/nbd.sock (uid 0)}: nbd::handshake: option received option=7 length=7
2026-12-02T00:39:38.666467Z  INFO conn{conn=1 peer=/run/nbd.sock (uid 0)}: nbd::server::connection: serving export export=\"v\" read_only=false
2026-12-02T00:39:38.661479Z DEBUG conn{conn=2 peer=/run/nbd.sock (uid 0)}: nbd::handshake: option received option=8 length=0
2026-12-02T00:39:38.666467Z  INFO conn{conn=2 peer=/run/nbd.sock (uid 0)}: nbd::server::connection: serving export export=\"vv\" read_only=false
2026-12-02T00:39:38.666467Z DEBUG conn{conn=2 peer=/run/nbd.sock (uid 0)}: nbd::session::input: request refused command=9 error=unsupported
2026-12-02T00:39:44.663728Z  INFO conn{conn=1 peer=/run/nbd.sock (uid 0)}: nbd::server::connection: connection closed export=\"v\" requests=96
2026-12-02T00:39:44.663728Z  INFO conn{conn=2 peer=/run/nbd.sock (uid 0)}: nbd::server::connection: connection closed export=\"vv\" requests=3 error=read request: connection reset
";

    #[test]
    fn log_parsers_find_options_connections_and_refusals() {
        let found = connections(LOG);
        assert_eq!(found.len(), 2);
        assert_eq!(
            found[0],
            Connection {
                id: 1,
                export: Some("v".to_string()),
                options: vec![7],
                closed: Some(Close::Clean),
            }
        );
        assert_eq!(found[1].id, 2);
        assert_eq!(found[1].export.as_deref(), Some("vv"));
        assert_eq!(found[1].options, [8]);
        assert_eq!(
            found[1].closed,
            Some(Close::Error("read request: connection reset".to_string()))
        );
        let refused = refused_requests(LOG);
        assert_eq!(refused.len(), 1);
        assert!(refused[0].contains("command=9"));
    }

    #[test]
    fn request_counts_reads_the_metrics_family() {
        let metrics = "\
# TYPE thinpool_volume_requests_total counter
thinpool_volume_requests_total{volume=\"v\",op=\"read\"} 70
thinpool_volume_requests_total{volume=\"v\",op=\"trim\"} 1
thinpool_volume_other{volume=\"v\",op=\"read\"} 5
";
        let counts = request_counts(metrics);
        assert_eq!(counts.len(), 2);
        assert_eq!(counts[&("v".to_string(), "read".to_string())], 70);
        assert_eq!(counts[&("v".to_string(), "trim".to_string())], 1);
    }

    #[test]
    fn prelude_names_the_paths_quoted() {
        let prelude = GuestServe {
            thinpool: PathBuf::from("/bin/thinpool"),
            pool: PathBuf::from("/p"),
            socket: PathBuf::from("/run/s"),
            client: PathBuf::from("/sbin/nbd-client"),
            extra: Vec::new(),
        }
        .args(&["--metrics", "127.0.0.1:9100"])
        .prelude();
        assert!(prelude.contains("THINPOOL='/bin/thinpool'"));
        assert!(prelude.contains("-v '--metrics' '127.0.0.1:9100'"));
        assert!(prelude.contains("NBD_CLIENT='/sbin/nbd-client'"));
        assert!(prelude.contains("nbd_up() {"));
    }
}
