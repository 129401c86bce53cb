//! The diff walk against a naive comparison of every mapping, on trees `PoolMetadata`
//! builds (snapshots share subtrees as the kernel's do), and its cost in nodes read.

use super::*;
use crate::format::metadata::PoolMetadata;
use crate::ids::{VirtualBlock, VolumeId};
use persistent_data::{BlockDevice, MemoryDevice};
use rand::Rng;
use std::collections::BTreeMap;
use std::sync::Arc;

fn metadata(blocks: u64, data_blocks: u64) -> PoolMetadata {
    let device: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(blocks));
    PoolMetadata::format(device, 128, data_blocks).unwrap()
}

fn map(md: &mut PoolMetadata, id: VolumeId, block: u64) {
    let data_block = md.alloc_data_block().unwrap();
    md.insert(id, VirtualBlock::new(block), data_block).unwrap();
}

fn mappings(md: &PoolMetadata, id: VolumeId) -> BTreeMap<u64, u64> {
    let mut all = BTreeMap::new();
    md.walk_volume(id, &mut |block, data_block, _| {
        all.insert(block.get(), data_block.get());
        Ok(())
    })
    .unwrap();
    all
}

/// The ranges the naive comparison of two mapping lists gives, merged as `thin_delta` does.
fn naive(
    left: &BTreeMap<u64, u64>,
    right: &BTreeMap<u64, u64>,
    keys: RangeInclusive<u64>,
    list_same: bool,
) -> Vec<DeltaRange> {
    let mut all: BTreeMap<u64, (DeltaKind, Option<u64>, Option<u64>)> = BTreeMap::new();
    for (&k, &l) in left.range(keys.clone()) {
        let r = right.get(&k).copied();
        let kind = match r {
            None => DeltaKind::LeftOnly,
            Some(r) if r == l => DeltaKind::Same,
            Some(_) => DeltaKind::Different,
        };
        all.insert(k, (kind, Some(l), r));
    }
    for (&k, &r) in right.range(keys) {
        all.entry(k)
            .or_insert((DeltaKind::RightOnly, None, Some(r)));
    }
    let mut ranges = Ranges::new(list_same);
    for (k, (kind, l, r)) in all {
        ranges.push(k, kind, l, r);
    }
    ranges.finish()
}

fn check(md: &PoolMetadata, left: VolumeId, right: VolumeId, keys: RangeInclusive<u64>) {
    let (l, r) = (mappings(md, left), mappings(md, right));
    for list_same in [false, true] {
        let request = DiffRequest {
            left: Some(md.volume_root(left).unwrap()),
            right: Some(md.volume_root(right).unwrap()),
            keys: keys.clone(),
            list_same,
            nodes_max: None,
        };
        let walked = diff(md.transaction_manager(), &request).unwrap();
        assert_eq!(
            walked.ranges,
            naive(&l, &r, keys.clone(), list_same),
            "{left} vs {right}, keys {keys:?}, list_same {list_same}"
        );
    }
}

/// Random writes, discards and snapshots on a few volumes; every pair compared with the
/// naive diff, whole and over random key ranges, before and after commits.
#[test]
fn the_walk_equals_a_naive_comparison() {
    let (_report, mut rng) = testkit::seeded_rng();
    let mut md = metadata(16384, 200_000);
    let mut volumes = vec![VolumeId::new(0)];
    md.create_thin(volumes[0]).unwrap();
    let span = 3000u64;
    for block in 0..1500 {
        map(&mut md, volumes[0], rng.gen_range(0..span).max(block));
    }
    md.commit().unwrap();
    for round in 0..12 {
        let origin = volumes[rng.gen_range(0..volumes.len())];
        let id = VolumeId::new(volumes.len() as u32);
        md.create_snap(id, origin).unwrap();
        volumes.push(id);
        for _ in 0..rng.gen_range(0..200) {
            let volume = volumes[rng.gen_range(0..volumes.len())];
            let block = rng.gen_range(0..span);
            match rng.gen_range(0..4) {
                0 => {
                    md.remove(volume, VirtualBlock::new(block)).unwrap();
                }
                1 => {
                    let end = (block + rng.gen_range(1..300)).min(span);
                    md.remove_range(volume, VirtualBlock::new(block), VirtualBlock::new(end))
                        .unwrap();
                }
                _ => map(&mut md, volume, block),
            }
        }
        if round % 3 == 0 {
            md.commit().unwrap();
        }
        for &left in &volumes {
            for &right in &volumes {
                check(&md, left, right, 0..=u64::MAX);
            }
        }
        let a = rng.gen_range(0..span);
        let b = rng.gen_range(a..span + 10);
        check(&md, origin, id, a..=b);
        check(&md, id, origin, a..=a);
    }
}

