//! What the send/receive tests share: pools of a chosen block size in memory, a byte model
//! of a volume (its bytes and its mapped blocks), and send/receive through memory.

#![allow(dead_code)]

use rand::Rng;
use std::collections::BTreeSet;
use thin_pool::testing::{deterministic_options, MemoryParts};
use thin_pool::{stream, Pool, VolumeInfo};

/// Volume size the tests use (not a multiple of every block size: the last block is partial).
pub const SIZE: u64 = (4 << 20) + 3 * 4096;

/// A pool of `block` bytes per data block, `data_mib` MiB of data, in memory.
pub fn pool(block: u64, data_mib: u64) -> (MemoryParts, Pool) {
    let parts = MemoryParts::new(4096, data_mib << 20);
    let pool = parts.format(block, deterministic_options());
    (parts, pool)
}

/// A volume as its writer sees it.
#[derive(Clone, Debug)]
pub struct Model {
    pub bytes: Vec<u8>,
    /// Mapped blocks of the sender's block size.
    pub mapped: BTreeSet<u64>,
    pub block: u64,
}

impl Model {
    pub fn new(size: u64, block: u64) -> Model {
        Model {
            bytes: vec![0; size as usize],
            mapped: BTreeSet::new(),
            block,
        }
    }

    /// Random writes (non-zero bytes, any offset and length) and whole-block discards on
    /// `name`, mirrored in the model.
    pub fn mutate(&mut self, pool: &Pool, name: &str, rng: &mut impl Rng, steps: usize) {
        let volume = pool.volume(name).unwrap();
        let size = self.bytes.len() as u64;
        for _ in 0..steps {
            if rng.gen_ratio(1, 6) {
                // Whole blocks only: the engine ignores a discard of the partial last one.
                let blocks = size / self.block;
                let first = rng.gen_range(0..blocks);
                let count = rng.gen_range(1..=3.min(blocks - first));
                let len = count * self.block;
                volume.discard(first * self.block, len).unwrap();
                let start = (first * self.block) as usize;
                self.bytes[start..start + len as usize].fill(0);
                for b in first..first + count {
                    self.mapped.remove(&b);
                }
                continue;
            }
            let offset = rng.gen_range(0..size / 512) * 512;
            let len = (rng.gen_range(1..=64u64) * 512).min(size - offset);
            let data: Vec<u8> = (0..len).map(|_| rng.gen_range(1..=255u8)).collect();
            volume.write(offset, &data, false).unwrap();
            self.bytes[offset as usize..(offset + len) as usize].copy_from_slice(&data);
            for b in offset / self.block..(offset + len).div_ceil(self.block) {
                self.mapped.insert(b);
            }
        }
        pool.commit().unwrap();
    }

    /// Which blocks of `block` bytes a faithful copy maps: those overlapping a mapped block.
    pub fn expected_mapped(&self, block: u64) -> Vec<bool> {
        let size = self.bytes.len() as u64;
        (0..size.div_ceil(block))
            .map(|b| {
                let (start, end) = (b * block, ((b + 1) * block).min(size));
                (start / self.block..end.div_ceil(self.block)).any(|s| self.mapped.contains(&s))
            })
            .collect()
    }
}

/// `snapshot` (with `base`, the increment) as a stream in memory.
pub fn send(pool: &Pool, snapshot: &str, base: Option<&str>) -> Vec<u8> {
    let mut out = Vec::new();
    stream::send(pool, snapshot, base, &mut out, &mut |_| {}).unwrap();
    out
}

/// Receive `bytes` as `name`.
pub fn receive(pool: &Pool, name: &str, bytes: &[u8]) -> thin_pool::Result<VolumeInfo> {
    stream::receive(pool, name, bytes, &mut |_| {}).map(|(info, _)| info)
}

/// Every byte of `name`.
pub fn read_all(pool: &Pool, name: &str) -> Vec<u8> {
    let volume = pool.volume(name).unwrap();
    let mut buf = vec![0; volume.size_bytes() as usize];
    volume.read(0, &mut buf).unwrap();
    buf
}

/// Which blocks of `name` are mapped, one entry per data block of its pool.
pub fn mapped(pool: &Pool, name: &str) -> Vec<bool> {
    let volume = pool.volume(name).unwrap();
    let block = pool.block_size_bytes();
    (0..volume.size_bytes().div_ceil(block))
        .map(|b| {
            let len = block.min(volume.size_bytes() - b * block);
            volume
                .block_status(b * block, len)
                .unwrap()
                .iter()
                .any(|e| e.mapped)
        })
        .collect()
}

/// What must not change when a receive is refused.
#[derive(Debug, PartialEq, Eq)]
pub struct Observed {
    pub transaction_id: u64,
    pub data_used_blocks: u64,
    pub volumes: Vec<(String, u64, u64)>,
}

pub fn observe(pool: &Pool) -> Observed {
    let status = pool.status();
    Observed {
        transaction_id: status.transaction_id,
        data_used_blocks: status.data_used_blocks,
        volumes: pool
            .list()
            .into_iter()
            .map(|v| (v.name, v.size_bytes, v.mapped_blocks))
            .collect(),
    }
}
