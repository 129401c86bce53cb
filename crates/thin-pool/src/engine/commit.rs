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
//! Failure: a metadata operation refused before any change (see
//! [`PoolMetadata::transaction_failed`]) is reported and the transaction goes on; any other
//! failure abandons the transaction as dm-thin does ([`Shared::metadata_failed`]).

use crate::engine::catalog::Catalog;
use crate::engine::options::PoolMode;
use crate::engine::shared::{MetaState, Op, Shared};
use crate::error::{Error, Result};
use crate::format::metadata::PoolMetadata;
use crate::ids::{DataBlock, VirtualBlock};
use std::collections::BTreeMap;
use std::sync::MutexGuard;

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
        let (mut meta, taken) = self.flush_and_lock()?;
        self.commit_locked(&mut meta, taken)
    }

    /// Count the queued ops, flush the data device (their data is now durable), lock the
    /// metadata. Returns the lock and how many ops may be applied: ops queued during the
    /// flush are not covered by it and wait for the next commit.
    pub(crate) fn flush_and_lock(&self) -> Result<(MutexGuard<'_, MetaState>, usize)> {
        let taken = self.lock_meta().ops.len();
        self.flush_data()?;
        Ok((self.lock_meta(), taken))
    }

    /// Apply `count` ops and commit; `meta` is locked and the data device was flushed after
    /// those ops were queued.
    pub(crate) fn commit_locked(&self, meta: &mut MetaState, count: usize) -> Result<()> {
        self.apply_ops(meta, count)?;
        self.commit_change(meta, |_| Ok(()))
    }

    /// Run `change` on the metadata and commit. A change refused before it changed anything
    /// leaves the transaction (with the ops applied so far) for the next commit.
    pub(crate) fn commit_change<T>(
        &self,
        meta: &mut MetaState,
        change: impl FnOnce(&mut PoolMetadata) -> Result<T>,
    ) -> Result<T> {
        let md = meta.md()?;
        let result = change(md).and_then(|value| md.commit().map(|()| value));
        let value = self.checked(meta, result)?;
        self.pass_down(meta);
        Ok(value)
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
        let ops = meta.take_ops(count);
        let mut freed = Vec::new();
        let md = meta.md()?;
        let result = ops
            .into_iter()
            .try_for_each(|op| apply_op(md, op, &mut freed));
        if let Err(e) = result {
            return Err(self.metadata_failed(meta, e));
        }
        #[cfg(debug_assertions)]
        self.assert_unreferenced(&freed);
        if self.options.discard_passdown {
            meta.passdown.extend(freed);
        }
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
    /// blocks).
    #[cfg(debug_assertions)]
    fn assert_unreferenced(&self, freed: &[DataBlock]) {
        if freed.is_empty() {
            return;
        }
        let freed: std::collections::HashSet<DataBlock> = freed.iter().copied().collect();
        for volume in self.volumes.load().values() {
            volume.index.for_each_in(
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

    /// After a durable commit: discard the data blocks discards freed, if nothing took them
    /// since (nothing can: the metadata lock is held from the commit to here).
    fn pass_down(&self, meta: &mut MetaState) {
        let blocks = std::mem::take(&mut meta.passdown);
        let Some(md) = meta.md.as_ref() else { return };
        for block in blocks {
            if md.data_block_count(block) == 0 && !md.is_reserved(block) {
                // A discard failure only costs space on the data device.
                let _ = self.data.discard(
                    block.offset_bytes(self.block_size_bytes),
                    self.block_size_bytes,
                );
            }
        }
    }

    /// A metadata operation failed: abandon the transaction as dm-thin does. Out of metadata
    /// space → that mode; anything else → read-only with needs_check set on disk.
    pub(crate) fn metadata_failed(&self, meta: &mut MetaState, error: Error) -> Error {
        let out_of_space = matches!(error, Error::OutOfMetadataSpace { .. });
        self.log(format!("metadata operation failed: {error}"));
        meta.md = None;
        // Reservations lived in the abandoned metadata: writes holding one cannot map it.
        meta.generation += 1;
        let dropped = meta.ops.len();
        meta.take_ops(dropped);
        meta.passdown.clear();
        if !out_of_space {
            let _ = PoolMetadata::mark_needs_check(&*self.metadata_device);
        }
        match PoolMetadata::open(self.metadata_device.clone()) {
            Ok(md) => {
                if let Err(e) = self.resync_indexes(&md) {
                    self.log(format!("reloading the index failed: {e}"));
                    self.set_mode(PoolMode::Fail);
                    return error;
                }
                meta.md = Some(md);
                self.set_mode(if out_of_space {
                    PoolMode::OutOfMetadataSpace
                } else {
                    PoolMode::ReadOnly
                });
            }
            Err(e) => {
                self.log(format!("reopening the metadata failed: {e}"));
                self.set_mode(PoolMode::Fail);
            }
        }
        error
    }

    /// After the metadata was reopened: make every volume's index equal its mapping tree
    /// again. The abandoned ops' mappings leave the index (their blocks are free in the
    /// reopened metadata and may be reserved again), and mappings whose removal was
    /// abandoned come back. Provisioning cannot race this: it needs a reservation of the
    /// current generation, and the caller holds the metadata lock.
    fn resync_indexes(&self, md: &PoolMetadata) -> Result<()> {
        for volume in self.volumes.load().values() {
            if !md.has_volume(volume.id) {
                continue;
            }
            let mut tree = BTreeMap::new();
            md.walk_mappings(volume.id, &mut |block, mapping| {
                tree.insert(block, mapping);
                Ok(())
            })?;
            let mut stale = Vec::new();
            volume.index.for_each_in(
                VirtualBlock::new(0),
                VirtualBlock::new(u64::MAX),
                &mut |block, mapping| {
                    if tree.get(&block) != Some(&mapping) {
                        stale.push(block);
                    }
                },
            );
            for block in stale {
                volume.index.clear(block);
            }
            for (block, mapping) in tree {
                if block.get() < volume.index.block_count()
                    && volume.index.lookup(block) != Some(mapping)
                {
                    volume.index.set(block, mapping);
                }
            }
        }
        Ok(())
    }
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
                // No passdown for a replaced block: until this commit is durable the old
                // mapping may be what survives a crash.
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
