//! Where the catalog and the metadata disagree on thin ids (issue 20 finding 11), and the
//! two operations that settle it. The kernel's dm-thin can change a pool thinpool made:
//! `create_snap` adds a thin id the catalog does not know (**unadopted**: not served, not
//! deletable by name, its blocks kept, its id never given to a new volume), `delete` removes
//! one the catalog still names (**orphaned**: listed, not served). Opening names both, with
//! the command that fixes each ([`open_warning`]); nothing is guessed (dm-thin keeps no
//! name or size).
//!
//! - [`adopt`]: give an unadopted thin id a name and a size (at least its highest mapped
//!   block), optionally an origin (recorded by thin id, as a snapshot's); published at once.
//! - [`forget`]: drop an orphaned entry (catalog only; its snapshots lose it as origin).
//!
//! Both are management changes like `manage`'s: commit lock, the catalog of `T + 1` stored
//! first, then the metadata's transaction id (`Change::commit_catalog`).

use crate::engine::catalog::{validate_name, Catalog, CatalogVolume};
use crate::engine::limits::check_volume_size;
use crate::engine::load::check_adopted;
use crate::engine::meta::Meta;
use crate::engine::volumes::{VolumeState, Volumes};
use crate::error::{CatalogRefusal, Error, Result};
use crate::format::metadata::PoolMetadata;
use crate::ids::VolumeId;
use std::sync::Arc;

/// A thin id the metadata holds and the catalog does not know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnadoptedThin {
    /// The thin id.
    pub id: VolumeId,
    /// Blocks it maps (its details').
    pub mapped_blocks: u64,
    /// Bytes it maps.
    pub mapped_bytes: u64,
}

/// A catalog entry whose thin id is not in the metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OrphanedVolume {
    /// Its name.
    pub name: String,
    /// The thin id the metadata lacks.
    pub id: VolumeId,
    /// The size the catalog records.
    pub size_bytes: u64,
}

/// Where the catalog and the metadata disagree (both empty when they agree).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Disagreements {
    /// Thin ids only the metadata holds, in id order.
    pub unadopted: Vec<UnadoptedThin>,
    /// Entries only the catalog holds, in catalog order.
    pub orphaned: Vec<OrphanedVolume>,
}

impl Disagreements {
    /// Whether the catalog and the metadata agree.
    pub fn is_empty(&self) -> bool {
        self.unadopted.is_empty() && self.orphaned.is_empty()
    }
}

/// The disagreements of `catalog` and `md`.
fn between(md: &PoolMetadata, catalog: &Catalog, block_size_bytes: u64) -> Disagreements {
    let in_metadata = md.volumes();
    let unadopted = catalog
        .unadopted(&in_metadata)
        .into_iter()
        .map(|id| {
            let mapped_blocks = md.details(id).map_or(0, |d| d.mapped_blocks);
            UnadoptedThin {
                id,
                mapped_blocks,
                mapped_bytes: mapped_blocks.saturating_mul(block_size_bytes),
            }
        })
        .collect();
    let orphaned = catalog
        .orphaned(&in_metadata)
        .into_iter()
        .map(|v| OrphanedVolume {
            name: v.name.clone(),
            id: v.id,
            size_bytes: v.size_bytes,
        })
        .collect();
    Disagreements {
        unadopted,
        orphaned,
    }
}

/// The pool's disagreements now (none known without metadata: a failed pool).
pub(crate) fn disagreements(meta: &Meta) -> Disagreements {
    meta.read(|view| {
        view.md
            .map(|md| between(md, view.catalog, meta.block_size_bytes()))
            .unwrap_or_default()
    })
}

/// The warning an open logs when the catalog and the metadata disagree: each id or name,
/// what it means and the command that settles it.
pub(crate) fn open_warning(found: &Disagreements) -> Option<String> {
    if found.is_empty() {
        return None;
    }
    let mut lines = vec![
        "the volume catalog and the metadata disagree; the other volumes are served".to_string(),
    ];
    for thin in &found.unadopted {
        lines.push(format!(
            "thin id {} ({:.2} MiB mapped) is in the metadata but not in the catalog (made outside thinpool, e.g. the kernel's create_snap): not served, its blocks kept; name it with `thinpool volume adopt {} NAME --size SIZE [--origin NAME]`",
            thin.id,
            thin.mapped_bytes as f64 / (1u64 << 20) as f64,
            thin.id
        ));
    }
    for volume in &found.orphaned {
        lines.push(format!(
            "volume {:?} (thin id {}) is in the catalog but its thin id is not in the metadata (deleted outside thinpool?): not served; drop the entry with `thinpool volume forget {}`",
            volume.name, volume.id, volume.name
        ));
    }
    Some(lines.join("; "))
}

