//! Resumable receives: what a [`VolumeReceiver`] verified, kept across an interruption
//! (`thinpool receive --resumable`, as `zfs receive -s`).
//!
//! [`VolumeReceiver::checkpoint`] commits, in one transaction of the pool, every block
//! assembled so far into a **hidden thin id** of the metadata (created at the first
//! checkpoint: `create_thin`, or for an incremental `create_snap` of the base) and a
//! `PartialReceive` entry of the catalog: the name it will take, the stream's content ids
//! and `offset`, the first byte of the volume not yet kept (a block boundary of this pool:
//! the block being assembled is left out and comes again). The thin id is no volume: not
//! served, not listed, not unadopted; its mappings are ordinary metadata, so a crash keeps
//! it consistent (the last checkpoint, or nothing) and `thin_check` sees one more device.
//!
//! A stream resuming it (its header's resume offset equal to `offset`, its stream id the
//! entry's) continues it ([`resume`]); the final trailer's receive turns the thin id into
//! the volume, in one transaction with the remaining blocks. A token of another stream, or
//! of an older offset, is refused with nothing changed. [`abort`] deletes the thin id and
//! the entry: the blocks the receive wrote are free again.

use crate::engine::catalog::{Catalog, PartialReceive};
use crate::engine::data_device::DataDevice;
use crate::engine::meta::Meta;
use crate::engine::receive::{ReceiveSpec, Staged, VolumeReceiver};
use crate::engine::volume::Volume;
use crate::engine::volumes::Volumes;
use crate::error::{Error, Result};
use std::sync::Arc;

impl VolumeReceiver {
    /// Commit what was received and checked so far as a partial receive (see the module
    /// doc); answers its offset: a stream resuming it starts there.
    pub fn checkpoint(&mut self) -> Result<u64> {
        let offset = match &self.pending {
            Some(pending) => pending.block * self.block_size,
            None => self.next_offset,
        };
        let unchanged = match &self.staged {
            Some(staged) => staged.offset == offset,
            None => offset == 0,
        };
        if unchanged && self.inserts.is_empty() && self.removes.is_empty() {
            // Nothing more to keep (nothing at all before the first byte).
            return Ok(offset);
        }
        let base_state = match &self.base {
            Some(base) => Some(self.volumes.named(base.name())?),
            None => None,
        };
        let mut change = self.meta.changes()?.begin()?;
        let mut catalog = change.catalog().clone();
        let staged = self.claim_staged(&mut catalog)?;
        let id = match staged {
            Some(id) => id,
            None => catalog.free_id(&change.view().md()?.volumes())?,
        };
        let blocks = self.staged.as_ref().map_or(0, |s| s.blocks) + self.inserts.len() as u64;
        let spec = &self.spec;
        catalog.partial.push(PartialReceive {
            name: spec.name.clone(),
            id,
            size_bytes: spec.size_bytes,
            content_id: spec.content_id.clone(),
            base_content_id: spec.base_content_id.clone(),
            origin_id: base_state.as_ref().map(|b| b.id().get()),
            offset,
            blocks,
        });
        let (inserts, removes) = (&self.inserts, &self.removes);
        let origin = base_state.as_ref().map(|b| b.id());
        change.commit_catalog(catalog, |md| {
            match (staged, origin) {
                (Some(_), _) => {}
                (None, Some(origin)) => md.create_snap(id, origin)?,
                (None, None) => md.create_thin(id)?,
            }
            for &block in removes {
                md.remove(id, block)?;
            }
            for &(vblock, block) in inserts {
                md.insert(id, vblock, block)?;
            }
            Ok(())
        })?;
        // The blocks are mapped now: no longer this receiver's to release.
        self.inserts.clear();
        self.removes.clear();
        self.staged = Some(Staged { id, offset, blocks });
        if let (None, Some(base)) = (staged, &base_state) {
            base.snapshotted_at(change.advance_time()?);
        }
        change.reclaim_freed();
        Ok(offset)
    }

