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
//! Files: `superblock` (block 0 and the metadata snapshot's), `trees` (details and mapping
//! trees of one superblock), `space_map` (stored counts against recomputed ones), `tree`
//! (the btree walk all of them use), `counts` (the recomputed reference counts), `report`
//! (what is found).
//!
//! Callers: the `thinpool check` command, and tests that run it after every commit.

mod counts;
mod report;
mod space_map;
mod superblock;
mod tree;
mod trees;

pub use report::{Problem, Report, Rule, Severity, Structure, Summary, PROBLEMS_MAX};

use counts::Counts;
use persistent_data::block_manager::BlockManager;
use persistent_data::space_map::METADATA_BLOCKS_MAX;
use persistent_data::BlockDevice;
use std::fmt;
use std::sync::Arc;
use tree::Walker;

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
    let Some(sb) = superblock::read_live(&bm, &mut report) else {
        return report;
    };
    if options.super_block_only {
        return report;
    }
    let device_blocks = bm.block_count();
    let metadata_blocks = sb.metadata_space_map.block_count;
    if metadata_blocks == 0 || metadata_blocks > device_blocks.min(METADATA_BLOCKS_MAX) {
        report.push(superblock::problem(
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
    let snapshot = superblock::read_snapshot(&mut walker, &sb);
    if options.metadata_snap {
        match snapshot {
            Some(snap) => trees::check(&mut walker, &snap, options, None),
            // Held but unreadable: already reported.
            None if sb.metadata_snap.is_some() => {}
            None => walker.problem(
                Severity::Fatal,
                Structure::Superblock,
                None,
                Some(0),
                Rule::MetadataSnapshot,
                "no metadata snapshot is held".to_string(),
            ),
        }
        return walker.report;
    }
    let data_block_count = sb.data_space_map.block_count;
    let mut data_counts = Counts::new(data_block_count);
    trees::check(&mut walker, &sb, options, Some(&mut data_counts));
    if let Some(snap) = &snapshot {
        trees::check(&mut walker, snap, options, Some(&mut data_counts));
    }
    if options.skip_mappings {
        return walker.report;
    }
    space_map::check(&mut walker, &sb, &data_counts);
    walker.report
}
