//! The space maps as stored (index, bitmaps, overflow tree), compared with the reference
//! counts the walk recomputed (spec §7.8, §11.13-14).

use super::counts::Counts;
use super::report::{Problem, Rule, Severity, Structure};
use super::tree::{TreeKind, Walker};
use super::Phase;
use crate::format::superblock::Superblock;
use persistent_data::btree::Value;
use persistent_data::checksum::BlockKind;
use persistent_data::space_map::core::{
    bitmap_count, decode_field, encode_field, ENTRIES_PER_BITMAP,
};
use persistent_data::space_map::disk::decode_index_block;
use persistent_data::space_map::{IndexEntry, SpaceMapRoot};
use persistent_data::{Block, MetadataBlock};
use std::collections::HashMap;

/// Read both space maps of the live superblock `sb` and compare their counts with the
/// walk's: the data map's with `data_counts`, the metadata map's with the walker's.
/// `data_sm_plausible` false (its bitmaps could not fit the metadata; already reported):
/// the data space map is not read.
pub(super) fn check(
    walker: &mut Walker<'_>,
    sb: &Superblock,
    data_counts: &Counts,
    data_sm_plausible: bool,
) {
    // Counts below a broken tree are unknown: comparing them would only add noise, so
    // counts are compared only while no structural problem was found.
    let data_sm = if data_sm_plausible {
        read_data(walker, &sb.data_space_map)
    } else {
        None
    };
    let structural_fatal = walker.report.fatal_count;
    if let (Some(stored), 0) = (data_sm, structural_fatal) {
        compare_counts(walker, Structure::DataSpaceMap, &stored, data_counts);
    }
    let after_data = walker.report.fatal_count;
    let metadata_sm = read_metadata(walker, &sb.metadata_space_map);
    if let (Some(stored), 0, true) = (
        metadata_sm,
        structural_fatal,
        walker.report.fatal_count == after_data,
    ) {
        let expected = std::mem::replace(&mut walker.counts, Counts::new(0, 0, 0));
        compare_counts(walker, Structure::MetadataSpaceMap, &stored, &expected);
        walker.counts = expected;
    }
}

