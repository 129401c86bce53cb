//! Model-based tests: the btree against `BTreeMap`, across commits and reopens, with shared
//! trees and reference counting checked down to the last block.

use super::*;
use crate::block::zeroed_block;
use crate::block_manager::BlockManager;
use crate::io::MemoryDevice;
use crate::space_map::{DataSpaceMap, SpaceMapRoot};
use crate::transaction::TransactionManager;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;

/// A counter that references data blocks (like a mapping leaf).
struct DataRefs<'a>(&'a mut DataSpaceMap);

impl RefCounter<u64> for DataRefs<'_> {
    fn inc(&mut self, _: &mut dyn CopyOnWrite, value: &u64) -> Result<()> {
        self.0.inc(*value)
    }
    fn dec(&mut self, _: &mut dyn CopyOnWrite, value: &u64) -> Result<()> {
        self.0.dec(*value).map(|_| ())
    }
}

/// A tiny pool for tests: superblock holds two tree roots and both space-map roots.
struct Harness {
    device: Arc<MemoryDevice>,
    tm: TransactionManager,
    data: DataSpaceMap,
    roots: [MetadataBlock; 2],
}

const DATA_BLOCKS: u64 = 40_000;

impl Harness {
    fn new(metadata_blocks: u64) -> Harness {
        let device = Arc::new(MemoryDevice::new(metadata_blocks));
        let bm = Arc::new(BlockManager::new(device.clone(), 256));
        let mut tm = TransactionManager::format(bm, metadata_blocks).unwrap();
        let data = DataSpaceMap::format(&mut tm, DATA_BLOCKS).unwrap();
        let a = create_empty::<u64>(&mut tm).unwrap();
        let b = create_empty::<u64>(&mut tm).unwrap();
        let mut h = Harness {
            device,
            tm,
            data,
            roots: [a, b],
        };
        h.commit();
        h
    }

    fn commit(&mut self) {
        let data_root = self.data.commit(&mut self.tm).unwrap();
        let meta_root = self.tm.commit_space_map().unwrap();
        let mut sb = zeroed_block();
        sb[16..24].copy_from_slice(&self.roots[0].get().to_le_bytes());
        sb[24..32].copy_from_slice(&self.roots[1].get().to_le_bytes());
        data_root.encode(&mut sb[64..96]);
        meta_root.encode(&mut sb[192..224]);
        self.tm.commit(sb).unwrap();
    }

    fn reopen(&mut self) {
        let bm = Arc::new(BlockManager::new(self.device.clone(), 256));
        let sb = bm
            .read(MetadataBlock::new(0), BlockKind::Superblock)
            .unwrap();
        let roots = [
            MetadataBlock::new(u64::from_le_bytes(sb[16..24].try_into().unwrap())),
            MetadataBlock::new(u64::from_le_bytes(sb[24..32].try_into().unwrap())),
        ];
        let data_root = SpaceMapRoot::decode(&sb[64..96]);
        let meta_root = SpaceMapRoot::decode(&sb[192..224]);
        self.tm = TransactionManager::open(bm.clone(), &meta_root).unwrap();
        self.data = DataSpaceMap::open(&*bm, &data_root).unwrap();
        self.roots = roots;
    }

    fn insert(&mut self, tree: usize, key: u64, value: u64) -> Option<u64> {
        let (root, old) = insert(
            &mut self.tm,
            &mut DataRefs(&mut self.data),
            self.roots[tree],
            key,
            &value,
        )
        .unwrap();
        self.roots[tree] = root;
        old
    }

    fn remove(&mut self, tree: usize, key: u64) -> Option<u64> {
        let (root, old) = remove::<u64, _>(
            &mut self.tm,
            &mut DataRefs(&mut self.data),
            self.roots[tree],
            key,
        )
        .unwrap();
        self.roots[tree] = root;
        old
    }

    fn contents(&self, tree: usize) -> BTreeMap<u64, u64> {
        let mut out = BTreeMap::new();
        walk::<u64, _>(&self.tm, self.roots[tree], &mut |k, v| {
            out.insert(k, v);
            Ok(())
        })
        .unwrap();
        out
    }

