//! Revert and rename: the management operations that give a volume another content or
//! another name while it keeps what clients and ancestry know it by.
//!
//! **Revert** (`Pool::revert_volume`, the thin-pool equivalent of `lvconvert --merge`):
//! VOLUME takes SNAPSHOT's content *and size*, keeps its name, its thin id, its read-only
//! flag and its own origin; SNAPSHOT stays (unless `delete_snapshot`) and keeps its origin.
//! No ancestry edge is added, so no cycle can appear: after reverting `vm` to its snapshot
//! `backup`, `backup` is still a snapshot of `vm`. In the metadata, in one transaction:
//! `delete(VOLUME)`, `create_snap(VOLUME's id, SNAPSHOT)` (O(1): SNAPSHOT's root gains a
//! reference; the pool time advances, so writes to either break sharing) and, with
//! `delete_snapshot`, `delete(SNAPSHOT)`. VOLUME's new state starts without an index
//! (built from its tree, SNAPSHOT's, on first use), so a revert costs the same whatever
//! SNAPSHOT maps.
//! SNAPSHOT may be any volume other than VOLUME, of any size.
//!
//! **Rename** (`Pool::rename_volume`): the catalog only (a transaction whose metadata change
//! is the transaction id); the thin id, content and ancestry stay (origins are kept by id,
//! so snapshots show the new name). The NBD export name is the volume name: renaming a
//! served volume changes it, which is why both operations refuse while a client has VOLUME
//! open.
//!
//! Open handles: VOLUME (and SNAPSHOT, when it is deleted) is claimed as a delete claims a
//! volume (open count 0 → `DELETING`, compare-and-swap): refused while a handle is alive,
//! and no handle can be opened until the operation ends. SNAPSHOT's writers are paused (its
//! gate), as a snapshot pauses its origin's, so its tree is taken at one instant.
//!
//! Crash safety: the catalog of transaction `T + 1` is stored before the metadata change
//! and `set_transaction_id(T, T + 1)` commit together (`Shared::catalog_transaction`): a
//! crash before the commit reopens the pool as it was (catalog `T + 1` discarded), after it
//! as reverted or renamed. The in-memory state (published volumes, indexes) changes only
//! after the commit, under the metadata lock.

use crate::engine::catalog::validate_name;
use crate::engine::manage::still_published;
use crate::engine::options::VolumeInfo;
use crate::engine::pool::Pool;
use crate::engine::shared::VolumeState;
use crate::error::{Error, Result};
use crate::ids::Time;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Pool {
    /// Give `volume` the content and size of `snapshot` (see the module doc). Refused
    /// (busy) while `volume` is open, or `snapshot` when `delete_snapshot` is set.
    pub fn revert_volume(
        &self,
        volume: &str,
        snapshot: &str,
        delete_snapshot: bool,
    ) -> Result<VolumeInfo> {
        if volume == snapshot {
            return Err(Error::Invalid(format!(
                "cannot revert volume {volume:?} to itself"
            )));
        }
        let shared = &self.shared;
        let source = shared.volume_named(snapshot)?;
        let _pause = source.gate.pause();
        let _commit = shared.lock_commit();
        shared.check_changes_allowed()?;
        still_published(shared, snapshot, &source)?;
        let target = shared.volume_named(volume)?;
        claim(&target, "reverting it")?;
        if delete_snapshot {
            if let Err(e) = claim(&source, "deleting it") {
                target.end_delete();
                return Err(e);
            }
        }
        let result = (|| -> Result<()> {
            let (mut meta, taken) = shared.flush_and_lock()?;
            let size_bytes = source.size_bytes.load(Ordering::Acquire);
            let mut catalog = meta.catalog.clone();
            for v in catalog.volumes.iter_mut().filter(|v| v.id == target.id) {
                v.size_bytes = size_bytes;
            }
            if delete_snapshot {
                catalog.remove(source.id);
            }
            let entry = catalog
                .volumes
                .iter()
                .find(|v| v.id == target.id)
                .cloned()
                .ok_or_else(|| Error::NoSuchVolume(volume.to_string()))?;
            let (target_id, source_id) = (target.id, source.id);
            shared.catalog_transaction(&mut meta, taken, catalog, |md| {
                md.delete(target_id)?;
                md.create_snap(target_id, source_id)?;
                if delete_snapshot {
                    md.delete(source_id)?;
                }
                Ok(())
            })?;
            let time = meta.md()?.pool_time()?;
            shared.set_time(time);
            source.snapshotted_time.store(time.get(), Ordering::Release);
            // The old state (claimed, unreachable once replaced) is dropped with its index.
            // The new one has none: its tree is SNAPSHOT's, every op of SNAPSHOT applied
            // (its writers paused before the flush), until a first use builds it.
            shared.publish_volume(Arc::new(VolumeState::new(&entry, None, time)));
            if delete_snapshot {
                shared.unpublish_volume(snapshot);
                for other in shared.volumes.load().values() {
                    other.forget_origin(source_id);
                }
            }
            Ok(())
        })();
        if let Err(e) = result {
            target.end_delete();
            if delete_snapshot {
                source.end_delete();
            }
            return Err(e);
        }
        shared.space.notify_all();
        self.info(volume)
    }

    /// Rename a volume (catalog only; see the module doc). Refused while it is open, or if
    /// `new` is taken.
    pub fn rename_volume(&self, old: &str, new: &str) -> Result<VolumeInfo> {
        validate_name(new)?;
        let shared = &self.shared;
        let _commit = shared.lock_commit();
        shared.check_changes_allowed()?;
        let volume = shared.volume_named(old)?;
        if old == new {
            return self.info(old);
        }
        if shared.volume_named(new).is_ok() {
            return Err(Error::NameExists(new.to_string()));
        }
        claim(&volume, "renaming it")?;
        let result = (|| -> Result<()> {
            let (mut meta, taken) = shared.flush_and_lock()?;
            if meta.catalog.find(new).is_some() {
                return Err(Error::NameExists(new.to_string()));
            }
            let mut catalog = meta.catalog.clone();
            let entry = catalog
                .volumes
                .iter_mut()
                .find(|v| v.id == volume.id)
                .ok_or_else(|| Error::NoSuchVolume(old.to_string()))?;
            entry.name = new.to_string();
            let entry = entry.clone();
            shared.catalog_transaction(&mut meta, taken, catalog, |_| Ok(()))?;
            let snapshotted_time = Time::new(volume.snapshotted_time.load(Ordering::Acquire))
                .ok_or_else(|| {
                    Error::Internal("a volume's snapshot time beyond 24 bits".to_string())
                })?;
            // The index (if built) goes along: the old state is claimed, so no handle
            // writes through it any more.
            let renamed =
                VolumeState::new(&entry, volume.loaded_index().cloned(), snapshotted_time);
            shared.unpublish_volume(old);
            shared.publish_volume(Arc::new(renamed));
            Ok(())
        })();
        if let Err(e) = result {
            volume.end_delete();
            return Err(e);
        }
        self.info(new)
    }
}

/// Claim `volume` (no handle alive, none opened until released), or say why not.
fn claim(volume: &VolumeState, doing: &str) -> Result<()> {
    volume.begin_delete().map_err(|_| {
        Error::Busy(format!(
            "volume {:?} is open ({} handles): disconnect its clients before {doing}",
            volume.name,
            volume.open_count()
        ))
    })
}
