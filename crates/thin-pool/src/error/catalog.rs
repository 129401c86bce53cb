//! [`CatalogRefusal`]: the refusals of `volume adopt` and `volume forget`, and of a name
//! whose catalog entry lost its thin id (issue 20 finding 11). Each carries the thin id,
//! the name and the sizes involved; all are refusals (the pool is left as it was).

use crate::ids::{VirtualBlock, VolumeId};

/// Why an adopt, a forget or a use of an orphaned name is refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CatalogRefusal {
    /// The thin id already has a catalog entry.
    #[error(
        "thin id {id} is volume {name:?} already (adopt names a thin id the catalog does not know)"
    )]
    IdInCatalog {
        /// The thin id.
        id: VolumeId,
        /// Its catalog name.
        name: String,
    },
    /// The thin id is not in the metadata.
    #[error("thin id {id} is not in the metadata ({})", unadopted_list(unadopted))]
    IdNotInMetadata {
        /// The thin id asked for.
        id: VolumeId,
        /// The thin ids that could be adopted.
        unadopted: Vec<VolumeId>,
    },
    /// A size that does not cover the highest block the thin id maps.
    #[error("thin id {id} maps virtual block {highest_block}, so its size must be at least {needed_bytes} bytes ({}), not {size_bytes} bytes ({})", mib(*needed_bytes), mib(*size_bytes))]
    SizeBelowMapped {
        /// The thin id.
        id: VolumeId,
        /// The size asked for.
        size_bytes: u64,
        /// The smallest size that covers every mapping.
        needed_bytes: u64,
        /// Its highest mapped block.
        highest_block: VirtualBlock,
    },
    /// `forget` of a volume whose thin id is in the metadata.
    #[error("volume {name:?} (thin id {id}) is in the metadata: forget drops only a catalog entry whose thin id is gone; `thinpool volume delete {name}` deletes the volume and its data")]
    StillInMetadata {
        /// The volume.
        name: String,
        /// Its thin id.
        id: VolumeId,
    },
    /// A catalog entry whose thin id is not in the metadata: not served.
    #[error("volume {name:?} is orphaned: its thin id {id} is not in the metadata (deleted outside thinpool?), so it is not served; `thinpool volume forget {name}` drops the catalog entry")]
    Orphaned {
        /// The volume.
        name: String,
        /// Its thin id.
        id: VolumeId,
    },
}

impl CatalogRefusal {
    /// The errno: as dm-thin, a missing device id is ENODATA; a taken id EEXIST.
    pub(crate) fn errno(&self) -> i32 {
        match self {
            CatalogRefusal::IdInCatalog { .. } => libc::EEXIST,
            CatalogRefusal::IdNotInMetadata { .. } | CatalogRefusal::Orphaned { .. } => {
                libc::ENODATA
            }
            CatalogRefusal::SizeBelowMapped { .. } | CatalogRefusal::StillInMetadata { .. } => {
                libc::EINVAL
            }
        }
    }
}

fn unadopted_list(ids: &[VolumeId]) -> String {
    if ids.is_empty() {
        return "it holds no thin id the catalog lacks".to_string();
    }
    let ids: Vec<String> = ids.iter().map(|id| id.to_string()).collect();
    format!("thin ids the catalog lacks: {}", ids.join(", "))
}

/// Bytes in MiB with two decimals.
fn mib(bytes: u64) -> String {
    format!("{:.2} MiB", bytes as f64 / (1u64 << 20) as f64)
}
