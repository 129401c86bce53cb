//! The one seam between a volume and the front ends that serve it (NBD, vhost-user-blk, and
//! later ublk): [`Target`], the requests every block front end makes (read, write with FUA,
//! flush, discard, write-zeroes, block status), what the device looks like ([`Geometry`]:
//! capacity, block size and alignment, read-only, discard), and [`TargetError`], every
//! failure as the errno a kernel would give. [`VolumeTarget`] implements it for a thin
//! volume; each front end only translates its wire format to these calls and the errno to
//! its own status codes (NBD errors, virtio-blk `IOERR`/`UNSUPP`), so no request semantics
//! live in a front end.
//!
//! Contract: offsets and lengths are bytes, multiples of [`SECTOR_BYTES`] (the engine refuses
//! others with `EINVAL`), inside `[0, size_bytes)` (past the end: `EINVAL`, checked by the
//! engine, so a front end need not trust its own checks). Every method takes `&self` and is
//! called from many threads at once. [`Target::flush`] makes every write completed before it,
//! through any front end, durable.
//!
//! [`FileTarget`] serves a plain file the same way (no mapping): the benchmark's raw export
//! and a reference device for tests.
//!
//! Invariant: a [`VolumeTarget`] holds its [`thin_pool::Volume`] handle for its whole life, so
//! while a front end has a volume attached the engine counts it as open and refuses to
//! delete, revert or shrink it.

#![forbid(unsafe_code)]

use std::fmt;
use std::ops::ControlFlow;

use thin_pool::Volume;

/// One piece of a lent read ([`Target::read_lent`]): a file range, or a run of zeroes.
pub use thin_pool::LentPiece;

mod file;
pub use file::{FileTarget, FILE_BLOCK_BYTES};

/// The unit of every offset and length.
pub const SECTOR_BYTES: u64 = 512;

/// Largest range one block-status call walks in the index, in data blocks (the front end
/// asks again for the rest), so one request cannot make a walk of a whole huge volume.
pub const BLOCK_STATUS_BLOCKS_MAX: u64 = 1 << 16;

/// A failed request: the errno (the same one the control socket reports for the same
/// engine error), what was being done, and the cause.
#[derive(Debug)]
pub struct TargetError {
    errno: i32,
    what: String,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl TargetError {
    /// An error with no cause but its errno.
    pub fn new(errno: i32, what: impl Into<String>) -> Self {
        TargetError {
            errno,
            what: what.into(),
            source: None,
        }
    }

    /// An engine error met while doing `what`; the errno is the engine's.
    pub fn engine(error: thin_pool::Error, what: impl Into<String>) -> Self {
        TargetError {
            errno: error.errno(),
            what: what.into(),
            source: Some(Box::new(error)),
        }
    }

    /// The errno (positive, as in `libc`).
    pub fn errno(&self) -> i32 {
        self.errno
    }

    /// Whether the request is one the target cannot do at all (`ENOTSUP`/`EOPNOTSUPP`), as
    /// opposed to one that failed.
    pub fn is_not_supported(&self) -> bool {
        self.errno == libc::ENOTSUP || self.errno == libc::EOPNOTSUPP
    }

    /// Splits the error into what was being done and its cause, for front ends that keep
    /// their own error type.
    pub fn into_parts(
        self,
    ) -> (
        i32,
        String,
        Option<Box<dyn std::error::Error + Send + Sync>>,
    ) {
        (self.errno, self.what, self.source)
    }
}

impl fmt::Display for TargetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.what)?;
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl std::error::Error for TargetError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// Result of a [`Target`] call.
pub type Result<T> = std::result::Result<T, TargetError>;

/// What a device looks like to its front end; read again at each use (a volume may grow
/// while attached).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Capacity in bytes; a multiple of [`SECTOR_BYTES`].
    pub size_bytes: u64,
    /// The data block size: the alignment that avoids read-modify-write and that discard and
    /// unmapping write-zeroes work in (they zero the parts of a range that do not cover a
    /// whole block).
    pub block_size_bytes: u64,
    /// Writes, discards and write-zeroes fail with `EROFS`.
    pub read_only: bool,
    /// Discard frees space.
    pub can_discard: bool,
}

