//! The control socket: management of a pool that `thinpool serve` holds, as JSON lines on a
//! Unix socket (default `control.sock` in the pool directory, mode 0600), and the one entry
//! point the management commands use, [`perform`], which opens the pool directly when no
//! server holds it and asks the server otherwise, so both paths give the same answers.
//!
//! Protocol: the client sends one JSON object per line, the server answers each with one line.
//!
//! ```text
//!   -> {"op":"create_volume","name":"vm1","size_bytes":1073741824}
//!   <- {"ok":true,"volume":{"name":"vm1","id":1,"size_bytes":1073741824,...}}
//!   -> {"op":"snapshot","origin":"vm1","name":"snap","read_only":true}
//!   -> {"op":"delete_volume","name":"vm1"}
//!   <- {"ok":false,"error":{"errno":16,"code":"EBUSY","message":"volume \"vm1\" is open"}}
//!   -> {"op":"resize_volume","name":"vm1","size_bytes":2147483648}
//!   -> {"op":"grow_data","size_bytes":21474836480}      (answers with the status)
//!   -> {"op":"list"}                                     (answers {"ok":true,"volumes":[...]})
//!   -> {"op":"status"}                                   (answers {"ok":true,"status":{...}})
//! ```
//!
//! Requests are checked strictly: an unknown `op`, a missing field or a field the request does
//! not have is refused with EINVAL (the connection goes on).
//!
//! Limits: a request line is at most [`REQUEST_BYTES_MAX`] bytes (longer ones get an error and
//! the connection is closed); each request must arrive whole within [`REQUEST_TIMEOUT`] of the
//! previous answer (or of connecting), else the client gets ETIMEDOUT and is closed; at most
//! [`CONNECTIONS_MAX`] clients at once, each on its own thread, and a new client at the cap
//! takes the place of the one idle the longest, so idle clients cannot lock management out
//! (only [`CONNECTIONS_MAX`] requests being carried out at once make a new client get EBUSY).
//! Management is serialized by the engine, not by this server.
//!
//! Shutdown ([`ControlServer::shutdown`]) is bounded: the accept loop polls a stop flag every
//! [`ACCEPT_POLL_INTERVAL`] (it is never left waiting for a wake-up connection, which could
//! not reach it if the socket file was removed), connections are cut, and requests being
//! carried out get at most [`STOP_WAIT`].

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};

use anyhow::{bail, Context};
use nbd::sync::lock;
use serde::{Deserialize, Serialize};
use thin_pool::{Pool, PoolStatus, VolumeInfo};

use crate::pool_dir::{percent, PoolDir, StoredOptions};

/// Longest request line the server reads.
pub const REQUEST_BYTES_MAX: usize = 64 * 1024;
/// Longest response line the client reads (a listing of many volumes).
pub const RESPONSE_BYTES_MAX: usize = 64 * 1024 * 1024;
/// Control clients served at once (one thread each); see the module notes for what happens
/// to one more.
pub const CONNECTIONS_MAX: usize = 16;
/// How long the server waits for a whole request line before it drops the client.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the server waits for a client to take an answer.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the client waits for an answer (a snapshot or resize commits the pool).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(120);

/// One management request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Create a thin volume.
    CreateVolume {
        /// Volume name.
        name: String,
        /// Virtual size.
        size_bytes: u64,
    },
    /// Snapshot `origin` as `name`.
    Snapshot {
        /// The volume to snapshot.
        origin: String,
        /// The new volume's name.
        name: String,
        /// Refuse writes to the snapshot.
        #[serde(default)]
        read_only: bool,
    },
    /// Delete a volume (refused while a client has it open).
    DeleteVolume {
        /// Volume name.
        name: String,
    },
    /// Change a volume's virtual size.
    ResizeVolume {
        /// Volume name.
        name: String,
        /// New virtual size.
        size_bytes: u64,
    },
    /// Grow the data device.
    GrowData {
        /// New data size.
        size_bytes: u64,
    },
    /// List volumes.
    List,
    /// Pool status.
    Status,
}

