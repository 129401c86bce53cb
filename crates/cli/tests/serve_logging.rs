//! Goal: `thinpool serve` logs what an operator needs on stderr, one timestamped line per
//! event naming its subject (issue 12, item 1): start (pool, sockets, volumes), each NBD
//! connection's open and close with its number, peer, export and the requests it served, an
//! unknown export, management operations with their result, a protocol violation at warn,
//! and shutdown with the connections it closed; `-q` keeps only warnings, `-v` adds debug
//! lines, `RUST_LOG` replaces both.
//!
//! Method: serve a pool, drive it with nbdinfo (a volume and an unknown export), the
//! `thinpool volume` commands (which go through the control socket while the server runs),
//! a raw client that sends a bad option magic, and a connection left open across SIGTERM;
//! then read the server's stderr.

mod e2e_support;

use e2e_support::*;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

const NBDINFO_TIMEOUT: Duration = Duration::from_secs(30);

/// Whether `line` starts with an RFC 3339 UTC timestamp (`2026-11-30T19:08:17.422462Z`).
fn timestamped(line: &str) -> bool {
    let Some((stamp, _)) = line.split_once(' ') else {
        return false;
    };
    let bytes = stamp.as_bytes();
    stamp.len() >= 20
        && stamp.ends_with('Z')
        && bytes[4] == b'-'
        && bytes[7] == b'-'
        && bytes[10] == b'T'
        && bytes[13] == b':'
        && bytes[16] == b':'
        && stamp[..4].bytes().all(|b| b.is_ascii_digit())
}

/// The one line of `log` holding every part of `parts`; fails, with the log, if none does.
fn line_with<'a>(log: &'a str, parts: &[&str]) -> &'a str {
    log.lines()
        .find(|line| parts.iter().all(|part| line.contains(part)))
        .unwrap_or_else(|| panic!("no log line with {parts:?}:\n{log}"))
}

/// The connection number a `conn{conn=N ...}` line names.
fn connection_number(line: &str) -> u64 {
    let start = line.find("conn{conn=").expect("a connection span") + "conn{conn=".len();
    let digits: String = line[start..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().unwrap()
}

fn nbdinfo(uri: &str) -> std::process::Output {
    run_tool("nbdinfo", &[uri], NBDINFO_TIMEOUT)
}

#[test]
fn every_event_is_logged_with_a_timestamp_and_its_subject() {
    require_tool("nbdinfo", "libnbd-bin");
    let temp = ScratchDir::new("serve-logging");
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap();
    create_pool(&pool, &["--data-size", "64M"]);
    create_volume(&pool, "vm", "16M");
    let served = serve(&pool, &[]);

    let info = nbdinfo(&served.uri("vm"));
    assert!(info.status.success(), "{info:?}");
    let unknown = nbdinfo(&served.uri("nope"));
    assert!(!unknown.status.success(), "{unknown:?}");
    thinpool_ok(&["volume", "create", "extra", "--size", "8M", "--pool", p]);
    thinpool_ok(&["volume", "resize", "extra", "--size", "16M", "--pool", p]);
    thinpool_ok(&["volume", "delete", "extra", "--pool", p]);
    thinpool_err(&["volume", "delete", "missing", "--pool", p]);

    // A client that breaks the handshake: client flags, then an option with a bad magic.
    let mut rude = UnixStream::connect(&served.socket).unwrap();
    rude.set_read_timeout(Some(NBDINFO_TIMEOUT)).unwrap();
    let mut greeting = [0u8; 18];
    rude.read_exact(&mut greeting).unwrap();
    // FIXED_NEWSTYLE | NO_ZEROES, a big-endian u32.
    rude.write_all(&[0, 0, 0, 3]).unwrap();
    rude.write_all(&[0xde; 16]).unwrap();
    let mut rest = Vec::new();
    let _ = rude.read_to_end(&mut rest);

    // A client asking for ten unknown exports in one handshake: four are logged at info.
    let mut curious = Client::start(&served.socket);
    for index in 0..10u8 {
        let name = [b'x', b'0' + index];
        // NBD_OPT_GO data: name length (big-endian u32), name, no information requests.
        let data = [&[0, 0, 0, 2][..], &name[..], &[0, 0][..]].concat();
        let replies = curious.option(OPT_GO, &data);
        assert!(
            replies.last().unwrap().reply_type & (1 << 31) != 0,
            "refused"
        );
    }
    drop(curious);

    // A connection still open at shutdown.
    let open = Client::open(&served.socket, "vm");
    wait_for("the open connection's log line", NBDINFO_TIMEOUT, || {
        served.stderr().matches("serving export").count() >= 2
    });
    let (status, log) = served.stop_with_log();
    drop(open);
    assert!(status.success(), "{log}");

    for line in log.lines() {
        assert!(
            timestamped(line),
            "line without a timestamp: {line:?}\n{log}"
        );
    }
    // Start: pool, sockets, volumes.
    let start = line_with(
        &log,
        &[
            " INFO ",
            "serving",
            "pool=",
            "nbd_socket=",
            "control_socket=",
        ],
    );
    assert!(start.contains("volumes=vm"), "{start}");
    assert!(
        start.contains(served_socket_name(&pool).as_str()),
        "{start}"
    );
    // The nbdinfo connection: opened, serving "vm", closed after its requests.
    let serving = line_with(&log, &[" INFO ", "serving export", "export=\"vm\""]);
    let first = connection_number(serving);
    assert!(serving.contains("(uid "), "the peer is named: {serving}");
    let closed = line_with(
        &log,
        &[
            &format!("conn{{conn={first} "),
            "connection closed",
            "export=\"vm\"",
        ],
    );
    let requests: u64 = closed
        .split("requests=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no request count: {closed}"));
    assert!(
        requests >= 1,
        "nbdinfo sends at least a disconnect's worth: {closed}"
    );
    line_with(
        &log,
        &[&format!("conn{{conn={first} "), "connection opened"],
    );
    // The unknown export, on its own connection.
    let unknown = line_with(
        &log,
        &[" INFO ", "unknown export requested", "export=\"nope\""],
    );
    assert_ne!(connection_number(unknown), first);
    let curious = line_with(&log, &["unknown export requested", "export=\"x0\""]);
    let curious = format!("conn{{conn={} ", connection_number(curious));
    let logged: Vec<&str> = log
        .lines()
        .filter(|line| line.contains(&curious) && line.contains("unknown export requested"))
        .collect();
    assert_eq!(logged.len(), 4, "{logged:#?}");
    // Management operations with their result.
    line_with(
        &log,
        &[
            " INFO ",
            "management operation done",
            "operation=create_volume",
            "volume=\"extra\"",
        ],
    );
    line_with(
        &log,
        &[
            " INFO ",
            "management operation done",
            "operation=resize_volume",
            "volume=\"extra\"",
        ],
    );
    line_with(
        &log,
        &[
            " INFO ",
            "management operation done",
            "operation=delete_volume",
            "volume=\"extra\"",
        ],
    );
    line_with(
        &log,
        &[
            "management operation refused",
            "operation=delete_volume",
            "volume=\"missing\"",
            "ENOENT",
        ],
    );
    // The protocol violation, at warn.
    line_with(
        &log,
        &[" WARN ", "conn{conn=", "protocol violation", "magic"],
    );
    // Shutdown names the connection it closed.
    line_with(&log, &[" INFO ", "stopping", "SIGTERM"]);
    let stopped = line_with(
        &log,
        &[" INFO ", "NBD server stopped", "connections_closed=1"],
    );
    assert!(stopped.contains("\"vm\""), "{stopped}");
    line_with(&log, &[" INFO ", "stopped; pool committed at transaction"]);
    // No per-request lines at the default level.
    assert!(
        !log.contains(" DEBUG ") && !log.contains(" TRACE "),
        "{log}"
    );
}

