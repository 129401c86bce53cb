//! Model-based tests of the btree and the space maps, longer than the unit tests.
//!
//! Goal: every tree operation, on every value size dm-thin uses, behaves like a `BTreeMap`
//! across commits and reopens; shared (cloned) trees stay independent under copy-on-write
//! and release every block when deleted; both space-map implementations behave like a vector
//! of counts, including the allocation rule (a block freed in a transaction is not reused
//! before the commit).
//!
//! Method: seeded random operations (`THINPOOL_SEED`, scaled by `THINPOOL_CASES`) run
//! against the real structures and a model side by side. After every commit: compare whole
//! contents, run `btree::check` on every tree, recount every metadata and data reference and
//! compare with both space maps; sometimes reopen from the test superblock and compare again.

mod common;

use common::{Details, Pool, TreeKind};
use persistent_data::btree::{self, NoRefs, Value};
use persistent_data::space_map::core::{CoreSpaceMap, ENTRIES_PER_BITMAP};
use persistent_data::space_map::IndexEntry;
use persistent_data::{BlockDevice, Error, MemoryDevice, MetadataBlock};
use rand::rngs::StdRng;
use rand::Rng;
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

/// A value type the model test can make up at random.
trait Random: Value + PartialEq {
    fn random(rng: &mut StdRng) -> Self;
}

impl Random for u32 {
    fn random(rng: &mut StdRng) -> u32 {
        rng.gen()
    }
}

impl Random for u64 {
    fn random(rng: &mut StdRng) -> u64 {
        rng.gen()
    }
}

impl Random for IndexEntry {
    fn random(rng: &mut StdRng) -> IndexEntry {
        IndexEntry {
            blocknr: rng.gen(),
            free_count: rng.gen(),
            none_free_before: rng.gen(),
        }
    }
}

impl Random for Details {
    fn random(rng: &mut StdRng) -> Details {
        Details {
            mapped_blocks: rng.gen(),
            transaction_id: rng.gen(),
            creation_time: rng.gen(),
            snapshotted_time: rng.gen(),
        }
    }
}

fn key_in(rng: &mut StdRng, key_space: u64) -> u64 {
    // Mostly inside the key space (dense: overwrites and removals hit), sometimes anywhere.
    if rng.gen_bool(0.02) {
        rng.gen()
    } else {
        rng.gen_range(0..key_space)
    }
}

/// One random operation on plain tree `tree` holding `V`s, mirrored in `model`.
fn plain_step<V: Random>(
    pool: &mut Pool,
    tree: usize,
    model: &mut BTreeMap<u64, V>,
    key_space: u64,
    rng: &mut StdRng,
    step: usize,
) {
    let key = key_in(rng, key_space);
    match rng.gen_range(0..100) {
        0..=54 => {
            let value = V::random(rng);
            let old = pool.insert_plain(tree, key, &value).unwrap();
            assert_eq!(
                old,
                model.insert(key, value),
                "step {step}: insert {key} into tree {tree}"
            );
        }
        55..=79 => {
            let old = pool.remove_plain::<V>(tree, key).unwrap();
            assert_eq!(
                old,
                model.remove(&key),
                "step {step}: remove {key} from tree {tree}"
            );
        }
        80..=82 => {
            let end = key.saturating_add(rng.gen_range(1..400));
            let (root, removed) =
                btree::remove_range::<V, _>(&mut pool.tm, &mut NoRefs, pool.roots[tree], key, end)
                    .unwrap();
            pool.roots[tree] = root;
            let keys: Vec<u64> = model.range(key..end).map(|(k, _)| *k).collect();
            for k in &keys {
                model.remove(k);
            }
            assert_eq!(
                removed,
                keys.len() as u64,
                "step {step}: remove_range {key}..{end}"
            );
        }
        83..=91 => {
            let found = btree::lookup::<V, _>(&pool.tm, pool.roots[tree], key).unwrap();
            assert_eq!(
                found,
                model.get(&key).copied(),
                "step {step}: lookup {key} in tree {tree}"
            );
        }
        _ => {
            let found = btree::lookup_ge::<V, _>(&pool.tm, pool.roots[tree], key).unwrap();
            let expected = model.range(key..).next().map(|(k, v)| (*k, *v));
            assert_eq!(
                found, expected,
                "step {step}: lookup_ge {key} in tree {tree}"
            );
        }
    }
}

