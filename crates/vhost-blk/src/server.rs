//! [`VhostBlkServer`]: one socket, one device. The socket file is made mode 0600 before it
//! appears at its path (bound inside a fresh 0700 directory beside it, then renamed into
//! place), so no other user can connect even for a moment. One front end at a time: a second
//! one waits in the listen queue until the first disconnects. After a front end goes away
//! (a VM stopped, or a front end reconnecting after `serve` restarted) the socket accepts the
//! next one with a fresh device state.
//!
//! While a front end is connected, [`VhostBlkServer::capacity_notifier`]'s handle can tell it
//! the target's capacity changed (`crate::capacity`: its relay keeps the backend request
//! channel).

use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use thinpool_frontend::Target;
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

use crate::backend::BlkBackend;
use crate::capacity::{BackendChannel, CapacityNotifier, Slot};
use crate::config::QUEUES_MAX;
use crate::relay::Relay;

/// The environment variable [`ServerOptions::from_env`] reads the poll time from, in
/// microseconds (`thinpool serve` and the benchmark's raw export honour it).
pub const POLL_ENV: &str = "THINPOOL_VHOST_POLL_US";

/// Longest poll accepted (a queue thread spins on a core for this long after each batch).
pub const POLL_MAX: Duration = Duration::from_millis(10);

/// How a socket serves its device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerOptions {
    /// Queues offered (1 to [`QUEUES_MAX`]), each served by its own thread.
    pub queues: u16,
    /// After a queue runs dry its thread keeps looking at the ring this long (notifications
    /// off, so the driver need not kick) before it sleeps: lower latency for a core's worth
    /// of spinning per queue. Zero (the default) sleeps at once.
    pub poll: Duration,
}

impl ServerOptions {
    /// `queues` queues, the poll time from [`POLL_ENV`] (unset: zero; at most
    /// [`POLL_MAX`]).
    pub fn from_env(queues: u16) -> io::Result<ServerOptions> {
        let poll = match std::env::var(POLL_ENV) {
            Err(_) => Duration::ZERO,
            Ok(text) => match text.trim().parse::<u64>() {
                Ok(us) if Duration::from_micros(us) <= POLL_MAX => Duration::from_micros(us),
                _ => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("{POLL_ENV}={text:?}: microseconds, at most {POLL_MAX:?}"),
                    ))
                }
            },
        };
        Ok(ServerOptions { queues, poll })
    }
}

/// A vhost-user-blk socket serving one [`Target`] until stopped.
pub struct VhostBlkServer {
    path: PathBuf,
    target: Arc<dyn Target>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    stopping: AtomicBool,
    /// The connected front end's connection, to cut it at stop.
    current: Mutex<Option<ShutdownHandle>>,
    /// The connected front end's backend request channel, for capacity notices.
    capacity: Arc<Slot>,
}

impl VhostBlkServer {
    /// Binds `path` (replacing a stale socket there) and serves `target` on it with `queues`
    /// queues (1 to 64) from a thread of its own, polling as [`ServerOptions::from_env`]
    /// says.
    pub fn start(target: Arc<dyn Target>, path: &Path, queues: u16) -> io::Result<Self> {
        Self::start_with(target, path, ServerOptions::from_env(queues)?)
    }

    /// [`VhostBlkServer::start`] with explicit options.
    pub fn start_with(
        target: Arc<dyn Target>,
        path: &Path,
        options: ServerOptions,
    ) -> io::Result<Self> {
        let queues = options.queues;
        if !(1..=QUEUES_MAX).contains(&queues) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{queues} queues: 1 to {QUEUES_MAX}"),
            ));
        }
        let listener = bind_private(path)?;
        let shared = Arc::new(Shared {
            stopping: AtomicBool::new(false),
            current: Mutex::new(None),
            capacity: Arc::default(),
        });
        let name = format!("vhost-blk {}", target.name());
        let thread = {
            let (shared, target) = (Arc::clone(&shared), Arc::clone(&target));
            let socket = path.to_owned();
            std::thread::Builder::new()
                .name("vhost-listen".into())
                .spawn(move || accept_loop(target, listener, &socket, options, &shared, &name))?
        };
        Ok(VhostBlkServer {
            path: path.to_owned(),
            target,
            shared,
            thread: Some(thread),
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A handle that tells the connected front end, if any, that the target's capacity
    /// changed (after the target grew: see [`CapacityNotifier::notify`]).
    pub fn capacity_notifier(&self) -> CapacityNotifier {
        CapacityNotifier::new(Arc::clone(&self.target), Arc::clone(&self.shared.capacity))
    }

    /// Disconnects the front end, stops accepting, removes the socket file and waits for
    /// the serving thread.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.shared.stopping.store(true, Ordering::Release);
        if let Ok(current) = self.shared.current.lock() {
            if let Some(handle) = current.as_ref() {
                handle.shutdown();
            }
        }
        // Wake the accept (a connection the loop sees is for stopping).
        let _ = UnixStream::connect(&self.path);
        let _ = thread.join();
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for VhostBlkServer {
    fn drop(&mut self) {
        self.stop_inner();
    }
}

/// A fresh mode 0700 directory beside `path`, named after it, this process and `what`.
fn private_dir(path: &Path, what: &str) -> io::Result<PathBuf> {
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
    let parent = parent.unwrap_or(Path::new("."));
    let file_name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "socket path has no name"))?;
    let private = parent.join(format!(
        ".{}.{}.{what}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&private);
    std::fs::DirBuilder::new().mode(0o700).create(&private)?;
    Ok(private)
}

/// A listening socket at `path` that was mode 0600 before anyone could reach it.
fn bind_private(path: &Path) -> io::Result<UnixListener> {
    let private = private_dir(path, "tmp")?;
    let result = (|| {
        let inner = private.join("sock");
        let listener = UnixListener::bind(&inner)?;
        std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o600))?;
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        std::fs::rename(&inner, path)?;
        Ok(listener)
    })();
    let _ = std::fs::remove_dir_all(&private);
    result
}

