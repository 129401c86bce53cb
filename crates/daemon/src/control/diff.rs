//! The `diff` request: the blocks in which two volumes differ ([`thin_pool::Pool::diff`]),
//! or `thin_delta`'s full report with `same` ranges ([`thin_pool::Pool::delta`]), as a
//! [`DiffRecord`] both the direct and the served path return.
//!
//! ```text
//!   -> {"op":"diff","base":"vm1","target":"vm1-snap","list_same":false}
//!   <- {"ok":true,"diff":{"base":"vm1","target":"vm1-snap","base_id":0,"target_id":1,
//!       "block_size_bytes":65536,...,"ranges":[{"begin":3,"length":1,"kind":"changed"}]}}
//! ```

use serde::{Deserialize, Serialize};
use thin_pool::format::diff::{DeltaHeader, DeltaKind, DeltaRange};
use thin_pool::{DiffKind, Pool};

use super::{OpError, Outcome};

/// Two volumes compared, as `diff` answers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiffRecord {
    /// The base volume (`left` in `thin_delta`'s terms).
    pub base: String,
    /// The target volume (`right`).
    pub target: String,
    /// The base volume's thin id.
    pub base_id: u64,
    /// The target volume's thin id.
    pub target_id: u64,
    /// Data block size.
    pub block_size_bytes: u64,
    /// The base volume's size.
    pub base_size_bytes: u64,
    /// The target volume's size.
    pub target_size_bytes: u64,
    /// `thin_delta`'s superblock fields, with `list_same` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub superblock: Option<DiffSuperblock>,
    /// Sorted ranges of virtual blocks; `same` ones only with `list_same`.
    pub ranges: Vec<DiffRangeRecord>,
}

/// The superblock fields `thin_delta` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiffSuperblock {
    /// Pool time.
    pub time: u32,
    /// Transaction id.
    pub transaction_id: u64,
    /// Data block size in sectors.
    pub data_block_size_sectors: u32,
    /// Data blocks in the pool.
    pub data_block_count: u64,
}

/// Virtual blocks `begin..begin + length` of one kind.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiffRangeRecord {
    /// First virtual block.
    pub begin: u64,
    /// Blocks.
    pub length: u64,
    /// `changed`, `base_only`, `target_only`, or `same`.
    pub kind: String,
    /// With `list_same`: the data block the first block maps to in the base, if mapped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_data_begin: Option<u64>,
    /// With `list_same`: the same in the target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_data_begin: Option<u64>,
}

/// `same` in a [`DiffRangeRecord`].
pub const SAME: &str = "same";

impl DiffRecord {
    /// `thin_delta`'s header, if the record has one.
    pub fn delta_header(&self) -> Option<DeltaHeader> {
        self.superblock.map(|s| DeltaHeader {
            time: s.time,
            transaction_id: s.transaction_id,
            data_block_size_sectors: s.data_block_size_sectors,
            data_block_count: s.data_block_count,
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
                    begin: range.begin,
                    length: range.length,
                    kind,
                    left_data_begin: range.base_data_begin,
                    right_data_begin: range.target_data_begin,
                })
            })
            .collect()
    }
}

/// Carries out a `diff` request on `pool`.
pub fn execute(pool: &Pool, base: &str, target: &str, list_same: bool) -> Result<Outcome, OpError> {
    let (base_info, target_info) = (pool.info(base)?, pool.info(target)?);
    let (superblock, ranges) = if list_same {
        let delta = pool.delta(base, target)?;
        let ranges = delta
            .ranges
            .iter()
            .map(|range| DiffRangeRecord {
                begin: range.begin,
                length: range.length,
                kind: match range.kind {
                    DeltaKind::Same => SAME,
                    DeltaKind::Different => DiffKind::Changed.as_str(),
                    DeltaKind::LeftOnly => DiffKind::BaseOnly.as_str(),
                    DeltaKind::RightOnly => DiffKind::TargetOnly.as_str(),
                }
                .to_string(),
                base_data_begin: range.left_data_begin,
                target_data_begin: range.right_data_begin,
            })
            .collect();
        let header = delta.header;
        let superblock = DiffSuperblock {
            time: header.time,
            transaction_id: header.transaction_id,
            data_block_size_sectors: header.data_block_size_sectors,
            data_block_count: header.data_block_count,
        };
        (Some(superblock), ranges)
    } else {
        let diff = pool.diff(base, target, None)?;
        let ranges = diff
            .ranges
            .iter()
            .map(|range| DiffRangeRecord {
                begin: range.begin.get(),
                length: range.length,
                kind: range.kind.as_str().to_string(),
                base_data_begin: None,
                target_data_begin: None,
            })
            .collect();
        (None, ranges)
    };
    Ok(Outcome::Diff(Box::new(DiffRecord {
        base: base.to_string(),
        target: target.to_string(),
        base_id: u64::from(base_info.id.get()),
        target_id: u64::from(target_info.id.get()),
        block_size_bytes: pool.block_size_bytes(),
        base_size_bytes: base_info.size_bytes,
        target_size_bytes: target_info.size_bytes,
        superblock,
        ranges,
    })))
}
