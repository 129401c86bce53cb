//! One virtio-blk request: a descriptor chain walked once into the worker's reused segment
//! lists (readable, then writable), every segment checked against the memory table before
//! anything is done and every byte moved through vm-memory's checked accessors
//! (`read_slice`/`write_slice`, inside the regions of the snapshot the batch holds), served by
//! the front-end seam ([`Target`]), its status written last. Nothing is allocated per request:
//! the segment lists and the data buffer live in the [`Worker`] and only grow.
//!
//! A chain is untrusted. One whose descriptors leave guest memory, overflow, or have no
//! writable byte for the status is dropped (returned to the used ring with length 0, nothing
//! written); any other bad request (short or write-only header, a length that is not whole
//! sectors, a range past the end, malformed discard segments) gets `VIRTIO_BLK_S_IOERR`, an
//! unknown type or flag `VIRTIO_BLK_S_UNSUPP`. Nothing here panics on guest input. The walk
//! is bounded by virtio-queue (a chain visits at most a queue's worth of descriptors, so a
//! loop ends).
//!
//! Reads go straight into guest memory when the target lends them ([`Target::read_lent`]: a
//! thin volume on a file, a plain file): the data device's file ranges are `preadv`ed into
//! the chain's writable buffers (`guest_io`) and unmapped runs zeroed there, no buffer of
//! ours in between. Writes likewise `pwritev` from guest memory what the target lends
//! ([`Target::write_lent`]: the blocks overwritten in place). Otherwise (a target that
//! cannot lend, and the part of a write that provisions or copies blocks: the engine takes
//! `&[u8]`, which guest memory, changed by the guest at any time, cannot safely be) data
//! passes through the worker's own buffer, at most [`CHUNK_BYTES`] at a time.

use std::fs::File;

use thinpool_frontend::{LentPiece, Target, TargetError, ZeroMode, SECTOR_BYTES};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    VIRTIO_BLK_T_WRITE_ZEROES,
};
use virtio_queue::DescriptorChain;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryError, GuestMemoryMmap};

use crate::config::{zero_sectors_max, DISCARD_SEG_MAX, ID_BYTES};
use crate::guest_io::{Direction, GuestIo};

/// Bytes of data moved through the worker's buffer at once.
pub const CHUNK_BYTES: usize = 1 << 20;

/// Zeroes written into guest memory for an unmapped run of a lent read.
static ZEROES: [u8; 64 << 10] = [0; 64 << 10];

/// Bytes of a request header (type, reserved, sector) and of one discard/write-zeroes
/// segment (sector, num_sectors, flags).
const HEADER_BYTES: usize = 16;
const SEGMENT_BYTES: usize = 16;

/// `VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP`.
const FLAG_UNMAP: u32 = 1;

/// A request's outcome: its virtio-blk status.
type Status = u8;

/// One descriptor's buffer, checked to lie inside guest memory.
#[derive(Clone, Copy, Debug)]
struct Segment {
    addr: GuestAddress,
    len: usize,
}

/// A list of segments read or written in order, as one run of bytes.
#[derive(Default)]
struct Segments {
    list: Vec<Segment>,
    /// Total bytes.
    len: usize,
    /// Bytes consumed so far: the position in the run.
    at: usize,
}

impl Segments {
    fn clear(&mut self) {
        self.list.clear();
        self.len = 0;
        self.at = 0;
    }

    fn left(&self) -> usize {
        self.len - self.at
    }

    /// Calls `each(address, range of the run)` for the `count` bytes from the position, and
    /// moves past them; stops at the first error.
    fn visit<E>(
        &mut self,
        count: usize,
        mut each: impl FnMut(GuestAddress, std::ops::Range<usize>) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        assert!(
            count <= self.left(),
            "{count} bytes past the chain's {}",
            self.len
        );
        let (mut start, end) = (self.at, self.at + count);
        let mut base = 0;
        for segment in &self.list {
            let segment_end = base + segment.len;
            if start < segment_end && start < end {
                let piece = (segment_end.min(end)) - start;
                let addr = GuestAddress(segment.addr.0 + (start - base) as u64);
                each(addr, start - self.at..start - self.at + piece)?;
                start += piece;
            }
            base = segment_end;
            if start >= end {
                break;
            }
        }
        self.at = end;
        Ok(())
    }

