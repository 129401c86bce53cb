//! The checker's superblocks: block 0, read raw so that a bad checksum is reported rather
//! than refused, and the metadata snapshot's. Fields are decoded by the one codec
//! ([`crate::format::superblock`]); each broken field rule it lists becomes a warning, as
//! thin_check only enforces the checksum.

use super::report::{Problem, Report, Rule, Severity, Structure};
use super::tree::Walker;
use crate::format::superblock::{Flaw, Superblock, Unchecked};
use persistent_data::block_manager::BlockManager;
use persistent_data::checksum::{self, BlockKind};
use persistent_data::MetadataBlock;

pub(super) fn problem(severity: Severity, rule: Rule, detail: String) -> Problem {
    Problem {
        severity,
        structure: Structure::Superblock,
        volume: None,
        block: Some(0),
        data_block: None,
        rule,
        detail,
    }
}

/// Read block 0: its checksum is the one superblock rule thin_check enforces; every other
/// broken field rule is a warning.
pub(super) fn read_live(bm: &BlockManager, report: &mut Report) -> Option<Superblock> {
    let data = match bm.read_raw(MetadataBlock::SUPERBLOCK) {
        Ok(data) => data,
        Err(error) => {
            report.push(problem(
                Severity::Fatal,
                Rule::Io,
                format!("cannot read the superblock: {error}"),
            ));
            return None;
        }
    };
    let stored = checksum::stored(&data);
    let computed = checksum::compute(&data, BlockKind::Superblock);
    if stored != computed {
        report.push(problem(
            Severity::Fatal,
            Rule::SuperblockChecksum,
            format!(
                "bad checksum in superblock (stored {stored:#010x}, computed {computed:#010x})"
            ),
        ));
        return None;
    }
    let unchecked = Unchecked::decode(&data);
    let sb = &unchecked.superblock;
    let summary = &mut report.summary;
    summary.transaction_id = sb.transaction_id;
    summary.time = sb.time;
    summary.flags = sb.flags;
    summary.metadata_snap = sb.metadata_snap.map(|snap| snap.get());
    summary.metadata_block_count = sb.metadata_space_map.block_count;
    summary.metadata_free_blocks = sb
        .metadata_space_map
        .block_count
        .saturating_sub(sb.metadata_space_map.allocated_count);
    summary.data_block_count = sb.data_space_map.block_count;
    summary.data_free_blocks = sb
        .data_space_map
        .block_count
        .saturating_sub(sb.data_space_map.allocated_count);
    // What the kernel checks but thin_check does not: warnings only, except a wrong magic,
    // which is no thin pool superblock at all: every open refuses it, and so does check.
    for flaw in unchecked.flaws(MetadataBlock::SUPERBLOCK) {
        let severity = match flaw {
            Flaw::Magic { .. } => Severity::Fatal,
            _ => Severity::Warning,
        };
        report.push(problem(severity, Rule::SuperblockField, flaw.to_string()));
    }
    Some(unchecked.superblock)
}

/// Count and read the metadata snapshot's superblock, if one is held.
/// Its checksum and location are checked (by the read); its fields are not.
pub(super) fn read_snapshot(walker: &mut Walker<'_>, sb: &Superblock) -> Option<Superblock> {
    let location = sb.metadata_snap?.get();
    if !walker.reference(location, Structure::MetadataSnapshot, None, Some(0)) {
        return None;
    }
    let data = walker.read(
        location,
        BlockKind::Superblock,
        Structure::MetadataSnapshot,
        None,
    )?;
    Some(Unchecked::decode(&data).superblock)
}