/// One volume, as `list` and the volume commands report it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VolumeRecord {
    /// Name (also the NBD export name).
    pub name: String,
    /// Id in the metadata (dm-thin's device id).
    pub id: u64,
    /// Virtual size.
    pub size_bytes: u64,
    /// Mapped data blocks.
    pub mapped_blocks: u64,
    /// Mapped share of the virtual size, in percent.
    pub mapped_percent: f64,
    /// Data block size.
    pub block_size_bytes: u64,
    /// The volume it is a snapshot of.
    pub origin: Option<String>,
    /// Writes refused.
    pub read_only: bool,
    /// Open handles (NBD connections using it).
    pub open_count: usize,
}

impl From<&VolumeInfo> for VolumeRecord {
    fn from(info: &VolumeInfo) -> Self {
        VolumeRecord {
            name: info.name.clone(),
            id: u64::from(info.id.get()),
            size_bytes: info.size_bytes,
            mapped_blocks: info.mapped_blocks,
            mapped_percent: info.mapped_percent(),
            block_size_bytes: info.block_size_bytes,
            origin: info.origin.clone(),
            read_only: info.read_only,
            open_count: info.open_count,
        }
    }
}

/// The pool's status, as `status` reports it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StatusRecord {
    /// Committed transaction id.
    pub transaction_id: u64,
    /// Data blocks in use.
    pub data_used_blocks: u64,
    /// Data blocks in the pool.
    pub data_total_blocks: u64,
    /// Data use in percent.
    pub data_used_percent: f64,
    /// Metadata blocks in use.
    pub metadata_used_blocks: u64,
    /// Metadata blocks in the pool.
    pub metadata_total_blocks: u64,
    /// Metadata use in percent.
    pub metadata_used_percent: f64,
    /// Data block size.
    pub block_size_bytes: u64,
    /// dm-thin's mode word: rw, out_of_data_space, ro, fail.
    pub mode: String,
    /// The metadata needs a check before the pool may write again.
    pub needs_check: bool,
    /// New blocks are zeroed where their first write does not cover them.
    pub zero_new_blocks: bool,
    /// Writes fail at once when out of data space.
    pub error_if_no_space: bool,
    /// Freed data blocks are discarded on the data device.
    pub discard_passdown: bool,
    /// Free data blocks fell to the low-water mark.
    pub low_water_reached: bool,
    /// Metadata block of a held metadata snapshot.
    pub metadata_snap: Option<u64>,
    /// Volumes in the pool.
    pub volume_count: usize,
}

impl StatusRecord {
    fn new(status: &PoolStatus, options: &StoredOptions) -> Self {
        StatusRecord {
            transaction_id: status.transaction_id,
            data_used_blocks: status.data_used_blocks,
            data_total_blocks: status.data_total_blocks,
            data_used_percent: percent(status.data_used_blocks, status.data_total_blocks),
            metadata_used_blocks: status.metadata_used_blocks,
            metadata_total_blocks: status.metadata_total_blocks,
            metadata_used_percent: percent(
                status.metadata_used_blocks,
                status.metadata_total_blocks,
            ),
            block_size_bytes: status.block_size_bytes,
            mode: status.mode.as_str().to_string(),
            needs_check: status.needs_check,
            zero_new_blocks: options.zero_new_blocks,
            error_if_no_space: status.error_if_no_space,
            discard_passdown: status.discard_passdown,
            low_water_reached: status.low_water_reached,
            metadata_snap: status.metadata_snap,
            volume_count: status.volume_count,
        }
    }
}

/// What a successful request produced.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// A volume was created, snapshotted or resized.
    Volume(VolumeRecord),
    /// The volume list.
    Volumes(Vec<VolumeRecord>),
    /// The pool status (also after growing the data device).
    Status(StatusRecord),
    /// Done; nothing to report (delete).
    Done,
}

/// A refused or failed request: an errno, its symbolic name, and the engine's message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpError {
    /// Linux errno.
    pub errno: i32,
    /// Its name, e.g. `EBUSY`.
    pub code: String,
    /// What went wrong.
    pub message: String,
}

impl OpError {
    fn new(errno: i32, message: impl Into<String>) -> Self {
        OpError {
            errno,
            code: errno_name(errno).to_string(),
            message: message.into(),
        }
    }
}

