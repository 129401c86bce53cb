//! Goal: freed data blocks give their space back to the host. Deleting a volume, shrinking
//! it and discarding punch holes in the data file once the commit that frees the blocks is
//! durable; blocks a snapshot still shares stay; with passdown off nothing is punched until
//! `Pool::trim` punches every free block. Every volume reads back as written throughout.
//! Method: a pool in a scratch directory (a sparse data file on the host file system); the
//! data file's allocated size (`st_blocks`) after each step, and every volume read back
//! against a model of its blocks.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use testkit::scratch::ScratchDir;
use thin_pool::{CreateOptions, Pool, PoolOptions};

const BLOCK: u64 = 65536;
const VOLUME_BLOCKS: u64 = 64;

fn pattern(volume: u8, b: u64) -> Vec<u8> {
    let mut data = vec![volume; BLOCK as usize];
    for (i, chunk) in data.chunks_mut(8).enumerate().step_by(64) {
        chunk.copy_from_slice(&(b << 32 | i as u64).to_le_bytes());
    }
    data
}

/// Volume name → written blocks (unwritten blocks read as zeros).
type Model = BTreeMap<String, BTreeMap<u64, Vec<u8>>>;

fn allocated_bytes(dir: &Path) -> u64 {
    std::fs::metadata(dir.join("data")).unwrap().blocks() * 512
}

fn check(pool: &Pool, model: &Model) {
    let volumes: Vec<String> = pool.list().into_iter().map(|v| v.name).collect();
    assert_eq!(volumes, model.keys().cloned().collect::<Vec<_>>());
    let zeros = vec![0u8; BLOCK as usize];
    for (name, blocks) in model {
        let v = pool.volume(name).unwrap();
        let size_blocks = pool.info(name).unwrap().size_bytes / BLOCK;
        for b in 0..size_blocks {
            let mut buf = vec![0u8; BLOCK as usize];
            v.read(b * BLOCK, &mut buf).unwrap();
            let expected = blocks.get(&b).unwrap_or(&zeros);
            assert!(&buf == expected, "volume {name} block {b}");
        }
    }
}

fn create(dir: &Path, options: PoolOptions) -> Pool {
    Pool::create(
        dir,
        &CreateOptions {
            data_size_bytes: 1024 * BLOCK,
            block_size_bytes: BLOCK,
            metadata_size_bytes: Some(8 << 20),
        },
        options,
    )
    .unwrap()
}

fn fill(pool: &Pool, model: &mut Model, name: &str, tag: u8, blocks: std::ops::Range<u64>) {
    let v = pool.volume(name).unwrap();
    for b in blocks {
        let data = pattern(tag, b);
        v.write(b * BLOCK, &data, false).unwrap();
        model.entry(name.to_string()).or_default().insert(b, data);
    }
    v.flush().unwrap();
}

/// The allocated size fell by at least `blocks` data blocks.
fn assert_fell(before: u64, after: u64, blocks: u64, what: &str) {
    assert!(
        after + blocks * BLOCK <= before,
        "{what}: allocated {before} → {after} bytes, expected a fall of {} bytes",
        blocks * BLOCK
    );
}

#[test]
fn delete_shrink_and_discard_punch_freed_blocks_and_snapshots_keep_theirs() {
    let scratch = ScratchDir::new("host-space");
    let dir = scratch.join("pool");
    let pool = create(
        &dir,
        PoolOptions {
            commit_interval: None,
            ..PoolOptions::default()
        },
    );
    let mut model = Model::new();
    for name in ["a", "b", "c"] {
        pool.create_volume(name, VOLUME_BLOCKS * BLOCK).unwrap();
        model.insert(name.to_string(), BTreeMap::new());
    }
    fill(&pool, &mut model, "a", 1, 0..VOLUME_BLOCKS);
    fill(&pool, &mut model, "b", 2, 0..VOLUME_BLOCKS);
    fill(&pool, &mut model, "c", 3, 0..VOLUME_BLOCKS);
    pool.snapshot("a", "a-snap", false).unwrap();
    model.insert("a-snap".to_string(), model["a"].clone());
    let full = allocated_bytes(&dir);
    assert!(full >= 3 * VOLUME_BLOCKS * BLOCK);

    pool.delete_volume("c").unwrap();
    model.remove("c");
    let after_delete = allocated_bytes(&dir);
    assert_fell(full, after_delete, VOLUME_BLOCKS, "delete");
    check(&pool, &model);

    // `a` shares every block with its snapshot: deleting it frees nothing.
    pool.delete_volume("a").unwrap();
    model.remove("a");
    assert_eq!(allocated_bytes(&dir), after_delete, "shared blocks stay");
    check(&pool, &model);

    pool.resize_volume("b", 16 * BLOCK, thin_pool::Shrink::DropData)
        .unwrap();
    model.get_mut("b").unwrap().retain(|&b, _| b < 16);
    let after_shrink = allocated_bytes(&dir);
    assert_fell(after_delete, after_shrink, VOLUME_BLOCKS - 16, "shrink");
    check(&pool, &model);

    let v = pool.volume("a-snap").unwrap();
    v.discard(8 * BLOCK, 24 * BLOCK).unwrap();
    v.flush().unwrap();
    drop(v);
    model
        .get_mut("a-snap")
        .unwrap()
        .retain(|&b, _| !(8..32).contains(&b));
    let after_discard = allocated_bytes(&dir);
    assert_fell(after_shrink, after_discard, 24, "discard");
    check(&pool, &model);
    assert!(pool.status().data_bytes_passed_down >= (VOLUME_BLOCKS + 48 + 24) * BLOCK);

    // Reused blocks come back whole.
    fill(&pool, &mut model, "b", 4, 0..16);
    fill(&pool, &mut model, "a-snap", 5, 8..32);
    check(&pool, &model);
    pool.close().unwrap();
    drop(pool);
    let reopened = Pool::open(&dir, PoolOptions::default()).unwrap();
    check(&reopened, &model);
}

