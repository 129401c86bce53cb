//! Commits: apply the queued ops whose data is durable to the metadata, then commit it.
//!
//! ```text
//!   commit          lock_commit ─ count ops ─ flush data ─ lock meta ─ apply ops ─ md.commit ─ pass down
//!   management op   lock_commit ─ flush_and_lock ─ catalog_transaction(apply ops, change, md.commit)
//! ```
//!
//! Ops queued while the data device is flushed are not covered by that flush and wait for
//! the next commit. Their reserved data blocks stay reserved in the metadata layer, outside
//! the committed space map (see `format::metadata::data_space`), so a crash never leaves a
//! mapping without its data nor a leaked block.
//!
//! Freed data blocks: a commit holds the blocks its transaction freed (they stay free in
//! the space map but are not reserved) and parks them in the limbo (`grace`); later
//! reclaims release them, and pass them all down (discard, shrink, delete, broken sharing:
//! the host gets the space back), once no I/O pinned before their unmap is left. A write out of space waits for that ([`Shared::wait_for_held`]).
//!
//! Failure: a metadata operation refused before any change (see
//! [`PoolMetadata::transaction_failed`]) is reported and the transaction goes on; any other
//! failure abandons the transaction as dm-thin does ([`Shared::metadata_failed`]). A panic
//! while applying ops or committing abandons it too, and the pool fails
//! ([`Shared::contained`], [`Shared::fail`]): nothing of that transaction is written.

use crate::engine::catalog::Catalog;
use crate::engine::grace::Held;
use crate::engine::options::{FaultPoint, PoolMode};
use crate::engine::shared::{MetaState, Op, Shared};
use crate::error::{Error, Result};
use crate::format::metadata::PoolMetadata;
use crate::ids::{DataBlock, VirtualBlock};
use std::collections::BTreeMap;
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

/// Metadata blocks one commit may need per applied op: roughly a leaf split every 126
/// inserts (over-estimated as one per 64 ops), plus a path shadow per volume touched.
const METADATA_BLOCKS_PER_OP_DIVISOR: u64 = 64;
const METADATA_BLOCKS_PER_COMMIT: u64 = 16;

/// Metadata blocks kept free for management operations (writes stop before they take them).
pub(crate) fn metadata_reserve_blocks(total: u64) -> u64 {
    (total / 10).clamp(8, 4096)
}

/// Metadata blocks a commit applying `count` ops may need.
pub(crate) fn metadata_blocks_for_ops(count: usize) -> u64 {
    count as u64 / METADATA_BLOCKS_PER_OP_DIVISOR + METADATA_BLOCKS_PER_COMMIT
}

impl Shared {
    /// Commit: take the ops queued now, flush data, apply them, commit metadata.
    pub(crate) fn commit(&self) -> Result<()> {
        let _commit = self.lock_commit();
        self.check_changes_allowed()?;
        let started = std::time::Instant::now();
        let (mut meta, taken) = self.flush_and_lock()?;
        let result = self.commit_locked(&mut meta, taken);
        self.log_if_slow(started.elapsed(), taken);
        result
    }

