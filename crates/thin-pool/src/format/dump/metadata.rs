//! Reading pool metadata into a dump: walks the superblock's trees (the live superblock or a
//! metadata snapshot) and drives a [`DumpVisitor`], the way `thin_dump` does.
//!
//! Called by `thinpool dump` and by tests; the visitor is usually an
//! [`XmlWriter`](super::XmlWriter) or [`HumanWriter`](super::HumanWriter).
//!
//! # How `thin_dump` 1.x decides what is a `<def>`
//!
//! Established with the real 1.1.0 (and matching the public 1.x sources):
//!
//! 1. The distinct bottom-level roots of the dumped devices are walked in ascending *block*
//!    order with one "seen" set. Only internal nodes are read. Every leaf below a lowest-level
//!    internal node is listed, in order, as a leaf entry (a leaf is listed again each time it
//!    is reached). An internal node above that level that was already seen (shared by an
//!    earlier tree) is listed as a *reference* entry named after its block and not descended;
//!    references of a node come before the leaves of its unseen children. A leaf root is a
//!    one-leaf list.
//! 2. Each device's list (devices in ascending id; devices with equal roots share a list) is
//!    fed to a sequence "gatherer", a reference entry ending a sequence. It splits the leaf
//!    sequences into maximal runs that always occur together: a run ends at a leaf that
//!    ends a sequence, that has several successors or none, or whose successor starts a run;
//!    a run starts at a sequence start, after a run end, or at a leaf reached from two
//!    different predecessors. A run is *shared* when its first leaf starts runs twice or a
//!    leaf-to-leaf step of it repeats (in practice: it is listed by two or more devices).
//! 3. Every shared run becomes `<def name="B">`, `B` = block number of its first leaf, defs
//!    in ascending `B`; a device lists `<ref name="B"/>` where its sequence has that run, and
//!    prints the leaves of unshared runs inline.
//! 4. Mapping runs (`RunBuilder`) continue across inline leaves but are cut before every
//!    `<ref>` and at the end of each def and device.
//!
//! Memory: a few words per leaf of the dumped trees (the leaf lists) plus per internal node;
//! the mappings themselves are streamed leaf by leaf and never held.
//!
//! The 0.9.0 flavour prints every device fully expanded, without defs.

use super::gather::Gatherer;
use super::{DeviceInfo, DumpVisitor, Flavour, Mapping, RunBuilder, SuperblockInfo};
use crate::format::details::DeviceDetails;
use crate::format::superblock::Superblock;
use crate::ids::{BlockTime, VolumeId};
use persistent_data::block_manager::{BlockManager, CACHE_BLOCKS_DEFAULT};
use persistent_data::btree::{self, node::Node};
use persistent_data::checksum::BlockKind;
use persistent_data::{BlockDevice, BlockSource, MetadataBlock};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

/// Errors from dumping metadata: the metadata could not be read, or the visitor failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    /// Reading or decoding the metadata failed.
    #[error("reading metadata")]
    Metadata(#[from] crate::Error),
    /// The visitor (the output) failed.
    #[error("writing the dump")]
    Output(#[from] super::Error),
    /// `-m` was given but no metadata snapshot is held.
    #[error("no metadata snapshot is held")]
    NoMetadataSnap,
}

impl From<persistent_data::Error> for ReadError {
    fn from(e: persistent_data::Error) -> ReadError {
        ReadError::Metadata(e.into())
    }
}

/// Which superblock to dump.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Source {
    /// The live superblock at block 0.
    #[default]
    Live,
    /// The metadata snapshot: the one the live superblock holds, or the superblock at the
    /// given block (`thin_dump -m[=BLOCK]`).
    MetadataSnap(Option<MetadataBlock>),
}

/// What to dump and how (the options of `thin_dump` that do not concern output files).
#[derive(Debug, Clone, Default)]
pub struct DumpOptions {
    /// Live metadata or the metadata snapshot.
    pub source: Source,
    /// 1.x (with `<def>`/`<ref>`) or 0.9.0 (expanded).
    pub flavour: Flavour,
    /// Print devices without their mappings (`--skip-mappings`).
    pub skip_mappings: bool,
    /// Dump only these devices (`--dev-id`); `None` for all.
    pub dev_ids: Option<Vec<u32>>,
    /// Replace the superblock's transaction id (`--transaction-id`).
    pub transaction_id: Option<u64>,
    /// Replace the superblock's data block size (`--data-block-size`).
    pub data_block_size_sectors: Option<u32>,
    /// Replace the data device size (`--nr-data-blocks`).
    pub data_block_count: Option<u64>,
}