#[test]
fn trim_punches_every_free_block_while_volumes_keep_their_data() {
    let scratch = ScratchDir::new("host-trim");
    let dir = scratch.join("pool");
    let no_passdown = PoolOptions {
        commit_interval: None,
        discard_passdown: false,
        ..PoolOptions::default()
    };
    let pool = create(&dir, no_passdown.clone());
    let mut model = Model::new();
    for name in ["keep", "gone", "shrunk"] {
        pool.create_volume(name, VOLUME_BLOCKS * BLOCK).unwrap();
        model.insert(name.to_string(), BTreeMap::new());
    }
    fill(&pool, &mut model, "keep", 1, 0..VOLUME_BLOCKS);
    fill(&pool, &mut model, "gone", 2, 0..VOLUME_BLOCKS);
    fill(&pool, &mut model, "shrunk", 3, 0..VOLUME_BLOCKS);
    let full = allocated_bytes(&dir);
    pool.delete_volume("gone").unwrap();
    model.remove("gone");
    pool.resize_volume("shrunk", 32 * BLOCK, thin_pool::Shrink::DropData)
        .unwrap();
    model.get_mut("shrunk").unwrap().retain(|&b, _| b < 32);
    let v = pool.volume("keep").unwrap();
    v.discard(0, 16 * BLOCK).unwrap();
    v.flush().unwrap();
    drop(v);
    model.get_mut("keep").unwrap().retain(|&b, _| b >= 16);
    assert_eq!(
        allocated_bytes(&dir),
        full,
        "passdown is off: nothing punched"
    );
    check(&pool, &model);

    let trimmed = pool.trim().unwrap();
    assert_eq!(trimmed, pool.status().data_bytes_passed_down);
    let free_blocks = {
        let status = pool.status();
        status.data_total_blocks - status.data_used_blocks
    };
    assert_eq!(trimmed, free_blocks * BLOCK, "every free block is trimmed");
    let after_trim = allocated_bytes(&dir);
    assert_fell(full, after_trim, VOLUME_BLOCKS + 32 + 16, "trim");
    check(&pool, &model);
    // Writes after a trim land on trimmed blocks and read back.
    fill(&pool, &mut model, "keep", 7, 0..16);
    check(&pool, &model);
    pool.close().unwrap();
}

#[test]
fn trim_while_writers_provision_never_punches_their_data() {
    let scratch = ScratchDir::new("host-trim-race");
    let dir = scratch.join("pool");
    let pool = create(
        &dir,
        PoolOptions {
            discard_passdown: false,
            ..PoolOptions::default()
        },
    );
    pool.create_volume("v", 512 * BLOCK).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let rounds = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let writer = {
        let v = pool.volume("v").unwrap();
        let stop = stop.clone();
        let rounds = rounds.clone();
        std::thread::spawn(move || {
            // Write every block, discard it, write it again: freed blocks are reused while
            // trims run.
            let mut round = 0u8;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                round = round.wrapping_add(1);
                for b in 0..512 {
                    v.write(b * BLOCK, &pattern(round, b), false).unwrap();
                    if b % 3 == 0 {
                        v.discard(b * BLOCK, BLOCK).unwrap();
                        v.write(b * BLOCK, &pattern(round, b), false).unwrap();
                    }
                }
                v.flush().unwrap();
                for b in 0..512 {
                    let mut buf = vec![0u8; BLOCK as usize];
                    v.read(b * BLOCK, &mut buf).unwrap();
                    assert!(buf == pattern(round, b), "round {round} block {b}");
                }
                rounds.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            round
        })
    };
    // Trims run through several whole rounds of the writer.
    let mut trims = 0;
    while trims < 20 || rounds.load(std::sync::atomic::Ordering::SeqCst) < 3 {
        pool.trim().unwrap();
        trims += 1;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let round = writer.join().unwrap();
    let v = pool.volume("v").unwrap();
    for b in 0..512 {
        let mut buf = vec![0u8; BLOCK as usize];
        v.read(b * BLOCK, &mut buf).unwrap();
        assert!(buf == pattern(round, b), "block {b}");
    }
    pool.close().unwrap();
}
