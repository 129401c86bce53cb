//! Pools on block devices: a pool directory that names a metadata device and a data device
//! (`devices.json`) instead of holding the `metadata` and `data` files, and the data device
//! on a block device ([`BlockDataDevice`]).
//!
//! The directory keeps what dm-thin's metadata does not hold (the catalog, `pool.json`) and
//! the sockets; the devices hold the pool, in the kernel's format, so either side can take
//! it over (`docs/lvm.md`).
//!
//! Both devices are opened with `O_EXCL`: on a block device Linux then refuses every other
//! exclusive opener (a second thinpool, a mount, dm-thin's table load) with `EBUSY`. That
//! claim is the pool's lock (a pool on files takes a `flock` on its metadata file); it holds
//! on this machine only (`docs/scale-out.md`). A busy device is reported as
//! [`Error::Locked`], so the management commands go to the serving process's control socket.
//!
//! What Linux does with the calls the data device makes, on a block device (block/fops.c,
//! `blkdev_fallocate`; the offset and length must be multiples of the logical block size,
//! else `EINVAL`):
//!
//! - `fallocate(ZERO_RANGE | KEEP_SIZE)`: zero-out that must not unmap
//!   (`blkdev_issue_zeroout` with `BLKDEV_ZERO_NOUNMAP`): the device's WRITE ZEROES if it
//!   has one, else the kernel writes zero pages. The range reads as zeros afterwards. This
//!   is what the `BLKZEROOUT` ioctl does.
//! - `fallocate(PUNCH_HOLE | KEEP_SIZE)`: zero-out that may unmap, without the fallback
//!   (`BLKDEV_ZERO_NOFALLBACK`): a WRITE ZEROES the device may implement by deallocating,
//!   and `EOPNOTSUPP` when the device has no WRITE ZEROES (`write_zeroes_max_bytes` 0).
//!   Reads give zeros afterwards. It is our discard passdown: the `BLKDISCARD` ioctl
//!   (REQ_OP_DISCARD, contents undefined afterwards) has no safe wrapper in rustix and this
//!   workspace has no `unsafe`, so passdown asks for "zeros, unmapped if you can" instead,
//!   which a loop device turns into a hole punched in its file and a thin-provisioning-aware
//!   device into an unmap.
//! - `fallocate(PUNCH_HOLE | KEEP_SIZE | NO_HIDE_STALE)`: on the kernels that still accept
//!   it, a real discard (`blkdev_issue_discard`, what `BLKDISCARD` does); later kernels
//!   dropped it from `blkdev_fallocate` and answer `EOPNOTSUPP` (6.18, where this was
//!   tested, does). Passdown tries it first and, once refused, uses the zero-out above.
//!
//! All of these drop the page cache over the range first.
//! - `copy_file_range` refuses block devices (`EINVAL`: regular files only), so copies go
//!   through a buffer.
//!
//! The device's queue limits come from `/sys/dev/block/MAJ:MIN/queue` (a partition's from
//! its disk's): `logical_block_size`, `discard_granularity`, `discard_max_bytes`,
//! `write_zeroes_max_bytes`. A device that cannot discard (`discard_max_bytes` 0) or has no
//! WRITE ZEROES gets no passdown at all, and the pool says so (an event, and `discard
//! passdown off` in its status), rather than writing zeros over every freed block. A passed
//! down range is trimmed to whole discard granules.
//!
//! `O_DIRECT` (`direct_io`): reads and writes whose offset and length are multiples of the
//! logical block size go to the device without the page cache, through a per-thread buffer
//! aligned to 4 KiB when the caller's is not; the rest (a client's unaligned bytes) go
//! through a second, buffered descriptor of the same device, which Linux keeps coherent
//! with the direct one (a direct read writes back dirty cached pages of its range first, a
//! direct write drops them). It helps when the clients cache themselves (a VM guest's page
//! cache, a file system on the volume): the host then does not keep a second copy and has
//! no dirty data of its own to write back at a flush. It costs the read-ahead and caching
//! of the host for small reads (`docs/performance.md`).
//!
//! On open: `Pool::open` looks for `devices.json` first. The sizes come from the devices
//! (a seek to the end), so a grown data device is noticed by `grow_data`, `create --grow` and
//! the next open. `docs/lvm.md` moves pools to and from the kernel; `docs/scale-out.md` covers
//! replicated devices and fencing.

use crate::engine::catalog::{Catalog, CatalogStore};
use crate::engine::catalog_dir::DirCatalog;
use crate::engine::data_device::DataDevice;
use crate::engine::index::INDEX_DATA_BLOCK_MAX;
use crate::engine::layout::DEVICES_FILE;
use crate::engine::options::PoolOptions;
use crate::error::{io_error, Error, Result};
use crate::format::metadata::PoolMetadata;
use persistent_data::space_map::METADATA_BLOCKS_MAX;
use persistent_data::{BlockDevice, FileDevice};
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod data;
mod identity;
pub use data::{BlockDataDevice, QueueLimits};
pub use identity::{lock_backing_file, DeviceIdentity};

