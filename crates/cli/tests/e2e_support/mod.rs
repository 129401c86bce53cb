//! Shared helpers for the binary's end-to-end tests: temporary directories, the `thinpool`
//! binary run with a timeout, a served pool (`thinpool serve` started, waited for, and killed
//! by PID on drop), external client tools with timeouts, a guard that kills background tools
//! by PID, and a minimal raw NBD client written from the protocol notes (independent of the
//! `nbd` crate's codec).
//!
//! NBD is big-endian on the wire, hence the explicit conversions here.
#![allow(dead_code)]
#![allow(clippy::big_endian_bytes)]

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The binary under test.
pub const THINPOOL: &str = env!("CARGO_BIN_EXE_thinpool");

pub const MIB: u64 = 1 << 20;

/// A temporary directory, removed on drop.
pub struct TempDir {
    pub path: PathBuf,
}

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "tp-{tag}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        TempDir { path }
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Panics (so the test cannot pass vacuously) if `tool` is not installed.
pub fn require_tool(tool: &str, package: &str) {
    let found = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|dir| dir.join(tool).is_file()))
        .unwrap_or(false)
        || Path::new("/usr/sbin").join(tool).is_file()
        || Path::new("/sbin").join(tool).is_file();
    assert!(
        found,
        "{tool} is missing: apt-get install -y {package} (scripts/test installs it)"
    );
}

/// Runs `program` with `args`, killing it (by PID) after `timeout`; the test fails then.
pub fn run_tool(program: &str, args: &[&str], timeout: Duration) -> Output {
    run_tool_in(program, args, timeout, None, &[])
}

/// [`run_tool`] in a working directory with extra environment variables.
pub fn run_tool_in(
    program: &str,
    args: &[&str],
    timeout: Duration,
    cwd: Option<&Path>,
    env: &[(&str, &str)],
) -> Output {
    let mut command = Command::new(program);
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env_remove("THINPOOL_POOL");
    if let Some(cwd) = cwd {
        command.current_dir(cwd);
    }
    for (key, value) in env {
        command.env(key, value);
    }
    let mut child = command
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {program}: {e}"));
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || read_all(stdout));
    let err = std::thread::spawn(move || read_all(stderr));
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{program} {args:?} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

fn read_all(mut reader: impl Read) -> Vec<u8> {
    let mut bytes = Vec::new();
    let _ = reader.read_to_end(&mut bytes);
    bytes
}

