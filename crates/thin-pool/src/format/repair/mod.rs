//! Repairing damaged metadata (`thinpool repair`, `thin_repair`'s equivalent, and
//! `thinpool dump --repair`): read what can be trusted and describe it as a dump, which
//! [`Restorer`] writes as new metadata (or a dump writer prints).
//!
//! ```text
//!   roots     the superblock's settings and roots, the metadata snapshot's as a fallback
//!             (a damaged superblock: given settings, its roots if they are nodes); when no
//!             root is a readable node, the roots a scan of the whole device finds
//!   walk      the details tree and the mapping tree, every trusted node, damage skipped
//!   emit      one device after another, mappings in ascending order, mapped_blocks as
//!             recovered; the new space maps are the restorer's, counted from these trees
//! ```
//!
//! What is kept: every mapping in a leaf whose every ancestor is trusted (see `walk`), and
//! inside the data device; a device listed by the mapping tree keeps its details when the
//! details tree still has them (otherwise new ones: created and snapshotted at the pool's
//! time). Nothing is guessed: a damaged node loses what is below it and nothing else.
//! Devices are written unshared (each its own leaves, as `thin_dump` 0.9.0 expands them),
//! so snapshots that shared leaves take more metadata after a repair.
//!
//! Memory: the details and the top level, plus the mappings of one device at a time.

mod roots;
mod walk;

pub use roots::RootSource;
pub use walk::Skipped;

use crate::format::details::DeviceDetails;
use crate::format::dump::{self, DeviceInfo, DumpVisitor, RunBuilder, SuperblockInfo};
use crate::format::restore::{RestoreOptions, Restorer};
use crate::ids::{BlockTime, VolumeId};
use persistent_data::block_manager::BlockManager;
use persistent_data::btree::Value;
use persistent_data::{BlockDevice, MetadataBlock};
use roots::{Plan, DETAILS_VALUE_SIZE, MAPPING_VALUE_SIZE};
use std::collections::BTreeMap;
use std::sync::Arc;
use walk::Walker;

/// Blocks the repair's block manager caches.
const CACHE_BLOCKS: usize = 4096;

/// Settings to use instead of the superblock's (`thin_repair`'s overrides). With a damaged
/// superblock the data block size must be given.
#[derive(Clone, Copy, Debug, Default)]
pub struct RepairOptions {
    /// `--transaction-id`.
    pub transaction_id: Option<u64>,
    /// `--data-block-size` (sectors).
    pub data_block_size_sectors: Option<u32>,
    /// `--nr-data-blocks`.
    pub data_block_count: Option<u64>,
}

/// Errors of a repair.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The superblock is damaged and no data block size was given.
    #[error("the superblock is damaged: give the data block size (--data-block-size, in sectors)")]
    DataBlockSizeNeeded,
    /// Neither the superblock nor a scan gave a readable mapping tree.
    #[error("no readable mapping tree was found")]
    NoMappingTree,
    /// Writing the output (the restorer or the dump writer) failed.
    #[error("writing the repaired metadata")]
    Output(#[source] dump::Error),
}

/// What a repair recovered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recovery {
    /// Where the roots came from.
    pub source: RootSource,
    /// Devices written.
    pub device_count: u64,
    /// Mappings written.
    pub mapping_count: u64,
    /// Devices of the mapping tree whose details were lost (given new ones).
    pub devices_without_details: Vec<u32>,
    /// Devices of the details tree the mapping tree no longer lists (not written).
    pub devices_without_mappings: Vec<u32>,
    /// What the walk left out.
    pub skipped: Skipped,
}

/// Repair the metadata on `input` into `output` (formatted over its whole size; `input` is
/// only read).
pub fn repair(
    input: Arc<dyn BlockDevice>,
    output: Arc<dyn BlockDevice>,
    options: &RepairOptions,
) -> Result<Recovery, Error> {
    let mut restorer = Restorer::new(output, RestoreOptions::default());
    recover(input, options, &mut restorer)
}

