//! Goal: `thinpool serve` stops within a bounded time on SIGTERM whatever state its sockets are
//! in, commits the pool, and says what it closed and what happened to the pool; TCP without
//! TLS warns that every local user can read and write every volume, and a non-loopback address
//! is refused unless `--insecure`; `--tcp-export` limits what TCP serves.
//!
//! Regressions (issue 10): SIGTERM never completed once `control.sock` was removed (shutdown
//! joined an accept thread that only a connection to that file could wake) and the pool was
//! not committed; "pool committed at transaction N" was printed for a read-only pool that
//! committed nothing; `--tcp` gave every local user every volume without a word.
//!
//! Method: run the binary, hold sockets open (idle NBD connections in handshake and in
//! transmission, idle and half-sent control requests), remove socket files, send SIGTERM with
//! `kill`, wait with a generous deadline (only to detect a hang), then check the messages, the
//! pool offline (`thinpool status`, `thinpool check`) and the metadata with both thin_check
//! versions. Every server runs on a Unix socket or on 127.0.0.1, and is killed by PID if a test
//! fails; the refused non-loopback address is refused before any socket is opened.
#![allow(clippy::big_endian_bytes)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use testkit::tools::ThinTools;

const THINPOOL: &str = env!("CARGO_BIN_EXE_thinpool");
/// Deadline to detect a hang at shutdown (the server's own steps take a few seconds at most).
const STOP_DEADLINE: Duration = Duration::from_secs(30);

