//! The real Linux kernel as a program: User-Mode Linux (Debian 12's `user-mode-linux`,
//! Linux 6.1), fetched by `scripts/fetch-uml` into `target/tools/user-mode-linux/`.
//!
//! A [`Boot`] describes one run of the kernel: host files as its disks (`ubd0=FILE` is the
//! guest's `/dev/ubda`, `ubd1=` `/dev/ubdb`, ...), the modules to load, and a shell script.
//! The harness writes an init script (PID 1) that mounts `/proc`, `/sys`, a tmpfs on `/run`
//! and the writable result directory (through hostfs, at the same path as on the host; the
//! host's `/` is the guest's root, read-only, so host binaries such as `dmsetup`,
//! `mkfs.ext4` and `thin_check` run inside unchanged), loads the modules with the
//! `finit_module` system call (dependencies first, from `modules.dep`; there is no kmod
//! inside), runs the script with `sh -e`, records its exit status in the result directory,
//! syncs and powers off (the `reboot` system call, `/proc/sysrq-trigger` as the fallback).
//!
//! UML runs as several host processes; it is started in its own process group and killed
//! (SIGKILL) by that group id when it overruns its timeout, when a test asks for a crash
//! ([`RunningUml::kill_group`]) or when the handle is dropped: never by name.
//!
//! Two kernels talk over [`net::UcastLink`] (UML's `ucast` transport on loopback UDP);
//! [`drbd::DrbdResource`] replicates their disks with DRBD.
//!
//! Paths given to the kernel (disks, the result directory) must not contain whitespace,
//! `,` or `=`; [`ScratchDir`](crate::ScratchDir) paths qualify.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub mod lvm;

/// Environment variable naming the unpacked package (the directory holding `usr/bin/linux.uml`).
pub const UML_DIR_VARIABLE: &str = "THINPOOL_UML_DIR";
/// Where `scripts/fetch-uml` unpacks the package, relative to the workspace root.
pub const FETCHED_UML_SUBDIR: &str = "target/tools/user-mode-linux";
/// How long one boot may run, by default, before it is killed. Generous: the machine's CPU
/// is shared and UML's system calls go through ptrace.
pub const DEFAULT_BOOT_TIMEOUT: Duration = Duration::from_secs(180);
/// Guest memory, by default.
pub const DEFAULT_MEMORY: &str = "256M";
/// The modules dm-thin needs (their dependencies come from `modules.dep`).
pub const DM_THIN_MODULES: [&str; 1] = ["dm-thin-pool"];

/// The file in the result directory holding the script's exit status.
const STATUS_FILE: &str = "uml-script-status";
/// The file in the result directory holding the guest's uptime when the script started.
const UPTIME_FILE: &str = "uml-script-start-uptime";
/// The interpreter that runs the module loader and the power-off (an absolute path: a
/// `python3` on `PATH` may be a shim that does not work in the guest).
const PYTHON: &str = "/usr/bin/python3";

/// Loads each `.ko` named on the command line with `finit_module(fd, "", 0)` (x86_64 system
/// call 313); a module already loaded (EEXIST) is fine.
const MODULE_LOADER: &str = r#"
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDONLY)
    if libc.syscall(313, fd, b"", 0) != 0:
        e = ctypes.get_errno()
        if e != errno.EEXIST:
            sys.exit("finit_module %s: %s" % (path, os.strerror(e)))
    os.close(fd)
"#;

/// `reboot(LINUX_REBOOT_MAGIC1, LINUX_REBOOT_MAGIC2, LINUX_REBOOT_CMD_POWER_OFF, NULL)`
/// (x86_64 system call 169).
const POWER_OFF: &str =
    "import ctypes; ctypes.CDLL(None, use_errno=True).syscall(169, 0xfee1dead, 672274793, 0x4321fedc, 0)";

/// The preload library `scripts/fetch-uml` builds beside the unpacked package
/// (`crates/testkit/uml/xstate-shim.c` says why it exists).
const XSTATE_SHIM_FILE: &str = "uml-xstate-shim.so";

