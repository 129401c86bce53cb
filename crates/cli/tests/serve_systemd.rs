//! Goal: `thinpool serve` follows systemd's and daemons' conventions (issue 12, item 5): it
//! serves a Unix or TCP socket passed by socket activation instead of making one, tells the
//! service manager when it is ready and when it stops, writes and removes a pid file (and
//! refuses one naming a running process), and with `--read-only` serves every export
//! read-only without writing a byte of the pool.
//!
//! Method: the real `systemd-socket-activate` (Debian's `systemd`) passes the socket, and
//! nbdinfo connects through it; a Unix datagram socket stands in for systemd's notify
//! socket; the read-only pool's files are compared byte for byte (and by mtime) before and
//! after a session of reads, a refused write and a refused management request.

mod e2e_support;

use e2e_support::*;
use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(30);

fn new_pool(temp: &ScratchDir) -> PathBuf {
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "64M"]);
    create_volume(&pool, "vm", "16M");
    pool
}

/// `systemd-socket-activate -l LISTEN thinpool serve --pool POOL EXTRA...`, its stdout and
/// stderr in files of `temp`. It execs the server (same pid) on the first connection.
fn socket_activate(temp: &ScratchDir, listen: &str, pool: &Path, extra: &[&str]) -> ChildGuard {
    require_tool("systemd-socket-activate", "systemd");
    let mut command = Command::new("systemd-socket-activate");
    command
        .args(["-l", listen, THINPOOL, "serve", "--pool"])
        .arg(pool)
        .args(extra)
        .env_remove("RUST_LOG")
        .env_remove("THINPOOL_POOL")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(temp.join("stdout")).unwrap())
        .stderr(std::fs::File::create(temp.join("stderr")).unwrap());
    ChildGuard::spawn(command, "systemd-socket-activate")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

#[test]
fn a_unix_socket_passed_by_socket_activation_is_served() {
    require_tool("nbdinfo", "libnbd-bin");
    let temp = ScratchDir::new("activate-unix");
    let pool = new_pool(&temp);
    let socket = temp.join("activated.sock");
    let mut activator = socket_activate(&temp, socket.to_str().unwrap(), &pool, &[]);
    wait_for("the activator's socket", TIMEOUT, || socket.exists());

    let uri = format!("nbd+unix:///vm?socket={}", socket.display());
    let info = run_tool("nbdinfo", &[&uri], TIMEOUT);
    assert!(
        info.status.success(),
        "{info:?}\n--- stderr ---\n{}",
        read(&temp.join("stderr"))
    );
    assert!(String::from_utf8_lossy(&info.stdout).contains("16777216"));
    let comm = std::fs::read_to_string(format!("/proc/{}/comm", activator.pid())).unwrap();
    assert_eq!(comm.trim(), "thinpool", "the activator execs the server");
    wait_for("the banner", TIMEOUT, || {
        read(&temp.join("stdout")).contains("thinpool: ready")
    });
    let banner = read(&temp.join("stdout"));
    assert!(
        banner.contains(&format!("NBD socket:     {}", socket.display())),
        "{banner}"
    );
    assert!(
        !pool.join("nbd.sock").exists(),
        "no socket of its own is made"
    );

    let status = activator.terminate(TIMEOUT).expect("the server stops");
    let log = read(&temp.join("stderr"));
    assert!(status.success(), "{log}");
    assert!(
        log.contains(&format!("NBD listening socket={}", socket.display())),
        "{log}"
    );
    assert!(
        socket.exists(),
        "a passed socket's file belongs to whoever passed it"
    );
}

