//! The read-ahead thread changes no report: the same problems, in the same order, and the
//! same summary as the walk alone, on healthy metadata and on damaged metadata (seeded
//! random damage: broken checksums, fields rewritten and restamped, blocks copied over
//! others, failing and corrupted reads); and on healthy metadata the reader queues every
//! node in the walk's order.

use super::read_ahead::ReadAhead;
use super::*;
use crate::{PoolMetadata, VirtualBlock, VolumeId};
use persistent_data::block_manager::validate;
use persistent_data::btree::node::Node;
use persistent_data::checksum::{self, BlockKind};
use persistent_data::{Block, MemoryDevice, MetadataBlock, BLOCK_SIZE};
use rand::rngs::StdRng;
use rand::Rng;
use std::collections::HashSet;
use std::time::{Duration, Instant};
use testkit::fault::{FaultDevice, Ops};

fn map(md: &mut PoolMetadata, id: u32, blocks: impl Iterator<Item = u64>) {
    for vb in blocks {
        let db = md.alloc_data_block().unwrap();
        md.insert(VolumeId::new(id), VirtualBlock::new(vb), db)
            .unwrap();
    }
    md.commit().unwrap();
}

/// Metadata with multi-level trees laid out in different orders, a snapshot sharing most
/// of its origin, and a metadata snapshot.
fn image() -> Vec<u8> {
    let device = Arc::new(MemoryDevice::new(4096));
    let mut md = PoolMetadata::format(device.clone(), 128, 200_000).unwrap();
    md.create_thin(VolumeId::new(0)).unwrap();
    map(&mut md, 0, 0..30_000);
    md.create_snap(VolumeId::new(1), VolumeId::new(0)).unwrap();
    map(&mut md, 1, (0..30_000).step_by(7));
    md.create_thin(VolumeId::new(2)).unwrap();
    map(&mut md, 2, (0..20_000).rev().map(|i| i * 3));
    md.reserve_metadata_snap().unwrap();
    map(&mut md, 0, 10_000..12_000);
    drop(md);
    device.to_bytes()
}

/// What a report says, for comparison.
fn findings(report: &Report) -> impl PartialEq + fmt::Debug + '_ {
    (
        &report.problems,
        &report.summary,
        report.problems_omitted,
        report.fatal_count,
        report.non_fatal_count,
        report.warning_count,
    )
}

fn run(device: Arc<dyn BlockDevice>, options: &CheckOptions, read_ahead: bool) -> (Report, u64) {
    check_with(device, options, read_ahead, &mut |_| {})
}

/// Check a device from `device` without and twice with the read-ahead (a new device each
/// time): the reports must be the same. Returns the report.
fn same_either_way(
    device: impl Fn() -> Arc<dyn BlockDevice>,
    options: &CheckOptions,
    what: &str,
) -> Report {
    let (alone, _) = run(device(), options, false);
    for _ in 0..2 {
        let (ahead, _) = run(device(), options, true);
        assert_eq!(
            findings(&ahead),
            findings(&alone),
            "{what}: with the read-ahead:\n{ahead}\nalone:\n{alone}"
        );
    }
    alone
}

fn option_sets() -> Vec<CheckOptions> {
    let skip = CheckOptions {
        leaf_occupancy: LeafOccupancy::SkipBottomLeaves,
        ..CheckOptions::default()
    };
    let snap = CheckOptions {
        metadata_snap: true,
        ..CheckOptions::default()
    };
    let top = CheckOptions {
        skip_mappings: true,
        ..CheckOptions::default()
    };
    vec![CheckOptions::default(), skip, snap, top]
}

#[test]
fn read_ahead_changes_nothing_on_healthy_metadata() {
    let image = image();
    for options in option_sets() {
        let device = || -> Arc<dyn BlockDevice> { Arc::new(MemoryDevice::from_bytes(&image)) };
        let report = same_either_way(device, &options, &format!("{options:?}"));
        assert!(report.is_clean(), "{options:?}:\n{report}");
    }
}

/// The kind a block validates as, if any.
fn kind_of(index: u64, data: &Block) -> Option<BlockKind> {
    BlockKind::ALL
        .into_iter()
        .find(|&kind| validate(MetadataBlock::new(index), data, kind).is_ok())
}

fn block_mut(image: &mut [u8], index: u64) -> &mut Block {
    let at = index as usize * BLOCK_SIZE;
    (&mut image[at..at + BLOCK_SIZE]).try_into().unwrap()
}

/// One random damage to `image`, whose valid blocks are `used`; returns what it did.
fn damage(rng: &mut StdRng, image: &mut [u8], used: &[(u64, BlockKind)]) -> String {
    let (index, kind) = used[rng.gen_range(0..used.len())];
    match rng.gen_range(0..3) {
        0 => {
            let at = rng.gen_range(0..BLOCK_SIZE);
            block_mut(image, index)[at] ^= 1 << rng.gen_range(0..8);
            format!("byte {at} of block {index} flipped")
        }
        1 => {
            // A field rewritten and the checksum made right again: pointers to other
            // blocks (shared subtrees, cycles, other trees), keys, entry counts, values.
            let at = 8 * rng.gen_range(2..BLOCK_SIZE / 8);
            let (other, _) = used[rng.gen_range(0..used.len())];
            let block = block_mut(image, index);
            let old = u64::from_le_bytes(block[at..at + 8].try_into().unwrap());
            let value = match rng.gen_range(0..4) {
                0 => other,
                1 => old.wrapping_add(1),
                2 => old.wrapping_sub(1),
                _ => rng.gen::<u64>() >> rng.gen_range(0..64),
            };
            block[at..at + 8].copy_from_slice(&value.to_le_bytes());
            checksum::stamp(block, kind);
            format!("u64 at {at} of {kind} block {index}: {old} -> {value}")
        }
        _ => {
            // A block copied over another (its location made right): a node reachable twice.
            let (from, from_kind) = used[rng.gen_range(0..used.len())];
            let source = *block_mut(image, from);
            let block = block_mut(image, index);
            *block = source;
            block[8..16].copy_from_slice(&index.to_le_bytes());
            checksum::stamp(block, from_kind);
            format!("{from_kind} block {from} copied over block {index}")
        }
    }
}