#[test]
fn extreme_keys_and_empty_trees() {
    let mut md = metadata(1024, 100);
    let (a, b, c) = (VolumeId::new(0), VolumeId::new(1), VolumeId::new(2));
    md.create_thin(a).unwrap();
    md.create_thin(b).unwrap();
    md.create_thin(c).unwrap();
    map(&mut md, a, u64::MAX);
    map(&mut md, a, u64::MAX - 1);
    map(&mut md, b, 0);
    check(&md, a, b, 0..=u64::MAX);
    check(&md, a, c, 0..=u64::MAX);
    check(&md, c, c, 0..=u64::MAX);
    check(&md, a, a, u64::MAX..=u64::MAX);
    let none = diff(md.transaction_manager(), &DiffRequest::new(None, None)).unwrap();
    assert_eq!(none, Diff::default());
    let root = md.volume_root(a).unwrap();
    let only_left = diff(
        md.transaction_manager(),
        &DiffRequest::new(Some(root), None),
    )
    .unwrap();
    assert_eq!(
        only_left.ranges,
        vec![DeltaRange {
            begin: u64::MAX - 1,
            length: 2,
            kind: DeltaKind::LeftOnly,
            left_data_begin: Some(1),
            right_data_begin: None,
        }]
    );
}

/// Nodes read for a diff of two snapshots of a 200k-mapping volume: a few per changed
/// block (the path to it, on both sides), nothing for the shared rest; a full diff against
/// an empty tree reads every node.
#[test]
fn the_walk_reads_nodes_in_proportion_to_the_difference() {
    let mut md = metadata(16384, 400_000);
    let origin = VolumeId::new(0);
    md.create_thin(origin).unwrap();
    let mapped = 200_000u64;
    for block in 0..mapped {
        map(&mut md, origin, block);
    }
    md.commit().unwrap();
    let root = md.volume_root(origin).unwrap();
    let full = diff(
        md.transaction_manager(),
        &DiffRequest::new(Some(root), None),
    )
    .unwrap();
    let mut read = Vec::new();
    for (i, changed) in [10u64, 100, 1000].into_iter().enumerate() {
        let snap = VolumeId::new(1 + i as u32);
        md.create_snap(snap, origin).unwrap();
        let stride = mapped / changed;
        for k in 0..changed {
            map(&mut md, snap, k * stride + 7);
        }
        md.commit().unwrap();
        let request = DiffRequest::new(Some(root), Some(md.volume_root(snap).unwrap()));
        let walked = diff(md.transaction_manager(), &request).unwrap();
        assert_eq!(walked.ranges.len() as u64, changed);
        assert!(walked
            .ranges
            .iter()
            .all(|r| r.kind == DeltaKind::Different && r.length == 1));
        read.push(walked.nodes_read);
        eprintln!(
            "{changed} changed blocks: {} nodes read (full walk {})",
            walked.nodes_read, full.nodes_read
        );
        // Two paths of at most 3 nodes per changed leaf, and the two spines.
        assert!(
            walked.nodes_read <= 6 * changed + 8,
            "{changed} changes: {} nodes read",
            walked.nodes_read
        );
    }
    assert!(
        read[0] * 20 < full.nodes_read,
        "a 10-block diff read {} nodes, the full walk {}",
        read[0],
        full.nodes_read
    );
    assert!(read[0] < read[1] && read[1] < read[2], "{read:?}");
}

/// A restricted key range reads only the paths into it.
#[test]
fn a_key_range_bounds_the_walk() {
    let mut md = metadata(16384, 200_000);
    let origin = VolumeId::new(0);
    md.create_thin(origin).unwrap();
    for block in 0..100_000 {
        map(&mut md, origin, block);
    }
    md.commit().unwrap();
    md.create_thin(VolumeId::new(1)).unwrap();
    let request = DiffRequest {
        keys: 50_000..=50_099,
        ..DiffRequest::new(
            Some(md.volume_root(origin).unwrap()),
            Some(md.volume_root(VolumeId::new(1)).unwrap()),
        )
    };
    let walked = diff(md.transaction_manager(), &request).unwrap();
    assert_eq!(
        walked.ranges,
        vec![DeltaRange {
            begin: 50_000,
            length: 100,
            kind: DeltaKind::LeftOnly,
            left_data_begin: Some(50_000),
            right_data_begin: None,
        }]
    );
    assert!(walked.nodes_read <= 12, "{} nodes read", walked.nodes_read);
}

