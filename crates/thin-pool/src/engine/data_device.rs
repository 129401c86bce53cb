//! The data device: where volume contents live, addressed in bytes.
//!
//! The engine needs more than read and write: zeroing a range cheaply (so a 4 KiB first
//! write into a 64 KiB block does not write 64 KiB), discarding, and copying between blocks
//! (to break sharing). [`FileDataDevice`] uses what Linux offers: `fallocate` zero-range or
//! punch-hole (on a block device these become the kernel's zero-out and discard), and
//! `copy_file_range`; each falls back to plain writes when the file system refuses.
//!
//! All methods take `&self` and are called from many threads at once.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::RwLock;

/// Counters of what reached the data device, for benchmarks and tests.
#[derive(Debug, Default)]
pub struct DataCounters {
    /// Bytes written with `write_at` (including zero-filling fallbacks).
    pub written_bytes: AtomicU64,
    /// Bytes zeroed or discarded without writing (fallocate).
    pub zeroed_bytes: AtomicU64,
    /// Bytes copied by the device (copy_file_range), not through our buffers.
    pub copied_bytes: AtomicU64,
    /// Flushes.
    pub flushes: AtomicU64,
}

impl DataCounters {
    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.written_bytes.load(Ordering::Relaxed)
    }
}

/// A byte-addressed device holding volume data.
///
/// Contract: a completed write is visible to later reads and durable after the next `flush`
/// returns. `zero` leaves the range reading as zeros; `discard` may leave anything (callers
/// only discard blocks nobody references). Ranges are inside `0..size_bytes()`.
pub trait DataDevice: Send + Sync {
    /// Size in bytes.
    fn size_bytes(&self) -> u64;
    /// Read exactly `buf.len()` bytes at `offset`.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Write all of `data` at `offset`.
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()>;
    /// Make `len` bytes at `offset` read as zeros, as cheaply as the device allows.
    fn zero(&self, offset: u64, len: u64) -> io::Result<()>;
    /// Tell the device `len` bytes at `offset` are unused.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()>;
    /// Copy `len` bytes from `from` to `to` (non-overlapping).
    fn copy(&self, from: u64, to: u64, len: u64) -> io::Result<()>;
    /// Make every completed write durable.
    fn flush(&self) -> io::Result<()>;
    /// What reached the device.
    fn counters(&self) -> &DataCounters;
    /// The file holding the device's bytes at the same offsets, opened for reading without
    /// `O_DIRECT`, for a front end that reads lent ranges itself (`Volume::read_lent`);
    /// `None` (the default) when there is none, as for a memory device.
    fn file(&self) -> Option<&File> {
        None
    }
    /// Re-read the size after the device grew. Returns the new size.
    fn refresh_size(&self) -> io::Result<u64> {
        Ok(self.size_bytes())
    }
    /// Grow to at least `size_bytes` if the device can (a regular file is extended), or
    /// notice that it grew. Returns the size now. Never shrinks.
    fn grow_to(&self, size_bytes: u64) -> io::Result<u64> {
        let _ = size_bytes;
        self.refresh_size()
    }
}

const ZERO_CHUNK: usize = 1 << 20;

/// `offset..offset+len` inside a device of `size` bytes, or `InvalidInput`.
fn check_range(offset: u64, len: u64, size: u64) -> io::Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("data range {offset}+{len} outside the data device ({size} bytes)"),
        )),
    }
}

/// Whether `from..from+len` and `to..to+len` are disjoint (what `copy` requires).
fn non_overlapping(from: u64, to: u64, len: u64) -> bool {
    from.saturating_add(len) <= to || to.saturating_add(len) <= from || len == 0
}

/// Write zeros with plain writes (the fallback).
fn write_zeros(device: &dyn DataDevice, offset: u64, len: u64) -> io::Result<()> {
    let zeros = vec![0u8; ZERO_CHUNK.min(len as usize)];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(zeros.len() as u64) as usize;
        device.write_at(offset + done, &zeros[..n])?;
        done += n as u64;
    }
    Ok(())
}

