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
//! Severity follows thin_check 1.x: an unreferenced metadata or data block with a stored
//! count is a leak (non-fatal: the exit code is still non-zero unless non-fatal errors are
//! ignored; `leaks` frees them in place for `--auto-repair`); every other broken rule is fatal, a count too high on a referenced block included
//! (0.9.0 calls that non-fatal too). Reference counts are compared only when the trees
//! were walked without a fatal problem (a broken tree makes every count below it suspect).
//!
//! Two threads: the walk (every rule, every count, every problem, in one thread, so the
//! report is deterministic) and a reader that reads the volumes' trees and the data space
//! map's bitmaps ahead of it, in the walk's order, in runs of consecutive blocks, and
//! validates their checksums (`read_ahead`). The walk takes what the reader queued and
//! reads anything else itself: the report is the same with or without the reader.
//!
//! Files: `superblock` (block 0 and the metadata snapshot's), `trees` (details and mapping
//! trees of one superblock), `space_map` (stored counts against recomputed ones), `leaks`
//! (freeing leaked blocks in place), `tree`
//! (the btree walk all of them use), `counts` (the recomputed reference counts),
//! `read_ahead` (the reader thread), `report` (what is found).
//!
//! Callers: the `thinpool check` command, and tests that run it after every commit.

mod counts;
mod leaks;
mod read_ahead;
mod report;
mod space_map;
mod superblock;
#[cfg(test)]
mod tests;
mod tree;
mod trees;

pub use leaks::{repair_leaks, LeakRepair};
pub use report::{Problem, Report, Rule, Severity, Structure, Summary, PROBLEMS_MAX};

use crate::format::superblock as superblock_codec;
use counts::Counts;
use persistent_data::block_manager::BlockManager;
use persistent_data::space_map::core::ENTRIES_PER_BITMAP;
use persistent_data::space_map::METADATA_BLOCKS_MAX;
use persistent_data::BlockDevice;
use read_ahead::ReadAhead;
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
    /// The data device's size in bytes, when it is known (`serve`'s check before opening
    /// a pool): a data space map larger than the device is fatal, and the per-data-block
    /// counts are sized by the device.
    pub data_device_bytes: Option<u64>,
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
    check_with(device, options, true, progress).0
}

/// [`check`], reading ahead on a second thread or not; also returns how many blocks the
/// walk took from the read-ahead.
fn check_with(
    device: Arc<dyn BlockDevice>,
    options: &CheckOptions,
    read_ahead: bool,
    progress: &mut dyn FnMut(Progress),
) -> (Report, u64) {
    let bm = BlockManager::new(device, CACHE_BLOCKS);
    let mut report = Report::default();
    progress(Progress {
        phase: Phase::Superblock,
        done_blocks: 0,
        total_blocks: 0,
    });
    let Some(sb) = superblock::read_live(&bm, &mut report) else {
        return (report, 0);
    };
    if options.super_block_only {
        return (report, 0);
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
        return (report, 0);
    }
    let queue = ReadAhead::new(metadata_blocks);
    std::thread::scope(|scope| {
        // Without a thread (none could be started), the walk reads every block itself.
        let reader = read_ahead
            .then(|| {
                std::thread::Builder::new()
                    .name("check-read-ahead".to_string())
                    .spawn_scoped(scope, || queue.run(&bm, metadata_blocks))
                    .ok()
            })
            .flatten();
        // The reader stops when the walk ends, however it ends (a panic included: the
        // scope joins the reader before unwinding further).
        let finish = Finish(&queue);
        let report = walk(
            &bm,
            reader.as_ref().map(|_| &queue),
            &sb,
            options,
            report,
            progress,
        );
        drop(finish);
        (report, queue.served())
    })
}

/// Stops the reader thread when dropped.
struct Finish<'a>(&'a ReadAhead);

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        self.0.finish();
    }
}