#[test]
fn xml_is_thin_deltas_form() {
    let mut out = Vec::new();
    let header = DeltaHeader {
        time: 1,
        transaction_id: 3,
        data_block_size_sectors: 128,
        data_block_count: 1000,
    };
    let ranges = [
        DeltaRange {
            begin: 0,
            length: 2,
            kind: DeltaKind::Same,
            left_data_begin: Some(7),
            right_data_begin: Some(7),
        },
        DeltaRange {
            begin: 5,
            length: 1,
            kind: DeltaKind::RightOnly,
            left_data_begin: None,
            right_data_begin: Some(9),
        },
        DeltaRange {
            begin: 8,
            length: 1,
            kind: DeltaKind::RightOnly,
            left_data_begin: None,
            right_data_begin: Some(3),
        },
    ];
    write_xml(&mut out, &header, 0, 1, &ranges, false).unwrap();
    assert_eq!(
        String::from_utf8(out).unwrap(),
        "<superblock uuid=\"\" time=\"1\" transaction=\"3\" data_block_size=\"128\" nr_data_blocks=\"1000\">\n  <diff left=\"0\" right=\"1\">\n    <same begin=\"0\" length=\"2\"/>\n    <right_only begin=\"5\" length=\"1\"/>\n    <right_only begin=\"8\" length=\"1\"/>\n  </diff>\n</superblock>"
    );
    let mut out = Vec::new();
    write_xml(&mut out, &header, 0, 1, &ranges, true).unwrap();
    assert_eq!(
        String::from_utf8(out).unwrap(),
        "<superblock uuid=\"\" time=\"1\" transaction=\"3\" data_block_size=\"128\" nr_data_blocks=\"1000\">\n  <diff left=\"0\" right=\"1\">\n    <same>\n      <range begin=\"0\" data_begin=\"7\" length=\"2\"/>\n    </same>\n    <right_only>\n      <range begin=\"5\" data_begin=\"9\" length=\"1\"/>\n      <range begin=\"8\" data_begin=\"3\" length=\"1\"/>\n    </right_only>\n  </diff>\n</superblock>"
    );
}

#[test]
fn a_corrupt_child_pointer_is_an_error() {
    let mut md = metadata(4096, 100_000);
    let a = VolumeId::new(0);
    md.create_thin(a).unwrap();
    for block in 0..2000 {
        map(&mut md, a, block);
    }
    md.commit().unwrap();
    // The superblock as a child: not a btree node, so the read fails its checksum.
    let request = DiffRequest::new(Some(MetadataBlock::new(0)), md.volume_root(a).ok());
    assert!(diff(md.transaction_manager(), &request).is_err());
}

/// A snapshot that grew a level (its root split) still shares the origin's leaves: the walk
/// reads down to them from the taller side and skips them.
#[test]
fn trees_of_different_heights_share_their_leaves() {
    let mut md = metadata(16384, 200_000);
    let origin = VolumeId::new(0);
    md.create_thin(origin).unwrap();
    for block in 0..20_000 {
        map(&mut md, origin, block * 2);
    }
    let snap = VolumeId::new(1);
    md.create_snap(snap, origin).unwrap();
    for block in 0..60_000 {
        map(&mut md, snap, 100_000 + block);
    }
    map(&mut md, snap, 2 * 777);
    md.commit().unwrap();
    let tm = md.transaction_manager();
    let (left, right) = (
        md.volume_root(origin).unwrap(),
        md.volume_root(snap).unwrap(),
    );
    let mut heights = Vec::new();
    for root in [left, right] {
        let mut walk = Walk {
            source: tm,
            nodes_read: 0,
            nodes_max: u64::MAX,
            stopped_at: None,
            keys: FULL,
            ranges: Ranges::new(false),
        };
        heights.push(walk.height(root).unwrap());
    }
    assert!(heights[0] < heights[1], "heights {heights:?}");
    check(&md, origin, snap, 0..=u64::MAX);
    check(&md, snap, origin, 0..=u64::MAX);
    // The snapshot's own part is read whole; of the part it shares with the origin, only
    // the path to block 1554.
    let walked = diff(tm, &DiffRequest::new(Some(left), Some(right))).unwrap();
    let whole_snapshot = diff(tm, &DiffRequest::new(None, Some(right))).unwrap();
    let whole_origin = diff(tm, &DiffRequest::new(Some(left), None)).unwrap();
    assert_eq!(walked.ranges.len(), 2);
    assert!(
        walked.nodes_read < whole_snapshot.nodes_read - whole_origin.nodes_read + 20,
        "{} nodes read; the snapshot's tree has {}, the origin's {}",
        walked.nodes_read,
        whole_snapshot.nodes_read,
        whole_origin.nodes_read
    );
}
