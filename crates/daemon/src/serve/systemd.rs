//! systemd's conventions for `thinpool serve`: sockets passed by socket activation
//! (`LISTEN_FDS`, `LISTEN_PID`), readiness and stop notification (`NOTIFY_SOCKET`), and the
//! pid file (`--pid-file`).
//!
//! A passed Unix stream socket is served instead of creating `nbd.sock`, a passed TCP socket
//! instead of binding `--tcp`; the control socket is always the server's own. The passed
//! sockets belong to whoever passed them: a Unix socket's file is not removed at shutdown.
//! Both crates used here do the file-descriptor work that would need `unsafe` in this one.

use std::io::Write;
use std::net::TcpListener;
use std::os::unix::fs::OpenOptionsExt;
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

/// A pid file this process wrote; removed again by [`PidFile::remove`] on a clean shutdown.
#[derive(Debug)]
pub(super) struct PidFile {
    path: PathBuf,
}

impl PidFile {
    /// Refuses `path` if it names a live process (another server); a stale one is replaced
    /// later. Called before anything is opened, so a second server stops early.
    pub(super) fn check(path: &Path) -> anyhow::Result<()> {
        if let Some(pid) = live_pid(path)? {
            bail!(
                "pid file {} names process {pid}, which is running (another server?)",
                path.display()
            );
        }
        Ok(())
    }

    /// Writes this process's id to `path` (mode 0644, through a temporary file renamed over
    /// it, never following a symbolic link), checking again that no live process holds it.
    pub(super) fn write(path: &Path) -> anyhow::Result<PidFile> {
        PidFile::check(path)?;
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
        tracing::info!(pid_file = %path.display(), pid = std::process::id(), "pid file written");
        Ok(PidFile {
            path: path.to_path_buf(),
        })
    }

    /// Removes the file if it still names this process.
    pub(super) fn remove(self) {
        let ours = std::fs::read_to_string(&self.path)
            .ok()
            .and_then(|text| text.trim().parse::<u32>().ok())
            == Some(std::process::id());
        if ours {
            if let Err(error) = std::fs::remove_file(&self.path) {
                tracing::warn!(pid_file = %self.path.display(), %error, "cannot remove the pid file");
            }
        }
    }
}

/// The process `path` names, if the file exists, holds a pid and that process runs (and is
/// not this one).
fn live_pid(path: &Path) -> anyhow::Result<Option<i32>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => {
            return Err(error).with_context(|| format!("cannot read pid file {}", path.display()))
        }
    };
    let Some(pid) = text
        .trim()
        .parse::<i32>()
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    else {
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
