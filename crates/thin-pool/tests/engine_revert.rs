//! Goal: `Pool::revert_volume` gives a volume the content and size of a snapshot (the
//! thin-pool `lvconvert --merge`), keeping its name, thin id and ancestry; the snapshot stays
//! or is deleted in the same transaction; both are refused while a handle is open, and a
//! refusal changes nothing. `Pool::rename_volume` changes only the name. After each, the
//! index equals the trees, the pool reopens the same, and both thin_check versions pass.
//! Method: write patterns through volume handles, keep a model of each volume's bytes (a
//! snapshot clones its origin's), revert and rename, compare every volume with its model
//! after each step and after reopening, and run the real checkers on the metadata file.

mod engine_kit;

use engine_kit::{assert_volumes_match, VolumeModel};
use std::path::Path;
use testkit::scratch::ScratchDir;
use testkit::tools::ThinTools;
use thin_pool::testing::dir_pool;
use thin_pool::{Error, Pool, PoolOptions};

const BLOCK: u64 = 65536;

fn options() -> PoolOptions {
    PoolOptions {
        commit_interval: None,
        ..PoolOptions::default()
    }
}

fn create(dir: &Path) -> Pool {
    dir_pool(dir, 256 * BLOCK, options())
}

/// Each volume's expected bytes.
type Model = VolumeModel;

fn write(pool: &Pool, model: &mut Model, name: &str, offset: u64, length: usize, seed: u64) {
    let data = testkit::pattern(seed, length);
    let volume = pool.volume(name).unwrap();
    volume.write(offset, &data, false).unwrap();
    volume.flush().unwrap();
    let bytes = model.get_mut(name).unwrap();
    bytes[offset as usize..offset as usize + length].copy_from_slice(&data);
}

fn check_with_real_tools(dir: &Path) {
    for tools in ThinTools::all() {
        tools.check(&dir.join("metadata")).assert_success();
    }
}

#[test]
fn revert_gives_the_snapshot_content_and_size_and_keeps_name_and_id() {
    let scratch = ScratchDir::new("revert-content");
    let dir = scratch.join("pool");
    let pool = create(&dir);
    let mut model = Model::new();
    pool.create_volume("vm", 16 * BLOCK).unwrap();
    model.insert("vm".into(), vec![0; 16 * BLOCK as usize]);
    write(&pool, &mut model, "vm", 0, 10 * BLOCK as usize, 1);
    pool.snapshot("vm", "backup", true).unwrap();
    model.insert("backup".into(), model["vm"].clone());
    // Diverge: overwrite part, write new blocks, then grow vm.
    write(
        &pool,
        &mut model,
        "vm",
        3 * BLOCK + 512,
        4 * BLOCK as usize,
        2,
    );
    write(&pool, &mut model, "vm", 12 * BLOCK, 2 * BLOCK as usize, 3);
    pool.resize_volume("vm", 32 * BLOCK, thin_pool::Shrink::DropData)
        .unwrap();
    model.get_mut("vm").unwrap().resize(32 * BLOCK as usize, 0);
    assert_volumes_match(&pool, &model);
    let id = pool.info("vm").unwrap().id;
    let used_before = pool.status().data_used_blocks;

    let info = pool.revert_volume("vm", "backup", false).unwrap();
    model.insert("vm".into(), model["backup"].clone());
    assert_eq!(info.id, id, "the thin id stays");
    assert_eq!(info.size_bytes, 16 * BLOCK, "the snapshot's size");
    assert!(!info.read_only, "vm's own flag, not the snapshot's");
    assert_eq!(info.origin, None, "vm's own origin");
    assert_eq!(pool.info("backup").unwrap().origin.as_deref(), Some("vm"));
    assert_volumes_match(&pool, &model);
    // vm's own blocks (7: 3 to 7, 12 and 13) were freed; the rest is shared with backup.
    assert_eq!(pool.status().data_used_blocks, used_before - 7);
    let usage = pool.usage().unwrap();
    let vm = usage.iter().find(|v| v.name == "vm").unwrap();
    assert_eq!((vm.mapped_bytes, vm.exclusive_bytes), (10 * BLOCK, 0));

    // Writes to the reverted volume break sharing; backup keeps its content.
    write(&pool, &mut model, "vm", 0, BLOCK as usize, 4);
    assert_volumes_match(&pool, &model);

    // Revert again, deleting the snapshot in the same operation.
    pool.revert_volume("vm", "backup", true).unwrap();
    let moved = model.remove("backup").unwrap();
    model.insert("vm".into(), moved);
    assert_volumes_match(&pool, &model);
    let usage = pool.usage().unwrap();
    assert_eq!(usage.len(), 1);
    assert_eq!(
        (usage[0].mapped_bytes, usage[0].exclusive_bytes),
        (10 * BLOCK, 10 * BLOCK),
        "every block is vm's alone"
    );
    pool.close().unwrap();
    drop(pool);
    check_with_real_tools(&dir);
    let pool = Pool::open(&dir, options()).unwrap();
    assert_volumes_match(&pool, &model);
    assert_eq!(pool.info("vm").unwrap().id, id);
}

