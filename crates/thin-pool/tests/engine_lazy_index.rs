//! Goal: a volume's index is built on demand. A snapshot, a revert and a rename leave it
//! unbuilt, and so does activation; the first open builds it from the volume's mapping tree
//! (the current transaction's), once even when several threads open the volume at the same
//! moment; every management operation is right on a volume that has none (delete, resize,
//! revert, rename, listing, usage). Method: write patterns through handles, keep a model of
//! each volume's bytes (a snapshot clones its origin's), check which indexes are built
//! (`Pool::index_built`) at each step, compare every volume with its model after each
//! operation and after reopening the pool on the same in-memory parts, and run our metadata
//! checker.

mod engine_kit;

use engine_kit::{assert_volumes_match, check_metadata, VolumeModel};
use std::collections::BTreeMap;
use std::sync::{Arc, Barrier};
use thin_pool::testing::{deterministic_options, MemoryParts};
use thin_pool::Pool;

const BLOCK: u64 = 65536;
/// Blocks in each test volume.
const VOLUME_BLOCKS: u64 = 64;

/// Each volume's expected bytes.
type Model = VolumeModel;

fn parts() -> MemoryParts {
    MemoryParts::new(4096, 1024 * BLOCK)
}

fn create(pool: &Pool, model: &mut Model, name: &str) {
    pool.create_volume(name, VOLUME_BLOCKS * BLOCK).unwrap();
    model.insert(name.to_string(), vec![0; (VOLUME_BLOCKS * BLOCK) as usize]);
}

fn snapshot(pool: &Pool, model: &mut Model, origin: &str, name: &str) {
    pool.snapshot(origin, name, false).unwrap();
    let bytes = model[origin].clone();
    model.insert(name.to_string(), bytes);
    assert!(
        !pool.index_built(name).unwrap(),
        "{name}: a new snapshot has no index"
    );
}

/// Write `length` bytes of a pattern at `offset` (a partial block breaks sharing by copying
/// the rest of the block, a whole one without).
fn write(pool: &Pool, model: &mut Model, name: &str, offset: u64, length: usize, seed: u64) {
    let data = testkit::pattern(seed, length);
    let volume = pool.volume(name).unwrap();
    volume.write(offset, &data, false).unwrap();
    let bytes = model.get_mut(name).unwrap();
    bytes[offset as usize..offset as usize + length].copy_from_slice(&data);
}

/// Every volume read whole against the model (building every index), the indexes against
/// the trees, the metadata checked.
fn assert_model(pool: &Pool, parts: &MemoryParts, model: &Model) {
    assert_volumes_match(pool, model);
    for name in model.keys() {
        assert!(pool.index_built(name).unwrap());
    }
    check_metadata(parts.metadata.clone(), None).unwrap();
}

/// [`assert_model`] on `pool`, then on the pool reopened on the same parts.
fn assert_model_across_reopen(pool: Pool, parts: &MemoryParts, model: &Model) {
    assert_model(&pool, parts, model);
    drop(pool);
    let pool = parts.reopen(deterministic_options());
    assert_model(&pool, parts, model);
}

/// The mapped blocks `list` gives for every volume.
fn mapped(pool: &Pool) -> BTreeMap<String, u64> {
    pool.list()
        .into_iter()
        .map(|v| (v.name, v.mapped_blocks))
        .collect()
}

/// Origin and snapshot written after the snapshot (whole blocks, partial blocks, shared
/// and not), read against the model; listing and usage do not build the snapshot's index;
/// the pool reopens with no index built and the same content.
#[test]
fn snapshot_then_write_origin_and_snapshot() {
    let parts = parts();
    let pool = parts.format(BLOCK, deterministic_options());
    let mut model = Model::new();
    create(&pool, &mut model, "v");
    write(&pool, &mut model, "v", 0, (16 * BLOCK) as usize, 1);
    write(&pool, &mut model, "v", 40 * BLOCK + 512, 4096, 2);
    snapshot(&pool, &mut model, "v", "s");
    // Listed from the snapshot's details: the origin's mapped blocks, no index built.
    assert_eq!(mapped(&pool)["s"], 17);
    assert_eq!(pool.info("s").unwrap().mapped_blocks, 17);
    let space = pool.usage().unwrap();
    assert!(space
        .iter()
        .any(|s| s.name == "s" && s.shared_bytes == 17 * BLOCK));
    assert!(!pool.index_built("s").unwrap());
    // The origin breaks sharing (partly and wholly); the snapshot's first write builds it.
    write(&pool, &mut model, "v", 3 * BLOCK + 1024, 2048, 3);
    write(&pool, &mut model, "v", 5 * BLOCK, BLOCK as usize, 4);
    write(&pool, &mut model, "s", 3 * BLOCK, 512, 5);
    assert!(pool.index_built("s").unwrap());
    write(&pool, &mut model, "s", 50 * BLOCK, (2 * BLOCK) as usize, 6);
    assert_model(&pool, &parts, &model);
    let before = mapped(&pool);
    drop(pool);
    let pool = parts.reopen(deterministic_options());
    for name in model.keys() {
        assert!(
            !pool.index_built(name).unwrap(),
            "{name}: built at activation"
        );
    }
    assert_eq!(mapped(&pool), before);
    assert_model(&pool, &parts, &model);
}