/// The devices of a pool on block devices, as stored in `devices.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DevicePaths {
    /// Format version of the file (1).
    pub version: u32,
    /// The metadata device (followed if it is a link, as `/dev/vg/lv` is).
    pub metadata_device: PathBuf,
    /// The data device.
    pub data_device: PathBuf,
    /// Open the data device with `O_DIRECT`.
    #[serde(default)]
    pub direct_io: bool,
    /// What identifies the metadata device (`DeviceIdentity`); recorded at create, or at
    /// the first read-write open of a pool recorded before identities were.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata_identity: Option<DeviceIdentity>,
    /// What identifies the data device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_identity: Option<DeviceIdentity>,
}

impl DevicePaths {
    /// Devices for a new pool directory.
    pub fn new(metadata_device: &Path, data_device: &Path, direct_io: bool) -> DevicePaths {
        DevicePaths {
            version: 1,
            metadata_device: metadata_device.to_path_buf(),
            data_device: data_device.to_path_buf(),
            direct_io,
            metadata_identity: None,
            data_identity: None,
        }
    }

    /// Reads `DIR/devices.json`; `None` for a pool on files (no such file). A link in its
    /// place is refused.
    pub fn load(dir: &Path) -> Result<Option<DevicePaths>> {
        let path = dir.join(DEVICES_FILE);
        let mut text = String::new();
        let opened = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path);
        match opened {
            Ok(mut file) => file
                .read_to_string(&mut text)
                .map_err(io_error(format!("reading {}", path.display())))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_error(format!("opening {}", path.display()))(e)),
        };
        let devices: DevicePaths = serde_json::from_str(&text)
            .map_err(|e| Error::Corrupt(format!("{}: {e}", path.display())))?;
        if devices.version != 1 {
            return Err(Error::UnsupportedVersion {
                path: path.display().to_string(),
                version: devices.version,
            });
        }
        Ok(Some(devices))
    }

    /// Writes `DIR/devices.json` durably (0600, a temporary file synced and renamed, the
    /// directory synced).
    pub fn store(&self, dir: &Path) -> Result<()> {
        let path = dir.join(DEVICES_FILE);
        let temporary = dir.join(format!("{DEVICES_FILE}.tmp"));
        let mut text = serde_json::to_string_pretty(self)
            .map_err(|e| Error::Internal(format!("encoding {DEVICES_FILE}: {e}")))?;
        text.push('\n');
        let write = || -> io::Result<()> {
            match std::fs::remove_file(&temporary) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
            let mut file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&temporary)?;
            file.write_all(text.as_bytes())?;
            file.sync_all()?;
            std::fs::rename(&temporary, &path)?;
            File::open(dir)?.sync_all()
        };
        write().map_err(io_error(format!("writing {}", path.display())))
    }
}

/// Opens `path` as a block device with `flags` added, mapping `EBUSY` (another exclusive
/// opener) to [`Error::Locked`].
pub(super) fn open_block_device(path: &Path, writable: bool, flags: i32) -> Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(writable)
        .custom_flags(flags)
        .open(path)
        .map_err(|e| busy_or(path, e))?;
    require_block_device(&file, path)?;
    Ok(file)
}

fn busy_or(path: &Path, e: io::Error) -> Error {
    if e.raw_os_error() == Some(libc::EBUSY) {
        match crate::owner::holders(path) {
            Some(holders) => Error::Locked {
                path: format!(
                    "{} (opened exclusively elsewhere: held by {holders})",
                    path.display()
                ),
            },
            None => Error::Locked {
                path: format!(
                    "{} (opened exclusively elsewhere: another thinpool, a mount or the kernel's device mapper)",
                    path.display()
                ),
            },
        }
    } else {
        io_error(format!("opening {}", path.display()))(e)
    }
}

fn require_block_device(file: &File, path: &Path) -> Result<()> {
    let metadata = file
        .metadata()
        .map_err(io_error(format!("examining {}", path.display())))?;
    if !metadata.file_type().is_block_device() {
        return Err(Error::NotBlockDevice {
            path: path.display().to_string(),
        });
    }
    Ok(())
}

/// Opens the metadata device exclusively (see the module doc).
pub fn open_metadata_device(path: &Path, writable: bool) -> Result<FileDevice> {
    let device = FileDevice::open_exclusive(path, writable).map_err(|e| busy_or(path, e))?;
    require_block_device(device.file(), path)?;
    Ok(device)
}