/// One random operation on data tree `tree` (values are data blocks it owns).
fn data_step(
    pool: &mut Pool,
    tree: usize,
    model: &mut BTreeMap<u64, u64>,
    key_space: u64,
    rng: &mut StdRng,
    step: usize,
) {
    let key = key_in(rng, key_space);
    match rng.gen_range(0..100) {
        0..=54 => {
            let value = pool.data.alloc().unwrap();
            let old = pool.insert_data(tree, key, value).unwrap();
            assert_eq!(
                old,
                model.insert(key, value),
                "step {step}: insert {key} into tree {tree}"
            );
        }
        55..=79 => {
            let old = pool.remove_data(tree, key).unwrap();
            assert_eq!(
                old,
                model.remove(&key),
                "step {step}: remove {key} from tree {tree}"
            );
        }
        80..=82 => {
            let end = key.saturating_add(rng.gen_range(1..400));
            let removed = pool.remove_range_data(tree, key, end).unwrap();
            let keys: Vec<u64> = model.range(key..end).map(|(k, _)| *k).collect();
            for k in &keys {
                model.remove(k);
            }
            assert_eq!(
                removed,
                keys.len() as u64,
                "step {step}: remove_range {key}..{end}"
            );
        }
        83..=91 => {
            let found = btree::lookup::<u64, _>(&pool.tm, pool.roots[tree], key).unwrap();
            assert_eq!(found, model.get(&key).copied(), "step {step}: lookup {key}");
        }
        _ => {
            let found = btree::lookup_ge::<u64, _>(&pool.tm, pool.roots[tree], key).unwrap();
            let expected = model.range(key..).next().map(|(k, v)| (*k, *v));
            assert_eq!(found, expected, "step {step}: lookup_ge {key}");
        }
    }
}

fn assert_tree<V: Value + PartialEq>(
    pool: &Pool,
    tree: usize,
    model: &BTreeMap<u64, V>,
    when: &str,
) {
    let mut found = Vec::with_capacity(model.len());
    btree::walk::<V, _>(&pool.tm, pool.roots[tree], &mut |k, v| {
        found.push((k, v));
        Ok(())
    })
    .unwrap();
    let expected: Vec<(u64, V)> = model.iter().map(|(k, v)| (*k, *v)).collect();
    if found != expected {
        let first = found.iter().zip(&expected).position(|(a, b)| a != b);
        panic!(
            "{when}: tree {tree} has {} entries, model {}; first difference at index {first:?}",
            found.len(),
            expected.len()
        );
    }
}

struct Models {
    data: BTreeMap<u64, u64>,
    small: BTreeMap<u64, u32>,
    wide: BTreeMap<u64, u64>,
    index: BTreeMap<u64, IndexEntry>,
    details: BTreeMap<u64, Details>,
}

const KINDS: [TreeKind; 5] = [
    TreeKind::Data,
    TreeKind::Plain(4),
    TreeKind::Plain(8),
    TreeKind::Plain(16),
    TreeKind::Plain(24),
];

impl Models {
    fn assert_matches(&self, pool: &Pool, when: &str) {
        assert_tree(pool, 0, &self.data, when);
        assert_tree(pool, 1, &self.small, when);
        assert_tree(pool, 2, &self.wide, when);
        assert_tree(pool, 3, &self.index, when);
        assert_tree(pool, 4, &self.details, when);
    }
}