#[test]
fn read_ahead_changes_nothing_on_damaged_metadata() {
    let (_report, mut rng) = testkit::seed::seeded_rng();
    let pristine = image();
    let used: Vec<(u64, BlockKind)> = (0..(pristine.len() / BLOCK_SIZE) as u64)
        .filter_map(|index| {
            let at = index as usize * BLOCK_SIZE;
            let data: &Block = pristine[at..at + BLOCK_SIZE].try_into().unwrap();
            kind_of(index, data).map(|kind| (index, kind))
        })
        .collect();
    let options = option_sets();
    let mut found = 0;
    for case in 0..testkit::seed::case_count(40) {
        let mut image = pristine.clone();
        let what: Vec<String> = (0..rng.gen_range(1..=3))
            .map(|_| damage(&mut rng, &mut image, &used))
            .collect();
        let options = &options[rng.gen_range(0..options.len())];
        let device = || -> Arc<dyn BlockDevice> { Arc::new(MemoryDevice::from_bytes(&image)) };
        let what = format!("case {case}: {what:?} ({options:?})");
        let report = same_either_way(device, options, &what);
        found += u64::from(!report.is_clean());
    }
    assert!(found > 0, "no damage was ever found");
}

#[test]
fn read_ahead_changes_nothing_when_reads_fail_or_are_corrupted() {
    let image = image();
    let options = CheckOptions::default();
    // Every read after the superblock's fails, the reader's included.
    let failing = || -> Arc<dyn BlockDevice> {
        let device = FaultDevice::new(MemoryDevice::from_bytes(&image));
        device.fail_from(Ops::READ, 2);
        Arc::new(device)
    };
    let report = same_either_way(failing, &options, "reads fail");
    assert!(report.has(Rule::Io), "{report}");
    // Reads of some nodes come back corrupted, whoever reads them.
    let corrupted = || -> Arc<dyn BlockDevice> {
        let device = FaultDevice::new(MemoryDevice::from_bytes(&image));
        for index in (0..(image.len() / BLOCK_SIZE) as u64).step_by(29) {
            let at = index as usize * BLOCK_SIZE;
            let data: &Block = image[at..at + BLOCK_SIZE].try_into().unwrap();
            if kind_of(index, data) == Some(BlockKind::Node) {
                device.corrupt_reads(MetadataBlock::new(index), 100, 0x10);
            }
        }
        Arc::new(device)
    };
    let report = same_either_way(corrupted, &options, "corrupted reads");
    assert!(report.has(Rule::Checksum(BlockKind::Node)), "{report}");
}

/// The nodes of the trees under `roots`, each once, in the walk's order (depth first,
/// children in key order).
fn walk_order(bm: &BlockManager, roots: &[u64]) -> Vec<u64> {
    fn visit(bm: &BlockManager, block: u64, seen: &mut HashSet<u64>, order: &mut Vec<u64>) {
        if !seen.insert(block) {
            return;
        }
        order.push(block);
        let data = bm.read(MetadataBlock::new(block), BlockKind::Node).unwrap();
        let node = Node::parse(MetadataBlock::new(block), &data, 8).unwrap();
        if !node.is_leaf() {
            for i in 0..node.len() {
                visit(bm, node.child(i).get(), seen, order);
            }
        }
    }
    let (mut seen, mut order) = (HashSet::new(), Vec::new());
    for &root in roots {
        visit(bm, root, &mut seen, &mut order);
    }
    order
}

#[test]
fn the_reader_queues_every_node_in_walk_order() {
    let image = image();
    let device = Arc::new(MemoryDevice::from_bytes(&image));
    let md = PoolMetadata::open(device.clone()).unwrap();
    let roots: Vec<u64> = (0..3)
        .map(|id| md.volume_root(VolumeId::new(id)).unwrap().get())
        .collect();
    drop(md);
    let bm = BlockManager::new(device, 16);
    let expected = walk_order(&bm, &roots);
    assert!(
        expected.len() > 300,
        "{} nodes: trees too small",
        expected.len()
    );
    let queue = ReadAhead::new(bm.block_count());
    std::thread::scope(|scope| {
        scope.spawn(|| queue.run(&bm, bm.block_count()));
        // Stop the reader however the test ends (a failed assertion included).
        let finish = Finish(&queue);
        queue.trees(roots.clone());
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut spares = Vec::new();
        let mut rest = &expected[..];
        while !rest.is_empty() {
            // Wait for the reader to fill its window (or reach the end), then take it all:
            // each node must be at the front of the queue when the walk asks for it.
            let batch = queue.wait_queued(rest.len(), deadline);
            assert!(batch > 0, "the reader queued nothing within a minute");
            for &block in &rest[..batch] {
                let data = queue.take(block, BlockKind::Node, &mut spares);
                let data = data.unwrap_or_else(|| panic!("node {block} not queued in order"));
                let direct = bm.read(MetadataBlock::new(block), BlockKind::Node).unwrap();
                assert_eq!(data[..], direct[..], "node {block}");
                spares.push(data);
            }
            rest = &rest[batch..];
        }
        assert_eq!(queue.served(), expected.len() as u64);
        drop(finish);
    });
}
