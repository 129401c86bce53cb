//! External processes in tests: client tools run with a timeout, background processes and a
//! served pool (`thinpool serve`) killed by PID when dropped, polling with a deadline, and
//! the check that a tool is installed.
//!
//! Every process a test starts is stopped by the time its guard is dropped, also when the
//! test fails, so a failing test never leaves a server or a FUSE mount behind.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Environment variables removed from every process started here (the pool the `thinpool`
/// binary would use by default).
const CLEARED_VARIABLES: [&str; 2] = ["THINPOOL_POOL", "RUST_LOG"];
/// How often polling loops look again.
const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// Fails the test, naming the Debian package to install, if `tool` is not on `PATH` (or in
/// `/usr/sbin`, `/sbin`): a test must not pass because its client was missing.
pub fn require_tool(tool: &str, package: &str) {
    let on_path = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|dir| dir.join(tool).is_file()))
        .unwrap_or(false);
    let found = on_path
        || ["/usr/sbin", "/sbin"]
            .iter()
            .any(|dir| Path::new(dir).join(tool).is_file());
    assert!(
        found,
        "{tool} is missing: apt-get install -y {package} (scripts/test installs it)"
    );
}

/// Runs `program args` with captured output, killing it (by PID) and failing the test if it
/// takes longer than `timeout`.
pub fn run_tool(program: impl AsRef<Path>, args: &[&str], timeout: Duration) -> Output {
    run_tool_in(program, args, timeout, None, &[])
}

/// [`run_tool`] in working directory `cwd` with extra environment variables.
pub fn run_tool_in(
    program: impl AsRef<Path>,
    args: &[&str],
    timeout: Duration,
    cwd: Option<&Path>,
    env: &[(&str, &str)],
) -> Output {
    let program = program.as_ref();
    let mut command = Command::new(program);
    command.args(args);
    for name in CLEARED_VARIABLES {
        command.env_remove(name);
    }
    if let Some(cwd) = cwd {
        command.current_dir(cwd);
    }
    command.envs(env.iter().copied());
    run_command(command, &format!("{} {args:?}", program.display()), timeout)
}

/// Runs `command` with no input and captured output, reading both pipes on helper threads
/// (so a chatty tool cannot block on a full pipe); kills it by PID and fails the test if it
/// runs longer than `timeout`. `description` names it in messages.
pub fn run_command(mut command: Command, description: &str, timeout: Duration) -> Output {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut guard = ChildGuard::spawn(command, description);
    let child = guard.child_mut();
    let stdout = child.stdout.take().expect("piped stdout");
    let stderr = child.stderr.take().expect("piped stderr");
    let out = std::thread::spawn(move || read_all(stdout));
    let err = std::thread::spawn(move || read_all(stderr));
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = guard.try_wait() {
            break status;
        }
        if Instant::now() >= deadline {
            let pid = guard.pid();
            drop(guard);
            panic!("`{description}` (pid {pid}) did not finish within {timeout:?} and was killed");
        }
        std::thread::sleep(POLL_INTERVAL);
    };
    Output {
        status,
        stdout: out.join().expect("stdout reader"),
        stderr: err.join().expect("stderr reader"),
    }
}

fn read_all(mut reader: impl Read) -> Vec<u8> {
    let mut bytes = Vec::new();
    let _ = reader.read_to_end(&mut bytes);
    bytes
}