    /// Reads the next `buffer.len()` bytes of the run from guest memory.
    fn read(
        &mut self,
        mem: &GuestMemoryMmap,
        buffer: &mut [u8],
    ) -> std::result::Result<(), GuestMemoryError> {
        self.visit(buffer.len(), |addr, range| {
            mem.read_slice(&mut buffer[range], addr)
        })
    }

    /// Fills the next `count` bytes of the run from `file` at `offset`, straight into guest
    /// memory (`preadv`).
    fn read_from(
        &mut self,
        mem: &GuestMemoryMmap,
        file: &File,
        offset: u64,
        count: usize,
    ) -> std::io::Result<()> {
        let mut io = GuestIo::new(Direction::FromFile, mem, file, offset);
        self.visit(count, |addr, range| io.add(addr, range.len()))?;
        io.finish()
    }

    /// Writes the next `count` bytes of the run to `file` at `offset`, straight from guest
    /// memory (`pwritev`).
    fn write_to(
        &mut self,
        mem: &GuestMemoryMmap,
        file: &File,
        offset: u64,
        count: usize,
    ) -> std::io::Result<()> {
        let mut io = GuestIo::new(Direction::ToFile, mem, file, offset);
        self.visit(count, |addr, range| io.add(addr, range.len()))?;
        io.finish()
    }

    /// Writes `count` zeroes as the next bytes of the run into guest memory.
    fn zero(
        &mut self,
        mem: &GuestMemoryMmap,
        count: usize,
    ) -> std::result::Result<(), GuestMemoryError> {
        self.visit(count, |addr, range| {
            let mut done = 0;
            while done < range.len() {
                let n = (range.len() - done).min(ZEROES.len());
                mem.write_slice(&ZEROES[..n], GuestAddress(addr.0 + done as u64))?;
                done += n;
            }
            Ok(())
        })
    }

    /// Writes `data` as the next bytes of the run into guest memory.
    fn write(
        &mut self,
        mem: &GuestMemoryMmap,
        data: &[u8],
    ) -> std::result::Result<(), GuestMemoryError> {
        self.visit(data.len(), |addr, range| {
            mem.write_slice(&data[range], addr)
        })
    }
}

/// What a worker thread keeps between requests.
pub struct Worker {
    /// The data buffer, reused (grown to at most [`CHUNK_BYTES`]).
    buffer: Vec<u8>,
    /// The chain's readable and writable buffers, reused.
    readable: Segments,
    writable: Segments,
    /// The driver negotiated FLUSH: the device is a write-back cache, writes need no FUA;
    /// without it every write is durable before it completes.
    pub write_back: bool,
    /// The queue's part of the inflight region, once the front end set one
    /// ([`crate::inflight`]): kept with the worker because only the queue's thread uses it.
    pub(crate) log: Option<crate::inflight::QueueLog>,
}

impl Worker {
    /// A worker with empty buffers.
    pub fn new(write_back: bool) -> Self {
        Worker {
            buffer: Vec::new(),
            readable: Segments::default(),
            writable: Segments::default(),
            write_back,
            log: None,
        }
    }

    /// Walks `chain` into the segment lists; false if a descriptor leaves guest memory or
    /// the lengths overflow.
    fn walk<M>(&mut self, mem: &GuestMemoryMmap, chain: DescriptorChain<M>) -> bool
    where
        M: std::ops::Deref<Target = GuestMemoryMmap> + Clone,
    {
        self.readable.clear();
        self.writable.clear();
        for descriptor in chain {
            let (addr, len) = (descriptor.addr(), descriptor.len() as usize);
            if len == 0 {
                continue;
            }
            if addr.0.checked_add(len as u64).is_none() || !mem.check_range(addr, len) {
                return false;
            }
            let list = if descriptor.is_write_only() {
                &mut self.writable
            } else {
                &mut self.readable
            };
            let Some(total) = list.len.checked_add(len) else {
                return false;
            };
            list.len = total;
            list.list.push(Segment { addr, len });
        }
        true
    }

