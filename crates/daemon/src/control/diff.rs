//! The `diff` request: the blocks in which two volumes differ ([`thin_pool::Pool::diff`]),
//! or `thin_delta`'s full report with `same` ranges ([`thin_pool::Pool::delta`]), as a
//! [`DiffRecord`] both the direct and the served path return.
//!
//! ```text
//!   -> {"op":"diff","base":"vm1","target":"vm1-snap","list_same":false}
//!   <- {"thinpool_json":1,"ok":true,"diff":{"base":{"name":"vm1","id":0,...},
//!       "target":{"name":"vm1-snap",...},"block_size_bytes":65536,"superblock":null,
//!       "ranges":[{"begin_block":3,"length_blocks":1,"offset_bytes":196608,
//!       "length_bytes":65536,"kind":"changed",...}]}}
//! ```

use serde::{Deserialize, Serialize};
use thin_pool::format::diff::{DeltaHeader, DeltaKind, DeltaRange};
use thin_pool::progress::Progress;
use thin_pool::{DiffKind, Pool};

use super::{OpError, Outcome, VolumeRecord};

/// Two volumes compared, as `diff` answers and `diff --json` prints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DiffRecord {
    /// The base volume (`left` in `thin_delta`'s terms).
    pub base: VolumeRecord,
    /// The target volume (`right`).
    pub target: VolumeRecord,
    /// Data block size.
    pub block_size_bytes: u64,
    /// `thin_delta`'s superblock fields, with `list_same` only (else null).
    pub superblock: Option<DiffSuperblock>,
    /// Sorted ranges of virtual blocks; `same` ones only with `list_same`.
    pub ranges: Vec<DiffRangeRecord>,
}

/// The superblock fields `thin_delta` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiffSuperblock {
    /// Pool time (dm-thin's snapshot counter).
    pub pool_time: u32,
    /// Transaction id.
    pub transaction_id: u64,
    /// Data block size in sectors.
    pub data_block_size_sectors: u32,
    /// Data blocks in the pool.
    pub data_total_blocks: u64,
}

/// Virtual blocks `begin_block..begin_block + length_blocks` of one kind, and the same
/// range in bytes (the last range cut at the larger volume's end: a volume may end inside
/// a block).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiffRangeRecord {
    /// First virtual block.
    pub begin_block: u64,
    /// Blocks.
    pub length_blocks: u64,
    /// First byte.
    pub offset_bytes: u64,
    /// Bytes.
    pub length_bytes: u64,
    /// `changed`, `base_only`, `target_only`, or `same`.
    pub kind: String,
    /// With `list_same`: the data block the first block maps to in the base, if mapped
    /// (else null).
    pub base_data_begin_block: Option<u64>,
    /// With `list_same`: the same in the target.
    pub target_data_begin_block: Option<u64>,
}

/// `same` in a [`DiffRangeRecord`].
pub const SAME: &str = "same";

impl DiffRecord {
    /// `thin_delta`'s header, if the record has one.
    pub fn delta_header(&self) -> Option<DeltaHeader> {
        self.superblock.map(|s| DeltaHeader {
            time: s.pool_time,
            transaction_id: s.transaction_id,
            data_block_size_sectors: s.data_block_size_sectors,
            data_block_count: s.data_total_blocks,
        })
    }

    /// The ranges in `thin_delta`'s terms.
    pub fn delta_ranges(&self) -> anyhow::Result<Vec<DeltaRange>> {
        self.ranges
            .iter()
            .map(|range| {
                let kind = match range.kind.as_str() {
                    SAME => DeltaKind::Same,
                    "changed" => DeltaKind::Different,
                    "base_only" => DeltaKind::LeftOnly,
                    "target_only" => DeltaKind::RightOnly,
                    other => anyhow::bail!("unknown diff range kind {other:?}"),
                };
                Ok(DeltaRange {
                    begin: range.begin_block,
                    length: range.length_blocks,
                    kind,
                    left_data_begin: range.base_data_begin_block,
                    right_data_begin: range.target_data_begin_block,
                })
            })
            .collect()
    }
}

/// Carries out a `diff` request on `pool`.
/// `progress` (without `list_same`) counts the virtual blocks compared.
pub fn execute(
    pool: &Pool,
    base: &str,
    target: &str,
    list_same: bool,
    progress: Option<&Progress>,
) -> Result<Outcome, OpError> {
    let (base_info, target_info) = (pool.info(base)?, pool.info(target)?);
    let block = pool.block_size_bytes();
    let end = base_info.size_bytes.max(target_info.size_bytes);
    let range = |begin: u64, length: u64, kind: &str, data: [Option<u64>; 2]| {
        let offset_bytes = begin * block;
        DiffRangeRecord {
            begin_block: begin,
            length_blocks: length,
            offset_bytes,
            length_bytes: (length * block).min(end.saturating_sub(offset_bytes)),
            kind: kind.to_string(),
            base_data_begin_block: data[0],
            target_data_begin_block: data[1],
        }
    };
    let (superblock, ranges) = if list_same {
        let delta = pool.delta(base, target)?;
        let ranges = delta
            .ranges
            .iter()
            .map(|r| {
                let kind = match r.kind {
                    DeltaKind::Same => SAME,
                    DeltaKind::Different => DiffKind::Changed.as_str(),
                    DeltaKind::LeftOnly => DiffKind::BaseOnly.as_str(),
                    DeltaKind::RightOnly => DiffKind::TargetOnly.as_str(),
                };
                range(
                    r.begin,
                    r.length,
                    kind,
                    [r.left_data_begin, r.right_data_begin],
                )
            })
            .collect();
        let header = delta.header;
        let superblock = DiffSuperblock {
            pool_time: header.time,
            transaction_id: header.transaction_id,
            data_block_size_sectors: header.data_block_size_sectors,
            data_total_blocks: header.data_block_count,
        };
        (Some(superblock), ranges)
    } else {
        let diff = match progress {
            Some(progress) => pool.diff_with_progress(base, target, None, progress)?,
            None => pool.diff(base, target, None)?,
        };
        let ranges = diff
            .ranges
            .iter()
            .map(|r| range(r.begin.get(), r.length, r.kind.as_str(), [None, None]))
            .collect();
        (None, ranges)
    };
    Ok(Outcome::Diff(Box::new(DiffRecord {
        base: VolumeRecord::from(&base_info),
        target: VolumeRecord::from(&target_info),
        block_size_bytes: block,
        superblock,
        ranges,
    })))
}
