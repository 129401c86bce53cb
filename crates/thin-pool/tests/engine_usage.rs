//! Goal: `Pool::usage` (per-volume mapped, exclusive and shared bytes, read without the
//! metadata lock) never fails nor reports impossible figures while writers provision and
//! break sharing and commits run back to back, and once writes stop it equals a model
//! computed from the committed trees by a plain walk of every volume.
//! Method: writer threads on an origin and two snapshots, a thread committing in a loop,
//! and the test thread calling `usage` meanwhile; then close, reopen the metadata and
//! count each data block's mappings volume by volume.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use thin_pool::testing::MemoryParts;
use thin_pool::{PoolMetadata, PoolOptions, VolumeId};

const BLOCK: u64 = 65536;
const VOLUME_BLOCKS: u64 = 64;

#[test]
fn usage_during_writes_and_commits_is_consistent_and_exact_after() {
    let parts = MemoryParts::new(2048, 512 * BLOCK);
    let options = PoolOptions {
        commit_interval: None,
        ..PoolOptions::default()
    };
    let pool = parts.format(BLOCK, options);
    pool.create_volume("origin", VOLUME_BLOCKS * BLOCK).unwrap();
    let origin = pool.volume("origin").unwrap();
    for block in 0..VOLUME_BLOCKS / 2 {
        origin.write(block * BLOCK, &[1; 4096], false).unwrap();
    }
    origin.flush().unwrap();
    drop(origin);
    pool.snapshot("origin", "a", false).unwrap();
    pool.snapshot("origin", "b", false).unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for (n, name) in ["origin", "a", "b"].into_iter().enumerate() {
        let volume = pool.volume(name).unwrap();
        let stop = stop.clone();
        threads.push(std::thread::spawn(move || {
            let mut block = n as u64;
            while !stop.load(Ordering::Relaxed) {
                // The first 16 blocks stay shared by all three.
                let target = 16 + block % (VOLUME_BLOCKS - 16);
                volume
                    .write(target * BLOCK, &[n as u8 + 2; 4096], false)
                    .unwrap();
                block += 7;
            }
        }));
    }
    {
        let pool = pool.clone();
        let stop = stop.clone();
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                pool.commit().unwrap();
            }
        }));
    }
    for _ in 0..3000 {
        let spaces = pool.usage().unwrap();
        assert_eq!(spaces.len(), 3);
        for space in &spaces {
            assert_eq!(
                space.exclusive_bytes + space.shared_bytes,
                space.mapped_bytes,
                "{space:?}"
            );
            assert!(space.mapped_bytes <= VOLUME_BLOCKS * BLOCK, "{space:?}");
        }
    }
    stop.store(true, Ordering::Relaxed);
    for thread in threads {
        thread.join().unwrap();
    }
    pool.commit().unwrap();
    let spaces = pool.usage().unwrap();
    pool.close().unwrap();
    drop(pool);

    // The model: every volume's mappings from the reopened metadata.
    let md = PoolMetadata::open(parts.metadata).unwrap();
    let mut mappings: BTreeMap<VolumeId, Vec<u64>> = BTreeMap::new();
    let mut references: HashMap<u64, u64> = HashMap::new();
    for id in md.volumes() {
        let mut blocks = Vec::new();
        md.walk_volume(id, &mut |_, data_block, _| {
            blocks.push(data_block.get());
            *references.entry(data_block.get()).or_default() += 1;
            Ok(())
        })
        .unwrap();
        mappings.insert(id, blocks);
    }
    let mut some_shared = false;
    for space in &spaces {
        let blocks = &mappings[&space.id];
        let exclusive = blocks.iter().filter(|b| references[b] == 1).count() as u64;
        assert_eq!(space.mapped_bytes, blocks.len() as u64 * BLOCK, "{space:?}");
        assert_eq!(space.exclusive_bytes, exclusive * BLOCK, "{space:?}");
        some_shared |= space.shared_bytes > 0;
    }
    assert!(some_shared, "the workload left sharing: {spaces:?}");
}
