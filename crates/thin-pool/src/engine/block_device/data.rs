//! The data device of a pool on a block device: opened exclusively, its size the device's,
//! zeroing by zero-out, passdown by discard granule (or none), optional `O_DIRECT` with
//! aligned buffers. What each call does on Linux is in the parent module's doc.

use super::{device_size_bytes, open_block_device};
use crate::engine::data_device::{DataCounters, DataDevice};
use crate::error::io_error;
use crate::error::Result;
use std::cell::RefCell;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Alignment of the buffers handed to `O_DIRECT` reads and writes (a page: more than any
/// logical block size Linux allows).
const DIRECT_ALIGN_BYTES: usize = 4096;

/// Chunk for writing zeros and copying through a buffer.
const CHUNK_BYTES: u64 = 1 << 20;

/// A block device's queue limits, from sysfs (all 0 when sysfs does not say).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueLimits {
    /// The smallest unit the device addresses (512 or 4096).
    pub logical_block_bytes: u64,
    /// The unit discards are done in (0: cannot discard).
    pub discard_granularity_bytes: u64,
    /// The largest discard (0: cannot discard).
    pub discard_max_bytes: u64,
    /// The largest WRITE ZEROES (0: none; zeroing falls back to writes).
    pub write_zeroes_max_bytes: u64,
}

impl QueueLimits {
    /// The limits of the block device open as `file`.
    pub fn of(file: &File) -> io::Result<QueueLimits> {
        let stat = rustix::fs::fstat(file)?;
        let (major, minor) = (
            rustix::fs::major(stat.st_rdev),
            rustix::fs::minor(stat.st_rdev),
        );
        let device = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
        // A partition has no queue of its own: its disk's is one level up.
        let queue = [device.join("queue"), device.join("../queue")]
            .into_iter()
            .find(|q| q.is_dir());
        let read = |name: &str| -> u64 {
            queue
                .as_ref()
                .and_then(|q| std::fs::read_to_string(q.join(name)).ok())
                .and_then(|text| text.trim().parse().ok())
                .unwrap_or(0)
        };
        let logical = match rustix::fs::ioctl_blksszget(file) {
            Ok(bytes) => u64::from(bytes),
            Err(_) => read("logical_block_size"),
        };
        Ok(QueueLimits {
            logical_block_bytes: logical.max(512),
            discard_granularity_bytes: read("discard_granularity"),
            discard_max_bytes: read("discard_max_bytes"),
            write_zeroes_max_bytes: read("write_zeroes_max_bytes"),
        })
    }

    /// Why discard passdown cannot be done on this device, if it cannot.
    pub fn passdown_refusal(&self) -> Option<String> {
        if self.discard_max_bytes == 0 {
            Some("the device cannot discard (discard_max_bytes 0)".to_string())
        } else if self.write_zeroes_max_bytes == 0 {
            Some(
                "the device has no WRITE ZEROES (write_zeroes_max_bytes 0), which passdown \
                 uses to unmap"
                    .to_string(),
            )
        } else {
            None
        }
    }
}

thread_local! {
    /// Each thread's aligned buffer for `O_DIRECT` transfers (grown as needed, kept).
    static BOUNCE: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on an `len`-byte slice aligned to [`DIRECT_ALIGN_BYTES`], from this thread's
/// buffer.
fn with_aligned<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    BOUNCE.with(|cell| {
        let mut storage = cell.borrow_mut();
        if storage.len() < len + DIRECT_ALIGN_BYTES {
            storage.resize(len + DIRECT_ALIGN_BYTES, 0);
        }
        let start = storage.as_ptr().align_offset(DIRECT_ALIGN_BYTES);
        let start = if start < DIRECT_ALIGN_BYTES { start } else { 0 };
        f(&mut storage[start..start + len])
    })
}

fn is_aligned(buf: &[u8]) -> bool {
    (buf.as_ptr() as usize).is_multiple_of(DIRECT_ALIGN_BYTES)
}

