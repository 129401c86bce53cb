//! Repairing leaks in place, as `thin_check` 1.1.0 does with `--auto-repair` or
//! `--clear-needs-check-flag`: a metadata or data block that no tree references but whose
//! stored count is above zero is freed, in one ordinary transaction (a new superblock over
//! the new space maps), and the metadata is checked again.
//!
//! Only leaks are repaired: with any fatal problem nothing is written (a count too high on
//! a referenced block, or one too low, means the trees or the space maps are wrong, which
//! `thinpool repair` rebuilds). The report keeps at most [`PROBLEMS_MAX`] problems, so more
//! leaks than that take several rounds; each round frees what its report lists.

use super::{check, CheckOptions, Report, Rule, PROBLEMS_MAX};
use crate::format::metadata::PoolMetadata;
use crate::ids::DataBlock;
use persistent_data::{BlockDevice, MetadataBlock};
use std::sync::Arc;

/// What a leak repair did.
#[derive(Clone, Debug)]
pub struct LeakRepair {
    /// Metadata blocks freed.
    pub metadata_blocks: u64,
    /// Data blocks freed.
    pub data_blocks: u64,
    /// The check after the last round (the given report if nothing was repaired).
    pub report: Report,
}

/// Free the leaks `report` (a check of `device` with `options`) lists, check again, and
/// repeat while leaks are found and nothing is fatal. `device` must be writable.
pub fn repair_leaks(
    device: Arc<dyn BlockDevice>,
    options: &CheckOptions,
    report: Report,
) -> crate::Result<LeakRepair> {
    let mut repair = LeakRepair {
        metadata_blocks: 0,
        data_blocks: 0,
        report,
    };
    // Every round frees at least one block; the metadata device bounds the rounds.
    let rounds_max = device.block_count() / PROBLEMS_MAX as u64 + 2;
    for _ in 0..rounds_max {
        let (metadata, data) = leaks(&repair.report);
        if repair.report.fatal_count > 0 || (metadata.is_empty() && data.is_empty()) {
            break;
        }
        let mut pool = PoolMetadata::open(device.clone())?;
        pool.release_leaks(&metadata, &data)?;
        drop(pool);
        repair.metadata_blocks += metadata.len() as u64;
        repair.data_blocks += data.len() as u64;
        repair.report = check(device.clone(), options, &mut |_| {});
    }
    Ok(repair)
}

/// The leaked metadata and data blocks a report lists.
fn leaks(report: &Report) -> (Vec<MetadataBlock>, Vec<DataBlock>) {
    let mut metadata = Vec::new();
    let mut data = Vec::new();
    for problem in &report.problems {
        match (problem.rule, problem.block, problem.data_block) {
            (Rule::MetadataLeak, Some(block), _) => metadata.push(MetadataBlock::new(block)),
            (Rule::DataLeak, _, Some(block)) => data.push(DataBlock::new(block)),
            _ => {}
        }
    }
    (metadata, data)
}
