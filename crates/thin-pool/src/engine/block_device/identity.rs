//! Which device a path names, beyond its name (issue 20, finding 5): device names are not
//! stable (`/dev/loop1` after a renumbering, `/dev/sdb` after a reboot, `dm-3` tomorrow), so
//! `devices.json` records with each path what identifies the device behind it, and a pool
//! opens only on the devices it recorded:
//!
//! - a loop device: its backing file's device and inode
//!   (`/sys/dev/block/MAJ:MIN/loop/backing_file`, then `stat`), the strongest identity:
//!   renumbered or re-attached, the same file is the same pool;
//! - a device-mapper device (an LVM volume): its dm uuid (`/sys/dev/block/MAJ:MIN/dm/uuid`);
//! - otherwise a stable link to it in `/dev/disk/by-id` (a disk's serial or WWN) or
//!   `/dev/disk/by-uuid`, which must still point at the device found;
//! - and its `major:minor`, compared only when none of the above is known.
//!
//! A device with no content that can prove it belongs to this pool: every data block is
//! dm-thin's (no block is free to hold a signature the kernel would not overwrite or serve),
//! the metadata device has no block the space map never hands out, and a fingerprint of
//! mapped data blocks would change with every write. So the identities above are the check;
//! the metadata device's content is then checked by its superblock as before.
//!
//! Aliases: two loop devices over one file are two block devices, so `O_EXCL` on one does
//! not refuse the other, and a second server could run the same pool from another directory.
//! The pool therefore also takes an exclusive `flock` on each loop device's backing file
//! ([`lock_backing_file`]), which every alias shares.

use crate::error::io_error;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// Where udev keeps stable links to block devices, in order of preference.
const STABLE_LINK_DIRS: [&str; 2] = ["/dev/disk/by-id", "/dev/disk/by-uuid"];

/// A loop device's backing file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoopBacking {
    /// Its path when recorded (for messages; the inode is what is compared).
    pub file: PathBuf,
    /// The device of the file system holding it.
    pub dev: u64,
    /// Its inode.
    pub ino: u64,
}

/// What identifies a block device, recorded in `devices.json` beside its path.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceIdentity {
    /// `MAJOR:MINOR` when recorded.
    pub major_minor: String,
    /// A loop device's backing file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loop_backing: Option<LoopBacking>,
    /// A device-mapper device's uuid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dm_uuid: Option<String>,
    /// A link in `/dev/disk/by-id` (or `by-uuid`) to the device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stable_link: Option<PathBuf>,
}

impl DeviceIdentity {
    /// The identity of the block device open as `file`.
    pub fn of(file: &File, path: &Path) -> Result<DeviceIdentity> {
        let metadata = file
            .metadata()
            .map_err(io_error(format!("examining {}", path.display())))?;
        let rdev = metadata.rdev();
        let (major, minor) = (rustix::fs::major(rdev), rustix::fs::minor(rdev));
        let sys = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
        let read = |name: &str| {
            std::fs::read_to_string(sys.join(name))
                .ok()
                .map(|text| text.trim().to_string())
                .filter(|text| !text.is_empty())
        };
        let loop_backing = read("loop/backing_file").and_then(|text| {
            let file = PathBuf::from(text.strip_suffix(" (deleted)").unwrap_or(&text));
            let metadata = std::fs::metadata(&file).ok()?;
            Some(LoopBacking {
                dev: metadata.dev(),
                ino: metadata.ino(),
                file,
            })
        });
        let dm_uuid = read("dm/uuid");
        let stable_link = if loop_backing.is_none() && dm_uuid.is_none() {
            stable_link_to(rdev)
        } else {
            None
        };
        Ok(DeviceIdentity {
            major_minor: format!("{major}:{minor}"),
            loop_backing,
            dm_uuid,
            stable_link,
        })
    }

    /// Whether `found` (the device at the path now) is the device this identity recorded.
    pub fn matches(&self, found: &DeviceIdentity) -> bool {
        if let Some(recorded) = &self.loop_backing {
            return found
                .loop_backing
                .as_ref()
                .is_some_and(|backing| (backing.dev, backing.ino) == (recorded.dev, recorded.ino));
        }
        if let Some(recorded) = &self.dm_uuid {
            return found.dm_uuid.as_ref() == Some(recorded);
        }
        if let Some(link) = &self.stable_link {
            // The link must still lead to the device found at the path.
            return std::fs::metadata(link).is_ok_and(|metadata| {
                metadata.file_type().is_block_device()
                    && format!(
                        "{}:{}",
                        rustix::fs::major(metadata.rdev()),
                        rustix::fs::minor(metadata.rdev())
                    ) == found.major_minor
            });
        }
        self.major_minor == found.major_minor
    }