#[test]
fn every_value_size_matches_its_model_across_commits_and_reopens() {
    let (_report, mut rng) = common::seeded();
    let device = Arc::new(MemoryDevice::new(16_384));
    let mut pool = Pool::format(device, 200_000, &KINDS).unwrap();
    let mut models = Models {
        data: BTreeMap::new(),
        small: BTreeMap::new(),
        wide: BTreeMap::new(),
        index: BTreeMap::new(),
        details: BTreeMap::new(),
    };
    // Dense key spaces (many overwrites, deep removals) and sparse ones (many leaves).
    let key_spaces: Vec<u64> = (0..KINDS.len())
        .map(|_| if rng.gen_bool(0.5) { 3_000 } else { 1_000_000 })
        .collect();
    let steps = testkit::case_count(60_000) as usize;
    let commit_every = rng.gen_range(200..800);
    for step in 0..steps {
        let tree = rng.gen_range(0..KINDS.len());
        let space = key_spaces[tree];
        match tree {
            0 => data_step(&mut pool, 0, &mut models.data, space, &mut rng, step),
            1 => plain_step(&mut pool, 1, &mut models.small, space, &mut rng, step),
            2 => plain_step(&mut pool, 2, &mut models.wide, space, &mut rng, step),
            3 => plain_step(&mut pool, 3, &mut models.index, space, &mut rng, step),
            _ => plain_step(&mut pool, 4, &mut models.details, space, &mut rng, step),
        }
        if step % commit_every == commit_every - 1 {
            if rng.gen_bool(0.1) {
                // Abandon the transaction instead: the committed state comes back.
                pool.reopen().unwrap();
                continue_after_abort(&mut pool, &mut models);
                continue;
            }
            pool.commit().unwrap();
            models.assert_matches(&pool, &format!("after commit at step {step}"));
            pool.verify()
                .unwrap_or_else(|e| panic!("after commit at step {step}: {e}"));
            if rng.gen_bool(0.3) {
                pool.reopen().unwrap();
                models.assert_matches(&pool, &format!("after reopen at step {step}"));
                pool.verify()
                    .unwrap_or_else(|e| panic!("after reopen at step {step}: {e}"));
            }
        }
    }
    pool.commit().unwrap();
    pool.verify().unwrap();
    // Empty every tree key by key: every data block and every node but the roots go back.
    let data_keys: Vec<u64> = models.data.keys().copied().collect();
    for key in data_keys {
        pool.remove_data(0, key).unwrap();
    }
    for tree in 1..KINDS.len() {
        pool.release(tree).unwrap();
    }
    pool.commit().unwrap();
    pool.verify().unwrap();
    assert_eq!(
        pool.data.core().allocated_count(),
        0,
        "every data block released"
    );
}

/// After an abandoned transaction the models must go back to the committed contents: rebuild
/// them from the reopened pool (which `verify` then checks against the recount).
fn continue_after_abort(pool: &mut Pool, models: &mut Models) {
    pool.verify().unwrap();
    fn read<V: Value>(pool: &Pool, tree: usize) -> BTreeMap<u64, V> {
        let mut out = BTreeMap::new();
        btree::walk::<V, _>(&pool.tm, pool.roots[tree], &mut |k, v| {
            out.insert(k, v);
            Ok(())
        })
        .unwrap();
        out
    }
    models.data = read(pool, 0);
    models.small = read(pool, 1);
    models.wide = read(pool, 2);
    models.index = read(pool, 3);
    models.details = read(pool, 4);
}

#[test]
fn abandoned_transaction_leaves_committed_contents() {
    let (_report, mut rng) = common::seeded();
    let device = Arc::new(MemoryDevice::new(4096));
    let mut pool = Pool::format(device, 50_000, &[TreeKind::Data]).unwrap();
    let mut model = BTreeMap::new();
    for _ in 0..3000 {
        let key = rng.gen_range(0..100_000);
        let value = pool.data.alloc().unwrap();
        pool.insert_data(0, key, value).unwrap();
        model.insert(key, value);
    }
    pool.commit().unwrap();
    let committed = model.clone();
    for _ in 0..2000 {
        let key = rng.gen_range(0..100_000);
        if rng.gen_bool(0.5) {
            let value = pool.data.alloc().unwrap();
            pool.insert_data(0, key, value).unwrap();
        } else {
            pool.remove_data(0, key).unwrap();
        }
    }
    pool.reopen().unwrap();
    assert_tree(&pool, 0, &committed, "after abandoning a transaction");
    pool.verify().unwrap();
}

