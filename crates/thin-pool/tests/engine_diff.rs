//! Goal: `Pool::diff` lists exactly the blocks in which two volumes differ (mapped in one
//! only, or to different data blocks), including writes not committed yet, and
//! `Pool::delta` lists what `thin_delta` lists.
//! Method: seeded random whole-block writes, discards, snapshots, resizes and deletes on a
//! few volumes, against a model that gives each mapping a token and follows dm-thin's
//! sharing rule (a write to a mapping older than the volume's last snapshot gets a new data
//! block; any other write stays in place). After each step a random pair of volumes is
//! diffed, whole and over a random block range, and compared with the model's diff; the
//! pool never commits on its own, so `diff` must commit what is queued. Then diffs run
//! while another thread writes: each lists every write completed before it.
//! The cost of the walk in nodes read is tested with the walk itself (`format::diff`).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use rand::Rng;
use thin_pool::format::diff::DeltaKind;
use thin_pool::testing::MemoryParts;
use thin_pool::{DiffKind, DiffRange, Pool, PoolOptions, VirtualBlock};

const BLOCK: u64 = 65536;

/// One volume in the model.
#[derive(Clone, Debug)]
struct ModelVolume {
    size_blocks: u64,
    /// Virtual block → (token of the data block, time mapped).
    mappings: BTreeMap<u64, (u64, u32)>,
    snapshotted_time: u32,
}

#[derive(Default)]
struct Model {
    volumes: BTreeMap<String, ModelVolume>,
    time: u32,
    next_token: u64,
}

impl Model {
    fn write(&mut self, name: &str, block: u64) {
        let token = self.next_token;
        let time = self.time;
        let volume = self.volumes.get_mut(name).unwrap();
        match volume.mappings.get(&block) {
            Some(&(_, mapped)) if mapped >= volume.snapshotted_time => {}
            _ => {
                volume.mappings.insert(block, (token, time));
                self.next_token += 1;
            }
        }
    }

    fn snapshot(&mut self, origin: &str, name: &str) {
        self.time += 1;
        let origin = self.volumes.get_mut(origin).unwrap();
        origin.snapshotted_time = self.time;
        let copy = origin.clone();
        self.volumes.insert(name.to_string(), copy);
    }

    fn diff(&self, base: &str, target: &str, blocks: Option<Range<u64>>) -> Vec<DiffRange> {
        let (b, t) = (&self.volumes[base], &self.volumes[target]);
        let end = b.size_blocks.max(t.size_blocks);
        let blocks = blocks.map_or(0..end, |r| r.start..r.end.min(end));
        let mut ranges: Vec<DiffRange> = Vec::new();
        let inside = |v: &ModelVolume, k: u64| {
            (k < v.size_blocks)
                .then(|| v.mappings.get(&k).map(|m| m.0))
                .flatten()
        };
        for k in blocks {
            let kind = match (inside(b, k), inside(t, k)) {
                (Some(x), Some(y)) if x != y => DiffKind::Changed,
                (Some(_), None) => DiffKind::BaseOnly,
                (None, Some(_)) => DiffKind::TargetOnly,
                _ => continue,
            };
            match ranges.last_mut() {
                Some(last) if last.kind == kind && last.begin.get() + last.length == k => {
                    last.length += 1
                }
                _ => ranges.push(DiffRange {
                    begin: VirtualBlock::new(k),
                    length: 1,
                    kind,
                }),
            }
        }
        ranges
    }
}

fn pool() -> Pool {
    MemoryParts::new(4096, 4096 * BLOCK).format(
        BLOCK,
        PoolOptions {
            commit_interval: None,
            ..PoolOptions::default()
        },
    )
}

#[test]
fn diff_matches_the_model() {
    let (_report, mut rng) = testkit::seed::seeded_rng();
    let steps = testkit::seed::case_count(400);
    let pool = pool();
    let mut model = Model::default();
    pool.create_volume("v0", 600 * BLOCK).unwrap();
    model.volumes.insert(
        "v0".to_string(),
        ModelVolume {
            size_blocks: 600,
            mappings: BTreeMap::new(),
            snapshotted_time: 0,
        },
    );
    let mut next_name = 1;
    let block = vec![0xa5u8; BLOCK as usize];
    for step in 0..steps {
        let names: Vec<String> = model.volumes.keys().cloned().collect();
        let name = names[rng.gen_range(0..names.len())].clone();
        let size = model.volumes[&name].size_blocks;
        match rng.gen_range(0..100) {
            0..=59 => {
                let volume = pool.volume(&name).unwrap();
                let first = rng.gen_range(0..size);
                for k in first..(first + rng.gen_range(1..40)).min(size) {
                    volume.write(k * BLOCK, &block, false).unwrap();
                    model.write(&name, k);
                }
            }
            60..=74 => {
                let volume = pool.volume(&name).unwrap();
                let first = rng.gen_range(0..size);
                let count = rng.gen_range(1..=(size - first).min(60));
                volume.discard(first * BLOCK, count * BLOCK).unwrap();
                let mappings = &mut model.volumes.get_mut(&name).unwrap().mappings;
                for k in first..first + count {
                    mappings.remove(&k);
                }
            }
            75..=84 if names.len() < 8 => {
                let snap = format!("v{next_name}");
                next_name += 1;
                pool.snapshot(&name, &snap, false).unwrap();
                model.snapshot(&name, &snap);
            }
            85..=89 => {
                let new_size = rng.gen_range(1..=800u64);
                pool.resize_volume(&name, new_size * BLOCK, thin_pool::Shrink::DropData)
                    .unwrap();
                let volume = model.volumes.get_mut(&name).unwrap();
                volume.size_blocks = new_size;
                volume.mappings.retain(|&k, _| k < new_size);
            }
            90..=91 if names.len() > 2 => {
                pool.delete_volume(&name).unwrap();
                model.volumes.remove(&name);
            }
            92..=93 => pool.commit().unwrap(),
            _ => {}
        }
        let names: Vec<String> = model.volumes.keys().cloned().collect();
        let base = &names[rng.gen_range(0..names.len())];
        let target = &names[rng.gen_range(0..names.len())];
        let diff = pool.diff(base, target, None).unwrap();
        assert_eq!(diff.block_size_bytes, BLOCK);
        assert_eq!(diff.base_size_blocks, model.volumes[base].size_blocks);
        assert_eq!(diff.target_size_blocks, model.volumes[target].size_blocks);
        assert_eq!(
            diff.ranges,
            model.diff(base, target, None),
            "step {step}: {base} vs {target}"
        );
        let start = rng.gen_range(0..900);
        let range = start..start + rng.gen_range(0..300);
        let part = pool
            .diff(
                base,
                target,
                Some(VirtualBlock::new(range.start)..VirtualBlock::new(range.end)),
            )
            .unwrap();
        assert_eq!(
            part.ranges,
            model.diff(base, target, Some(range.clone())),
            "step {step}: {base} vs {target} over {range:?}"
        );
    }
    pool.verify_index().unwrap();
}

