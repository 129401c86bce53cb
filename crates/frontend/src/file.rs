//! [`FileTarget`]: a plain file as a [`Target`], byte for byte, no thin mapping: the control
//! that measures what mapping costs through the same front end (the benchmark's raw export
//! over vhost-user-blk, beside the thin volume), and a reference device for tests.
//!
//! Geometry: the file's length rounded down to whole sectors, 4 KiB blocks, discard punches
//! holes (`fallocate(PUNCH_HOLE | KEEP_SIZE)`, whole blocks and partial ones alike: a hole
//! reads as zeroes), block status from `SEEK_DATA`/`SEEK_HOLE`. The size is fixed at open.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rustix::fs::{fallocate, FallocateFlags, SeekFrom};

use crate::{Extent, Geometry, LentPiece, Result, Target, TargetError, ZeroMode, SECTOR_BYTES};

/// The block size a [`FileTarget`] reports (page-sized: what avoids read-modify-write in
/// the page cache).
pub const FILE_BLOCK_BYTES: u64 = 4096;

/// Largest piece [`FileTarget::write_zeroes`] writes at once when it must write zeroes.
const ZERO_CHUNK: usize = 1 << 20;

/// A plain file served as is.
pub struct FileTarget {
    name: String,
    path: PathBuf,
    file: File,
    size_bytes: u64,
    read_only: bool,
}

impl FileTarget {
    /// Opens `path` (read-write unless `read_only`) as device `name`; its length rounded down
    /// to 512 bytes is the device's (at least one sector).
    pub fn open(name: &str, path: &Path, read_only: bool) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .map_err(|e| io_error(format!("opening {}", path.display()), e))?;
        let length = file
            .metadata()
            .map_err(|e| io_error(format!("stat of {}", path.display()), e))?
            .len();
        let size_bytes = length / SECTOR_BYTES * SECTOR_BYTES;
        if size_bytes == 0 {
            return Err(TargetError::new(
                libc::EINVAL,
                format!("{} is {length} bytes: at least 512 needed", path.display()),
            ));
        }
        Ok(FileTarget {
            name: name.to_string(),
            path: path.to_path_buf(),
            file,
            size_bytes,
            read_only,
        })
    }

    /// The file served.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Checks a request: whole sectors inside the device, and writable if `write`.
    fn check(&self, offset: u64, length: u64, write: bool) -> Result<()> {
        if write && self.read_only {
            return Err(TargetError::new(libc::EROFS, "the device is read-only"));
        }
        let inside = offset
            .checked_add(length)
            .is_some_and(|end| end <= self.size_bytes);
        if !inside || !offset.is_multiple_of(SECTOR_BYTES) || !length.is_multiple_of(SECTOR_BYTES) {
            return Err(TargetError::new(
                libc::EINVAL,
                format!(
                    "offset {offset} length {length}: not whole sectors inside {} bytes",
                    self.size_bytes
                ),
            ));
        }
        Ok(())
    }

    fn io(&self, what: String, error: std::io::Error) -> TargetError {
        io_error(format!("{what} on {}", self.path.display()), error)
    }
}

fn io_error(what: String, error: std::io::Error) -> TargetError {
    let errno = error.raw_os_error().filter(|&e| e > 0).unwrap_or(libc::EIO);
    TargetError::new(errno, format!("{what}: {error}"))
}

impl Target for FileTarget {
    fn name(&self) -> &str {
        &self.name
    }

    fn geometry(&self) -> Geometry {
        Geometry {
            size_bytes: self.size_bytes,
            block_size_bytes: FILE_BLOCK_BYTES,
            read_only: self.read_only,
            can_discard: true,
        }
    }

    fn read(&self, offset: u64, buffer: &mut [u8]) -> Result<()> {
        self.check(offset, buffer.len() as u64, false)?;
        self.file
            .read_exact_at(buffer, offset)
            .map_err(|e| self.io(format!("read at {offset} length {}", buffer.len()), e))
    }

