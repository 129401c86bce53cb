//! Shared test helpers: a server on a Unix socket in a temporary directory, a raw NBD client
//! written from the protocol notes (independent of the crate's own codec), seeded randomness,
//! and a guard for spawned client tools (timeout, kill by PID on drop).
//!
//! NBD is big-endian on the wire, hence the explicit conversions here.
#![allow(dead_code)]
#![allow(clippy::big_endian_bytes)]

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nbd::{Config, ExportMap, MemoryExport, Server};

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;
pub const OPT_EXTENDED_HEADERS: u32 = 11;

pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_UNSUP: u32 = 0x8000_0001;
pub const REP_ERR_INVALID: u32 = 0x8000_0003;
pub const REP_ERR_UNKNOWN: u32 = 0x8000_0006;
pub const REP_ERR_SHUTDOWN: u32 = 0x8000_0007;
pub const REP_ERR_TOO_BIG: u32 = 0x8000_0009;
pub const REP_ERR_EXT_HEADER_REQD: u32 = 0x8000_000a;

pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

pub const FLAG_FUA: u16 = 1;
pub const FLAG_NO_HOLE: u16 = 2;
pub const FLAG_DF: u16 = 4;
pub const FLAG_REQ_ONE: u16 = 8;
pub const FLAG_FAST_ZERO: u16 = 16;
pub const FLAG_PAYLOAD_LEN: u16 = 32;

pub const TF_HAS_FLAGS: u16 = 1;
pub const TF_READ_ONLY: u16 = 2;
pub const TF_SEND_FLUSH: u16 = 4;
pub const TF_SEND_FUA: u16 = 8;
pub const TF_SEND_TRIM: u16 = 32;
pub const TF_SEND_WRITE_ZEROES: u16 = 64;
pub const TF_SEND_DF: u16 = 128;
pub const TF_CAN_MULTI_CONN: u16 = 256;
pub const TF_SEND_CACHE: u16 = 1024;
pub const TF_SEND_FAST_ZERO: u16 = 2048;

pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;

pub const CHUNK_NONE: u16 = 0;
pub const CHUNK_OFFSET_DATA: u16 = 1;
pub const CHUNK_OFFSET_HOLE: u16 = 2;
pub const CHUNK_BLOCK_STATUS: u16 = 5;
pub const CHUNK_BLOCK_STATUS_EXT: u16 = 6;
pub const CHUNK_ERROR: u16 = 0x8001;
pub const CHUNK_ERROR_OFFSET: u16 = 0x8002;

pub const MIB: u64 = 1024 * 1024;

/// Seed from THINPOOL_SEED, else from the clock; printed so a failure can be replayed.
pub fn seed() -> u64 {
    let seed = std::env::var("THINPOOL_SEED")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("THINPOOL_SEED={seed} (set it to replay this run)");
    seed
}

/// A temporary directory removed on drop.
pub struct TempDir {
    pub path: PathBuf,
}

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "nbd-test-{tag}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&path).unwrap();
        TempDir { path }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A server on a Unix socket serving an [`ExportMap`].
pub struct TestServer {
    pub server: Option<Server>,
    pub exports: Arc<ExportMap>,
    pub socket: PathBuf,
    pub dir: TempDir,
}

impl TestServer {
    pub fn start(exports: Vec<Arc<MemoryExport>>) -> Self {
        Self::start_with(exports, Config::default())
    }

    pub fn start_with(exports: Vec<Arc<MemoryExport>>, config: Config) -> Self {
        let map = Arc::new(ExportMap::new());
        for export in exports {
            map.insert(export);
        }
        let dir = TempDir::new("srv");
        let socket = dir.path.join("nbd.sock");
        let mut server = Server::new(map.clone(), config);
        server.listen_unix(&socket).unwrap();
        TestServer {
            server: Some(server),
            exports: map,
            socket,
            dir,
        }
    }

    /// libnbd/qemu URI for export `name` on this server.
    pub fn uri(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.socket.display())
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            server.shutdown();
        }
    }
}

