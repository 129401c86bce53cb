//! Goal (issue 20, finding 2): a pool open for I/O never writes over metadata or a catalog
//! that another writer changed since its last commit (`thinpool restore -o` with the lock
//! bypassed, a second server on an alias of the device, an editor). Before each commit it
//! reads block 0 back and compares it with the superblock it last wrote, and before
//! storing a catalog it checks the catalog file it last wrote: on a difference the commit
//! fails with a typed error, the pool fails safe (nothing more is written, every change and
//! every write refused) and the foreign metadata stays exactly as written.
//!
//! Method: a pool in a scratch directory through the public API; the foreign writer is a
//! second `PoolMetadata` on the same metadata file (no lock taken), committing a
//! transaction of its own, or a rewritten catalog file; every file of the directory is
//! compared byte for byte after the refused commit.

use persistent_data::FileDevice;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use testkit::scratch::ScratchDir;
use thin_pool::format::check::{check, CheckOptions};
use thin_pool::testing::dir_pool;
use thin_pool::{Error, Pool, PoolMetadata, PoolMode, PoolOptions, TransactionId};

const BLOCK: u64 = 65536;

fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(Result::unwrap)
        .filter(|entry| entry.file_type().unwrap().is_file())
        .map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            (name, std::fs::read(entry.path()).unwrap())
        })
        .collect()
}

/// A pool with one volume holding data at block 1, committed, and no periodic commit (the
/// test triggers each commit itself).
fn served_pool(dir: &Path) -> Pool {
    let options = PoolOptions {
        commit_interval: None,
        ..PoolOptions::default()
    };
    let pool = dir_pool(dir, 64 * BLOCK, options);
    pool.create_volume("vm", 8 * BLOCK).unwrap();
    pool.volume("vm")
        .unwrap()
        .write(BLOCK, &[7u8; 4096], true)
        .unwrap();
    pool.commit().unwrap();
    pool
}

/// After a refused commit: failed, every change and write refused, nothing written.
fn assert_fails_safe(pool: &Pool, dir: &Path, before: &BTreeMap<String, Vec<u8>>) {
    assert_eq!(pool.mode(), PoolMode::Fail);
    let volume = pool.volume("vm");
    if let Ok(volume) = volume {
        assert!(volume.write(0, &[1u8; 4096], true).is_err(), "a new block");
        assert!(volume.write(BLOCK, &[1u8; 4096], true).is_err(), "in place");
    }
    assert!(pool.create_volume("c", BLOCK).is_err());
    assert!(pool.commit().is_err());
    let _ = pool.close();
    assert!(
        pool.events()
            .iter()
            .any(|event| event.contains("changed under the server")),
        "logged: {:?}",
        pool.events()
    );
    assert_eq!(
        &files(dir),
        before,
        "nothing written after the foreign change"
    );
}

#[test]
fn a_commit_after_a_foreign_metadata_commit_fails_safe_and_writes_nothing() {
    let scratch = ScratchDir::new("foreign-metadata");
    let dir = scratch.path();
    let pool = served_pool(dir);
    let ours = pool.status().transaction_id;
    // Queued work of ours: a first write to block 2 (its op waits for the next commit).
    pool.volume("vm")
        .unwrap()
        .write(2 * BLOCK, &[9u8; 4096], false)
        .unwrap();
    // The foreign writer: the same metadata file, another transaction committed.
    let device = Arc::new(FileDevice::open(&dir.join("metadata"), true).unwrap());
    let mut foreign = PoolMetadata::open(device.clone()).unwrap();
    let theirs = TransactionId::new(ours + 40);
    foreign
        .set_transaction_id(TransactionId::new(ours), theirs)
        .unwrap();
    foreign.commit().unwrap();
    drop(foreign);
    let before = files(dir);

    let error = pool.commit().unwrap_err();
    assert!(
        matches!(&error, Error::MetadataChangedUnderServer { found, expected }
            if *found == theirs.get().to_string() && *expected == ours),
        "{error:?}"
    );
    let text = error.to_string();
    assert!(
        text.contains(&format!(
            "superblock transaction id {}, expected {ours}",
            theirs.get()
        )) && text.contains("another writer?"),
        "{text}"
    );
    assert_fails_safe(&pool, dir, &before);
    drop(pool);
    // The foreign metadata is intact: it checks clean and is the foreign transaction.
    let report = check(device.clone(), &CheckOptions::default(), &mut |_| {});
    assert!(report.is_clean(), "{:?}", report.problems);
    let reopened = PoolMetadata::open(device).unwrap();
    assert_eq!(reopened.transaction_id(), theirs);
}

#[test]
fn garbage_written_over_the_superblock_is_not_overwritten() {
    let scratch = ScratchDir::new("foreign-superblock");
    let dir = scratch.path();
    let pool = served_pool(dir);
    let tid = pool.status().transaction_id;
    let mut metadata = std::fs::read(dir.join("metadata")).unwrap();
    metadata[..4096].fill(0x5a);
    std::fs::write(dir.join("metadata"), &metadata).unwrap();
    let before = files(dir);
    let error = pool.create_volume("b", BLOCK).unwrap_err();
    assert!(
        matches!(&error, Error::MetadataChangedUnderServer { found, .. }
            if found.contains("unreadable")),
        "{error:?}"
    );
    assert!(!dir.join(format!("catalog-{}.json", tid + 1)).exists());
    assert_fails_safe(&pool, dir, &before);
}

#[test]
fn a_change_after_a_foreign_catalog_write_fails_safe_and_writes_nothing() {
    let scratch = ScratchDir::new("foreign-catalog");
    let dir = scratch.path();
    let pool = served_pool(dir);
    let tid = pool.status().transaction_id;
    let path = dir.join(format!("catalog-{tid}.json"));
    let foreign = std::fs::read_to_string(&path)
        .unwrap()
        .replace("\"vm\"", "\"renamed-by-someone-else\"");
    std::fs::write(&path, &foreign).unwrap();
    let before = files(dir);

    let error = pool.create_volume("b", BLOCK).unwrap_err();
    assert!(
        matches!(&error, Error::CatalogChangedUnderServer { expected, .. } if *expected == tid),
        "{error:?}"
    );
    assert!(error.to_string().contains("another writer?"), "{error}");
    assert_fails_safe(&pool, dir, &before);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), foreign);
}

#[test]
fn our_own_commits_and_changes_pass_the_check() {
    let scratch = ScratchDir::new("foreign-none");
    let dir = scratch.path();
    let pool = served_pool(dir);
    for i in 0..5u64 {
        pool.create_volume(&format!("v{i}"), 4 * BLOCK).unwrap();
        pool.volume("vm")
            .unwrap()
            .write(i * BLOCK, &[i as u8; 4096], true)
            .unwrap();
        pool.snapshot("vm", &format!("s{i}"), true).unwrap();
    }
    pool.reserve_metadata_snap().unwrap();
    pool.volume("vm")
        .unwrap()
        .write(0, &[3; 4096], true)
        .unwrap();
    pool.release_metadata_snap().unwrap();
    pool.close().unwrap();
    assert_eq!(pool.mode(), PoolMode::Write);
    drop(pool);
    let pool = Pool::open(dir, PoolOptions::default()).unwrap();
    assert_eq!(pool.list().len(), 11);
}