#[test]
fn cloned_trees_diverge_independently_and_release_every_block() {
    let (_report, mut rng) = common::seeded();
    let device = Arc::new(MemoryDevice::new(8192));
    // Trees 0..3: data trees (0 the origin, 1 and 2 its clones); 3..5: details trees.
    let kinds = [
        TreeKind::Data,
        TreeKind::Data,
        TreeKind::Data,
        TreeKind::Plain(24),
        TreeKind::Plain(24),
    ];
    let mut pool = Pool::format(device, 100_000, &kinds).unwrap();
    let baseline_meta = pool.tm.space_map().allocated_count();
    let mut data_models: Vec<BTreeMap<u64, u64>> = vec![BTreeMap::new(); 3];
    let mut detail_models: Vec<BTreeMap<u64, Details>> = vec![BTreeMap::new(); 2];
    let fill = testkit::case_count(6000) as usize;
    for step in 0..fill {
        data_step(&mut pool, 0, &mut data_models[0], 60_000, &mut rng, step);
        if step % 3 == 0 {
            plain_step(&mut pool, 3, &mut detail_models[0], 20_000, &mut rng, step);
        }
    }
    // Clone: 1 and 2 share 0's root (so its root has count 3: the metadata overflow tree),
    // 4 shares 3's. One clone is taken before the commit, one after.
    pool.share(0, 1).unwrap();
    pool.commit().unwrap();
    pool.share(0, 2).unwrap();
    pool.share(3, 4).unwrap();
    data_models[1] = data_models[0].clone();
    data_models[2] = data_models[0].clone();
    detail_models[1] = detail_models[0].clone();
    assert_eq!(pool.tm.count(pool.roots[0]), 3, "a root shared three ways");
    pool.commit().unwrap();
    pool.verify().unwrap();

    let steps = testkit::case_count(6000) as usize;
    for step in 0..steps {
        // Mostly change one side, so the other side's unchanged leaves stay shared.
        let tree = match rng.gen_range(0..10) {
            0..=5 => 1,
            6..=7 => 0,
            8 => 2,
            _ => 3 + rng.gen_range(0..2),
        };
        if tree < 3 {
            data_step(
                &mut pool,
                tree,
                &mut data_models[tree],
                60_000,
                &mut rng,
                step,
            );
        } else {
            plain_step(
                &mut pool,
                tree,
                &mut detail_models[tree - 3],
                20_000,
                &mut rng,
                step,
            );
        }
        if step % 1000 == 999 {
            pool.commit().unwrap();
            for (tree, model) in data_models.iter().enumerate() {
                assert_tree(&pool, tree, model, &format!("step {step}"));
            }
            for (i, model) in detail_models.iter().enumerate() {
                assert_tree(&pool, 3 + i, model, &format!("step {step}"));
            }
            pool.verify().unwrap_or_else(|e| panic!("step {step}: {e}"));
        }
    }
    pool.reopen().unwrap();
    for (tree, model) in data_models.iter().enumerate() {
        assert_tree(&pool, tree, model, "after reopen");
    }
    pool.verify().unwrap();
    // Release the trees one at a time; the others stay intact.
    for tree in [1, 4, 0, 2, 3] {
        pool.release(tree).unwrap();
        pool.commit().unwrap();
        pool.verify()
            .unwrap_or_else(|e| panic!("after releasing tree {tree}: {e}"));
        for (other, model) in data_models.iter_mut().enumerate() {
            if other == tree {
                model.clear();
            }
            assert_tree(&pool, other, model, &format!("after releasing tree {tree}"));
        }
    }
    assert_eq!(pool.data.core().allocated_count(), 0, "a data block leaked");
    assert_eq!(
        pool.tm.space_map().allocated_count(),
        baseline_meta,
        "metadata blocks in use after releasing everything (format used {baseline_meta})"
    );
}

