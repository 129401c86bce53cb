//! The `status` answer's record: the pool's figures, who serves it, and where its catalog
//! and metadata disagree (split from `protocol.rs`, which re-exports these types).

use serde::{Deserialize, Serialize};
use thin_pool::{Disagreements, PoolStatus, VolumeInfo};

use crate::pool_dir::{percent, StoredOptions};

/// The pool's status, as `status` reports it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StatusRecord {
    /// Committed transaction id.
    pub transaction_id: u64,
    /// Data blocks in use.
    pub data_used_blocks: u64,
    /// Data blocks in the pool.
    pub data_total_blocks: u64,
    /// Data use in percent.
    pub data_used_percent: f64,
    /// Metadata blocks in use.
    pub metadata_used_blocks: u64,
    /// Metadata blocks in the pool.
    pub metadata_total_blocks: u64,
    /// Metadata use in percent.
    pub metadata_used_percent: f64,
    /// Data block size.
    pub block_size_bytes: u64,
    /// dm-thin's mode word: rw, out_of_data_space, ro, fail.
    pub mode: String,
    /// In fail mode: why (e.g. a panic inside the engine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fail_reason: Option<String>,
    /// The metadata needs a check before the pool may write again.
    pub needs_check: bool,
    /// New blocks are zeroed where their first write does not cover them.
    pub zero_new_blocks: bool,
    /// Writes fail at once when out of data space.
    pub error_if_no_space: bool,
    /// Freed data blocks are discarded on the data device.
    pub discard_passdown: bool,
    /// Data use reached the low-water mark.
    pub low_water_reached: bool,
    /// Metadata use reached the low-water mark.
    #[serde(default)]
    pub metadata_low_water_reached: bool,
    /// The low-water mark, in percent of the data and of the metadata.
    #[serde(default)]
    pub low_water_percent: u32,
    /// Autoextend, if on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoextend: Option<crate::pool_dir::StoredAutoextend>,
    /// How long a write waits for space when out of it (0: forever).
    #[serde(default)]
    pub no_space_timeout_seconds: u64,
    /// Bytes of freed data blocks given back to the host since the pool opened.
    #[serde(default)]
    pub data_bytes_passed_down: u64,
    /// Metadata block of a held metadata snapshot.
    pub metadata_snap: Option<u64>,
    /// Volumes in the pool.
    pub volume_count: usize,
    /// Thin ids the metadata holds and the catalog does not know: not served.
    #[serde(default)]
    pub unadopted: Vec<UnadoptedRecord>,
    /// Catalog entries whose thin id is not in the metadata: not served.
    #[serde(default)]
    pub orphaned: Vec<OrphanedRecord>,
    /// Who serves the pool (`status` only; null when no server holds it).
    #[serde(default)]
    pub served: Option<ServedRecord>,
    /// The volumes' virtual sizes added up (`status` only).
    #[serde(default)]
    pub volumes_size_bytes: u64,
    /// The volumes' sizes add up to more than the data device: writes can run out of
    /// space before any volume is full (LVM warns of this "over-provisioning").
    #[serde(default)]
    pub overprovisioned: bool,
    /// Per volume `thinpool replicate` replicates: its lag (`crate::replication::Lag`;
    /// filled by the `status` command from the pool directory's `replication.json`).
    #[serde(default)]
    pub replication: Vec<crate::replication::Lag>,
}

/// The server holding a pool, as it reports itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServedRecord {
    /// The serving process.
    pub pid: u32,
    /// NBD connections open on the Unix socket(s), in handshake or transmission.
    pub nbd_unix_connections: u64,
    /// NBD connections open over TCP (0 without `--tcp`).
    pub nbd_tcp_connections: u64,
    /// vhost-user-blk sockets served (`--vhost-user-blk`).
    pub vhost_user_blk_sockets: u64,
}

/// A thin id only the metadata holds (`thinpool volume adopt` names it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnadoptedRecord {
    /// The thin id.
    pub id: u64,
    /// Blocks it maps.
    pub mapped_blocks: u64,
    /// Bytes it maps.
    pub mapped_bytes: u64,
}

/// A catalog entry whose thin id the metadata lacks (`thinpool volume forget` drops it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrphanedRecord {
    /// Its name.
    pub name: String,
    /// The thin id the metadata lacks.
    pub id: u64,
    /// The size the catalog records.
    pub size_bytes: u64,
}

impl StatusRecord {
    pub(super) fn new(status: &PoolStatus, options: &StoredOptions) -> Self {
        StatusRecord::with_disagreements(status, options, &Disagreements::default())
    }

    /// The status with the catalog's disagreements with the metadata.
    pub(super) fn with_disagreements(
        status: &PoolStatus,
        options: &StoredOptions,
        found: &Disagreements,
    ) -> Self {
        StatusRecord {
            transaction_id: status.transaction_id,
            data_used_blocks: status.data_used_blocks,
            data_total_blocks: status.data_total_blocks,
            data_used_percent: percent(status.data_used_blocks, status.data_total_blocks),
            metadata_used_blocks: status.metadata_used_blocks,
            metadata_total_blocks: status.metadata_total_blocks,
            metadata_used_percent: percent(
                status.metadata_used_blocks,
                status.metadata_total_blocks,
            ),
            block_size_bytes: status.block_size_bytes,
            mode: status.mode.as_str().to_string(),
            fail_reason: status.fail_reason.clone(),
            needs_check: status.needs_check,
            zero_new_blocks: options.zero_new_blocks,
            error_if_no_space: status.error_if_no_space,
            discard_passdown: status.discard_passdown,
            low_water_reached: status.low_water_reached,
            metadata_low_water_reached: status.metadata_low_water_reached,
            low_water_percent: status.low_water_percent,
            autoextend: options.space.autoextend,
            no_space_timeout_seconds: status.no_space_timeout.as_secs(),
            data_bytes_passed_down: status.data_bytes_passed_down,
            metadata_snap: status.metadata_snap,
            volume_count: status.volume_count,
            unadopted: found
                .unadopted
                .iter()
                .map(|thin| UnadoptedRecord {
                    id: u64::from(thin.id.get()),
                    mapped_blocks: thin.mapped_blocks,
                    mapped_bytes: thin.mapped_bytes,
                })
                .collect(),
            orphaned: found
                .orphaned
                .iter()
                .map(|volume| OrphanedRecord {
                    name: volume.name.clone(),
                    id: u64::from(volume.id.get()),
                    size_bytes: volume.size_bytes,
                })
                .collect(),
            served: None,
            volumes_size_bytes: 0,
            overprovisioned: false,
            replication: Vec::new(),
        }
    }

    /// Sets the provisioned size (the volumes' sizes added up) and whether it exceeds the
    /// data device.
    pub fn set_provisioned(&mut self, volumes: &[VolumeInfo]) {
        self.volumes_size_bytes = volumes.iter().map(|v| v.size_bytes).sum();
        self.overprovisioned =
            self.volumes_size_bytes > self.data_total_blocks * self.block_size_bytes;
    }
}
