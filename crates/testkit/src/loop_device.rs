//! Loop devices (`losetup`) over test files, so that pools run on real block devices.
//!
//! [`LoopDevice::attach`] returns `None`, after printing that the test is skipped, when
//! this machine does not let the tests attach loop devices (no root, no `/dev/loop-control`
//! in a container); with `THINPOOL_REQUIRE_LOOP_DEVICES=1` (set by `scripts/test` when it
//! runs as root) that is a failure instead, so CI cannot skip them silently. A device is
//! detached when its guard drops, on failure too.

use crate::process::run_tool;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Variable that turns a skip for want of loop devices into a failure.
pub const REQUIRE_VARIABLE: &str = "THINPOOL_REQUIRE_LOOP_DEVICES";

const LOSETUP_TIMEOUT: Duration = Duration::from_secs(30);

/// A loop device attached to a file, detached when dropped.
#[derive(Debug)]
pub struct LoopDevice {
    device: PathBuf,
    file: PathBuf,
}

impl LoopDevice {
    /// `losetup -f --show FILE`; `None` (the test is to be skipped, as printed) when loop
    /// devices cannot be attached here and [`REQUIRE_VARIABLE`] is not set.
    pub fn attach(file: &Path, test: &str) -> Option<LoopDevice> {
        LoopDevice::attach_with(file, test, &[])
    }

    /// [`LoopDevice::attach`] with more `losetup` options, e.g. `--sector-size 4096`.
    pub fn attach_with(file: &Path, test: &str, options: &[&str]) -> Option<LoopDevice> {
        let file_arg = file.display().to_string();
        let mut args = vec!["-f", "--show"];
        args.extend_from_slice(options);
        args.push(&file_arg);
        let output = run_tool(losetup(), &args, LOSETUP_TIMEOUT);
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            if std::env::var_os(REQUIRE_VARIABLE).is_some_and(|v| v == "1") {
                panic!("{test}: losetup failed and {REQUIRE_VARIABLE}=1: {stderr}");
            }
            eprintln!(
                "SKIPPED {test}: cannot attach a loop device here (losetup: {}); run as root, or set {REQUIRE_VARIABLE}=1 to make this a failure",
                stderr.trim()
            );
            return None;
        }
        let printed = String::from_utf8_lossy(&output.stdout).trim().to_string();
        // The guard first: whatever follows, the device is detached.
        let device = LoopDevice {
            device: PathBuf::from(&printed),
            file: file.to_path_buf(),
        };
        assert!(
            printed.starts_with("/dev/loop"),
            "losetup printed {printed:?}"
        );
        Some(device)
    }

    /// `losetup DEVICE FILE`: attaches `file` at a given, free device (e.g. the number
    /// another test device just gave up, to play a renumbering). Fails the test if losetup
    /// refuses (this is only called once loop devices are known to work).
    pub fn attach_at(device: &Path, file: &Path) -> LoopDevice {
        let device_arg = device.display().to_string();
        let file_arg = file.display().to_string();
        // A device just detached may stay busy a moment (udev still has it open).
        let mut output = run_tool(losetup(), &[&device_arg, &file_arg], LOSETUP_TIMEOUT);
        for _ in 0..50 {
            if output.status.success() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
            output = run_tool(losetup(), &[&device_arg, &file_arg], LOSETUP_TIMEOUT);
        }
        assert!(
            output.status.success(),
            "losetup {device_arg} {file_arg}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        LoopDevice {
            device: device.to_path_buf(),
            file: file.to_path_buf(),
        }
    }

    /// Detaches the device now (as dropping the guard does), e.g. to attach another file
    /// at its number.
    pub fn detach(self) {
        drop(self);
    }

    /// The device, e.g. `/dev/loop3`.
    pub fn path(&self) -> &Path {
        &self.device
    }

    /// The device as a string, for command lines.
    pub fn arg(&self) -> String {
        self.device.display().to_string()
    }

    /// The backing file.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// `losetup -c`: the device takes its file's new size.
    pub fn refresh_size(&self) {
        let output = run_tool(losetup(), &["-c", &self.arg()], LOSETUP_TIMEOUT);
        assert!(
            output.status.success(),
            "losetup -c {}: {}",
            self.arg(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let output = run_tool(losetup(), &["-d", &self.arg()], LOSETUP_TIMEOUT);
        if !output.status.success() {
            eprintln!(
                "losetup -d {}: {}",
                self.arg(),
                String::from_utf8_lossy(&output.stderr)
            );
        }
    }
}

/// `losetup`, from PATH or /sbin.
fn losetup() -> PathBuf {
    ["/usr/sbin/losetup", "/sbin/losetup"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("losetup"))
}