/// The allocation rule checked on a bare space map: alloc returns a block of count 0 that
/// was not released in this transaction, and `None` only when no such block exists.
#[test]
fn core_space_map_matches_a_vector_of_counts() {
    let (_report, mut rng) = common::seeded();
    let mut size = rng.gen_range(1..3 * ENTRIES_PER_BITMAP);
    let mut sm = CoreSpaceMap::new(size);
    let mut model = vec![0u32; size as usize];
    let mut released = HashSet::new();
    let steps = testkit::case_count(400_000) as usize;
    // Work on a window of blocks so counts climb past 3 (the overflow) and back.
    let mut window = 0..size.min(600);
    for step in 0..steps {
        let block = rng.gen_range(window.clone());
        match rng.gen_range(0..100) {
            0..=34 => {
                sm.inc(block);
                model[block as usize] += 1;
            }
            35..=69 => {
                let result = sm.dec(block);
                if model[block as usize] == 0 {
                    assert_eq!(result, Err(block), "step {step}: dec of a free block");
                } else {
                    model[block as usize] -= 1;
                    assert_eq!(
                        result,
                        Ok(model[block as usize]),
                        "step {step}: dec {block}"
                    );
                    if model[block as usize] == 0 {
                        released.insert(block);
                    }
                }
            }
            70..=89 => match sm.alloc() {
                Some(b) => {
                    assert!(b < size, "step {step}: alloc {b} beyond {size}");
                    assert_eq!(model[b as usize], 0, "step {step}: alloc {b} is in use");
                    assert!(
                        !released.contains(&b),
                        "step {step}: alloc {b} was released in this transaction"
                    );
                    model[b as usize] = 1;
                }
                None => {
                    let free = (0..size).find(|b| model[*b as usize] == 0 && !released.contains(b));
                    assert_eq!(free, None, "step {step}: alloc found nothing");
                }
            },
            90..=97 => {
                let b = rng.gen_range(window.clone());
                assert_eq!(sm.count(b), model[b as usize], "step {step}: count {b}");
            }
            98 => {
                sm.end_transaction();
                released.clear();
            }
            _ => {
                if rng.gen_bool(0.2) && size < 4 * ENTRIES_PER_BITMAP {
                    size += rng.gen_range(1..ENTRIES_PER_BITMAP);
                    sm.extend(size);
                    model.resize(size as usize, 0);
                }
                let start = rng.gen_range(0..size);
                window = start..size.min(start + 600);
            }
        }
        if step % 20_000 == 0 {
            for (b, &count) in model.iter().enumerate() {
                assert_eq!(sm.count(b as u64), count, "step {step}: block {b}");
            }
            let allocated = model.iter().filter(|&&c| c > 0).count() as u64;
            assert_eq!(
                sm.allocated_count(),
                allocated,
                "step {step}: allocated count"
            );
            sm.verify();
        }
    }
    sm.verify();
}

/// The data space map against a vector of counts, with commits, reopens and growth.
#[test]
fn data_space_map_matches_a_vector_of_counts_across_commits_and_reopens() {
    let (_report, mut rng) = common::seeded();
    let device = Arc::new(MemoryDevice::new(4096));
    let mut size = ENTRIES_PER_BITMAP + rng.gen_range(1..ENTRIES_PER_BITMAP);
    let mut pool = Pool::format(device, size, &[]).unwrap();
    let mut model = vec![0u32; size as usize];
    let mut released = HashSet::new();
    let steps = testkit::case_count(60_000) as usize;
    let mut window = 0..600;
    for step in 0..steps {
        let block = rng.gen_range(window.clone());
        match rng.gen_range(0..100) {
            0..=34 => {
                pool.data.inc(block).unwrap();
                model[block as usize] += 1;
            }
            35..=64 => {
                let result = pool.data.dec(block);
                if model[block as usize] == 0 {
                    assert!(
                        matches!(result, Err(Error::Invalid(_))),
                        "step {step}: {result:?}"
                    );
                } else {
                    model[block as usize] -= 1;
                    assert_eq!(
                        result.unwrap(),
                        model[block as usize],
                        "step {step}: dec {block}"
                    );
                    if model[block as usize] == 0 {
                        released.insert(block);
                    }
                }
            }
            65..=89 => match pool.data.alloc() {
                Ok(b) => {
                    assert_eq!(model[b as usize], 0, "step {step}: alloc {b} is in use");
                    assert!(
                        !released.contains(&b),
                        "step {step}: alloc {b} was freed in this transaction"
                    );
                    model[b as usize] = 1;
                }
                Err(e) => {
                    assert!(
                        matches!(e, Error::OutOfDataSpace { .. }),
                        "step {step}: {e}"
                    );
                    let free = (0..size).find(|b| model[*b as usize] == 0 && !released.contains(b));
                    assert_eq!(free, None, "step {step}: alloc found nothing");
                }
            },
            90..=91 => {
                assert!(pool.data.inc(size).is_err(), "inc beyond the map");
                assert!(pool.data.dec(size + 7).is_err(), "dec beyond the map");
            }
            92..=96 => {
                let start = rng.gen_range(0..size);
                window = start..size.min(start + 600);
            }
            97 => {
                if size < 5 * ENTRIES_PER_BITMAP {
                    size += rng.gen_range(1..ENTRIES_PER_BITMAP);
                    pool.data.extend(size);
                    model.resize(size as usize, 0);
                }
            }
            _ => {
                pool.commit().unwrap();
                released.clear();
                if rng.gen_bool(0.5) {
                    pool.reopen().unwrap();
                }
                assert_eq!(pool.data.block_count(), size);
                for (b, &count) in model.iter().enumerate() {
                    assert_eq!(
                        pool.data.count(b as u64),
                        count,
                        "step {step}: data block {b}"
                    );
                }
                pool.data.core().verify();
                assert_metadata_counts(&pool);
            }
        }
    }
}

