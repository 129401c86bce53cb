//! Provisioning: what volume I/O needs from the pool, and nothing more.
//!
//! [`Provisioner`] is the volume's view of the pool: the data device, the mode, and the
//! three steps that change mappings:
//!
//! ```text
//!   alloc(volume)             reserve a data block in the metadata (short metadata lock);
//!                             out of space: commit once, then fail or wait per the policy
//!   alloc_many(count)         reserve several under one metadata lock hold (None: too few)
//!   map(volume, block, r)     queue Op::Insert for the reservation, publish it in the index
//!   map_many(volume, [..])    the same for several blocks under one metadata lock hold
//!   unmap(volume, block)      clear the index entry, queue Op::Remove
//! ```
//!
//! A [`Reservation`] not mapped (the write failed) is released when dropped. The caller
//! holds the volume's block lock for `block` across `map` and `unmap`: that lock orders the
//! index updates of one block, so a block is mapped once. The index is updated together
//! with the op queue, under the metadata lock, so the index always equals the trees plus
//! the queued ops, also when a metadata failure drops the queue.

use crate::engine::data_device::DataDevice;
use crate::engine::grace::Pin;
use crate::engine::index::INDEX_DATA_BLOCK_MAX;
use crate::engine::options::{FaultPoint, PoolMode, PoolOptions};
use crate::engine::shared::{Op, Shared, VolumeState};
use crate::error::{Error, Result};
use crate::ids::{BlockTime, DataBlock, VirtualBlock};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest wait on the space condition before checking the deadline again.
const SPACE_WAIT_STEP: Duration = Duration::from_millis(200);

/// Longest wait, out of space, for freed blocks to leave their grace period (pinned I/O
/// to finish) before the no-space policy applies.
const GRACE_WAIT_MAX: Duration = Duration::from_secs(5);

/// The pool as volume I/O sees it. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Provisioner {
    shared: Arc<Shared>,
}

/// A data block reserved for one write. Map it with [`Provisioner::map`]; dropping it
/// unmapped gives the block back.
#[must_use]
pub(crate) struct Reservation<'a> {
    provisioner: &'a Provisioner,
    block: DataBlock,
    /// The metadata generation it was reserved in (void once the metadata is reopened).
    generation: u64,
    mapped: bool,
}

impl Reservation<'_> {
    /// The reserved block.
    pub(crate) fn data_block(&self) -> DataBlock {
        self.block
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.mapped {
            self.provisioner.release(self.block, self.generation);
        }
    }
}

impl Provisioner {
    pub(crate) fn new(shared: Arc<Shared>) -> Provisioner {
        Provisioner { shared }
    }

    /// The pool's mode.
    pub(crate) fn mode(&self) -> PoolMode {
        self.shared.mode()
    }

    /// The data device.
    pub(crate) fn data(&self) -> &dyn DataDevice {
        &*self.shared.data
    }

    /// Data block size in bytes.
    pub(crate) fn block_size_bytes(&self) -> u64 {
        self.shared.block_size_bytes
    }

    /// The pool's options.
    pub(crate) fn options(&self) -> &PoolOptions {
        &self.shared.options
    }