/// A data device on a file (sparse is fine) or a block device.
#[derive(Debug)]
pub struct FileDataDevice {
    file: File,
    path: PathBuf,
    size_bytes: AtomicU64,
    zero_range_works: AtomicBool,
    punch_hole_works: AtomicBool,
    copy_range_works: AtomicBool,
    counters: DataCounters,
    /// Serializes size refreshes with nothing on the I/O path (only `refresh_size` writes).
    resize: RwLock<()>,
}

impl FileDataDevice {
    /// Open an existing file or block device read-write. A symbolic link at `path` is
    /// refused, not followed (another user who could plant one must not choose the file).
    pub fn open(path: &Path) -> io::Result<FileDataDevice> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .open(path)?;
        let size = device_size(&file)?;
        Ok(FileDataDevice::with_file(file, path, size))
    }

    /// A data device on a file the caller opened read-write (e.g. relative to a directory
    /// it holds open); `path` names it in messages.
    pub fn from_file(file: File, path: &Path) -> io::Result<FileDataDevice> {
        let size = device_size(&file)?;
        Ok(FileDataDevice::with_file(file, path, size))
    }

    /// Create a new sparse file of `size_bytes`, private to its owner (mode 0600). Fails if
    /// anything, a file or a symbolic link, is already at `path`: nothing is truncated.
    pub fn create(path: &Path, size_bytes: u64) -> io::Result<FileDataDevice> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .open(path)?;
        file.set_len(size_bytes)?;
        Ok(FileDataDevice::with_file(file, path, size_bytes))
    }

    fn with_file(file: File, path: &Path, size: u64) -> FileDataDevice {
        FileDataDevice {
            file,
            path: path.to_path_buf(),
            size_bytes: AtomicU64::new(size),
            zero_range_works: AtomicBool::new(true),
            punch_hole_works: AtomicBool::new(true),
            copy_range_works: AtomicBool::new(true),
            counters: DataCounters::default(),
            resize: RwLock::new(()),
        }
    }

    /// `fallocate(flags | KEEP_SIZE)` unless the file system said it cannot (remembered in
    /// `works`). Ok(false): not supported, use a fallback.
    fn try_fallocate(
        &self,
        flags: rustix::fs::FallocateFlags,
        works: &AtomicBool,
        offset: u64,
        len: u64,
    ) -> io::Result<bool> {
        if !works.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let flags = flags | rustix::fs::FallocateFlags::KEEP_SIZE;
        match rustix::fs::fallocate(&self.file, flags, offset, len) {
            Ok(()) => Ok(true),
            Err(e) if unsupported(&e.into()) => {
                works.store(false, Ordering::Relaxed);
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The path opened.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Grow a regular file to `size_bytes` (never shrinks), and sync the new length before
    /// the pool's metadata can name a block in it.
    pub fn grow_file(&self, size_bytes: u64) -> io::Result<()> {
        let _guard = self.resize.write().unwrap_or_else(|e| e.into_inner());
        if size_bytes > self.size_bytes.load(Ordering::Acquire) {
            self.file.set_len(size_bytes)?;
            self.file.sync_all()?;
            self.size_bytes.store(size_bytes, Ordering::Release);
        }
        Ok(())
    }
}

fn device_size(file: &File) -> io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    let meta = file.metadata()?;
    if meta.is_file() {
        return Ok(meta.len());
    }
    let mut handle = file.try_clone()?;
    handle.seek(SeekFrom::End(0))
}

fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(code) if code == rustix::io::Errno::OPNOTSUPP.raw_os_error()
            || code == rustix::io::Errno::NOSYS.raw_os_error()
            || code == rustix::io::Errno::INVAL.raw_os_error()
            || code == rustix::io::Errno::XDEV.raw_os_error()
    )
}

impl DataDevice for FileDataDevice {
    fn size_bytes(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }

