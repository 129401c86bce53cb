//! Where a repair starts: the superblock's settings and, in order of preference, the roots
//! of the device-details tree and of the mapping tree.
//!
//! - A good superblock (checksum, location, fields) gives everything: its settings, its
//!   roots, then the roots of the metadata snapshot it holds (used when a live root node
//!   is itself damaged).
//! - A damaged superblock gives no settings that can be trusted (as with `thin_repair`, the
//!   data block size must then be given; the transaction id, time and data device size are
//!   rebuilt from the trees unless given). Its roots are still tried first (a root is a node
//!   whose own checksum and location say it is one).
//!
//! When no root of the plan is a readable node, the repair scans the whole metadata device
//! for roots ([`scan`]).

use super::{Error, RepairOptions};
use crate::format::superblock::{Superblock, Unchecked};
use persistent_data::block_manager::{validate, BlockManager};
use persistent_data::btree::node::Node;
use persistent_data::checksum::BlockKind;
use persistent_data::MetadataBlock;
use std::collections::{BTreeMap, HashSet};

/// Leaf value size of the device-details tree.
pub const DETAILS_VALUE_SIZE: usize = 24;
/// Leaf value size of the mapping tree (both levels).
pub const MAPPING_VALUE_SIZE: usize = 8;

/// Where the roots came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RootSource {
    /// A good superblock (and its metadata snapshot).
    Superblock,
    /// A damaged superblock's roots (then a scan of the device).
    DamagedSuperblock,
}

/// What a repair starts from.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Where the roots came from.
    pub source: RootSource,
    /// The pool's time, if known (else rebuilt from the trees).
    pub time: Option<u32>,
    /// The transaction id, if known (else rebuilt from the details).
    pub transaction_id: Option<u64>,
    /// Data block size in sectors.
    pub data_block_size_sectors: u32,
    /// Data blocks, if known (else one past the highest mapped block).
    pub data_block_count: Option<u64>,
    /// Details-tree roots, best first.
    pub details_roots: Vec<MetadataBlock>,
    /// Mapping-tree roots, best first.
    pub mapping_roots: Vec<MetadataBlock>,
}

/// Decide where to start (module docs).
pub fn plan(bm: &BlockManager, options: &RepairOptions) -> Result<Plan, Error> {
    if let Ok(sb) = Superblock::read(bm, MetadataBlock::SUPERBLOCK) {
        let mut details_roots = vec![sb.device_details_root];
        let mut mapping_roots = vec![sb.data_mapping_root];
        if let Some(snap) = sb
            .metadata_snap
            .and_then(|at| Superblock::read(bm, at).ok())
        {
            details_roots.push(snap.device_details_root);
            mapping_roots.push(snap.data_mapping_root);
        }
        return Ok(Plan {
            source: RootSource::Superblock,
            time: Some(sb.time),
            transaction_id: Some(options.transaction_id.unwrap_or(sb.transaction_id)),
            data_block_size_sectors: options
                .data_block_size_sectors
                .unwrap_or(sb.data_block_size_sectors),
            data_block_count: Some(
                options
                    .data_block_count
                    .unwrap_or(sb.data_space_map.block_count),
            ),
            details_roots,
            mapping_roots,
        });
    }
    let data_block_size_sectors = options
        .data_block_size_sectors
        .ok_or(Error::DataBlockSizeNeeded)?;
    let mut details_roots = Vec::new();
    let mut mapping_roots = Vec::new();
    if let Ok(raw) = bm.read_raw(MetadataBlock::SUPERBLOCK) {
        let raw = Unchecked::decode(&raw).superblock;
        details_roots.push(raw.device_details_root);
        mapping_roots.push(raw.data_mapping_root);
    }
    Ok(Plan {
        source: RootSource::DamagedSuperblock,
        time: None,
        transaction_id: options.transaction_id,
        data_block_size_sectors,
        data_block_count: options.data_block_count,
        details_roots,
        mapping_roots,
    })
}

/// One trusted node of a scan: its kind and what the choice of roots needs of it.
struct Scanned {
    leaf: bool,
    value_size: usize,
    /// Internal nodes: their children. Leaves of 8-byte values: their values.
    values: Vec<u64>,
    /// Details leaves: the highest transaction id and time their entries name.
    newest: (u64, u32),
    keys: Vec<u64>,
}

/// Roots found by [`scan`], best first.
#[derive(Debug, Default)]
pub struct Found {
    /// Details-tree roots.
    pub details_roots: Vec<MetadataBlock>,
    /// Top-level mapping-tree roots.
    pub mapping_roots: Vec<MetadataBlock>,
}

