//! Provisioning: what volume I/O needs from the pool, and nothing more.
//!
//! [`Provisioner`] is the volume's view of the pool: the data device, the mode, the grace
//! pins, and the steps that change mappings, over the metadata owner (`meta`):
//!
//! ```text
//!   alloc(volume, wait)       reserve a data block (Meta::reserve, short metadata lock);
//!                             out of space: commit once, then fail or wait per the policy
//!                             (Alloc::Paused: the volume is being paused, sit it out)
//!   alloc_many(count)         reserve several under one metadata lock hold (None: too few)
//!   map(volume, block, r)     queue Op::Insert for the reservation, publish it in the index
//!   map_many(volume, [..])    the same for several blocks under one metadata lock hold
//!   unmap(volume, block)      clear the index entry, queue Op::Remove
//! ```
//!
//! A [`Reservation`] not mapped (the write failed) is released when dropped. The caller
//! holds the volume's block lock for `block` across `map` and `unmap`: that lock orders the
//! index updates of one block, so a block is mapped once. The index is updated together
//! with the op queue, under the metadata lock (`Meta::queue`), so the index always equals
//! the trees plus the queued ops, also when a metadata failure drops the queue.
//!
//! **What queue-until-space guarantees.** Out of data space with the queue policy, a write
//! waits up to the no-space timeout (zero: forever), counted from the first wait of its
//! piece ([`SpaceWait`]), then fails with out of data space having changed nothing of that
//! piece. A snapshot or resize pausing its volume neither fails it nor waits for it: `alloc`
//! answers [`Alloc::Paused`], the write drops its block lock, leaves the gate until the
//! pause is over (`Pass::sit_out_pause`) and asks again, looking the block up anew, so it
//! lands after the operation as a write issued then would (after a snapshot it breaks the
//! sharing). Only `error_if_no_space`, or a deadline already past, fails it during a pause
//! (it would not wait anyway).

use crate::engine::data_device::DataDevice;
use crate::engine::grace::{Pin, Readers};
use crate::engine::health::Health;
use crate::engine::meta::Meta;
use crate::engine::meta_state::Grant;
use crate::engine::options::{FaultPoint, PoolMode, PoolOptions};
use crate::engine::queue::Op;
use crate::engine::space::SpaceWatch;
use crate::engine::volumes::{Lookup, VolumeState};
use crate::error::{Error, Result};
use crate::ids::{BlockTime, DataBlock, VirtualBlock};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest wait on the space condition before checking the deadline again.
const SPACE_WAIT_STEP: Duration = Duration::from_millis(200);

/// Longest wait, out of space, for freed blocks to leave their grace period (pinned I/O
/// to finish) before the no-space policy applies.
const GRACE_WAIT_MAX: Duration = Duration::from_secs(5);

/// One write piece's wait for data space ([`Provisioner::space_wait`]): its deadline (None:
/// queue forever), set when the piece first asked.
pub(crate) struct SpaceWait {
    deadline: Option<Instant>,
}

/// What [`Provisioner::alloc`] got.
#[must_use]
pub(crate) enum Alloc<'a> {
    /// A data block, reserved.
    Reserved(Reservation<'a>),
    /// No space yet, and the volume's writers are being paused: sit the pause out, holding
    /// no block lock, and ask again with the same [`SpaceWait`].
    Paused,
}

/// The owners a provisioner uses.
pub(crate) struct ProvisionParts {
    pub(crate) meta: Arc<Meta>,
    pub(crate) data: Arc<dyn DataDevice>,
    pub(crate) options: Arc<PoolOptions>,
    pub(crate) readers: Arc<Readers>,
    pub(crate) watch: Arc<SpaceWatch>,
    pub(crate) health: Arc<Health>,
}

/// The pool as volume I/O sees it. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Provisioner {
    parts: Arc<ProvisionParts>,
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
            self.provisioner
                .parts
                .meta
                .release(self.block, self.generation);
        }
    }
}

impl Provisioner {
    pub(crate) fn new(parts: ProvisionParts) -> Provisioner {
        Provisioner {
            parts: Arc::new(parts),
        }
    }

    /// The pool's mode.
    #[inline]
    pub(crate) fn mode(&self) -> PoolMode {
        self.parts.health.mode()
    }