fn accept_loop(
    target: Arc<dyn Target>,
    listener: UnixListener,
    socket: &Path,
    options: ServerOptions,
    shared: &Shared,
    name: &str,
) {
    while !shared.stopping.load(Ordering::Acquire) {
        let front = match listener.accept() {
            Ok((front, _)) => front,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) => {
                tracing::warn!(device = name, "vhost-user-blk accept: {error}");
                continue;
            }
        };
        if shared.stopping.load(Ordering::Acquire) {
            break;
        }
        if let Err(error) = serve_one(&target, front, socket, options, shared, name) {
            if shared.stopping.load(Ordering::Acquire) {
                break;
            }
            tracing::warn!(device = name, "vhost-user-blk front end: {error}");
        }
    }
}

/// Connects `daemon` to a fresh socket of its own (through a private 0700 directory beside
/// `socket`, removed at once) and returns our end of it, for the [`Relay`].
fn connect_handler(
    daemon: &mut VhostUserDaemon<BlkBackend>,
    socket: &Path,
) -> io::Result<UnixStream> {
    let private = private_dir(socket, "relay")?;
    let result = (|| {
        let inner = private.join("sock");
        let listener = UnixListener::bind(&inner)?;
        // The connection waits in the listen queue for the daemon's accept.
        let ours = UnixStream::connect(&inner)?;
        daemon
            .start(&mut Listener::from(listener))
            .map_err(|e| io::Error::other(e.to_string()))?;
        Ok(ours)
    })();
    let _ = std::fs::remove_dir_all(&private);
    result
}

/// Serves the accepted front end until it disconnects, its messages passing through the
/// compatibility [`Relay`] to the vhost-user handler.
fn serve_one(
    target: &Arc<dyn Target>,
    front: UnixStream,
    socket: &Path,
    options: ServerOptions,
    shared: &Shared,
    name: &str,
) -> io::Result<()> {
    let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
    let backend = BlkBackend::new(
        Arc::clone(target),
        options.queues,
        options.poll,
        mem.clone(),
    )?;
    let mut daemon = VhostUserDaemon::new(name.to_string(), backend.clone(), mem)
        .map_err(|e| io::Error::other(e.to_string()))?;
    if let Err(error) = backend.register_rescans(&daemon) {
        daemon.request_shutdown();
        backend.exit_all();
        return Err(error);
    }
    // Attached before the relay runs: once the front end has its SET_BACKEND_REQ_FD
    // answered, a notice reaches it.
    let channel = Arc::new(BackendChannel::default());
    shared
        .capacity
        .attach(Arc::clone(&channel), target.geometry().size_bytes);
    let relay = connect_handler(&mut daemon, socket)
        .and_then(|ours| Relay::start(front, ours, Some(backend.clone()), channel));
    let relay = match relay {
        Ok(relay) => relay,
        Err(error) => {
            shared.capacity.detach();
            daemon.request_shutdown();
            let _ = daemon.wait();
            backend.exit_all();
            return Err(error);
        }
    };
    tracing::info!(device = name, "vhost-user-blk front end connected");
    if let Ok(mut current) = shared.current.lock() {
        *current = daemon.shutdown_handle();
    }
    if shared.stopping.load(Ordering::Acquire) {
        daemon.request_shutdown();
    }
    let result = daemon.wait();
    shared.capacity.detach();
    if let Ok(mut current) = shared.current.lock() {
        *current = None;
    }
    // The handler's end is closed now, so both directions of the relay end.
    daemon.request_shutdown();
    let relayed = relay.join();
    backend.exit_all();
    tracing::info!(device = name, "vhost-user-blk front end disconnected");
    result.map_err(|e| io::Error::other(e.to_string()))?;
    relayed
}