/// Read what can be trusted of the metadata on `device` and describe it to `visitor` (a
/// [`Restorer`] for `repair`, a dump writer for `dump --repair`).
pub fn recover(
    device: Arc<dyn BlockDevice>,
    options: &RepairOptions,
    visitor: &mut dyn DumpVisitor,
) -> Result<Recovery, Error> {
    let bm = BlockManager::new(device, CACHE_BLOCKS);
    let plan = roots::plan(&bm, options)?;
    let mut walker = Walker::new(&bm);
    let mut found = None;
    let details = read_details(&mut walker, &plan, &mut found);
    let roots = read_top_level(&mut walker, &plan, &mut found)?;
    let data_block_count = match plan.data_block_count {
        Some(count) => count,
        None => highest_mapped(&bm, &roots).map_or(0, |block| block + 1),
    };
    let pool = pool_info(&plan, &details, &roots, &bm, data_block_count);
    let mut recovery = Recovery {
        source: plan.source,
        device_count: 0,
        mapping_count: 0,
        devices_without_details: Vec::new(),
        devices_without_mappings: details
            .keys()
            .filter(|id| !roots.contains_key(id))
            .copied()
            .collect(),
        skipped: Skipped::default(),
    };
    visitor.superblock_begin(&pool).map_err(Error::Output)?;
    for (&id, &root) in &roots {
        let found = details.get(&id).copied();
        if found.is_none() {
            recovery.devices_without_details.push(id);
        }
        let details = found.unwrap_or(DeviceDetails {
            mapped_blocks: 0,
            transaction_id: pool.transaction,
            creation_time: pool.time,
            snapshotted_time: pool.time,
        });
        let mappings = read_mappings(&mut walker, root, data_block_count);
        emit_device(visitor, id, &details, &mappings).map_err(Error::Output)?;
        recovery.device_count += 1;
        recovery.mapping_count += mappings.len() as u64;
    }
    visitor.superblock_end().map_err(Error::Output)?;
    recovery.skipped = walker.skipped;
    Ok(recovery)
}

/// The first of `roots`, then of the roots a scan finds (made once, on first need), that
/// is a trusted node.
fn first_readable(
    walker: &Walker<'_>,
    roots: &[MetadataBlock],
    scanned: impl Fn(&roots::Found) -> &[MetadataBlock],
    found: &mut Option<roots::Found>,
    value_size: usize,
) -> Option<MetadataBlock> {
    let readable = |root: &&MetadataBlock| walker.root_is_readable(**root, value_size);
    if let Some(&root) = roots.iter().find(readable) {
        return Some(root);
    }
    let found = found.get_or_insert_with(|| roots::scan(walker.block_manager()));
    scanned(found).iter().find(readable).copied()
}

/// The details of the first details root that is a trusted node (none: no details).
fn read_details(
    walker: &mut Walker<'_>,
    plan: &Plan,
    found: &mut Option<roots::Found>,
) -> BTreeMap<u32, DeviceDetails> {
    let mut details = BTreeMap::new();
    let root = first_readable(
        walker,
        &plan.details_roots,
        |f| &f.details_roots,
        found,
        DETAILS_VALUE_SIZE,
    );
    if let Some(root) = root {
        walker.entries(root, DETAILS_VALUE_SIZE, &mut |key, value| {
            let Some(id) = volume_id(key) else {
                return false;
            };
            details.insert(id, DeviceDetails::unpack(value));
            true
        });
    }
    details
}

/// The bottom-level roots of the first mapping root that is a trusted node.
fn read_top_level(
    walker: &mut Walker<'_>,
    plan: &Plan,
    found: &mut Option<roots::Found>,
) -> Result<BTreeMap<u32, MetadataBlock>, Error> {
    let root = first_readable(
        walker,
        &plan.mapping_roots,
        |f| &f.mapping_roots,
        found,
        MAPPING_VALUE_SIZE,
    )
    .ok_or(Error::NoMappingTree)?;
    let mut roots = BTreeMap::new();
    walker.entries(root, MAPPING_VALUE_SIZE, &mut |key, value| {
        let block = u64::unpack(value);
        match volume_id(key) {
            // Block 0 is the superblock, never a tree.
            Some(id) if block != 0 => {
                roots.insert(id, MetadataBlock::new(block));
                true
            }
            _ => false,
        }
    });
    Ok(roots)
}

