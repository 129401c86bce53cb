//! [`ControlServer`]: the control socket's accept loop and its connections.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use nbd::sync::lock;
use rustix::event::{poll, PollFd, PollFlags, Timespec};

use super::protocol::{parse_request, Response};
use super::{
    OpError, Target, ACCEPT_POLL_INTERVAL, CONNECTIONS_MAX, REQUEST_BYTES_MAX, REQUEST_TIMEOUT,
    STOP_WAIT, WRITE_TIMEOUT,
};

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
pub(super) struct RequestReader {
    pub(super) stream: UnixStream,
    pub(super) buffer: Vec<u8>,
}

/// Why no request line came.
pub(super) enum NoRequest {
    /// The client closed the connection (or it was cut).
    Closed,
    /// [`REQUEST_TIMEOUT`] passed without a whole line.
    TimedOut,
    /// A line longer than [`REQUEST_BYTES_MAX`].
    TooLong,
}

impl RequestReader {
    pub(super) fn next_line(&mut self, timeout: Duration) -> Result<Vec<u8>, NoRequest> {
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
            Ok(request) if super::stream::is_stream(&request) => {
                super::stream::serve(&request, reader, writer, &shared.target);
                return;
            }
            Ok(request) if super::progress::is_counted(&request) => {
                super::progress::counted(&request, &shared.target, &writer)
            }
            Ok(request) => shared.target.execute(&request),
            Err(message) => Err(OpError::new(libc::EINVAL, message)),
        };
        if send(&mut writer, &result.into()).is_err() {
            return;
        }
    }
}
