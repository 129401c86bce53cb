//! A metadata device that simulates power cuts: [`CrashDevice`].
//!
//! It keeps two things apart, as real media do:
//!
//! ```text
//!   durable image      what survives a power cut for certain (everything before the last flush)
//!   volatile writes    completed writes since the last flush, in issue order
//! ```
//!
//! Reads see the latest write (durable image with the volatile writes applied). `flush` moves
//! the volatile writes into the durable image. [`CrashDevice::crash_image`] builds the device
//! as it could look after a power cut now, per [`CrashMode`]: only the durable image, or
//! with any subset of the volatile writes (which also models reordering), or with some of the
//! kept writes torn at a 512-byte sector boundary.
//!
//! To crash a workload at every point: run it once and read [`CrashDevice::operation_count`]
//! (writes plus flushes); then, for each `n`, rerun it on a fresh device with
//! [`CrashDevice::set_power_cut_after`]`(Some(n))`. The first `n` writes and flushes complete;
//! from then on every operation (reads included) fails with an I/O error, so the engine sees
//! the failure, and the test takes [`CrashDevice::crash_image`] and reopens from it.
//!
//! Assumptions about the media (what the engine may rely on): a single 512-byte sector is
//! written atomically; nothing written before a completed flush is lost; nothing is ever
//! written that the engine did not write.

use persistent_data::{Block, BlockDevice, MemoryDevice, MetadataBlock, BLOCK_SIZE};
use rand::Rng;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

/// Size of the unit a disk writes atomically.
pub const SECTOR_SIZE: usize = 512;
/// Sectors in one metadata block.
pub const SECTORS_PER_BLOCK: usize = BLOCK_SIZE / SECTOR_SIZE;

/// What happens to the volatile writes at a simulated power cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashMode {
    /// Every write since the last flush is lost.
    DropAll,
    /// Each volatile write independently survives or is lost (probability 1/2 each). A later
    /// write to a block may be lost while an earlier one survives, which models reordering.
    KeepRandomSubset,
    /// Like `KeepRandomSubset`, but each surviving write is torn with probability 1/2: only a
    /// random non-empty proper prefix of its 512-byte sectors reaches the disk; the rest of
    /// the block keeps its previous contents.
    Tear,
}

impl CrashMode {
    /// Every mode, for tests that loop over them.
    pub const ALL: [CrashMode; 3] = [
        CrashMode::DropAll,
        CrashMode::KeepRandomSubset,
        CrashMode::Tear,
    ];
}

type Blocks = Vec<Option<Arc<Block>>>;

#[derive(Debug)]
struct State {
    /// Contents after the last completed flush.
    durable: Blocks,
    /// Latest contents (durable plus volatile), what reads return.
    current: Blocks,
    /// Writes completed since the last flush, in issue order.
    volatile: Vec<(usize, Arc<Block>)>,
    reads: u64,
    writes: u64,
    flushes: u64,
    /// Writes and flushes allowed before the power cut (`None`: never cut).
    power_cut_after: Option<u64>,
    power_is_cut: bool,
}

impl State {
    fn operations(&self) -> u64 {
        self.writes + self.flushes
    }

    /// Account one write or flush; fails if the power is (or now goes) out.
    fn start_operation(&mut self) -> io::Result<()> {
        self.check_power()?;
        if let Some(limit) = self.power_cut_after {
            if self.operations() >= limit {
                self.power_is_cut = true;
                return Err(power_cut_error(limit));
            }
        }
        Ok(())
    }

    fn check_power(&self) -> io::Result<()> {
        if self.power_is_cut {
            return Err(power_cut_error(self.operations()));
        }
        Ok(())
    }

    fn index(&self, block: MetadataBlock) -> io::Result<usize> {
        usize::try_from(block.get())
            .ok()
            .filter(|&index| index < self.current.len())
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "metadata block {block} is outside the device ({} blocks)",
                        self.current.len()
                    ),
                )
            })
    }
}

fn power_cut_error(operations: u64) -> io::Error {
    io::Error::other(format!(
        "simulated power cut after {operations} writes and flushes"
    ))
}

/// A metadata device that keeps unflushed writes apart and can lose them at a simulated power
/// cut. See the module documentation for the workflow.
#[derive(Debug)]
pub struct CrashDevice {
    state: Mutex<State>,
}

impl CrashDevice {
    /// A zero-filled device of `block_count` blocks, all durable.
    pub fn new(block_count: u64) -> CrashDevice {
        let count = usize::try_from(block_count).expect("device size fits in memory");
        CrashDevice::from_blocks(vec![None; count])
    }

    /// A device whose durable image is a copy of `device` (for example a previous
    /// [`crash_image`](Self::crash_image), to crash again during recovery).
    pub fn from_device(device: &dyn BlockDevice) -> io::Result<CrashDevice> {
        let count = usize::try_from(device.block_count()).expect("device size fits in memory");
        let mut blocks = Vec::with_capacity(count);
        let mut buf = [0u8; BLOCK_SIZE];
        for index in 0..count {
            device.read(MetadataBlock::new(index as u64), &mut buf)?;
            blocks.push(if buf.iter().all(|&b| b == 0) {
                None
            } else {
                Some(Arc::new(buf))
            });
        }
        Ok(CrashDevice::from_blocks(blocks))
    }