/// The unpacked `user-mode-linux` package: the kernel binary and its module tree.
#[derive(Clone, Debug)]
pub struct Uml {
    kernel: PathBuf,
    /// `uml-xstate-shim.so` beside the package (built by `scripts/fetch-uml`), preloaded into
    /// the kernel's process: without it this UML dies at its first context switch on hosts
    /// whose XSAVE area is larger than its own (AVX-512, AMX). A no-op on other hosts.
    xstate_shim: Option<PathBuf>,
    modules: PathBuf,
    /// Module name (as `modprobe` spells it, `-` and `_` the same) → (path relative to
    /// `modules`, its dependencies' names).
    dependencies: BTreeMap<String, (PathBuf, Vec<String>)>,
}

impl Uml {
    /// Finds the package: `$THINPOOL_UML_DIR`, else `<workspace>/target/tools/user-mode-linux`.
    /// Panics naming `scripts/fetch-uml` if it is not there: a kernel test must not pass
    /// because the kernel was missing.
    pub fn find() -> Uml {
        let dir = match std::env::var_os(UML_DIR_VARIABLE) {
            Some(dir) => PathBuf::from(dir),
            None => Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../..")
                .join(FETCHED_UML_SUBDIR),
        };
        Uml::at(&dir)
    }

    /// The package unpacked at `dir`.
    pub fn at(dir: &Path) -> Uml {
        let kernel = dir.join("usr/bin/linux.uml");
        assert!(
            kernel.is_file(),
            "{} is missing: run scripts/fetch-uml (scripts/test runs it) or set {UML_DIR_VARIABLE}",
            kernel.display()
        );
        let versions = dir.join("usr/lib/uml/modules");
        let modules = std::fs::read_dir(&versions)
            .unwrap_or_else(|e| panic!("cannot list {}: {e}", versions.display()))
            .filter_map(|entry| entry.ok().map(|entry| entry.path()))
            .find(|path| path.join("modules.dep").is_file())
            .unwrap_or_else(|| panic!("no modules.dep under {}", versions.display()));
        let dep_path = modules.join("modules.dep");
        let text = std::fs::read_to_string(&dep_path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", dep_path.display()));
        let dependencies = parse_modules_dep(&text);
        let xstate_shim = dir
            .parent()
            .map(|tools| tools.join(XSTATE_SHIM_FILE))
            .filter(|shim| shim.is_file());
        Uml {
            kernel,
            xstate_shim,
            modules,
            dependencies,
        }
    }

    /// The kernel binary.
    pub fn kernel(&self) -> &Path {
        &self.kernel
    }

    /// The `.ko` files to load for `names`, in load order: every module after its
    /// dependencies, each once. Panics on a module the kernel does not ship.
    pub fn module_files(&self, names: &[&str]) -> Vec<PathBuf> {
        let mut order = Vec::new();
        for name in names {
            self.visit(&module_key(name), &mut order, &mut Vec::new());
        }
        order
            .into_iter()
            .map(|key| self.modules.join(&self.dependencies[&key].0))
            .collect()
    }

    fn visit(&self, key: &str, order: &mut Vec<String>, path: &mut Vec<String>) {
        if order.iter().any(|done| done == key) {
            return;
        }
        assert!(
            !path.iter().any(|on| on == key),
            "modules.dep has a dependency cycle through {key}"
        );
        let (_, deps) = self
            .dependencies
            .get(key)
            .unwrap_or_else(|| panic!("module {key} is not in {}", self.modules.display()));
        path.push(key.to_string());
        for dep in deps {
            self.visit(dep, order, path);
        }
        path.pop();
        order.push(key.to_string());
    }
}

/// `modules.dep` lines are `kernel/a/b.ko: kernel/c.ko kernel/d.ko`.
fn parse_modules_dep(text: &str) -> BTreeMap<String, (PathBuf, Vec<String>)> {
    let mut map = BTreeMap::new();
    for line in text.lines() {
        let Some((module, deps)) = line.split_once(':') else {
            continue;
        };
        let deps = deps.split_whitespace().map(module_key).collect();
        map.insert(module_key(module), (PathBuf::from(module.trim()), deps));
    }
    map
}

/// A module's name from its name or path: the file stem, `_` spelled `-`.
fn module_key(name: &str) -> String {
    let file = name.trim().rsplit('/').next().unwrap_or(name);
    let stem = file
        .strip_suffix(".ko.xz")
        .or_else(|| file.strip_suffix(".ko"))
        .unwrap_or(file);
    stem.replace('_', "-")
}

/// A disk given to the guest.
#[derive(Clone, Debug)]
struct Disk {
    path: PathBuf,
    writable: bool,
}

/// One run of the kernel, built up and then [`run`](Boot::run) or [`spawn`](Boot::spawn)ed.
#[derive(Clone, Debug)]
pub struct Boot {
    uml: Uml,
    result_dir: PathBuf,
    disks: Vec<Disk>,
    modules: Vec<String>,
    script: String,
    timeout: Duration,
    memory: String,
    /// More kernel command-line arguments (devices such as `virtio_uml.device=`).
    kernel_args: Vec<String>,
}

impl Boot {
    /// A boot whose writable result directory is `result_dir` (created if missing; the
    /// harness keeps its init script, console log and status files there too).
    pub fn new(uml: &Uml, result_dir: &Path) -> Boot {
        std::fs::create_dir_all(result_dir)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", result_dir.display()));
        let result_dir = result_dir
            .canonicalize()
            .unwrap_or_else(|e| panic!("cannot resolve {}: {e}", result_dir.display()));
        check_kernel_path(&result_dir);
        Boot {
            uml: uml.clone(),
            result_dir,
            disks: Vec::new(),
            modules: Vec::new(),
            script: String::new(),
            timeout: DEFAULT_BOOT_TIMEOUT,
            memory: DEFAULT_MEMORY.to_string(),
            kernel_args: Vec::new(),
        }
    }