/// A device id that dm-thin accepts.
fn volume_id(key: u64) -> Option<u32> {
    u32::try_from(key)
        .ok()
        .filter(|&id| id <= VolumeId::MAX.get())
}

/// The trusted mappings of the tree at `root` to data blocks below `data_block_count`:
/// (virtual block, data block, time), ascending.
fn read_mappings(
    walker: &mut Walker<'_>,
    root: MetadataBlock,
    data_block_count: u64,
) -> Vec<(u64, u64, u32)> {
    let mut mappings = Vec::new();
    walker.entries(root, MAPPING_VALUE_SIZE, &mut |key, value| {
        let value = BlockTime::unpack(u64::unpack(value));
        let data_block = value.data_block().get();
        if data_block >= data_block_count {
            return false;
        }
        mappings.push((key, data_block, value.time().get()));
        true
    });
    mappings
}

/// The highest data block any trusted mapping names (a walk of its own, uncounted).
fn highest_mapped(bm: &BlockManager, roots: &BTreeMap<u32, MetadataBlock>) -> Option<u64> {
    let mut walker = Walker::new(bm);
    let mut highest = None;
    for &root in roots.values() {
        for (_, data_block, _) in read_mappings(&mut walker, root, u64::MAX) {
            highest = highest.max(Some(data_block));
        }
    }
    highest
}

/// The superblock of the output: the plan's settings, or (damaged superblock) the newest
/// time and transaction id the trees record, the transaction id one past the newest device.
fn pool_info(
    plan: &Plan,
    details: &BTreeMap<u32, DeviceDetails>,
    roots: &BTreeMap<u32, MetadataBlock>,
    bm: &BlockManager,
    data_block_count: u64,
) -> SuperblockInfo {
    let time = plan.time.unwrap_or_else(|| {
        let mut walker = Walker::new(bm);
        let mapped = roots
            .values()
            .flat_map(|&root| read_mappings(&mut walker, root, u64::MAX))
            .map(|(_, _, time)| time)
            .max();
        let recorded = details
            .values()
            .map(|d| d.creation_time.max(d.snapshotted_time))
            .max();
        mapped.max(recorded).unwrap_or(0)
    });
    let transaction = plan.transaction_id.unwrap_or_else(|| {
        details
            .values()
            .map(|d| d.transaction_id.saturating_add(1))
            .max()
            .unwrap_or(0)
    });
    SuperblockInfo {
        uuid: String::new(),
        time,
        transaction,
        flags: 0,
        version: 2,
        data_block_size_sectors: plan.data_block_size_sectors,
        data_block_count,
        metadata_snap: None,
    }
}

/// One device's events: its header (mapped_blocks as recovered), its runs, its end.
fn emit_device(
    visitor: &mut dyn DumpVisitor,
    id: u32,
    details: &DeviceDetails,
    mappings: &[(u64, u64, u32)],
) -> Result<(), dump::Error> {
    visitor.device_begin(&DeviceInfo {
        dev_id: id,
        mapped_block_count: mappings.len() as u64,
        transaction: details.transaction_id,
        creation_time: details.creation_time,
        snap_time: details.snapshotted_time,
    })?;
    let mut runs = RunBuilder::new();
    for &(virtual_block, data_block, time) in mappings {
        if let Some(run) = runs.push(virtual_block, data_block, time) {
            visitor.mapping(&run)?;
        }
    }
    if let Some(run) = runs.flush() {
        visitor.mapping(&run)?;
    }
    visitor.device_end()
}

#[cfg(test)]
mod tests;