/// Recount the metadata references of a pool without trees (its data counts are the test's
/// own) and compare with the metadata space map.
fn assert_metadata_counts(pool: &Pool) {
    let bm = pool.tm.block_manager().clone();
    let sb = common::read_superblock(&bm).unwrap();
    let counts = common::recount(&*bm, &sb.meta_root, &sb.data_root, &[]).unwrap();
    let data = counts.data.clone();
    common::compare_counts(&counts, &|b| pool.tm.count(MetadataBlock::new(b)), &|b| {
        data[b as usize]
    })
    .unwrap();
}

/// The rule that makes a crash safe: a metadata block freed in a transaction (it is still
/// part of the committed state) is never handed out again before that transaction commits.
#[test]
fn metadata_block_freed_in_a_transaction_is_not_reused_before_commit() {
    let (_report, mut rng) = common::seeded();
    let device = Arc::new(MemoryDevice::new(600));
    let mut pool = Pool::format(device.clone(), 100_000, &[TreeKind::Data]).unwrap();
    for _ in 0..20_000 {
        let key = rng.gen_range(0..1_000_000);
        let value = pool.data.alloc().unwrap();
        pool.insert_data(0, key, value).unwrap();
    }
    pool.commit().unwrap();
    let committed: Vec<u64> = (0..device.block_count())
        .filter(|&b| pool.tm.count(MetadataBlock::new(b)) > 0)
        .collect();
    // Free the whole tree: its nodes drop to count 0 but are still in the committed state.
    pool.release(0).unwrap();
    let freed: HashSet<u64> = committed
        .iter()
        .copied()
        .filter(|&b| pool.tm.count(MetadataBlock::new(b)) == 0)
        .collect();
    assert!(
        freed.len() > 50,
        "releasing the tree freed only {} blocks",
        freed.len()
    );
    let mut handed_out = 0;
    loop {
        match pool.tm.new_block() {
            Ok(block) => {
                assert!(
                    !freed.contains(&block.get()),
                    "block {block} reused in the transaction that freed it"
                );
                handed_out += 1;
            }
            Err(Error::OutOfMetadataSpace { .. }) => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(handed_out > 0);
    // Abandon; commit the release instead, and the freed blocks are available again.
    pool.reopen().unwrap();
    pool.release(0).unwrap();
    pool.commit().unwrap();
    pool.verify().unwrap();
    let mut reused = 0;
    while let Ok(block) = pool.tm.new_block() {
        reused += usize::from(freed.contains(&block.get()));
    }
    assert!(
        reused >= freed.len() - 4,
        "only {reused} of {} freed blocks reusable after the commit",
        freed.len()
    );
}

/// The checker of these tests must itself catch a wrong count (else the tests above prove
/// nothing): a leaked metadata reference and a leaked data reference are both reported.
#[test]
fn recount_reports_leaked_references() {
    let device = Arc::new(MemoryDevice::new(1024));
    let mut pool = Pool::format(device, 1000, &[TreeKind::Data]).unwrap();
    for key in 0..600 {
        let value = pool.data.alloc().unwrap();
        pool.insert_data(0, key, value).unwrap();
    }
    pool.commit().unwrap();
    pool.verify().unwrap();
    pool.tm.inc(pool.roots[0]).unwrap();
    pool.commit().unwrap();
    let error = pool.verify().unwrap_err().to_string();
    assert!(
        error.contains(&format!("metadata block {}", pool.roots[0])),
        "{error}"
    );
    pool.tm.dec(pool.roots[0]).unwrap();
    pool.data.inc(5).unwrap();
    pool.commit().unwrap();
    let error = pool.verify().unwrap_err().to_string();
    assert!(
        error.contains("data block 5: space map 2, recount 1"),
        "{error}"
    );
}