/// Everything after the superblock: the trees, then the space maps.
fn walk(
    bm: &BlockManager,
    read_ahead: Option<&ReadAhead>,
    sb: &superblock_codec::Superblock,
    options: &CheckOptions,
    report: Report,
    progress: &mut dyn FnMut(Progress),
) -> Report {
    let metadata_blocks = sb.metadata_space_map.block_count;
    let bottom_leaf_occupancy = options.leaf_occupancy == LeafOccupancy::Strict;
    let mut walker = Walker::new(
        bm,
        read_ahead,
        metadata_blocks,
        sb.metadata_space_map.allocated_count,
        bottom_leaf_occupancy,
        report,
        progress,
    );
    walker.total_blocks = sb.metadata_space_map.allocated_count;
    // The live superblock's implicit reference.
    walker.counts.inc(0);
    let snapshot = superblock::read_snapshot(&mut walker, sb);
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
    let data_sm_plausible = check_data_size(&mut walker, sb, options, metadata_blocks);
    // Dense counts for what the data device (or a modest default) holds; a larger count
    // read from disk gets a sparse map, bounded by the mappings actually found.
    let data_device_blocks = data_device_blocks(sb, options).unwrap_or(0);
    let dense_max = counts::DENSE_MAX.max(data_device_blocks);
    let data_in_use = sb.data_space_map.allocated_count;
    let mut data_counts = Counts::new(data_block_count, dense_max, data_in_use);
    trees::check(&mut walker, sb, options, Some(&mut data_counts));
    if let Some(snap) = &snapshot {
        trees::check(&mut walker, snap, options, Some(&mut data_counts));
    }
    if options.skip_mappings {
        return walker.report;
    }
    space_map::check(&mut walker, sb, &data_counts, data_sm_plausible);
    walker.report
}

/// Blocks of the data device, when its size is known and the block size valid.
fn data_device_blocks(sb: &superblock_codec::Superblock, options: &CheckOptions) -> Option<u64> {
    let block_bytes = u64::from(sb.data_block_size_sectors) * 512;
    options
        .data_device_bytes
        .filter(|_| block_bytes > 0)
        .map(|bytes| bytes / block_bytes)
}

/// Bound the data space map's `nr_blocks` by what is present: its bitmaps must fit the
/// metadata space map (each is a metadata block), and, when the data device's size is
/// known, its blocks the data device. Returns whether the data space map can be read
/// (false: its bitmaps cannot exist, so it is not read; the problem is reported).
fn check_data_size(
    walker: &mut Walker<'_>,
    sb: &superblock_codec::Superblock,
    options: &CheckOptions,
    metadata_blocks: u64,
) -> bool {
    let data_blocks = sb.data_space_map.block_count;
    let bitmaps = data_blocks.div_ceil(ENTRIES_PER_BITMAP);
    let mut plausible = true;
    if bitmaps > metadata_blocks {
        walker.report.push(superblock::problem(
            Severity::Fatal,
            Rule::DataDeviceSize,
            format!(
                "data space map has {data_blocks} blocks: its {bitmaps} bitmaps cannot fit the metadata space map's {metadata_blocks} blocks"
            ),
        ));
        plausible = false;
    }
    if let Some(device_blocks) = data_device_blocks(sb, options) {
        if data_blocks > device_blocks {
            walker.report.push(superblock::problem(
                Severity::Fatal,
                Rule::DataDeviceSize,
                format!(
                    "data space map has {data_blocks} blocks; the data device holds {device_blocks}"
                ),
            ));
        }
    }
    plausible
}

/// The check a server runs before it opens a pool read-write (as LVM runs thin_check
/// before activating one): every rule, thin_check 1.x's occupancy rule, the data space map
/// bounded by the data device of `data_device_bytes`. The pool may be opened read-write
/// only if the report [`passes`](Report::passes) with non-fatal problems ignored (a leaked
/// metadata block harms no volume).
pub fn check_before_open(metadata: Arc<dyn BlockDevice>, data_device_bytes: u64) -> Report {
    check_before_open_with_progress(metadata, data_device_bytes, &mut |_| {})
}

/// [`check_before_open`], telling `progress` how far it has come (as [`check`] does).
pub fn check_before_open_with_progress(
    metadata: Arc<dyn BlockDevice>,
    data_device_bytes: u64,
    progress: &mut dyn FnMut(Progress),
) -> Report {
    let options = CheckOptions {
        leaf_occupancy: LeafOccupancy::SkipBottomLeaves,
        ignore_non_fatal: true,
        data_device_bytes: Some(data_device_bytes),
        ..CheckOptions::default()
    };
    check(metadata, &options, progress)
}
