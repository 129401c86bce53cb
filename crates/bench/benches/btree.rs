//! Btree throughput on a file-backed metadata device: random inserts with periodic commits,
//! then random lookups after a reopen (fresh block-manager cache; the OS page cache stays
//! warm, so "cold-ish").
//!
//! Run: `cargo bench -p persistent-data --bench btree` (release profile). Environment:
//! `THINPOOL_BENCH_INSERTS` (default 1 000 000), `THINPOOL_BENCH_DIR` (default `/dev/shm`
//! if present, else the temporary directory), `THINPOOL_SEED`.

use persistent_data::block::zeroed_block;
use persistent_data::block_manager::{BlockManager, CACHE_BLOCKS_DEFAULT};
use persistent_data::btree::{self, CheckOptions, NoRefs};
use persistent_data::checksum::BlockKind;
use persistent_data::space_map::SpaceMapRoot;
use persistent_data::{BlockDevice, FileDevice, MetadataBlock, TransactionManager};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

const METADATA_BLOCKS: u64 = 262_144; // 1 GiB, sparse
const COMMIT_EVERY: usize = 10_000;
const ROOT_AT: usize = 320;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|s| s.trim().parse().ok())
}

fn commit(tm: &mut TransactionManager, root: MetadataBlock) {
    let meta_root = tm.commit_space_map().expect("commit space map");
    let mut sb = zeroed_block();
    meta_root.encode(&mut sb[192..224]);
    sb[ROOT_AT..ROOT_AT + 8].copy_from_slice(&root.get().to_le_bytes());
    tm.commit(sb).expect("commit");
}

fn per_op(total: Duration, ops: usize) -> f64 {
    total.as_nanos() as f64 / ops as f64
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` would pass test filters. Run
    // the measurement only when benchmarking.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let inserts = env_u64("THINPOOL_BENCH_INSERTS").unwrap_or(1_000_000) as usize;
    let seed = env_u64("THINPOOL_SEED").unwrap_or(42);
    let dir = std::env::var_os("THINPOOL_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let shm = PathBuf::from("/dev/shm");
            if shm.is_dir() {
                shm
            } else {
                std::env::temp_dir()
            }
        });
    let path = dir.join(format!("thinpool-btree-bench-{}.meta", std::process::id()));
    let mut rng = SmallRng::seed_from_u64(seed);
    let keys: Vec<u64> = (0..inserts).map(|_| rng.gen()).collect();

    let device: Arc<dyn BlockDevice> =
        Arc::new(FileDevice::create(&path, METADATA_BLOCKS).expect("create metadata file"));
    let bm = Arc::new(BlockManager::new(device.clone(), CACHE_BLOCKS_DEFAULT));
    let mut tm = TransactionManager::format(bm, METADATA_BLOCKS).expect("format");
    let mut root = btree::create_empty::<u64>(&mut tm).expect("empty tree");
    commit(&mut tm, root);

    let mut commit_time = Duration::ZERO;
    let start = Instant::now();
    for (i, &key) in keys.iter().enumerate() {
        root = btree::insert(&mut tm, &mut NoRefs, root, key, &(i as u64))
            .expect("insert")
            .0;
        if (i + 1) % COMMIT_EVERY == 0 {
            let commit_start = Instant::now();
            commit(&mut tm, root);
            commit_time += commit_start.elapsed();
        }
    }
    let commit_start = Instant::now();
    commit(&mut tm, root);
    commit_time += commit_start.elapsed();
    let insert_time = start.elapsed();
    let used_blocks = tm.space_map().allocated_count();
    drop(tm);

    // Reopen with a fresh cache.
    let bm = Arc::new(BlockManager::new(device, CACHE_BLOCKS_DEFAULT));
    let sb = bm
        .read(MetadataBlock::SUPERBLOCK, BlockKind::Superblock)
        .expect("superblock");
    let meta_root = SpaceMapRoot::decode(&sb[192..224]);
    let root = MetadataBlock::new(u64::from_le_bytes(
        sb[ROOT_AT..ROOT_AT + 8].try_into().unwrap(),
    ));
    let open_start = Instant::now();
    let tm = TransactionManager::open(bm.clone(), &meta_root).expect("open");
    let open_time = open_start.elapsed();
    let mut order: Vec<usize> = (0..inserts).collect();
    order.shuffle(&mut rng);
    let start = Instant::now();
    let mut found = 0usize;
    for &i in &order {
        if btree::lookup::<u64, _>(&tm, root, keys[i])
            .expect("lookup")
            .is_some()
        {
            found += 1;
        }
    }
    let lookup_time = start.elapsed();
    let distinct = {
        let mut sorted = keys.clone();
        sorted.sort_unstable();
        sorted.dedup();
        sorted.len()
    };
    assert_eq!(found, inserts, "every inserted key found");
    let stats = btree::check::<u64, _>(
        &*bm,
        root,
        CheckOptions::default(),
        &mut |_| {},
        &mut |_, _| Ok(()),
    )
    .expect("tree checks");
    assert_eq!(stats.entry_count, distinct as u64);
    let _ = std::fs::remove_file(&path);

    println!(
        "btree bench: {inserts} random u64 keys, file {}",
        path.display()
    );
    println!(
        "  insert: {:>8.3} s total, {:>7.0} ns/insert (commits every {COMMIT_EVERY}: {:.3} s of it)",
        insert_time.as_secs_f64(),
        per_op(insert_time, inserts),
        commit_time.as_secs_f64()
    );
    println!(
        "  reopen: {:>8.3} ms (metadata space map load)",
        open_time.as_secs_f64() * 1e3
    );
    println!(
        "  lookup: {:>8.3} s total, {:>7.0} ns/lookup (fresh block cache, shuffled order)",
        lookup_time.as_secs_f64(),
        per_op(lookup_time, inserts)
    );
    println!(
        "  tree: {} entries, {} nodes, depth {}; {used_blocks} metadata blocks in use",
        stats.entry_count, stats.node_count, stats.depth
    );
}
