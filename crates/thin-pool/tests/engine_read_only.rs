//! Goal: a read-only open (`PoolOptions::read_only`, what `thinpool serve --read-only` uses)
//! writes nothing at all: the metadata, data and catalog files keep their bytes, a catalog
//! newer than the metadata (a change that never committed) is left for the next read-write
//! open to discard, reads see the committed data, and every change is refused.
//!
//! Method: a pool in a scratch directory through the public API; a planted catalog file one
//! transaction ahead; every file of the directory compared byte for byte before and after.

use std::collections::BTreeMap;
use std::path::Path;
use testkit::scratch::ScratchDir;
use thin_pool::testing::dir_pool;
use thin_pool::{Error, Pool, PoolMode, PoolOptions};

const BLOCK: u64 = 65536;

fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(Result::unwrap)
        .filter(|entry| entry.file_type().unwrap().is_file())
        .map(|entry| {
            (
                entry.file_name().to_string_lossy().into_owned(),
                std::fs::read(entry.path()).unwrap(),
            )
        })
        .collect()
}

#[test]
fn a_read_only_open_writes_nothing_and_refuses_every_change() {
    let scratch = ScratchDir::new("read-only-open");
    let dir = scratch.path();
    let pool = dir_pool(dir, 64 * BLOCK, PoolOptions::default());
    pool.create_volume("vm", 8 * BLOCK).unwrap();
    let volume = pool.volume("vm").unwrap();
    volume.write(BLOCK, &[7u8; 4096], true).unwrap();
    drop(volume);
    let transaction_id = pool.status().transaction_id;
    pool.close().unwrap();
    drop(pool);
    // A catalog one transaction ahead: what a crash between its write and the commit leaves.
    let current = dir.join(format!("catalog-{transaction_id}.json"));
    let ahead = dir.join(format!("catalog-{}.json", transaction_id + 1));
    std::fs::copy(&current, &ahead).unwrap();
    let before = files(dir);

    let read_only = PoolOptions {
        read_only: true,
        ..PoolOptions::default()
    };
    let pool = Pool::open(dir, read_only).unwrap();
    assert_eq!(pool.mode(), PoolMode::ReadOnly);
    assert!(!pool.status().needs_check);
    let volume = pool.volume("vm").unwrap();
    assert!(volume.read_only());
    let mut buffer = vec![0u8; 4096];
    volume.read(BLOCK, &mut buffer).unwrap();
    assert_eq!(buffer, vec![7u8; 4096]);
    assert!(matches!(
        volume.write(0, &[1u8; 4096], false),
        Err(Error::ReadOnly { needs_check: false })
    ));
    drop(volume);
    assert!(matches!(
        pool.create_volume("new", BLOCK),
        Err(Error::ReadOnly { needs_check: false })
    ));
    pool.close().unwrap();
    drop(pool);
    assert!(before == files(dir), "a read-only open changed a file");
    assert!(ahead.exists());

    // The next read-write open discards the catalog that never committed.
    let pool = Pool::open(dir, PoolOptions::default()).unwrap();
    assert!(!ahead.exists());
    pool.close().unwrap();
}
