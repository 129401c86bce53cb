//! The metadata checker (`thinpool check`, thin_check's equivalent): validates pool
//! metadata on a device opened read-only, against every rule of spec §11, and reports every
//! problem it finds rather than stopping at the first.
//!
//! Order of work (each phase is reported to the progress callback):
//!
//! ```text
//!   superblock        checksum and magic (fatal); version, blocknr, flags (warnings)
//!   details tree      live superblock, then the metadata snapshot's
//!   mapping tree      top level (keys == details keys), each volume's tree (mapped_blocks,
//!                     data blocks < data nr_blocks), shared subtrees walked once
//!   data space map    index tree, bitmaps, overflow tree; stored counts == leaves per block
//!   metadata space map index block, bitmaps, overflow tree; stored counts == references
//! ```
//!
//! Reference counts are recomputed per spec §7.8 while walking: one count per metadata
//! block and per data block, in arrays sized by the devices, never by the number of
//! mappings. Each node is read once (a visited mark per metadata block), so the check reads
//! about as many blocks as the metadata holds.
//!
//! Severity follows thin_check 1.x: an unreferenced metadata block with a stored count is
//! a leak (non-fatal: the exit code is still non-zero unless non-fatal errors are ignored);
//! every other broken rule is fatal, a count too high on a referenced block included
//! (0.9.0 calls that non-fatal too). Reference counts are compared only when the trees
//! were walked without a fatal problem (a broken tree makes every count below it suspect).
//!
//! Callers: the `thinpool check` command, and tests that run it after every commit.

mod report;
mod tree;

pub use report::{Problem, Report, Rule, Severity, Structure, Summary, PROBLEMS_MAX};

use crate::format::details::{unpack_block_time, DeviceDetails};
use crate::format::superblock::{valid_data_block_size, MAGIC, NEEDS_CHECK_FLAG};
use crate::ids::VolumeId;
use persistent_data::block_manager::BlockManager;
use persistent_data::btree::Value;
use persistent_data::checksum::{self, BlockKind};
use persistent_data::space_map::core::{bitmap_count, decode_field, ENTRIES_PER_BITMAP};
use persistent_data::space_map::disk::decode_index_block;
use persistent_data::space_map::{IndexEntry, SpaceMapRoot, METADATA_BLOCKS_MAX};
use persistent_data::{Block, BlockDevice, MetadataBlock};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;
use tree::{Counts, TreeKind, Walker};

/// Blocks the checker's block manager caches (the walk reads each node once; the cache
/// only serves re-reads of shared nodes).
pub const CACHE_BLOCKS: usize = 1024;

/// Which thin_check's occupancy rule applies to bottom-level mapping leaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LeafOccupancy {
    /// thin_check 0.9.0 (and the kernel's invariant): every non-root node at least a third
    /// full, bottom-level mapping leaves included.
    #[default]
    Strict,
    /// thin_check 1.x: bottom-level mapping leaves may be less full.
    SkipBottomLeaves,
}

/// What to check.
#[derive(Clone, Copy, Debug, Default)]
pub struct CheckOptions {
    /// Check the superblock only (`--super-block-only`).
    pub super_block_only: bool,
    /// Check the details tree and the mapping tree's top level only; no volume trees and no
    /// reference counts (`--skip-mappings`).
    pub skip_mappings: bool,
    /// Let non-fatal problems pass ([`Report::passes`] with this flag;
    /// `--ignore-non-fatal-errors`).
    pub ignore_non_fatal: bool,
    /// The occupancy rule for bottom-level leaves.
    pub leaf_occupancy: LeafOccupancy,
    /// Check the trees of the metadata snapshot instead of the live ones, without the
    /// space maps (`--metadata-snap`).
    pub metadata_snap: bool,
}

/// A phase of the check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Reading the superblock.
    Superblock,
    /// Walking the device-details tree.
    DetailsTree,
    /// Walking the mapping tree.
    MappingTree,
    /// Checking the data space map.
    DataSpaceMap,
    /// Checking the metadata space map.
    MetadataSpaceMap,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Superblock => "superblock",
            Phase::DetailsTree => "device details tree",
            Phase::MappingTree => "mapping tree",
            Phase::DataSpaceMap => "data space map",
            Phase::MetadataSpaceMap => "metadata space map",
        })
    }
}