/// Fails with the Debian package to install if `tool` is not on PATH.
pub fn require_tool(tool: &str, package: &str) {
    let found = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).any(|dir| dir.join(tool).is_file()))
        .unwrap_or(false);
    assert!(
        found,
        "`{tool}` not found: install the Debian package `{package}` (apt-get install -y {package})"
    );
}

/// Kills the child by PID when dropped unless it was waited for.
pub struct ChildGuard {
    child: Option<Child>,
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Runs `program args` with a timeout; panics (after killing it) if it takes longer.
pub fn run_tool(program: &str, args: &[&str], timeout: Duration) -> Output {
    let child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("spawn {program}: {error}"));
    let mut guard = ChildGuard { child: Some(child) };
    let child = guard.child.as_mut().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out_thread = std::thread::spawn(move || {
        let mut buffer = Vec::new();
        let _ = stdout.read_to_end(&mut buffer);
        buffer
    });
    let err_thread = std::thread::spawn(move || {
        let mut buffer = Vec::new();
        let _ = stderr.read_to_end(&mut buffer);
        buffer
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = guard.child.as_mut().unwrap().try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            drop(guard);
            panic!("{program} {args:?} did not finish within {timeout:?}; killed");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    guard.child = None;
    Output {
        status,
        stdout: out_thread.join().unwrap(),
        stderr: err_thread.join().unwrap(),
    }
}

/// Runs a tool and requires success; returns stdout.
pub fn run_ok(program: &str, args: &[&str], timeout: Duration) -> String {
    let output = run_tool(program, args, timeout);
    assert!(
        output.status.success(),
        "{program} {args:?} failed with {}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Deterministic pseudo-random bytes for a pattern id.
pub fn pattern(id: u64, length: usize) -> Vec<u8> {
    let mut state = id.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..length)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// One option reply.
#[derive(Debug, Clone)]
pub struct OptionReply {
    pub option: u32,
    pub reply_type: u32,
    pub data: Vec<u8>,
}

/// Reply framing in the transmission phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Simple,
    Structured,
    Extended,
}

/// A finished reply, reassembled from its chunks.
#[derive(Debug, Default)]
pub struct Completed {
    pub cookie: u64,
    pub error: u32,
    pub error_message: String,
    pub data: Vec<u8>,
    pub chunk_types: Vec<u16>,
    /// (context id, [(length, flags)]) per block-status chunk.
    pub block_status: Vec<(u32, Vec<(u64, u64)>)>,
}

struct Pending {
    command: u16,
    offset: u64,
    length: u64,
    partial: Completed,
}

/// A hand-written NBD client over a Unix socket.
pub struct RawClient {
    pub stream: UnixStream,
    pub mode: Mode,
    next_cookie: u64,
    pending: HashMap<u64, Pending>,
}

pub fn be16(bytes: &[u8]) -> u16 {
    u16::from_be_bytes(bytes[..2].try_into().unwrap())
}
pub fn be32(bytes: &[u8]) -> u32 {
    u32::from_be_bytes(bytes[..4].try_into().unwrap())
}
pub fn be64(bytes: &[u8]) -> u64 {
    u64::from_be_bytes(bytes[..8].try_into().unwrap())
}

/// GO/INFO option data.
pub fn export_request(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut data = Vec::new();
    data.extend_from_slice(&(name.len() as u32).to_be_bytes());
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for info in infos {
        data.extend_from_slice(&info.to_be_bytes());
    }
    data
}

/// LIST/SET_META_CONTEXT option data.
pub fn meta_request(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut data = Vec::new();
    data.extend_from_slice(&(name.len() as u32).to_be_bytes());
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for query in queries {
        data.extend_from_slice(&(query.len() as u32).to_be_bytes());
        data.extend_from_slice(query.as_bytes());
    }
    data
}

impl RawClient {
    /// Connects and reads the greeting (checked), without sending client flags.
    pub fn connect(socket: &Path) -> Self {
        let stream = UnixStream::connect(socket).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut client = RawClient {
            stream,
            mode: Mode::Simple,
            next_cookie: 1,
            pending: HashMap::new(),
        };
        let greeting = client.read_bytes(18);
        assert_eq!(be64(&greeting[0..]), NBDMAGIC);
        assert_eq!(be64(&greeting[8..]), IHAVEOPT);
        assert_eq!(be16(&greeting[16..]), 3, "FIXED_NEWSTYLE | NO_ZEROES");
        client
    }

    /// Connects, reads the greeting and sends FIXED_NEWSTYLE | NO_ZEROES.
    pub fn start(socket: &Path) -> Self {
        let mut client = Self::connect(socket);
        client.send(&3u32.to_be_bytes());
        client
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).unwrap();
    }

    pub fn read_bytes(&mut self, length: usize) -> Vec<u8> {
        let mut buffer = vec![0u8; length];
        self.stream.read_exact(&mut buffer).unwrap();
        buffer
    }

    /// True if the server closed the connection (EOF or reset) within the read timeout.
    pub fn is_closed(&mut self) -> bool {
        let mut byte = [0u8; 1];
        loop {
            match self.stream.read(&mut byte) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(error) => panic!("waiting for close: {error}"),
            }
        }
    }

    pub fn send_option(&mut self, code: u32, data: &[u8]) {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&IHAVEOPT.to_be_bytes());
        bytes.extend_from_slice(&code.to_be_bytes());
        bytes.extend_from_slice(&(data.len() as u32).to_be_bytes());
        bytes.extend_from_slice(data);
        self.send(&bytes);
    }

