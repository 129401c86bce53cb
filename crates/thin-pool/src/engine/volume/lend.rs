//! Lent reads: instead of copying a read into a caller's buffer, the volume hands out where
//! its bytes lie (ranges of the data device's file, and runs that read as zeroes), so a
//! front end can move them into memory it does not own as a `&mut [u8]` (guest memory shared
//! with a VM: vhost-user-blk `preadv`s straight into it) with no copy through a buffer.
//!
//! The guard is the same as [`Volume::read`]'s: the whole walk, callbacks included, runs
//! pinned (`Provisioner::pin`, see `grace`), so a data block that a discard, a shrink or a
//! broken sharing frees meanwhile is not given to another volume (nor discarded on the data
//! device) until the callback that reads it has returned. The pieces borrow the walk: the
//! callback's argument cannot outlive it, so nothing reads a lent range after the pin is
//! dropped. A callback must not wait for the pool (no volume writes, no flush, no
//! management call): a pinned thread holds back the release of freed blocks.
//!
//! Consecutive mapped blocks that are consecutive on the data device come out as one piece
//! (one `preadv` for a sequentially written volume), consecutive unmapped ones as one run of
//! zeroes.
//!
//! Lent writes ([`Volume::write_lent`]) are the in-place overwrite handed out the same way:
//! inside the volume's write gate (so no snapshot can make a block shared meanwhile) and
//! pinned, the ranges of the blocks that are mapped and not shared, from the start of the
//! write up to the first block that needs provisioning, a copy or zeroing; the caller
//! writes them itself and the rest with [`Volume::write`].

use std::fs::File;
use std::ops::ControlFlow;

use super::{data_io, Volume};
use crate::engine::options::PoolMode;
use crate::engine::volumes::Lookup;
use crate::error::{Error, Result};

/// One piece of a lent read ([`Volume::read_lent`]), in the order of the read.
#[derive(Clone, Copy, Debug)]
pub enum LentPiece<'a> {
    /// `length_bytes` that read as zeroes (unmapped).
    Zeroes {
        /// Length in bytes; nonzero.
        length_bytes: u64,
    },
    /// `length_bytes` at `offset` in `file` (the data device; opened for reading, buffered,
    /// so any buffer alignment works).
    File {
        /// The data device's file.
        file: &'a File,
        /// Offset in `file` of the piece's first byte.
        offset: u64,
        /// Length in bytes; nonzero.
        length_bytes: u64,
    },
}

impl LentPiece<'_> {
    /// Length in bytes.
    pub fn length_bytes(&self) -> u64 {
        match *self {
            LentPiece::Zeroes { length_bytes } | LentPiece::File { length_bytes, .. } => {
                length_bytes
            }
        }
    }
}

/// A run being gathered: zeroes, or data-device bytes from `start`.
#[derive(Clone, Copy)]
enum Pending {
    None,
    Zeroes(u64),
    Data { start: u64, length: u64 },
}

impl Pending {
    /// Adds the next `n` bytes (at `at` on the data device, `None`: unmapped) and returns
    /// the run they end, if they do not continue this one.
    fn push(&mut self, at: Option<u64>, n: u64) -> Pending {
        let (next, ended) = match (at, *self) {
            (None, Pending::Zeroes(run)) => (Pending::Zeroes(run + n), Pending::None),
            (Some(at), Pending::Data { start, length }) if start + length == at => (
                Pending::Data {
                    start,
                    length: length + n,
                },
                Pending::None,
            ),
            (None, ended) => (Pending::Zeroes(n), ended),
            (Some(at), ended) => (
                Pending::Data {
                    start: at,
                    length: n,
                },
                ended,
            ),
        };
        *self = next;
        ended
    }

    /// The run as a piece of `file`; `None` for no run.
    fn piece(self, file: &File) -> Option<LentPiece<'_>> {
        match self {
            Pending::None => None,
            Pending::Zeroes(length_bytes) => Some(LentPiece::Zeroes { length_bytes }),
            Pending::Data { start, length } => Some(LentPiece::File {
                file,
                offset: start,
                length_bytes: length,
            }),
        }
    }
}

impl Volume {
    /// Whether [`Volume::read_lent`] can lend (the data device has a file; not a memory
    /// device, nor a block device opened with `O_DIRECT`).
    pub fn can_lend(&self) -> bool {
        self.pool.data().file().is_some()
    }