/// Progress of a check, for a progress bar.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// What is being checked.
    pub phase: Phase,
    /// Btree nodes read so far.
    pub done_blocks: u64,
    /// Metadata blocks in use (the stored `nr_allocated`): about how many the check reads.
    pub total_blocks: u64,
}

/// The superblock fields the checker uses, decoded without judging them (thin_check only
/// checks the checksum; the rest gives warnings).
#[derive(Clone, Debug)]
struct RawSuperblock {
    flags: u32,
    blocknr: u64,
    magic: u64,
    version: u32,
    time: u32,
    transaction_id: u64,
    metadata_snap: u64,
    data_space_map: SpaceMapRoot,
    metadata_space_map: SpaceMapRoot,
    data_mapping_root: u64,
    device_details_root: u64,
    data_block_size_sectors: u32,
    compat_ro_flags: u32,
    incompat_flags: u32,
}

impl RawSuperblock {
    fn decode(b: &Block) -> RawSuperblock {
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        RawSuperblock {
            flags: u32_at(4),
            blocknr: u64_at(8),
            magic: u64_at(32),
            version: u32_at(40),
            time: u32_at(44),
            transaction_id: u64_at(48),
            metadata_snap: u64_at(56),
            data_space_map: SpaceMapRoot::decode(&b[64..96]),
            metadata_space_map: SpaceMapRoot::decode(&b[192..224]),
            data_mapping_root: u64_at(320),
            device_details_root: u64_at(328),
            data_block_size_sectors: u32_at(336),
            compat_ro_flags: u32_at(356),
            incompat_flags: u32_at(360),
        }
    }
}

/// Check the metadata on `device` (only read, never written). Every problem found, I/O
/// errors included, is in the report; `progress` hears of each phase and of every thousand
/// nodes read.
pub fn check(
    device: Arc<dyn BlockDevice>,
    options: &CheckOptions,
    progress: &mut dyn FnMut(Progress),
) -> Report {
    let bm = BlockManager::new(device, CACHE_BLOCKS);
    let mut report = Report::default();
    progress(Progress {
        phase: Phase::Superblock,
        done_blocks: 0,
        total_blocks: 0,
    });
    let Some(sb) = read_live_superblock(&bm, &mut report) else {
        return report;
    };
    if options.super_block_only {
        return report;
    }
    let device_blocks = bm.block_count();
    let metadata_blocks = sb.metadata_space_map.block_count;
    if metadata_blocks == 0 || metadata_blocks > device_blocks.min(METADATA_BLOCKS_MAX) {
        report.push(superblock_problem(
            Severity::Fatal,
            Rule::BlockOutOfRange,
            format!(
                "metadata space map has {metadata_blocks} blocks; the device has {device_blocks} (at most {METADATA_BLOCKS_MAX} usable)"
            ),
        ));
        return report;
    }
    let bottom_leaf_occupancy = options.leaf_occupancy == LeafOccupancy::Strict;
    let mut walker = Walker::new(
        &bm,
        metadata_blocks,
        bottom_leaf_occupancy,
        report,
        progress,
    );
    walker.total_blocks = sb.metadata_space_map.allocated_count;
    // The live superblock's implicit reference.
    walker.counts.inc(0);
    let snapshot = read_snapshot_superblock(&mut walker, &sb);
    if options.metadata_snap {
        match snapshot {
            Some(snap) => {
                check_trees(&mut walker, &snap, options, None);
            }
            None if sb.metadata_snap == 0 => walker.problem(
                Severity::Fatal,
                Structure::Superblock,
                None,
                Some(0),
                Rule::MetadataSnapshot,
                "no metadata snapshot is held".to_string(),
            ),
            None => {}
        }
        return walker.report;
    }
    let data_block_count = sb.data_space_map.block_count;
    let mut data_counts = Counts::new(data_block_count);
    check_trees(&mut walker, &sb, options, Some(&mut data_counts));
    if let Some(snap) = &snapshot {
        check_trees(&mut walker, snap, options, Some(&mut data_counts));
    }
    if options.skip_mappings {
        return walker.report;
    }
    // Counts below a broken tree are unknown: comparing them would only add noise, so
    // counts are compared only while no structural problem was found.
    let data_sm = read_data_space_map(&mut walker, &sb.data_space_map);
    let structural_fatal = walker.report.fatal_count;
    if let (Some(stored), 0) = (data_sm, structural_fatal) {
        compare_counts(&mut walker, Structure::DataSpaceMap, &stored, &data_counts);
    }
    let after_data = walker.report.fatal_count;
    let metadata_sm = read_metadata_space_map(&mut walker, &sb.metadata_space_map);
    if let (Some(stored), 0, true) = (
        metadata_sm,
        structural_fatal,
        walker.report.fatal_count == after_data,
    ) {
        let expected = std::mem::replace(&mut walker.counts, Counts::new(0));
        compare_counts(&mut walker, Structure::MetadataSpaceMap, &stored, &expected);
        walker.counts = expected;
    }
    walker.report
}