/// Dump the metadata on `device` (opened read-only through a fresh block manager).
pub fn dump(
    device: Arc<dyn BlockDevice>,
    options: &DumpOptions,
    visitor: &mut dyn DumpVisitor,
) -> Result<(), ReadError> {
    let bm = BlockManager::new(device, CACHE_BLOCKS_DEFAULT);
    let live = Superblock::read(&bm, MetadataBlock::SUPERBLOCK)?;
    let superblock = match options.source {
        Source::Live => live,
        Source::MetadataSnap(location) => {
            let location = location
                .or(live.metadata_snap)
                .ok_or(ReadError::NoMetadataSnap)?;
            Superblock::read(&bm, location)?
        }
    };
    dump_superblock(&bm, &superblock, options, visitor)
}

/// Dump the trees of `superblock`, read from `source` (a block manager for committed
/// metadata, or a transaction manager for the state of an open transaction).
pub fn dump_superblock<S: BlockSource + ?Sized>(
    source: &S,
    superblock: &Superblock,
    options: &DumpOptions,
    visitor: &mut dyn DumpVisitor,
) -> Result<(), ReadError> {
    let info = SuperblockInfo {
        uuid: String::new(),
        time: superblock.time,
        transaction: options.transaction_id.unwrap_or(superblock.transaction_id),
        flags: superblock.flags,
        version: superblock.version,
        data_block_size_sectors: options
            .data_block_size_sectors
            .unwrap_or(superblock.data_block_size_sectors),
        data_block_count: options
            .data_block_count
            .unwrap_or(superblock.data_space_map.block_count),
        metadata_snap: None,
    };
    let devices = read_devices(source, superblock, options)?;
    visitor.superblock_begin(&info)?;
    if options.skip_mappings {
        for device in &devices {
            visitor.device_begin(&device.info)?;
            visitor.device_end()?;
        }
    } else {
        match options.flavour {
            Flavour::V0_9 => {
                for device in &devices {
                    visitor.device_begin(&device.info)?;
                    emit_tree(source, device.root, visitor)?;
                    visitor.device_end()?;
                }
            }
            Flavour::V1 => emit_shared(source, &devices, visitor)?,
        }
    }
    visitor.superblock_end()?;
    Ok(())
}

struct Device {
    info: DeviceInfo,
    root: MetadataBlock,
}

fn read_devices<S: BlockSource + ?Sized>(
    source: &S,
    superblock: &Superblock,
    options: &DumpOptions,
) -> Result<Vec<Device>, ReadError> {
    let mut details = Vec::new();
    let details_root = superblock.device_details_root;
    btree::walk::<DeviceDetails, _>(source, details_root, &mut |key, d| {
        details.push((volume_id(details_root, key)?, d));
        Ok(())
    })?;
    let mut roots = Vec::new();
    if !options.skip_mappings {
        let mapping_root = superblock.data_mapping_root;
        btree::walk::<u64, _>(source, mapping_root, &mut |key, root| {
            roots.push((volume_id(mapping_root, key)?, MetadataBlock::new(root)));
            Ok(())
        })?;
    }
    let selected = |id: VolumeId| {
        options
            .dev_ids
            .as_ref()
            .is_none_or(|ids| ids.contains(&id.get()))
    };
    let to_info = |id: VolumeId, d: &DeviceDetails| DeviceInfo {
        dev_id: id.get(),
        mapped_block_count: d.mapped_blocks,
        transaction: d.transaction_id,
        creation_time: d.creation_time,
        snap_time: d.snapshotted_time,
    };
    if options.skip_mappings {
        return Ok(details
            .iter()
            .filter(|(id, _)| selected(*id))
            .map(|(id, d)| Device {
                info: to_info(*id, d),
                root: MetadataBlock::new(0),
            })
            .collect());
    }
    // thin_dump 1.x pairs the n-th mapping root with the n-th details entry.
    Ok(roots
        .iter()
        .zip(details.iter())
        .filter(|((id, _), _)| selected(*id))
        .map(|(&(id, root), (_, d))| Device {
            info: to_info(id, d),
            root,
        })
        .collect())
}

