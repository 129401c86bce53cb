//! One owner at a time: the claim every writer of a pool's metadata takes, and who holds it.
//!
//! A pool on files is claimed by an exclusive `flock` on its `metadata` file (the server
//! holds it while it serves, `Pool::open` takes it); a pool on block devices by opening the
//! metadata device with `O_EXCL` (Linux then refuses every other exclusive opener with
//! `EBUSY`). Writers outside the pool engine (`thinpool restore -o`, `check
//! --clear-needs-check-flag`) open their output through [`open_for_writing`], which takes the
//! same claim, so a served pool's metadata is never overwritten under its server (issue 20,
//! finding 2: `restore -o POOL/metadata` used to succeed while `serve` held the pool).
//!
//! A refusal names the holders: [`holders`] finds the process holding a file's `flock` in
//! `/proc/locks` (by device and inode), or every process with a block device open in
//! `/proc/PID/fd`.

use std::fs::File;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use persistent_data::FileDevice;

use crate::error::{Error, Result};

/// A process holding a pool's claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    /// Its process id.
    pub pid: u32,
    /// Its command name (`/proc/PID/comm`), if readable.
    pub command: Option<String>,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {}", self.pid)?;
        if let Some(command) = &self.command {
            write!(f, " ({command})")?;
        }
        Ok(())
    }
}

/// The claim [`open_for_writing`] took beyond the device's own descriptor (a duplicate of a
/// metadata file's locked descriptor, a loop device's backing-file lock): held while it
/// lives, so a caller that hands the device on (and drops it) keeps the pool until done.
#[derive(Debug)]
pub struct Claim {
    _files: Vec<File>,
}

/// Opens `path` (a metadata file or block device) for writing with the pool's claim: an
/// exclusive `flock` on a regular file; on a block device `O_EXCL`, and for a loop device
/// also the `flock` on its backing file that every alias of it shares (see
/// `engine::block_device`). Refused with [`Error::Locked`], naming the holder, while
/// another process holds it (a server). The claim lasts as long as the device or the
/// returned [`Claim`], whichever lives longer.
pub fn open_for_writing(path: &Path) -> Result<(FileDevice, Claim)> {
    let is_block_device = std::fs::metadata(path)
        .map(|metadata| metadata.file_type().is_block_device())
        .unwrap_or(false);
    let opened = if is_block_device {
        FileDevice::open_exclusive(path, true)
    } else {
        FileDevice::open(path, true)
    };
    let device = opened.map_err(|error| {
        if error.raw_os_error() == Some(libc::EBUSY) {
            locked(path)
        } else {
            Error::Io {
                what: format!("opening {} for writing", path.display()),
                source: error,
            }
        }
    })?;
    let duplicate = || {
        device.file().try_clone().map_err(|source| Error::Io {
            what: format!("holding {}", path.display()),
            source,
        })
    };
    let files = if is_block_device {
        let identity = crate::engine::block_device::DeviceIdentity::of(device.file(), path)?;
        match &identity.loop_backing {
            Some(backing) => vec![crate::engine::block_device::lock_backing_file(
                backing, path,
            )?],
            None => vec![],
        }
    } else {
        lock_exclusive(device.file(), path)?;
        vec![duplicate()?]
    };
    Ok((device, Claim { _files: files }))
}

/// Takes the exclusive `flock` on `file` (opened from `path`) without waiting; refused with
/// [`Error::Locked`] naming the holder.
pub fn lock_exclusive(file: &File, path: &Path) -> Result<()> {
    match file.try_lock() {
        Ok(()) => Ok(()),
        Err(std::fs::TryLockError::WouldBlock) => Err(locked(path)),
        Err(std::fs::TryLockError::Error(source)) => Err(Error::Io {
            what: format!("locking {}", path.display()),
            source,
        }),
    }
}

/// [`Error::Locked`] for `path`, naming the processes that hold it if they can be found.
pub fn locked(path: &Path) -> Error {
    let path = match holders(path) {
        Some(holders) => format!("{} (held by {holders})", path.display()),
        None => path.display().to_string(),
    };
    Error::Locked { path }
}

