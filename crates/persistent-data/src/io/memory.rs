//! A metadata device in memory, for tests and benchmarks.

use super::{out_of_range, BlockDevice};
use crate::block::{Block, MetadataBlock, BLOCK_SIZE};
use std::io;
use std::sync::RwLock;

/// Blocks in a vector; every write is durable at once (`flush` does nothing). Unwritten
/// blocks read as zeros.
#[derive(Debug)]
pub struct MemoryDevice {
    blocks: RwLock<Vec<Option<Box<Block>>>>,
}

impl MemoryDevice {
    /// A zero-filled device of `block_count` blocks.
    pub fn new(block_count: u64) -> MemoryDevice {
        let count = usize::try_from(block_count).expect("memory device size fits in memory");
        MemoryDevice {
            blocks: RwLock::new(vec![None; count]),
        }
    }

    /// A device holding a copy of `bytes` (whose length must be a multiple of 4 KiB).
    pub fn from_bytes(bytes: &[u8]) -> MemoryDevice {
        assert_eq!(bytes.len() % BLOCK_SIZE, 0, "image length is whole blocks");
        let blocks = bytes
            .chunks_exact(BLOCK_SIZE)
            .map(|chunk| {
                let mut block = Box::new([0u8; BLOCK_SIZE]);
                block.copy_from_slice(chunk);
                Some(block)
            })
            .collect();
        MemoryDevice {
            blocks: RwLock::new(blocks),
        }
    }

    /// A copy of the whole device as bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let blocks = self.blocks.read().unwrap_or_else(|e| e.into_inner());
        let mut bytes = vec![0u8; blocks.len() * BLOCK_SIZE];
        for (index, block) in blocks.iter().enumerate() {
            if let Some(block) = block {
                bytes[index * BLOCK_SIZE..(index + 1) * BLOCK_SIZE].copy_from_slice(&block[..]);
            }
        }
        bytes
    }

    /// Grow (never shrink) the device to `block_count` blocks.
    pub fn grow(&self, block_count: u64) {
        let count = usize::try_from(block_count).expect("memory device size fits in memory");
        let mut blocks = self.blocks.write().unwrap_or_else(|e| e.into_inner());
        assert!(count >= blocks.len(), "memory devices never shrink");
        blocks.resize(count, None);
    }
}

impl BlockDevice for MemoryDevice {
    fn block_count(&self) -> u64 {
        self.blocks.read().unwrap_or_else(|e| e.into_inner()).len() as u64
    }

    fn read(&self, block: MetadataBlock, buf: &mut Block) -> io::Result<()> {
        let blocks = self.blocks.read().unwrap_or_else(|e| e.into_inner());
        match usize::try_from(block.get())
            .ok()
            .and_then(|i| blocks.get(i))
        {
            Some(Some(stored)) => buf.copy_from_slice(&stored[..]),
            Some(None) => buf.fill(0),
            None => return Err(out_of_range(block, blocks.len() as u64)),
        }
        Ok(())
    }

    fn write(&self, block: MetadataBlock, buf: &Block) -> io::Result<()> {
        let mut blocks = self.blocks.write().unwrap_or_else(|e| e.into_inner());
        let count = blocks.len() as u64;
        match usize::try_from(block.get())
            .ok()
            .and_then(|i| blocks.get_mut(i))
        {
            Some(slot) => {
                *slot = Some(Box::new(*buf));
                Ok(())
            }
            None => Err(out_of_range(block, count)),
        }
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn extend_to(&self, block_count: u64) -> io::Result<u64> {
        if block_count > self.block_count() {
            self.grow(block_count);
        }
        Ok(BlockDevice::block_count(self))
    }
}