/// The error for a name no served volume has: orphaned if the catalog names it, else
/// `error` as it was.
pub(crate) fn orphan_or(meta: &Meta, name: &str, error: Error) -> Error {
    if !matches!(error, Error::NoSuchVolume(_)) {
        return error;
    }
    let orphan = meta.read(|view| {
        let md = view.md?;
        let entry = view.catalog.find(name)?;
        (!md.has_volume(entry.id)).then_some(entry.id)
    });
    match orphan {
        Some(id) => CatalogRefusal::Orphaned {
            name: name.to_string(),
            id,
        }
        .into(),
        None => error,
    }
}

/// What an adopt asks for.
pub(crate) struct Adoption<'a> {
    pub(crate) id: VolumeId,
    pub(crate) name: &'a str,
    pub(crate) size_bytes: u64,
    pub(crate) origin: Option<&'a str>,
}

/// Name the unadopted thin id `id` (see the module doc). Refused: an id the catalog has or
/// the metadata lacks, a name in use, a size below its highest mapped block, an origin
/// that is not a served volume.
pub(crate) fn adopt(meta: &Meta, volumes: &Volumes, adoption: &Adoption<'_>) -> Result<()> {
    let Adoption {
        id,
        name,
        size_bytes,
        origin,
    } = *adoption;
    validate_name(name)?;
    check_volume_size(size_bytes)?;
    let origin_id = match origin {
        Some(origin) => Some(
            volumes
                .named(origin)
                .map_err(|e| orphan_or(meta, origin, e))?
                .id(),
        ),
        None => None,
    };
    let mut change = meta.changes()?.begin()?;
    let catalog = change.catalog();
    let partial = catalog.partial.iter().map(|p| (p.id, &p.name));
    let known = catalog
        .volumes
        .iter()
        .map(|v| (v.id, &v.name))
        .chain(partial);
    if let Some((_, name)) = known.into_iter().find(|&(known, _)| known == id) {
        return Err(CatalogRefusal::IdInCatalog {
            id,
            name: name.clone(),
        }
        .into());
    }
    let md = change.view().md()?;
    if !md.has_volume(id) {
        return Err(CatalogRefusal::IdNotInMetadata {
            id,
            unadopted: catalog.unadopted(&md.volumes()),
        }
        .into());
    }
    if catalog.find(name).is_some() {
        return Err(Error::NameExists(name.to_string()));
    }
    if origin_id.is_some_and(|origin| catalog.volumes.iter().all(|v| v.id != origin)) {
        return Err(Error::NoSuchVolume(origin.unwrap_or_default().to_string()));
    }
    check_covers_mappings(md, id, size_bytes, meta.block_size_bytes())?;
    let snapshotted_time = check_adopted(md, name, id, size_bytes, meta.block_size_bytes())?;
    let entry = CatalogVolume {
        name: name.to_string(),
        id,
        size_bytes,
        read_only: false,
        origin: origin_id,
        content_id: None,
    };
    let mut catalog = catalog.clone();
    // Last in creation order: its origin comes before it, as the catalog's rule wants.
    catalog.volumes.push(entry.clone());
    change.commit_catalog(catalog, |_| Ok(()))?;
    // No index: built from its tree on first use, as after activation.
    volumes.publish(Arc::new(VolumeState::new(&entry, None, snapshotted_time)));
    assert!(change.catalog().find(name).is_some_and(|v| v.id == id));
    Ok(())
}

/// `size_bytes` covers the highest block thin id `id` maps.
fn check_covers_mappings(
    md: &PoolMetadata,
    id: VolumeId,
    size_bytes: u64,
    block_size_bytes: u64,
) -> Result<()> {
    let Some(highest_block) = md.highest_mapped(id)? else {
        return Ok(());
    };
    let needed_bytes = highest_block
        .get()
        .saturating_add(1)
        .saturating_mul(block_size_bytes);
    if size_bytes < needed_bytes {
        return Err(CatalogRefusal::SizeBelowMapped {
            id,
            size_bytes,
            needed_bytes,
            highest_block,
        }
        .into());
    }
    Ok(())
}

/// Drop the orphaned entry `name` (catalog only). Refused for a name whose thin id is in
/// the metadata (that is a delete) and for a name the catalog lacks.
pub(crate) fn forget(meta: &Meta, volumes: &Volumes, name: &str) -> Result<()> {
    let mut change = meta.changes()?.begin()?;
    let entry = change
        .catalog()
        .find(name)
        .cloned()
        .ok_or_else(|| Error::NoSuchVolume(name.to_string()))?;
    if change.view().md()?.has_volume(entry.id) {
        return Err(CatalogRefusal::StillInMetadata {
            name: name.to_string(),
            id: entry.id,
        }
        .into());
    }
    assert!(
        volumes.named(name).is_err(),
        "an orphaned entry is never published"
    );
    let mut catalog = change.catalog().clone();
    // Its snapshots lose it as origin: a later volume of that id is not theirs.
    catalog.remove(entry.id);
    change.commit_catalog(catalog, |_| Ok(()))?;
    assert!(change.catalog().find(name).is_none());
    Ok(())
}