    /// Take this receiver's partial receive out of `catalog` (a checkpoint puts it back,
    /// a finish makes it the volume): its thin id, None before the first checkpoint.
    /// Refused if it is gone or moved on (aborted, or resumed by another receive), or, with
    /// none yet, if another receive keeps one under the name.
    pub(super) fn claim_staged(
        &self,
        catalog: &mut Catalog,
    ) -> Result<Option<crate::ids::VolumeId>> {
        let name = &self.spec.name;
        let at = catalog.partial.iter().position(|p| p.name == *name);
        match (&self.staged, at) {
            (None, None) => Ok(None),
            (None, Some(_)) => Err(Error::BadStream(format!(
                "another receive keeps a partial receive of {name:?} now"
            ))),
            (Some(_), None) => Err(Error::BadStream(format!(
                "the partial receive of {name:?} was dropped (thinpool receive --abort) \
                 during this receive"
            ))),
            (Some(staged), Some(at)) => {
                let kept = catalog.partial.remove(at);
                if kept.id != staged.id || kept.offset != staged.offset {
                    return Err(Error::BadStream(format!(
                        "the partial receive of {name:?} moved on (another receive resumed \
                         it) during this receive"
                    )));
                }
                Ok(Some(staged.id))
            }
        }
    }
}

/// The partial receives of the pool, in the order they were begun.
pub(crate) fn list(meta: &Meta) -> Vec<PartialReceive> {
    meta.read(|view| view.catalog.partial.clone())
}

/// Continue partial receive `name` with a stream of content id `content_id` (and
/// `base_content_id`) whose records start at `offset`. Refused, with nothing changed, if
/// `name` keeps no partial receive, keeps another stream's, or stands at another offset (a
/// stale token).
pub(crate) fn resume(
    meta: Arc<Meta>,
    volumes: Arc<Volumes>,
    data: Arc<dyn DataDevice>,
    spec: ReceiveSpec,
    offset: u64,
    open_base: impl FnOnce(&str) -> Result<Volume>,
) -> Result<VolumeReceiver> {
    let name = spec.name.clone();
    let kept = meta
        .read(|view| {
            view.catalog
                .partial
                .iter()
                .find(|p| p.name == name)
                .cloned()
        })
        .ok_or_else(|| {
            Error::BadStream(format!(
                "no partial receive of {name:?} is kept here: a resumed stream (send \
                 --resume) continues one; send the whole stream"
            ))
        })?;
    if kept.content_id != spec.content_id || kept.base_content_id != spec.base_content_id {
        return Err(Error::BadStream(format!(
            "the resumed stream is stream {} (base {:?}), the partial receive of {name:?} is \
             stream {} (base {:?}): a token of another stream",
            spec.content_id, spec.base_content_id, kept.content_id, kept.base_content_id
        )));
    }
    if kept.offset != offset || kept.size_bytes != spec.size_bytes {
        return Err(Error::BadStream(format!(
            "the resumed stream starts at byte {offset}, the partial receive of {name:?} \
             holds bytes 0..{} of {}: a stale token (`thinpool receive --list-partial` shows \
             the current one)",
            kept.offset, kept.size_bytes
        )));
    }
    let mut receiver = VolumeReceiver::begin_unchecked(meta, volumes, data, spec, open_base)?;
    receiver.next_offset = offset;
    receiver.staged = Some(Staged {
        id: kept.id,
        offset,
        blocks: kept.blocks,
    });
    Ok(receiver)
}

/// Drop partial receive `name`: its thin id deleted (the blocks it wrote freed) and its
/// entry removed, in one transaction. Answers what it was.
pub(crate) fn abort(meta: &Meta, name: &str) -> Result<PartialReceive> {
    meta.check_changes_allowed()?;
    let mut change = meta.changes()?.begin()?;
    let mut catalog = change.catalog().clone();
    let at = catalog
        .partial
        .iter()
        .position(|p| p.name == name)
        .ok_or_else(|| Error::BadStream(format!("no partial receive of {name:?} is kept")))?;
    let kept = catalog.partial.remove(at);
    let id = kept.id;
    change.commit_catalog(catalog, |md| {
        if md.has_volume(id) {
            md.delete(id)?;
        }
        Ok(())
    })?;
    change.reclaim_freed();
    drop(change);
    meta.notify_space();
    Ok(kept)
}