/// `delta` lists `same` ranges as well, over the whole trees, by thin id.
#[test]
fn delta_lists_same_ranges_too() {
    let pool = pool();
    pool.create_volume("a", 100 * BLOCK).unwrap();
    let block = vec![1u8; BLOCK as usize];
    let a = pool.volume("a").unwrap();
    for k in 0..10 {
        a.write(k * BLOCK, &block, false).unwrap();
    }
    drop(a);
    pool.snapshot("a", "b", false).unwrap();
    let b = pool.volume("b").unwrap();
    b.write(3 * BLOCK, &block, false).unwrap();
    b.write(20 * BLOCK, &block, false).unwrap();
    b.discard(8 * BLOCK, BLOCK).unwrap();
    let delta = pool.delta("a", "b").unwrap();
    assert_eq!((delta.base_id.get(), delta.target_id.get()), (0, 1));
    assert_eq!(delta.header.time, 1);
    assert_eq!(delta.header.data_block_size_sectors, 128);
    let listed: Vec<(u64, u64, DeltaKind)> = delta
        .ranges
        .iter()
        .map(|r| (r.begin, r.length, r.kind))
        .collect();
    assert_eq!(
        listed,
        vec![
            (0, 3, DeltaKind::Same),
            (3, 1, DeltaKind::Different),
            (4, 4, DeltaKind::Same),
            (8, 1, DeltaKind::LeftOnly),
            (9, 1, DeltaKind::Same),
            (20, 1, DeltaKind::RightOnly),
        ]
    );
    assert!(matches!(
        pool.diff("a", "nope", None),
        Err(thin_pool::Error::NoSuchVolume(_))
    ));
}

/// A diff taken while another thread writes lists every write that completed before it was
/// called, and nothing that was never written; writes go on meanwhile (no deadlock between
/// the diff's commits and provisioning).
#[test]
fn diff_sees_every_completed_write_while_writes_go_on() {
    use rand::seq::SliceRandom;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let (_report, mut rng) = testkit::seed::seeded_rng();
    let pool = pool();
    let blocks = 1024u64;
    pool.create_volume("a", blocks * BLOCK).unwrap();
    let a = pool.volume("a").unwrap();
    a.write_zeroes(0, blocks * BLOCK, false, false).unwrap();
    drop(a);
    pool.snapshot("a", "b", false).unwrap();
    let mut order: Vec<u64> = (0..blocks).collect();
    order.shuffle(&mut rng);
    let order = Arc::new(order[..600].to_vec());
    let done = Arc::new(AtomicUsize::new(0));
    let writer = {
        let (pool, order, done) = (pool.clone(), order.clone(), done.clone());
        std::thread::spawn(move || {
            let b = pool.volume("b").unwrap();
            let data = vec![9u8; 4096];
            for &block in order.iter() {
                b.write(block * BLOCK, &data, false).unwrap();
                done.fetch_add(1, Ordering::Release);
            }
        })
    };
    let written: std::collections::BTreeSet<u64> = order.iter().copied().collect();
    loop {
        let completed = done.load(Ordering::Acquire);
        let diff = pool.diff("a", "b", None).unwrap();
        let listed: std::collections::BTreeSet<u64> = diff
            .ranges
            .iter()
            .inspect(|r| assert_eq!(r.kind, DiffKind::Changed, "{r:?}"))
            .flat_map(|r| r.begin.get()..r.begin.get() + r.length)
            .collect();
        for block in &order[..completed] {
            assert!(listed.contains(block), "block {block} written, not listed");
        }
        assert!(
            listed.is_subset(&written),
            "a block listed that was never written"
        );
        if completed == order.len() {
            break;
        }
    }
    writer.join().unwrap();
}
