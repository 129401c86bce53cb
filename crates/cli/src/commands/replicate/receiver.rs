//! The receiver of a round (`thinpool receive` on a pool directory, or DEST's command),
//! its stdin, stdout and stderr piped, watched for progress: `replicate --timeout` is an
//! idle timeout on it (docs/replication.md). Progress is a byte of the stream it takes
//! from its stdin, or one it gives on stdout or stderr. After the timeout without any, the
//! receiver is killed with SIGKILL (by its PID; a command by its process group, which it
//! runs in alone so that what its shell started, `sleep` or `ssh`, goes too) and the round
//! fails with a "timed out" error.
//!
//! ```text
//!   caller's thread   Input::write: non-blocking write, poll(POLLOUT) up to the idle limit
//!                     Receiver::finish: poll(pidfd) up to the idle limit, kill, reap
//!   two threads       stdout, stderr: read to the end, each read is progress
//! ```
//!
//! The thread that waits is the one that kills, and it kills before it reaps: the PID and
//! the group it leads still name this receiver (a zombie keeps both), never a process that
//! got the number since. After the receiver exited, its stdout and stderr are waited for
//! at most one more timeout (a process it left behind, outside its group, may hold the
//! pipes; its collecting thread is then left to end with them) and what came is taken.

use anyhow::Context;
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::process::{Pid, PidfdFlags, Signal};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The most one write hands the pipe: each write that returns is progress, so a slow but
/// live receiver is seen taking the stream every pipe's worth.
const WRITE_CHUNK_BYTES: usize = 64 * 1024;
/// The longest single poll (a longer timeout polls again).
const POLL_MAX: Duration = Duration::from_secs(3600);
/// How long a killed receiver's stderr is waited for, for the error message.
const KILLED_STDERR_WAIT: Duration = Duration::from_secs(5);

/// When the receiver last made progress.
#[derive(Debug)]
struct Activity(Mutex<Instant>);

impl Activity {
    fn lock(&self) -> MutexGuard<'_, Instant> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn touch(&self) {
        *self.lock() = Instant::now();
    }

    /// How much of `timeout` is left since the last progress (zero: timed out).
    fn left(&self, timeout: Duration) -> Duration {
        timeout.saturating_sub(self.lock().elapsed())
    }
}

/// What a collecting thread has read of one pipe.
#[derive(Default)]
struct Collected {
    bytes: Vec<u8>,
    /// End of file (or a read error): nothing more comes.
    done: bool,
}

/// One of the receiver's output pipes, read to its end on a thread of its own.
struct Collector {
    shared: Arc<(Mutex<Collected>, Condvar)>,
}