impl From<thin_pool::Error> for OpError {
    /// The engine's errno ([`thin_pool::Error::errno`], the one the NBD adapter uses too) and
    /// its message with every cause.
    fn from(error: thin_pool::Error) -> Self {
        OpError::new(error.errno(), error.report().to_string())
    }
}

impl std::fmt::Display for OpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.code)
    }
}

impl std::error::Error for OpError {}

/// The symbolic name of an errno: those the engine and this module give, and those a device
/// commonly fails with (an I/O error keeps the device's errno).
fn errno_name(errno: i32) -> &'static str {
    match errno {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EINTR => "EINTR",
        libc::EIO => "EIO",
        libc::ENXIO => "ENXIO",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EBUSY => "EBUSY",
        libc::EEXIST => "EEXIST",
        libc::ENODEV => "ENODEV",
        libc::EINVAL => "EINVAL",
        libc::EFBIG => "EFBIG",
        libc::ENOSPC => "ENOSPC",
        libc::EROFS => "EROFS",
        libc::ENODATA => "ENODATA",
        libc::EPROTO => "EPROTO",
        libc::EOVERFLOW => "EOVERFLOW",
        libc::ENOTSUP => "ENOTSUP",
        libc::ESHUTDOWN => "ESHUTDOWN",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::EDQUOT => "EDQUOT",
        _ => "EUNKNOWN",
    }
}

/// The wire form of an answer.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Response {
    ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    volume: Option<VolumeRecord>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    volumes: Option<Vec<VolumeRecord>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    status: Option<StatusRecord>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<OpError>,
}

impl From<Result<Outcome, OpError>> for Response {
    fn from(result: Result<Outcome, OpError>) -> Self {
        match result {
            Ok(Outcome::Volume(volume)) => Response {
                ok: true,
                volume: Some(volume),
                ..Response::default()
            },
            Ok(Outcome::Volumes(volumes)) => Response {
                ok: true,
                volumes: Some(volumes),
                ..Response::default()
            },
            Ok(Outcome::Status(status)) => Response {
                ok: true,
                status: Some(status),
                ..Response::default()
            },
            Ok(Outcome::Done) => Response {
                ok: true,
                ..Response::default()
            },
            Err(error) => Response {
                ok: false,
                error: Some(error),
                ..Response::default()
            },
        }
    }
}

impl Response {
    fn into_result(self) -> anyhow::Result<Result<Outcome, OpError>> {
        if !self.ok {
            return Ok(Err(self
                .error
                .context("control socket answered ok=false without an error")?));
        }
        Ok(Ok(match (self.volume, self.volumes, self.status) {
            (Some(volume), None, None) => Outcome::Volume(volume),
            (None, Some(volumes), None) => Outcome::Volumes(volumes),
            (None, None, Some(status)) => Outcome::Status(status),
            (None, None, None) => Outcome::Done,
            _ => bail!("control socket answered with more than one result"),
        }))
    }
}

/// A pool and what the binary knows about it: the options it was opened with and the names
/// raw exports took.
pub struct Target {
    /// The open pool.
    pub pool: Pool,
    /// Options from `pool.json`.
    pub options: StoredOptions,
    /// Names volumes may not take (raw exports).
    pub reserved_names: Vec<String>,
}

