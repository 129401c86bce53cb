//! Management operations on an open pool: create, snapshot and delete volumes, set the
//! transaction id, hold and release the metadata snapshot. Free functions over the owners
//! (the metadata owner `Meta` and the registry `Volumes`); `Pool` calls them. Growth and
//! volume resizes are in `grow`, revert and rename in `revert`.
//!
//! Each takes the commit lock (`Meta::changes`), applies the ops queued before it (their
//! data flushed), checks every limit, then changes the catalog and the metadata in one
//! transaction (`Change::commit_catalog`: catalog `T + 1` stored first, see `catalog`), and
//! only then the in-memory state (published volumes, indexes, the pool time), still under
//! the metadata lock. A refused operation changes nothing. None of them builds an index: a
//! snapshot starts without one (its tree is its content), and a delete of a volume
//! without one changes only the metadata.

use crate::engine::catalog::{validate_name, CatalogVolume};
use crate::engine::index::Index;
use crate::engine::limits::check_volume_size;
use crate::engine::meta::Meta;
use crate::engine::volumes::{VolumeState, Volumes};
use crate::error::{Error, Result};
use crate::ids::TransactionId;
use std::sync::Arc;

/// Create a thin volume of `size_bytes` (a multiple of 512).
pub(crate) fn create_volume(
    meta: &Meta,
    volumes: &Volumes,
    name: &str,
    size_bytes: u64,
) -> Result<()> {
    validate_name(name)?;
    check_volume_size(size_bytes)?;
    let mut change = meta.changes()?.begin()?;
    if change.catalog().find(name).is_some() {
        return Err(Error::NameExists(name.to_string()));
    }
    // Every thin id of the metadata is taken, the unadopted ones too.
    let id = change.catalog().free_id(&change.view().md()?.volumes())?;
    let entry = CatalogVolume {
        name: name.to_string(),
        id,
        size_bytes,
        read_only: false,
        origin: None,
        content_id: None,
    };
    let mut catalog = change.catalog().clone();
    catalog.volumes.push(entry.clone());
    change.commit_catalog(catalog, |md| md.create_thin(id))?;
    let volume = Arc::new(VolumeState::new(
        &entry,
        // Empty and 16 bytes a 2^36 blocks: built at once.
        Some(Arc::new(Index::new(
            size_bytes.div_ceil(meta.block_size_bytes()),
        ))),
        meta.time(),
    ));
    volumes.publish(volume);
    assert!(change.catalog().find(name).is_some_and(|v| v.id == id));
    Ok(())
}

/// Snapshot `origin` as `name`. Pauses only the origin's writes, briefly.
pub(crate) fn snapshot(
    meta: &Meta,
    volumes: &Volumes,
    origin: &str,
    name: &str,
    read_only: bool,
) -> Result<()> {
    validate_name(name)?;
    let origin_volume = volumes.named(origin)?;
    let _pause = origin_volume.gate().pause();
    let turn = meta.changes()?;
    volumes.still_published(origin, &origin_volume)?;
    let mut change = turn.begin()?;
    if change.catalog().find(name).is_some() {
        return Err(Error::NameExists(name.to_string()));
    }
    // Every thin id of the metadata is taken, the unadopted ones too.
    let id = change.catalog().free_id(&change.view().md()?.volumes())?;
    let entry = CatalogVolume {
        name: name.to_string(),
        id,
        size_bytes: origin_volume.size_bytes(),
        read_only,
        origin: Some(origin_volume.id()),
        content_id: None,
    };
    let mut catalog = change.catalog().clone();
    catalog.volumes.push(entry.clone());
    let origin_id = origin_volume.id();
    change.commit_catalog(catalog, |md| md.create_snap(id, origin_id))?;
    let time = change.advance_time()?;
    origin_volume.snapshotted_at(time);
    // No index: its tree (the origin's root, shared) is its content until a first use
    // builds one (`Meta::index`), so a snapshot costs the same whatever its size.
    volumes.publish(Arc::new(VolumeState::new(&entry, None, time)));
    Ok(())
}

/// Delete a volume. Refused (busy) while it is open; from the moment it is claimed until it
/// is gone no handle can be opened, so when it returns no handle reaches the volume, and
/// its thin id and data blocks can be given to another.
pub(crate) fn delete_volume(meta: &Meta, volumes: &Volumes, name: &str) -> Result<()> {
    let turn = meta.changes()?;
    let volume = volumes.named(name)?;
    volume.begin_delete()?;
    let result = (|| -> Result<()> {
        let mut change = turn.begin()?;
        let mut catalog = change.catalog().clone();
        let id = volume.id();
        // Its snapshots lose their origin: the id and the name may be reused.
        catalog.remove(id);
        change.commit_catalog(catalog, |md| md.delete(id))?;
        // Under the metadata lock: no commit sees the volume's id free while the volume is
        // still published.
        volumes.unpublish(name, Some(id));
        // Its freed blocks are in no index now: release (and pass down) at once.
        change.reclaim_freed();
        assert!(change.catalog().find(name).is_none());
        Ok(())
    })();
    if result.is_err() {
        volume.end_delete();
    }
    result?;
    meta.notify_space();
    Ok(())
}

/// Set the user transaction id (the catalog follows it).
pub(crate) fn set_transaction_id(
    meta: &Meta,
    current: TransactionId,
    new: TransactionId,
) -> Result<()> {
    let mut change = meta.changes()?.begin()?;
    change.set_transaction_id(current, new)?;
    assert_eq!(change.catalog().transaction_id, new.get());
    Ok(())
}

/// Hold a metadata snapshot (so `thin_dump -m` can read a consistent tree while serving).
pub(crate) fn reserve_metadata_snap(meta: &Meta) -> Result<u64> {
    let mut change = meta.changes()?.begin()?;
    let location = change.commit_with(|md| md.reserve_metadata_snap())?;
    Ok(location.get())
}

/// Release the held metadata snapshot.
pub(crate) fn release_metadata_snap(meta: &Meta) -> Result<()> {
    let mut change = meta.changes()?.begin()?;
    change.commit_with(|md| md.release_metadata_snap())
}