/// A temporary directory (0700), removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        use std::os::unix::fs::DirBuilderExt;
        let path = std::env::temp_dir().join(format!("tp-stop-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .unwrap();
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `thinpool ARGS` (with `$THINPOOL_POOL` unset), killed by PID after 60 s.
fn thinpool(args: &[&str]) -> Output {
    testkit::process::run_tool(THINPOOL, args, Duration::from_secs(60))
}

#[track_caller]
fn thinpool_ok(args: &[&str]) -> String {
    let output = thinpool(args);
    assert!(
        output.status.success(),
        "thinpool {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn new_pool(dir: &Path) -> String {
    let pool = dir.to_str().unwrap().to_string();
    thinpool_ok(&["create", "--pool", &pool, "--data-size", "64M"]);
    thinpool_ok(&["volume", "create", "vm", "--size", "16M", "--pool", &pool]);
    pool
}

/// A running `thinpool serve`, killed by PID on drop unless it exited.
struct Server {
    child: Child,
    stderr_path: PathBuf,
    banner: Vec<String>,
}

impl Server {
    /// Starts `thinpool serve ARGS` and waits for its ready line.
    fn start(args: &[&str], stderr_path: PathBuf) -> Server {
        let stderr = std::fs::File::create(&stderr_path).unwrap();
        let mut child = Command::new(THINPOOL)
            .arg("serve")
            .args(args)
            .env_remove("THINPOOL_POOL")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("start thinpool serve");
        let stdout = child.stdout.take().unwrap();
        let (sender, receiver) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        let mut server = Server {
            child,
            stderr_path,
            banner: Vec::new(),
        };
        loop {
            match receiver.recv_timeout(Duration::from_secs(30)) {
                Ok(line) => {
                    let ready = line.starts_with("thinpool: ready");
                    server.banner.push(line);
                    if ready {
                        return server;
                    }
                }
                Err(_) => panic!(
                    "thinpool serve did not become ready: {:?}\n{}",
                    server.banner,
                    server.stderr()
                ),
            }
        }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// The TCP address from the banner.
    fn tcp(&self) -> String {
        self.banner
            .iter()
            .find_map(|line| line.trim().strip_prefix("NBD TCP:"))
            .expect("banner names the TCP address")
            .trim()
            .to_string()
    }

    /// SIGTERM; waits up to [`STOP_DEADLINE`] for the exit. Returns the status, the stderr and
    /// how long it took.
    fn terminate(&mut self) -> (ExitStatus, String, Duration) {
        let started = Instant::now();
        let kill = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(kill.success());
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return (status, self.stderr(), started.elapsed());
            }
            assert!(
                started.elapsed() < STOP_DEADLINE,
                "thinpool serve did not stop within {STOP_DEADLINE:?} of SIGTERM:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The committed transaction id, read offline.
fn transaction_id(pool: &str) -> u64 {
    let status: serde_json::Value =
        serde_json::from_str(&thinpool_ok(&["status", "--json", "--pool", pool])).unwrap();
    status["transaction_id"].as_u64().unwrap()
}

/// The pool is consistent for our checker and both thin_check versions.
fn check_metadata(pool: &Path) {
    let metadata = pool.join("metadata");
    thinpool_ok(&["check", metadata.to_str().unwrap()]);
    for tools in ThinTools::all() {
        tools.check(&metadata).assert_success();
    }
}

/// The transaction id in "pool committed at transaction N".
fn committed_at(stderr: &str) -> u64 {
    let tail = stderr
        .split("pool committed at transaction ")
        .nth(1)
        .unwrap_or_else(|| panic!("no commit reported:\n{stderr}"));
    tail.split_whitespace().next().unwrap().parse().unwrap()
}

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const CMD_WRITE: u16 = 1;

/// Reads the server's greeting and sends the client flags (fixed newstyle, no zeroes): the
/// connection is then waiting in the handshake for an option.
fn greet(stream: &mut (impl Read + Write)) {
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).unwrap();
    assert_eq!(
        u64::from_be_bytes(greeting[..8].try_into().unwrap()),
        NBDMAGIC
    );
    stream.write_all(&3u32.to_be_bytes()).unwrap();
}

/// Negotiates `export` with NBD_OPT_GO: the connection is then in transmission.
fn go(stream: &mut (impl Read + Write), export: &str) {
    if let Err(reply_type) = try_go(stream, export) {
        panic!("export {export:?} refused with {reply_type:#x}");
    }
}

/// As [`go`]; `Err` with the reply type if the server refuses the export.
fn try_go(stream: &mut (impl Read + Write), export: &str) -> Result<(), u32> {
    greet(stream);
    let mut option = Vec::new();
    option.extend_from_slice(&IHAVEOPT.to_be_bytes());
    option.extend_from_slice(&OPT_GO.to_be_bytes());
    option.extend_from_slice(&(4 + export.len() as u32 + 2).to_be_bytes());
    option.extend_from_slice(&(export.len() as u32).to_be_bytes());
    option.extend_from_slice(export.as_bytes());
    option.extend_from_slice(&0u16.to_be_bytes());
    stream.write_all(&option).unwrap();
    loop {
        let mut header = [0u8; 20];
        stream.read_exact(&mut header).unwrap();
        let reply_type = u32::from_be_bytes(header[12..16].try_into().unwrap());
        let length = u32::from_be_bytes(header[16..20].try_into().unwrap()) as usize;
        let mut payload = vec![0u8; length];
        stream.read_exact(&mut payload).unwrap();
        if reply_type & 0x8000_0000 != 0 {
            return Err(reply_type);
        }
        if reply_type == REP_ACK {
            return Ok(());
        }
    }
}

/// One WRITE of `data` at `offset`, waiting for its simple reply; no flush.
fn write_unflushed(stream: &mut (impl Read + Write), offset: u64, data: &[u8]) {
    let mut request = Vec::new();
    request.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    request.extend_from_slice(&0u16.to_be_bytes());
    request.extend_from_slice(&CMD_WRITE.to_be_bytes());
    request.extend_from_slice(&1u64.to_be_bytes());
    request.extend_from_slice(&offset.to_be_bytes());
    request.extend_from_slice(&(data.len() as u32).to_be_bytes());
    request.extend_from_slice(data);
    stream.write_all(&request).unwrap();
    let mut reply = [0u8; 16];
    stream.read_exact(&mut reply).unwrap();
    assert_eq!(
        u32::from_be_bytes(reply[4..8].try_into().unwrap()),
        0,
        "write failed"
    );
}

fn timeouts<S>(stream: S, set: impl Fn(&S, Option<Duration>) -> std::io::Result<()>) -> S {
    set(&stream, Some(Duration::from_secs(30))).unwrap();
    stream
}

#[test]
fn sigterm_with_control_and_nbd_sockets_removed_commits_and_exits() {
    let temp = TempDir::new("removed");
    let pool = new_pool(&temp.0);
    let mut server = Server::start(&["--pool", &pool], temp.0.join("stderr"));
    // A write the server acknowledged but nobody flushed: only the shutdown commit (or the
    // periodic one) makes it durable.
    let mut client = timeouts(
        UnixStream::connect(temp.0.join("nbd.sock")).unwrap(),
        UnixStream::set_read_timeout,
    );
    go(&mut client, "vm");
    write_unflushed(&mut client, 0, &[0x5a; 65536]);

    std::fs::remove_file(temp.0.join("control.sock")).unwrap();
    std::fs::remove_file(temp.0.join("nbd.sock")).unwrap();
    let (status, stderr, took) = server.terminate();
    eprintln!("stopped in {took:?}:\n{stderr}");
    assert!(status.success(), "{status}\n{stderr}");
    assert!(
        stderr.contains("control socket closed (0 clients disconnected)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("NBD listeners closed (1 connection closed)"),
        "{stderr}"
    );
    let committed = committed_at(&stderr);
    assert_eq!(transaction_id(&pool), committed);
    check_metadata(&temp.0);
    let listing: serde_json::Value =
        serde_json::from_str(&thinpool_ok(&["list", "--json", "--pool", &pool])).unwrap();
    assert_eq!(listing["volumes"][0]["mapped_blocks"], 1, "{listing}");
}

#[test]
fn sigterm_with_idle_nbd_and_control_connections_closes_them_all() {
    let temp = TempDir::new("idle");
    let pool = new_pool(&temp.0);
    let mut server = Server::start(
        &["--pool", &pool, "--tcp", "127.0.0.1:0"],
        temp.0.join("stderr"),
    );
    let nbd_socket = temp.0.join("nbd.sock");
    let mut held = Vec::new();
    // Connected, never greeted back.
    held.push(UnixStream::connect(&nbd_socket).unwrap());
    // In the handshake, waiting for an option.
    let mut stream = timeouts(
        UnixStream::connect(&nbd_socket).unwrap(),
        UnixStream::set_read_timeout,
    );
    greet(&mut stream);
    held.push(stream);
    // In transmission, idle.
    for _ in 0..2 {
        let mut stream = timeouts(
            UnixStream::connect(&nbd_socket).unwrap(),
            UnixStream::set_read_timeout,
        );
        go(&mut stream, "vm");
        held.push(stream);
    }
    let mut tcp = timeouts(
        TcpStream::connect(server.tcp()).unwrap(),
        TcpStream::set_read_timeout,
    );
    go(&mut tcp, "vm");
    // Control clients: silent, and one with half a request.
    let control_socket = temp.0.join("control.sock");
    let mut control = Vec::new();
    for _ in 0..3 {
        control.push(UnixStream::connect(&control_socket).unwrap());
    }
    let mut half = UnixStream::connect(&control_socket).unwrap();
    half.write_all(br#"{"op":"li"#).unwrap();
    control.push(half);
    // Wait until the server has taken every connection (a management op answers after the
    // accept loop has seen the earlier connections).
    thinpool_ok(&["status", "--pool", &pool]);

    let (status, stderr, took) = server.terminate();
    eprintln!("stopped in {took:?}:\n{stderr}");
    assert!(status.success(), "{status}\n{stderr}");
    assert!(
        stderr.contains("control socket closed (4 clients disconnected)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("NBD listeners closed (5 connections closed)"),
        "{stderr}"
    );
    assert_eq!(transaction_id(&pool), committed_at(&stderr));
    check_metadata(&temp.0);
    // Every held connection sees its end.
    let mut byte = [0u8; 1];
    for mut stream in held.into_iter().chain(control) {
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        while matches!(stream.read(&mut byte), Ok(n) if n > 0) {}
    }
    assert!(!control_socket.exists() && !nbd_socket.exists());
}

#[test]
fn read_only_pool_says_nothing_was_committed() {
    let temp = TempDir::new("ro");
    let pool = new_pool(&temp.0);
    let before = transaction_id(&pool);
    let metadata = persistent_data::FileDevice::open(&temp.0.join("metadata"), true).unwrap();
    thin_pool::PoolMetadata::mark_needs_check(&metadata).unwrap();
    drop(metadata);
    let mut server = Server::start(&["--pool", &pool], temp.0.join("stderr"));
    let (status, stderr, _) = server.terminate();
    assert!(status.success(), "{status}\n{stderr}");
    assert!(!stderr.contains("committed at"), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "stopped; pool read-only (needs_check): nothing committed (the pool stays at transaction {before})"
        )),
        "{stderr}"
    );
}

#[test]
fn tcp_on_loopback_warns_that_every_local_user_can_use_every_volume() {
    let temp = TempDir::new("tcp-warn");
    let pool = new_pool(&temp.0);
    let mut server = Server::start(
        &["--pool", &pool, "--tcp", "127.0.0.1:0"],
        temp.0.join("stderr"),
    );
    let stderr = server.stderr();
    assert!(
        stderr.contains(" WARN ")
            && stderr.contains("NBD on TCP 127.0.0.1:")
            && stderr.contains("no TLS and no authentication")
            && stderr.contains("every local user can read and write every volume"),
        "{stderr}"
    );
    let (status, _, _) = server.terminate();
    assert!(status.success());

    // The Unix socket alone: no warning.
    let mut server = Server::start(&["--pool", &pool], temp.0.join("stderr2"));
    assert!(!server.stderr().contains(" WARN "), "{}", server.stderr());
    server.terminate();
}

#[test]
fn tcp_on_a_non_loopback_address_is_refused_without_insecure() {
    let temp = TempDir::new("tcp-refused");
    let pool = new_pool(&temp.0);
    // Refused before anything is bound: the wildcard addresses are not loopback.
    for address in ["0.0.0.0:0", "[::]:0", "0.0.0.0"] {
        let output = thinpool(&["serve", "--pool", &pool, "--tcp", address]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{address}: {stderr}");
        assert!(
            stderr.contains("non-loopback") && stderr.contains("--insecure"),
            "{address}: {stderr}"
        );
        assert!(!temp.0.join("nbd.sock").exists());
        assert!(!temp.0.join("control.sock").exists());
    }
    // --insecure means nothing without --tcp.
    let output = thinpool(&["serve", "--pool", &pool, "--insecure"]);
    assert!(!output.status.success());
    // Loopback needs no --insecure, in either family.
    for address in ["127.0.0.1:0", "[::1]:0"] {
        if address.starts_with('[') && std::net::TcpListener::bind("[::1]:0").is_err() {
            continue; // no IPv6 loopback on this machine
        }
        let mut server = Server::start(
            &["--pool", &pool, "--tcp", address],
            temp.0.join(format!("stderr-{}", address.len())),
        );
        let (status, _, _) = server.terminate();
        assert!(status.success());
    }
}

#[test]
fn tcp_export_limits_what_tcp_serves_and_the_unix_socket_serves_all() {
    let temp = TempDir::new("tcp-export");
    let pool = new_pool(&temp.0);
    thinpool_ok(&[
        "volume", "create", "secret", "--size", "16M", "--pool", &pool,
    ]);
    let mut server = Server::start(
        &[
            "--pool",
            &pool,
            "--tcp",
            "127.0.0.1:0",
            "--tcp-export",
            "vm",
        ],
        temp.0.join("stderr"),
    );
    let stderr = server.stderr();
    assert!(
        stderr.contains("every local user can read and write the exports vm "),
        "{stderr}"
    );
    let tcp = server.tcp();
    let connect = || {
        timeouts(
            TcpStream::connect(&tcp).unwrap(),
            TcpStream::set_read_timeout,
        )
    };
    assert_eq!(try_go(&mut connect(), "vm"), Ok(()));
    // NBD_REP_ERR_UNKNOWN, as for a name that does not exist.
    assert_eq!(try_go(&mut connect(), "secret"), Err(0x8000_0006));
    assert_eq!(try_go(&mut connect(), "nothing"), Err(0x8000_0006));
    let unix = || {
        timeouts(
            UnixStream::connect(temp.0.join("nbd.sock")).unwrap(),
            UnixStream::set_read_timeout,
        )
    };
    assert_eq!(try_go(&mut unix(), "secret"), Ok(()));
    // NBD_OPT_LIST over TCP names only the allowed export.
    let listing = Command::new("timeout")
        .args(["30", "nbdinfo", "--list", "--json", &format!("nbd://{tcp}")])
        .output()
        .expect("nbdinfo (libnbd-bin) is installed");
    assert!(listing.status.success(), "{listing:?}");
    let listing: serde_json::Value = serde_json::from_slice(&listing.stdout).unwrap();
    let names: Vec<&str> = listing["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|export| export["export-name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["vm"]);
    let (status, _, _) = server.terminate();
    assert!(status.success());
}
