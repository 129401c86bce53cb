//! systemd's conventions for `thinpool serve`: sockets passed by socket activation
//! (`LISTEN_FDS`, `LISTEN_PID`), readiness and stop notification (`NOTIFY_SOCKET`), and the
//! pid file (`--pid-file`).
//!
//! A passed Unix stream socket is served instead of creating `nbd.sock`, a passed TCP socket
//! instead of binding `--tcp`; the control socket is always the server's own. The passed
//! sockets belong to whoever passed them: a Unix socket's file is not removed at shutdown.
//! Both crates used here do the file-descriptor work that would need `unsafe` in this one.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

/// The sockets systemd (or `systemd-socket-activate`) passed, by kind.
#[derive(Debug, Default)]
pub(super) struct Activated {
    /// Unix stream sockets, listening.
    pub unix: Vec<UnixListener>,
    /// TCP sockets, listening.
    pub tcp: Vec<TcpListener>,
}

impl Activated {
    /// The sockets passed to this process (`LISTEN_PID` names it), if any. A passed socket
    /// that is neither a Unix nor a TCP stream socket is refused.
    pub(super) fn from_env() -> anyhow::Result<Activated> {
        let mut fds = listenfd::ListenFd::from_env();
        let mut activated = Activated::default();
        for index in 0..fds.len() {
            if let Ok(Some(listener)) = fds.take_unix_listener(index) {
                activated.unix.push(listener);
            } else if let Ok(Some(listener)) = fds.take_tcp_listener(index) {
                activated.tcp.push(listener);
            } else {
                bail!(
                    "socket activation: passed file descriptor {} is neither a Unix nor a TCP stream socket",
                    3 + index
                );
            }
        }
        // Nothing this process starts should take them for its own.
        for name in ["LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"] {
            std::env::remove_var(name);
        }
        Ok(activated)
    }
}

/// Tells the service manager the server is ready (`READY=1`), if it asked
/// (`NOTIFY_SOCKET`); nothing otherwise.
pub(super) fn notify_ready(status: &str) {
    notify(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status(status),
    ]);
}

/// Tells the service manager the server is stopping (`STOPPING=1`).
pub(super) fn notify_stopping() {
    notify(&[sd_notify::NotifyState::Stopping]);
}

fn notify(states: &[sd_notify::NotifyState]) {
    // A failed notification only matters to systemd, which then times the service out and
    // says so; the server goes on.
    if let Err(error) = sd_notify::notify(false, states) {
        tracing::warn!(%error, "cannot notify the service manager (NOTIFY_SOCKET)");
    }
}

/// Longest pid file read: a pid and a newline take at most 11 bytes; anything longer is not
/// a pid file (and `/dev/zero` must not be read until memory runs out).
const PID_FILE_READ_MAX: usize = 32;

/// A pid file this process wrote; removed again by [`PidFile::remove`] on a clean shutdown,
/// only if the file at the path is still the one written (same inode, holding this pid).
///
/// The path must not already hold anything but a pid file (a regular file of at most
/// [`PID_FILE_READ_MAX`] bytes holding a decimal pid and a newline, or nothing) and must not
/// lie inside a pool directory: the file is renamed over and removed at shutdown, so
/// `--pid-file POOL/data` would otherwise lose every volume.
#[derive(Debug)]
pub(super) struct PidFile {
    path: PathBuf,
    /// Device, inode and change time of the file written ([`identity`]).
    identity: (u64, u64, i64, i64),
}

impl PidFile {
    /// Refuses `path` if it names a live process (another server), if something that is not
    /// a pid file is there, or if it lies inside the pool directory `pool` or any directory
    /// holding a pool; a stale pid file is replaced later. Called before anything is
    /// opened, so a second server stops early.
    pub(super) fn check(path: &Path, pool: &Path) -> anyhow::Result<()> {
        refuse_inside_pool(path, pool)?;
        if let Some(pid) = live_pid(path)? {
            bail!(
                "pid file {} names process {pid}, which is running (another server?)",
                path.display()
            );
        }
        Ok(())
    }

    /// Writes this process's id to `path` (mode 0644, through a temporary file renamed over
    /// it, never following a symbolic link), checking again that no live process holds it
    /// and that it is no pool's file.
    pub(super) fn write(path: &Path, pool: &Path) -> anyhow::Result<PidFile> {
        PidFile::check(path, pool)?;
        let temporary = path.with_file_name(format!(
            ".{}.{}",
            path.file_name()
                .map(|name| name.to_string_lossy().into_owned())
                .unwrap_or_default(),
            std::process::id()
        ));
        let _ = std::fs::remove_file(&temporary);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .open(&temporary)
            .with_context(|| format!("cannot create pid file {}", temporary.display()))?;
        writeln!(file, "{}", std::process::id())
            .and_then(|()| file.sync_all())
            .with_context(|| format!("cannot write pid file {}", temporary.display()))?;
        std::fs::rename(&temporary, path).with_context(|| {
            let _ = std::fs::remove_file(&temporary);
            format!("cannot put the pid file in place at {}", path.display())
        })?;
        // After the rename, which changes the inode's ctime: a file put there later has
        // another ctime even if it gets the same inode number (a freed one is reused).
        let metadata = file
            .metadata()
            .with_context(|| format!("cannot examine pid file {}", path.display()))?;
        tracing::info!(pid_file = %path.display(), pid = std::process::id(), "pid file written");
        Ok(PidFile {
            path: path.to_path_buf(),
            identity: identity(&metadata),
        })
    }

