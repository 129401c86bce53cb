//! Metadata block devices: the storage-backend trait every layer above is written against,
//! and the two real implementations (a file or block device, and memory).
//!
//! Tests plug in crashing and failing devices from the `testkit` crate through the same trait.

mod file;
mod memory;

pub use file::FileDevice;
pub use memory::MemoryDevice;

use crate::block::{Block, MetadataBlock};
use std::io;

/// A device of 4 KiB metadata blocks.
///
/// Contract:
/// - `read` and `write` transfer exactly one whole block; a block outside
///   `0..block_count()` is an `io::ErrorKind::InvalidInput` error, never a panic.
/// - A completed `write` is visible to later `read`s but is durable only after a later
///   `flush` returns `Ok` (what a crash may lose is exactly the writes since the last flush).
/// - `flush` makes every write completed before it durable.
/// - Implementations are safe to share between threads.
pub trait BlockDevice: Send + Sync {
    /// Number of blocks the device holds.
    fn block_count(&self) -> u64;
    /// Read one block into `buf`.
    fn read(&self, block: MetadataBlock, buf: &mut Block) -> io::Result<()>;
    /// Read the consecutive blocks `first..first + bufs.len()` into `bufs`, in one request
    /// where the device can (a file: one `preadv`), as a reader of runs of blocks wants (the
    /// checker). The default reads them one by one; either way a block outside the device
    /// is an error and nothing is read past it.
    fn read_blocks(&self, first: MetadataBlock, bufs: &mut [&mut Block]) -> io::Result<()> {
        for (i, buf) in bufs.iter_mut().enumerate() {
            self.read(MetadataBlock::new(first.get() + i as u64), buf)?;
        }
        Ok(())
    }
    /// Write one block from `buf`.
    fn write(&self, block: MetadataBlock, buf: &Block) -> io::Result<()>;
    /// Make every completed write durable.
    fn flush(&self) -> io::Result<()>;
    /// Grow the device to at least `block_count` blocks if it can (a regular file is
    /// extended), or notice that it grew; returns the size now. Never shrinks.
    fn extend_to(&self, block_count: u64) -> io::Result<u64> {
        let _ = block_count;
        Ok(self.block_count())
    }
}

impl<T: BlockDevice + ?Sized> BlockDevice for std::sync::Arc<T> {
    fn block_count(&self) -> u64 {
        (**self).block_count()
    }
    fn read(&self, block: MetadataBlock, buf: &mut Block) -> io::Result<()> {
        (**self).read(block, buf)
    }
    fn read_blocks(&self, first: MetadataBlock, bufs: &mut [&mut Block]) -> io::Result<()> {
        (**self).read_blocks(first, bufs)
    }
    fn write(&self, block: MetadataBlock, buf: &Block) -> io::Result<()> {
        (**self).write(block, buf)
    }
    fn flush(&self) -> io::Result<()> {
        (**self).flush()
    }
    fn extend_to(&self, block_count: u64) -> io::Result<u64> {
        (**self).extend_to(block_count)
    }
}

/// The error for an access outside the device.
pub(crate) fn out_of_range(block: MetadataBlock, block_count: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("metadata block {block} is outside the device ({block_count} blocks)"),
    )
}

#[cfg(test)]
mod tests;