    /// Adds a read-write disk: the first is `/dev/ubda`, the next `/dev/ubdb`, ...
    pub fn disk(mut self, path: &Path) -> Boot {
        self.disks.push(Disk {
            path: path.to_path_buf(),
            writable: true,
        });
        self
    }

    /// Adds a read-only disk.
    pub fn disk_read_only(mut self, path: &Path) -> Boot {
        self.disks.push(Disk {
            path: path.to_path_buf(),
            writable: false,
        });
        self
    }

    /// Loads `names` (and their dependencies) before the script runs.
    pub fn modules(mut self, names: &[&str]) -> Boot {
        self.modules
            .extend(names.iter().map(|name| name.to_string()));
        self
    }

    /// The shell script to run (with `sh -e`, in the result directory, `PATH` set to the
    /// usual system directories, `DM_DISABLE_UDEV=1`, `$RESULT` naming the result directory).
    pub fn script(mut self, script: &str) -> Boot {
        self.script = script.to_string();
        self
    }

    /// How long the boot may run before it is killed (default [`DEFAULT_BOOT_TIMEOUT`]).
    pub fn timeout(mut self, timeout: Duration) -> Boot {
        self.timeout = timeout;
        self
    }

    /// The result directory.
    pub fn result_dir(&self) -> &Path {
        &self.result_dir
    }

    /// Boots, waits for the power-off (killing the kernel after the timeout) and returns
    /// what happened. Does not judge the script's status: see [`Outcome::assert_success`].
    pub fn run(self) -> Outcome {
        let timeout = self.timeout;
        let mut running = self.spawn();
        running.wait(timeout)
    }