/// The data device of a pool on a block device: opened exclusively, its size the device's,
/// zeroing and passdown as the module doc says, optionally `O_DIRECT`.
#[derive(Debug)]
pub struct BlockDataDevice {
    /// The exclusive descriptor (`O_DIRECT` when direct I/O is on).
    file: File,
    /// With direct I/O: a buffered descriptor for unaligned transfers and `fallocate`.
    buffered: Option<File>,
    path: PathBuf,
    size_bytes: AtomicU64,
    limits: QueueLimits,
    zero_range_works: AtomicBool,
    passdown_works: AtomicBool,
    /// `NO_HIDE_STALE` (a real discard) not refused yet.
    discard_works: AtomicBool,
    counters: DataCounters,
    /// The `flock` on a loop device's backing file, shared by its aliases (see
    /// `identity.rs`), held while the device is open.
    backing_lock: Option<File>,
}

impl BlockDataDevice {
    /// Opens the block device at `path` read-write and exclusively, with `O_DIRECT` if
    /// `direct_io`.
    pub fn open(path: &Path, direct_io: bool) -> Result<BlockDataDevice> {
        let flags = libc::O_EXCL | if direct_io { libc::O_DIRECT } else { 0 };
        let file = open_block_device(path, true, flags)?;
        let buffered = if direct_io {
            Some(open_block_device(path, true, 0)?)
        } else {
            None
        };
        let size =
            device_size_bytes(&file).map_err(io_error(format!("sizing {}", path.display())))?;
        let limits =
            QueueLimits::of(&file).map_err(io_error(format!("examining {}", path.display())))?;
        Ok(BlockDataDevice {
            file,
            buffered,
            path: path.to_path_buf(),
            size_bytes: AtomicU64::new(size),
            passdown_works: AtomicBool::new(limits.passdown_refusal().is_none()),
            limits,
            zero_range_works: AtomicBool::new(true),
            discard_works: AtomicBool::new(true),
            counters: DataCounters::default(),
            backing_lock: None,
        })
    }

    /// The exclusive descriptor, e.g. to identify the device.
    pub(super) fn file(&self) -> &File {
        &self.file
    }

    /// Holds `lock` (a backing file's `flock`) as long as the device is open.
    pub(super) fn hold_lock(&mut self, lock: File) {
        self.backing_lock = Some(lock);
    }

    /// The device's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The device's queue limits.
    pub fn limits(&self) -> QueueLimits {
        self.limits
    }

    /// Whether discards reach the device.
    pub fn passes_down(&self) -> bool {
        self.passdown_works.load(Ordering::Relaxed)
    }

    /// Whether the data device was opened with `O_DIRECT`.
    pub fn direct_io(&self) -> bool {
        self.buffered.is_some()
    }

    /// The descriptor for buffered transfers and `fallocate`.
    fn buffered(&self) -> &File {
        self.buffered.as_ref().unwrap_or(&self.file)
    }

    /// Whether a transfer of `len` bytes at `offset` can go direct.
    fn direct_fits(&self, offset: u64, len: usize) -> bool {
        let unit = self.limits.logical_block_bytes;
        self.buffered.is_some() && offset.is_multiple_of(unit) && (len as u64).is_multiple_of(unit)
    }

    fn check_range(&self, offset: u64, len: u64) -> io::Result<()> {
        let size = self.size_bytes();
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("data range {offset}+{len} outside the data device ({size} bytes)"),
            )),
        }
    }

    /// Writes zeros with plain writes.
    fn write_zeros(&self, offset: u64, len: u64) -> io::Result<()> {
        let zeros = vec![0u8; CHUNK_BYTES.min(len) as usize];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(zeros.len() as u64) as usize;
            self.write_at(offset + done, &zeros[..n])?;
            done += n as u64;
        }
        Ok(())
    }
}

fn refused(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(code) if code == libc::EOPNOTSUPP || code == libc::EINVAL || code == libc::ENOSYS)
}

