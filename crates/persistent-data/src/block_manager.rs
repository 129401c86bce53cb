//! The block manager: reads and writes whole metadata blocks through a bounded cache, and
//! validates every block it reads (checksum for the expected kind, self-location) and every
//! block it writes (the checksum the caller stamped must be right).
//!
//! The cache holds only blocks as they are on the device (committed, or written during the
//! current commit); blocks being changed in a transaction live in the transaction manager
//! until they are written. Callers share cached blocks as `Arc<Block>`.

use crate::block::{Block, MetadataBlock, BLOCK_SIZE};
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

/// The error for a block beyond the device.
fn beyond_device(block: MetadataBlock, count: u64) -> Error {
    Error::corrupt(
        block,
        format!("reference beyond the end of the metadata device ({count} blocks)"),
    )
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
        self.read_device(block)
    }

    /// Read a block from the device, past the cache.
    fn read_device(&self, block: MetadataBlock) -> Result<Arc<Block>> {
        let count = self.device.block_count();
        if block.get() >= count {
            return Err(beyond_device(block, count));
        }
        // Read in place: `Arc::from` a boxed block would copy it.
        let mut data = Arc::new([0u8; BLOCK_SIZE]);
        let buf = Arc::get_mut(&mut data).expect("a new block is not shared");
        self.device.read(block, buf).map_err(|source| Error::Io {
            operation: "read",
            block,
            source,
        })?;
        Ok(data)
    }

    /// Read the consecutive blocks from `first`, one into each of `buffers` (whose
    /// contents are overwritten; a buffer shared with another `Arc` is replaced by a new
    /// one), with one device request ([`BlockDevice::read_blocks`]), and validate each as
    /// `kind`, past the cache (neither looked up nor filled: for a reader that reads each
    /// block once, such as the checker reading ahead of its walk, which recycles its
    /// buffers). Each block gets the result [`BlockManager::read`] would give it: if the
    /// request fails, or the run passes the end of the device, the blocks are read one by
    /// one so that each error names its block.
    pub fn read_run(
        &self,
        first: MetadataBlock,
        mut buffers: Vec<Arc<Block>>,
        kind: BlockKind,
    ) -> Vec<Result<Arc<Block>>> {
        let location = |i: usize| MetadataBlock::new(first.get() + i as u64);
        let in_device = first
            .get()
            .checked_add(buffers.len() as u64)
            .is_some_and(|end| end <= self.device.block_count());
        if in_device {
            let mut bufs: Vec<&mut Block> = buffers
                .iter_mut()
                .map(|data| {
                    if Arc::get_mut(data).is_none() {
                        *data = Arc::new([0u8; BLOCK_SIZE]);
                    }
                    Arc::get_mut(data).expect("a new block is not shared")
                })
                .collect();
            if self.device.read_blocks(first, &mut bufs).is_ok() {
                return buffers
                    .into_iter()
                    .enumerate()
                    .map(|(i, data)| validate(location(i), &data, kind).map(|()| data))
                    .collect();
            }
        }
        (0..buffers.len())
            .map(|i| {
                let data = self.read_device(location(i))?;
                validate(location(i), &data, kind).map(|()| data)
            })
            .collect()
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

    #[test]
    fn read_run_validates_each_block_like_read() {
        let device = Arc::new(MemoryDevice::new(8));
        for b in 0..8 {
            device
                .write(MetadataBlock::new(b), &stamped(b, BlockKind::Node, b as u8))
                .unwrap();
        }
        // Block 3 claims to live elsewhere, block 5 is a bitmap.
        device
            .write(MetadataBlock::new(3), &stamped(4, BlockKind::Node, 3))
            .unwrap();
        device
            .write(MetadataBlock::new(5), &stamped(5, BlockKind::Bitmap, 5))
            .unwrap();
        let bm = BlockManager::new(device, 4);
        let shared = Arc::new([9u8; crate::BLOCK_SIZE]);
        let mut buffers: Vec<Arc<Block>> =
            (0..6).map(|_| Arc::new([7u8; crate::BLOCK_SIZE])).collect();
        buffers[1] = shared.clone();
        let run = bm.read_run(MetadataBlock::new(1), buffers, BlockKind::Node);
        assert_eq!(run.len(), 6);
        for (i, result) in run.iter().enumerate() {
            let block = MetadataBlock::new(1 + i as u64);
            match (result, bm.read(block, BlockKind::Node)) {
                (Ok(data), Ok(expected)) => assert_eq!(data[..], expected[..], "{block}"),
                (Err(e), Err(expected)) => assert_eq!(e.to_string(), expected.to_string()),
                (got, expected) => panic!("{block}: {got:?} vs {expected:?}"),
            }
        }
        assert!(run[2].as_ref().unwrap_err().is_corruption());
        assert!(matches!(run[4], Err(Error::Checksum { .. })));
        assert_eq!(shared[0], 9, "a shared buffer is not written");
        assert!(bm.lock().blocks.len() <= 4);
        // Past the end of the device: the blocks inside are read, the others refused.
        let buffers = (0..3).map(|_| Arc::new([0u8; crate::BLOCK_SIZE])).collect();
        let run = bm.read_run(MetadataBlock::new(6), buffers, BlockKind::Node);
        assert!(run[0].is_ok() && run[1].is_ok());
        assert!(run[2].as_ref().unwrap_err().is_corruption());
    }
}
