//! Revert and rename: the management operations that give a volume another content or
//! another name while it keeps what clients and ancestry know it by.
//!
//! **Revert** (`revert_volume`, the thin-pool equivalent of `lvconvert --merge`):
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
//! **Rename** (`rename_volume`): the catalog only (a transaction whose metadata change
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
//! and `set_transaction_id(T, T + 1)` commit together (`Change::commit_catalog`): a
//! crash before the commit reopens the pool as it was (catalog `T + 1` discarded), after it
//! as reverted or renamed. The in-memory state (published volumes, indexes) changes only
//! after the commit, under the metadata lock. A reverted volume loses its content id
//! (`receive`): its content is no longer what was sent or received under it.

use crate::engine::catalog::validate_name;
use crate::engine::meta::Meta;
use crate::engine::volumes::{VolumeState, Volumes};
use crate::error::{Error, Result};
use std::sync::Arc;

/// Give `volume` the content and size of `snapshot` (see the module doc). Refused (busy)
/// while `volume` is open, or `snapshot` when `delete_snapshot` is set.
pub(crate) fn revert_volume(
    meta: &Meta,
    volumes: &Volumes,
    volume: &str,
    snapshot: &str,
    delete_snapshot: bool,
) -> Result<()> {
    if volume == snapshot {
        return Err(Error::RevertToItself {
            volume: volume.to_string(),
        });
    }
    let source = volumes.named(snapshot)?;
    let _pause = source.gate().pause();
    let turn = meta.changes()?;
    volumes.still_published(snapshot, &source)?;
    let target = volumes.named(volume)?;
    target.claim("reverting it")?;
    if delete_snapshot {
        if let Err(e) = source.claim("deleting it") {
            target.end_delete();
            return Err(e);
        }
    }
    let result = (|| -> Result<()> {
        let mut change = turn.begin()?;
        let size_bytes = source.size_bytes();
        let mut catalog = change.catalog().clone();
        catalog.set_content_changed(target.id(), size_bytes);
        if delete_snapshot {
            catalog.remove(source.id());
        }
        let entry = catalog
            .volumes
            .iter()
            .find(|v| v.id == target.id())
            .cloned()
            .ok_or_else(|| Error::NoSuchVolume(volume.to_string()))?;
        let (target_id, source_id) = (target.id(), source.id());
        change.commit_catalog(catalog, |md| {
            md.delete(target_id)?;
            md.create_snap(target_id, source_id)?;
            if delete_snapshot {
                md.delete(source_id)?;
            }
            Ok(())
        })?;
        let time = change.advance_time()?;
        source.snapshotted_at(time);
        // The old state (claimed, unreachable once replaced) is dropped with its index.
        // The new one has none: its tree is SNAPSHOT's, every op of SNAPSHOT applied (its
        // writers paused before the flush), until a first use builds it.
        volumes.publish(Arc::new(VolumeState::new(&entry, None, time)));
        if delete_snapshot {
            volumes.unpublish(snapshot, Some(source_id));
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
    meta.notify_space();
    Ok(())
}

/// Rename a volume (catalog only; see the module doc). Refused while it is open, or if
/// `new` is taken.
pub(crate) fn rename_volume(meta: &Meta, volumes: &Volumes, old: &str, new: &str) -> Result<()> {
    validate_name(new)?;
    let turn = meta.changes()?;
    let volume = volumes.named(old)?;
    if old == new {
        return Ok(());
    }
    if volumes.named(new).is_ok() {
        return Err(Error::NameExists(new.to_string()));
    }
    volume.claim("renaming it")?;
    let result = (|| -> Result<()> {
        let mut change = turn.begin()?;
        if change.catalog().find(new).is_some() {
            return Err(Error::NameExists(new.to_string()));
        }
        let mut catalog = change.catalog().clone();
        let entry = catalog
            .volumes
            .iter_mut()
            .find(|v| v.id == volume.id())
            .ok_or_else(|| Error::NoSuchVolume(old.to_string()))?;
        entry.name = new.to_string();
        let entry = entry.clone();
        change.commit_catalog(catalog, |_| Ok(()))?;
        let snapshotted_time = volume.snapshotted_time()?;
        // The index (if built) goes along: the old state is claimed, so no handle writes
        // through it any more.
        let renamed = VolumeState::new(&entry, volume.loaded_index().cloned(), snapshotted_time);
        volumes.unpublish(old, None);
        volumes.publish(Arc::new(renamed));
        Ok(())
    })();
    if let Err(e) = result {
        volume.end_delete();
        return Err(e);
    }
    Ok(())
}
