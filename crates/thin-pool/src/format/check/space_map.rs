//! The space maps as stored (index, bitmaps, overflow tree), compared with the reference
//! counts the walk recomputed (spec §7.8, §11.13-14).

use super::report::{Problem, Rule, Severity, Structure};
use super::tree::{Counts, TreeKind, Walker};
use super::Phase;
use persistent_data::btree::Value;
use persistent_data::checksum::BlockKind;
use persistent_data::space_map::core::{bitmap_count, decode_field, ENTRIES_PER_BITMAP};
use persistent_data::space_map::disk::decode_index_block;
use persistent_data::space_map::{IndexEntry, SpaceMapRoot};
use persistent_data::MetadataBlock;
use std::collections::HashMap;

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
pub(super) fn compare_counts(
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