    /// A commit (data flush included) that takes [`PoolOptions::slow_commit_threshold`] or more
    /// is logged at warn: the disks are slow or overloaded.
    ///
    /// [`PoolOptions::slow_commit_threshold`]: crate::PoolOptions::slow_commit_threshold
    fn log_if_slow(&self, elapsed: std::time::Duration, ops: usize) {
        if self
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

    /// Count the queued ops, flush the data device (their data is now durable), lock the
    /// metadata. Returns the lock and how many ops may be applied: ops queued during the
    /// flush are not covered by it and wait for the next commit.
    pub(crate) fn flush_and_lock(&self) -> Result<(MutexGuard<'_, MetaState>, usize)> {
        let started = Instant::now();
        let taken = self.lock_meta().ops.len();
        self.flush_data()?;
        let mut meta = self.lock_meta();
        meta.commit_started = Some(started);
        Ok((meta, taken))
    }

    /// Apply `count` ops and commit; `meta` is locked and the data device was flushed after
    /// those ops were queued.
    pub(crate) fn commit_locked(&self, meta: &mut MetaState, count: usize) -> Result<()> {
        self.apply_ops(meta, count)?;
        self.commit_change(meta, |_| Ok(()))?;
        // Every block this commit freed was unmapped from its index when its op was
        // queued.
        self.reclaim_freed(meta);
        Ok(())
    }

    /// Once the blocks the last commit freed are unmapped from every index: start their
    /// grace period now and, if no I/O pinned before is left (the usual case), release
    /// them and pass them down at once.
    pub(crate) fn reclaim_freed(&self, meta: &mut MetaState) {
        self.reclaim(meta);
        self.reclaim(meta);
    }

    /// Run `change` on the metadata and commit. A change refused before it changed anything
    /// leaves the transaction (with the ops applied so far) for the next commit.
    pub(crate) fn commit_change<T>(
        &self,
        meta: &mut MetaState,
        change: impl FnOnce(&mut PoolMetadata) -> Result<T>,
    ) -> Result<T> {
        self.contained(meta, "a metadata commit", |meta| {
            // Blocks freed by earlier commits were unmapped from every index before this
            // lock was taken: they may start (or end) their grace period.
            self.reclaim(meta);
            let md = meta.md()?;
            let result = change(md).and_then(|value| {
                self.fault_point(FaultPoint::Commit);
                md.commit().map(|()| value)
            });
            let value = self.checked(meta, result)?;
            let started = meta.commit_started.take();
            let duration = started.map_or(Duration::ZERO, |started| started.elapsed());
            self.commit_counters.durations.record(duration);
            self.park_freed(meta);
            Ok(value)
        })
    }

    /// Call the test-only fault hook, if any.
    pub(crate) fn fault_point(&self, point: FaultPoint) {
        if let Some(hook) = &self.options.fault_hook {
            hook.call(point);
        }
    }

    /// Pass on the result of a metadata operation: an error after the operation changed
    /// something (the transaction failed) abandons the transaction; a refusal changes
    /// nothing and is only reported.
    pub(crate) fn checked<T>(&self, meta: &mut MetaState, result: Result<T>) -> Result<T> {
        match result {
            Err(e)
                if meta
                    .md
                    .as_ref()
                    .is_some_and(PoolMetadata::transaction_failed) =>
            {
                Err(self.metadata_failed(meta, e))
            }
            other => other,
        }
    }

    /// A management change: store the new catalog as transaction T + 1, apply queued ops,
    /// make the change and `set_transaction_id(T, T + 1)`, commit.
    pub(crate) fn catalog_transaction(
        &self,
        meta: &mut MetaState,
        taken: usize,
        mut catalog: Catalog,
        change: impl FnOnce(&mut PoolMetadata) -> Result<()>,
    ) -> Result<()> {
        self.apply_ops(meta, taken)?;
        let current = meta.md()?.transaction_id();
        let next = current.next();
        catalog.transaction_id = next.get();
        self.catalog_store.store(&catalog)?;
        self.commit_change(meta, |md| {
            self.fault_point(FaultPoint::ManagementChange);
            change(md)?;
            md.set_transaction_id(current, next)
        })?;
        meta.catalog = catalog;
        self.catalog_store.committed(next.get())?;
        Ok(())
    }

    /// Apply the first `count` queued ops (their data is durable) to the metadata.
    pub(crate) fn apply_ops(&self, meta: &mut MetaState, count: usize) -> Result<()> {
        let count = count.min(meta.ops.len());
        if count == 0 {
            return Ok(());
        }
        self.check_metadata_room(meta, count)?;
        // A panic part-way leaves the trees half-updated and the ops drained: `contained`
        // abandons that transaction (fail mode) so no later commit can make it durable.
        let freed = self.contained(meta, "applying queued ops", |meta| {
            let ops = meta.take_ops(count);
            let mut freed = Vec::new();
            let md = meta.md()?;
            let result = ops.into_iter().enumerate().try_for_each(|(applied, op)| {
                self.fault_point(FaultPoint::ApplyOp { applied });
                apply_op(md, op, &mut freed)
            });
            match result {
                Ok(()) => Ok(freed),
                Err(e) => Err(self.metadata_failed(meta, e)),
            }
        })?;
        #[cfg(debug_assertions)]
        self.assert_unreferenced(&freed);
        #[cfg(not(debug_assertions))]
        let _ = freed;
        Ok(())
    }

    /// Refuse to apply `count` ops (entering out-of-metadata-space mode) unless the
    /// metadata has room for them beyond the reserve kept for management operations.
    fn check_metadata_room(&self, meta: &mut MetaState, count: usize) -> Result<()> {
        let usage = meta.md()?.usage();
        let total = usage.metadata_total_blocks;
        let free = total - usage.metadata_used_blocks;
        if free < metadata_reserve_blocks(total) + metadata_blocks_for_ops(count) {
            self.set_mode(PoolMode::OutOfMetadataSpace);
            return Err(Error::OutOfMetadataSpace { block_count: total });
        }
        Ok(())
    }

    /// Debug builds: a data block a commit freed is referenced by no volume's index (the
    /// index equals the trees plus the queued ops, and a queued op only maps reserved
    /// blocks). A volume without an index is skipped: its only mappings are in its tree,
    /// and a block no tree references is what a commit frees.
    #[cfg(debug_assertions)]
    fn assert_unreferenced(&self, freed: &[DataBlock]) {
        if freed.is_empty() {
            return;
        }
        let freed: std::collections::HashSet<DataBlock> = freed.iter().copied().collect();
        for volume in self.volumes.load().values() {
            let Some(index) = volume.loaded_index() else {
                continue;
            };
            index.for_each_in(
                VirtualBlock::new(0),
                VirtualBlock::new(u64::MAX),
                &mut |block, mapping| {
                    assert!(
                        !freed.contains(&mapping.data_block()),
                        "volume {:?} block {block} maps data block {}, which a commit freed",
                        volume.name,
                        mapping.data_block()
                    );
                },
            );
        }
    }

    /// After a durable commit: the data blocks it freed (held by the metadata; by a
    /// discard, a shrink, a delete or a broken sharing) go to the limbo, marked for passdown
    /// when the pool passes freed blocks down. Their grace period starts at a later
    /// `reclaim`: the caller may still be unmapping them from an index (a shrink clears its
    /// index after the commit, under the metadata lock).
    fn park_freed(&self, meta: &mut MetaState) {
        let pass_down = self.options.discard_passdown;
        let Some(md) = meta.md.as_mut() else { return };
        let usage = md.usage();
        let held = md.take_newly_held_data_blocks();
        meta.limbo
            .add(held.into_iter().map(|block| Held { block, pass_down }));
        self.watch.after_commit(self, &usage);
    }

    /// Without waiting: release the held blocks no pinned I/O can reach any more (passing
    /// down those a discard freed), and start the grace period of those freed since.
    pub(crate) fn reclaim(&self, meta: &mut MetaState) {
        let released = meta.limbo.poll(&self.readers);
        let Some(md) = meta.md.as_mut() else { return };
        let mut pass_down: Vec<u64> = released
            .iter()
            .filter(|held| held.pass_down && md.is_held(held.block))
            .map(|held| held.block.get())
            .collect();
        // Discarded before they are released (under the metadata lock): a block reserved
        // again afterwards is never punched under its new data. Runs of neighbours go
        // down as one discard; a failure only costs space on the data device.
        pass_down.sort_unstable();
        let mut bytes = 0;
        for (first, count) in block_runs(&pass_down) {
            let (offset, len) = (first * self.block_size_bytes, count * self.block_size_bytes);
            if self.data.discard(offset, len).is_ok() {
                bytes += len;
            }
        }
        self.watch
            .passed_down_bytes
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        for held in released {
            if md.is_held(held.block) {
                md.release_held_data_block(held.block);
            }
        }
    }

    /// Wait (until `deadline`) for every held block to be released: pinned I/O is short
    /// and takes no lock, so this ends unless a device stalls. The caller is not pinned.
    pub(crate) fn wait_for_held(&self, deadline: Instant) {
        let mut pause = Duration::from_micros(10);
        loop {
            {
                let mut meta = self.lock_meta();
                self.reclaim(&mut meta);
                if meta.limbo.is_empty() {
                    break;
                }
            }
            if Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(5));
        }
        self.space.notify_all();
    }