/// The default NBD socket's path, as the start line gives it.
fn served_socket_name(pool: &std::path::Path) -> String {
    pool.join("nbd.sock").display().to_string()
}

#[test]
fn quiet_verbose_and_rust_log_choose_the_level() {
    require_tool("nbdinfo", "libnbd-bin");
    let temp = ScratchDir::new("serve-log-level");
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "64M"]);
    create_volume(&pool, "vm", "16M");

    let quiet = serve(&pool, &["-q"]);
    assert!(nbdinfo(&quiet.uri("vm")).status.success());
    let (status, log) = quiet.stop_with_log();
    assert!(status.success(), "{log}");
    assert!(!log.contains(" INFO "), "-q logs only warnings:\n{log}");

    let verbose = serve(&pool, &["-v"]);
    assert!(nbdinfo(&verbose.uri("vm")).status.success());
    let (status, log) = verbose.stop_with_log();
    assert!(status.success(), "{log}");
    line_with(&log, &[" DEBUG ", "conn{conn=", "option received"]);
    line_with(&log, &[" INFO ", "serving export"]);

    // RUST_LOG replaces -v: only nbd's warnings and above, nothing of the binary's info.
    let filtered = Served::start_with_env(
        std::path::Path::new(THINPOOL),
        &pool,
        &["-v"],
        &[("RUST_LOG", "warn")],
    );
    assert!(nbdinfo(&filtered.uri("vm")).status.success());
    let (status, log) = filtered.stop_with_log();
    assert!(status.success(), "{log}");
    assert!(!log.contains(" INFO ") && !log.contains(" DEBUG "), "{log}");
}

#[test]
fn pool_mode_changes_and_slow_commits_are_logged() {
    require_tool("nbdcopy", "libnbd-bin");
    let temp = ScratchDir::new("serve-log-modes");
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap();
    // 16 data blocks of 64 KiB under a 4 MiB volume: writing 2 MiB runs out of space.
    create_pool(&pool, &["--data-size", "1M", "--error-if-no-space"]);
    create_volume(&pool, "vm", "4M");
    // A threshold of 0 logs every commit as slow: the line's form, not the disk's speed.
    let served = serve(&pool, &["--slow-commit-ms", "0"]);
    let source = temp.join("source");
    std::fs::write(&source, pattern(3, 2 << 20)).unwrap();
    let copy = run_tool(
        "nbdcopy",
        &[source.to_str().unwrap(), &served.uri("vm")],
        NBDINFO_TIMEOUT,
    );
    assert!(!copy.status.success(), "the pool has 1 MiB: {copy:?}");
    thinpool_ok(&["create", "--grow", "--data-size", "8M", "--pool", p]);
    let copy = run_tool(
        "nbdcopy",
        &[source.to_str().unwrap(), &served.uri("vm")],
        NBDINFO_TIMEOUT,
    );
    assert!(copy.status.success(), "{copy:?}");
    let (status, log) = served.stop_with_log();
    assert!(status.success(), "{log}");

    line_with(
        &log,
        &[
            " WARN ",
            "pool mode changed",
            "from=\"rw\"",
            "to=\"out_of_data_space\"",
        ],
    );
    line_with(
        &log,
        &[" INFO ", "management operation done", "operation=grow_data"],
    );
    line_with(
        &log,
        &[
            " INFO ",
            "pool mode changed",
            "from=\"out_of_data_space\"",
            "to=\"rw\"",
        ],
    );
    line_with(&log, &[" WARN ", "slow commit", "milliseconds="]);
}