    /// Boots in the background.
    pub fn spawn(self) -> RunningUml {
        for name in [STATUS_FILE, UPTIME_FILE] {
            let _ = std::fs::remove_file(self.result_dir.join(name));
        }
        let init = self.result_dir.join("uml-init.sh");
        std::fs::write(&init, self.init_script())
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", init.display()));
        std::fs::set_permissions(&init, std::fs::Permissions::from_mode(0o755))
            .unwrap_or_else(|e| panic!("cannot chmod {}: {e}", init.display()));
        let script = self.result_dir.join("uml-script.sh");
        std::fs::write(&script, &self.script)
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", script.display()));

        let umid = format!("thinpool-{}-{}", std::process::id(), unique());
        let uml_dir = self.result_dir.join("uml-dir");
        std::fs::create_dir_all(&uml_dir)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", uml_dir.display()));
        let mut args = vec![
            format!("mem={}", self.memory),
            "root=/dev/root".to_string(),
            "rootfstype=hostfs".to_string(),
            "rootflags=/".to_string(),
            "ro".to_string(),
            format!("init={}", init.display()),
            "con=null".to_string(),
            "con0=fd:0,fd:1".to_string(),
            "ssl=null".to_string(),
            format!("umid={umid}"),
            format!("uml_dir={}", uml_dir.display()),
        ];
        for (index, disk) in self.disks.iter().enumerate() {
            let path = disk
                .path
                .canonicalize()
                .unwrap_or_else(|e| panic!("cannot resolve disk {}: {e}", disk.path.display()));
            check_kernel_path(&path);
            let suffix = if disk.writable { "" } else { "r" };
            args.push(format!("ubd{index}{suffix}={}", path.display()));
        }
        args.extend(self.kernel_args.iter().cloned());
        let console_path = self.result_dir.join("uml-console.log");
        let console = File::create(&console_path)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", console_path.display()));
        let console_err = console
            .try_clone()
            .unwrap_or_else(|e| panic!("cannot duplicate {}: {e}", console_path.display()));
        let mut command = Command::new(&self.uml.kernel);
        command
            .args(&args)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("TMPDIR", "/tmp")
            .envs(self.uml.xstate_shim.iter().map(|shim| ("LD_PRELOAD", shim)))
            .stdin(Stdio::null())
            .stdout(console)
            .stderr(console_err)
            // Its own process group, killed as a whole.
            .process_group(0);
        let started = Instant::now();
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.uml.kernel.display()));
        RunningUml {
            child: Some(child),
            started,
            result_dir: self.result_dir,
            console_path,
            command_line: args.join(" "),
        }
    }

    fn init_script(&self) -> String {
        let result = shell_quote(&self.result_dir.display().to_string());
        let modules: Vec<String> = self
            .uml
            .module_files(&self.modules.iter().map(String::as_str).collect::<Vec<_>>())
            .iter()
            .map(|path| shell_quote(&path.display().to_string()))
            .collect();
        let load = if modules.is_empty() {
            String::new()
        } else {
            format!(
                "{PYTHON} -c {} {} || status=$?\n",
                shell_quote(MODULE_LOADER),
                modules.join(" ")
            )
        };
        format!(
            "#!/bin/sh
# Written by testkit::uml: PID 1 of one User-Mode Linux boot.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin DM_DISABLE_UDEV=1 RESULT={result} HOME=/root
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t tmpfs tmpfs /run
mount -t hostfs -o {result} none {result}
cat /proc/uptime > {result}/{UPTIME_FILE}
status=0
{load}if [ $status -eq 0 ]; then
    cd {result} && sh -e {result}/uml-script.sh
    status=$?
fi
echo $status > {result}/{STATUS_FILE}
echo \"uml-script: exit status $status\"
sync
{PYTHON} -c {power_off}
echo o > /proc/sysrq-trigger
sleep 3600
",
            power_off = shell_quote(POWER_OFF),
        )
    }
}

/// A kernel that is running; killed (its whole process group) when dropped.
#[derive(Debug)]
pub struct RunningUml {
    child: Option<Child>,
    started: Instant,
    result_dir: PathBuf,
    console_path: PathBuf,
    command_line: String,
}

impl RunningUml {
    /// The process group id (the kernel's main process id).
    pub fn process_group(&self) -> u32 {
        self.child.as_ref().map(Child::id).expect("still running")
    }

    /// The console (kernel log and the script's output) so far.
    pub fn console(&self) -> String {
        std::fs::read_to_string(&self.console_path).unwrap_or_default()
    }