/// Size in bytes of a block device (seeking to its end: its inode's length is 0).
pub fn device_size_bytes(file: &File) -> io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    let mut handle = file.try_clone()?;
    handle.seek(SeekFrom::End(0))
}

/// The metadata blocks of a metadata device of `size_bytes`: its whole 4 KiB blocks, at
/// most what the format addresses (the rest of a larger device is left unused, as dm-thin
/// does).
pub fn metadata_blocks_of(size_bytes: u64) -> u64 {
    (size_bytes / 4096).min(METADATA_BLOCKS_MAX)
}

/// Whether the first block of `device` holds dm-thin pool metadata (its superblock magic),
/// whatever its state.
pub fn holds_pool_metadata(device: &dyn BlockDevice) -> Result<bool> {
    let mut block = persistent_data::block::zeroed_block();
    if device.block_count() == 0 {
        return Ok(false);
    }
    device
        .read(persistent_data::MetadataBlock::new(0), &mut block)
        .map_err(io_error("reading the metadata superblock".to_string()))?;
    // The magic is the little-endian u64 at byte 32 of the superblock (after csum, flags,
    // blocknr and the uuid).
    let magic = u64::from_le_bytes(block[32..40].try_into().expect("8 bytes"));
    Ok(magic == crate::format::superblock::MAGIC)
}

/// Format a pool on two block devices, recorded in `dir` (`devices.json`, the catalog).
/// Their sizes are the devices' (the metadata device up to the format's limit). A metadata
/// device that already holds pool metadata is refused (`thinpool import` takes such a pool
/// over). Returns the devices for `Pool::create_on_devices` to open, and the lock their
/// aliases share ([`claim`]).
pub(crate) fn create_on_devices(
    dir: &Path,
    devices: &DevicePaths,
    block_size_bytes: u64,
) -> Result<Opened> {
    if crate::engine::layout::pool_exists(dir) {
        return Err(Error::PoolExists {
            path: dir.display().to_string(),
        });
    }
    let metadata = open_metadata_device(&devices.metadata_device, true)?;
    let mut data = BlockDataDevice::open(&devices.data_device, devices.direct_io)?;
    let (devices, lock) = claim(devices, &metadata, &mut data, false)?;
    if holds_pool_metadata(&metadata)? {
        return Err(Error::MetadataExists {
            path: devices.metadata_device.display().to_string(),
        });
    }
    let metadata_blocks = metadata_blocks_of(metadata.block_count() * 4096);
    let data_blocks = check_layout(block_size_bytes, data.size_bytes(), metadata_blocks)?;
    std::fs::create_dir_all(dir).map_err(io_error(format!("creating {}", dir.display())))?;
    let metadata: Arc<dyn BlockDevice> = Arc::new(metadata);
    let md = PoolMetadata::format(
        metadata.clone(),
        (block_size_bytes / 512) as u32,
        data_blocks,
    )?;
    let catalog = DirCatalog::new(dir);
    catalog.store(&Catalog {
        transaction_id: md.transaction_id().get(),
        volumes: vec![],
        partial: Vec::new(),
    })?;
    drop(md);
    // Last: the pool exists once its devices are named.
    devices.store(dir)?;
    Ok((metadata, data, lock))
}

/// Devices opened for a pool, with the lock their aliases share ([`claim`]).
pub(crate) type Opened = (Arc<dyn BlockDevice>, BlockDataDevice, Option<Arc<File>>);

/// The devices `dir` names, opened and checked against the identities recorded; a pool
/// recorded before identities were gets them now (read-write opens only).
pub(crate) fn open_devices(dir: &Path, devices: &DevicePaths, read_only: bool) -> Result<Opened> {
    let metadata = open_metadata_device(&devices.metadata_device, !read_only)?;
    let mut data = BlockDataDevice::open(&devices.data_device, devices.direct_io)?;
    let (claimed, lock) = claim(devices, &metadata, &mut data, true)?;
    if claimed != *devices && !read_only {
        claimed.store(dir)?;
    }
    Ok((Arc::new(metadata), data, lock))
}