    /// A metadata operation failed: abandon the transaction as dm-thin does. Out of metadata
    /// space → that mode; anything else → read-only with needs_check set on disk.
    pub(crate) fn metadata_failed(&self, meta: &mut MetaState, error: Error) -> Error {
        let out_of_space = matches!(error, Error::OutOfMetadataSpace { .. });
        self.log_warn(format!("metadata operation failed: {error}"));
        meta.md = None;
        // Reservations lived in the abandoned metadata: writes holding one cannot map it.
        meta.generation += 1;
        let dropped = meta.ops.len();
        meta.take_ops(dropped);
        if !out_of_space {
            let _ = PoolMetadata::mark_needs_check(&*self.metadata_device);
        }
        match PoolMetadata::open(self.metadata_device.clone()) {
            Ok(mut md) => {
                let unmapped = match self.resync_indexes(&md) {
                    Ok(unmapped) => unmapped,
                    Err(e) => {
                        self.log_warn(format!("reloading the index failed: {e}"));
                        self.record_fail_reason(&format!(
                            "{error}; reloading the index failed: {e}"
                        ));
                        self.set_mode(PoolMode::Fail);
                        return error;
                    }
                };
                // Blocks in their grace period, and blocks of the mappings the index just
                // dropped, may still be reached by pinned I/O: hold them in the reopened
                // metadata too (those it maps again are not free and stay unheld).
                md.hold_freed_data_blocks();
                let still_held: Vec<Held> = meta
                    .limbo
                    .blocks()
                    .filter(|&block| md.is_held(block) || md.hold_data_block(block))
                    .map(|block| Held {
                        block,
                        pass_down: false,
                    })
                    .collect();
                meta.limbo = Default::default();
                meta.limbo.add(still_held);
                meta.limbo.add(
                    unmapped
                        .into_iter()
                        .filter(|&block| md.hold_data_block(block))
                        .map(|block| Held {
                            block,
                            pass_down: false,
                        }),
                );
                meta.md = Some(md);
                self.set_mode(if out_of_space {
                    PoolMode::OutOfMetadataSpace
                } else {
                    PoolMode::ReadOnly
                });
            }
            Err(e) => {
                self.log_warn(format!("reopening the metadata failed: {e}"));
                self.record_fail_reason(&format!("{error}; reopening the metadata failed: {e}"));
                self.set_mode(PoolMode::Fail);
            }
        }
        error
    }

