//! The state inside the metadata owner's mutex ([`MetaState`]) and what it does while
//! locked: reserve and release data blocks, queue ops, apply them and commit, park and
//! reclaim freed blocks, and fail safe (abandon the transaction). The lower half of the
//! metadata owner: only `meta` (its upper half, which holds the locks) owns a
//! `MetaState`, so nothing here is reachable but through it. See `meta` for the protocol.

use crate::engine::catalog::{Catalog, CatalogStore};
use crate::engine::data_device::DataDevice;
use crate::engine::grace::{Held, Limbo, Readers};
use crate::engine::health::Health;
use crate::engine::index::INDEX_DATA_BLOCK_MAX;
use crate::engine::limits::{block_runs, metadata_blocks_for_ops, metadata_reserve_blocks};
use crate::engine::options::{FaultPoint, PoolMode, PoolOptions};
use crate::engine::queue::{apply_op, Op, OpQueue};
use crate::engine::recovery::resync_indexes;
use crate::engine::space::SpaceWatch;
use crate::engine::stats::DurationHistogram;
use crate::engine::volumes::Volumes;
use crate::engine::written::LastWritten;
use crate::error::{Error, Result};
use crate::format::metadata::{PoolMetadata, Usage};
use crate::ids::DataBlock;
use persistent_data::BlockDevice;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar};
use std::time::{Duration, Instant};

/// What the metadata mutex guards.
pub(crate) struct MetaState {
    /// The metadata; None only after it was abandoned and could not be reopened.
    md: Option<PoolMetadata>,
    /// Bumped each time `md` is abandoned: reservations made before are void.
    generation: u64,
    catalog: Catalog,
    queue: OpQueue,
    /// Data blocks freed by commits, held until no I/O pinned before they were unmapped
    /// is left (`grace`).
    limbo: Limbo,
    /// When the commit under way started (its data flush).
    commit_started: Option<Instant>,
    /// Block 0 as `md` last wrote (or read) it: each commit checks it is still on disk.
    written: LastWritten,
}

impl MetaState {
    pub(crate) fn new(mut md: PoolMetadata, catalog: Catalog) -> Result<MetaState> {
        md.hold_freed_data_blocks();
        let written = LastWritten::of(&md)?;
        Ok(MetaState {
            md: Some(md),
            generation: 0,
            catalog,
            queue: OpQueue::default(),
            limbo: Limbo::default(),
            commit_started: None,
            written,
        })
    }

    pub(crate) fn md(&mut self) -> Result<&mut PoolMetadata> {
        self.md
            .as_mut()
            .ok_or(Error::ReadOnly { needs_check: true })
    }