impl Target {
    /// Carries out one request.
    pub fn execute(&self, request: &Request) -> Result<Outcome, OpError> {
        let pool = &self.pool;
        match request {
            Request::CreateVolume { name, size_bytes } => {
                self.check_name_free(name)?;
                let info = pool.create_volume(name, *size_bytes)?;
                Ok(Outcome::Volume(VolumeRecord::from(&info)))
            }
            Request::Snapshot {
                origin,
                name,
                read_only,
            } => {
                self.check_name_free(name)?;
                let info = pool.snapshot(origin, name, *read_only)?;
                Ok(Outcome::Volume(VolumeRecord::from(&info)))
            }
            Request::DeleteVolume { name } => {
                pool.delete_volume(name)?;
                Ok(Outcome::Done)
            }
            Request::ResizeVolume { name, size_bytes } => {
                let info = pool.resize_volume(name, *size_bytes)?;
                Ok(Outcome::Volume(VolumeRecord::from(&info)))
            }
            Request::GrowData { size_bytes } => {
                let block_size = pool.block_size_bytes();
                let wanted_blocks = size_bytes / block_size;
                let before = pool.status().data_total_blocks;
                if wanted_blocks < before {
                    return Err(OpError::new(
                        libc::EINVAL,
                        format!(
                            "data holds {before} blocks; {size_bytes} bytes is {wanted_blocks}: it cannot shrink"
                        ),
                    ));
                }
                // The engine checks the grow, then extends a regular data file (a block
                // device must already be large enough).
                pool.grow_data(*size_bytes)?;
                let status = pool.status();
                if status.data_total_blocks < wanted_blocks {
                    return Err(OpError::new(
                        libc::ENOSPC,
                        format!(
                            "the data device holds {} blocks, not the {wanted_blocks} asked for",
                            status.data_total_blocks
                        ),
                    ));
                }
                Ok(Outcome::Status(StatusRecord::new(&status, &self.options)))
            }
            Request::List => Ok(Outcome::Volumes(
                pool.list().iter().map(VolumeRecord::from).collect(),
            )),
            Request::Status => Ok(Outcome::Status(StatusRecord::new(
                &pool.status(),
                &self.options,
            ))),
        }
    }

    fn check_name_free(&self, name: &str) -> Result<(), OpError> {
        if self.reserved_names.iter().any(|reserved| reserved == name) {
            return Err(OpError::new(
                libc::EEXIST,
                format!("{name:?} is the name of a raw export"),
            ));
        }
        Ok(())
    }
}

/// Carries out `request` on the pool in `dir`: directly if no process holds the pool, through
/// its control socket if a server does. The outer error is a failure to reach the pool; the
/// inner one is the pool's answer.
pub fn perform(dir: &PoolDir, request: &Request) -> anyhow::Result<Result<Outcome, OpError>> {
    dir.require_pool()?;
    let options = StoredOptions::load(dir)?;
    match Pool::open(&dir.path, options.pool_options()) {
        Ok(pool) => {
            let target = Target {
                pool,
                options,
                reserved_names: Vec::new(),
            };
            let result = target.execute(request);
            target
                .pool
                .close()
                .with_context(|| format!("cannot close the pool in {}", dir.path.display()))?;
            Ok(result)
        }
        Err(thin_pool::Error::Locked { .. }) => {
            let socket = dir.control_socket();
            call(&socket, request).with_context(|| {
                format!(
                    "the pool in {} is held by another process, and its control socket {} does not answer",
                    dir.path.display(),
                    socket.display()
                )
            })
        }
        Err(error) => {
            Err(error).with_context(|| format!("cannot open the pool in {}", dir.path.display()))
        }
    }
}

/// Sends one request to a control socket and returns the answer.
pub fn call(socket: &Path, request: &Request) -> anyhow::Result<Result<Outcome, OpError>> {
    let mut stream = UnixStream::connect(socket)
        .with_context(|| format!("cannot connect to {}", socket.display()))?;
    stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
    let mut line = serde_json::to_vec(request).context("cannot encode the request")?;
    line.push(b'\n');
    stream.write_all(&line).context("cannot send the request")?;
    let mut reader = BufReader::new(stream);
    let answer =
        match read_line(&mut reader, RESPONSE_BYTES_MAX).context("cannot read the answer")? {
            Line::Complete(answer) => answer,
            Line::End => bail!("the server closed the control connection without answering"),
            Line::TooLong => bail!("the answer is longer than {RESPONSE_BYTES_MAX} bytes"),
        };
    let response: Response =
        serde_json::from_slice(&answer).context("the answer is not valid JSON")?;
    response.into_result()
}

/// One line read with a length limit.
enum Line {
    /// A line without its newline (the last line may lack one).
    Complete(Vec<u8>),
    /// End of stream before any byte.
    End,
    /// More than the limit without a newline.
    TooLong,
}

