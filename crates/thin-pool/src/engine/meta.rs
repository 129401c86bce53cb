//! The metadata owner: [`Meta`] owns the metadata (behind its mutex, with the catalog, the
//! op queue, the reservations' generation and the grace-period limbo), the commit lock and
//! the pool time, and is the only code that changes them. Nothing of its state escapes:
//! callers use
//!
//! ```text
//!   reserve / reserve_many / release   a data block for one write (short metadata lock)
//!   queue(generation, |q| q.push(op))  ops for the next commit, published with the index
//!   commit                             lock_commit ─ count ops ─ flush data ─ lock meta ─
//!                                      apply ops ─ md.commit ─ park freed ─ reclaim
//!   changes()?.begin()? → Change       a management change: commit lock, data flushed,
//!                                      metadata locked; commit_catalog / commit_with / ...
//!   read(|view| ..)                    a look at the metadata under its mutex
//!   fail                               abandon the transaction (fail mode)
//! ```
//!
//! Ops queued while the data device is flushed are not covered by that flush and wait for
//! the next commit. Their reserved data blocks stay reserved in the metadata layer, outside
//! the committed space map (see `format::metadata::data_space`), so a crash never leaves a
//! mapping without its data nor a leaked block.
//!
//! Freed data blocks: a commit holds the blocks its transaction freed and parks them in the
//! limbo (`grace`); later reclaims release them (passing down those a discard, shrink,
//! delete or broken sharing freed) once no I/O pinned before their unmap is left.
//!
//! Locks, in the order they are taken: a volume's gate, the commit lock (one commit or
//! management operation at a time), a volume's block lock, the metadata mutex.
//!
//! Failure: a metadata operation refused before any change (see
//! [`PoolMetadata::transaction_failed`]) is reported and the transaction goes on; any other
//! failure abandons the transaction as dm-thin does (`metadata_failed`: read-only, or out of
//! metadata space, the metadata reopened and the indexes resynced). A panic holding the
//! metadata or the commit lock, or inside a commit, abandons it too and the pool fails
//! ([`Meta::fail`]): nothing of that transaction is written.
//!
//! One owner: before each commit (and before storing a catalog) the metadata owner reads
//! block 0 back and compares it with the superblock it last wrote (`written`), and the
//! catalog store checks that the catalog file is the one it last wrote. A difference is a
//! foreign write (a second writer bypassed the lock): the pool fails
//! ([`crate::Error::MetadataChangedUnderServer`], [`crate::Error::CatalogChangedUnderServer`])
//! and writes nothing over it.

use crate::engine::catalog::Catalog;
use crate::engine::index::Index;
use crate::engine::load::{build_index, TreeToIndex};
use crate::engine::meta_state::{fault_point, Grant, MetaParts, MetaState, Queue, View};
use crate::engine::options::{FaultPoint, PoolMode};
use crate::engine::stats::HistogramSnapshot;
use crate::engine::volumes::VolumeState;
use crate::error::{Error, Result};
use crate::format::metadata::PoolMetadata;
use crate::ids::{DataBlock, Time, TransactionId};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The metadata owner (see the module documentation).
pub(crate) struct Meta {
    state: Mutex<MetaState>,
    /// Serializes commits and management changes (everything that applies queued ops).
    commit_lock: Mutex<()>,
    /// The pool time new mappings are made at (the metadata's, mirrored for the data path).
    time: AtomicU32,
    parts: MetaParts,
}

impl Meta {
    pub(crate) fn new(parts: MetaParts, md: PoolMetadata, catalog: Catalog) -> Result<Meta> {
        assert_eq!(
            u64::from(md.data_block_size_sectors()) * 512,
            parts.block_size_bytes
        );
        assert_eq!(catalog.transaction_id, md.transaction_id().get());
        let time = md.pool_time()?;
        Ok(Meta {
            state: Mutex::new(MetaState::new(md, catalog)?),
            commit_lock: Mutex::new(()),
            time: AtomicU32::new(time.get()),
            parts,
        })
    }

    pub(crate) fn block_size_bytes(&self) -> u64 {
        self.parts.block_size_bytes
    }

    /// The pool time new mappings are made at.
    pub(crate) fn time(&self) -> Time {
        Time::new(self.time.load(Ordering::Acquire)).expect("only 24-bit times are stored")
    }

    /// Durations of the commits since the pool opened (lock-free).
    pub(crate) fn commit_durations(&self) -> HistogramSnapshot {
        self.parts.durations.snapshot()
    }