    /// After the metadata was reopened: make every volume's index equal its mapping tree
    /// again. The abandoned ops' mappings leave the index (their blocks are free in the
    /// reopened metadata and may be reserved again), and mappings whose removal was
    /// abandoned come back. Provisioning cannot race this: it needs a reservation of the
    /// current generation, and the caller holds the metadata lock. Returns the data blocks
    /// of the mappings dropped from an index. A volume without an index needs nothing: it
    /// is built from the reopened metadata when first used.
    fn resync_indexes(&self, md: &PoolMetadata) -> Result<Vec<DataBlock>> {
        let mut unmapped = Vec::new();
        for volume in self.volumes.load().values() {
            if !md.has_volume(volume.id) {
                continue;
            }
            let Some(index) = volume.loaded_index() else {
                continue;
            };
            let mut tree = BTreeMap::new();
            md.walk_mappings(volume.id, &mut |block, mapping| {
                tree.insert(block, mapping);
                Ok(())
            })?;
            let mut stale = Vec::new();
            index.for_each_in(
                VirtualBlock::new(0),
                VirtualBlock::new(u64::MAX),
                &mut |block, mapping| {
                    if tree.get(&block) != Some(&mapping) {
                        stale.push(block);
                        unmapped.push(mapping.data_block());
                    }
                },
            );
            for block in stale {
                index.clear(block);
            }
            for (block, mapping) in tree {
                if block.get() < index.block_count() && index.lookup(block) != Some(mapping) {
                    index.set(block, mapping);
                }
            }
        }
        Ok(unmapped)
    }
}

/// Runs of consecutive numbers in sorted `blocks`, as (first, count).
pub(crate) fn block_runs(blocks: &[u64]) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &block in blocks {
        match runs.last_mut() {
            Some((first, count)) if *first + *count == block => *count += 1,
            _ => runs.push((block, 1)),
        }
    }
    runs
}

/// Apply one op; a data block it frees (count now zero) is added to `freed`.
fn apply_op(md: &mut PoolMetadata, op: Op, freed: &mut Vec<DataBlock>) -> Result<()> {
    match op {
        Op::Insert {
            volume,
            block,
            mapping,
        } => {
            let data_block = mapping.data_block();
            if md.has_volume(volume) {
                // A replaced block whose count falls to zero is held by the commit and
                // passed down only once that commit is durable (until then the old mapping
                // may be what survives a crash).
                md.insert_at(volume, block, data_block, mapping.time())?;
            } else if !md.release_data_block(data_block) {
                // The volume was deleted: the reservation goes back.
                return Err(Error::Internal(format!(
                    "queued mapping of deleted volume {volume} holds data block {data_block}, which is not reserved"
                )));
            }
            Ok(())
        }
        Op::Remove { volume, block } => {
            if !md.has_volume(volume) {
                return Ok(());
            }
            if let Some(old) = md.remove(volume, block)? {
                if md.data_block_count(old) == 0 {
                    freed.push(old);
                }
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::block_runs;

    #[test]
    fn runs_join_neighbours_only() {
        assert_eq!(block_runs(&[]), vec![]);
        assert_eq!(block_runs(&[3]), vec![(3, 1)]);
        assert_eq!(
            block_runs(&[1, 2, 3, 5, 7, 8]),
            vec![(1, 3), (5, 1), (7, 2)]
        );
    }
}