    pub fn read_option_reply(&mut self) -> OptionReply {
        let header = self.read_bytes(20);
        assert_eq!(be64(&header), OPTION_REPLY_MAGIC);
        let length = be32(&header[16..]) as usize;
        assert!(length <= 64 * 1024, "option reply of {length} bytes");
        OptionReply {
            option: be32(&header[8..]),
            reply_type: be32(&header[12..]),
            data: self.read_bytes(length),
        }
    }

    /// Sends an option and collects replies up to the final ACK or error.
    pub fn option(&mut self, code: u32, data: &[u8]) -> Vec<OptionReply> {
        self.send_option(code, data);
        let mut replies = Vec::new();
        loop {
            let reply = self.read_option_reply();
            assert_eq!(reply.option, code, "reply to the wrong option");
            let last = reply.reply_type == REP_ACK || reply.reply_type & 0x8000_0000 != 0;
            replies.push(reply);
            if last {
                return replies;
            }
        }
    }

    /// Negotiates `mode`, optionally selects base:allocation, and GOes to `name`.
    /// Returns (size, transmission flags, context id).
    pub fn negotiate(socket: &Path, name: &str, mode: Mode, meta: bool) -> (Self, u64, u16, u32) {
        let mut client = Self::start(socket);
        match mode {
            Mode::Simple => {}
            Mode::Structured => {
                let replies = client.option(OPT_STRUCTURED_REPLY, &[]);
                assert_eq!(replies[0].reply_type, REP_ACK);
            }
            Mode::Extended => {
                let replies = client.option(OPT_EXTENDED_HEADERS, &[]);
                assert_eq!(replies[0].reply_type, REP_ACK);
            }
        }
        let mut context = 0;
        if meta {
            let replies = client.option(
                OPT_SET_META_CONTEXT,
                &meta_request(name, &["base:allocation"]),
            );
            assert_eq!(replies.len(), 2, "{replies:?}");
            assert_eq!(replies[0].reply_type, REP_META_CONTEXT);
            assert_eq!(&replies[0].data[4..], b"base:allocation");
            context = be32(&replies[0].data);
        }
        let (size, flags) = client.go(name);
        client.mode = mode;
        (client, size, flags, context)
    }