    /// Serves one chain; returns the number of bytes written into it (the used length), 0
    /// for a dropped chain.
    pub fn serve<M>(
        &mut self,
        target: &dyn Target,
        mem: &GuestMemoryMmap,
        chain: DescriptorChain<M>,
    ) -> u32
    where
        M: std::ops::Deref<Target = GuestMemoryMmap> + Clone,
    {
        if !self.walk(mem, chain) {
            tracing::debug!("vhost-user-blk: dropped a chain outside guest memory");
            return 0;
        }
        let Some(data_len) = self.writable.len.checked_sub(1) else {
            tracing::debug!("vhost-user-blk: dropped a chain with no status byte");
            return 0;
        };
        // The data part of the writable run ends before the status byte.
        self.writable.len = data_len;
        let status = self.execute(target, mem);
        let written = self.writable.at;
        self.writable.len = data_len + 1;
        self.writable.at = data_len;
        if self.writable.write(mem, &[status]).is_err() {
            return 0;
        }
        u32::try_from(written + 1).unwrap_or(u32::MAX)
    }

    fn execute(&mut self, target: &dyn Target, mem: &GuestMemoryMmap) -> Status {
        let mut header = [0u8; HEADER_BYTES];
        if self.readable.left() < HEADER_BYTES || self.readable.read(mem, &mut header).is_err() {
            tracing::debug!("vhost-user-blk: request header shorter than 16 readable bytes");
            return VIRTIO_BLK_S_IOERR as Status;
        }
        let kind = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
        let sector = u64::from_le_bytes(header[8..16].try_into().unwrap_or_default());
        let result = match kind {
            VIRTIO_BLK_T_IN => self.read(target, mem, sector),
            VIRTIO_BLK_T_OUT => self.write(target, mem, sector),
            VIRTIO_BLK_T_FLUSH => target.flush(),
            VIRTIO_BLK_T_GET_ID => self.get_id(target, mem),
            VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
                self.zero(target, mem, kind == VIRTIO_BLK_T_DISCARD)
            }
            _ => return VIRTIO_BLK_S_UNSUPP as Status,
        };
        match result {
            Ok(()) => VIRTIO_BLK_S_OK as Status,
            Err(error) if error.is_not_supported() => VIRTIO_BLK_S_UNSUPP as Status,
            Err(error) => {
                tracing::debug!(
                    errno = error.errno(),
                    "vhost-user-blk request failed: {error}"
                );
                VIRTIO_BLK_S_IOERR as Status
            }
        }
    }

    fn read(&mut self, target: &dyn Target, mem: &GuestMemoryMmap, sector: u64) -> Result {
        let length = self.writable.left();
        let mut offset = byte_range(target, sector, length as u64)?;
        let writable = &mut self.writable;
        let lent = target.read_lent(offset, length as u64, &mut |piece| {
            // The pieces add up to `length`, a usize.
            let count = piece.length_bytes() as usize;
            match piece {
                LentPiece::Zeroes { .. } => writable
                    .zero(mem, count)
                    .map_err(|e| invalid(format!("writing guest memory: {e}"))),
                LentPiece::File { file, offset, .. } => {
                    writable.read_from(mem, file, offset, count).map_err(|e| {
                        TargetError::new(
                            e.raw_os_error().unwrap_or(libc::EIO),
                            format!("reading {count} bytes at {offset} into guest memory: {e}"),
                        )
                    })
                }
            }
        })?;
        if lent {
            debug_assert_eq!(self.writable.left(), 0, "a lent read fills the chain");
            return Ok(());
        }
        let mut left = length;
        while left > 0 {
            let piece = left.min(CHUNK_BYTES);
            let buffer = grown(&mut self.buffer, piece);
            target.read(offset, buffer)?;
            self.writable
                .write(mem, buffer)
                .map_err(|e| invalid(format!("writing guest memory: {e}")))?;
            offset += piece as u64;
            left -= piece;
        }
        Ok(())
    }

    fn write(&mut self, target: &dyn Target, mem: &GuestMemoryMmap, sector: u64) -> Result {
        let length = self.readable.left();
        let mut offset = byte_range(target, sector, length as u64)?;
        let fua = !self.write_back;
        let readable = &mut self.readable;
        let lent = target.write_lent(offset, length as u64, fua, &mut |piece| {
            // The pieces add up to at most `length`, a usize.
            let count = piece.length_bytes() as usize;
            match piece {
                LentPiece::File { file, offset, .. } => {
                    readable.write_to(mem, file, offset, count).map_err(|e| {
                        TargetError::new(
                            e.raw_os_error().unwrap_or(libc::EIO),
                            format!("writing {count} bytes at {offset} from guest memory: {e}"),
                        )
                    })
                }
                LentPiece::Zeroes { .. } => Err(TargetError::new(
                    libc::EIO,
                    "a lent write gave a run of zeroes".to_string(),
                )),
            }
        })?;
        // What was not lent (blocks to provision or copy, or all of it: a target that cannot
        // lend) goes through the buffer.
        assert!(lent <= length as u64, "lent {lent} of {length} bytes");
        offset += lent;
        let mut left = length - lent as usize;
        while left > 0 {
            let piece = left.min(CHUNK_BYTES);
            let buffer = grown(&mut self.buffer, piece);
            self.readable
                .read(mem, buffer)
                .map_err(|e| invalid(format!("reading guest memory: {e}")))?;
            target.write(offset, buffer, fua)?;
            offset += piece as u64;
            left -= piece;
        }
        Ok(())
    }

    /// DISCARD (`discard`) or WRITE_ZEROES: segments of (sector, sectors, flags).
    fn zero(&mut self, target: &dyn Target, mem: &GuestMemoryMmap, discard: bool) -> Result {
        let length = self.readable.left();
        let count = length / SEGMENT_BYTES;
        if !length.is_multiple_of(SEGMENT_BYTES) || count == 0 || count > DISCARD_SEG_MAX as usize {
            return Err(invalid(format!("{length} bytes of discard segments")));
        }
        let max_sectors = zero_sectors_max(&target.geometry());
        let fua = !self.write_back;
        for _ in 0..count {
            let mut segment = [0u8; SEGMENT_BYTES];
            self.readable
                .read(mem, &mut segment)
                .map_err(|e| invalid(format!("reading guest memory: {e}")))?;
            let sector = u64::from_le_bytes(segment[0..8].try_into().unwrap_or_default());
            let sectors = u32::from_le_bytes(segment[8..12].try_into().unwrap_or_default());
            let flags = u32::from_le_bytes(segment[12..16].try_into().unwrap_or_default());
            let allowed = if discard { 0 } else { FLAG_UNMAP };
            if flags & !allowed != 0 {
                return Err(TargetError::new(libc::ENOTSUP, format!("flags {flags:#x}")));
            }
            if u64::from(sectors) > max_sectors {
                return Err(invalid(format!("{sectors} sectors in one segment")));
            }
            let length = u64::from(sectors) * SECTOR_BYTES;
            let offset = byte_range(target, sector, length)?;
            if length == 0 {
                continue;
            }
            if discard {
                target.discard(offset, length, fua)?;
            } else {
                let mode = ZeroMode {
                    may_unmap: flags & FLAG_UNMAP != 0,
                    fast: false,
                    fua,
                };
                target.write_zeroes(offset, length, mode)?;
            }
        }
        Ok(())
    }

    /// GET_ID: the volume's name, zero-padded to 20 bytes (cut to what the chain can hold).
    fn get_id(&mut self, target: &dyn Target, mem: &GuestMemoryMmap) -> Result {
        let mut id = [0u8; ID_BYTES];
        let name = target.name().as_bytes();
        let n = name.len().min(ID_BYTES);
        id[..n].copy_from_slice(&name[..n]);
        let room = self.writable.left().min(ID_BYTES);
        self.writable
            .write(mem, &id[..room])
            .map_err(|e| invalid(format!("writing guest memory: {e}")))
    }
}

/// The first `length` bytes of `buffer`, grown to hold them (it never shrinks).
fn grown(buffer: &mut Vec<u8>, length: usize) -> &mut [u8] {
    if buffer.len() < length {
        buffer.resize(length, 0);
    }
    &mut buffer[..length]
}

type Result = std::result::Result<(), TargetError>;

fn invalid(what: String) -> TargetError {
    TargetError::new(libc::EINVAL, what)
}

/// The byte offset of `sector`, after checking that `length` bytes from it are whole
/// sectors inside the device.
fn byte_range(
    target: &dyn Target,
    sector: u64,
    length: u64,
) -> std::result::Result<u64, TargetError> {
    let size = target.geometry().size_bytes;
    let offset = sector
        .checked_mul(SECTOR_BYTES)
        .filter(|offset| offset.checked_add(length).is_some_and(|end| end <= size));
    match offset {
        Some(offset) if length.is_multiple_of(SECTOR_BYTES) => Ok(offset),
        _ => Err(invalid(format!(
            "sector {sector} length {length} is not whole sectors inside {size} bytes"
        ))),
    }
}

#[cfg(test)]
mod tests;