    fn file(&self) -> Option<&File> {
        Some(&self.file)
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        check_range(offset, buf.len() as u64, self.size_bytes())?;
        self.file.read_exact_at(buf, offset)?;
        Ok(())
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        check_range(offset, data.len() as u64, self.size_bytes())?;
        self.file.write_all_at(data, offset)?;
        self.counters
            .written_bytes
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn zero(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(offset, len, self.size_bytes())?;
        if len == 0 {
            return Ok(());
        }
        use rustix::fs::FallocateFlags;
        for (flags, works) in [
            (FallocateFlags::ZERO_RANGE, &self.zero_range_works),
            (FallocateFlags::PUNCH_HOLE, &self.punch_hole_works),
        ] {
            if self.try_fallocate(flags, works, offset, len)? {
                self.counters.zeroed_bytes.fetch_add(len, Ordering::Relaxed);
                return Ok(());
            }
        }
        write_zeros(self, offset, len)
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(offset, len, self.size_bytes())?;
        if len > 0 {
            let flags = rustix::fs::FallocateFlags::PUNCH_HOLE;
            self.try_fallocate(flags, &self.punch_hole_works, offset, len)?;
        }
        Ok(())
    }

    fn copy(&self, from: u64, to: u64, len: u64) -> io::Result<()> {
        assert!(
            non_overlapping(from, to, len),
            "copy {from}->{to} of {len} overlaps"
        );
        let size = self.size_bytes();
        check_range(from, len, size)?;
        check_range(to, len, size)?;
        if self.copy_range_works.load(Ordering::Relaxed) {
            let (mut src, mut dst, mut left) = (from, to, len);
            while left > 0 {
                let chunk = left.min(1 << 30) as usize;
                match rustix::fs::copy_file_range(
                    &self.file,
                    Some(&mut src),
                    &self.file,
                    Some(&mut dst),
                    chunk,
                ) {
                    Ok(0) => break,
                    Ok(n) => left -= n as u64,
                    Err(e) if unsupported(&e.into()) && left == len => {
                        self.copy_range_works.store(false, Ordering::Relaxed);
                        break;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            if left == 0 {
                self.counters.copied_bytes.fetch_add(len, Ordering::Relaxed);
                return Ok(());
            }
            if left < len {
                // Partly copied: finish with buffers.
                return copy_with_buffer(self, from + (len - left), to + (len - left), left);
            }
        }
        copy_with_buffer(self, from, to, len)
    }

    fn flush(&self) -> io::Result<()> {
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        rustix::fs::fdatasync(&self.file).map_err(io::Error::from)
    }

    fn counters(&self) -> &DataCounters {
        &self.counters
    }

    fn refresh_size(&self) -> io::Result<u64> {
        let _guard = self.resize.write().unwrap_or_else(|e| e.into_inner());
        let size = device_size(&self.file)?;
        self.size_bytes.store(size, Ordering::Release);
        Ok(size)
    }

    fn grow_to(&self, size_bytes: u64) -> io::Result<u64> {
        let before = self.size_bytes();
        if self.file.metadata()?.is_file() {
            self.grow_file(size_bytes)?;
        }
        let after = self.refresh_size()?;
        debug_assert!(after >= before, "a data device never shrinks");
        Ok(after)
    }
}

fn copy_with_buffer(device: &dyn DataDevice, from: u64, to: u64, len: u64) -> io::Result<()> {
    let mut buf = vec![0u8; ZERO_CHUNK.min(len as usize)];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(buf.len() as u64) as usize;
        device.read_at(from + done, &mut buf[..n])?;
        device.write_at(to + done, &buf[..n])?;
        done += n as u64;
    }
    Ok(())
}

/// A data device in memory (for tests): a vector of bytes behind a lock.
#[derive(Debug)]
pub struct MemoryDataDevice {
    bytes: RwLock<Vec<u8>>,
    counters: DataCounters,
}

impl MemoryDataDevice {
    /// A zero-filled device of `size_bytes`.
    pub fn new(size_bytes: u64) -> MemoryDataDevice {
        MemoryDataDevice {
            bytes: RwLock::new(vec![0; size_bytes as usize]),
            counters: DataCounters::default(),
        }
    }

    /// Grow to `size_bytes`.
    pub fn grow(&self, size_bytes: u64) {
        let mut bytes = self.bytes.write().unwrap_or_else(|e| e.into_inner());
        if size_bytes as usize > bytes.len() {
            bytes.resize(size_bytes as usize, 0);
        }
    }

    /// A copy of the contents.
    pub fn contents(&self) -> Vec<u8> {
        self.bytes.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl DataDevice for MemoryDataDevice {
    fn size_bytes(&self) -> u64 {
        self.bytes.read().unwrap_or_else(|e| e.into_inner()).len() as u64
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let bytes = self.bytes.read().unwrap_or_else(|e| e.into_inner());
        check_range(offset, buf.len() as u64, bytes.len() as u64)?;
        buf.copy_from_slice(&bytes[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut bytes = self.bytes.write().unwrap_or_else(|e| e.into_inner());
        check_range(offset, data.len() as u64, bytes.len() as u64)?;
        bytes[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        self.counters
            .written_bytes
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }
    fn zero(&self, offset: u64, len: u64) -> io::Result<()> {
        let mut bytes = self.bytes.write().unwrap_or_else(|e| e.into_inner());
        check_range(offset, len, bytes.len() as u64)?;
        bytes[offset as usize..(offset + len) as usize].fill(0);
        self.counters.zeroed_bytes.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(offset, len, self.size_bytes())
    }
    fn copy(&self, from: u64, to: u64, len: u64) -> io::Result<()> {
        assert!(
            non_overlapping(from, to, len),
            "copy {from}->{to} of {len} overlaps"
        );
        let mut bytes = self.bytes.write().unwrap_or_else(|e| e.into_inner());
        check_range(from, len, bytes.len() as u64)?;
        check_range(to, len, bytes.len() as u64)?;
        bytes.copy_within(from as usize..(from + len) as usize, to as usize);
        self.counters.copied_bytes.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    fn counters(&self) -> &DataCounters {
        &self.counters
    }
    fn grow_to(&self, size_bytes: u64) -> io::Result<u64> {
        self.grow(size_bytes);
        Ok(self.size_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conformance(device: &dyn DataDevice) {
        let block = vec![0xabu8; 65536];
        device.write_at(65536, &block).unwrap();
        device.zero(65536 + 4096, 8192).unwrap();
        let mut buf = vec![0u8; 65536];
        device.read_at(65536, &mut buf).unwrap();
        assert!(buf[..4096].iter().all(|&b| b == 0xab));
        assert!(buf[4096..12288].iter().all(|&b| b == 0));
        assert!(buf[12288..].iter().all(|&b| b == 0xab));
        device.copy(65536, 3 * 65536, 65536).unwrap();
        let mut copy = vec![0u8; 65536];
        device.read_at(3 * 65536, &mut copy).unwrap();
        assert_eq!(copy, buf);
        device.flush().unwrap();
        assert!(device.read_at(device.size_bytes() - 10, &mut buf).is_err());
    }

    #[test]
    fn memory_data_device_conforms() {
        conformance(&MemoryDataDevice::new(8 * 65536));
    }

    #[test]
    fn file_data_device_conforms() {
        let dir = std::env::temp_dir().join(format!("tp-data-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let device = FileDataDevice::create(&dir.join("data"), 8 * 65536).unwrap();
        conformance(&device);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn data_files_are_private_and_never_reached_through_links() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("tp-data-link-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        let link = dir.join("data");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        assert!(FileDataDevice::create(&link, 65536).is_err());
        assert!(FileDataDevice::open(&link).is_err());
        // An existing file is not truncated either.
        assert!(FileDataDevice::create(&victim, 65536).is_err());
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        let fresh = FileDataDevice::create(&dir.join("fresh"), 65536).unwrap();
        let mode = std::fs::metadata(dir.join("fresh"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        drop(fresh);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