    /// Sends GO asking for BLOCK_SIZE; requires success and returns (size, flags).
    pub fn go(&mut self, name: &str) -> (u64, u16) {
        let replies = self.option(OPT_GO, &export_request(name, &[3]));
        let last = replies.last().unwrap();
        assert_eq!(last.reply_type, REP_ACK, "GO failed: {replies:?}");
        let export = replies
            .iter()
            .find(|reply| reply.reply_type == REP_INFO && be16(&reply.data) == 0)
            .expect("NBD_INFO_EXPORT");
        assert_eq!(export.data.len(), 12);
        (be64(&export.data[2..]), be16(&export.data[10..]))
    }

    /// Sends a request; returns its cookie. `payload` goes after the header.
    pub fn send_request(
        &mut self,
        command: u16,
        flags: u16,
        offset: u64,
        length: u64,
        payload: &[u8],
    ) -> u64 {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let mut bytes = Vec::with_capacity(32 + payload.len());
        match self.mode {
            Mode::Extended => {
                bytes.extend_from_slice(&0x21e4_1c71u32.to_be_bytes());
                bytes.extend_from_slice(&flags.to_be_bytes());
                bytes.extend_from_slice(&command.to_be_bytes());
                bytes.extend_from_slice(&cookie.to_be_bytes());
                bytes.extend_from_slice(&offset.to_be_bytes());
                bytes.extend_from_slice(&length.to_be_bytes());
            }
            _ => {
                bytes.extend_from_slice(&0x2560_9513u32.to_be_bytes());
                bytes.extend_from_slice(&flags.to_be_bytes());
                bytes.extend_from_slice(&command.to_be_bytes());
                bytes.extend_from_slice(&cookie.to_be_bytes());
                bytes.extend_from_slice(&offset.to_be_bytes());
                bytes.extend_from_slice(&(length as u32).to_be_bytes());
            }
        }
        bytes.extend_from_slice(payload);
        self.send(&bytes);
        if command != CMD_DISC {
            self.pending.insert(
                cookie,
                Pending {
                    command,
                    offset,
                    length,
                    partial: Completed {
                        cookie,
                        ..Default::default()
                    },
                },
            );
        }
        cookie
    }

    /// Reads messages until some request is complete; validates framing as it goes.
    pub fn read_completed(&mut self) -> Completed {
        loop {
            let magic = be32(&self.read_bytes(4));
            match magic {
                0x6744_6698 => {
                    let rest = self.read_bytes(12);
                    let error = be32(&rest);
                    let cookie = be64(&rest[4..]);
                    let pending = self
                        .pending
                        .remove(&cookie)
                        .unwrap_or_else(|| panic!("simple reply for unknown cookie {cookie}"));
                    assert!(
                        pending.command != CMD_READ || self.mode == Mode::Simple || error != 0,
                        "successful READ answered with a simple reply in {:?} mode",
                        self.mode
                    );
                    assert_ne!(self.mode, Mode::Extended, "simple reply in extended mode");
                    let mut completed = pending.partial;
                    completed.error = error;
                    if pending.command == CMD_READ && error == 0 {
                        completed.data = self.read_bytes(pending.length as usize);
                    }
                    return completed;
                }
                0x668e_33ef | 0x6e8a_278c => {
                    let extended = magic == 0x6e8a_278c;
                    assert_eq!(
                        extended,
                        self.mode == Mode::Extended,
                        "chunk magic for mode"
                    );
                    let rest = self.read_bytes(if extended { 28 } else { 16 });
                    let flags = be16(&rest);
                    let chunk_type = be16(&rest[2..]);
                    let cookie = be64(&rest[4..]);
                    let length = if extended {
                        be64(&rest[20..])
                    } else {
                        u64::from(be32(&rest[12..]))
                    };
                    assert!(length <= 64 * MIB, "chunk payload {length}");
                    let payload = self.read_bytes(length as usize);
                    let pending = self
                        .pending
                        .get_mut(&cookie)
                        .unwrap_or_else(|| panic!("chunk for unknown cookie {cookie}"));
                    if extended {
                        assert_eq!(be64(&rest[12..]), pending.offset, "extended chunk offset");
                    }
                    Self::apply_chunk(pending, chunk_type, &payload);
                    if flags & 1 != 0 {
                        let pending = self.pending.remove(&cookie).unwrap();
                        let mut completed = pending.partial;
                        if pending.command == CMD_READ
                            && completed.error == 0
                            && completed.data.is_empty()
                        {
                            completed.data = vec![0u8; pending.length as usize];
                        }
                        return completed;
                    }
                }
                other => panic!("bad reply magic {other:#x}"),
            }
        }
    }