fn superblock_problem(severity: Severity, rule: Rule, detail: String) -> Problem {
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

/// Read block 0: its checksum is the one superblock rule thin_check enforces.
fn read_live_superblock(bm: &BlockManager, report: &mut Report) -> Option<RawSuperblock> {
    let data = match bm.read_raw(MetadataBlock::SUPERBLOCK) {
        Ok(data) => data,
        Err(error) => {
            report.push(superblock_problem(
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
        report.push(superblock_problem(
            Severity::Fatal,
            Rule::SuperblockChecksum,
            format!(
                "bad checksum in superblock (stored {stored:#010x}, computed {computed:#010x})"
            ),
        ));
        return None;
    }
    let sb = RawSuperblock::decode(&data);
    let summary = &mut report.summary;
    summary.transaction_id = sb.transaction_id;
    summary.time = sb.time;
    summary.flags = sb.flags;
    summary.metadata_snap = (sb.metadata_snap != 0).then_some(sb.metadata_snap);
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
    // A wrong magic is no thin pool superblock at all: every open refuses it, so does check.
    if sb.magic != MAGIC {
        report.push(superblock_problem(
            Severity::Fatal,
            Rule::SuperblockField,
            format!("magic is {}, expected {MAGIC}", sb.magic),
        ));
    }
    // What the kernel checks but thin_check does not: warnings only.
    let mut warn = |detail: String| {
        report.push(superblock_problem(
            Severity::Warning,
            Rule::SuperblockField,
            detail,
        ))
    };
    if sb.blocknr != 0 {
        warn(format!("blocknr is {}, expected 0", sb.blocknr));
    }
    if !(1..=2).contains(&sb.version) {
        warn(format!("version {} is not 1 or 2", sb.version));
    }
    if sb.incompat_flags != 0 || sb.compat_ro_flags != 0 {
        warn(format!(
            "unknown feature flags: incompat {:#x}, compat_ro {:#x}",
            sb.incompat_flags, sb.compat_ro_flags
        ));
    }
    if sb.flags & !NEEDS_CHECK_FLAG != 0 {
        warn(format!("unknown flag bits {:#x}", sb.flags));
    }
    if !valid_data_block_size(sb.data_block_size_sectors) {
        warn(format!(
            "data block size {} sectors is not a multiple of 128 in 128..=2097152",
            sb.data_block_size_sectors
        ));
    }
    Some(sb)
}

/// Count and read the metadata snapshot's superblock, if one is held.
fn read_snapshot_superblock(walker: &mut Walker<'_>, sb: &RawSuperblock) -> Option<RawSuperblock> {
    if sb.metadata_snap == 0 {
        return None;
    }
    let location = sb.metadata_snap;
    if !walker.reference(location, Structure::MetadataSnapshot, None, Some(0)) {
        return None;
    }
    let data = walker.read(
        location,
        BlockKind::Superblock,
        Structure::MetadataSnapshot,
        None,
    )?;
    Some(RawSuperblock::decode(&data))
}

/// Walk the details tree and the mapping tree of one superblock (live or snapshot),
/// counting data references into `data_counts` (None: don't count data).
fn check_trees(
    walker: &mut Walker<'_>,
    sb: &RawSuperblock,
    options: &CheckOptions,
    mut data_counts: Option<&mut Counts>,
) {
    let is_live = sb.blocknr == 0 && !options.metadata_snap;
    let structure = if is_live {
        Structure::Superblock
    } else {
        Structure::MetadataSnapshot
    };
    let from = Some(sb.blocknr);
    walker.start_phase(Phase::DetailsTree);
    let mut details: BTreeMap<u64, DeviceDetails> = BTreeMap::new();
    let details_walked = walker.reference(sb.device_details_root, structure, None, from)
        && walker
            .walk(
                sb.device_details_root,
                TreeKind::Details,
                &mut |_, key, value| {
                    details.insert(key, DeviceDetails::unpack(value));
                    None
                },
            )
            .is_some();
    walker.start_phase(Phase::MappingTree);
    let mut roots: Vec<(u64, u64)> = Vec::new();
    let top_walked = walker.reference(sb.data_mapping_root, structure, None, from)
        && walker
            .walk(
                sb.data_mapping_root,
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
    let data_block_count = data_counts.as_ref().map_or(u64::MAX, |c| c.len());
    for (key, root) in roots {
        let volume = VolumeId(u32::try_from(key).unwrap_or(u32::MAX));
        if !walker.reference(root, Structure::MappingTopLevel, Some(volume), None) {
            continue;
        }
        let mut visit = |_: MetadataBlock, vb: u64, value: &[u8]| {
            let (data_block, _time) = unpack_block_time(u64::unpack(value));
            if data_block >= data_block_count {
                return Some((
                    Rule::DataBlockOutOfRange,
                    format!(
                        "virtual block {vb} maps to data block {data_block}, beyond the data space map's {data_block_count} blocks"
                    ),
                    Some(data_block),
                ));
            }
            if let Some(counts) = data_counts.as_deref_mut() {
                counts.inc(data_block);
            }
            None
        };
        let Some(mappings) = walker.walk(root, TreeKind::Bottom(volume), &mut visit) else {
            continue;
        };
        if is_live {
            walker.report.summary.mapping_count += mappings;
        }
        if let Some(d) = details.get(&key) {
            if d.mapped_blocks != mappings {
                walker.problem(
                    Severity::Fatal,
                    Structure::DetailsTree,
                    Some(volume),
                    Some(root),
                    Rule::MappedBlocks,
                    format!(
                        "details say mapped_blocks {}, the volume's tree (root {root}) has {mappings} mappings",
                        d.mapped_blocks
                    ),
                );
            }
        }
    }
}

fn compare_keys(
    walker: &mut Walker<'_>,
    sb: &RawSuperblock,
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
            Some(VolumeId(u32::try_from(*key).unwrap_or(u32::MAX))),
            Some(sb.device_details_root),
            Rule::DetailsMismatch,
            format!("device {key} is in the details tree but not in the mapping tree"),
        );
    }
    for key in top.keys().filter(|k| !details.contains_key(k)) {
        walker.problem(
            Severity::Fatal,
            structure,
            Some(VolumeId(u32::try_from(*key).unwrap_or(u32::MAX))),
            Some(sb.data_mapping_root),
            Rule::DetailsMismatch,
            format!("device {key} is in the mapping tree but not in the details tree"),
        );
    }
}

/// A space map as stored: where its bitmaps are and its overflow counts.
struct StoredSpaceMap {
    block_count: u64,
    bitmaps: Vec<Option<u64>>,
    overflow: HashMap<u64, u32>,
}

fn read_overflow(
    walker: &mut Walker<'_>,
    structure: Structure,
    root: u64,
    block_count: u64,
) -> Option<HashMap<u64, u32>> {
    if !walker.reference(root, structure, None, Some(0)) {
        return None;
    }
    let mut overflow = HashMap::new();
    let mut visit = |_: MetadataBlock, key: u64, value: &[u8]| {
        let count = u32::unpack(value);
        if key >= block_count {
            return Some((
                Rule::OverflowMismatch,
                format!("overflow entry for block {key} beyond the map's {block_count} blocks"),
                None,
            ));
        }
        if count < 3 {
            return Some((
                Rule::OverflowMismatch,
                format!("overflow entry for block {key} holds count {count}, below 3"),
                None,
            ));
        }
        overflow.insert(key, count);
        None
    };
    walker
        .walk(root, TreeKind::Overflow(structure), &mut visit)
        .map(|_| overflow)
}

fn read_data_space_map(walker: &mut Walker<'_>, root: &SpaceMapRoot) -> Option<StoredSpaceMap> {
    walker.start_phase(Phase::DataSpaceMap);
    let structure = Structure::DataSpaceMap;
    let bitmaps = bitmap_count(root.block_count);
    let mut entries: Vec<Option<u64>> = vec![None; bitmaps];
    let index_walked = walker.reference(root.bitmap_root, structure, None, Some(0)) && {
        let mut visit = |_: MetadataBlock, key: u64, value: &[u8]| {
            let entry = IndexEntry::unpack(value);
            match usize::try_from(key).ok().filter(|&i| i < bitmaps) {
                Some(i) => {
                    entries[i] = Some(entry.blocknr);
                    None
                }
                None => Some((
                    Rule::SpaceMapIndex,
                    format!("index entry {key}: the map has only {bitmaps} bitmaps"),
                    None,
                )),
            }
        };
        walker
            .walk(root.bitmap_root, TreeKind::DataIndex, &mut visit)
            .is_some()
    };
    let mut ok = index_walked;
    if index_walked {
        for (i, entry) in entries.iter_mut().enumerate() {
            match *entry {
                None => {
                    walker.problem(
                        Severity::Fatal,
                        structure,
                        None,
                        Some(root.bitmap_root),
                        Rule::SpaceMapIndex,
                        format!("index has no entry for bitmap {i}"),
                    );
                    ok = false;
                }
                Some(location) => {
                    if !walker.reference(location, structure, None, Some(root.bitmap_root)) {
                        *entry = None;
                    }
                }
            }
        }
    }
    let overflow = read_overflow(walker, structure, root.ref_count_root, root.block_count);
    match overflow {
        Some(overflow) if ok => Some(StoredSpaceMap {
            block_count: root.block_count,
            bitmaps: entries,
            overflow,
        }),
        _ => None,
    }
}

fn read_metadata_space_map(walker: &mut Walker<'_>, root: &SpaceMapRoot) -> Option<StoredSpaceMap> {
    walker.start_phase(Phase::MetadataSpaceMap);
    let structure = Structure::MetadataSpaceMap;
    let bitmaps = bitmap_count(root.block_count);
    let mut locations = None;
    if walker.reference(root.bitmap_root, structure, None, Some(0)) {
        if let Some(data) = walker.read(root.bitmap_root, BlockKind::Index, structure, None) {
            let entries = decode_index_block(&data);
            let mut found = Vec::with_capacity(bitmaps);
            for (i, entry) in entries.iter().take(bitmaps).enumerate() {
                if entry.blocknr == 0
                    || !walker.reference(entry.blocknr, structure, None, Some(root.bitmap_root))
                {
                    walker.problem(
                        Severity::Fatal,
                        structure,
                        None,
                        Some(root.bitmap_root),
                        Rule::SpaceMapIndex,
                        format!("index entry {i} points at block {}", entry.blocknr),
                    );
                    found.push(None);
                } else {
                    found.push(Some(entry.blocknr));
                }
            }
            locations = Some(found);
        }
    }
    let overflow = read_overflow(walker, structure, root.ref_count_root, root.block_count);
    Some(StoredSpaceMap {
        block_count: root.block_count,
        bitmaps: locations?,
        overflow: overflow?,
    })
}

/// Compare a stored space map with the recomputed counts, bitmap by bitmap.
fn compare_counts(
    walker: &mut Walker<'_>,
    structure: Structure,
    stored: &StoredSpaceMap,
    expected: &Counts,
) {
    let mut overflow_seen = 0usize;
    let mut bad_blocks = 0u64;
    let mut leaked_blocks = 0u64;
    for (index, location) in stored.bitmaps.iter().enumerate() {
        let Some(location) = *location else { continue };
        let Some(data) = walker.read(location, BlockKind::Bitmap, structure, None) else {
            continue;
        };
        let first = index as u64 * ENTRIES_PER_BITMAP;
        for entry in 0..ENTRIES_PER_BITMAP {
            let block = first + entry;
            let at = 16 + (entry / 32) as usize * 8;
            let word = u64::from_le_bytes(data[at..at + 8].try_into().expect("8 bytes"));
            let field = (word >> ((entry % 32) * 2)) & 3;
            if block >= stored.block_count {
                if field != 0 {
                    walker.problem(
                        Severity::Fatal,
                        structure,
                        None,
                        Some(location),
                        Rule::BitmapTail,
                        format!(
                            "entry for block {block}, beyond the map's {} blocks, is in use",
                            stored.block_count
                        ),
                    );
                }
                continue;
            }
            let stored_count = if field == 3 {
                match stored.overflow.get(&block) {
                    Some(&count) => {
                        overflow_seen += 1;
                        count
                    }
                    None => {
                        walker.problem(
                            Severity::Fatal,
                            structure,
                            None,
                            Some(location),
                            Rule::OverflowMismatch,
                            format!("bitmap says block {block} has 3 or more references, the overflow tree has no entry"),
                        );
                        continue;
                    }
                }
            } else {
                decode_field(field)
            };
            let expected_count = if block < expected.len() {
                expected.get(block)
            } else {
                0
            };
            if stored_count == expected_count {
                continue;
            }
            bad_blocks += 1;
            if expected_count == 0 {
                leaked_blocks += 1;
            }
            let (severity, rule) = match structure {
                Structure::DataSpaceMap => (Severity::Fatal, Rule::DataCount),
                _ if expected_count == 0 => (Severity::NonFatal, Rule::MetadataLeak),
                _ if stored_count > expected_count => (Severity::Fatal, Rule::MetadataOverCount),
                _ => (Severity::Fatal, Rule::MetadataUnderCount),
            };
            let (block_field, data_block) = match structure {
                Structure::DataSpaceMap => (Some(location), Some(block)),
                _ => (Some(block), None),
            };
            walker.report.push(Problem {
                severity,
                structure,
                volume: None,
                block: block_field,
                data_block,
                rule,
                detail: format!(
                    "reference count is {stored_count}, expected {expected_count}{}",
                    match rule {
                        Rule::MetadataLeak => " (leaked)",
                        _ => "",
                    }
                ),
            });
        }
    }
    if overflow_seen != stored.overflow.len() {
        // Some overflow entry's bitmap field is not 3.
        let mut orphans: Vec<u64> = stored
            .overflow
            .keys()
            .copied()
            .filter(|&block| {
                let index = (block / ENTRIES_PER_BITMAP) as usize;
                stored.bitmaps.get(index).is_some_and(Option::is_some)
            })
            .collect();
        orphans.sort_unstable();
        let mut reported = 0;
        for block in orphans {
            if let Some(field) = bitmap_field(walker, stored, block, structure) {
                if field != 3 {
                    reported += 1;
                    walker.problem(
                        Severity::Fatal,
                        structure,
                        None,
                        Some(block),
                        Rule::OverflowMismatch,
                        format!(
                            "overflow tree holds a count for block {block}, whose bitmap entry is {field}, not 3"
                        ),
                    );
                }
            }
        }
        debug_assert!(reported > 0 || walker.report.fatal_count > 0);
    }
    match structure {
        Structure::DataSpaceMap => walker.report.summary.data_bad_count_blocks += bad_blocks,
        _ => walker.report.summary.metadata_leaked_blocks += leaked_blocks,
    }
}

fn bitmap_field(
    walker: &mut Walker<'_>,
    stored: &StoredSpaceMap,
    block: u64,
    structure: Structure,
) -> Option<u64> {
    let index = (block / ENTRIES_PER_BITMAP) as usize;
    let location = (*stored.bitmaps.get(index)?)?;
    let data = walker.read(location, BlockKind::Bitmap, structure, None)?;
    let entry = block % ENTRIES_PER_BITMAP;
    let at = 16 + (entry / 32) as usize * 8;
    let word = u64::from_le_bytes(data[at..at + 8].try_into().expect("8 bytes"));
    Some((word >> ((entry % 32) * 2)) & 3)
}
