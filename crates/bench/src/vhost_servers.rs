//! The servers of the vhost-user-blk section, each started once for the whole run and stopped
//! by its process id: `qemu-storage-daemon`'s vhost-user-blk export of the raw file (the
//! peer), the raw export over vhost-user-blk (`thinpool-bench vhost-raw-serve`), and
//! `thinpool serve` of a pool whose volume holds the same bytes (over
//! vhost-user-blk when the binary has `--vhost-user-blk`, and over NBD); CPU time of a
//! process from `/proc/PID/stat`; and fio's nbd engine as the NBD load generator.

use crate::vhost_load::{Pattern, RunResult, Workload};
use anyhow::{bail, ensure, Context};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Clock ticks per second of `/proc/PID/stat` (USER_HZ, 100 on every Linux architecture
/// this runs on).
const TICKS_PER_SECOND: f64 = 100.0;
/// How long a server may take to listen, or to exit after SIGTERM.
const SERVER_TIMEOUT: Duration = Duration::from_secs(60);

/// User + system CPU seconds of process `pid`, all its threads (10 ms resolution); this
/// process's with `None` (`CLOCK_PROCESS_CPUTIME_ID`, nanoseconds, threads that ended
/// included).
pub fn cpu_seconds(pid: Option<u32>) -> anyhow::Result<f64> {
    let Some(pid) = pid else {
        let now = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
        return Ok(now.tv_sec as f64 + now.tv_nsec as f64 / 1e9);
    };
    let path = format!("/proc/{pid}/stat");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    // Fields after the command name (which may hold spaces, in parentheses): state is
    // field 3, utime 14 and stime 15.
    let rest = text.rsplit_once(')').context("no ')' in stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    ensure!(fields.len() > 12, "{path}: too few fields");
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    Ok(ticks as f64 / TICKS_PER_SECOND)
}

/// A server process, killed (SIGKILL, by PID) when dropped unless stopped.
pub struct Server {
    name: &'static str,
    child: Option<Child>,
}

impl Server {
    fn spawn(name: &'static str, mut command: Command) -> anyhow::Result<Server> {
        let child = command
            .spawn()
            .with_context(|| format!("starting {name} ({command:?})"))?;
        Ok(Server {
            name,
            child: Some(child),
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).expect("running")
    }

    fn check_running(&mut self) -> anyhow::Result<()> {
        let child = self.child.as_mut().expect("running");
        if let Some(status) = child.try_wait()? {
            self.child = None;
            bail!("{} exited early: {status}", self.name);
        }
        Ok(())
    }

    /// SIGTERM by PID, then waits for the exit (SIGKILL after the timeout).
    pub fn stop(mut self) -> anyhow::Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let pid = rustix::process::Pid::from_raw(child.id() as i32).context("pid")?;
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        let deadline = Instant::now() + SERVER_TIMEOUT;
        while child.try_wait()?.is_none() {
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("{} ignored SIGTERM", self.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn wait_for_socket(server: &mut Server, socket: &Path) -> anyhow::Result<()> {
    let deadline = Instant::now() + SERVER_TIMEOUT;
    while !socket.exists() {
        server.check_running()?;
        ensure!(
            Instant::now() < deadline,
            "no socket at {}",
            socket.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// `qemu-storage-daemon` exporting `image` as vhost-user-blk on `socket` with `queues`
/// queues (a client may use fewer), writable, discards passed down.
pub fn start_qsd(image: &Path, socket: &Path, queues: usize, log: &Path) -> anyhow::Result<Server> {
    let _ = std::fs::remove_file(socket);
    let output = std::fs::File::create(log)?;
    let mut command = Command::new("qemu-storage-daemon");
    command
        .arg("--blockdev")
        .arg(format!(
            "driver=file,node-name=f,filename={},discard=unmap",
            image.display()
        ))
        .arg("--export")
        .arg(format!(
            "type=vhost-user-blk,id=e,node-name=f,addr.type=unix,addr.path={},writable=on,\
             num-queues={queues}",
            socket.display()
        ))
        .stdin(Stdio::null())
        .stdout(output.try_clone()?)
        .stderr(output);
    let mut server = Server::spawn("qemu-storage-daemon", command)?;
    wait_for_socket(&mut server, socket)?;
    Ok(server)
}

/// The raw export over vhost-user-blk: this binary's `vhost-raw-serve` of `image` on
/// `socket` with `queues` queues.
pub fn start_raw_vhost(
    image: &Path,
    socket: &Path,
    queues: usize,
    log: &Path,
) -> anyhow::Result<Server> {
    let _ = std::fs::remove_file(socket);
    let output = std::fs::File::create(log)?;
    let mut command = Command::new(std::env::current_exe().context("this binary")?);
    command
        .arg("vhost-raw-serve")
        .arg("--file")
        .arg(image)
        .arg("--socket")
        .arg(socket)
        .arg("--queues")
        .arg(queues.to_string())
        .stdin(Stdio::null())
        .stdout(output.try_clone()?)
        .stderr(output);
    let mut server = Server::spawn("thinpool-bench vhost-raw-serve", command)?;
    wait_for_socket(&mut server, socket)?;
    Ok(server)
}

/// Whether `thinpool serve` of this binary can export a volume over vhost-user-blk, and if
/// not, why.
pub fn thinpool_vhost_support(thinpool: &Path) -> Result<(), String> {
    let output = Command::new(thinpool)
        .args(["serve", "--help"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", thinpool.display()))?;
    if String::from_utf8_lossy(&output.stdout).contains("--vhost-user-blk") {
        Ok(())
    } else {
        Err(format!(
            "{} serve has no --vhost-user-blk",
            thinpool.display()
        ))
    }
}

/// A pool made with the `thinpool` binary, holding volume `vm` of the raw file's size.
pub struct ThinPool {
    pub binary: PathBuf,
    pub dir: PathBuf,
}

/// The volume's name.
pub const VOLUME: &str = "vm";

impl ThinPool {
    /// Creates the pool (data a quarter larger than the volume, 64 KiB blocks) and volume.
    pub fn create(binary: &Path, dir: &Path, volume_bytes: u64) -> anyhow::Result<ThinPool> {
        let pool = ThinPool {
            binary: binary.to_path_buf(),
            dir: dir.to_path_buf(),
        };
        let data = format!("{}M", (volume_bytes + volume_bytes / 4) >> 20);
        let size = format!("{}M", volume_bytes >> 20);
        pool.cli(&["create", "--data-size", &data])?;
        pool.cli(&["volume", "create", VOLUME, "--size", &size])?;
        Ok(pool)
    }

    fn cli(&self, args: &[&str]) -> anyhow::Result<()> {
        let output = Command::new(&self.binary)
            .args(args)
            .arg("--pool")
            .arg(&self.dir)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running thinpool {args:?}"))?;
        ensure!(
            output.status.success(),
            "thinpool {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(())
    }

    /// `thinpool serve` of the pool: the NBD socket, and `vhost` as the volume's
    /// vhost-user-blk socket with `queues` queues if given. Returns once it prints
    /// `thinpool: ready`.
    pub fn serve(
        &self,
        nbd: &Path,
        vhost: Option<&Path>,
        queues: usize,
        log: &Path,
    ) -> anyhow::Result<Server> {
        let mut command = Command::new(&self.binary);
        command
            .arg("serve")
            .arg("--quiet")
            .arg("--pool")
            .arg(&self.dir)
            .arg("--socket")
            .arg(nbd);
        if let Some(vhost) = vhost {
            let _ = std::fs::remove_file(vhost);
            command
                .arg("--vhost-user-blk")
                .arg(format!("{VOLUME}={},queues={queues}", vhost.display()));
        }
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log)?);
        let mut server = Server::spawn("thinpool serve", command)?;
        let stdout = server.child.as_mut().and_then(|c| c.stdout.take());
        let mut lines = BufReader::new(stdout.context("serve's stdout")?).lines();
        loop {
            let Some(line) = lines.next() else {
                server.check_running()?;
                bail!("thinpool serve closed stdout before it was ready");
            };
            if line?.starts_with("thinpool: ready") {
                break;
            }
        }
        // Keep reading (and dropping) its stdout so that the server never blocks on it.
        std::thread::spawn(move || lines.for_each(drop));
        if let Some(vhost) = vhost {
            wait_for_socket(&mut server, vhost)?;
        }
        Ok(server)
    }
}

/// `nbd+unix:///vm?socket=...`.
pub fn nbd_uri(socket: &Path) -> String {
    format!("nbd+unix:///{VOLUME}?socket={}", socket.display())
}

/// Copies `image` into the export at `uri` (`nbdcopy`).
pub fn nbdcopy_into(image: &Path, uri: &str) -> anyhow::Result<()> {
    let status = Command::new("nbdcopy")
        .arg(image)
        .arg(uri)
        .stdin(Stdio::null())
        .status()
        .context("running nbdcopy")?;
    ensure!(
        status.success(),
        "nbdcopy {} {uri}: {status}",
        image.display()
    );
    Ok(())
}

/// One timed run of `workload` through fio's nbd engine on `uri`: a job (connection) per
/// queue, `depth` in flight on each; sequential jobs each read their own slice.
pub fn run_fio_nbd(
    uri: &str,
    device_bytes: u64,
    workload: &Workload,
    duration: Duration,
    scratch: &Path,
) -> anyhow::Result<RunResult> {
    let output_path = scratch.join("fio.json");
    let slice = device_bytes / workload.queues as u64;
    let rw = match workload.pattern {
        Pattern::Random => "randread",
        Pattern::Sequential => "read",
    };
    let mut command = Command::new("fio");
    command.args([
        "--name=bench",
        "--ioengine=nbd",
        &format!("--uri={uri}"),
        &format!("--rw={rw}"),
        &format!("--bs={}", workload.request_bytes),
        &format!("--iodepth={}", workload.depth),
        &format!("--numjobs={}", workload.queues),
        &format!("--size={slice}"),
        &format!("--offset_increment={slice}"),
        "--randrepeat=1",
        "--time_based",
        &format!("--runtime={}ms", duration.as_millis().max(1)),
        "--output-format=json",
        &format!("--output={}", output_path.display()),
    ]);
    let output = command
        .stdin(Stdio::null())
        .output()
        .context("running fio")?;
    ensure!(
        output.status.success(),
        "fio failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = std::fs::read_to_string(&output_path)?;
    let start = text.find('{').context("no JSON in fio's output")?;
    let report: serde_json::Value = serde_json::from_str(&text[start..])?;
    fio_result(&report, workload)
}

fn fio_result(report: &serde_json::Value, workload: &Workload) -> anyhow::Result<RunResult> {
    let mut result = RunResult::default();
    for job in report["jobs"].as_array().context("fio: no jobs")? {
        ensure!(
            job["error"].as_i64() == Some(0),
            "fio job error {}",
            job["error"]
        );
        let read = &job["read"];
        let ios = read["total_ios"].as_u64().context("fio: total_ios")?;
        let runtime_s = job["job_runtime"].as_f64().context("fio: job_runtime")? / 1000.0;
        let cpu_percent =
            job["usr_cpu"].as_f64().unwrap_or(0.0) + job["sys_cpu"].as_f64().unwrap_or(0.0);
        result.ios += ios;
        result.latency_sum_s += read["lat_ns"]["mean"].as_f64().unwrap_or(0.0) * ios as f64 / 1e9;
        result.seconds = result.seconds.max(runtime_s);
        result.client_cpu_s += cpu_percent / 100.0 * runtime_s;
    }
    ensure!(result.ios > 0, "fio completed no I/O");
    result.bytes = result.ios * workload.request_bytes as u64;
    Ok(result)
}