fn read_line(reader: &mut impl BufRead, limit: usize) -> std::io::Result<Line> {
    let mut line = Vec::new();
    reader
        .by_ref()
        .take(limit as u64 + 1)
        .read_until(b'\n', &mut line)?;
    if line.is_empty() {
        return Ok(Line::End);
    }
    if line.last() == Some(&b'\n') {
        line.pop();
        return Ok(Line::Complete(line));
    }
    if line.len() > limit {
        return Ok(Line::TooLong);
    }
    Ok(Line::Complete(line))
}

/// State shared by the accept loop and the connection threads.
struct Shared {
    target: Arc<Target>,
    stopping: AtomicBool,
    connections: Mutex<HashMap<u64, Connection>>,
    connection_ended: Condvar,
    next_connection: AtomicU64,
}

/// What the server knows of one control connection: a handle to cut it, and whether it is
/// waiting for a request (idle, since when) or carrying one out.
struct Connection {
    stream: UnixStream,
    idle_since: Option<Instant>,
}

impl Shared {
    /// The connection table changes only by single inserts, removes and flag updates, so a
    /// poisoned lock is recovered ([`nbd::sync`] states the policy).
    fn lock_connections(&self) -> MutexGuard<'_, HashMap<u64, Connection>> {
        lock(&self.connections)
    }

    /// Marks connection `id` idle (waiting for a request) or busy; false if it is no longer
    /// in the table (it was evicted while idle, so a request it just read must not run: its
    /// client would never get the answer). A busy connection is never evicted, so once this
    /// returned true for busy, the request runs on a connection that stays.
    fn set_idle(&self, id: u64, idle: bool) -> bool {
        match self.lock_connections().get_mut(&id) {
            Some(connection) => {
                connection.idle_since = idle.then(Instant::now);
                true
            }
            None => false,
        }
    }
}

/// What [`ControlServer::shutdown`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ControlStopReport {
    /// Control connections that were open and were closed.
    pub clients_closed: usize,
    /// Connections still carrying out a request when the wait ended (they are left to finish
    /// on their own threads; the engine serializes them with the final commit).
    pub requests_unfinished: usize,
}

/// The control socket server; [`ControlServer::shutdown`] stops it and removes the socket.
pub struct ControlServer {
    path: PathBuf,
    /// Device and inode of the socket file bound, so that shutdown removes only our own file
    /// (not one another server put there after ours was removed).
    socket_identity: Option<(u64, u64)>,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl ControlServer {
    /// Listens at `path` (which must not exist), mode 0600, serving requests on `target`.
    pub fn start(path: &Path, target: Arc<Target>) -> anyhow::Result<ControlServer> {
        let listener = UnixListener::bind(path)
            .with_context(|| format!("cannot bind control socket {}", path.display()))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("cannot chmod 0600 {}", path.display()))?;
        let socket_identity = std::fs::symlink_metadata(path)
            .ok()
            .map(|metadata| (metadata.dev(), metadata.ino()));
        listener
            .set_nonblocking(true)
            .context("cannot make the control socket non-blocking")?;
        let shared = Arc::new(Shared {
            target,
            stopping: AtomicBool::new(false),
            connections: Mutex::new(HashMap::new()),
            connection_ended: Condvar::new(),
            next_connection: AtomicU64::new(0),
        });
        let accept_shared = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name("control-accept".into())
            .spawn(move || accept_loop(&listener, &accept_shared))
            .context("cannot start the control thread")?;
        Ok(ControlServer {
            path: path.to_path_buf(),
            socket_identity,
            shared,
            accept: Some(accept),
        })
    }

    /// Stops accepting, cuts every control connection, waits (at most [`STOP_WAIT`]) for
    /// requests being carried out, and removes the socket file if it is still ours. Returns
    /// within a bounded time whatever state the socket is in (even if its file was removed:
    /// the accept loop polls a stop flag rather than waiting to be woken by a connection).
    pub fn shutdown(mut self) -> ControlStopReport {
        self.stop()
    }