    /// Look at the metadata under its mutex.
    pub(crate) fn read<T>(&self, f: impl FnOnce(&View<'_>) -> T) -> T {
        let state = self.lock_state();
        f(&state.view())
    }

    /// Call the test-only fault hook, if any.
    pub(crate) fn fault_point(&self, point: FaultPoint) {
        fault_point(&self.parts.options, point);
    }

    /// Whether a commit would change anything (ops queued, or changes such as a grown space
    /// map).
    pub(crate) fn is_dirty(&self) -> bool {
        self.read(|view| !view.queue.is_empty() || view.md.is_some_and(|md| md.has_changes()))
    }

    /// Whether the mode lets metadata change (allocations, commits, management).
    pub(crate) fn check_changes_allowed(&self) -> Result<()> {
        match self.parts.health.mode() {
            PoolMode::Write | PoolMode::OutOfDataSpace => Ok(()),
            PoolMode::OutOfMetadataSpace => Err(Error::OutOfMetadataSpace {
                block_count: self.parts.device.block_count(),
            }),
            PoolMode::ReadOnly | PoolMode::Fail => Err(Error::ReadOnly {
                needs_check: !self.parts.options.read_only,
            }),
        }
    }

    pub(crate) fn flush_data(&self) -> Result<()> {
        self.parts.data.flush().map_err(|source| Error::Io {
            what: "flushing the data device".to_string(),
            source,
        })
    }

    /// Extend the metadata device to `blocks` (0: its current size); returns its blocks.
    pub(crate) fn extend_device(&self, blocks: u64) -> Result<u64> {
        self.parts
            .device
            .extend_to(blocks)
            .map_err(|source| Error::Io {
                what: "growing the metadata device".to_string(),
                source,
            })
    }

    /// Take the commit lock: no commit or management change runs until it is dropped.
    pub(crate) fn turn(&self) -> Turn<'_> {
        Turn {
            meta: self,
            _commit: self.lock_commit(),
        }
    }