    /// Recount every reference from scratch and compare with both space maps.
    fn verify_counts(&self) {
        let meta_blocks = self.tm.space_map().block_count();
        let mut meta = vec![0u32; meta_blocks as usize];
        let mut data = vec![0u32; DATA_BLOCKS as usize];
        meta[0] += 1;
        let mut seen_leaves = std::collections::HashSet::new();
        for &root in &self.roots {
            count_tree(&self.tm, root, &mut meta, &mut data, &mut seen_leaves);
        }
        // Space-map structures. The data map's trees and bitmaps were written at the last
        // commit; compare only right after a commit.
        let sb = self
            .tm
            .read(MetadataBlock::new(0), BlockKind::Superblock)
            .unwrap();
        let data_root = SpaceMapRoot::decode(&sb[64..96]);
        let meta_root = SpaceMapRoot::decode(&sb[192..224]);
        let mut nodes = vec![];
        check::<crate::space_map::IndexEntry, _>(
            &self.tm,
            MetadataBlock::new(data_root.bitmap_root),
            CheckOptions::default(),
            &mut |b| nodes.push(b),
            &mut |_, e| {
                meta[e.blocknr as usize] += 1;
                Ok(())
            },
        )
        .unwrap();
        check::<u32, _>(
            &self.tm,
            MetadataBlock::new(data_root.ref_count_root),
            CheckOptions::default(),
            &mut |b| nodes.push(b),
            &mut |_, _| Ok(()),
        )
        .unwrap();
        check::<u32, _>(
            &self.tm,
            MetadataBlock::new(meta_root.ref_count_root),
            CheckOptions::default(),
            &mut |b| nodes.push(b),
            &mut |_, _| Ok(()),
        )
        .unwrap();
        for b in nodes {
            meta[b.get() as usize] += 1;
        }
        meta[meta_root.bitmap_root as usize] += 1;
        let index = self
            .tm
            .read(MetadataBlock::new(meta_root.bitmap_root), BlockKind::Index)
            .unwrap();
        for entry in crate::space_map::disk::decode_index_block(&index)
            .iter()
            .take(self.tm.space_map().bitmap_count())
        {
            meta[entry.blocknr as usize] += 1;
        }
        for (b, &expected) in meta.iter().enumerate() {
            assert_eq!(
                self.tm.count(MetadataBlock::new(b as u64)),
                expected,
                "metadata block {b}"
            );
        }
        for (b, &expected) in data.iter().enumerate() {
            assert_eq!(self.data.count(b as u64), expected, "data block {b}");
        }
        self.tm.space_map().verify();
        self.data.core().verify();
    }
}

fn count_tree(
    tm: &TransactionManager,
    block: MetadataBlock,
    meta: &mut [u32],
    data: &mut [u32],
    seen: &mut std::collections::HashSet<MetadataBlock>,
) {
    meta[block.get() as usize] += 1;
    if !seen.insert(block) {
        return; // shared node: its children were counted through its first parent
    }
    let bytes = tm.read(block, BlockKind::Node).unwrap();
    let node = Node::parse(block, &bytes, 8).unwrap();
    for i in 0..node.len() {
        if node.is_leaf() {
            data[u64::unpack(node.value_bytes(i)) as usize] += 1;
        } else {
            count_tree(tm, node.child(i), meta, data, seen);
        }
    }
}

fn seed() -> u64 {
    std::env::var("THINPOOL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random)
}

struct SeedReport(u64);
impl Drop for SeedReport {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("seed = {} (rerun with THINPOOL_SEED={})", self.0, self.0);
        }
    }
}

