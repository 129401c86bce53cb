//! Goal (issue 20, finding 6): an open pool holds its directory by descriptor, so renaming
//! the directory away and putting a link to another directory in its place (what a user
//! who can flip a link in the path would do) does not send the pool's later catalog writes
//! into that other directory: they stay with the pool, and the other directory is
//! untouched.
//!
//! Method: a pool in a scratch directory through the public API; after the swap, changes
//! that write catalogs (create, snapshot, rename, delete); then the moved pool reopens with
//! every change and the decoy directory holds only what it held.

use std::path::Path;
use testkit::scratch::ScratchDir;
use thin_pool::testing::dir_pool;
use thin_pool::{Pool, PoolOptions};

const BLOCK: u64 = 65536;

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_directory_swapped_after_open_does_not_redirect_catalog_writes() {
    let scratch = ScratchDir::new("pool-directory-swap");
    let (pool_dir, moved, decoy) = (
        scratch.path().join("pool"),
        scratch.path().join("moved"),
        scratch.path().join("decoy"),
    );
    std::fs::create_dir_all(&pool_dir).unwrap();
    std::fs::create_dir_all(&decoy).unwrap();
    std::fs::write(decoy.join("keep"), b"the other user's file").unwrap();
    let pool = dir_pool(&pool_dir, 64 * BLOCK, PoolOptions::default());
    pool.create_volume("a", 4 * BLOCK).unwrap();
    pool.close().unwrap();
    drop(pool);
    let pool = Pool::open(&pool_dir, PoolOptions::default()).unwrap();

    std::fs::rename(&pool_dir, &moved).unwrap();
    std::os::unix::fs::symlink(&decoy, &pool_dir).unwrap();

    pool.create_volume("b", 4 * BLOCK).unwrap();
    pool.snapshot("a", "a-snap", true).unwrap();
    pool.rename_volume("b", "c").unwrap();
    pool.delete_volume("a-snap").unwrap();
    pool.volume("c")
        .unwrap()
        .write(0, &[5u8; 4096], true)
        .unwrap();
    pool.close().unwrap();
    drop(pool);

    assert_eq!(
        names(&decoy),
        vec!["keep".to_string()],
        "nothing went to the decoy"
    );
    let pool = Pool::open(&moved, PoolOptions::default()).unwrap();
    let mut listed: Vec<String> = pool.list().into_iter().map(|v| v.name).collect();
    listed.sort();
    assert_eq!(listed, vec!["a".to_string(), "c".to_string()]);
    let mut buf = [0u8; 4096];
    pool.volume("c").unwrap().read(0, &mut buf).unwrap();
    assert_eq!(buf, [5u8; 4096]);
}