    /// [`Meta::turn`], refused unless the mode lets metadata change.
    pub(crate) fn changes(&self) -> Result<Turn<'_>> {
        let turn = self.turn();
        self.check_changes_allowed()?;
        Ok(turn)
    }

    /// Commit: take the ops queued now, flush data, apply them, commit metadata.
    pub(crate) fn commit(&self) -> Result<()> {
        let turn = self.changes()?;
        let started = Instant::now();
        let mut change = turn.begin()?;
        let taken = change.taken;
        let result = change.commit();
        drop(change);
        self.log_if_slow(started.elapsed(), taken);
        result
    }

    /// A commit (data flush included) that takes [`PoolOptions::slow_commit_threshold`] or
    /// more is logged at warn: the disks are slow or overloaded.
    fn log_if_slow(&self, elapsed: Duration, ops: usize) {
        if self
            .parts
            .options
            .slow_commit_threshold
            .is_some_and(|threshold| elapsed >= threshold)
        {
            tracing::warn!(
                milliseconds = elapsed.as_millis() as u64,
                ops,
                "slow commit"
            );
        }
    }

    /// Reserve a data block (no policy: out of space is the caller's to handle).
    pub(crate) fn reserve(&self) -> Result<(DataBlock, Grant)> {
        self.lock_state().reserve()
    }

    /// Reserve `count` data blocks under one hold of the metadata lock. None when the pool
    /// has fewer free blocks (nothing stays reserved).
    pub(crate) fn reserve_many(&self, count: usize) -> Result<Option<(Vec<DataBlock>, Grant)>> {
        self.lock_state().reserve_many(count)
    }

    /// Give back a reservation of `generation` that will not be mapped.
    pub(crate) fn release(&self, block: DataBlock, generation: u64) {
        self.lock_state().release(block, generation)
    }

    /// Queue ops for the next commit: `f` pushes them (and publishes them in the index)
    /// under the metadata mutex, so a metadata failure (which drops the queue and resyncs
    /// the indexes under it) never misses one. With `generation`, refused (read-only, needs
    /// check) once the metadata that generation's reservations lived in was abandoned.
    pub(crate) fn queue<T>(
        &self,
        generation: Option<u64>,
        f: impl FnOnce(&mut Queue<'_>) -> Result<T>,
    ) -> Result<T> {
        self.lock_state().queue(&self.parts.options, generation, f)
    }

    /// Wait (up to `timeout`) for data space: a growth, a release, a failure.
    pub(crate) fn wait_for_space(&self, timeout: Duration) {
        let state = self.lock_state();
        let _ = self.parts.space.wait_timeout(state, timeout);
    }

    /// Wake the writes waiting for data space.
    pub(crate) fn notify_space(&self) {
        self.parts.space.notify_all();
    }

    /// Wait (until `deadline`) for every held block to be released: pinned I/O is short
    /// and takes no lock, so this ends unless a device stalls. The caller is not pinned.
    pub(crate) fn wait_for_held(&self, deadline: Instant) {
        let mut pause = Duration::from_micros(10);
        loop {
            {
                let mut state = self.lock_state();
                state.reclaim(&self.parts);
                if state.limbo_is_empty() {
                    break;
                }
            }
            if Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(5));
        }
        self.parts.space.notify_all();
    }

    /// Release the held blocks no pinned I/O can reach any more, if any are held.
    pub(crate) fn reclaim_now(&self) {
        let mut state = self.lock_state();
        if !state.limbo_is_empty() {
            state.reclaim(&self.parts);
        }
    }

    /// `volume`'s index, built from its mapping tree if it has none yet (see `volumes`).
    /// Once built this is one atomic load. The build holds the commit lock for a walk of the
    /// volume's tree (17 ms for 1M mappings; commits and management operations wait, reads
    /// and writes go on) and the metadata mutex only for a moment before and after it.
    /// Fails if the metadata is gone or the tree breaks a rule the index relies on.
    pub(crate) fn index<'v>(&self, volume: &'v VolumeState) -> Result<&'v Arc<Index>> {
        if let Some(index) = volume.loaded_index() {
            return Ok(index);
        }
        // The tree of a volume without an index is its committed one (no queued op of it
        // exists), whose blocks are never written in place: read without the mutex.
        let _commit = self.lock_commit();
        if let Some(index) = volume.loaded_index() {
            return Ok(index);
        }
        let tree = self.read(|view| TreeToIndex::of(view.md()?, volume))?;
        let index = build_index(&tree, volume, self.parts.block_size_bytes).inspect_err(|e| {
            self.parts.health.log_warn(format!(
                "volume {:?}: building its index failed: {e}",
                volume.name()
            ))
        })?;
        // Set under the metadata mutex, which `list`, the commit's assertion and the resync
        // after a metadata failure read indexes under.
        let _state = self.lock_state();
        Ok(volume.set_index(index, self.parts.block_size_bytes))
    }

    /// Abandon the transaction and enter fail mode (see `MetaState::fail_locked`).
    pub(crate) fn fail(&self, reason: String) {
        let mut state = self.lock_state();
        if self.parts.health.mode() != PoolMode::Fail {
            state.fail_locked(&self.parts, reason);
        }
    }

    /// The metadata lock. Poisoned (a thread panicked holding it, maybe half-way through
    /// changing the transaction): the pool fails first.
    fn lock_state(&self) -> MutexGuard<'_, MetaState> {
        match self.state.lock() {
            Ok(state) => state,
            Err(poisoned) => {
                let mut state = poisoned.into_inner();
                state.fail_locked(
                    &self.parts,
                    "a thread panicked holding the metadata lock".to_string(),
                );
                self.state.clear_poison();
                state
            }
        }
    }

    /// The commit lock. Poisoned (a commit or management operation panicked, maybe between
    /// its catalog and its metadata change): the pool fails first.
    fn lock_commit(&self) -> MutexGuard<'_, ()> {
        match self.commit_lock.lock() {
            Ok(guard) => guard,
            Err(poisoned) => {
                let guard = poisoned.into_inner();
                self.fail("a commit or management operation panicked".to_string());
                self.commit_lock.clear_poison();
                guard
            }
        }
    }

    /// Count the queued ops, flush the data device (their data is now durable), lock the
    /// metadata. Returns the lock and how many ops may be applied: ops queued during the
    /// flush are not covered by it and wait for the next commit.
    fn flush_and_lock(&self) -> Result<(MutexGuard<'_, MetaState>, usize)> {
        let started = Instant::now();
        let taken = self.lock_state().queued_count();
        self.flush_data()?;
        let mut state = self.lock_state();
        state.start_commit(started);
        assert!(taken <= state.queued_count() || state.view().md.is_none());
        Ok((state, taken))
    }
}

/// The commit lock, held: no commit or management change runs meanwhile ([`Meta::turn`]).
pub(crate) struct Turn<'a> {
    meta: &'a Meta,
    _commit: MutexGuard<'a, ()>,
}

impl<'a> Turn<'a> {
    /// Look at the metadata under its mutex.
    pub(crate) fn read<T>(&self, f: impl FnOnce(&View<'_>) -> T) -> T {
        self.meta.read(f)
    }

    /// Flush the data device and lock the metadata: the change may apply every op queued
    /// before the flush.
    pub(crate) fn begin(self) -> Result<Change<'a>> {
        let (state, taken) = self.meta.flush_and_lock()?;
        Ok(Change {
            state,
            meta: self.meta,
            taken,
            _turn: self,
        })
    }
}

/// A management change under way: the commit lock and the metadata mutex held, the ops
/// queued before the data flush ready to apply. Each `commit*` method applies them and
/// commits one transaction.
pub(crate) struct Change<'a> {
    state: MutexGuard<'a, MetaState>,
    meta: &'a Meta,
    /// Queued ops the data flush covered (not applied yet).
    taken: usize,
    _turn: Turn<'a>,
}