    /// The file itself: a plain file's bytes never come to hold other data.
    fn read_lent(
        &self,
        offset: u64,
        length: u64,
        each: &mut dyn FnMut(LentPiece<'_>) -> Result<()>,
    ) -> Result<bool> {
        self.check(offset, length, false)?;
        if length > 0 {
            each(LentPiece::File {
                file: &self.file,
                offset,
                length_bytes: length,
            })?;
        }
        Ok(true)
    }

    /// The file itself, every byte.
    fn write_lent(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        each: &mut dyn FnMut(LentPiece<'_>) -> Result<()>,
    ) -> Result<u64> {
        self.check(offset, length, true)?;
        if length > 0 {
            each(LentPiece::File {
                file: &self.file,
                offset,
                length_bytes: length,
            })?;
            if fua {
                self.flush()?;
            }
        }
        Ok(length)
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.check(offset, data.len() as u64, true)?;
        self.file
            .write_all_at(data, offset)
            .map_err(|e| self.io(format!("write at {offset} length {}", data.len()), e))?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, length: u64, mode: ZeroMode) -> Result<()> {
        self.check(offset, length, true)?;
        if mode.may_unmap {
            return self.discard(offset, length, mode.fua);
        }
        if mode.fast {
            return Err(TargetError::new(
                libc::ENOTSUP,
                "zeroing without unmapping writes data",
            ));
        }
        let zeroes = vec![0u8; ZERO_CHUNK.min(length as usize)];
        let mut done = 0;
        while done < length {
            let piece = (length - done).min(zeroes.len() as u64) as usize;
            self.file
                .write_all_at(&zeroes[..piece], offset + done)
                .map_err(|e| self.io(format!("write zeroes at {}", offset + done), e))?;
            done += piece as u64;
        }
        if mode.fua {
            self.flush()?;
        }
        Ok(())
    }

    fn discard(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.check(offset, length, true)?;
        if length > 0 {
            fallocate(
                &self.file,
                FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
                offset,
                length,
            )
            .map_err(|e| self.io(format!("punching {length} bytes at {offset}"), e.into()))?;
        }
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        self.file
            .sync_data()
            .map_err(|e| self.io("fdatasync".to_string(), e))
    }

    fn block_status(&self, offset: u64, length: u64, extents_max: usize) -> Result<Vec<Extent>> {
        let end = offset.saturating_add(length).min(self.size_bytes);
        if end <= offset {
            return Err(TargetError::new(
                libc::EINVAL,
                format!("block status at {offset} length {length} is past the end"),
            ));
        }
        let mut extents = Vec::new();
        let mut at = offset;
        while at < end && extents.len() < extents_max.max(1) {
            // ENXIO from SEEK_DATA: no data after `at` (the rest is a hole).
            let data = match rustix::fs::seek(&self.file, SeekFrom::Data(at)) {
                Ok(data) => data.min(end),
                Err(rustix::io::Errno::NXIO) => end,
                Err(e) => return Err(self.io(format!("SEEK_DATA at {at}"), e.into())),
            };
            let (mapped, stop) = if data > at {
                (false, data)
            } else {
                let hole = rustix::fs::seek(&self.file, SeekFrom::Hole(at))
                    .map_err(|e| self.io(format!("SEEK_HOLE at {at}"), e.into()))?;
                (true, hole.min(end))
            };
            if stop <= at {
                break;
            }
            extents.push(Extent {
                length_bytes: stop - at,
                mapped,
            });
            at = stop;
        }
        Ok(extents)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_target_reads_writes_punches_and_reports_holes() {
        let dir = std::env::temp_dir().join(format!("file-target-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("img");
        std::fs::write(&path, vec![0u8; 64 << 10]).unwrap();
        let target = FileTarget::open("raw", &path, false).unwrap();
        assert_eq!(target.geometry().size_bytes, 64 << 10);
        target.write(8192, &[7u8; 8192], true).unwrap();
        let mut back = vec![0u8; 16384];
        target.read(4096, &mut back).unwrap();
        assert!(back[..4096].iter().all(|&b| b == 0) && back[4096..12288].iter().all(|&b| b == 7));
        target.discard(12288, 4096, false).unwrap();
        let mode = ZeroMode::default();
        target.write_zeroes(8192, 512, mode).unwrap();
        target.read(8192, &mut back[..8192]).unwrap();
        assert!(back[..512].iter().all(|&b| b == 0) && back[512..4096].iter().all(|&b| b == 7));
        assert!(back[4096..8192].iter().all(|&b| b == 0), "punched");
        let errno = |r: Result<()>| r.unwrap_err().errno();
        assert_eq!(errno(target.read(64 << 10, &mut back[..512])), libc::EINVAL);
        assert_eq!(errno(target.read(100, &mut back[..512])), libc::EINVAL);
        let extents = target.block_status(0, 64 << 10, 16).unwrap();
        let total: u64 = extents.iter().map(|e| e.length_bytes).sum();
        assert_eq!(total, 64 << 10);
        drop(target);
        let read_only = FileTarget::open("raw", &path, true).unwrap();
        assert_eq!(errno(read_only.write(0, &[1; 512], false)), libc::EROFS);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