/// Find tree roots by reading every block: the trusted nodes (checksum and location right,
/// header valid) that no other trusted internal node lists are roots. A root whose leftmost
/// leaf holds 24-byte values heads a details tree; one whose leftmost leaf holds 8-byte
/// values that are all blocks of trusted nodes heads a top-level mapping tree (bottom-level
/// values pack a data block above bit 24, which is beyond any metadata device). Details
/// roots are ranked by the newest transaction id and time they record, then by how many
/// devices they hold; mapping roots by how many of the best details tree's devices they
/// hold, then by how many devices. Stale trees of earlier transactions survive on disk, so
/// the ranking prefers the newest.
pub fn scan(bm: &BlockManager) -> Found {
    let nodes = read_nodes(bm);
    let listed: HashSet<u64> = nodes
        .values()
        .filter(|n| !n.leaf)
        .flat_map(|n| n.values.iter().copied())
        .collect();
    let roots: Vec<u64> = nodes
        .keys()
        .copied()
        .filter(|b| !listed.contains(b))
        .collect();
    let mut details: Vec<(u64, u32, usize, u64)> = Vec::new();
    let mut mappings: Vec<(u64, Vec<u64>)> = Vec::new();
    for &root in &roots {
        let Some(leaf) = leftmost_leaf(&nodes, root) else {
            continue;
        };
        if leaf.value_size == DETAILS_VALUE_SIZE {
            let (transaction, time, count) = summarise(&nodes, root);
            details.push((transaction, time, count, root));
        } else if leaf.values.iter().all(|v| nodes.contains_key(v)) && !leaf.values.is_empty() {
            mappings.push((root, tree_keys(&nodes, root)));
        }
    }
    details.sort_by_key(|d| std::cmp::Reverse(*d));
    let best_keys: HashSet<u64> = details
        .first()
        .map(|d| tree_keys(&nodes, d.3).into_iter().collect())
        .unwrap_or_default();
    mappings.sort_by_key(|(root, keys)| {
        let common = keys.iter().filter(|k| best_keys.contains(k)).count();
        std::cmp::Reverse((common, keys.len(), *root))
    });
    Found {
        details_roots: details.iter().map(|d| MetadataBlock::new(d.3)).collect(),
        mapping_roots: mappings
            .iter()
            .map(|(root, _)| MetadataBlock::new(*root))
            .collect(),
    }
}

/// Every trusted node of the device (block 0, the superblock, aside).
fn read_nodes(bm: &BlockManager) -> BTreeMap<u64, Scanned> {
    let mut nodes = BTreeMap::new();
    for block in 1..bm.block_count() {
        let location = MetadataBlock::new(block);
        let Ok(data) = bm.read_raw(location) else {
            continue;
        };
        if validate(location, &data, BlockKind::Node).is_err() {
            continue;
        }
        let value_size = u32::from_le_bytes(data[24..28].try_into().expect("4 bytes")) as usize;
        let Ok(node) = Node::parse(location, &data, value_size) else {
            continue;
        };
        if !matches!(value_size, DETAILS_VALUE_SIZE | MAPPING_VALUE_SIZE) && node.is_leaf() {
            continue;
        }
        let mut keys: Vec<u64> = (0..node.len()).map(|i| node.key(i)).collect();
        let (values, newest) = if !node.is_leaf() {
            keys.clear();
            (
                (0..node.len()).map(|i| node.child(i).get()).collect(),
                (0, 0),
            )
        } else if value_size == MAPPING_VALUE_SIZE {
            let value = |i| u64::from_le_bytes(node.value_bytes(i).try_into().expect("8 bytes"));
            let values: Vec<u64> = (0..node.len()).map(value).collect();
            // Only a top-level leaf's values are all metadata blocks; a bottom-level leaf's
            // keys and values are not kept (memory stays a few words per node).
            if values.iter().all(|&v| v != 0 && v < bm.block_count()) {
                (values, (0, 0))
            } else {
                keys.clear();
                (Vec::new(), (0, 0))
            }
        } else {
            (Vec::new(), newest_details(&node))
        };
        nodes.insert(
            block,
            Scanned {
                leaf: node.is_leaf(),
                value_size,
                values,
                newest,
                keys,
            },
        );
    }
    nodes
}

/// The highest transaction id and time the entries of a details leaf record.
fn newest_details(node: &Node<'_>) -> (u64, u32) {
    use crate::format::details::DeviceDetails;
    use persistent_data::btree::Value;
    (0..node.len())
        .map(|i| DeviceDetails::unpack(node.value_bytes(i)))
        .fold((0, 0), |(transaction, time), d| {
            (
                transaction.max(d.transaction_id),
                time.max(d.creation_time).max(d.snapshotted_time),
            )
        })
}

/// The leftmost leaf below `root`, if every node on the way is a trusted node.
fn leftmost_leaf(nodes: &BTreeMap<u64, Scanned>, root: u64) -> Option<&Scanned> {
    let mut node = nodes.get(&root)?;
    for _ in 0..super::walk::DEPTH_MAX {
        if node.leaf {
            return Some(node);
        }
        node = nodes.get(node.values.first()?)?;
    }
    None
}

/// The keys of the leaves below `root` (trusted nodes only, each node once).
fn tree_keys(nodes: &BTreeMap<u64, Scanned>, root: u64) -> Vec<u64> {
    let mut keys = Vec::new();
    let mut seen = HashSet::new();
    let mut stack = vec![(root, 0usize)];
    while let Some((block, depth)) = stack.pop() {
        let Some(node) = nodes.get(&block).filter(|_| seen.insert(block)) else {
            continue;
        };
        if node.leaf {
            keys.extend(&node.keys);
        } else if depth < super::walk::DEPTH_MAX {
            stack.extend(node.values.iter().map(|&child| (child, depth + 1)));
        }
    }
    keys
}

/// A details tree's newest transaction id and time, and its device count.
fn summarise(nodes: &BTreeMap<u64, Scanned>, root: u64) -> (u64, u32, usize) {
    let mut newest = (0u64, 0u32);
    let mut count = 0;
    let mut seen = HashSet::new();
    let mut stack = vec![(root, 0usize)];
    while let Some((block, depth)) = stack.pop() {
        let Some(node) = nodes.get(&block).filter(|_| seen.insert(block)) else {
            continue;
        };
        if node.leaf {
            newest = (newest.0.max(node.newest.0), newest.1.max(node.newest.1));
            count += node.keys.len();
        } else if depth < super::walk::DEPTH_MAX {
            stack.extend(node.values.iter().map(|&child| (child, depth + 1)));
        }
    }
    (newest.0, newest.1, count)
}