/// Runs a tool that must succeed; returns its stdout.
#[track_caller]
pub fn run_ok(program: impl AsRef<Path>, args: &[&str], timeout: Duration) -> String {
    let program = program.as_ref();
    let output = run_tool(program, args, timeout);
    assert!(
        output.status.success(),
        "{} {args:?} failed with {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        program.display(),
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Polls `condition` until it holds; fails the test after `timeout`.
#[track_caller]
pub fn wait_for(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// A child process killed (SIGKILL, by its PID) and reaped when dropped, unless it already
/// exited and was waited for.
#[derive(Debug)]
pub struct ChildGuard {
    child: Child,
    name: String,
    exited: Option<ExitStatus>,
}

impl ChildGuard {
    /// Spawns `command`; `name` is for messages.
    pub fn spawn(mut command: Command, name: &str) -> ChildGuard {
        let name = name.to_string();
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        ChildGuard {
            child,
            name,
            exited: None,
        }
    }

    /// Starts `program args` in the background with no input and output discarded.
    pub fn background(program: &str, args: &[&str]) -> ChildGuard {
        let mut command = Command::new(program);
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        ChildGuard::spawn(command, program)
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The child, to take its pipes.
    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    /// The exit status if the process has exited.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none() {
            self.exited = self
                .child
                .try_wait()
                .unwrap_or_else(|e| panic!("cannot wait for {}: {e}", self.name));
        }
        self.exited
    }

    /// Waits up to `timeout` for the process to exit on its own: its status, or `None` if it
    /// is still running.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// Sends SIGTERM and waits up to `timeout` for the process to exit: its status, or `None`
    /// if it is still running (the guard still kills it when dropped).
    pub fn terminate(&mut self, timeout: Duration) -> Option<ExitStatus> {
        if let Some(status) = self.try_wait() {
            return Some(status);
        }
        let pid = self.pid().to_string();
        run_ok("kill", &["-TERM", &pid], Duration::from_secs(5));
        self.wait_exit(timeout)
    }

    /// SIGKILL and reap, as a crash.
    pub fn kill(&mut self) {
        if self.exited.is_none() {
            let _ = self.child.kill();
            self.exited = self.child.wait().ok();
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A running `thinpool serve`: started, waited for until it prints `thinpool: ready`, and
/// killed by PID when dropped unless stopped first. Its stderr goes to a file, shown when
/// it fails to start or to stop.
#[derive(Debug)]
pub struct Served {
    process: ChildGuard,
    /// The pool directory given with `--pool` (empty for the working directory's default).
    pub pool: PathBuf,
    /// The NBD socket, from the `NBD socket:` line of the banner.
    pub socket: PathBuf,
    /// The TCP address, from the `NBD TCP:` line of the banner, if any.
    pub tcp: Option<String>,
    /// Everything printed on stdout up to and including the ready line.
    pub banner: String,
    stderr_path: PathBuf,
}

/// Longest wait for a server to print its ready line or to exit after SIGTERM.
const SERVE_TIMEOUT: Duration = Duration::from_secs(30);

impl Served {
    /// Starts `binary serve [--pool POOL] EXTRA...` in `cwd` (or this directory); `pool` may be
    /// empty to use the default pool of the working directory.
    pub fn start(binary: &Path, pool: &Path, extra: &[&str], cwd: Option<&Path>) -> Served {
        Served::start_in(binary, pool, extra, cwd, &[])
    }

    /// As [`Served::start`], in this directory, with `env` set in the server's environment.
    pub fn start_with_env(
        binary: &Path,
        pool: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Served {
        Served::start_in(binary, pool, extra, None, env)
    }

    fn start_in(
        binary: &Path,
        pool: &Path,
        extra: &[&str],
        cwd: Option<&Path>,
        env: &[(&str, &str)],
    ) -> Served {
        let mut command = Command::new(binary);
        command.arg("serve");
        if !pool.as_os_str().is_empty() {
            command.arg("--pool").arg(pool);
        }
        command.args(extra);
        for name in CLEARED_VARIABLES {
            command.env_remove(name);
        }
        command.envs(env.iter().copied());
        if let Some(cwd) = cwd {
            command.current_dir(cwd);
        }
        let stderr_path = std::env::temp_dir().join(format!(
            "thinpool-serve-stderr-{}-{}",
            std::process::id(),
            unique()
        ));
        let stderr = std::fs::File::create(&stderr_path)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", stderr_path.display()));
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        let mut process = ChildGuard::spawn(command, "thinpool serve");
        let stdout = process.child_mut().stdout.take().expect("piped stdout");
        let lines = stdout_lines(stdout);
        let mut served = Served {
            process,
            pool: pool.to_path_buf(),
            socket: PathBuf::new(),
            tcp: None,
            banner: String::new(),
            stderr_path,
        };
        served.wait_ready(&lines);
        served
    }

    fn wait_ready(&mut self, lines: &mpsc::Receiver<String>) {
        let deadline = Instant::now() + SERVE_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(line) = lines.recv_timeout(left) else {
                panic!(
                    "thinpool serve did not become ready:\n{}\n--- stderr ---\n{}",
                    self.banner,
                    self.stderr()
                );
            };
            self.banner.push_str(&line);
            self.banner.push('\n');
            let line = line.trim();
            if let Some(socket) = line.strip_prefix("NBD socket:") {
                self.socket = PathBuf::from(socket.trim());
            }
            if let Some(tcp) = line.strip_prefix("NBD TCP:") {
                self.tcp = Some(tcp.trim().to_string());
            }
            if line.starts_with("thinpool: ready") {
                return;
            }
        }
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// The server's stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// `nbd+unix:///NAME?socket=...`.
    pub fn uri(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.socket.display())
    }

    /// SIGTERM, then waits for a clean exit; returns the exit status. Fails the test, with
    /// the server's stderr, if it does not exit in time.
    pub fn stop(mut self) -> ExitStatus {
        self.process
            .terminate(SERVE_TIMEOUT)
            .unwrap_or_else(|| panic!("thinpool serve ignored SIGTERM:\n{}", self.stderr()))
    }

    /// As [`Served::stop`], and returns what the server wrote on stderr too.
    pub fn stop_with_log(mut self) -> (ExitStatus, String) {
        let status = self
            .process
            .terminate(SERVE_TIMEOUT)
            .unwrap_or_else(|| panic!("thinpool serve ignored SIGTERM:\n{}", self.stderr()));
        let log = self.stderr();
        (status, log)
    }

    /// SIGKILL, as a crash.
    pub fn kill9(mut self) {
        self.process.kill();
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.process.kill();
        let _ = std::fs::remove_file(&self.stderr_path);
    }
}

/// The lines of `stdout`, read on a thread until it closes.
fn stdout_lines(stdout: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if sender.send(line).is_err() {
                break;
            }
        }
    });
    receiver
}

/// A number not returned before in this process.
fn unique() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    COUNTER.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_tool_captures_output_and_status() {
        let output = run_tool(
            "sh",
            &["-c", "echo out; echo err >&2; exit 3"],
            Duration::from_secs(10),
        );
        assert_eq!(output.status.code(), Some(3));
        assert_eq!(output.stdout, b"out\n");
        assert_eq!(output.stderr, b"err\n");
    }

    #[test]
    fn run_tool_kills_a_tool_that_overruns() {
        let result = std::panic::catch_unwind(|| {
            run_tool("sleep", &["30"], Duration::from_millis(100));
        });
        assert!(result.is_err(), "an overrunning tool must fail the test");
    }

    #[test]
    fn child_guard_kills_on_drop_and_terminate_reports_the_status() {
        let guard = ChildGuard::background("sleep", &["30"]);
        let pid = guard.pid();
        drop(guard);
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists()
                || std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                    .map(|line| !line.starts_with("sleep"))
                    .unwrap_or(true),
            "sleep {pid} still running"
        );
        let mut guard = ChildGuard::background("sleep", &["30"]);
        let status = guard.terminate(Duration::from_secs(10));
        assert!(!status.expect("sleep exits on SIGTERM").success());
    }

    #[test]
    fn wait_for_fails_after_its_timeout() {
        wait_for("nothing", Duration::from_secs(1), || true);
        let result = std::panic::catch_unwind(|| {
            wait_for("never", Duration::from_millis(50), || false);
        });
        assert!(result.is_err());
    }
}