    /// Pin the calling thread around a lookup and the data I/O it leads to (see `grace`):
    /// while pinned, take no lock and do not wait for space.
    #[inline]
    pub(crate) fn pin(&self) -> Pin<'_> {
        self.shared.readers.pin()
    }

    /// Make every completed write durable: commit (a pool read-only by option only
    /// flushes the data device).
    pub(crate) fn flush(&self) -> Result<()> {
        match self.mode() {
            PoolMode::ReadOnly if self.shared.options.read_only => self.shared.flush_data(),
            _ => self.shared.commit(),
        }
    }

    /// Reserve a data block for provisioning a block of `volume`. Out of space: commit
    /// (releasing blocks freed by discards), then error or wait per the pool's policy.
    ///
    /// A write waiting for space gives up (out of data space) as soon as a management
    /// operation pauses its volume (snapshot, resize): that operation waits for the writers
    /// inside the gate, and must not wait up to the no-space timeout. The write has changed
    /// nothing yet, and out of data space is what it gets at the timeout anyway.
    pub(crate) fn alloc(&self, volume: &VolumeState) -> Result<Reservation<'_>> {
        let shared = &*self.shared;
        // A zero timeout queues forever, as dm-thin's.
        let timeout = shared.options.no_space_timeout;
        let deadline = (!timeout.is_zero()).then(|| Instant::now() + timeout);
        let mut committed_once = false;
        loop {
            shared.check_changes_allowed()?;
            let mut meta = shared.lock_meta();
            let generation = meta.generation;
            let md = meta.md()?;
            match md.alloc_data_block() {
                Ok(block) => {
                    if block.get() > INDEX_DATA_BLOCK_MAX {
                        md.release_data_block(block);
                        return Err(Error::Invalid(format!(
                            "data block {block} beyond the engine's range"
                        )));
                    }
                    let usage = md.usage();
                    drop(meta);
                    self.reserved(usage.data_used_blocks, usage.data_total_blocks);
                    return Ok(Reservation {
                        provisioner: self,
                        block,
                        generation,
                        mapped: false,
                    });
                }
                Err(Error::OutOfDataSpace { block_count }) => {
                    drop(meta);
                    if !committed_once {
                        committed_once = true;
                        // Frees the blocks discards unmapped; they become reservable once
                        // the I/O pinned before their unmap is done.
                        shared.commit()?;
                        let grace = Instant::now() + GRACE_WAIT_MAX;
                        shared.wait_for_held(deadline.map_or(grace, |d| d.min(grace)));
                        continue;
                    }
                    let now = Instant::now();
                    let expired = deadline.is_some_and(|d| now >= d);
                    if shared.watch.may_grow() && !volume.gate.is_paused() {
                        // Autoextend can still grow the data: wait for it, whatever the
                        // policy and the timeout (the growth thread wakes us, or says it
                        // cannot grow).
                        shared.watch.request_space();
                        let meta = shared.lock_meta();
                        let _ = shared.space.wait_timeout(meta, SPACE_WAIT_STEP);
                        continue;
                    }
                    shared.set_mode(PoolMode::OutOfDataSpace);
                    if shared.options.error_if_no_space || expired || volume.gate.is_paused() {
                        return Err(Error::OutOfDataSpace { block_count });
                    }
                    // Queued: autoextend (if on) retries while writes wait.
                    shared.watch.request();
                    let meta = shared.lock_meta();
                    let wait = deadline.map_or(SPACE_WAIT_STEP, |d| (d - now).min(SPACE_WAIT_STEP));
                    let _ = shared.space.wait_timeout(meta, wait);
                    committed_once = false;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Reserve `count` data blocks under one hold of the metadata lock, for a write that
    /// provisions that many whole blocks. None when the pool has fewer free blocks (nothing
    /// stays reserved): the caller then provisions block by block through [`Provisioner::alloc`],
    /// which applies the no-space policy.
    pub(crate) fn alloc_many(&self, count: usize) -> Result<Option<Vec<Reservation<'_>>>> {
        let shared = &*self.shared;
        shared.check_changes_allowed()?;
        let mut meta = shared.lock_meta();
        let generation = meta.generation;
        let md = meta.md()?;
        let mut blocks = Vec::with_capacity(count);
        let failure = loop {
            if blocks.len() == count {
                break None;
            }
            match md.alloc_data_block() {
                Ok(block) if block.get() <= INDEX_DATA_BLOCK_MAX => blocks.push(block),
                Ok(block) => {
                    blocks.push(block);
                    break Some(Err(Error::Invalid(format!(
                        "data block {block} beyond the engine's range"
                    ))));
                }
                Err(Error::OutOfDataSpace { .. }) => break Some(Ok(None)),
                Err(e) => break Some(Err(e)),
            }
        };
        if let Some(result) = failure {
            for &block in &blocks {
                md.release_data_block(block);
            }
            return result;
        }
        let usage = md.usage();
        drop(meta);
        self.reserved(usage.data_used_blocks, usage.data_total_blocks);
        Ok(Some(
            blocks
                .into_iter()
                .map(|block| Reservation {
                    provisioner: self,
                    block,
                    generation,
                    mapped: false,
                })
                .collect(),
        ))
    }

    /// After a reservation: the low-water event and the autoextend request (`autoextend`),
    /// and leaving out-of-data-space mode.
    fn reserved(&self, used_blocks: u64, total_blocks: u64) {
        let shared = &*self.shared;
        shared
            .watch
            .after_reservation(shared, used_blocks, total_blocks);
        if shared.mode() == PoolMode::OutOfDataSpace {
            shared.set_mode(PoolMode::Write);
        }
    }

    /// Map `block` of `volume` to the reserved block, whose data is written: queue the
    /// mapping for the next commit and publish it in the index. The caller holds the
    /// volume's block lock for `block`, and `block` is unmapped or shared.
    pub(crate) fn map(
        &self,
        volume: &VolumeState,
        block: VirtualBlock,
        reservation: Reservation<'_>,
    ) -> Result<()> {
        self.map_many(volume, vec![(block, reservation)])
    }

    /// [`Provisioner::map`] for several blocks under one hold of the metadata lock, in
    /// order. The caller holds the block locks of every block. On an error nothing of
    /// `mappings` is queued or published (the reservations go back).
    pub(crate) fn map_many(
        &self,
        volume: &VolumeState,
        mut mappings: Vec<(VirtualBlock, Reservation<'_>)>,
    ) -> Result<()> {
        let time = self.shared.time();
        for (block, reservation) in &mappings {
            if let Some(old) = volume.index().lookup(*block) {
                assert!(
                    volume.is_shared(old),
                    "volume {:?} block {block}: provisioning over an unshared mapping",
                    volume.name
                );
                assert_ne!(old.data_block(), reservation.block, "a block maps once");
            }
        }
        let mut meta = self.shared.lock_meta();
        if let Some((_, stale)) = mappings
            .iter()
            .find(|(_, r)| r.generation != meta.generation)
        {
            // The metadata was abandoned since the block was reserved: the reservation
            // went with it, and the write cannot be recorded.
            let generation = stale.generation;
            for (_, reservation) in &mut mappings {
                if reservation.generation == generation {
                    reservation.mapped = true;
                }
            }
            drop(meta);
            return Err(Error::ReadOnly { needs_check: true });
        }
        // The volume's size only changes under this lock (and with its writers paused); a
        // write beyond it is refused, never queued.
        let block_count = volume.index().block_count();
        if let Some((block, _)) = mappings.iter().find(|(b, _)| b.get() >= block_count) {
            let block = *block;
            drop(meta);
            return Err(Error::Invalid(format!(
                "volume {:?}: block {block} is beyond its {block_count} blocks",
                volume.name
            )));
        }
        for (block, reservation) in &mut mappings {
            let mapping = BlockTime::new(reservation.block, time);
            meta.push(Op::Insert {
                volume: volume.id,
                block: *block,
                mapping,
            });
            reservation.mapped = true;
            self.shared.fault_point(FaultPoint::Map);
            // Published under the metadata lock, so a metadata failure (which drops the
            // queued ops and reloads the index under that lock) never misses it.
            volume.index().set(*block, mapping);
        }
        drop(meta);
        Ok(())
    }

    /// Unmap `block` of `volume` if it is mapped: clear the index entry and queue the
    /// removal. The caller holds the volume's block lock for `block`.
    pub(crate) fn unmap(&self, volume: &VolumeState, block: VirtualBlock) {
        if volume.index().lookup(block).is_some() {
            let mut meta = self.shared.lock_meta();
            volume.index().clear(block);
            meta.push(Op::Remove {
                volume: volume.id,
                block,
            });
        }
    }

    /// Give back a reservation that will not be mapped (its write failed).
    fn release(&self, block: DataBlock, generation: u64) {
        let mut meta = self.shared.lock_meta();
        if meta.generation != generation {
            return;
        }
        if let Some(md) = meta.md.as_mut() {
            let released = md.release_data_block(block);
            debug_assert!(released, "data block {block} was reserved");
        }
    }
}