    pub(crate) fn view(&self) -> View<'_> {
        View {
            md: self.md.as_ref(),
            catalog: &self.catalog,
            generation: self.generation,
            queue: &self.queue,
        }
    }

    pub(crate) fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    /// The catalog of the transaction just committed.
    pub(crate) fn set_catalog(&mut self, catalog: Catalog) {
        assert_eq!(
            Some(catalog.transaction_id),
            self.md.as_ref().map(|md| md.transaction_id().get()),
            "the catalog follows the metadata's transaction"
        );
        self.catalog = catalog;
    }

    pub(crate) fn queued_count(&self) -> usize {
        self.queue.len()
    }

    pub(crate) fn limbo_is_empty(&self) -> bool {
        self.limbo.is_empty()
    }

    /// A commit (or management change) starts at `at`: its data flush.
    pub(crate) fn start_commit(&mut self, at: Instant) {
        self.commit_started = Some(at);
    }

    /// Reserve a data block (no policy: out of space is the caller's to handle).
    pub(crate) fn reserve(&mut self) -> Result<(DataBlock, Grant)> {
        let generation = self.generation;
        let md = self.md()?;
        let block = md.alloc_data_block()?;
        if block.get() > INDEX_DATA_BLOCK_MAX {
            md.release_data_block(block);
            return Err(Error::DataBlockBeyondEngine { block });
        }
        let usage = md.usage();
        assert!(
            block.get() < usage.data_total_blocks,
            "a reserved block is inside the data space map"
        );
        Ok((block, grant(generation, &usage)))
    }

    /// Reserve `count` data blocks under one hold of the metadata lock. None when the pool
    /// has fewer free blocks (nothing stays reserved).
    pub(crate) fn reserve_many(&mut self, count: usize) -> Result<Option<(Vec<DataBlock>, Grant)>> {
        assert!(count > 0);
        let generation = self.generation;
        let md = self.md()?;
        let mut blocks = Vec::with_capacity(count);
        let failure = loop {
            if blocks.len() == count {
                break None;
            }
            match md.alloc_data_block() {
                Ok(block) if block.get() <= INDEX_DATA_BLOCK_MAX => blocks.push(block),
                Ok(block) => {
                    blocks.push(block);
                    break Some(Err(Error::DataBlockBeyondEngine { block }));
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
        debug_assert!(
            {
                let mut sorted = blocks.clone();
                sorted.sort_unstable();
                sorted.windows(2).all(|w| w[0] != w[1])
            },
            "each block is reserved once"
        );
        let usage = md.usage();
        Ok(Some((blocks, grant(generation, &usage))))
    }

    /// Give back a reservation of `generation` that will not be mapped.
    pub(crate) fn release(&mut self, block: DataBlock, generation: u64) {
        if self.generation != generation {
            return;
        }
        if let Some(md) = self.md.as_mut() {
            let released = md.release_data_block(block);
            debug_assert!(released, "data block {block} was reserved");
        }
    }

    /// Queue ops for the next commit: `f` pushes them (and publishes them in the index)
    /// under the metadata mutex, so a metadata failure (which drops the queue and resyncs
    /// the indexes under it) never misses one. With `generation`, refused (read-only, needs
    /// check) once the metadata that generation's reservations lived in was abandoned.
    pub(crate) fn queue<T>(
        &mut self,
        options: &PoolOptions,
        generation: Option<u64>,
        f: impl FnOnce(&mut Queue<'_>) -> Result<T>,
    ) -> Result<T> {
        if generation.is_some_and(|g| g != self.generation) {
            return Err(Error::ReadOnly { needs_check: true });
        }
        assert!(generation.is_none_or(|g| g == self.generation));
        let before = self.queue.len();
        let result = f(&mut Queue {
            ops: &mut self.queue,
            options,
        });
        debug_assert!(
            result.is_ok() || self.queue.len() == before,
            "a refused queue adds nothing"
        );
        result
    }

    /// Abandon the transaction and enter fail mode: the in-memory metadata (with whatever
    /// part of the transaction was applied) is dropped without writing anything, so the
    /// device keeps the last committed transaction; queued ops and reservations go with it
    /// (writes holding a reservation fail), and waiters for space wake up to fail.
    pub(crate) fn fail_locked(&mut self, parts: &MetaParts, reason: String) {
        let health = &parts.health;
        health.record_fail_reason(&reason);
        health.log_warn(format!(
            "pool failed: {reason}; the transaction is abandoned, the last commit stays on disk"
        ));
        self.md = None;
        self.generation += 1;
        self.queue.drop_all();
        health.set_mode(PoolMode::Fail);
        parts.space.notify_all();
        assert!(self.md.is_none() && self.queue.is_empty());
        assert_eq!(health.mode(), PoolMode::Fail);
    }

    /// Run `operation` on the locked metadata; if it panics, fail the pool and return the
    /// panic as an error instead of unwinding further.
    pub(crate) fn contained<T>(
        &mut self,
        parts: &MetaParts,
        what: &str,
        operation: impl FnOnce(&mut MetaState) -> Result<T>,
    ) -> Result<T> {
        let result = catch_unwind(AssertUnwindSafe(|| operation(&mut *self)));
        result.unwrap_or_else(|payload| {
            let reason = format!("{what} panicked: {}", panic_message(&*payload));
            self.fail_locked(parts, reason.clone());
            Err(Error::Internal(reason))
        })
    }

    /// Apply `count` ops and commit; the data device was flushed after they were queued.
    pub(crate) fn commit_locked(&mut self, parts: &MetaParts, count: usize) -> Result<()> {
        self.apply_ops(parts, count)?;
        self.commit_change(parts, |_| Ok(()))?;
        // Every block this commit freed was unmapped from its index when its op was queued.
        self.reclaim_freed(parts);
        Ok(())
    }

    /// Once the blocks the last commit freed are unmapped from every index: start their
    /// grace period now and, if no I/O pinned before is left (the usual case), release
    /// them and pass them down at once.
    pub(crate) fn reclaim_freed(&mut self, parts: &MetaParts) {
        #[cfg(debug_assertions)]
        crate::engine::recovery::assert_not_in_limbo(&parts.volumes, self.limbo.blocks());
        self.reclaim(parts);
        self.reclaim(parts);
    }

    /// Run `change` on the metadata and commit. A change refused before it changed anything
    /// leaves the transaction (with the ops applied so far) for the next commit.
    pub(crate) fn commit_change<T>(
        &mut self,
        parts: &MetaParts,
        change: impl FnOnce(&mut PoolMetadata) -> Result<T>,
    ) -> Result<T> {
        self.contained(parts, "a metadata commit", |state| {
            // Blocks freed by earlier commits were unmapped from every index before this
            // lock was taken: they may start (or end) their grace period.
            state.reclaim(parts);
            state.check_written(parts)?;
            let before = state.md()?.commits_started();
            let md = state.md()?;
            let result = change(md).and_then(|value| {
                fault_point(&parts.options, FaultPoint::Commit);
                md.commit().map(|()| value)
            });
            let value = state.checked(parts, result)?;
            let md = state.md()?;
            assert!(!md.has_changes(), "a commit leaves no change behind");
            assert!(md.commits_started() > before, "a commit was started");
            match LastWritten::of(md) {
                Ok(written) => state.written = written,
                Err(e) => state.fail_locked(parts, format!("reading back the superblock: {e}")),
            }
            let started = state.commit_started.take();
            let duration = started.map_or(Duration::ZERO, |started| started.elapsed());
            parts.durations.record(duration);
            state.park_freed(parts);
            Ok(value)
        })
    }

    /// Refuse (and fail the pool: nothing more is written) if block 0 of the metadata device
    /// is not what the pool last wrote: another writer changed the metadata.
    pub(crate) fn check_written(&mut self, parts: &MetaParts) -> Result<()> {
        if self.md.is_none() {
            return Ok(());
        }
        match self.written.check(&*parts.device) {
            // Block 0 cannot be read: a metadata I/O failure, as any other (read-only).
            Err(e @ Error::Io { .. }) => Err(self.metadata_failed(parts, e)),
            checked => self.foreign_fails(parts, checked),
        }
    }

    /// Store `catalog` (for the transaction about to commit), after checking that neither
    /// the superblock nor the catalog file changed under the pool.
    pub(crate) fn store_catalog(&mut self, parts: &MetaParts, catalog: &Catalog) -> Result<()> {
        self.check_written(parts)?;
        let stored = parts.catalog_store.store(catalog);
        self.foreign_fails(parts, stored)
    }

    /// A foreign change found: fail the pool (the transaction is dropped unwritten).
    fn foreign_fails(&mut self, parts: &MetaParts, result: Result<()>) -> Result<()> {
        if let Err(
            e
            @ (Error::MetadataChangedUnderServer { .. } | Error::CatalogChangedUnderServer { .. }),
        ) = result
        {
            self.fail_locked(parts, e.to_string());
            return Err(e);
        }
        result
    }

    /// Pass on the result of a metadata operation: an error after the operation changed
    /// something (the transaction failed) abandons the transaction; a refusal changes
    /// nothing and is only reported.
    pub(crate) fn checked<T>(&mut self, parts: &MetaParts, result: Result<T>) -> Result<T> {
        match result {
            Err(e)
                if self
                    .md
                    .as_ref()
                    .is_some_and(PoolMetadata::transaction_failed) =>
            {
                Err(self.metadata_failed(parts, e))
            }
            other => other,
        }
    }

    /// Apply the first `count` queued ops (their data is durable) to the metadata.
    pub(crate) fn apply_ops(&mut self, parts: &MetaParts, count: usize) -> Result<()> {
        let count = count.min(self.queue.len());
        if count == 0 {
            return Ok(());
        }
        self.check_metadata_room(parts, count)?;
        let queued = self.queue.len();
        // A panic part-way leaves the trees half-updated and the ops drained: `contained`
        // abandons that transaction (fail mode) so no later commit can make it durable.
        let freed = self.contained(parts, "applying queued ops", |state| {
            let ops = state.queue.take(count);
            let mut freed = Vec::new();
            let md = state.md()?;
            let result = ops.into_iter().enumerate().try_for_each(|(applied, op)| {
                fault_point(&parts.options, FaultPoint::ApplyOp { applied });
                apply_op(md, op, &mut freed)
            });
            match result {
                Ok(()) => Ok(freed),
                Err(e) => Err(state.metadata_failed(parts, e)),
            }
        })?;
        assert_eq!(self.queue.len(), queued - count, "each op applied once");
        #[cfg(debug_assertions)]
        crate::engine::recovery::assert_unreferenced(&parts.volumes, &freed);
        #[cfg(not(debug_assertions))]
        let _ = freed;
        Ok(())
    }

    /// Refuse to apply `count` ops (entering out-of-metadata-space mode) unless the
    /// metadata has room for them beyond the reserve kept for management operations.
    pub(crate) fn check_metadata_room(&mut self, parts: &MetaParts, count: usize) -> Result<()> {
        let usage = self.md()?.usage();
        let total = usage.metadata_total_blocks;
        let free = total - usage.metadata_used_blocks;
        if free < metadata_reserve_blocks(total) + metadata_blocks_for_ops(count) {
            parts.health.set_mode(PoolMode::OutOfMetadataSpace);
            return Err(Error::OutOfMetadataSpace { block_count: total });
        }
        Ok(())
    }

    /// After a durable commit: the data blocks it freed (held by the metadata) go to the
    /// limbo, marked for passdown when the pool passes freed blocks down. Their grace
    /// period starts at a later `reclaim`: the caller may still be unmapping them from an
    /// index (a shrink clears its index after the commit, under the metadata lock).
    pub(crate) fn park_freed(&mut self, parts: &MetaParts) {
        let pass_down = parts.options.discard_passdown;
        let Some(md) = self.md.as_mut() else { return };
        let usage = md.usage();
        let held = md.take_newly_held_data_blocks();
        debug_assert!(held.iter().all(|&block| md.is_held(block)));
        self.limbo
            .add(held.into_iter().map(|block| Held { block, pass_down }));
        parts.watch.after_commit(&usage);
    }

    /// Without waiting: release the held blocks no pinned I/O can reach any more (passing
    /// down those a discard freed), and start the grace period of those freed since.
    pub(crate) fn reclaim(&mut self, parts: &MetaParts) {
        let released = self.limbo.poll(&parts.readers);
        let Some(md) = self.md.as_mut() else { return };
        let mut pass_down: Vec<u64> = released
            .iter()
            .filter(|held| held.pass_down && md.is_held(held.block))
            .map(|held| held.block.get())
            .collect();
        // Discarded before they are released (under the metadata lock): a block reserved
        // again afterwards is never punched under its new data. Runs of neighbours go
        // down as one discard; a failure only costs space on the data device.
        pass_down.sort_unstable();
        let block_size = parts.block_size_bytes;
        let mut bytes = 0;
        parts
            .watch
            .freed(released.iter().map(|held| held.block.get()));
        for (first, count) in block_runs(&pass_down) {
            let (offset, len) = (first * block_size, count * block_size);
            if parts.data.discard(offset, len).is_ok() {
                bytes += parts.watch.given_back(first, count) * block_size;
            }
        }
        parts.watch.passed_down(bytes);
        for held in released {
            if md.is_held(held.block) {
                md.release_held_data_block(held.block);
            }
        }
    }

    /// A metadata operation failed: abandon the transaction as dm-thin does. Out of metadata
    /// space → that mode; anything else → read-only with needs_check set on disk.
    pub(crate) fn metadata_failed(&mut self, parts: &MetaParts, error: Error) -> Error {
        let health = &parts.health;
        let out_of_space = matches!(error, Error::OutOfMetadataSpace { .. });
        health.log_warn(format!("metadata operation failed: {error}"));
        self.md = None;
        // Reservations lived in the abandoned metadata: writes holding one cannot map it.
        self.generation += 1;
        self.queue.drop_all();
        if !out_of_space {
            let _ = PoolMetadata::mark_needs_check(&*parts.device);
        }
        let reopened = PoolMetadata::open(parts.device.clone()).map_err(|e| {
            health.log_warn(format!("reopening the metadata failed: {e}"));
            format!("{error}; reopening the metadata failed: {e}")
        });
        let resynced = reopened.and_then(|md| match resync_indexes(&parts.volumes, &md) {
            Ok(unmapped) => Ok((md, unmapped)),
            Err(e) => {
                health.log_warn(format!("reloading the index failed: {e}"));
                Err(format!("{error}; reloading the index failed: {e}"))
            }
        });
        match resynced {
            Ok((mut md, unmapped)) => {
                self.limbo = rehold(&mut md, &self.limbo, unmapped);
                if let Ok(written) = LastWritten::of(&md) {
                    self.written = written;
                }
                self.md = Some(md);
                health.set_mode(if out_of_space {
                    PoolMode::OutOfMetadataSpace
                } else {
                    PoolMode::ReadOnly
                });
            }
            Err(reason) => {
                health.record_fail_reason(&reason);
                health.set_mode(PoolMode::Fail);
            }
        }
        assert!(self.queue.is_empty(), "the abandoned ops are dropped");
        error
    }
}

/// A look at the metadata under its mutex ([`Meta::read`], [`Change::view`]).
pub(crate) struct View<'a> {
    /// None in fail mode.
    pub(crate) md: Option<&'a PoolMetadata>,
    pub(crate) catalog: &'a Catalog,
    /// The metadata generation (bumped when a transaction is abandoned).
    pub(crate) generation: u64,
    pub(crate) queue: &'a OpQueue,
}

impl<'a> View<'a> {
    pub(crate) fn md(&self) -> Result<&'a PoolMetadata> {
        self.md.ok_or(Error::ReadOnly { needs_check: true })
    }
}

/// A reservation's receipt: the generation it is valid in and the data usage after it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grant {
    pub(crate) generation: u64,
    pub(crate) data_used_blocks: u64,
    pub(crate) data_total_blocks: u64,
}

