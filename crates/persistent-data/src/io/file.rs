//! A metadata device backed by a regular file or a block device.

use super::{out_of_range, BlockDevice};
use crate::block::{Block, MetadataBlock, BLOCK_SIZE};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A file (or block device) of metadata blocks, accessed with positional I/O so that any
/// number of threads may use it at once. `flush` is `fdatasync`.
#[derive(Debug)]
pub struct FileDevice {
    file: File,
    path: PathBuf,
    block_count: AtomicU64,
}

impl FileDevice {
    /// Open an existing file or block device. Its size, rounded down to whole blocks, is the
    /// device size. With `writable` false every write fails.
    pub fn open(path: &Path, writable: bool) -> io::Result<FileDevice> {
        FileDevice::open_with(path, writable, 0)
    }

    /// [`FileDevice::open`], refusing a symbolic link at `path` instead of following it (for
    /// files a program owns, such as a pool directory's `metadata`: a link planted there
    /// must not redirect its writes). User-named devices (`/dev/vg/lv` is a link) use `open`.
    pub fn open_no_follow(path: &Path, writable: bool) -> io::Result<FileDevice> {
        FileDevice::open_with(path, writable, libc::O_NOFOLLOW)
    }

    /// [`FileDevice::open`] for a block device, opened exclusively (`O_EXCL`): while it is
    /// open, Linux refuses every other exclusive opener of the device (another thinpool, a
    /// mount, the device mapper's dm-thin) with `EBUSY`. Plain opens (`blkid`, a
    /// `thin_check` run by hand) are not refused; the claim is this machine's only.
    pub fn open_exclusive(path: &Path, writable: bool) -> io::Result<FileDevice> {
        FileDevice::open_with(path, writable, libc::O_EXCL)
    }

    /// A device on a file the caller opened (e.g. relative to a directory it holds open);
    /// `path` names it in messages.
    pub fn from_file(file: File, path: &Path) -> io::Result<FileDevice> {
        let size_bytes = device_size_bytes(&file)?;
        Ok(FileDevice {
            file,
            path: path.to_path_buf(),
            block_count: AtomicU64::new(size_bytes / BLOCK_SIZE as u64),
        })
    }

    fn open_with(path: &Path, writable: bool, flags: i32) -> io::Result<FileDevice> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = OpenOptions::new()
            .read(true)
            .write(writable)
            .custom_flags(flags)
            .open(path)?;
        let size_bytes = device_size_bytes(&file)?;
        Ok(FileDevice {
            file,
            path: path.to_path_buf(),
            block_count: AtomicU64::new(size_bytes / BLOCK_SIZE as u64),
        })
    }

    /// Create (or truncate) a regular file of `block_count` blocks, preallocated (see
    /// `preallocate`: a host ENOSPC fails the create, not a later commit). A new file is
    /// private to its owner (mode 0600); a symbolic link at `path` is refused, not followed.
    pub fn create(path: &Path, block_count: u64) -> io::Result<FileDevice> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)?;
        file.set_len(block_count * BLOCK_SIZE as u64)?;
        preallocate(&file, 0, block_count * BLOCK_SIZE as u64)?;
        Ok(FileDevice {
            file,
            path: path.to_path_buf(),
            block_count: AtomicU64::new(block_count),
        })
    }

    /// The path this device was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The open file, e.g. to take a lock on it.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Re-read the size of the underlying file or device (after it was grown).
    pub fn refresh_size(&self) -> io::Result<u64> {
        let blocks = device_size_bytes(&self.file)? / BLOCK_SIZE as u64;
        self.block_count.store(blocks, Ordering::Release);
        Ok(blocks)
    }
}

/// Allocate `len` bytes at `offset` of a regular file on the host file system (fallocate), so
/// that writing them later cannot fail for lack of space. A file system without fallocate
/// leaves the file sparse (no guarantee, no error); a copy-on-write one (btrfs) may still
/// need space on overwrite.
fn preallocate(file: &File, offset: u64, len: u64) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), offset, len) {
        Ok(()) => Ok(()),
        Err(e) if e == rustix::io::Errno::OPNOTSUPP || e == rustix::io::Errno::NOSYS => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Size in bytes of a regular file or a block device (whose metadata length is 0).
fn device_size_bytes(file: &File) -> io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    let meta = file.metadata()?;
    if meta.is_file() {
        return Ok(meta.len());
    }
    // Block devices report their size through seeking to the end.
    let mut handle = file.try_clone()?;
    handle.seek(SeekFrom::End(0))
}

impl BlockDevice for FileDevice {
    fn block_count(&self) -> u64 {
        self.block_count.load(Ordering::Acquire)
    }

    fn read(&self, block: MetadataBlock, buf: &mut Block) -> io::Result<()> {
        let count = self.block_count();
        if block.get() >= count {
            return Err(out_of_range(block, count));
        }
        self.file.read_exact_at(buf, block.byte_offset())
    }

    /// One `preadv` for the whole run (a short read is finished with `pread`s).
    fn read_blocks(&self, first: MetadataBlock, bufs: &mut [&mut Block]) -> io::Result<()> {
        let count = self.block_count();
        let end = first.get().saturating_add(bufs.len() as u64);
        if end > count {
            return Err(out_of_range(MetadataBlock::new(end - 1).max(first), count));
        }
        let total = bufs.len() * BLOCK_SIZE;
        let mut done = 0;
        // Whole runs go in one call, at most IOV_MAX (1024) buffers each.
        for chunk in bufs.chunks_mut(1024) {
            let offset = first.byte_offset() + done as u64;
            let mut slices: Vec<io::IoSliceMut<'_>> = chunk
                .iter_mut()
                .map(|buf| io::IoSliceMut::new(&mut buf[..]))
                .collect();
            let read = loop {
                match rustix::io::preadv(&self.file, &mut slices, offset) {
                    Ok(read) => break read,
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(e) => return Err(e.into()),
                }
            };
            drop(slices);
            let chunk_bytes = chunk.len() * BLOCK_SIZE;
            let mut filled = read;
            while filled < chunk_bytes {
                let (index, within) = (filled / BLOCK_SIZE, filled % BLOCK_SIZE);
                let at = offset + filled as u64;
                self.file.read_exact_at(&mut chunk[index][within..], at)?;
                filled += BLOCK_SIZE - within;
            }
            done += chunk_bytes;
        }
        debug_assert_eq!(done, total);
        Ok(())
    }

    fn write(&self, block: MetadataBlock, buf: &Block) -> io::Result<()> {
        let count = self.block_count();
        if block.get() >= count {
            return Err(out_of_range(block, count));
        }
        self.file.write_all_at(buf, block.byte_offset())
    }

    fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    /// A regular file grows preallocated; on failure (a full host file system) it keeps its
    /// size.
    fn extend_to(&self, block_count: u64) -> io::Result<u64> {
        let old_bytes = self.block_count() * BLOCK_SIZE as u64;
        if self.file.metadata()?.is_file() && block_count > self.block_count() {
            let new_bytes = block_count * BLOCK_SIZE as u64;
            self.file.set_len(new_bytes)?;
            if let Err(e) = preallocate(&self.file, old_bytes, new_bytes - old_bytes) {
                self.file.set_len(old_bytes)?;
                return Err(e);
            }
        }
        self.refresh_size()
    }
}