    /// The data device.
    #[inline]
    pub(crate) fn data(&self) -> &dyn DataDevice {
        &*self.parts.data
    }

    /// Data block size in bytes.
    #[inline]
    pub(crate) fn block_size_bytes(&self) -> u64 {
        self.parts.meta.block_size_bytes()
    }

    /// The pool's options.
    pub(crate) fn options(&self) -> &PoolOptions {
        &self.parts.options
    }

    /// Pin the calling thread around a lookup and the data I/O it leads to (see `grace`):
    /// while pinned, take no lock and do not wait for space.
    #[inline]
    pub(crate) fn pin(&self) -> Pin<'_> {
        self.parts.readers.pin()
    }

    /// Make every completed write durable: commit (a pool read-only by option only
    /// flushes the data device).
    pub(crate) fn flush(&self) -> Result<()> {
        match self.mode() {
            PoolMode::ReadOnly if self.parts.options.read_only => self.parts.meta.flush_data(),
            _ => self.parts.meta.commit(),
        }
    }

    /// The wait for space of one write piece, kept across its [`Provisioner::alloc`]
    /// calls: the no-space deadline counts from the first.
    pub(crate) fn space_wait(&self) -> SpaceWait {
        // A zero timeout queues forever, as dm-thin's.
        let timeout = self.parts.options.no_space_timeout;
        SpaceWait {
            deadline: (!timeout.is_zero()).then(|| Instant::now() + timeout),
        }
    }

    /// Reserve a data block for provisioning a block of `volume`. Out of space: commit
    /// (releasing blocks freed by discards), then error or wait per the pool's policy, up
    /// to `wait`'s deadline.
    ///
    /// A write waiting for space while a management operation pauses its volume (snapshot,
    /// resize) gets [`Alloc::Paused`]: that operation waits for the writers inside the gate,
    /// so the caller drops its block locks, sits the pause out (`Pass::sit_out_pause`) and
    /// asks again with the same `wait`; the write has changed nothing of this piece yet.
    pub(crate) fn alloc(&self, volume: &VolumeState, wait: &SpaceWait) -> Result<Alloc<'_>> {
        let parts = &*self.parts;
        let meta = &*parts.meta;
        let deadline = wait.deadline;
        let mut committed_once = false;
        loop {
            meta.check_changes_allowed()?;
            let block_count = match meta.reserve() {
                Ok((block, grant)) => return Ok(Alloc::Reserved(self.reserved(block, grant))),
                Err(Error::OutOfDataSpace { block_count }) => block_count,
                Err(e) => return Err(e),
            };
            if !committed_once {
                committed_once = true;
                // Frees the blocks discards unmapped; they become reservable once the I/O
                // pinned before their unmap is done.
                meta.commit()?;
                let grace = Instant::now() + GRACE_WAIT_MAX;
                meta.wait_for_held(deadline.map_or(grace, |d| d.min(grace)));
                continue;
            }
            let now = Instant::now();
            let expired = deadline.is_some_and(|d| now >= d);
            let may_grow = parts.watch.may_grow();
            let gives_up = parts.options.error_if_no_space || expired;
            if volume.gate().is_paused() && (may_grow || !gives_up) {
                // It would wait: not inside the gate a pauser waits on.
                return Ok(Alloc::Paused);
            }
            if may_grow {
                // Autoextend can still grow the data: wait for it, whatever the policy and
                // the timeout (the worker wakes us, or says it cannot grow).
                parts.watch.request_space();
                meta.wait_for_space(SPACE_WAIT_STEP);
                continue;
            }
            parts.health.set_mode(PoolMode::OutOfDataSpace);
            if gives_up {
                return Err(Error::OutOfDataSpace { block_count });
            }
            // Queued: autoextend (if on) retries while writes wait.
            parts.watch.request();
            meta.wait_for_space(
                deadline.map_or(SPACE_WAIT_STEP, |d| (d - now).min(SPACE_WAIT_STEP)),
            );
            committed_once = false;
        }
    }

    /// Reserve `count` data blocks under one hold of the metadata lock, for a write that
    /// provisions that many whole blocks. None when the pool has fewer free blocks (nothing
    /// stays reserved): the caller then provisions block by block through
    /// [`Provisioner::alloc`], which applies the no-space policy.
    pub(crate) fn alloc_many(&self, count: usize) -> Result<Option<Vec<Reservation<'_>>>> {
        assert!(count > 0, "a run reserves at least one block");
        self.parts.meta.check_changes_allowed()?;
        let Some((blocks, grant)) = self.parts.meta.reserve_many(count)? else {
            return Ok(None);
        };
        assert_eq!(blocks.len(), count);
        self.after_reservation(grant);
        Ok(Some(
            blocks
                .into_iter()
                .map(|block| Reservation {
                    provisioner: self,
                    block,
                    generation: grant.generation,
                    mapped: false,
                })
                .collect(),
        ))
    }

    fn reserved(&self, block: DataBlock, grant: Grant) -> Reservation<'_> {
        self.after_reservation(grant);
        Reservation {
            provisioner: self,
            block,
            generation: grant.generation,
            mapped: false,
        }
    }

    /// After a reservation: the low-water event and the autoextend request (`space`), and
    /// leaving out-of-data-space mode.
    fn after_reservation(&self, grant: Grant) {
        let parts = &*self.parts;
        parts
            .watch
            .after_reservation(grant.data_used_blocks, grant.data_total_blocks);
        if parts.health.mode() == PoolMode::OutOfDataSpace {
            parts.health.set_mode(PoolMode::Write);
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
        let Some(generation) = mappings.first().map(|(_, r)| r.generation) else {
            return Ok(());
        };
        let time = self.parts.meta.time();
        let index = volume.index();
        for (block, reservation) in &mappings {
            assert_eq!(
                reservation.generation, generation,
                "one reservation generation"
            );
            assert!(!reservation.mapped, "a reservation is mapped once");
            match volume.classify(index.lookup(*block)) {
                Lookup::Unmapped => {}
                Lookup::Shared(old) => {
                    assert_ne!(old, reservation.block, "a block maps once")
                }
                Lookup::Exclusive(_) => panic!(
                    "volume {:?} block {block}: provisioning over an unshared mapping",
                    volume.name()
                ),
            }
        }
        let queued = self.parts.meta.queue(Some(generation), |queue| {
            // The volume's size only changes under this lock (and with its writers
            // paused); a write beyond it is refused, never queued.
            let block_count = index.block_count();
            if let Some((block, _)) = mappings.iter().find(|(b, _)| b.get() >= block_count) {
                return Err(Error::BlockBeyondVolume {
                    volume: volume.name().to_string(),
                    block: *block,
                    block_count,
                });
            }
            for (block, reservation) in &mut mappings {
                let mapping = BlockTime::new(reservation.block, time);
                queue.push(Op::Insert {
                    volume: volume.id(),
                    block: *block,
                    mapping,
                });
                reservation.mapped = true;
                queue.fault_point(FaultPoint::Map);
                // Published under the metadata lock, so a metadata failure (which drops the
                // queued ops and reloads the index under that lock) never misses it.
                index.set(*block, mapping);
            }
            Ok(())
        });
        if let Err(Error::ReadOnly { needs_check: true }) = &queued {
            // The metadata was abandoned since the blocks were reserved: the reservations
            // went with it, and the write cannot be recorded.
            for (_, reservation) in &mut mappings {
                reservation.mapped = true;
            }
        }
        assert!(
            queued.is_err() || mappings.iter().all(|(_, r)| r.mapped),
            "every mapping is queued once"
        );
        queued
    }

    /// Unmap `block` of `volume` if it is mapped: clear the index entry and queue the
    /// removal. The caller holds the volume's block lock for `block`.
    pub(crate) fn unmap(&self, volume: &VolumeState, block: VirtualBlock) {
        let index = volume.index();
        if index.lookup(block).is_some() {
            let queued = self.parts.meta.queue(None, |queue| {
                index.clear(block);
                queue.push(Op::Remove {
                    volume: volume.id(),
                    block,
                });
                Ok(())
            });
            assert!(queued.is_ok(), "an unmap is always queued");
            debug_assert!(index.lookup(block).is_none());
        }
    }
}
