//! Restored pools: dm-thin metadata holds no volume names or sizes (LVM keeps them), so a
//! pool directory whose `metadata` was restored (by `thinpool restore` or LVM's
//! `thin_restore`) gets a catalog naming each volume `thin-ID` ([`name_restored_volumes`]),
//! with the size of the data device (or up to its highest mapped block, if that is further).
//! The management commands and `serve` write it when a pool directory has none at all.

use anyhow::Context;
use persistent_data::FileDevice;
use std::path::Path;
use std::sync::Arc;
use thin_pool::catalog::{Catalog, CatalogStore, CatalogVolume, DirCatalog};
use thin_pool::PoolMetadata;
use thin_pool::{DATA_FILE, METADATA_FILE};

/// If the pool directory `dir` has no volume catalog (its metadata was restored, e.g. by
/// LVM's `thin_restore`), write one naming each volume `thin-ID`. Returns whether it did.
pub fn name_restored_volumes(dir: &Path) -> anyhow::Result<bool> {
    if has_catalog(dir)? {
        return Ok(false);
    }
    write_restored_catalog(dir)?;
    Ok(true)
}

/// Whether `dir` holds any `catalog-N.json`.
pub fn has_catalog(dir: &Path) -> anyhow::Result<bool> {
    let entries =
        std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?;
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list {}", dir.display()))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("catalog-") && name.ends_with(".json") {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Write the catalog of the metadata in `dir` (volumes `thin-ID`), as the only catalog.
pub fn write_restored_catalog(dir: &Path) -> anyhow::Result<()> {
    let path = dir.join(METADATA_FILE);
    let device = FileDevice::open(&path, false)
        .with_context(|| format!("cannot open {}", path.display()))?;
    let md = PoolMetadata::open(Arc::new(device))
        .with_context(|| format!("cannot read the metadata in {}", path.display()))?;
    let block_size_bytes = u64::from(md.data_block_size_sectors()) * 512;
    let data_path = dir.join(DATA_FILE);
    let data_bytes = std::fs::metadata(&data_path)
        .with_context(|| format!("cannot stat {}", data_path.display()))?
        .len();
    let data_blocks = data_bytes / block_size_bytes;
    let mut volumes = Vec::new();
    for id in md.volumes() {
        let highest = md
            .highest_mapped(id)
            .with_context(|| format!("cannot read the mappings of volume {id}"))?;
        let blocks = highest.map_or(0, |block| block.get().saturating_add(1));
        let size_bytes = blocks
            .max(data_blocks)
            .max(1)
            .checked_mul(block_size_bytes)
            .with_context(|| format!("volume {id} maps blocks beyond any volume size"))?;
        volumes.push(CatalogVolume {
            name: format!("thin-{id}"),
            id,
            size_bytes,
            read_only: false,
            origin: None,
            content_id: None,
        });
    }
    let catalog = Catalog {
        transaction_id: md.transaction_id().get(),
        volumes,
        partial: Vec::new(),
    };
    let store = DirCatalog::new(dir);
    store
        .store(&catalog)
        .and_then(|()| store.committed(catalog.transaction_id))
        .with_context(|| format!("cannot write the volume catalog in {}", dir.display()))?;
    Ok(())
}