/// A snapshot of a snapshot that was never opened: both read right, and writes to each of
/// the three volumes stay in it.
#[test]
fn snapshot_of_a_snapshot_never_opened() {
    let parts = parts();
    let pool = parts.format(BLOCK, deterministic_options());
    let mut model = Model::new();
    create(&pool, &mut model, "v");
    write(&pool, &mut model, "v", 0, (8 * BLOCK) as usize, 1);
    snapshot(&pool, &mut model, "v", "s1");
    write(&pool, &mut model, "v", 2 * BLOCK, 4096, 2);
    snapshot(&pool, &mut model, "s1", "s2");
    assert!(!pool.index_built("s1").unwrap());
    write(&pool, &mut model, "s2", BLOCK + 512, 1024, 3);
    write(&pool, &mut model, "v", 7 * BLOCK, BLOCK as usize, 4);
    snapshot(&pool, &mut model, "s2", "s3");
    write(&pool, &mut model, "s1", 20 * BLOCK, 512, 5);
    assert_model_across_reopen(pool, &parts, &model);
}

/// A snapshot never opened is deleted: the blocks only it still maps (the origin broke
/// sharing of them) are free again, the others stay with the origin.
#[test]
fn snapshot_never_opened_then_deleted() {
    let parts = parts();
    let pool = parts.format(BLOCK, deterministic_options());
    let mut model = Model::new();
    create(&pool, &mut model, "v");
    write(&pool, &mut model, "v", 0, (10 * BLOCK) as usize, 1);
    pool.commit().unwrap();
    let used_before = pool.status().data_used_blocks;
    snapshot(&pool, &mut model, "v", "s");
    write(&pool, &mut model, "v", 0, (4 * BLOCK) as usize, 2);
    pool.commit().unwrap();
    assert_eq!(pool.status().data_used_blocks, used_before + 4);
    pool.delete_volume("s").unwrap();
    model.remove("s");
    pool.commit().unwrap();
    assert_eq!(pool.status().data_used_blocks, used_before);
    assert_model_across_reopen(pool, &parts, &model);
}

/// Revert to a snapshot never opened, of a volume whose index is built and of one whose
/// is not; rename of both kinds; the reverted volume starts without an index either way.
#[test]
fn revert_and_rename_of_unbuilt_volumes() {
    let parts = parts();
    let pool = parts.format(BLOCK, deterministic_options());
    let mut model = Model::new();
    create(&pool, &mut model, "v");
    write(&pool, &mut model, "v", 0, (6 * BLOCK) as usize, 1);
    snapshot(&pool, &mut model, "v", "backup");
    write(&pool, &mut model, "v", BLOCK, (3 * BLOCK) as usize, 2);
    write(&pool, &mut model, "v", 30 * BLOCK, 512, 3);
    // v (built) reverted to backup (never opened).
    pool.revert_volume("v", "backup", false).unwrap();
    assert!(!pool.index_built("v").unwrap());
    assert!(!pool.index_built("backup").unwrap());
    let reverted = model["backup"].clone();
    model.insert("v".to_string(), reverted);
    assert_eq!(mapped(&pool)["v"], 6);
    write(&pool, &mut model, "v", 2 * BLOCK + 512, 512, 4);
    // A volume never opened (w, a snapshot) reverted to another never opened (backup),
    // deleting it.
    snapshot(&pool, &mut model, "v", "w");
    pool.revert_volume("w", "backup", true).unwrap();
    let reverted = model.remove("backup").unwrap();
    model.insert("w".to_string(), reverted);
    assert!(!pool.index_built("w").unwrap());
    // Renames: w without an index, v with one.
    pool.rename_volume("w", "w2").unwrap();
    assert!(!pool.index_built("w2").unwrap());
    let moved = model.remove("w").unwrap();
    model.insert("w2".to_string(), moved);
    assert!(pool.index_built("v").unwrap());
    pool.rename_volume("v", "v2").unwrap();
    assert!(pool.index_built("v2").unwrap());
    let moved = model.remove("v").unwrap();
    model.insert("v2".to_string(), moved);
    write(&pool, &mut model, "v2", 9 * BLOCK, 4096, 5);
    write(&pool, &mut model, "w2", 0, 4096, 6);
    assert_model_across_reopen(pool, &parts, &model);
}