    /// Waits until `path` (relative to the result directory) exists, for at most `timeout`;
    /// whether it appeared. Returns early, false, if the kernel exited.
    pub fn wait_for_file(&mut self, path: &str, timeout: Duration) -> bool {
        let path = self.result_dir.join(path);
        let deadline = Instant::now() + timeout;
        loop {
            if path.exists() {
                return true;
            }
            if Instant::now() >= deadline || self.has_exited() {
                return path.exists();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the kernel has exited (or was killed).
    pub fn has_exited(&mut self) -> bool {
        match self.child.as_mut() {
            None => true,
            Some(child) => matches!(child.try_wait(), Ok(Some(_))),
        }
    }

    /// SIGKILL to the whole process group, as a crash (a power cut for the guest), then
    /// reaps the main process.
    pub fn kill_group(&mut self) {
        if let Some(mut child) = self.child.take() {
            if matches!(child.try_wait(), Ok(None)) {
                let group = format!("-{}", child.id());
                // The leader is not reaped yet, so the group id is still ours.
                let _ = Command::new("kill")
                    .args(["-KILL", "--", &group])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits up to `timeout` for the kernel to power off; kills the group after it.
    pub fn wait(&mut self, timeout: Duration) -> Outcome {
        let deadline = self.started + timeout;
        let mut status = None;
        let mut timed_out = false;
        while let Some(child) = self.child.as_mut() {
            match child.try_wait() {
                Ok(Some(exit)) => {
                    status = Some(exit);
                    self.child = None;
                }
                Ok(None) if Instant::now() >= deadline => {
                    timed_out = true;
                    self.kill_group();
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => panic!("cannot wait for UML: {e}"),
            }
        }
        let script_status = std::fs::read_to_string(self.result_dir.join(STATUS_FILE))
            .ok()
            .and_then(|text| text.trim().parse().ok());
        let script_started = std::fs::read_to_string(self.result_dir.join(UPTIME_FILE))
            .ok()
            .and_then(|text| text.split_whitespace().next()?.parse::<f64>().ok())
            .map(Duration::from_secs_f64);
        Outcome {
            exit: status,
            timed_out,
            script_status,
            script_started,
            elapsed: self.started.elapsed(),
            console: self.console(),
            command_line: self.command_line.clone(),
        }
    }
}

impl Drop for RunningUml {
    fn drop(&mut self) {
        self.kill_group();
    }
}

/// What one boot did.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The kernel process's exit status (`None` if it was killed after its timeout).
    pub exit: Option<ExitStatus>,
    /// Whether it was killed because it overran its timeout.
    pub timed_out: bool,
    /// The script's exit status, if it finished.
    pub script_status: Option<i32>,
    /// The guest's uptime when the script started (after the modules loaded): the kernel's
    /// boot time.
    pub script_started: Option<Duration>,
    /// Wall time from start to power-off.
    pub elapsed: Duration,
    /// Kernel log and the script's output.
    pub console: String,
    /// The kernel command line, for messages.
    pub command_line: String,
}

impl Outcome {
    /// Panics, with the console, unless the script ran to exit status 0 and the kernel
    /// powered off by itself.
    #[track_caller]
    pub fn assert_success(&self) -> &Outcome {
        assert!(
            !self.timed_out && self.script_status == Some(0) && self.exit.is_some(),
            "UML run failed (timed out: {}, script status {:?}, kernel exit {:?})\n\
             command line: {}\n--- console ---\n{}{}",
            self.timed_out,
            self.script_status,
            self.exit,
            self.command_line,
            self.console,
            if self.console.contains("ptrace set fp regs failed") {
                "\n(the host's XSAVE area is larger than this UML's: run scripts/fetch-uml, \
                 which builds target/tools/uml-xstate-shim.so)"
            } else {
                ""
            }
        );
        self
    }
}

/// Panics on a path the kernel command line cannot carry.
fn check_kernel_path(path: &Path) {
    let text = path.display().to_string();
    assert!(
        !text
            .chars()
            .any(|c| c.is_whitespace() || c == ',' || c == '='),
        "UML cannot take path {text:?}: no whitespace, ',' or '=' allowed"
    );
}

/// `text` quoted for `sh`.
pub fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', "'\\''"))
}

fn unique() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    COUNTER.fetch_add(1, Ordering::Relaxed)
}

pub mod drbd;
pub mod nbd;
pub mod net;
pub mod virtio;

#[cfg(test)]
mod tests;