    /// Lends the `length` bytes at `offset`: calls `each` with consecutive pieces covering
    /// the range in order, pinned for the whole walk (see the module docs). Returns
    /// `Ok(false)`, calling nothing, when the data device has no file to lend
    /// ([`Volume::can_lend`]): read with [`Volume::read`] instead. A `Break` from `each`
    /// stops the walk (the caller keeps its own error). Range and mode are checked as
    /// [`Volume::read`] checks them.
    pub fn read_lent(
        &self,
        offset: u64,
        length: u64,
        each: &mut dyn FnMut(LentPiece<'_>) -> ControlFlow<()>,
    ) -> Result<bool> {
        self.check_range(offset, length)?;
        if self.pool.mode() == PoolMode::Fail {
            return Err(Error::ReadOnly { needs_check: true });
        }
        let data = self.pool.data();
        let Some(file) = data.file() else {
            return Ok(false);
        };
        let device_bytes = data.size_bytes();
        let _pin = self.pool.pin();
        let mut pending = Pending::None;
        let mut lent = 0u64;
        for (block, in_block, n) in self.pieces(offset, length) {
            let at = match self.lookup(block).data_block() {
                None => None,
                Some(data_block) => {
                    let at = self.data_offset(data_block, in_block);
                    // As `read_at` would: a range past the device is refused, never lent.
                    if at.checked_add(n).is_none_or(|end| end > device_bytes) {
                        return Err(beyond_device(at, n, device_bytes));
                    }
                    Some(at)
                }
            };
            if let Some(piece) = pending.push(at, n).piece(file) {
                lent += piece.length_bytes();
                if each(piece).is_break() {
                    return Ok(true);
                }
            }
        }
        if let Some(piece) = pending.piece(file) {
            lent += piece.length_bytes();
            if each(piece).is_break() {
                return Ok(true);
            }
        }
        assert_eq!(lent, length, "the pieces cover the read");
        Ok(true)
    }
}

impl Volume {
    /// Lends the data-file ranges a write of `length` bytes at `offset` overwrites in place:
    /// calls `each` with them (only [`LentPiece::File`]s, in order) for the blocks from
    /// `offset` on that are mapped and not shared, up to the first that is not (or the end),
    /// and returns how many bytes from `offset` were lent: the caller writes those into the
    /// pieces and the rest with [`Volume::write`]. Zero, calling nothing, when the data
    /// device has no file. Inside the write gate and pinned, as an in-place write is; with
    /// `fua`, and every byte lent, the data is durable when this returns (a partial lend
    /// leaves the flush to the caller's [`Volume::write`] of the rest). A `Break` from `each`
    /// stops the walk and returns the bytes lent before that piece; the broken piece's bytes
    /// may be written or not, like a failed write's.
    pub fn write_lent(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        each: &mut dyn FnMut(LentPiece<'_>) -> ControlFlow<()>,
    ) -> Result<u64> {
        self.check_range(offset, length)?;
        self.check_writable()?;
        let data = self.pool.data();
        let Some(file) = data.file() else {
            return Ok(0);
        };
        let lent = {
            let _pass = self.volume.gate().enter();
            self.check_range(offset, length)?;
            let _pin = self.pool.pin();
            self.lend_in_place(file, offset, length, each)?
        };
        data.counters()
            .written_bytes
            .fetch_add(lent, std::sync::atomic::Ordering::Relaxed);
        if fua && lent == length && length > 0 {
            self.flush()?;
        }
        Ok(lent)
    }
}

impl Volume {
    /// The walk of [`Volume::write_lent`], inside the gate and pinned: the bytes lent.
    fn lend_in_place(
        &self,
        file: &File,
        offset: u64,
        length: u64,
        each: &mut dyn FnMut(LentPiece<'_>) -> ControlFlow<()>,
    ) -> Result<u64> {
        let device_bytes = self.pool.data().size_bytes();
        let mut pending = Pending::None;
        let mut lent = 0u64;
        for (block, in_block, n) in self.pieces(offset, length) {
            let Lookup::Exclusive(data_block) = self.lookup(block) else {
                break;
            };
            let at = self.data_offset(data_block, in_block);
            if at.checked_add(n).is_none_or(|end| end > device_bytes) {
                return Err(beyond_device(at, n, device_bytes));
            }
            if let Some(piece) = pending.push(Some(at), n).piece(file) {
                if each(piece).is_break() {
                    return Ok(lent);
                }
                lent += piece.length_bytes();
            }
        }
        if let Some(piece) = pending.piece(file) {
            if each(piece).is_break() {
                return Ok(lent);
            }
            lent += piece.length_bytes();
        }
        Ok(lent)
    }
}

fn beyond_device(at: u64, n: u64, device_bytes: u64) -> Error {
    data_io("lending a read")(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("data range {at}+{n} outside the data device ({device_bytes} bytes)"),
    ))
}
