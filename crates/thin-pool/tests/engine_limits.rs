//! Goal: every management operation checks its limits before it changes anything, and a
//! refused one leaves the pool exactly as it was (issue 9, reproductions 3 and 4): the
//! largest volume (1 EiB) is created, written at both ends and reopened; larger sizes are
//! refused by create and resize; a data grow the metadata cannot record is refused before
//! the data file changes and the pool stays writable; a pool whose metadata cannot hold its
//! data space map, or cannot be preallocated, is not created at all.
//!
//! Method: pools in scratch directories through the public API; file sizes read from the
//! host; the metadata checked by our checker after each scenario.

mod engine_kit;

use engine_kit::check_metadata;
use persistent_data::{BlockDevice, FileDevice};
use std::path::Path;
use std::sync::Arc;
use testkit::scratch::ScratchDir;
use thin_pool::{CreateOptions, Error, ErrorKind, Pool, PoolMode, PoolOptions};

/// Linux's EINVAL: what every refusal of an impossible request maps to.
const EINVAL: i32 = 22;
use thin_pool::{DATA_FILE, METADATA_FILE};

const BLOCK: u64 = 65536;
const EIB: u64 = 1 << 60;

fn options() -> PoolOptions {
    PoolOptions {
        commit_interval: None,
        ..PoolOptions::default()
    }
}

fn create(dir: &Path, data_size_bytes: u64, metadata_size_bytes: Option<u64>) -> Pool {
    Pool::create(
        dir,
        &CreateOptions {
            data_size_bytes,
            block_size_bytes: BLOCK,
            metadata_size_bytes,
        },
        options(),
    )
    .unwrap()
}

fn check(dir: &Path) {
    let metadata: Arc<dyn BlockDevice> =
        Arc::new(FileDevice::open(&dir.join(METADATA_FILE), false).unwrap());
    check_metadata(metadata, None).unwrap();
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().len()
}