/// Runs a tool that must succeed; returns its stdout.
#[track_caller]
pub fn run_ok(program: &str, args: &[&str], timeout: Duration) -> String {
    let output = run_tool(program, args, timeout);
    assert!(
        output.status.success(),
        "{program} {args:?} failed with {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// `thinpool ARGS` (with `$THINPOOL_POOL` unset).
pub fn thinpool(args: &[&str]) -> Output {
    run_tool(THINPOOL, args, Duration::from_secs(60))
}

/// `thinpool ARGS`, which must succeed; returns stdout.
#[track_caller]
pub fn thinpool_ok(args: &[&str]) -> String {
    run_ok(THINPOOL, args, Duration::from_secs(60))
}

/// `thinpool ARGS`, which must fail; returns stderr.
#[track_caller]
pub fn thinpool_err(args: &[&str]) -> String {
    let output = thinpool(args);
    assert!(
        !output.status.success(),
        "thinpool {args:?} succeeded:\n{}",
        String::from_utf8_lossy(&output.stdout)
    );
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Creates a pool at `dir` with `extra` create arguments.
pub fn create_pool(dir: &Path, extra: &[&str]) {
    let dir = dir.to_str().unwrap();
    let mut args = vec!["create", "--pool", dir];
    args.extend_from_slice(extra);
    thinpool_ok(&args);
}

/// Creates a volume.
pub fn create_volume(dir: &Path, name: &str, size: &str) {
    thinpool_ok(&[
        "volume",
        "create",
        name,
        "--size",
        size,
        "--pool",
        dir.to_str().unwrap(),
    ]);
}

/// A running `thinpool serve`; killed (SIGKILL, by PID) on drop unless stopped.
pub struct Served {
    pub child: Child,
    pub pool: PathBuf,
    pub socket: PathBuf,
    pub tcp: Option<String>,
    pub banner: String,
    stderr_path: PathBuf,
}

impl Served {
    /// Starts `thinpool serve --pool POOL EXTRA...` and waits for "thinpool: ready".
    pub fn start(pool: &Path, extra: &[&str]) -> Served {
        Served::start_in(pool, extra, None)
    }

    /// As [`Served::start`], with a working directory; `pool` may be empty to use the
    /// default pool directory of `cwd`.
    pub fn start_in(pool: &Path, extra: &[&str], cwd: Option<&Path>) -> Served {
        let mut command = Command::new(THINPOOL);
        command.arg("serve");
        if !pool.as_os_str().is_empty() {
            command.arg("--pool").arg(pool);
        }
        command.args(extra).env_remove("THINPOOL_POOL");
        if let Some(cwd) = cwd {
            command.current_dir(cwd);
        }
        let stderr_path = std::env::temp_dir().join(format!(
            "tp-serve-stderr-{}-{}",
            std::process::id(),
            unique()
        ));
        let stderr = std::fs::File::create(&stderr_path).unwrap();
        let mut child = command
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
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut banner = String::new();
        let mut served = Served {
            child,
            pool: pool.to_path_buf(),
            socket: PathBuf::new(),
            tcp: None,
            banner: String::new(),
            stderr_path,
        };
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match receiver.recv_timeout(left) {
                Ok(line) => {
                    banner.push_str(&line);
                    banner.push('\n');
                    if let Some(socket) = line.trim().strip_prefix("NBD socket:") {
                        served.socket = PathBuf::from(socket.trim());
                    }
                    if let Some(tcp) = line.trim().strip_prefix("NBD TCP:") {
                        served.tcp = Some(tcp.trim().to_string());
                    }
                    if line.starts_with("thinpool: ready") {
                        break;
                    }
                }
                Err(_) => {
                    let stderr = served.stderr();
                    panic!(
                        "thinpool serve did not become ready:\n{banner}\n--- stderr ---\n{stderr}"
                    );
                }
            }
        }
        served.banner = banner;
        served
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The server's stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// `nbd+unix:///NAME?socket=...`.
    pub fn uri(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.socket.display())
    }

    /// Sends SIGTERM and waits (up to 30 s) for a clean exit; returns the exit status.
    pub fn stop(mut self) -> std::process::ExitStatus {
        let pid = self.pid().to_string();
        run_ok("kill", &["-TERM", &pid], Duration::from_secs(5));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            if Instant::now() >= deadline {
                panic!("thinpool serve ignored SIGTERM:\n{}", self.stderr());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, as a crash.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A number not returned before in this process.
fn unique() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    COUNTER.fetch_add(1, Ordering::SeqCst)
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.stderr_path);
    }
}

/// A background process (nbdfuse, ...) killed by PID on drop.
pub struct Background {
    pub child: Child,
    pub name: String,
}

impl Background {
    pub fn spawn(program: &str, args: &[&str]) -> Background {
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {program}: {e}"));
        Background {
            child,
            name: program.to_string(),
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until `condition` holds, polling, or panics after `timeout`.
#[track_caller]
pub fn wait_for(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Allocated ranges `(offset, length)` from `nbdinfo --map --json`, merged.
pub fn nbdinfo_data_extents(uri: &str) -> Vec<(u64, u64)> {
    let text = run_ok(
        "nbdinfo",
        &["--map", "--json", uri],
        Duration::from_secs(30),
    );
    let extents: serde_json::Value = serde_json::from_str(&text).expect("nbdinfo json");
    let mut ranges = Vec::new();
    for extent in extents.as_array().expect("array") {
        let kind = extent["type"].as_u64().unwrap();
        if kind & 1 == 0 {
            ranges.push((
                extent["offset"].as_u64().unwrap(),
                extent["length"].as_u64().unwrap(),
            ));
        }
    }
    merge(ranges)
}

/// Allocated ranges from `qemu-img map --output=json`, merged.
pub fn qemu_img_data_extents(uri: &str) -> Vec<(u64, u64)> {
    let text = run_ok(
        "qemu-img",
        &["map", "--output=json", "-f", "raw", uri],
        Duration::from_secs(30),
    );
    let extents: serde_json::Value = serde_json::from_str(&text).expect("qemu-img json");
    let mut ranges = Vec::new();
    for extent in extents.as_array().expect("array") {
        if extent["data"].as_bool().unwrap() {
            ranges.push((
                extent["start"].as_u64().unwrap(),
                extent["length"].as_u64().unwrap(),
            ));
        }
    }
    merge(ranges)
}

/// Sorts and merges adjacent ranges.
pub fn merge(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (offset, length) in ranges {
        match merged.last_mut() {
            Some(last) if last.0 + last.1 == offset => last.1 += length,
            _ => merged.push((offset, length)),
        }
    }
    merged
}

// ---- a minimal raw NBD client --------------------------------------------------------------

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const OPT_GO: u32 = 7;
pub const REP_ACK: u32 = 1;
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const EINVAL: u32 = 22;
pub const EPERM: u32 = 1;

/// A raw NBD connection in transmission, with simple replies only.
pub struct RawClient {
    pub stream: UnixStream,
    pub size: u64,
    pub flags: u16,
    next_handle: u64,
}

/// A simple reply: handle, error, and the payload of a READ.
pub struct Reply {
    pub handle: u64,
    pub error: u32,
}

impl RawClient {
    /// Connects and negotiates `export` with NBD_OPT_GO; panics if the server refuses.
    pub fn connect(socket: &Path, export: &str) -> RawClient {
        let client = RawClient::try_connect(socket, export)
            .unwrap_or_else(|error| panic!("cannot open export {export:?}: {error}"));
        client
            .stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        client
    }

    /// Connects and negotiates; `Err` with the option reply type if the server refuses.
    pub fn try_connect(socket: &Path, export: &str) -> Result<RawClient, String> {
        let mut stream = UnixStream::connect(socket).map_err(|e| e.to_string())?;
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut greeting = [0u8; 18];
        stream
            .read_exact(&mut greeting)
            .map_err(|e| e.to_string())?;
        assert_eq!(
            u64::from_be_bytes(greeting[..8].try_into().unwrap()),
            NBDMAGIC
        );
        assert_eq!(
            u64::from_be_bytes(greeting[8..16].try_into().unwrap()),
            IHAVEOPT
        );
        // Fixed newstyle, no zeroes.
        stream.write_all(&3u32.to_be_bytes()).unwrap();
        let mut data = Vec::new();
        data.extend_from_slice(&(export.len() as u32).to_be_bytes());
        data.extend_from_slice(export.as_bytes());
        data.extend_from_slice(&0u16.to_be_bytes());
        let mut option = Vec::new();
        option.extend_from_slice(&IHAVEOPT.to_be_bytes());
        option.extend_from_slice(&OPT_GO.to_be_bytes());
        option.extend_from_slice(&(data.len() as u32).to_be_bytes());
        option.extend_from_slice(&data);
        stream.write_all(&option).unwrap();
        let mut size = 0;
        let mut flags = 0;
        loop {
            let mut header = [0u8; 20];
            stream.read_exact(&mut header).map_err(|e| e.to_string())?;
            assert_eq!(
                u64::from_be_bytes(header[..8].try_into().unwrap()),
                OPTION_REPLY_MAGIC
            );
            let reply_type = u32::from_be_bytes(header[12..16].try_into().unwrap());
            let length = u32::from_be_bytes(header[16..20].try_into().unwrap()) as usize;
            let mut payload = vec![0u8; length];
            stream.read_exact(&mut payload).map_err(|e| e.to_string())?;
            if reply_type == REP_ACK {
                break;
            }
            if reply_type & 0x8000_0000 != 0 {
                return Err(format!(
                    "option refused with {reply_type:#x}: {}",
                    String::from_utf8_lossy(&payload)
                ));
            }
            // NBD_REP_INFO / NBD_INFO_EXPORT: size and transmission flags.
            if payload.len() >= 12 && u16::from_be_bytes([payload[0], payload[1]]) == 0 {
                size = u64::from_be_bytes(payload[2..10].try_into().unwrap());
                flags = u16::from_be_bytes([payload[10], payload[11]]);
            }
        }
        Ok(RawClient {
            stream,
            size,
            flags,
            next_handle: 1,
        })
    }

    /// Sends a request header (and payload, if any); returns its handle.
    pub fn send(
        &mut self,
        command: u16,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> u64 {
        let handle = self.next_handle;
        self.next_handle += 1;
        let mut request = Vec::with_capacity(28 + payload.len());
        request.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        request.extend_from_slice(&flags.to_be_bytes());
        request.extend_from_slice(&command.to_be_bytes());
        request.extend_from_slice(&handle.to_be_bytes());
        request.extend_from_slice(&offset.to_be_bytes());
        request.extend_from_slice(&length.to_be_bytes());
        request.extend_from_slice(payload);
        self.stream.write_all(&request).unwrap();
        handle
    }

    /// Reads a simple reply header; `read_length` bytes of payload follow a successful READ.
    pub fn reply(&mut self, read_length: usize) -> (Reply, Vec<u8>) {
        let mut header = [0u8; 16];
        self.stream.read_exact(&mut header).expect("reply header");
        assert_eq!(
            u32::from_be_bytes(header[..4].try_into().unwrap()),
            SIMPLE_REPLY_MAGIC
        );
        let error = u32::from_be_bytes(header[4..8].try_into().unwrap());
        let handle = u64::from_be_bytes(header[8..16].try_into().unwrap());
        let mut data = Vec::new();
        if error == 0 && read_length > 0 {
            data = vec![0u8; read_length];
            self.stream.read_exact(&mut data).expect("read payload");
        }
        (Reply { handle, error }, data)
    }

    /// WRITE, waiting for the reply; returns the error value.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> u32 {
        let handle = self.send(CMD_WRITE, 0, offset, data.len() as u32, data);
        let (reply, _) = self.reply(0);
        assert_eq!(reply.handle, handle);
        reply.error
    }

    /// READ, which must succeed.
    pub fn read(&mut self, offset: u64, length: usize) -> Vec<u8> {
        let handle = self.send(CMD_READ, 0, offset, length as u32, &[]);
        let (reply, data) = self.reply(length);
        assert_eq!(reply.handle, handle);
        assert_eq!(reply.error, 0, "read at {offset} failed");
        data
    }

    /// FLUSH; returns the error value.
    pub fn flush(&mut self) -> u32 {
        let handle = self.send(CMD_FLUSH, 0, 0, 0, &[]);
        let (reply, _) = self.reply(0);
        assert_eq!(reply.handle, handle);
        reply.error
    }

    /// A WRITE or FLUSH that reports socket failures instead of panicking (for crash
    /// tests): `Ok(error value)` from the reply.
    pub fn try_command(
        &mut self,
        command: u16,
        offset: u64,
        payload: &[u8],
    ) -> std::io::Result<u32> {
        let handle = self.next_handle;
        self.next_handle += 1;
        let mut request = header_bytes(command, handle, offset, payload.len() as u32);
        request.extend_from_slice(payload);
        self.stream.write_all(&request)?;
        let mut reply = [0u8; 16];
        self.stream.read_exact(&mut reply)?;
        if u32::from_be_bytes(reply[..4].try_into().unwrap()) != SIMPLE_REPLY_MAGIC
            || u64::from_be_bytes(reply[8..16].try_into().unwrap()) != handle
        {
            return Err(std::io::Error::other("unexpected reply"));
        }
        Ok(u32::from_be_bytes(reply[4..8].try_into().unwrap()))
    }

    /// NBD_CMD_DISC and close.
    pub fn disconnect(mut self) {
        self.send(CMD_DISC, 0, 0, 0, &[]);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

fn header_bytes(command: u16, handle: u64, offset: u64, length: u32) -> Vec<u8> {
    let mut request = Vec::with_capacity(28);
    request.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    request.extend_from_slice(&0u16.to_be_bytes());
    request.extend_from_slice(&command.to_be_bytes());
    request.extend_from_slice(&handle.to_be_bytes());
    request.extend_from_slice(&offset.to_be_bytes());
    request.extend_from_slice(&length.to_be_bytes());
    request
}

/// Deterministic bytes for (`tag`, `offset`).
pub fn pattern(tag: u64, length: usize) -> Vec<u8> {
    let mut state = tag.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..length)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}
