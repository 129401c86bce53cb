//! The block manager: reads and writes whole metadata blocks through a bounded cache, and
//! validates every block it reads (checksum for the expected kind, self-location) and every
//! block it writes (the checksum the caller stamped must be right).
//!
//! The cache holds only blocks as they are on the device (committed, or written during the
//! current commit); blocks being changed in a transaction live in the transaction manager
//! until they are written. Callers share cached blocks as `Arc<Block>`.

use crate::block::{zeroed_block, Block, MetadataBlock};
use crate::checksum::{self, BlockKind};
use crate::error::{Error, Result};
use crate::io::BlockDevice;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// Offset of the self-location (`blocknr`) field, the same in every block kind.
pub const BLOCKNR_OFFSET: usize = 8;

/// Default cache size: 16 384 blocks = 64 MiB.
pub const CACHE_BLOCKS_DEFAULT: usize = 16_384;

struct Cache {
    /// Cached blocks with the kind they were validated as (`None`: read raw, unvalidated).
    blocks: HashMap<MetadataBlock, (Arc<Block>, Option<BlockKind>)>,
    /// Insertion order, for eviction (first in, first out). May name blocks already evicted.
    order: VecDeque<MetadataBlock>,
    capacity_blocks: usize,
}

impl Cache {
    fn insert(&mut self, block: MetadataBlock, data: Arc<Block>, kind: Option<BlockKind>) {
        if self.blocks.insert(block, (data, kind)).is_none() {
            self.order.push_back(block);
        }
        while self.blocks.len() > self.capacity_blocks {
            match self.order.pop_front() {
                Some(victim) => {
                    self.blocks.remove(&victim);
                }
                None => break,
            }
        }
        // Keep the order queue from growing without bound through stale entries.
        if self.order.len() > 2 * self.capacity_blocks + 16 {
            let blocks = &self.blocks;
            self.order.retain(|b| blocks.contains_key(b));
        }
    }
}

/// Validated, cached access to a metadata device.
pub struct BlockManager {
    device: Arc<dyn BlockDevice>,
    cache: Mutex<Cache>,
}

impl std::fmt::Debug for BlockManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockManager")
            .field("block_count", &self.device.block_count())
            .finish()
    }
}

/// The self-location stored in a block.
pub fn stored_location(data: &Block) -> u64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&data[BLOCKNR_OFFSET..BLOCKNR_OFFSET + 8]);
    u64::from_le_bytes(bytes)
}

/// Check a block's checksum and self-location.
pub fn validate(block: MetadataBlock, data: &Block, kind: BlockKind) -> Result<()> {
    let stored = checksum::stored(data);
    let computed = checksum::compute(data, kind);
    if stored != computed {
        return Err(Error::Checksum {
            block,
            kind,
            stored,
            computed,
        });
    }
    let location = stored_location(data);
    if location != block.get() {
        return Err(Error::corrupt(
            block,
            format!("{kind} says it lives at block {location}"),
        ));
    }
    Ok(())
}

impl BlockManager {
    /// A block manager over `device` caching up to `cache_blocks` blocks.
    pub fn new(device: Arc<dyn BlockDevice>, cache_blocks: usize) -> BlockManager {
        assert!(cache_blocks > 0);
        BlockManager {
            device,
            cache: Mutex::new(Cache {
                blocks: HashMap::new(),
                order: VecDeque::new(),
                capacity_blocks: cache_blocks,
            }),
        }
    }

    /// The device underneath.
    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.device
    }

    /// Number of blocks on the device.
    pub fn block_count(&self) -> u64 {
        self.device.block_count()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Read a block without validating it (for tools that identify block kinds).
    pub fn read_raw(&self, block: MetadataBlock) -> Result<Arc<Block>> {
        if let Some((data, _)) = self.lock().blocks.get(&block) {
            return Ok(data.clone());
        }
        let count = self.device.block_count();
        if block.get() >= count {
            return Err(Error::corrupt(
                block,
                format!("reference beyond the end of the metadata device ({count} blocks)"),
            ));
        }
        let mut data = zeroed_block();
        self.device
            .read(block, &mut data)
            .map_err(|source| Error::Io {
                operation: "read",
                block,
                source,
            })?;
        Ok(Arc::from(data))
    }

    /// Read a block and validate it as `kind`. Only valid blocks enter the cache.
    pub fn read(&self, block: MetadataBlock, kind: BlockKind) -> Result<Arc<Block>> {
        let cached = self.lock().blocks.get(&block).cloned();
        if let Some((data, cached_kind)) = cached {
            // A block validated as this kind before needs no new checksum; a reader
            // expecting another kind must still get a checksum error.
            if cached_kind != Some(kind) {
                validate(block, &data, kind)?;
            }
            return Ok(data);
        }
        let data = self.read_raw(block)?;
        validate(block, &data, kind)?;
        self.lock().insert(block, data.clone(), Some(kind));
        Ok(data)
    }

    /// Write a block whose checksum the caller stamped. Asserts it is valid as `kind`: a
    /// block we write must pass our own read checks.
    pub fn write(&self, block: MetadataBlock, data: Arc<Block>, kind: BlockKind) -> Result<()> {
        if let Err(e) = validate(block, &data, kind) {
            panic!("writing an invalid block: {e}");
        }
        self.device
            .write(block, &data)
            .map_err(|source| Error::Io {
                operation: "write",
                block,
                source,
            })?;
        self.lock().insert(block, data, Some(kind));
        Ok(())
    }

    /// Make all written blocks durable.
    pub fn flush(&self) -> Result<()> {
        self.device.flush().map_err(|source| Error::Io {
            operation: "flush",
            block: MetadataBlock::new(0),
            source,
        })
    }

    /// Forget every cached block (after a failed commit, the device contents are unknown).
    pub fn invalidate(&self) {
        let mut cache = self.lock();
        cache.blocks.clear();
        cache.order.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::MemoryDevice;

    fn stamped(location: u64, kind: BlockKind, fill: u8) -> Arc<Block> {
        let mut data = [fill; crate::BLOCK_SIZE];
        data[BLOCKNR_OFFSET..BLOCKNR_OFFSET + 8].copy_from_slice(&location.to_le_bytes());
        checksum::stamp(&mut data, kind);
        Arc::new(data)
    }

    #[test]
    fn write_then_read_validates() {
        let bm = BlockManager::new(Arc::new(MemoryDevice::new(16)), 4);
        for b in 0..10 {
            bm.write(
                MetadataBlock::new(b),
                stamped(b, BlockKind::Node, b as u8),
                BlockKind::Node,
            )
            .unwrap();
        }
        for b in 0..10 {
            let data = bm.read(MetadataBlock::new(b), BlockKind::Node).unwrap();
            assert_eq!(data[100], b as u8);
        }
        let err = bm
            .read(MetadataBlock::new(3), BlockKind::Bitmap)
            .unwrap_err();
        assert!(matches!(err, Error::Checksum { .. }), "{err}");
        assert!(bm.lock().blocks.len() <= 4, "cache is bounded");
    }

    #[test]
    fn wrong_location_is_corruption() {
        let device = Arc::new(MemoryDevice::new(4));
        device
            .write(MetadataBlock::new(2), &stamped(1, BlockKind::Node, 0))
            .unwrap();
        let bm = BlockManager::new(device, 4);
        let err = bm.read(MetadataBlock::new(2), BlockKind::Node).unwrap_err();
        assert!(err.is_corruption());
        assert!(err.to_string().contains("block 2"), "{err}");
        let err = bm.read(MetadataBlock::new(9), BlockKind::Node).unwrap_err();
        assert!(err.is_corruption(), "{err}");
    }
}