/// The processes (other than this one) holding `path`, at least one: the holder of a
/// `flock` on it for a regular file; every process with it open for a block device (the
/// kernel does not say which of them opened it exclusively, and a passing `losetup` or
/// `blkid` may have it open too). `None` if there is none or it cannot be found (e.g.
/// `/proc` is not readable).
pub fn holders(path: &Path) -> Option<Holders> {
    let metadata = std::fs::metadata(path).ok()?;
    let pids = if metadata.file_type().is_block_device() {
        block_device_openers(metadata.rdev())
    } else {
        flock_holder(metadata.dev(), metadata.ino())
            .into_iter()
            .collect()
    };
    let holders: Vec<Holder> = pids
        .into_iter()
        .map(|pid| {
            let command = std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .ok()
                .map(|text| text.trim().to_string());
            Holder { pid, command }
        })
        .collect();
    (!holders.is_empty()).then_some(Holders(holders))
}

/// One or more [`Holder`]s, shown as `pid 1 (a), pid 2 (b)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holders(pub Vec<Holder>);

impl Holders {
    /// The first holder found (the only one for a `flock`).
    pub fn first(&self) -> &Holder {
        &self.0[0]
    }
}

impl std::fmt::Display for Holders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, holder) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{holder}")?;
        }
        Ok(())
    }
}

/// The pid of the `FLOCK` holder of inode `ino` on device `dev`, from `/proc/locks`, whose
/// lines read `N: FLOCK  ADVISORY  WRITE PID MAJ:MIN:INODE 0 EOF` (major and minor in hex;
/// waiters are marked `->` and skipped).
fn flock_holder(dev: u64, ino: u64) -> Option<u32> {
    let text = std::fs::read_to_string("/proc/locks").ok()?;
    let wanted = (
        u64::from(rustix::fs::major(dev)),
        u64::from(rustix::fs::minor(dev)),
        ino,
    );
    let me = std::process::id();
    text.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.get(1) == Some(&"->") || fields.get(1) != Some(&"FLOCK") {
            return None;
        }
        let pid: u32 = fields.get(4)?.parse().ok()?;
        let mut parts = fields.get(5)?.split(':');
        let major = u64::from_str_radix(parts.next()?, 16).ok()?;
        let minor = u64::from_str_radix(parts.next()?, 16).ok()?;
        let inode: u64 = parts.next()?.parse().ok()?;
        ((major, minor, inode) == wanted && pid != me).then_some(pid)
    })
}

/// The processes (other than this one) with block device `rdev` open, from
/// `/proc/PID/fd`, in pid order.
fn block_device_openers(rdev: u64) -> Vec<u32> {
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
                return false;
            };
            fds.filter_map(|fd| fd.ok()).any(|fd| {
                std::fs::metadata(fd.path()).is_ok_and(|metadata| {
                    metadata.file_type().is_block_device() && metadata.rdev() == rdev
                })
            })
        })
        .collect();
    pids.sort_unstable();
    pids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_flock_names_its_holder_and_refuses_the_writer() {
        let dir = std::env::temp_dir().join(format!("thinpool-owner-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("metadata");
        std::fs::write(&path, vec![0u8; 4096 * 8]).unwrap();
        // A child process holds the lock (flock(1) from util-linux, which becomes `sleep`
        // without forking, so killing it frees the lock), as a server would.
        let mut child = std::process::Command::new("flock")
            .arg("--no-fork")
            .arg(&path)
            .args(["sleep", "30"])
            .spawn()
            .expect("flock(1) runs");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while holders(&path).is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "the lock was not seen"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let found = holders(&path).unwrap();
        let error = open_for_writing(&path).expect_err("refused while held");
        let text = error.to_string();
        assert!(matches!(error, Error::Locked { .. }), "{text}");
        assert_eq!(found.first().pid, child.id(), "flock(1) took the lock");
        assert!(
            text.contains(&format!("held by pid {}", child.id())),
            "{text}"
        );
        let _ = child.kill();
        let _ = child.wait();
        let (device, claim) = open_for_writing(&path).expect("free once the holder is gone");
        // Held by this process now: another open of ours is refused too (flock is per open).
        assert!(open_for_writing(&path).is_err());
        drop(device);
        assert!(open_for_writing(&path).is_err(), "the claim holds it still");
        drop(claim);
        assert!(open_for_writing(&path).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