/// Shrink and grow a snapshot never opened: its index, built afterwards, has the new size
/// and none of the blocks the shrink removed.
#[test]
fn resize_of_a_volume_without_an_index() {
    let parts = parts();
    let pool = parts.format(BLOCK, deterministic_options());
    let mut model = Model::new();
    create(&pool, &mut model, "v");
    write(
        &pool,
        &mut model,
        "v",
        0,
        (VOLUME_BLOCKS * BLOCK) as usize,
        1,
    );
    snapshot(&pool, &mut model, "v", "s");
    pool.resize_volume("s", 20 * BLOCK, thin_pool::Shrink::DropData)
        .unwrap();
    assert!(!pool.index_built("s").unwrap());
    assert_eq!(mapped(&pool)["s"], 20);
    pool.resize_volume("s", 40 * BLOCK, thin_pool::Shrink::DropData)
        .unwrap();
    let bytes = model.get_mut("s").unwrap();
    bytes.truncate((20 * BLOCK) as usize);
    bytes.resize((40 * BLOCK) as usize, 0);
    write(&pool, &mut model, "s", 39 * BLOCK, 512, 2);
    assert_model_across_reopen(pool, &parts, &model);
}

/// Several threads open a snapshot never opened at the same moment: one index is built
/// (two builds would trip the engine's assertion that builds are serialized) and every
/// thread reads the same bytes, the model's.
#[test]
fn concurrent_first_opens_build_one_index() {
    const THREADS: usize = 8;
    let parts = parts();
    let pool = parts.format(BLOCK, deterministic_options());
    let mut model = Model::new();
    create(&pool, &mut model, "v");
    for i in 0..VOLUME_BLOCKS / 2 {
        write(&pool, &mut model, "v", 2 * i * BLOCK, 4096, i);
    }
    for round in 0..4 {
        let name = format!("s{round}");
        snapshot(&pool, &mut model, "v", &name);
        write(&pool, &mut model, "v", round * BLOCK, 512, 100 + round);
        let barrier = Arc::new(Barrier::new(THREADS));
        let reads: Vec<Vec<u8>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..THREADS)
                .map(|_| {
                    let (pool, barrier, name) = (&pool, barrier.clone(), &name);
                    scope.spawn(move || {
                        barrier.wait();
                        let volume = pool.volume(name).unwrap();
                        let mut bytes = vec![0u8; (VOLUME_BLOCKS * BLOCK) as usize];
                        volume.read(0, &mut bytes).unwrap();
                        bytes
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for bytes in &reads {
            assert!(*bytes == model[&name], "{name}: a thread read other bytes");
        }
    }
    assert_model(&pool, &parts, &model);
}

/// First opens of snapshots race writes to their origin (breaking sharing, provisioning,
/// flushing: commits) and commits from another thread: each snapshot reads as its origin
/// was when it was taken, and the origin as its writer left it.
#[test]
fn first_opens_race_writes_and_commits_of_the_origin() {
    const READERS: usize = 4;
    const ROUNDS: u64 = 6;
    let parts = parts();
    let pool = parts.format(BLOCK, deterministic_options());
    let mut model = Model::new();
    create(&pool, &mut model, "v");
    write(
        &pool,
        &mut model,
        "v",
        0,
        (VOLUME_BLOCKS * BLOCK / 2) as usize,
        1,
    );
    for round in 0..ROUNDS {
        let name = format!("s{round}");
        snapshot(&pool, &mut model, "v", &name);
        let barrier = Arc::new(Barrier::new(READERS + 2));
        let origin = model.get_mut("v").unwrap();
        let reads: Vec<Vec<u8>> = std::thread::scope(|scope| {
            let writer = {
                let (pool, barrier) = (&pool, barrier.clone());
                scope.spawn(move || {
                    let volume = pool.volume("v").unwrap();
                    barrier.wait();
                    for i in 0..16u64 {
                        let block = (round * 7 + i * 5) % VOLUME_BLOCKS;
                        let (offset, length) = (block * BLOCK + 512 * (i % 4), 4096);
                        let data = testkit::pattern(1000 * round + i, length);
                        volume.write(offset, &data, i % 3 == 0).unwrap();
                        origin[offset as usize..offset as usize + length].copy_from_slice(&data);
                    }
                })
            };
            let committer = {
                let (pool, barrier) = (&pool, barrier.clone());
                scope.spawn(move || {
                    barrier.wait();
                    for _ in 0..8 {
                        pool.commit().unwrap();
                    }
                })
            };
            let readers: Vec<_> = (0..READERS)
                .map(|_| {
                    let (pool, barrier, name) = (&pool, barrier.clone(), &name);
                    scope.spawn(move || {
                        barrier.wait();
                        let volume = pool.volume(name).unwrap();
                        let mut bytes = vec![0u8; (VOLUME_BLOCKS * BLOCK) as usize];
                        volume.read(0, &mut bytes).unwrap();
                        bytes
                    })
                })
                .collect();
            writer.join().unwrap();
            committer.join().unwrap();
            readers.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for bytes in &reads {
            assert!(
                *bytes == model[&name],
                "{name}: a first open read other bytes"
            );
        }
    }
    assert_model_across_reopen(pool, &parts, &model);
}