fn cases(default: usize) -> usize {
    std::env::var("THINPOOL_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

#[test]
fn btree_matches_model_across_commits_and_reopens() {
    let seed = seed();
    let _report = SeedReport(seed);
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut h = Harness::new(4096);
    let mut model = BTreeMap::new();
    let operations = cases(6000);
    let key_space = if rng.gen_bool(0.5) { 2_000 } else { 100_000 };
    for step in 0..operations {
        let key = rng.gen_range(0..key_space);
        match rng.gen_range(0..10) {
            0..=5 => {
                let value = h.data.alloc().unwrap();
                let old = h.insert(0, key, value);
                assert_eq!(old, model.insert(key, value), "insert {key} at step {step}");
                // The tree took its own reference via the counter only on copy; the alloc's
                // reference is the mapping's.
            }
            6..=8 => {
                assert_eq!(
                    h.remove(0, key),
                    model.remove(&key),
                    "remove {key} at step {step}"
                );
            }
            _ => {
                assert_eq!(
                    lookup::<u64, _>(&h.tm, h.roots[0], key).unwrap(),
                    model.get(&key).copied()
                );
                let ge = lookup_ge::<u64, _>(&h.tm, h.roots[0], key).unwrap();
                assert_eq!(ge, model.range(key..).next().map(|(k, v)| (*k, *v)));
            }
        }
        if step % 500 == 499 {
            h.commit();
            assert_eq!(h.contents(0), model);
            h.verify_counts();
            check::<u64, _>(
                &h.tm,
                h.roots[0],
                CheckOptions::default(),
                &mut |_| {},
                &mut |_, _| Ok(()),
            )
            .unwrap();
            if rng.gen_bool(0.3) {
                h.reopen();
                assert_eq!(h.contents(0), model);
            }
        }
    }
    // Empty the tree: everything goes back.
    let keys: Vec<u64> = model.keys().copied().collect();
    for key in keys {
        h.remove(0, key);
    }
    h.commit();
    h.verify_counts();
    assert_eq!(
        h.data.core().allocated_count(),
        0,
        "every data reference released"
    );
}

#[test]
fn shared_tree_changes_one_side_only_and_leaks_nothing() {
    let seed = seed();
    let _report = SeedReport(seed);
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut h = Harness::new(4096);
    let baseline_meta = h.tm.space_map().allocated_count();
    let mut model = BTreeMap::new();
    for _ in 0..5000 {
        let key = rng.gen_range(0..50_000);
        let value = h.data.alloc().unwrap();
        h.insert(0, key, value);
        if let Some(old) = model.insert(key, value) {
            let _ = old;
        }
    }
    h.commit();
    // Clone tree 0 into tree 1 (a snapshot): share the root, drop tree 1's old empty root.
    let old_root = h.roots[1];
    delete_tree::<u64, _>(&mut h.tm, &mut DataRefs(&mut h.data), old_root).unwrap();
    h.tm.inc(h.roots[0]).unwrap();
    h.roots[1] = h.roots[0];
    h.commit();
    h.verify_counts();
    let mut model1 = model.clone();
    for step in 0..3000 {
        let key = rng.gen_range(0..50_000);
        let tree = rng.gen_range(0..2);
        let m = if tree == 0 { &mut model } else { &mut model1 };
        if rng.gen_bool(0.6) {
            let value = h.data.alloc().unwrap();
            m.insert(key, value);
            h.insert(tree, key, value);
        } else {
            assert_eq!(h.remove(tree, key), m.remove(&key), "step {step}");
        }
        if step % 1000 == 999 {
            h.commit();
            h.verify_counts();
            assert_eq!(h.contents(0), model);
            assert_eq!(h.contents(1), model1);
        }
    }
    h.reopen();
    assert_eq!(h.contents(0), model);
    assert_eq!(h.contents(1), model1);
    for tree in 0..2 {
        let root = h.roots[tree];
        delete_tree::<u64, _>(&mut h.tm, &mut DataRefs(&mut h.data), root).unwrap();
        h.roots[tree] = create_empty::<u64>(&mut h.tm).unwrap();
    }
    h.commit();
    h.verify_counts();
    assert_eq!(h.data.core().allocated_count(), 0, "no data block leaked");
    // Metadata: back to the space maps' own blocks plus two empty roots.
    let now = h.tm.space_map().allocated_count();
    assert!(
        now <= baseline_meta + 4,
        "metadata in use grew from {baseline_meta} to {now}"
    );
}

#[test]
fn sequential_inserts_fill_nodes_and_check() {
    let mut h = Harness::new(4096);
    for key in 0..20_000 {
        let value = h.data.alloc().unwrap();
        h.insert(0, key, value);
    }
    h.commit();
    let stats = check::<u64, _>(
        &h.tm,
        h.roots[0],
        CheckOptions::default(),
        &mut |_| {},
        &mut |_, _| Ok(()),
    )
    .unwrap();
    assert_eq!(stats.entry_count, 20_000);
    assert!(stats.depth >= 2);
    for key in (0..20_000).rev().step_by(3) {
        h.remove(0, key);
    }
    h.commit();
    check::<u64, _>(
        &h.tm,
        h.roots[0],
        CheckOptions::default(),
        &mut |_| {},
        &mut |_, _| Ok(()),
    )
    .unwrap();
    h.verify_counts();
    let (root, removed) = remove_range::<u64, _>(
        &mut h.tm,
        &mut DataRefs(&mut h.data),
        h.roots[0],
        100,
        15_000,
    )
    .unwrap();
    h.roots[0] = root;
    assert!(removed > 9000);
    h.commit();
    h.verify_counts();
    assert!(h.contents(0).keys().all(|&k| !(100..15_000).contains(&k)));
}

#[test]
fn sharing_a_root_of_the_current_transaction_still_copies_on_write() {
    let mut h = Harness::new(1024);
    for key in 0..10 {
        let value = h.data.alloc().unwrap();
        h.insert(0, key, value);
    }
    // Not committed: the root is a block of this transaction. Share it anyway.
    let old_root = h.roots[1];
    delete_tree::<u64, _>(&mut h.tm, &mut DataRefs(&mut h.data), old_root).unwrap();
    h.tm.inc(h.roots[0]).unwrap();
    h.roots[1] = h.roots[0];
    let before = h.contents(1);
    let value = h.data.alloc().unwrap();
    h.insert(0, 100, value);
    h.remove(0, 3);
    assert_eq!(
        h.contents(1),
        before,
        "the other owner of a shared root is unchanged"
    );
    assert_ne!(h.roots[0], h.roots[1]);
    h.commit();
    h.verify_counts();
}