/// Ops being queued under the metadata mutex ([`Meta::queue`]).
pub(crate) struct Queue<'a> {
    ops: &'a mut OpQueue,
    options: &'a PoolOptions,
}

impl Queue<'_> {
    pub(crate) fn push(&mut self, op: Op) {
        self.ops.push(op);
    }

    /// The test-only fault hook.
    pub(crate) fn fault_point(&self, point: FaultPoint) {
        fault_point(self.options, point);
    }
}

/// What the metadata owner is made of, besides the metadata and the catalog.
pub(crate) struct MetaParts {
    pub(crate) device: Arc<dyn BlockDevice>,
    pub(crate) data: Arc<dyn DataDevice>,
    pub(crate) block_size_bytes: u64,
    pub(crate) options: Arc<PoolOptions>,
    pub(crate) catalog_store: Box<dyn CatalogStore>,
    pub(crate) volumes: Arc<Volumes>,
    pub(crate) readers: Arc<Readers>,
    pub(crate) watch: Arc<SpaceWatch>,
    pub(crate) health: Arc<Health>,
    /// Signalled (with the metadata mutex) when data space may have appeared.
    pub(crate) space: Condvar,
    /// Durations of the commits since the pool opened.
    pub(crate) durations: DurationHistogram,
}

/// Blocks in their grace period, and blocks of the mappings the index just dropped, may
/// still be reached by pinned I/O: hold them in the reopened metadata too (those it maps
/// again are not free and stay unheld). Returns the new limbo.
fn rehold(md: &mut PoolMetadata, limbo: &Limbo, unmapped: Vec<DataBlock>) -> Limbo {
    md.hold_freed_data_blocks();
    let still_held: Vec<Held> = limbo
        .blocks()
        .filter(|&block| md.is_held(block) || md.hold_data_block(block))
        .map(|block| Held {
            block,
            pass_down: false,
        })
        .collect();
    let mut limbo = Limbo::default();
    limbo.add(still_held);
    limbo.add(
        unmapped
            .into_iter()
            .filter(|&block| md.hold_data_block(block))
            .map(|block| Held {
                block,
                pass_down: false,
            }),
    );
    limbo
}

fn grant(generation: u64, usage: &Usage) -> Grant {
    Grant {
        generation,
        data_used_blocks: usage.data_used_blocks,
        data_total_blocks: usage.data_total_blocks,
    }
}

/// Call the test-only fault hook, if any.
pub(crate) fn fault_point(options: &PoolOptions, point: FaultPoint) {
    if let Some(hook) = &options.fault_hook {
        hook.call(point);
    }
}

/// The message of a panic's payload (a `&str` or a `String`, as `panic!` makes them).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(message) = payload.downcast_ref::<&str>() {
        (*message).to_string()
    } else if let Some(message) = payload.downcast_ref::<String>() {
        message.clone()
    } else {
        "a panic without a message".to_string()
    }
}
