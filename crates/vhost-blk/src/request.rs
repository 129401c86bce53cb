//! One virtio-blk request: a descriptor chain read through virtio-queue's bounds-checked
//! [`Reader`] and [`Writer`] (every byte through vm-memory's checked accessors, inside the
//! regions of the memory table), served by the front-end seam ([`Target`]), its status
//! written last.
//!
//! A chain is untrusted. One whose descriptors leave guest memory, overflow, or have no
//! writable byte for the status is dropped (returned to the used ring with length 0, nothing
//! written); any other bad request (short or write-only header, a length that is not whole
//! sectors, a range past the end, malformed discard segments) gets `VIRTIO_BLK_S_IOERR`, an
//! unknown type or flag `VIRTIO_BLK_S_UNSUPP`. Nothing here panics on guest input.
//!
//! The one copy: the engine reads into and writes from `&[u8]` slices, and guest memory
//! (shared with a guest that may change it at any time) cannot be one without `unsafe`, so
//! data passes through the worker's own buffer, at most [`CHUNK_BYTES`] at a time.

use std::io::{Read, Write};

use thinpool_frontend::{Target, TargetError, ZeroMode, SECTOR_BYTES};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    VIRTIO_BLK_T_WRITE_ZEROES,
};
use virtio_queue::{DescriptorChain, Reader, Writer};
use vm_memory::GuestMemoryMmap;

use crate::config::{zero_sectors_max, DISCARD_SEG_MAX, ID_BYTES};

/// Bytes of data moved through the worker's buffer at once.
pub const CHUNK_BYTES: usize = 1 << 20;

/// Bytes of a request header (type, reserved, sector) and of one discard/write-zeroes
/// segment (sector, num_sectors, flags).
const HEADER_BYTES: usize = 16;
const SEGMENT_BYTES: usize = 16;

/// `VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP`.
const FLAG_UNMAP: u32 = 1;

/// A request's outcome: its virtio-blk status.
type Status = u8;

/// What a worker thread keeps between requests.
pub struct Worker {
    /// The data buffer, reused (grown to at most [`CHUNK_BYTES`]).
    buffer: Vec<u8>,
    /// The driver negotiated FLUSH: the device is a write-back cache, writes need no FUA;
    /// without it every write is durable before it completes.
    pub write_back: bool,
}

impl Worker {
    /// A worker with an empty buffer.
    pub fn new(write_back: bool) -> Self {
        Worker {
            buffer: Vec::new(),
            write_back,
        }
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
        let (Ok(mut reader), Ok(mut writer)) = (
            Reader::new(mem, chain.clone()),
            Writer::<()>::new(mem, chain),
        ) else {
            tracing::debug!("vhost-user-blk: dropped a chain outside guest memory");
            return 0;
        };
        let Some(data_len) = writer.available_bytes().checked_sub(1) else {
            tracing::debug!("vhost-user-blk: dropped a chain with no status byte");
            return 0;
        };
        let Ok(mut status_writer) = writer.split_at(data_len) else {
            return 0;
        };
        let status = self.execute(target, &mut reader, &mut writer);
        let written = writer.bytes_written();
        if status_writer.write_all(&[status]).is_err() {
            return 0;
        }
        u32::try_from(written + 1).unwrap_or(u32::MAX)
    }

    fn execute(&mut self, target: &dyn Target, reader: &mut Reader, writer: &mut Writer) -> Status {
        let mut header = [0u8; HEADER_BYTES];
        if reader.read_exact(&mut header).is_err() {
            tracing::debug!("vhost-user-blk: request header shorter than 16 readable bytes");
            return VIRTIO_BLK_S_IOERR as Status;
        }
        let kind = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
        let sector = u64::from_le_bytes(header[8..16].try_into().unwrap_or_default());
        let result = match kind {
            VIRTIO_BLK_T_IN => self.read(target, sector, writer),
            VIRTIO_BLK_T_OUT => self.write(target, sector, reader),
            VIRTIO_BLK_T_FLUSH => target.flush(),
            VIRTIO_BLK_T_GET_ID => get_id(target, writer),
            VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
                self.zero(target, kind == VIRTIO_BLK_T_DISCARD, reader)
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

    fn read(&mut self, target: &dyn Target, sector: u64, writer: &mut Writer) -> Result {
        let length = writer.available_bytes();
        let mut offset = byte_range(target, sector, length as u64)?;
        let mut left = length;
        while left > 0 {
            let piece = left.min(CHUNK_BYTES);
            let buffer = self.buffer(piece);
            target.read(offset, buffer)?;
            writer
                .write_all(buffer)
                .map_err(|e| invalid(format!("writing guest memory: {e}")))?;
            offset += piece as u64;
            left -= piece;
        }
        Ok(())
    }

    fn write(&mut self, target: &dyn Target, sector: u64, reader: &mut Reader) -> Result {
        let length = reader.available_bytes();
        let mut offset = byte_range(target, sector, length as u64)?;
        let fua = !self.write_back;
        let mut left = length;
        while left > 0 {
            let piece = left.min(CHUNK_BYTES);
            let buffer = self.buffer(piece);
            reader
                .read_exact(buffer)
                .map_err(|e| invalid(format!("reading guest memory: {e}")))?;
            target.write(offset, buffer, fua)?;
            offset += piece as u64;
            left -= piece;
        }
        Ok(())
    }

    /// DISCARD (`discard`) or WRITE_ZEROES: segments of (sector, sectors, flags).
    fn zero(&mut self, target: &dyn Target, discard: bool, reader: &mut Reader) -> Result {
        let length = reader.available_bytes();
        let count = length / SEGMENT_BYTES;
        if !length.is_multiple_of(SEGMENT_BYTES) || count == 0 || count > DISCARD_SEG_MAX as usize {
            return Err(invalid(format!("{length} bytes of discard segments")));
        }
        let max_sectors = zero_sectors_max(&target.geometry());
        let fua = !self.write_back;
        for _ in 0..count {
            let mut segment = [0u8; SEGMENT_BYTES];
            reader
                .read_exact(&mut segment)
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

    fn buffer(&mut self, length: usize) -> &mut [u8] {
        if self.buffer.len() < length {
            self.buffer.resize(length, 0);
        }
        &mut self.buffer[..length]
    }
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

/// GET_ID: the volume's name, zero-padded to 20 bytes (cut to what the chain can hold).
fn get_id(target: &dyn Target, writer: &mut Writer) -> Result {
    let mut id = [0u8; ID_BYTES];
    let name = target.name().as_bytes();
    let n = name.len().min(ID_BYTES);
    id[..n].copy_from_slice(&name[..n]);
    let room = writer.available_bytes().min(ID_BYTES);
    writer
        .write_all(&id[..room])
        .map_err(|e| invalid(format!("writing guest memory: {e}")))
}

#[cfg(test)]
mod tests;