#[test]
fn a_tcp_socket_passed_by_socket_activation_is_served() {
    require_tool("nbdinfo", "libnbd-bin");
    let temp = ScratchDir::new("activate-tcp");
    let pool = new_pool(&temp);
    // A port free a moment ago; the activator binds it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let mut activator = socket_activate(&temp, &listen, &pool, &[]);
    wait_for("the activator's port", TIMEOUT, || {
        read(&temp.join("stderr")).contains("Listening on")
            || std::fs::read_to_string("/proc/net/tcp")
                .unwrap_or_default()
                .contains(&format!(":{port:04X} 00000000:0000 0A"))
    });

    let uri = format!("nbd://127.0.0.1:{port}/vm");
    let info = run_tool("nbdinfo", &[&uri], TIMEOUT);
    assert!(
        info.status.success(),
        "{info:?}\n--- stderr ---\n{}",
        read(&temp.join("stderr"))
    );
    wait_for("the banner", TIMEOUT, || {
        read(&temp.join("stdout")).contains("thinpool: ready")
    });
    let banner = read(&temp.join("stdout"));
    assert!(
        banner.contains(&format!("NBD TCP:        {listen}")),
        "{banner}"
    );
    // TCP on loopback warns as --tcp does.
    let log = read(&temp.join("stderr"));
    assert!(log.contains(" WARN ") && log.contains("no TLS"), "{log}");

    let status = activator.terminate(TIMEOUT).expect("the server stops");
    let log = read(&temp.join("stderr"));
    assert!(status.success(), "{log}");
    assert!(log.contains(&format!("socket=tcp {listen}")), "{log}");
    // A TCP connection's lines name its peer address.
    assert!(
        log.lines().any(|line| line.contains("conn{conn=")
            && line.contains("peer=127.0.0.1:")
            && line.contains("serving export export=\"vm\"")),
        "{log}"
    );
}

#[test]
fn readiness_and_stopping_are_notified() {
    require_tool("nbdinfo", "libnbd-bin");
    let temp = ScratchDir::new("notify");
    let pool = new_pool(&temp);
    let notify_path = temp.join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(TIMEOUT)).unwrap();
    let served = Served::start_with_env(
        Path::new(THINPOOL),
        &pool,
        &[],
        &[("NOTIFY_SOCKET", notify_path.to_str().unwrap())],
    );
    let mut buffer = [0u8; 4096];
    let length = notify.recv(&mut buffer).expect("a READY message");
    let message = String::from_utf8_lossy(&buffer[..length]).to_string();
    assert!(message.lines().any(|line| line == "READY=1"), "{message:?}");
    // Ready means serving: a client gets through at once.
    let info = run_tool("nbdinfo", &[&served.uri("vm")], TIMEOUT);
    assert!(info.status.success(), "{info:?}");

    let (status, log) = served.stop_with_log();
    assert!(status.success(), "{log}");
    let length = notify.recv(&mut buffer).expect("a STOPPING message");
    let message = String::from_utf8_lossy(&buffer[..length]).to_string();
    assert!(
        message.lines().any(|line| line == "STOPPING=1"),
        "{message:?}"
    );
}

#[test]
fn the_pid_file_is_written_refused_while_live_and_removed_at_exit() {
    let temp = ScratchDir::new("pid-file");
    let pool = new_pool(&temp);
    let pid_file = temp.join("thinpool.pid");
    let pid_arg = pid_file.to_str().unwrap();
    // A stale file (a pid no process has) is replaced.
    std::fs::write(&pid_file, "2147483646\n").unwrap();
    let served = serve(&pool, &["--pid-file", pid_arg]);
    assert_eq!(read(&pid_file).trim(), served.pid().to_string());

    // A second server naming the same file is refused before it opens anything.
    let other = temp.join("other");
    create_pool(&other, &["--data-size", "64M"]);
    let error = thinpool_err(&[
        "serve",
        "--pool",
        other.to_str().unwrap(),
        "--pid-file",
        pid_arg,
    ]);
    assert!(
        error.contains("names process") && error.contains(&served.pid().to_string()),
        "{error}"
    );
    assert!(!other.join("nbd.sock").exists());
    assert_eq!(read(&pid_file).trim(), served.pid().to_string());

    let (status, log) = served.stop_with_log();
    assert!(status.success(), "{log}");
    assert!(!pid_file.exists(), "removed on a clean shutdown");
}

/// Every regular file of the pool directory: content and mtime.
fn pool_files(pool: &Path) -> BTreeMap<String, (Vec<u8>, i64, i64)> {
    std::fs::read_dir(pool)
        .unwrap()
        .map(Result::unwrap)
        .filter(|entry| entry.file_type().unwrap().is_file())
        .map(|entry| {
            let metadata = entry.metadata().unwrap();
            (
                entry.file_name().to_string_lossy().into_owned(),
                (
                    std::fs::read(entry.path()).unwrap(),
                    metadata.mtime(),
                    metadata.mtime_nsec(),
                ),
            )
        })
        .collect()
}

