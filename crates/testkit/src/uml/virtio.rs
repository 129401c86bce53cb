//! Virtio block devices for a UML boot: the kernel's built-in `virtio_uml` is a vhost-user
//! **front end**, so a vhost-user-blk server's Unix socket becomes a real Linux virtio-blk
//! disk in the guest.
//!
//! [`Boot::vhost_user_blk`] adds `virtio_uml.device=SOCKET:2` (`<socket>:<virtio_id>`, 2 is
//! the virtio block device id) to the kernel command line and loads `virtio_blk.ko` (with the
//! harness's `finit_module` loader); the first such device is `/dev/vda`, the next
//! `/dev/vdb`, ... The server must be listening before the boot: the kernel connects while it
//! registers the device, and one CPU means one queue.
//!
//! [`QemuStorageDaemon`] is the reference server: `qemu-storage-daemon`'s vhost-user-blk
//! export of a raw host file, started and stopped by its process id.

use super::{check_kernel_path, Boot};
use crate::process::{wait_for, ChildGuard};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

/// The virtio device id of a block device (virtio 1.2, "Device Types").
pub const VIRTIO_ID_BLOCK: u32 = 2;
/// The module that drives virtio block devices (`virtio_uml` itself is built in).
pub const VIRTIO_BLK_MODULES: [&str; 1] = ["virtio_blk"];
/// The program of the reference server.
pub const QEMU_STORAGE_DAEMON: &str = "qemu-storage-daemon";

/// How long to wait for a server's socket to appear or for it to exit after SIGTERM.
const SERVER_TIMEOUT: Duration = Duration::from_secs(30);

impl Boot {
    /// Attaches the vhost-user-blk server listening on `socket` as the guest's next virtio
    /// disk (`/dev/vda` first) and loads `virtio_blk`. Panics on a path the kernel command
    /// line cannot carry (whitespace, `,`, `=`, or the `:` that separates the device id).
    pub fn vhost_user_blk(mut self, socket: &Path) -> Boot {
        let text = socket.display().to_string();
        check_kernel_path(socket);
        assert!(
            !text.contains(':'),
            "virtio_uml cannot take socket path {text:?}: ':' separates the device id"
        );
        assert!(
            socket.is_absolute(),
            "virtio_uml connects from the guest's root: {text:?} must be absolute"
        );
        self.kernel_args
            .push(format!("virtio_uml.device={text}:{VIRTIO_ID_BLOCK}"));
        self.modules(&VIRTIO_BLK_MODULES)
    }
}

/// A running `qemu-storage-daemon` exporting one raw file as vhost-user-blk; killed by PID
/// when dropped unless [`stop`](QemuStorageDaemon::stop)ped first.
#[derive(Debug)]
pub struct QemuStorageDaemon {
    process: ChildGuard,
    socket: PathBuf,
    log: PathBuf,
}

impl QemuStorageDaemon {
    /// Exports `image` (a raw file, discards passed down as holes: `discard=unmap`),
    /// writable, with `num_queues` queues, on a new socket at `socket`; returns once the
    /// socket exists. `log` receives the daemon's output.
    pub fn start(image: &Path, socket: &Path, num_queues: u16, log: &Path) -> QemuStorageDaemon {
        for path in [image, socket] {
            let text = path.display().to_string();
            assert!(
                !text.contains(','),
                "qemu option values cannot take {text:?} (a ',' would need doubling)"
            );
        }
        assert!(num_queues >= 1, "a vhost-user-blk export needs a queue");
        let _ = std::fs::remove_file(socket);
        let output = std::fs::File::create(log)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", log.display()));
        let output_err = output
            .try_clone()
            .unwrap_or_else(|e| panic!("cannot duplicate {}: {e}", log.display()));
        let mut command = Command::new(QEMU_STORAGE_DAEMON);
        command
            .arg("--blockdev")
            .arg(format!(
                "driver=file,node-name=f,filename={},discard=unmap",
                image.display()
            ))
            .arg("--export")
            .arg(format!(
                "type=vhost-user-blk,id=e,node-name=f,addr.type=unix,addr.path={},\
                 writable=on,num-queues={num_queues}",
                socket.display()
            ))
            .stdin(Stdio::null())
            .stdout(output)
            .stderr(output_err);
        let mut daemon = QemuStorageDaemon {
            process: ChildGuard::spawn(command, QEMU_STORAGE_DAEMON),
            socket: socket.to_path_buf(),
            log: log.to_path_buf(),
        };
        wait_for("qemu-storage-daemon's socket", SERVER_TIMEOUT, || {
            if let Some(status) = daemon.process.try_wait() {
                panic!(
                    "qemu-storage-daemon exited ({status}) before listening:\n{}",
                    daemon.log()
                );
            }
            daemon.socket.exists()
        });
        daemon
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// The vhost-user socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// What the daemon printed so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM (by PID) and waits for the exit; its status. Panics, with the log, if the
    /// daemon ignores it (the guard then kills it).
    pub fn stop(mut self) -> ExitStatus {
        let status = self.process.terminate(SERVER_TIMEOUT);
        status.unwrap_or_else(|| panic!("qemu-storage-daemon ignored SIGTERM:\n{}", self.log()))
    }
}
