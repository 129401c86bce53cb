//! The trees of one superblock (live or metadata snapshot): the details tree, the mapping
//! tree's top level (its keys must be the details' keys) and each volume's mapping tree
//! (its size must be the details' `mapped_blocks`, its data blocks inside the data space
//! map). Data references are counted for the space-map comparison.

use super::counts::Counts;
use super::report::{Rule, Severity, Structure};
use super::tree::{TreeKind, ValueProblem, Walker};
use super::{CheckOptions, Phase};
use crate::format::details::DeviceDetails;
use crate::format::superblock::Superblock;
use crate::ids::{BlockTime, VolumeId};
use persistent_data::btree::node::Node;
use persistent_data::btree::Value;
use persistent_data::MetadataBlock;
use std::collections::BTreeMap;

/// The volume a tree key names, for reports (a key beyond u32 shows as u32::MAX).
fn volume_id(key: u64) -> VolumeId {
    VolumeId::new(u32::try_from(key).unwrap_or(u32::MAX))
}

/// Walk the details tree and the mapping tree of one superblock (live or snapshot),
/// counting data references into `data_counts` (None: don't count data).
pub(super) fn check(
    walker: &mut Walker<'_>,
    sb: &Superblock,
    options: &CheckOptions,
    mut data_counts: Option<&mut Counts>,
) {
    let is_live = sb.blocknr == MetadataBlock::SUPERBLOCK && !options.metadata_snap;
    let structure = if is_live {
        Structure::Superblock
    } else {
        Structure::MetadataSnapshot
    };
    let from = Some(sb.blocknr.get());
    walker.start_phase(Phase::DetailsTree);
    let mut details: BTreeMap<u64, DeviceDetails> = BTreeMap::new();
    let details_walked = walker.reference(sb.device_details_root.get(), structure, None, from)
        && walker
            .walk(
                sb.device_details_root.get(),
                TreeKind::Details,
                &mut |_, key, value| {
                    details.insert(key, DeviceDetails::unpack(value));
                    None
                },
            )
            .is_some();
    walker.start_phase(Phase::MappingTree);
    let mut roots: Vec<(u64, u64)> = Vec::new();
    let top_walked = walker.reference(sb.data_mapping_root.get(), structure, None, from)
        && walker
            .walk(
                sb.data_mapping_root.get(),
                TreeKind::TopLevel,
                &mut |_, key, value| {
                    roots.push((key, u64::unpack(value)));
                    None
                },
            )
            .is_some();
    if is_live {
        walker.report.summary.volume_count = details.len() as u64;
    }
    // Shared top-level leaves of the snapshot were walked from the live superblock: its
    // key sets are only complete for the first superblock walked.
    if details_walked && top_walked && (is_live || walker.report.fatal_count == 0) {
        compare_keys(walker, sb, &details, &roots, is_live);
    }
    if options.skip_mappings {
        return;
    }
    walker.read_ahead_trees(roots.iter().map(|&(_, root)| root).collect());
    for (key, root) in roots {
        let mapped_blocks = details.get(&key).map(|d| d.mapped_blocks);
        check_volume(
            walker,
            volume_id(key),
            root,
            mapped_blocks,
            is_live,
            data_counts.as_deref_mut(),
        );
    }
}

/// Walk the mapping tree of `volume` (root `root`), whose details say `mapped_blocks`
/// (None: no details), counting its data references into `data_counts` (None: don't).
fn check_volume(
    walker: &mut Walker<'_>,
    volume: VolumeId,
    root: u64,
    mapped_blocks: Option<u64>,
    is_live: bool,
    mut data_counts: Option<&mut Counts>,
) {
    if !walker.reference(root, Structure::MappingTopLevel, Some(volume), None) {
        return;
    }
    let data_block_count = data_counts.as_ref().map_or(u64::MAX, |c| c.len());
    // One call per leaf: the loop over its mappings is the check's innermost.
    let mut visit = |_: MetadataBlock, node: &Node<'_>, problems: &mut Vec<ValueProblem>| {
        for i in 0..node.len() {
            let data_block = BlockTime::unpack(u64::unpack(node.value_bytes(i)))
                .data_block()
                .get();
            if data_block >= data_block_count {
                let vb = node.key(i);
                problems.push((
                    Rule::DataBlockOutOfRange,
                    format!(
                        "virtual block {vb} maps to data block {data_block}, beyond the data space map's {data_block_count} blocks"
                    ),
                    Some(data_block),
                ));
            } else if let Some(counts) = data_counts.as_deref_mut() {
                counts.inc(data_block);
            }
        }
    };
    let Some(mappings) = walker.walk_leaves(root, TreeKind::Bottom(volume), &mut visit) else {
        return;
    };
    if is_live {
        walker.report.summary.mapping_count += mappings;
    }
    if let Some(mapped_blocks) = mapped_blocks.filter(|&m| m != mappings) {
        walker.problem(
            Severity::Fatal,
            Structure::DetailsTree,
            Some(volume),
            Some(root),
            Rule::MappedBlocks,
            format!(
                "details say mapped_blocks {mapped_blocks}, the volume's tree (root {root}) has {mappings} mappings"
            ),
        );
    }
}

fn compare_keys(
    walker: &mut Walker<'_>,
    sb: &Superblock,
    details: &BTreeMap<u64, DeviceDetails>,
    roots: &[(u64, u64)],
    is_live: bool,
) {
    let structure = if is_live {
        Structure::DetailsTree
    } else {
        Structure::MetadataSnapshot
    };
    let top: BTreeMap<u64, u64> = roots.iter().copied().collect();
    for key in details.keys().filter(|k| !top.contains_key(k)) {
        walker.problem(
            Severity::Fatal,
            structure,
            Some(volume_id(*key)),
            Some(sb.device_details_root.get()),
            Rule::DetailsMismatch,
            format!("device {key} is in the details tree but not in the mapping tree"),
        );
    }
    for key in top.keys().filter(|k| !details.contains_key(k)) {
        walker.problem(
            Severity::Fatal,
            structure,
            Some(volume_id(*key)),
            Some(sb.data_mapping_root.get()),
            Rule::DetailsMismatch,
            format!("device {key} is in the mapping tree but not in the details tree"),
        );
    }
}