/// A space map as stored: where its bitmaps are and its overflow counts.
pub(super) struct StoredSpaceMap {
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

pub(super) fn read_data(walker: &mut Walker<'_>, root: &SpaceMapRoot) -> Option<StoredSpaceMap> {
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
                    let detail = format!("index has no entry for bitmap {i}");
                    index_problem(walker, structure, root, detail);
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

/// A broken rule of the space map's index (reported against its root block).
fn index_problem(
    walker: &mut Walker<'_>,
    structure: Structure,
    root: &SpaceMapRoot,
    detail: String,
) {
    let block = Some(root.bitmap_root);
    walker.problem(
        Severity::Fatal,
        structure,
        None,
        block,
        Rule::SpaceMapIndex,
        detail,
    );
}

pub(super) fn read_metadata(
    walker: &mut Walker<'_>,
    root: &SpaceMapRoot,
) -> Option<StoredSpaceMap> {
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
                    let detail = format!("index entry {i} points at block {}", entry.blocknr);
                    index_problem(walker, structure, root, detail);
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

/// What a comparison found, for the summary.
#[derive(Default)]
struct Tally {
    /// Overflow entries met through a bitmap field of 3.
    overflow_seen: usize,
    /// Blocks whose stored count differs from the expected one.
    bad_blocks: u64,
    /// Of those, blocks expected to be free.
    leaked_blocks: u64,
}

/// Compare a stored space map with the recomputed counts, bitmap by bitmap.
pub(super) fn compare_counts(
    walker: &mut Walker<'_>,
    structure: Structure,
    stored: &StoredSpaceMap,
    expected: &Counts,
) {
    let mut tally = Tally::default();
    walker.read_ahead_blocks(
        stored.bitmaps.iter().flatten().copied().collect(),
        BlockKind::Bitmap,
    );
    for (index, location) in stored.bitmaps.iter().enumerate() {
        let Some(location) = *location else { continue };
        let Some(data) = walker.read(location, BlockKind::Bitmap, structure, None) else {
            continue;
        };
        let bitmap = Bitmap {
            structure,
            location,
            first: index as u64 * ENTRIES_PER_BITMAP,
            data: &data,
        };
        compare_bitmap(walker, &bitmap, stored, expected, &mut tally);
    }
    if tally.overflow_seen != stored.overflow.len() {
        report_overflow_orphans(walker, structure, stored);
    }
    let summary = &mut walker.report.summary;
    match structure {
        Structure::DataSpaceMap => {
            summary.data_bad_count_blocks += tally.bad_blocks;
            summary.data_leaked_blocks += tally.leaked_blocks;
        }
        _ => summary.metadata_leaked_blocks += tally.leaked_blocks,
    }
}

/// One bitmap block being compared.
struct Bitmap<'a> {
    structure: Structure,
    location: u64,
    /// The block its first entry counts.
    first: u64,
    data: &'a Block,
}

/// Compare the entries of one bitmap with the recomputed counts.
fn compare_bitmap(
    walker: &mut Walker<'_>,
    bitmap: &Bitmap<'_>,
    stored: &StoredSpaceMap,
    expected: &Counts,
    tally: &mut Tally,
) {
    let mut next = 0;
    while next < ENTRIES_PER_BITMAP {
        // Most words of 32 entries hold exactly the expected small counts: compare them
        // whole, and look at each entry only where they differ.
        if next % WORD_ENTRIES == 0
            && word_matches(
                bitmap.data,
                next,
                bitmap.first + next,
                stored.block_count,
                expected,
            )
        {
            next += WORD_ENTRIES;
            continue;
        }
        compare_entry(walker, bitmap, next, stored, expected, tally);
        next += 1;
    }
}

/// Compare entry `entry` of a bitmap with its recomputed count.
fn compare_entry(
    walker: &mut Walker<'_>,
    bitmap: &Bitmap<'_>,
    entry: u64,
    stored: &StoredSpaceMap,
    expected: &Counts,
    tally: &mut Tally,
) {
    let (structure, location) = (bitmap.structure, bitmap.location);
    let block = bitmap.first + entry;
    let field = bitmap_entry(bitmap.data, entry);
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
        return;
    }
    let stored_count = if field == 3 {
        let Some(&count) = stored.overflow.get(&block) else {
            walker.problem(
                Severity::Fatal,
                structure,
                None,
                Some(location),
                Rule::OverflowMismatch,
                format!("bitmap says block {block} has 3 or more references, the overflow tree has no entry"),
            );
            return;
        };
        tally.overflow_seen += 1;
        count
    } else {
        decode_field(field)
    };
    let expected_count = if block < expected.len() {
        expected.get(block)
    } else {
        0
    };
    if stored_count != expected_count {
        tally.bad_blocks += 1;
        if expected_count == 0 {
            tally.leaked_blocks += 1;
        }
        let problem = count_problem(structure, location, block, stored_count, expected_count);
        walker.report.push(problem);
    }
}

/// A stored count that differs from the expected one: a leak (non-fatal) when no reference
/// was found, fatal otherwise.
fn count_problem(
    structure: Structure,
    bitmap: u64,
    block: u64,
    stored_count: u32,
    expected_count: u32,
) -> Problem {
    let (severity, rule) = match structure {
        Structure::DataSpaceMap if expected_count == 0 => (Severity::NonFatal, Rule::DataLeak),
        Structure::DataSpaceMap => (Severity::Fatal, Rule::DataCount),
        _ if expected_count == 0 => (Severity::NonFatal, Rule::MetadataLeak),
        _ if stored_count > expected_count => (Severity::Fatal, Rule::MetadataOverCount),
        _ => (Severity::Fatal, Rule::MetadataUnderCount),
    };
    let (block_field, data_block) = match structure {
        Structure::DataSpaceMap => (Some(bitmap), Some(block)),
        _ => (Some(block), None),
    };
    let leaked = if matches!(rule, Rule::MetadataLeak | Rule::DataLeak) {
        " (leaked)"
    } else {
        ""
    };
    Problem {
        severity,
        structure,
        volume: None,
        block: block_field,
        data_block,
        rule,
        detail: format!("reference count is {stored_count}, expected {expected_count}{leaked}"),
    }
}

/// Report the overflow entries whose bitmap field is not 3 (some exist: fewer entries were
/// met through the bitmaps than the overflow tree holds).
fn report_overflow_orphans(walker: &mut Walker<'_>, structure: Structure, stored: &StoredSpaceMap) {
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
        let Some(field) = bitmap_field(walker, stored, block, structure) else {
            continue;
        };
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
    debug_assert!(reported > 0 || walker.report.fatal_count > 0);
}

/// Entries in one 64-bit word of a bitmap.
const WORD_ENTRIES: u64 = 32;

/// Whether the word of 32 entries starting at `entry` (a multiple of 32), for blocks from
/// `block`, is exactly what the expected counts give, each under 3 (no overflow entry), all
/// blocks inside both the stored map and the counts.
fn word_matches(data: &Block, entry: u64, block: u64, block_count: u64, expected: &Counts) -> bool {
    let end = block + WORD_ENTRIES;
    if end > block_count || end > expected.len() {
        return false;
    }
    let Some(counts) = expected.dense(block, WORD_ENTRIES as usize) else {
        return false;
    };
    let mut word = 0u64;
    for (i, &count) in counts.iter().enumerate() {
        if count > 2 {
            return false;
        }
        word |= encode_field(u32::from(count)) << (2 * i);
    }
    let at = 16 + (entry / WORD_ENTRIES) as usize * 8;
    u64::from_le_bytes(data[at..at + 8].try_into().expect("8 bytes")) == word
}

/// The 2-bit field of entry `entry` of a bitmap block (after its 16-byte header).
fn bitmap_entry(data: &Block, entry: u64) -> u64 {
    debug_assert!(entry < ENTRIES_PER_BITMAP);
    let at = 16 + (entry / 32) as usize * 8;
    let word = u64::from_le_bytes(data[at..at + 8].try_into().expect("8 bytes"));
    (word >> ((entry % 32) * 2)) & 3
}

/// The bitmap field of `block` in a stored map, reading its bitmap again.
fn bitmap_field(
    walker: &mut Walker<'_>,
    stored: &StoredSpaceMap,
    block: u64,
    structure: Structure,
) -> Option<u64> {
    let index = (block / ENTRIES_PER_BITMAP) as usize;
    let location = (*stored.bitmaps.get(index)?)?;
    let data = walker.read(location, BlockKind::Bitmap, structure, None)?;
    Some(bitmap_entry(&data, block % ENTRIES_PER_BITMAP))
}