/// A key of the details tree or the mapping tree's top level, as a volume id; a key beyond
/// what a volume id holds is corruption of the tree at `root`.
fn volume_id(root: MetadataBlock, key: u64) -> persistent_data::Result<VolumeId> {
    u32::try_from(key)
        .ok()
        .map(VolumeId::new)
        .filter(|&id| id <= VolumeId::MAX)
        .ok_or_else(|| {
            persistent_data::Error::corrupt(root, format!("device id {key} is out of range"))
        })
}

/// Emit every mapping of one tree as maximal runs (0.9.0 style).
fn emit_tree<S: BlockSource + ?Sized>(
    source: &S,
    root: MetadataBlock,
    visitor: &mut dyn DumpVisitor,
) -> Result<(), ReadError> {
    let mut runs = RunBuilder::new();
    let mut failed = None;
    btree::walk::<u64, _>(source, root, &mut |key, value| {
        let value = BlockTime::unpack(value);
        let (data, time) = (value.data_block().get(), value.time().get());
        if let Some(run) = runs.push(key, data, time) {
            if let Err(e) = visitor.mapping(&run) {
                failed = Some(e);
                return Err(persistent_data::Error::Invalid("output failed".to_string()));
            }
        }
        Ok(())
    })
    .map_err(|e| match failed.take() {
        Some(output) => ReadError::Output(output),
        None => e.into(),
    })?;
    if let Some(run) = runs.flush() {
        visitor.mapping(&run)?;
    }
    Ok(())
}

/// An element of a device's leaf list (module docs, step 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    Leaf(u64),
    Ref(u64),
}

fn emit_shared<S: BlockSource + ?Sized>(
    source: &S,
    devices: &[Device],
    visitor: &mut dyn DumpVisitor,
) -> Result<(), ReadError> {
    let roots: BTreeSet<u64> = devices.iter().map(|d| d.root.get()).collect();
    let lists = collect_entries(source, &roots)?;
    let mut gatherer = Gatherer::default();
    for device in devices {
        gatherer.new_seq();
        for entry in &lists[&device.root.get()] {
            match *entry {
                Entry::Leaf(block) => gatherer.next(block),
                Entry::Ref(_) => gatherer.new_seq(),
            }
        }
    }
    let runs = gatherer.gather()?;
    for (head, (run, shared)) in &runs {
        if *shared {
            visitor.def_begin(&head.to_string())?;
            emit_leaves(source, run, visitor)?;
            visitor.def_end()?;
        }
    }
    for device in devices {
        visitor.device_begin(&device.info)?;
        let entries = &lists[&device.root.get()];
        let mut leaves: Vec<u64> = Vec::new();
        let mut index = 0;
        while index < entries.len() {
            match entries[index] {
                Entry::Ref(block) => {
                    emit_leaves(source, &leaves, visitor)?;
                    leaves.clear();
                    visitor.reference(&block.to_string())?;
                    index += 1;
                }
                Entry::Leaf(block) => match runs.get(&block) {
                    Some((run, true)) => {
                        emit_leaves(source, &leaves, visitor)?;
                        leaves.clear();
                        visitor.reference(&block.to_string())?;
                        index += run.len();
                    }
                    Some((run, false)) => {
                        leaves.extend_from_slice(run);
                        index += run.len();
                    }
                    None => {
                        leaves.push(block);
                        index += 1;
                    }
                },
            }
        }
        emit_leaves(source, &leaves, visitor)?;
        visitor.device_end()?;
    }
    Ok(())
}