    fn stop(&mut self) -> ControlStopReport {
        let Some(accept) = self.accept.take() else {
            return ControlStopReport {
                clients_closed: 0,
                requests_unfinished: 0,
            };
        };
        self.shared.stopping.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + STOP_WAIT;
        while !accept.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if accept.is_finished() {
            let _ = accept.join();
        }
        let clients_closed = {
            let connections = self.shared.lock_connections();
            for connection in connections.values() {
                // Idle clients see EOF at once; a request being carried out finishes (its
                // answer is lost) and its thread then ends.
                let _ = connection.stream.shutdown(std::net::Shutdown::Both);
            }
            connections.len()
        };
        let mut connections = self.shared.lock_connections();
        while !connections.is_empty() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            connections =
                nbd::sync::wait_timeout(&self.shared.connection_ended, connections, deadline - now)
                    .0;
        }
        let requests_unfinished = connections.len();
        drop(connections);
        let still_ours = std::fs::symlink_metadata(&self.path)
            .ok()
            .map(|metadata| (metadata.dev(), metadata.ino()));
        if still_ours.is_some() && still_ours == self.socket_identity {
            let _ = std::fs::remove_file(&self.path);
        }
        ControlStopReport {
            clients_closed,
            requests_unfinished,
        }
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How often the accept loop looks at the stop flag while no client connects.
const ACCEPT_POLL_INTERVAL: Duration = Duration::from_millis(100);
/// Longest wait at shutdown for the accept loop and for requests being carried out.
pub const STOP_WAIT: Duration = Duration::from_secs(5);

fn accept_loop(listener: &UnixListener, shared: &Arc<Shared>) {
    let interval = Timespec::try_from(ACCEPT_POLL_INTERVAL).expect("poll interval fits");
    while !shared.stopping.load(Ordering::SeqCst) {
        let mut fds = [PollFd::new(listener, PollFlags::IN)];
        match poll(&mut fds, Some(&interval)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => {}
            Err(_) => {
                std::thread::sleep(ACCEPT_POLL_INTERVAL);
                continue;
            }
        }
        match listener.accept() {
            Ok((stream, _)) => admit(stream, shared),
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {}
            // EMFILE and the like: pause rather than spin.
            Err(_) => std::thread::sleep(ACCEPT_POLL_INTERVAL),
        }
    }
}

/// Starts a thread for a new connection. At the cap, the connection idle the longest is
/// closed to make room, so idle clients can never lock management out; only when every
/// connection is carrying out a request is the new one refused with EBUSY.
fn admit(mut stream: UnixStream, shared: &Arc<Shared>) {
    // Accepted sockets do not inherit the listener's O_NONBLOCK on Linux; make sure anyway.
    if stream.set_nonblocking(false).is_err() {
        return;
    }
    let id = shared.next_connection.fetch_add(1, Ordering::SeqCst);
    {
        let mut connections = shared.lock_connections();
        if connections.len() >= CONNECTIONS_MAX {
            let oldest_idle = connections
                .iter()
                .filter_map(|(id, connection)| connection.idle_since.map(|since| (since, *id)))
                .min();
            match oldest_idle {
                Some((_, evicted)) => {
                    if let Some(connection) = connections.remove(&evicted) {
                        let _ = connection.stream.shutdown(std::net::Shutdown::Both);
                    }
                }
                None => {
                    drop(connections);
                    let busy: Response = Err(OpError::new(
                        libc::EBUSY,
                        format!("{CONNECTIONS_MAX} control requests are being carried out"),
                    ))
                    .into();
                    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
                    let _ = send(&mut stream, &busy);
                    return;
                }
            }
        }
        let Ok(handle) = stream.try_clone() else {
            return;
        };
        connections.insert(
            id,
            Connection {
                stream: handle,
                idle_since: Some(Instant::now()),
            },
        );
    }
    let connection_shared = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name(format!("control-{id}"))
        .spawn(move || {
            serve_connection(stream, id, &connection_shared);
            connection_shared.lock_connections().remove(&id);
            connection_shared.connection_ended.notify_all();
        });
    if spawned.is_err() {
        shared.lock_connections().remove(&id);
        shared.connection_ended.notify_all();
    }
}

fn send(stream: &mut UnixStream, response: &Response) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(response).map_err(std::io::Error::other)?;
    line.push(b'\n');
    stream.write_all(&line)
}