    /// Removes the file if it is still the one this process wrote and names this process.
    pub(super) fn remove(self) {
        let same_file = std::fs::symlink_metadata(&self.path)
            .is_ok_and(|metadata| identity(&metadata) == self.identity);
        let ours = same_file
            && matches!(read_pid_file(&self.path), Ok(PidFileContent::Pid(pid)) if pid as u32 == std::process::id());
        if ours {
            if let Err(error) = std::fs::remove_file(&self.path) {
                tracing::warn!(pid_file = %self.path.display(), %error, "cannot remove the pid file");
            }
        } else {
            tracing::warn!(pid_file = %self.path.display(), "the pid file was replaced by another file; left in place");
        }
    }
}

/// What tells the file written from one put at its path later: device, inode and ctime.
fn identity(metadata: &std::fs::Metadata) -> (u64, u64, i64, i64) {
    (
        metadata.dev(),
        metadata.ino(),
        metadata.ctime(),
        metadata.ctime_nsec(),
    )
}

/// Refuses a pid file path inside the pool directory `pool` or inside any directory that
/// holds a pool (checked on the resolved parent directory and every directory above it).
fn refuse_inside_pool(path: &Path, pool: &Path) -> anyhow::Result<()> {
    let parent = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let parent = std::fs::canonicalize(parent).with_context(|| {
        format!(
            "cannot resolve the directory of pid file {}",
            path.display()
        )
    })?;
    let pool = std::fs::canonicalize(pool).ok();
    for dir in parent.ancestors() {
        if pool.as_deref() == Some(dir) || thin_pool::Pool::exists(dir) {
            bail!(
                "refusing pid file {}: it is inside the pool directory {}, whose files the pid \
                 file would replace (give a path outside it, e.g. /run/thinpool/pool.pid)",
                path.display(),
                dir.display()
            );
        }
    }
    Ok(())
}

/// What an existing pid file path holds.
enum PidFileContent {
    /// Nothing there, or an empty regular file.
    Empty,
    /// A regular file holding this pid.
    Pid(i32),
}

/// Reads a pid file without following a link or blocking, at most [`PID_FILE_READ_MAX`]
/// bytes; refuses anything else than a regular file holding a decimal pid and a newline.
fn read_pid_file(path: &Path) -> anyhow::Result<PidFileContent> {
    let shown = path.display();
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags((rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK).bits() as i32)
        .open(path)
    {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            return Ok(PidFileContent::Empty)
        }
        Err(error) if error.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error()) => {
            bail!("refusing pid file {shown}: it is a symbolic link, not a pid file")
        }
        Err(error) => return Err(error).with_context(|| format!("cannot read pid file {shown}")),
    };
    let metadata = file
        .metadata()
        .with_context(|| format!("cannot examine pid file {shown}"))?;
    if !metadata.is_file() {
        bail!(
            "refusing pid file {shown}: it exists and is not a regular file (the pid file \
             would be put in its place and removed at shutdown)"
        );
    }
    let mut bytes = Vec::with_capacity(PID_FILE_READ_MAX + 1);
    file.take(PID_FILE_READ_MAX as u64 + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("cannot read pid file {shown}"))?;
    if bytes.is_empty() {
        return Ok(PidFileContent::Empty);
    }
    let digits = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
    let pid = (bytes.len() <= PID_FILE_READ_MAX
        && !digits.is_empty()
        && digits.iter().all(u8::is_ascii_digit))
    .then(|| std::str::from_utf8(digits).ok()?.parse::<i32>().ok())
    .flatten()
    .filter(|pid| *pid > 0);
    match pid {
        Some(pid) => Ok(PidFileContent::Pid(pid)),
        None => bail!(
            "refusing pid file {shown}: it exists and does not hold a process id (the pid file \
             would replace it and remove it at shutdown); give another path or remove it"
        ),
    }
}

/// The process `path` names, if the file exists, holds a pid and that process runs (and is
/// not this one). Anything there that is not a pid file is refused.
fn live_pid(path: &Path) -> anyhow::Result<Option<i32>> {
    let PidFileContent::Pid(pid) = read_pid_file(path)? else {
        return Ok(None);
    };
    let Some(pid) = rustix::process::Pid::from_raw(pid) else {
        return Ok(None);
    };
    if pid.as_raw_nonzero().get() as u32 == std::process::id() {
        return Ok(None);
    }
    // Signal 0: EPERM means it runs under another user.
    match rustix::process::test_kill_process(pid) {
        Ok(()) | Err(rustix::io::Errno::PERM) => Ok(Some(pid.as_raw_nonzero().get())),
        Err(_) => Ok(None),
    }
}