/// Checks that the devices open are the ones `devices` recorded (when it recorded their
/// identities: `check`), and takes the locks every alias of them shares: an exclusive
/// `flock` on a loop device's backing file (the metadata device's is returned, to be held
/// as the pool's lock; the data device's is held by the data device). Returns `devices`
/// with the identities found.
fn claim(
    devices: &DevicePaths,
    metadata: &FileDevice,
    data: &mut BlockDataDevice,
    check: bool,
) -> Result<(DevicePaths, Option<Arc<File>>)> {
    let found_metadata = DeviceIdentity::of(metadata.file(), &devices.metadata_device)?;
    let found_data = DeviceIdentity::of(data.file(), &devices.data_device)?;
    for (path, role, recorded, found) in [
        (
            &devices.metadata_device,
            "metadata",
            &devices.metadata_identity,
            &found_metadata,
        ),
        (
            &devices.data_device,
            "data",
            &devices.data_identity,
            &found_data,
        ),
    ] {
        match recorded {
            Some(recorded) if check && !recorded.matches(found) => {
                return Err(identity::not_this_pools(path, role, recorded, found))
            }
            _ => {}
        }
    }
    let lock = found_metadata
        .loop_backing
        .as_ref()
        .map(|backing| identity::lock_backing_file(backing, &devices.metadata_device))
        .transpose()?;
    if let Some(backing) = &found_data.loop_backing {
        let same_file = found_metadata
            .loop_backing
            .as_ref()
            .is_some_and(|other| (other.dev, other.ino) == (backing.dev, backing.ino));
        if !same_file {
            data.hold_lock(identity::lock_backing_file(backing, &devices.data_device)?);
        }
    }
    let mut claimed = devices.clone();
    claimed.metadata_identity = Some(found_metadata);
    claimed.data_identity = Some(found_data);
    Ok((claimed, lock.map(Arc::new)))
}

/// Passdown on `data` unless the device cannot take it: turns `options.discard_passdown`
/// off and returns the event saying why.
pub(crate) fn passdown_refusal(
    data: &BlockDataDevice,
    options: &mut PoolOptions,
) -> Option<String> {
    let refusal = options
        .discard_passdown
        .then(|| data.limits().passdown_refusal())
        .flatten()?;
    options.discard_passdown = false;
    Some(format!(
        "discard passdown off on {}: {refusal}",
        data.path().display()
    ))
}

/// The limits `Pool::create` checks, for devices of given sizes; returns the data blocks.
fn check_layout(block_size: u64, data_bytes: u64, metadata_blocks: u64) -> Result<u64> {
    if !block_size.is_multiple_of(512)
        || !crate::format::superblock::valid_data_block_size(
            (block_size / 512).try_into().unwrap_or(0),
        )
    {
        return Err(Error::BadBlockSize { bytes: block_size });
    }
    let data_blocks = (data_bytes / block_size).min(INDEX_DATA_BLOCK_MAX + 1);
    if data_blocks == 0 {
        return Err(Error::DataSmallerThanBlock {
            data_bytes,
            block_size_bytes: block_size,
        });
    }
    crate::engine::limits::check_metadata_room(metadata_blocks, data_blocks)?;
    Ok(data_blocks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_round_trip_and_a_link_is_refused() {
        let dir = std::env::temp_dir().join(format!("tp-devices-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(DevicePaths::load(&dir).unwrap(), None);
        let devices = DevicePaths::new(Path::new("/dev/loop7"), Path::new("/dev/loop8"), true);
        devices.store(&dir).unwrap();
        assert_eq!(DevicePaths::load(&dir).unwrap(), Some(devices));
        std::fs::remove_file(dir.join(DEVICES_FILE)).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", dir.join(DEVICES_FILE)).unwrap();
        assert!(DevicePaths::load(&dir).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_regular_file_is_not_taken_for_a_block_device() {
        let dir = std::env::temp_dir().join(format!("tp-notblock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("data");
        std::fs::write(&file, vec![0u8; 1 << 20]).unwrap();
        let error = BlockDataDevice::open(&file, false).unwrap_err();
        assert!(error.to_string().contains("not a block device"), "{error}");
        assert!(open_metadata_device(&file, true).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn passdown_is_off_unless_the_device_discards_and_zeroes() {
        let limits = |discard_max_bytes, write_zeroes_max_bytes| QueueLimits {
            logical_block_bytes: 512,
            discard_granularity_bytes: 4096,
            discard_max_bytes,
            write_zeroes_max_bytes,
        };
        assert_eq!(limits(1 << 30, 1 << 30).passdown_refusal(), None);
        let cannot = limits(0, 1 << 30).passdown_refusal().unwrap();
        assert!(cannot.contains("cannot discard"), "{cannot}");
        assert!(limits(1 << 30, 0).passdown_refusal().is_some());
    }

    #[test]
    fn layouts_are_checked_before_anything_is_written() {
        assert!(check_layout(65536, 1 << 30, 1024).is_ok());
        assert!(check_layout(4096, 1 << 30, 1024).is_err());
        assert!(check_layout(65536, 1000, 1024).is_err());
        assert!(check_layout(65536, 1 << 30, 10).is_err());
        // 2^30 blocks need far more than 100 metadata blocks of space map.
        assert!(check_layout(65536, 1 << 46, 100).is_err());
    }
}