impl<'a> Change<'a> {
    pub(crate) fn view(&self) -> View<'_> {
        self.state.view()
    }

    /// Release the metadata lock, keep the commit lock.
    pub(crate) fn into_turn(self) -> Turn<'a> {
        let Change { state, _turn, .. } = self;
        drop(state);
        _turn
    }

    pub(crate) fn catalog(&self) -> &Catalog {
        self.state.catalog()
    }

    /// Apply the ops the flush covered and commit.
    pub(crate) fn commit(&mut self) -> Result<()> {
        let taken = std::mem::take(&mut self.taken);
        self.state.commit_locked(&self.meta.parts, taken)
    }

    /// Apply the ops, run `change` on the metadata and commit.
    pub(crate) fn commit_with<T>(
        &mut self,
        change: impl FnOnce(&mut PoolMetadata) -> Result<T>,
    ) -> Result<T> {
        let taken = std::mem::take(&mut self.taken);
        self.state.apply_ops(&self.meta.parts, taken)?;
        self.state.commit_change(&self.meta.parts, change)
    }

    /// A change of volumes: store `catalog` as transaction T + 1, apply the ops, make the
    /// change and `set_transaction_id(T, T + 1)`, commit; then `catalog` is the catalog. A
    /// crash before the commit reopens the pool as it was (catalog T + 1 discarded).
    pub(crate) fn commit_catalog(
        &mut self,
        mut catalog: Catalog,
        change: impl FnOnce(&mut PoolMetadata) -> Result<()>,
    ) -> Result<()> {
        let meta = self.meta;
        let taken = std::mem::take(&mut self.taken);
        self.state.apply_ops(&meta.parts, taken)?;
        let current = self.state.md()?.transaction_id();
        let next = current.next();
        catalog.transaction_id = next.get();
        self.state.store_catalog(&meta.parts, &catalog)?;
        self.state.commit_change(&meta.parts, |md| {
            fault_point(&meta.parts.options, FaultPoint::ManagementChange);
            change(md)?;
            md.set_transaction_id(current, next)
        })?;
        assert_eq!(self.state.md()?.transaction_id(), next);
        self.state.set_catalog(catalog);
        meta.parts.catalog_store.committed(next.get())?;
        Ok(())
    }

    /// Set the user transaction id (the catalog follows it).
    pub(crate) fn set_transaction_id(
        &mut self,
        current: TransactionId,
        new: TransactionId,
    ) -> Result<()> {
        let meta = self.meta;
        let mut catalog = self.state.catalog().clone();
        catalog.transaction_id = new.get();
        self.state.store_catalog(&meta.parts, &catalog)?;
        self.state.md()?.set_transaction_id(current, new)?;
        self.commit()?;
        self.state.set_catalog(catalog);
        meta.parts.catalog_store.committed(new.get())?;
        Ok(())
    }

    /// Record `blocks` data blocks (if more than now) and commit; returns the data blocks.
    pub(crate) fn extend_data(&mut self, blocks: u64) -> Result<u64> {
        let md = self.state.md()?;
        if blocks > md.data_space_map().block_count() {
            md.extend_data(blocks)?;
            self.commit()?;
        }
        let blocks_now = self.state.md()?.data_space_map().block_count();
        assert!(
            blocks_now >= blocks,
            "the data space map covers {blocks} blocks"
        );
        Ok(blocks_now)
    }

    /// Let the metadata space map manage `blocks` metadata blocks and commit; returns the
    /// blocks it manages. Refused on metadata that needs a check.
    pub(crate) fn extend_metadata(&mut self, blocks: u64) -> Result<u64> {
        if self.state.view().md.is_some_and(|md| md.needs_check()) {
            return Err(Error::ReadOnly { needs_check: true });
        }
        let result = self.state.md()?.extend_metadata(blocks);
        let total = self.state.checked(&self.meta.parts, result)?;
        if self.meta.parts.health.mode() == PoolMode::OutOfMetadataSpace {
            self.meta.parts.health.set_mode(PoolMode::Write);
        }
        self.commit()?;
        Ok(total)
    }

    /// The blocks the last commit freed are in no index now: release (and pass down) at once.
    pub(crate) fn reclaim_freed(&mut self) {
        self.state.reclaim_freed(&self.meta.parts);
    }

    /// Take the metadata's pool time (a snapshot or revert advanced it) as the time new
    /// mappings are made at.
    pub(crate) fn advance_time(&mut self) -> Result<Time> {
        let time = self.state.md()?.pool_time()?;
        let before = self.meta.time.swap(time.get(), Ordering::AcqRel);
        assert!(before <= time.get(), "the pool time only grows");
        Ok(time)
    }
}