    fn from_blocks(blocks: Blocks) -> CrashDevice {
        CrashDevice {
            state: Mutex::new(State {
                durable: blocks.clone(),
                current: blocks,
                volatile: Vec::new(),
                reads: 0,
                writes: 0,
                flushes: 0,
                power_cut_after: None,
                power_is_cut: false,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Cut the power once `operations` writes and flushes (counted since the device was
    /// made) have completed: the next write or flush, and every operation after it, fails.
    /// `Some(0)` fails the very first write or flush; a limit already reached fails the next
    /// one. `None` removes the limit (but does not restore power already cut).
    pub fn set_power_cut_after(&self, operations: Option<u64>) {
        self.lock().power_cut_after = operations;
    }

    /// Cut the power now: every further operation fails.
    pub fn cut_power(&self) {
        self.lock().power_is_cut = true;
    }

    /// Whether the power has been cut (by [`cut_power`](Self::cut_power) or the limit).
    pub fn is_power_cut(&self) -> bool {
        self.lock().power_is_cut
    }

    /// Reads attempted so far (including failed ones).
    pub fn read_count(&self) -> u64 {
        self.lock().reads
    }

    /// Writes that completed.
    pub fn write_count(&self) -> u64 {
        self.lock().writes
    }

    /// Flushes that completed.
    pub fn flush_count(&self) -> u64 {
        self.lock().flushes
    }

    /// Writes plus flushes that completed: the unit of [`set_power_cut_after`](Self::set_power_cut_after).
    pub fn operation_count(&self) -> u64 {
        self.lock().operations()
    }

    /// Writes completed since the last flush (what a power cut now may lose).
    pub fn volatile_write_count(&self) -> usize {
        self.lock().volatile.len()
    }

    /// The durable image only: what certainly survives a power cut now.
    pub fn snapshot_durable(&self) -> MemoryDevice {
        let state = self.lock();
        let device = MemoryDevice::new(state.durable.len() as u64);
        for (index, block) in state.durable.iter().enumerate() {
            if let Some(block) = block {
                write_block(&device, index, block);
            }
        }
        device
    }

    /// The latest contents, as reads see them (durable plus every volatile write).
    pub fn snapshot_current(&self) -> MemoryDevice {
        let state = self.lock();
        let device = MemoryDevice::new(state.current.len() as u64);
        for (index, block) in state.current.iter().enumerate() {
            if let Some(block) = block {
                write_block(&device, index, block);
            }
        }
        device
    }

    /// The device as it could look after a power cut now: the durable image plus the
    /// volatile writes that `mode` lets through, applied in issue order. Random choices come
    /// from `rng`, so a seeded generator makes the image reproducible. Does not change this
    /// device.
    pub fn crash_image<R: Rng + ?Sized>(&self, mode: CrashMode, rng: &mut R) -> MemoryDevice {
        let state = self.lock();
        let device = MemoryDevice::new(state.durable.len() as u64);
        for (index, block) in state.durable.iter().enumerate() {
            if let Some(block) = block {
                write_block(&device, index, block);
            }
        }
        for (index, block) in &state.volatile {
            match mode {
                CrashMode::DropAll => {}
                CrashMode::KeepRandomSubset => {
                    if rng.gen_bool(0.5) {
                        write_block(&device, *index, block);
                    }
                }
                CrashMode::Tear => {
                    if !rng.gen_bool(0.5) {
                        continue;
                    }
                    if rng.gen_bool(0.5) {
                        let sectors = rng.gen_range(1..SECTORS_PER_BLOCK);
                        let mut torn = [0u8; BLOCK_SIZE];
                        device
                            .read(MetadataBlock::new(*index as u64), &mut torn)
                            .expect("block inside the image");
                        let prefix_bytes = sectors * SECTOR_SIZE;
                        torn[..prefix_bytes].copy_from_slice(&block[..prefix_bytes]);
                        write_block(&device, *index, &torn);
                    } else {
                        write_block(&device, *index, block);
                    }
                }
            }
        }
        device
    }
}

fn write_block(device: &MemoryDevice, index: usize, block: &Block) {
    device
        .write(MetadataBlock::new(index as u64), block)
        .expect("block inside the image");
}

impl BlockDevice for CrashDevice {
    fn block_count(&self) -> u64 {
        self.lock().current.len() as u64
    }

    fn read(&self, block: MetadataBlock, buf: &mut Block) -> io::Result<()> {
        let mut state = self.lock();
        state.reads += 1;
        state.check_power()?;
        let index = state.index(block)?;
        match &state.current[index] {
            Some(stored) => buf.copy_from_slice(&stored[..]),
            None => buf.fill(0),
        }
        Ok(())
    }

    fn write(&self, block: MetadataBlock, buf: &Block) -> io::Result<()> {
        let mut state = self.lock();
        let index = state.index(block)?;
        state.start_operation()?;
        state.writes += 1;
        let stored = Arc::new(*buf);
        state.current[index] = Some(Arc::clone(&stored));
        state.volatile.push((index, stored));
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        let mut state = self.lock();
        state.start_operation()?;
        state.flushes += 1;
        let volatile = std::mem::take(&mut state.volatile);
        for (index, block) in volatile {
            state.durable[index] = Some(block);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