impl DataDevice for BlockDataDevice {
    fn size_bytes(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        if !self.direct_fits(offset, buf.len()) {
            return self.buffered().read_exact_at(buf, offset);
        }
        if is_aligned(buf) {
            return self.file.read_exact_at(buf, offset);
        }
        with_aligned(buf.len(), |bounce| {
            self.file.read_exact_at(bounce, offset)?;
            buf.copy_from_slice(bounce);
            Ok(())
        })
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.check_range(offset, data.len() as u64)?;
        if !self.direct_fits(offset, data.len()) {
            self.buffered().write_all_at(data, offset)?;
        } else if is_aligned(data) {
            self.file.write_all_at(data, offset)?;
        } else {
            with_aligned(data.len(), |bounce| {
                bounce.copy_from_slice(data);
                self.file.write_all_at(bounce, offset)
            })?;
        }
        self.counters
            .written_bytes
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// The whole logical blocks of the range are zeroed by the device (`ZERO_RANGE`, i.e.
    /// zero-out), the unaligned edges by writes.
    fn zero(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check_range(offset, len)?;
        let unit = self.limits.logical_block_bytes;
        let end = offset + len;
        let (start_aligned, end_aligned) = (offset.next_multiple_of(unit), end / unit * unit);
        if start_aligned >= end_aligned || !self.zero_range_works.load(Ordering::Relaxed) {
            return self.write_zeros(offset, len);
        }
        let flags = rustix::fs::FallocateFlags::ZERO_RANGE | rustix::fs::FallocateFlags::KEEP_SIZE;
        match rustix::fs::fallocate(
            self.buffered(),
            flags,
            start_aligned,
            end_aligned - start_aligned,
        ) {
            Ok(()) => {
                self.counters
                    .zeroed_bytes
                    .fetch_add(end_aligned - start_aligned, Ordering::Relaxed);
            }
            Err(e) if refused(&e.into()) => {
                self.zero_range_works.store(false, Ordering::Relaxed);
                return self.write_zeros(offset, len);
            }
            Err(e) => return Err(e.into()),
        }
        self.write_zeros(offset, start_aligned - offset)?;
        self.write_zeros(end_aligned, end - end_aligned)
    }

    /// Passdown (see the module doc): the whole discard granules of the range, as a zero-out
    /// that may unmap; nothing on a device that cannot.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check_range(offset, len)?;
        if !self.passdown_works.load(Ordering::Relaxed) {
            return Ok(());
        }
        let unit = self
            .limits
            .discard_granularity_bytes
            .max(self.limits.logical_block_bytes);
        let (start, end) = (offset.next_multiple_of(unit), (offset + len) / unit * unit);
        if start >= end {
            return Ok(());
        }
        use rustix::fs::FallocateFlags;
        let flags = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
        if self.discard_works.load(Ordering::Relaxed) {
            let discard = flags | FallocateFlags::NO_HIDE_STALE;
            match rustix::fs::fallocate(self.buffered(), discard, start, end - start) {
                Ok(()) => return Ok(()),
                Err(e) if refused(&e.into()) => self.discard_works.store(false, Ordering::Relaxed),
                Err(e) => return Err(e.into()),
            }
        }
        match rustix::fs::fallocate(self.buffered(), flags, start, end - start) {
            Ok(()) => Ok(()),
            Err(e) if refused(&e.into()) => {
                self.passdown_works.store(false, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    fn copy(&self, from: u64, to: u64, len: u64) -> io::Result<()> {
        self.check_range(from, len)?;
        self.check_range(to, len)?;
        let mut buf = vec![0u8; CHUNK_BYTES.min(len) as usize];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(buf.len() as u64) as usize;
            self.read_at(from + done, &mut buf[..n])?;
            self.write_at(to + done, &buf[..n])?;
            done += n as u64;
        }
        Ok(())
    }

    /// `fdatasync` of the device: writes back its page cache (every descriptor of a block
    /// device shares it) and flushes the device's cache.
    fn flush(&self) -> io::Result<()> {
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        rustix::fs::fdatasync(self.buffered()).map_err(io::Error::from)
    }

    fn counters(&self) -> &DataCounters {
        &self.counters
    }

    /// The device's size now (after `losetup -c`, `lvextend`, a grown RBD image...).
    fn refresh_size(&self) -> io::Result<u64> {
        let size = device_size_bytes(&self.file)?;
        self.size_bytes.store(size, Ordering::Release);
        Ok(size)
    }
}