/// How [`Target::write_zeroes`] may reach its result.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ZeroMode {
    /// Whole blocks may be unmapped; otherwise the range ends allocated.
    pub may_unmap: bool,
    /// Fail with `ENOTSUP`, changing nothing, unless no data needs writing.
    pub fast: bool,
    /// Durable when the call returns.
    pub fua: bool,
}

/// One run of equal allocation reported by [`Target::block_status`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Length in bytes; nonzero.
    pub length_bytes: u64,
    /// Allocated; an unmapped run reads as zeroes.
    pub mapped: bool,
}

/// A block device as every front end sees it. See the module docs for the contract.
pub trait Target: Send + Sync {
    /// The device's name (NBD's export name, virtio-blk's `GET_ID`).
    fn name(&self) -> &str;

    /// Capacity, block size, access.
    fn geometry(&self) -> Geometry;

    /// Fills all of `buffer` with the bytes at `offset`.
    fn read(&self, offset: u64, buffer: &mut [u8]) -> Result<()>;

    /// Lends where the `length` bytes at `offset` lie instead of copying them: calls `each`
    /// with consecutive pieces covering the range in order (file ranges the front end reads
    /// itself, straight into memory it could not hand over as a `&mut [u8]`, and runs of
    /// zeroes), each valid only during its call; the target keeps the ranges from being
    /// reused for other data until the call returns. `Ok(false)`, calling nothing: this
    /// target cannot lend (use [`Target::read`]); the default. An error from `each` stops
    /// the walk and is returned. `each` must not call the target.
    fn read_lent(
        &self,
        offset: u64,
        length: u64,
        each: &mut dyn FnMut(LentPiece<'_>) -> Result<()>,
    ) -> Result<bool> {
        let _ = (offset, length, each);
        Ok(false)
    }

    /// Writes `data` at `offset`; with `fua` it is durable when this returns.
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()>;

    /// Lends the file ranges a write of `length` bytes at `offset` overwrites in place
    /// (only [`LentPiece::File`]s, in order, each valid during its call), for the front end
    /// to write itself from memory it could not hand over as a `&[u8]`; returns how many
    /// bytes from `offset` were lent (the front end writes the rest with [`Target::write`],
    /// with `fua` if it asked for it). With `fua` and every byte lent, the data is durable
    /// when this returns. The default lends nothing (`Ok(0)`). An error from `each` stops
    /// the walk and is returned. `each` must not call the target.
    fn write_lent(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        each: &mut dyn FnMut(LentPiece<'_>) -> Result<()>,
    ) -> Result<u64> {
        let _ = (offset, length, fua, each);
        Ok(0)
    }

    /// Makes `length` bytes at `offset` read as zeroes.
    fn write_zeroes(&self, offset: u64, length: u64, mode: ZeroMode) -> Result<()>;

    /// The range is no longer needed: whole blocks are unmapped, the rest reads as zeroes.
    fn discard(&self, offset: u64, length: u64, fua: bool) -> Result<()>;

    /// Makes every completed write durable.
    fn flush(&self) -> Result<()>;

    /// Allocation from `offset`: consecutive extents starting there, at least one and at most
    /// `extents_max`, none past the end; they may stop short of `offset + length`.
    fn block_status(&self, offset: u64, length: u64, extents_max: usize) -> Result<Vec<Extent>>;
}

/// A thin volume as a [`Target`]; holds the volume open for as long as it lives.
pub struct VolumeTarget {
    volume: Volume,
}

impl VolumeTarget {
    /// Wraps an open volume.
    pub fn new(volume: Volume) -> Self {
        VolumeTarget { volume }
    }

    /// The volume served.
    pub fn volume(&self) -> &Volume {
        &self.volume
    }

    /// Whether every piece of `[offset, offset + length)` that does not cover a whole data
    /// block is unmapped, so zeroing with unmap allowed does no data I/O.
    fn zeroing_is_fast(&self, offset: u64, length: u64) -> Result<bool> {
        let block = self.volume.block_size_bytes();
        let end = offset.saturating_add(length);
        let head_end = offset.next_multiple_of(block).min(end);
        let tail_start = (end / block * block).max(head_end);
        for (start, stop) in [(offset, head_end), (tail_start, end)] {
            if start < stop {
                let extents = self
                    .volume
                    .block_status(start, stop - start)
                    .map_err(|e| TargetError::engine(e, format!("block status at {start}")))?;
                if extents.iter().any(|extent| extent.mapped) {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }
}

impl Target for VolumeTarget {
    fn name(&self) -> &str {
        self.volume.name()
    }

    fn geometry(&self) -> Geometry {
        Geometry {
            size_bytes: self.volume.size_bytes(),
            block_size_bytes: self.volume.block_size_bytes(),
            read_only: self.volume.read_only(),
            can_discard: self.volume.can_discard(),
        }
    }

    fn read(&self, offset: u64, buffer: &mut [u8]) -> Result<()> {
        self.volume.read(offset, buffer).map_err(|e| {
            TargetError::engine(e, format!("read at {offset} length {}", buffer.len()))
        })
    }

    fn read_lent(
        &self,
        offset: u64,
        length: u64,
        each: &mut dyn FnMut(LentPiece<'_>) -> Result<()>,
    ) -> Result<bool> {
        let mut failed = None;
        let lent = self
            .volume
            .read_lent(offset, length, &mut |piece| match each(piece) {
                Ok(()) => ControlFlow::Continue(()),
                Err(error) => {
                    failed = Some(error);
                    ControlFlow::Break(())
                }
            })
            .map_err(|e| {
                TargetError::engine(e, format!("lent read at {offset} length {length}"))
            })?;
        match failed {
            Some(error) => Err(error),
            None => Ok(lent),
        }
    }

    fn write_lent(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        each: &mut dyn FnMut(LentPiece<'_>) -> Result<()>,
    ) -> Result<u64> {
        let mut failed = None;
        let lent = self
            .volume
            .write_lent(offset, length, fua, &mut |piece| match each(piece) {
                Ok(()) => ControlFlow::Continue(()),
                Err(error) => {
                    failed = Some(error);
                    ControlFlow::Break(())
                }
            })
            .map_err(|e| {
                TargetError::engine(e, format!("lent write at {offset} length {length}"))
            })?;
        match failed {
            Some(error) => Err(error),
            None => Ok(lent),
        }
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.volume
            .write(offset, data, fua)
            .map_err(|e| TargetError::engine(e, format!("write at {offset} length {}", data.len())))
    }

    fn write_zeroes(&self, offset: u64, length: u64, mode: ZeroMode) -> Result<()> {
        if mode.fast && !(mode.may_unmap && self.zeroing_is_fast(offset, length)?) {
            return Err(TargetError::new(
                libc::ENOTSUP,
                format!("zeroing {length} bytes at {offset} needs data writes"),
            ));
        }
        self.volume
            .write_zeroes(offset, length, mode.may_unmap, mode.fua)
            .map_err(|e| {
                TargetError::engine(e, format!("write zeroes at {offset} length {length}"))
            })
    }

    fn discard(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.volume
            .discard(offset, length)
            .map_err(|e| TargetError::engine(e, format!("discard at {offset} length {length}")))?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        self.volume
            .flush()
            .map_err(|e| TargetError::engine(e, "flush"))
    }

    fn block_status(&self, offset: u64, length: u64, extents_max: usize) -> Result<Vec<Extent>> {
        let block = self.volume.block_size_bytes();
        // Walk at most BLOCK_STATUS_BLOCKS_MAX blocks, ending on a block boundary.
        let limit_end = (offset / block + BLOCK_STATUS_BLOCKS_MAX).saturating_mul(block);
        let end = offset
            .saturating_add(length)
            .min(limit_end)
            .min(self.volume.size_bytes());
        if end <= offset {
            return Err(TargetError::new(
                libc::EINVAL,
                format!("block status at {offset} length {length} is past the end"),
            ));
        }
        let extents = self
            .volume
            .block_status(offset, end - offset)
            .map_err(|e| {
                TargetError::engine(e, format!("block status at {offset} length {length}"))
            })?;
        Ok(extents
            .into_iter()
            .take(extents_max.max(1))
            .map(|extent| Extent {
                length_bytes: extent.length_bytes,
                mapped: extent.mapped,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests;