    /// What identifies the device, for messages.
    pub fn describe(&self) -> String {
        if let Some(backing) = &self.loop_backing {
            format!(
                "loop device over {} (inode {} on device {}:{}, {})",
                backing.file.display(),
                backing.ino,
                rustix::fs::major(backing.dev),
                rustix::fs::minor(backing.dev),
                self.major_minor
            )
        } else if let Some(uuid) = &self.dm_uuid {
            format!("device-mapper device {uuid} ({})", self.major_minor)
        } else if let Some(link) = &self.stable_link {
            format!("{} ({})", link.display(), self.major_minor)
        } else {
            format!("device {}", self.major_minor)
        }
    }
}

/// The refusal of a device that is not the one recorded.
pub fn not_this_pools(
    path: &Path,
    role: &str,
    expected: &DeviceIdentity,
    found: &DeviceIdentity,
) -> Error {
    Error::NotThisPoolsDevice {
        path: path.display().to_string(),
        role: if role == "metadata" {
            "metadata"
        } else {
            "data"
        },
        expected: expected.describe(),
        found: found.describe(),
    }
}

/// A link in [`STABLE_LINK_DIRS`] to block device `rdev`, if udev made one.
fn stable_link_to(rdev: u64) -> Option<PathBuf> {
    STABLE_LINK_DIRS.iter().find_map(|dir| {
        let mut links: Vec<PathBuf> = std::fs::read_dir(dir)
            .ok()?
            .filter_map(|entry| entry.ok().map(|entry| entry.path()))
            .filter(|link| {
                std::fs::metadata(link).is_ok_and(|metadata| {
                    metadata.file_type().is_block_device() && metadata.rdev() == rdev
                })
            })
            .collect();
        links.sort();
        links.into_iter().next()
    })
}

/// Takes an exclusive `flock` on a loop device's backing file, which every loop device
/// over that file shares; refused with [`Error::Locked`] (naming the holder) while another
/// process holds it. The lock lasts as long as the returned file.
pub fn lock_backing_file(backing: &LoopBacking, device: &Path) -> Result<File> {
    let file = File::open(&backing.file).map_err(io_error(format!(
        "opening {}, the backing file of {}",
        backing.file.display(),
        device.display()
    )))?;
    let metadata = file
        .metadata()
        .map_err(io_error(format!("examining {}", backing.file.display())))?;
    if (metadata.dev(), metadata.ino()) != (backing.dev, backing.ino) {
        return Err(Error::BackingFileChanged {
            file: backing.file.display().to_string(),
            device: device.display().to_string(),
        });
    }
    crate::owner::lock_exclusive(&file, &backing.file).map_err(|error| match error {
        Error::Locked { path } => Error::Locked {
            path: format!(
                "{} (its backing file {path} is claimed by another pool: the same file through \
                 another loop device)",
                device.display()
            ),
        },
        other => other,
    })?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(major_minor: &str) -> DeviceIdentity {
        DeviceIdentity {
            major_minor: major_minor.to_string(),
            loop_backing: None,
            dm_uuid: None,
            stable_link: None,
        }
    }

    #[test]
    fn the_strongest_recorded_identity_decides() {
        let backing = |ino| LoopBacking {
            file: PathBuf::from("/x/data.img"),
            dev: 42,
            ino,
        };
        let recorded = DeviceIdentity {
            loop_backing: Some(backing(7)),
            ..identity("7:1")
        };
        // Renumbered: another minor, the same file: the same device.
        let moved = DeviceIdentity {
            loop_backing: Some(backing(7)),
            ..identity("7:5")
        };
        assert!(recorded.matches(&moved));
        // The same number over another file: not it.
        let other = DeviceIdentity {
            loop_backing: Some(backing(8)),
            ..identity("7:1")
        };
        assert!(!recorded.matches(&other));
        assert!(!recorded.matches(&identity("7:1")));
        let dm = DeviceIdentity {
            dm_uuid: Some("LVM-abc".into()),
            ..identity("253:3")
        };
        assert!(dm.matches(&DeviceIdentity {
            dm_uuid: Some("LVM-abc".into()),
            ..identity("253:5")
        }));
        assert!(!dm.matches(&DeviceIdentity {
            dm_uuid: Some("LVM-def".into()),
            ..identity("253:3")
        }));
        assert!(identity("8:0").matches(&identity("8:0")));
        assert!(!identity("8:0").matches(&identity("8:16")));
        let text = recorded.describe();
        assert!(
            text.contains("/x/data.img") && text.contains("inode 7"),
            "{text}"
        );
    }

    #[test]
    fn identities_round_trip_and_old_records_have_none() {
        let recorded = DeviceIdentity {
            stable_link: Some("/dev/disk/by-id/wwn-0x1".into()),
            ..identity("8:0")
        };
        let text = serde_json::to_string(&recorded).unwrap();
        assert!(!text.contains("loop_backing"), "{text}");
        assert_eq!(
            serde_json::from_str::<DeviceIdentity>(&text).unwrap(),
            recorded
        );
    }
}