#[test]
fn read_only_serves_every_export_read_only_and_writes_nothing() {
    require_tool("nbdinfo", "libnbd-bin");
    require_tool("nbdcopy", "libnbd-bin");
    let temp = ScratchDir::new("read-only");
    let pool = new_pool(&temp);
    let p = pool.to_str().unwrap();
    // Some data to read back, written by a read-write server first.
    let written = temp.join("written");
    std::fs::write(&written, pattern(7, 1 << 20)).unwrap();
    let served = serve(&pool, &[]);
    let copy = run_tool(
        "nbdcopy",
        &[written.to_str().unwrap(), &served.uri("vm")],
        TIMEOUT,
    );
    assert!(copy.status.success(), "{copy:?}");
    served.stop();
    let before = pool_files(&pool);
    assert!(before.len() >= 3, "{:?}", before.keys());

    let served = serve(&pool, &["--read-only"]);
    let info = run_tool("nbdinfo", &[&served.uri("vm")], TIMEOUT);
    let text = String::from_utf8_lossy(&info.stdout);
    assert!(text.contains("is_read_only: true"), "{text}");
    let back = temp.join("back");
    let copy = run_tool(
        "nbdcopy",
        &[&served.uri("vm"), back.to_str().unwrap()],
        TIMEOUT,
    );
    assert!(copy.status.success(), "{copy:?}");
    let back = std::fs::read(&back).unwrap();
    assert_eq!(&back[..1 << 20], &pattern(7, 1 << 20)[..]);
    // A write is refused by the server itself.
    let mut client = Client::open(&served.socket, "vm");
    client.send_request(CMD_WRITE, 0, 0, 512, &[1u8; 512]);
    let reply = client.read_completed();
    assert_eq!(reply.error, EPERM, "{reply:?}");
    drop(client);
    // So is a management request, saying why.
    let error = thinpool_err(&["volume", "create", "new", "--size", "8M", "--pool", p]);
    assert!(error.contains("read-only"), "{error}");
    let (status, log) = served.stop_with_log();
    assert!(status.success(), "{log}");
    assert!(log.contains("read_only=true"), "{log}");

    let after = pool_files(&pool);
    assert_eq!(
        before.keys().collect::<Vec<_>>(),
        after.keys().collect::<Vec<_>>()
    );
    for (name, (content, seconds, nanoseconds)) in &before {
        let (content_after, seconds_after, nanoseconds_after) = &after[name];
        assert!(content == content_after, "{name} changed");
        assert_eq!(
            (seconds, nanoseconds),
            (seconds_after, nanoseconds_after),
            "{name} was written"
        );
    }
}

#[test]
fn the_unit_files_pass_systemd_analyze_verify() {
    require_tool("systemd-analyze", "systemd");
    let temp = ScratchDir::new("units");
    let contrib = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../contrib/systemd");
    // An instance for a pool directory, with the binary under test in ExecStart.
    for (template, instance) in [
        (
            "thinpool@.service",
            "thinpool@var-lib-thinpool-pool.service",
        ),
        ("thinpool@.socket", "thinpool@var-lib-thinpool-pool.socket"),
    ] {
        let text = std::fs::read_to_string(contrib.join(template)).unwrap();
        assert!(
            !template.ends_with(".service") || text.contains("/usr/local/bin/thinpool serve"),
            "{text}"
        );
        let text = text.replace("/usr/local/bin/thinpool", THINPOOL);
        std::fs::write(temp.join(instance), text).unwrap();
    }
    let service = temp.join("thinpool@var-lib-thinpool-pool.service");
    let socket = temp.join("thinpool@var-lib-thinpool-pool.socket");
    let output = run_tool(
        "systemd-analyze",
        &[
            "verify",
            "--man=no",
            service.to_str().unwrap(),
            socket.to_str().unwrap(),
        ],
        TIMEOUT,
    );
    let complaints = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && complaints.trim().is_empty(),
        "{complaints}"
    );
}