/// Reads request lines from a connection, each within [`REQUEST_TIMEOUT`] in total (not per
/// read, so a client trickling bytes is cut as surely as a silent one).
struct RequestReader {
    stream: UnixStream,
    buffer: Vec<u8>,
}

/// Why no request line came.
enum NoRequest {
    /// The client closed the connection (or it was cut).
    Closed,
    /// [`REQUEST_TIMEOUT`] passed without a whole line.
    TimedOut,
    /// A line longer than [`REQUEST_BYTES_MAX`].
    TooLong,
}

impl RequestReader {
    fn next_line(&mut self, timeout: Duration) -> Result<Vec<u8>, NoRequest> {
        let deadline = Instant::now() + timeout;
        let mut scanned = 0;
        loop {
            if let Some(position) = self.buffer[scanned..].iter().position(|&b| b == b'\n') {
                let end = scanned + position;
                let mut line: Vec<u8> = self.buffer.drain(..=end).collect();
                line.pop();
                return Ok(line);
            }
            scanned = self.buffer.len();
            if self.buffer.len() > REQUEST_BYTES_MAX {
                return Err(NoRequest::TooLong);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(NoRequest::TimedOut);
            }
            if self.stream.set_read_timeout(Some(left)).is_err() {
                return Err(NoRequest::Closed);
            }
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk) {
                // A last line without its newline still counts.
                Ok(0) if self.buffer.is_empty() => return Err(NoRequest::Closed),
                Ok(0) => return Ok(std::mem::take(&mut self.buffer)),
                Ok(count) => self.buffer.extend_from_slice(&chunk[..count]),
                Err(error)
                    if matches!(
                        error.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(NoRequest::TimedOut)
                }
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return Err(NoRequest::Closed),
            }
        }
    }
}

fn serve_connection(stream: UnixStream, id: u64, shared: &Shared) {
    if stream.set_write_timeout(Some(WRITE_TIMEOUT)).is_err() {
        return;
    }
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = RequestReader {
        stream,
        buffer: Vec::new(),
    };
    loop {
        if !shared.set_idle(id, true) {
            return;
        }
        let line = match reader.next_line(REQUEST_TIMEOUT) {
            Ok(line) => line,
            Err(NoRequest::Closed) => return,
            Err(NoRequest::TimedOut) => {
                let refusal: Response = Err(OpError::new(
                    libc::ETIMEDOUT,
                    format!(
                        "no complete request within {} s: closing",
                        REQUEST_TIMEOUT.as_secs()
                    ),
                ))
                .into();
                let _ = send(&mut writer, &refusal);
                return;
            }
            Err(NoRequest::TooLong) => {
                let refusal: Response = Err(OpError::new(
                    libc::EOVERFLOW,
                    format!("request longer than {REQUEST_BYTES_MAX} bytes"),
                ))
                .into();
                let _ = send(&mut writer, &refusal);
                return;
            }
        };
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if !shared.set_idle(id, false) {
            return;
        }
        let result = match parse_request(&line) {
            Ok(_) if shared.stopping.load(Ordering::SeqCst) => {
                Err(OpError::new(libc::ESHUTDOWN, "the server is stopping"))
            }
            Ok(request) => shared.target.execute(&request),
            Err(message) => Err(OpError::new(libc::EINVAL, message)),
        };
        if send(&mut writer, &result.into()).is_err() {
            return;
        }
    }
}