/// Emit the mappings of consecutive leaves as runs that may span leaf boundaries.
fn emit_leaves<S: BlockSource + ?Sized>(
    source: &S,
    leaves: &[u64],
    visitor: &mut dyn DumpVisitor,
) -> Result<(), ReadError> {
    let mut runs = RunBuilder::new();
    for &leaf in leaves {
        let block = MetadataBlock::new(leaf);
        let data = source.read_block(block, BlockKind::Node)?;
        let node = Node::parse(block, &data, 8)?;
        if !node.is_leaf() {
            return Err(
                persistent_data::Error::corrupt(block, "mapping node is not a leaf").into(),
            );
        }
        let mut last_key = None;
        for i in 0..node.len() {
            let key = node.key(i);
            if last_key.is_some_and(|last| key <= last) {
                return Err(persistent_data::Error::corrupt(
                    block,
                    format!(
                        "mapping keys out of order: {key} after {}",
                        last_key.unwrap_or(0)
                    ),
                )
                .into());
            }
            last_key = Some(key);
            let value = u64::from_le_bytes(node.value_bytes(i).try_into().expect("8 bytes"));
            let value = BlockTime::unpack(value);
            let (data_block, time) = (value.data_block().get(), value.time().get());
            if let Some(run) = push_run(&mut runs, key, data_block, time) {
                visitor.mapping(&run)?;
            }
        }
    }
    if let Some(run) = runs.flush() {
        visitor.mapping(&run)?;
    }
    Ok(())
}

/// `RunBuilder::push`, except that keys that do not increase (possible across leaves of
/// corrupt or oddly shared trees) start a new run instead of panicking.
fn push_run(runs: &mut RunBuilder, key: u64, data_block: u64, time: u32) -> Option<Mapping> {
    let mut probe = runs.clone();
    match probe.flush() {
        Some(pending) if key <= pending.virtual_last() => {
            let closed = runs.flush();
            *runs = RunBuilder::new();
            let _ = runs.push(key, data_block, time);
            closed
        }
        _ => runs.push(key, data_block, time),
    }
}

/// Step 1 of the module docs: the leaf list of each distinct root.
fn collect_entries<S: BlockSource + ?Sized>(
    source: &S,
    roots: &BTreeSet<u64>,
) -> Result<HashMap<u64, Vec<Entry>>, ReadError> {
    let mut seen: HashSet<u64> = HashSet::new();
    let mut lists = HashMap::new();
    for &root in roots {
        let mut entries = Vec::new();
        let depth = tree_depth(source, MetadataBlock::new(root))?;
        if depth == 0 {
            entries.push(Entry::Leaf(root));
        } else if !seen.insert(root) {
            entries.push(Entry::Ref(root));
        } else {
            walk_internal(
                source,
                MetadataBlock::new(root),
                depth - 1,
                &mut seen,
                &mut entries,
            )?;
        }
        lists.insert(root, entries);
    }
    Ok(lists)
}

/// Levels below `root` (0 for a leaf), following first children.
fn tree_depth<S: BlockSource + ?Sized>(
    source: &S,
    root: MetadataBlock,
) -> Result<usize, ReadError> {
    let mut block = root;
    for depth in 0..btree::MAX_DEPTH {
        let data = source.read_block(block, BlockKind::Node)?;
        let node = Node::parse(block, &data, 8)?;
        if node.is_leaf() {
            return Ok(depth);
        }
        if node.is_empty() {
            return Err(
                persistent_data::Error::corrupt(block, "internal node with no entries").into(),
            );
        }
        block = node.child(0);
    }
    Err(persistent_data::Error::corrupt(root, "mapping tree too deep").into())
}

/// Walk an internal node whose children are `depth` levels above the leaves.
fn walk_internal<S: BlockSource + ?Sized>(
    source: &S,
    block: MetadataBlock,
    depth: usize,
    seen: &mut HashSet<u64>,
    entries: &mut Vec<Entry>,
) -> Result<(), ReadError> {
    let data = source.read_block(block, BlockKind::Node)?;
    let node = Node::parse(block, &data, 8)?;
    if node.is_leaf() {
        return Err(persistent_data::Error::corrupt(
            block,
            "btree nodes are not all at the same depth",
        )
        .into());
    }
    let children: Vec<u64> = (0..node.len()).map(|i| node.child(i).get()).collect();
    drop(data);
    if depth == 0 {
        entries.extend(children.iter().map(|&c| Entry::Leaf(c)));
        return Ok(());
    }
    let mut unseen = Vec::new();
    for child in children {
        if seen.insert(child) {
            unseen.push(child);
        } else {
            entries.push(Entry::Ref(child));
        }
    }
    for child in unseen {
        walk_internal(source, MetadataBlock::new(child), depth - 1, seen, entries)?;
    }
    Ok(())
}