impl Collector {
    fn start(mut pipe: impl Read + Send + 'static, activity: Arc<Activity>) -> Collector {
        let shared = Arc::new((Mutex::new(Collected::default()), Condvar::new()));
        let writer = Arc::clone(&shared);
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match pipe.read(&mut buf) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(_) => 0,
                };
                let (lock, wake) = &*writer;
                let mut collected = lock.lock().unwrap_or_else(|e| e.into_inner());
                if n == 0 {
                    collected.done = true;
                    wake.notify_all();
                    return;
                }
                activity.touch();
                collected.bytes.extend_from_slice(&buf[..n]);
            }
        });
        Collector { shared }
    }

    /// What was read by `deadline`, all of it if the pipe ended by then.
    fn take(&self, deadline: Instant) -> Vec<u8> {
        let (lock, wake) = &*self.shared;
        let mut collected = lock.lock().unwrap_or_else(|e| e.into_inner());
        while !collected.done {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            collected = wake
                .wait_timeout(collected, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        std::mem::take(&mut collected.bytes)
    }
}

/// Waits up to `limit` for `fd` to be ready for `flags` (or to report an error or a
/// hang-up). False when it is not (the limit passed, or a signal came).
fn ready(fd: impl AsFd, flags: PollFlags, limit: Duration) -> io::Result<bool> {
    let timeout = Timespec::try_from(limit.min(POLL_MAX)).expect("an hour fits a timespec");
    let mut fds = [PollFd::new(&fd, flags)];
    match poll(&mut fds, Some(&timeout)) {
        Ok(count) => Ok(count > 0),
        Err(rustix::io::Errno::INTR) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The receiver's stdin: each write waits for the receiver at most the idle timeout, then
/// fails with [`io::ErrorKind::TimedOut`].
pub struct Input {
    pipe: ChildStdin,
    activity: Arc<Activity>,
    timeout: Duration,
}

impl Write for Input {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let chunk = &buf[..buf.len().min(WRITE_CHUNK_BYTES)];
        loop {
            match self.pipe.write(chunk) {
                Ok(n) => {
                    self.activity.touch();
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let left = self.activity.left(self.timeout);
                    if left.is_zero() {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the receiver takes no more of the stream",
                        ));
                    }
                    ready(&self.pipe, PollFlags::OUT, left)?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What a receiver that exited by itself left.
pub struct Finished {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// A running receiver, watched (module doc).
pub struct Receiver {
    child: Child,
    /// Readable once the receiver exited (it stays unreaped until `finish` waits).
    pidfd: OwnedFd,
    /// It leads a process group of its own (a command), killed as a whole.
    own_group: bool,
    timeout: Duration,
    activity: Arc<Activity>,
    input: Option<Input>,
    stdout: Collector,
    stderr: Collector,
}

impl Receiver {
    /// Starts `command` with its stdio piped (in a process group of its own if
    /// `own_group`), watched with the idle `timeout`.
    pub fn spawn(mut command: Command, own_group: bool, timeout: Duration) -> anyhow::Result<Self> {
        assert!(
            !timeout.is_zero(),
            "an idle timeout of 0 s kills every receiver"
        );
        command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if own_group {
            command.process_group(0);
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("cannot start the receiver {command:?}"))?;
        let pipes = Self::watch(&mut child);
        let (pidfd, pipe) = match pipes {
            Ok(watched) => watched,
            Err(error) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(error);
            }
        };
        let activity = Arc::new(Activity(Mutex::new(Instant::now())));
        let stdout = Collector::start(child.stdout.take().expect("piped"), activity.clone());
        let stderr = Collector::start(child.stderr.take().expect("piped"), activity.clone());
        Ok(Receiver {
            child,
            pidfd,
            own_group,
            timeout,
            input: Some(Input {
                pipe,
                activity: activity.clone(),
                timeout,
            }),
            activity,
            stdout,
            stderr,
        })
    }

    /// The child's pidfd and its stdin, made non-blocking.
    fn watch(child: &mut Child) -> anyhow::Result<(OwnedFd, ChildStdin)> {
        let pid = Pid::from_raw(child.id() as i32).context("the receiver has no PID")?;
        let pidfd = rustix::process::pidfd_open(pid, PidfdFlags::empty())
            .context("cannot watch the receiver (pidfd_open)")?;
        let pipe = child.stdin.take().expect("piped");
        rustix::io::ioctl_fionbio(&pipe, true)
            .context("cannot make the receiver's stdin non-blocking")?;
        Ok((pidfd, pipe))
    }

    /// Its stdin, where the stream goes.
    pub fn input(&mut self) -> &mut Input {
        self.input.as_mut().expect("until finish")
    }

    /// Closes its stdin and waits for it to exit, at most the idle timeout past its last
    /// progress: then it is killed and this fails saying it timed out.
    pub fn finish(mut self) -> anyhow::Result<Finished> {
        drop(self.input.take());
        loop {
            let left = self.activity.left(self.timeout);
            if left.is_zero() {
                return Err(self.kill());
            }
            if ready(&self.pidfd, PollFlags::IN, left).context("cannot wait for the receiver")? {
                break;
            }
        }
        let status = self.child.wait().context("cannot wait for the receiver")?;
        let deadline = Instant::now() + self.timeout;
        Ok(Finished {
            status,
            stdout: self.stdout.take(deadline),
            stderr: self.stderr.take(deadline),
        })
    }

    /// Kills the receiver (unreaped: its PID and group are still its own), reaps it, and
    /// says so.
    fn kill(&mut self) -> anyhow::Error {
        let pid = self.child.id();
        let killed = if self.own_group {
            let group = Pid::from_raw(pid as i32).expect("a child's PID is positive");
            rustix::process::kill_process_group(group, Signal::KILL)
        } else {
            rustix::process::pidfd_send_signal(&self.pidfd, Signal::KILL)
        };
        let reaped = self.child.wait();
        let stderr = self.stderr.take(Instant::now() + KILLED_STDERR_WAIT);
        let stderr = String::from_utf8_lossy(&stderr);
        let mut message = format!(
            "timed out: no progress for {} (--timeout), so it was killed (pid {pid}{})",
            humantime::format_duration(self.timeout),
            if self.own_group {
                " and its process group"
            } else {
                ""
            }
        );
        if let Err(e) = killed {
            message.push_str(&format!("; the kill failed: {e}"));
        }
        if let Err(e) = reaped {
            message.push_str(&format!("; waiting for it failed: {e}"));
        }
        if !stderr.trim().is_empty() {
            message.push_str(&format!("; it said: {}", stderr.trim()));
        }
        anyhow::anyhow!(message)
    }
}