/// Parses one request line, refusing fields the request does not have. `deny_unknown_fields`
/// on [`Request`] covers the variants with fields, but serde lets a unit variant of an
/// internally tagged enum (`list`, `status`) accept any map; so the keys sent are also checked
/// against the request's own wire form.
fn parse_request(line: &[u8]) -> Result<Request, String> {
    let value: serde_json::Value =
        serde_json::from_slice(line).map_err(|error| format!("bad request: {error}"))?;
    let request: Request =
        serde_json::from_value(value.clone()).map_err(|error| format!("bad request: {error}"))?;
    let known = serde_json::to_value(&request).map_err(|error| format!("bad request: {error}"))?;
    if let (Some(sent), Some(known)) = (value.as_object(), known.as_object()) {
        if let Some(unknown) = sent.keys().find(|key| !known.contains_key(*key)) {
            return Err(format!(
                "bad request: unknown field {unknown:?} for op {:?}",
                known.get("op").and_then(|op| op.as_str()).unwrap_or("?")
            ));
        }
    }
    Ok(request)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_have_a_stable_wire_form() {
        let request = Request::Snapshot {
            origin: "a".into(),
            name: "b".into(),
            read_only: true,
        };
        let text = serde_json::to_string(&request).unwrap();
        assert_eq!(
            text,
            r#"{"op":"snapshot","origin":"a","name":"b","read_only":true}"#
        );
        let parsed: Request =
            serde_json::from_str(r#"{"op":"snapshot","origin":"a","name":"b"}"#).unwrap();
        assert_eq!(
            parsed,
            Request::Snapshot {
                origin: "a".into(),
                name: "b".into(),
                read_only: false
            }
        );
        assert!(serde_json::from_str::<Request>(r#"{"op":"format_disk"}"#).is_err());
    }

    #[test]
    fn unknown_fields_are_refused_for_every_op() {
        for line in [
            r#"{"op":"list","x":1}"#,
            r#"{"op":"status","x":1}"#,
            r#"{"op":"delete_volume","name":"a","force":true}"#,
            r#"{"op":"grow_data","size_bytes":1,"x":1}"#,
        ] {
            let error = parse_request(line.as_bytes()).unwrap_err();
            assert!(error.contains("unknown field"), "{line}: {error}");
        }
        assert_eq!(parse_request(br#"{"op":"list"}"#), Ok(Request::List));
        assert_eq!(
            parse_request(br#"{"op":"snapshot","origin":"a","name":"b"}"#),
            Ok(Request::Snapshot {
                origin: "a".into(),
                name: "b".into(),
                read_only: false
            })
        );
    }

    #[test]
    fn request_lines_are_bounded_in_length_and_time() {
        let (client, server) = UnixStream::pair().unwrap();
        let mut reader = RequestReader {
            stream: server,
            buffer: Vec::new(),
        };
        (&client).write_all(b"{\"op\":\"list\"}\n{\"op\"").unwrap();
        let line = reader.next_line(Duration::from_secs(5)).ok().unwrap();
        assert_eq!(line, br#"{"op":"list"}"#);
        assert!(matches!(
            reader.next_line(Duration::from_millis(50)),
            Err(NoRequest::TimedOut)
        ));
        (&client).write_all(&vec![b'x'; REQUEST_BYTES_MAX]).unwrap();
        assert!(matches!(
            reader.next_line(Duration::from_secs(5)),
            Err(NoRequest::TooLong)
        ));
        drop(client);
        let mut closed = RequestReader {
            stream: UnixStream::pair().unwrap().1,
            buffer: Vec::new(),
        };
        assert!(matches!(
            closed.next_line(Duration::from_secs(5)),
            Err(NoRequest::Closed)
        ));
    }

    #[test]
    fn lines_are_bounded() {
        let mut input: &[u8] = b"abc\ndef";
        assert!(matches!(read_line(&mut input, 8).unwrap(), Line::Complete(l) if l == b"abc"));
        assert!(matches!(read_line(&mut input, 8).unwrap(), Line::Complete(l) if l == b"def"));
        assert!(matches!(read_line(&mut input, 8).unwrap(), Line::End));
        let mut long: &[u8] = b"0123456789\n";
        assert!(matches!(read_line(&mut long, 4).unwrap(), Line::TooLong));
    }

    #[test]
    fn errors_round_trip() {
        let response: Response = Err(OpError::new(libc::EBUSY, "volume \"x\" is open")).into();
        let text = serde_json::to_string(&response).unwrap();
        assert_eq!(
            text,
            r#"{"ok":false,"error":{"errno":16,"code":"EBUSY","message":"volume \"x\" is open"}}"#
        );
        let back: Response = serde_json::from_str(&text).unwrap();
        let error = back.into_result().unwrap().unwrap_err();
        assert_eq!(error.to_string(), "volume \"x\" is open (EBUSY)");
    }
}