    fn apply_chunk(pending: &mut Pending, chunk_type: u16, payload: &[u8]) {
        let completed = &mut pending.partial;
        completed.chunk_types.push(chunk_type);
        match chunk_type {
            CHUNK_NONE => assert!(payload.is_empty()),
            CHUNK_OFFSET_DATA => {
                assert_eq!(pending.command, CMD_READ);
                let offset = be64(payload);
                let data = &payload[8..];
                assert!(offset >= pending.offset);
                assert!(offset + data.len() as u64 <= pending.offset + pending.length);
                if completed.data.is_empty() {
                    completed.data = vec![0u8; pending.length as usize];
                }
                let at = (offset - pending.offset) as usize;
                completed.data[at..at + data.len()].copy_from_slice(data);
            }
            CHUNK_OFFSET_HOLE => {
                assert_eq!(pending.command, CMD_READ);
                if completed.data.is_empty() {
                    completed.data = vec![0u8; pending.length as usize];
                }
            }
            CHUNK_BLOCK_STATUS => {
                assert_eq!(pending.command, CMD_BLOCK_STATUS);
                assert_eq!((payload.len() - 4) % 8, 0);
                let id = be32(payload);
                let extents = payload[4..]
                    .chunks(8)
                    .map(|pair| (u64::from(be32(pair)), u64::from(be32(&pair[4..]))))
                    .collect();
                completed.block_status.push((id, extents));
            }
            CHUNK_BLOCK_STATUS_EXT => {
                assert_eq!(pending.command, CMD_BLOCK_STATUS);
                let id = be32(payload);
                let count = be32(&payload[4..]) as usize;
                assert_eq!(payload.len(), 8 + 16 * count);
                let extents = payload[8..]
                    .chunks(16)
                    .map(|pair| (be64(pair), be64(&pair[8..])))
                    .collect();
                completed.block_status.push((id, extents));
            }
            CHUNK_ERROR | CHUNK_ERROR_OFFSET => {
                completed.error = be32(payload);
                let message_length = be16(&payload[4..]) as usize;
                completed.error_message =
                    String::from_utf8(payload[6..6 + message_length].to_vec()).unwrap();
            }
            other => panic!("unknown chunk type {other}"),
        }
    }

    /// Sends one request and waits for its reply (nothing else may be in flight).
    pub fn request(
        &mut self,
        command: u16,
        flags: u16,
        offset: u64,
        length: u64,
        payload: &[u8],
    ) -> Completed {
        let cookie = self.send_request(command, flags, offset, length, payload);
        let completed = self.read_completed();
        assert_eq!(completed.cookie, cookie);
        completed
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) {
        let reply = self.request(CMD_WRITE, 0, offset, data.len() as u64, data);
        assert_eq!(reply.error, 0, "write at {offset}: {}", reply.error_message);
    }

    pub fn read(&mut self, offset: u64, length: u64) -> Vec<u8> {
        let reply = self.request(CMD_READ, 0, offset, length, &[]);
        assert_eq!(reply.error, 0, "read at {offset}: {}", reply.error_message);
        assert_eq!(reply.data.len() as u64, length);
        reply.data
    }

    pub fn disconnect(mut self) {
        self.send_request(CMD_DISC, 0, 0, 0, &[]);
        assert!(self.is_closed(), "server did not close after DISC");
    }
}