#[test]
fn revert_and_rename_are_refused_while_open_and_change_nothing() {
    let scratch = ScratchDir::new("revert-busy");
    let dir = scratch.join("pool");
    let pool = create(&dir);
    let mut model = Model::new();
    pool.create_volume("vm", 8 * BLOCK).unwrap();
    model.insert("vm".into(), vec![0; 8 * BLOCK as usize]);
    write(&pool, &mut model, "vm", 0, 4 * BLOCK as usize, 1);
    pool.snapshot("vm", "snap", false).unwrap();
    model.insert("snap".into(), model["vm"].clone());
    write(&pool, &mut model, "vm", 0, BLOCK as usize, 2);
    let transaction = pool.status().transaction_id;

    let handle = pool.volume("vm").unwrap();
    let refused = pool.revert_volume("vm", "snap", false).unwrap_err();
    assert!(matches!(refused, Error::Busy(_)), "{refused:?}");
    let message = refused.to_string();
    assert!(message.contains("\"vm\" is open"), "{message}");
    let refused = pool.rename_volume("vm", "other").unwrap_err();
    assert!(matches!(refused, Error::Busy(_)), "{refused:?}");
    // The handle still works, and the volume can be opened again.
    handle.write(BLOCK, &[7; 512], false).unwrap();
    drop(handle);
    model.get_mut("vm").unwrap()[BLOCK as usize..BLOCK as usize + 512].fill(7);
    pool.volume("vm").unwrap().flush().unwrap();

    // A snapshot open for writing may be reverted to, not deleted by the revert.
    let snap_handle = pool.volume("snap").unwrap();
    let refused = pool.revert_volume("vm", "snap", true).unwrap_err();
    assert!(matches!(refused, Error::Busy(_)), "{refused:?}");
    assert!(pool.volume("vm").is_ok(), "vm released after the refusal");
    for (volume, snapshot) in [("vm", "vm"), ("vm", "nothing"), ("nothing", "snap")] {
        assert!(pool.revert_volume(volume, snapshot, false).is_err());
    }
    assert!(matches!(
        pool.rename_volume("vm", "snap"),
        Err(Error::NameExists(_))
    ));
    assert!(pool.rename_volume("vm", "bad/name").is_err());
    assert_eq!(
        pool.status().transaction_id,
        transaction,
        "nothing committed"
    );
    assert_volumes_match(&pool, &model);

    pool.revert_volume("vm", "snap", false).unwrap();
    model.insert("vm".into(), model["snap"].clone());
    drop(snap_handle);
    assert_volumes_match(&pool, &model);
}

#[test]
fn rename_keeps_content_id_and_ancestry() {
    let scratch = ScratchDir::new("rename");
    let dir = scratch.join("pool");
    let pool = create(&dir);
    let mut model = Model::new();
    pool.create_volume("vm", 8 * BLOCK).unwrap();
    model.insert("vm".into(), vec![0; 8 * BLOCK as usize]);
    write(&pool, &mut model, "vm", 0, 3 * BLOCK as usize, 1);
    pool.snapshot("vm", "snap", true).unwrap();
    model.insert("snap".into(), model["vm"].clone());
    let id = pool.info("vm").unwrap().id;

    let info = pool.rename_volume("vm", "vm2").unwrap();
    let moved = model.remove("vm").unwrap();
    model.insert("vm2".into(), moved);
    assert_eq!(info.id, id);
    assert_eq!(pool.info("snap").unwrap().origin.as_deref(), Some("vm2"));
    assert!(pool.volume("vm").is_err());
    assert_volumes_match(&pool, &model);
    // The renamed volume is written as before (sharing with snap is broken, not lost).
    write(&pool, &mut model, "vm2", BLOCK, 512, 2);
    // A new volume takes the old name: it is nobody's origin.
    pool.create_volume("vm", BLOCK).unwrap();
    model.insert("vm".into(), vec![0; BLOCK as usize]);
    assert_eq!(pool.info("snap").unwrap().origin.as_deref(), Some("vm2"));
    assert_volumes_match(&pool, &model);
    let snap_info = pool.rename_volume("snap", "snap-renamed").unwrap();
    assert!(snap_info.read_only, "the flag stays");
    let moved = model.remove("snap").unwrap();
    model.insert("snap-renamed".into(), moved);
    pool.close().unwrap();
    drop(pool);
    check_with_real_tools(&dir);
    let pool = Pool::open(&dir, options()).unwrap();
    assert_volumes_match(&pool, &model);
    assert_eq!(
        pool.info("snap-renamed").unwrap().origin.as_deref(),
        Some("vm2")
    );
}