fn invalid(result: Result<impl std::fmt::Debug, Error>) -> String {
    match result {
        Err(error) if error.kind() == ErrorKind::Refused && error.errno() == EINVAL => {
            error.to_string()
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn the_largest_volume_works_and_larger_sizes_are_refused() {
    let temp = ScratchDir::new("limits-largest");
    let dir = temp.join("pool");
    let pool = create(&dir, 64 << 20, None);
    let info = pool.create_volume("big", EIB).unwrap();
    assert_eq!(info.size_bytes, EIB);
    pool.create_volume("small", 1 << 30).unwrap();
    for size in [EIB + 512, u64::MAX - 511] {
        let message = invalid(pool.create_volume("bigger", size));
        assert!(message.contains("largest volume"), "{message}");
        let message = invalid(pool.resize_volume("small", size, thin_pool::Shrink::DropData));
        assert!(message.contains("largest volume"), "{message}");
    }
    assert_eq!(pool.list().len(), 2);
    assert_eq!(pool.info("small").unwrap().size_bytes, 1 << 30);
    let volume = pool.volume("big").unwrap();
    volume.write(0, &[1u8; BLOCK as usize], false).unwrap();
    volume
        .write(EIB - BLOCK, &[2u8; BLOCK as usize], false)
        .unwrap();
    drop(volume);
    // A snapshot of it copies the index: cheap too.
    pool.snapshot("big", "big-snap", true).unwrap();
    // Shrinking clears what lies beyond without visiting every block.
    pool.resize_volume("big", 1 << 40, thin_pool::Shrink::DropData)
        .unwrap();
    assert_eq!(pool.info("big").unwrap().mapped_blocks, 1);
    assert_eq!(pool.info("big-snap").unwrap().mapped_blocks, 2);
    pool.resize_volume("big", EIB, thin_pool::Shrink::DropData)
        .unwrap();
    pool.close().unwrap();
    drop(pool);
    check(&dir);

    let pool = Pool::open(&dir, options()).unwrap();
    assert_eq!(pool.mode(), PoolMode::Write);
    let mut buf = vec![0u8; BLOCK as usize];
    let snap = pool.volume("big-snap").unwrap();
    snap.read(EIB - BLOCK, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 2));
    let big = pool.volume("big").unwrap();
    big.read(EIB - BLOCK, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    big.read(0, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 1));
    drop((snap, big));
    pool.close().unwrap();
    drop(pool);
}

#[test]
fn a_data_grow_the_metadata_cannot_record_is_refused_before_the_data_file_changes() {
    let temp = ScratchDir::new("limits-grow");
    let dir = temp.join("pool");
    let pool = create(&dir, 256 << 20, None);
    pool.create_volume("v", 64 << 20).unwrap();
    let volume = pool.volume("v").unwrap();
    // Acknowledged, not yet committed.
    volume.write(0, &[7u8; BLOCK as usize], false).unwrap();
    let before = pool.status();
    let message = invalid(pool.grow_data(8 << 40));
    assert!(message.contains("metadata blocks"), "{message}");
    let free = before.metadata_total_blocks - before.metadata_used_blocks;
    assert!(
        message.contains(&format!("{free} of the {}", before.metadata_total_blocks)),
        "{message}"
    );
    assert_eq!(file_len(&dir.join(DATA_FILE)), 256 << 20);
    assert_eq!(pool.mode(), PoolMode::Write);
    assert_eq!(pool.status().data_total_blocks, 4096);
    // More data blocks than the format addresses.
    let message = invalid(pool.grow_data(u64::MAX));
    assert!(message.contains("at most"), "{message}");
    assert_eq!(file_len(&dir.join(DATA_FILE)), 256 << 20);
    volume.write(BLOCK, &[8u8; BLOCK as usize], false).unwrap();
    pool.commit().unwrap();
    // A grow it can record works.
    assert_eq!(pool.grow_data(1 << 30).unwrap(), 16384);
    drop(volume);
    pool.close().unwrap();
    drop(pool);
    check(&dir);
    let pool = Pool::open(&dir, options()).unwrap();
    assert_eq!(pool.mode(), PoolMode::Write);
    assert_eq!(pool.info("v").unwrap().mapped_blocks, 2);
    pool.close().unwrap();
    drop(pool);
}

#[test]
fn a_pool_whose_metadata_cannot_hold_its_data_space_map_is_not_created() {
    let temp = ScratchDir::new("limits-create");
    let dir = temp.join("pool");
    // 256 KiB of metadata (64 blocks) cannot record 8 TiB of 64 KiB blocks (8193 bitmaps).
    let result = Pool::create(
        &dir,
        &CreateOptions {
            data_size_bytes: 8 << 40,
            block_size_bytes: BLOCK,
            metadata_size_bytes: Some(256 << 10),
        },
        options(),
    );
    let message = invalid(result);
    assert!(message.contains("cannot map"), "{message}");
    assert!(!dir.join(METADATA_FILE).exists());
    assert!(!dir.join(DATA_FILE).exists());
    // The metadata file is preallocated: its blocks are on the host, not holes.
    let pool = create(&dir, 64 << 20, Some(4 << 20));
    pool.close().unwrap();
    drop(pool);
    let allocated = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(dir.join(METADATA_FILE)).unwrap().blocks() * 512
    };
    assert!(allocated >= 4 << 20, "{allocated} bytes allocated");
    // Growing the metadata beyond the format's limit is refused, the file unchanged.
    let pool = Pool::open(&dir, options()).unwrap();
    let message = invalid(pool.grow_metadata(Some(1 << 40)));
    assert!(message.contains("at most"), "{message}");
    assert_eq!(file_len(&dir.join(METADATA_FILE)), 4 << 20);
    assert_eq!(pool.grow_metadata(Some(8 << 20)).unwrap(), 2048);
    pool.close().unwrap();
    drop(pool);
    check(&dir);
}

#[test]
fn a_data_device_grown_beyond_what_the_metadata_can_record_still_opens() {
    let temp = ScratchDir::new("limits-grown-outside");
    let dir = temp.join("pool");
    let pool = create(&dir, 256 << 20, None);
    pool.create_volume("v", 1 << 20).unwrap();
    pool.volume("v")
        .unwrap()
        .write(0, &[3u8; BLOCK as usize], true)
        .unwrap();
    pool.close().unwrap();
    drop(pool);
    // As an operator extending the data file (or LV) by hand would.
    let data = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join(DATA_FILE))
        .unwrap();
    data.set_len(8 << 40).unwrap();
    drop(data);
    let pool = Pool::open(&dir, options()).unwrap();
    assert_eq!(pool.mode(), PoolMode::Write);
    assert_eq!(pool.status().data_total_blocks, 4096);
    let events = pool.events();
    assert!(
        events.iter().any(|e| e.contains("grow the metadata")),
        "{events:?}"
    );
    pool.volume("v")
        .unwrap()
        .write(BLOCK, &[4u8; BLOCK as usize], true)
        .unwrap();
    pool.close().unwrap();
    drop(pool);
    check(&dir);
}
