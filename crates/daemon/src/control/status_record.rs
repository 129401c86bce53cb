//! The `status` answer's record: the pool's figures, who serves it, and where its catalog
//! and metadata disagree (split from `protocol.rs`, which re-exports these types).

use serde::{Deserialize, Serialize};
use thin_pool::{Disagreements, PoolStatus, VolumeInfo};

use crate::pool_dir::{percent, StoredAutoextend, StoredOptions};

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
    /// In fail mode: why (e.g. a panic inside the engine); else null.
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
    pub metadata_low_water_reached: bool,
    /// The low-water mark, in percent of the data and of the metadata.
    pub low_water_percent: u32,
    /// Autoextend; null when off.
    pub autoextend: Option<AutoextendRecord>,
    /// How long a write waits for space when out of it (0: forever).
    pub no_space_timeout_seconds: u64,
    /// Bytes of freed data blocks given back to the host since the pool opened.
    pub data_passed_down_bytes: u64,
    /// Metadata block of a held metadata snapshot; null when none is held.
    pub metadata_snap_block: Option<u64>,
    /// Volumes in the pool.
    pub volume_count: usize,
    /// Thin ids the metadata holds and the catalog does not know: not served.
    pub unadopted: Vec<UnadoptedRecord>,
    /// Catalog entries whose thin id is not in the metadata: not served.
    pub orphaned: Vec<OrphanedRecord>,
    /// Who serves the pool; null when no server holds it.
    pub served: Option<ServedRecord>,
    /// The volumes' virtual sizes added up.
    pub volumes_size_bytes: u64,
    /// The volumes' sizes add up to more than the data device: writes can run out of
    /// space before any volume is full (LVM warns of this "over-provisioning").
    pub overprovisioned: bool,
    /// Per volume `thinpool replicate` replicates: its lag (`crate::replication::Lag`;
    /// filled by the `status` command from the pool directory's `replication.json`).
    #[serde(default)]
    pub replication: Vec<crate::replication::Lag>,
}

/// Autoextend's settings, as `status` reports them (`pool.json`'s form is not the contract).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AutoextendRecord {
    /// Used share, in percent, that triggers a growth.
    pub threshold_percent: u32,
    /// Growth step as a share of the current size, in percent; null when `by_bytes` is set.
    pub by_percent: Option<u32>,
    /// Growth step in bytes; null when it is a share.
    pub by_bytes: Option<u64>,
    /// Largest data size autoextend grows to.
    pub max_bytes: u64,
}

impl AutoextendRecord {
    /// The stored settings' form; `pool_dir` reads the same settings back from it.
    pub fn stored(&self) -> StoredAutoextend {
        StoredAutoextend {
            threshold_percent: self.threshold_percent,
            by_percent: self.by_percent,
            by_bytes: self.by_bytes,
            max_bytes: self.max_bytes,
        }
    }
}

impl From<&StoredAutoextend> for AutoextendRecord {
    fn from(stored: &StoredAutoextend) -> Self {
        AutoextendRecord {
            threshold_percent: stored.threshold_percent,
            by_percent: stored.by_percent,
            by_bytes: stored.by_bytes,
            max_bytes: stored.max_bytes,
        }
    }
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
            autoextend: options
                .space
                .autoextend
                .as_ref()
                .map(AutoextendRecord::from),
            no_space_timeout_seconds: status.no_space_timeout.as_secs(),
            data_passed_down_bytes: status.data_bytes_passed_down,
            metadata_snap_block: status.metadata_snap,
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
