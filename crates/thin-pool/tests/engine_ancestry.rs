//! Goal: a snapshot's origin is recorded by thin id and never names the wrong volume
//! (issue 9, item 6; regression test for reproduction 9): after the origin is deleted the
//! snapshot has no origin, also when a new volume takes the old one's name or its thin id;
//! a revert by delete-and-resnapshot leaves no cycle; neither do `revert_volume` and
//! `rename_volume` (issue 11, item 6), through which snapshots follow their origin's new
//! name and a re-created name is nobody's origin; catalogs written before (origins by
//! name) still open, with each name resolved to the volume it named then.
//! Method: management operations on a pool in a scratch directory, checking
//! `VolumeInfo::origin` after each and after a reopen; for the old format, the catalog file
//! is rewritten with origin names, as older versions wrote it.

use std::path::Path;
use testkit::scratch::ScratchDir;
use thin_pool::testing::dir_pool;
use thin_pool::{Pool, PoolOptions};

const BLOCK: u64 = 65536;

fn options() -> PoolOptions {
    PoolOptions {
        commit_interval: None,
        ..PoolOptions::default()
    }
}

fn create(dir: &Path) -> Pool {
    dir_pool(dir, 64 * BLOCK, options())
}

fn origin(pool: &Pool, name: &str) -> Option<String> {
    pool.info(name).unwrap().origin
}

/// The only catalog file in `dir`.
fn catalog_path(dir: &Path) -> std::path::PathBuf {
    let mut found: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            name.starts_with("catalog-") && name.ends_with(".json")
        })
        .collect();
    assert_eq!(found.len(), 1, "{found:?}");
    found.pop().unwrap()
}

#[test]
fn deleted_origin_is_not_replaced_by_a_new_volume_of_its_name_or_id() {
    let scratch = ScratchDir::new("ancestry-reuse");
    let dir = scratch.join("pool");
    let pool = create(&dir);
    pool.create_volume("v1", 4 * BLOCK).unwrap();
    pool.snapshot("v1", "s1", true).unwrap();
    assert_eq!(origin(&pool, "s1").as_deref(), Some("v1"));
    let old_id = pool.info("v1").unwrap().id;
    pool.delete_volume("v1").unwrap();
    assert_eq!(origin(&pool, "s1"), None, "deleted origin");
    // Same name, and (the lowest free id) the same thin id.
    pool.create_volume("v1", 4 * BLOCK).unwrap();
    assert_eq!(pool.info("v1").unwrap().id, old_id, "the id was reused");
    assert_eq!(origin(&pool, "s1"), None, "not the new v1");
    assert_eq!(origin(&pool, "v1"), None);
    // Another name on a reused id.
    pool.snapshot("v1", "s2", false).unwrap();
    let id = pool.info("v1").unwrap().id;
    pool.delete_volume("v1").unwrap();
    pool.create_volume("other", BLOCK).unwrap();
    assert_eq!(pool.info("other").unwrap().id, id);
    assert_eq!(origin(&pool, "s2"), None, "not the volume that took the id");
    drop(pool);
    let pool = Pool::open(&dir, options()).unwrap();
    for name in ["s1", "s2", "other"] {
        assert_eq!(origin(&pool, name), None, "{name} after reopen");
    }
}

#[test]
fn revert_by_delete_and_resnapshot_leaves_no_cycle() {
    let scratch = ScratchDir::new("ancestry-revert");
    let dir = scratch.join("pool");
    let pool = create(&dir);
    pool.create_volume("vm", 4 * BLOCK).unwrap();
    pool.snapshot("vm", "backup", true).unwrap();
    // Revert vm to backup.
    pool.delete_volume("vm").unwrap();
    pool.snapshot("backup", "vm", false).unwrap();
    assert_eq!(origin(&pool, "vm").as_deref(), Some("backup"));
    assert_eq!(origin(&pool, "backup"), None, "no cycle");
    // And again, one level deeper.
    pool.snapshot("vm", "backup2", true).unwrap();
    pool.delete_volume("vm").unwrap();
    pool.snapshot("backup2", "vm", false).unwrap();
    drop(pool);
    let pool = Pool::open(&dir, options()).unwrap();
    assert_eq!(origin(&pool, "vm").as_deref(), Some("backup2"));
    assert_eq!(origin(&pool, "backup2"), None);
    assert_eq!(origin(&pool, "backup"), None);
    // No volume is its own ancestor.
    for volume in pool.list() {
        let mut seen = vec![volume.name.clone()];
        let mut next = volume.origin.clone();
        while let Some(name) = next {
            assert!(!seen.contains(&name), "cycle through {seen:?}");
            seen.push(name.clone());
            next = origin(&pool, &name);
        }
    }
}

#[test]
fn catalog_with_origin_names_is_read_and_rewritten_by_id() {
    let scratch = ScratchDir::new("ancestry-old-catalog");
    let dir = scratch.join("pool");
    let pool = create(&dir);
    pool.create_volume("base", 4 * BLOCK).unwrap();
    pool.snapshot("base", "snap", true).unwrap();
    pool.create_volume("gone", 4 * BLOCK).unwrap();
    pool.snapshot("gone", "orphan", true).unwrap();
    pool.delete_volume("gone").unwrap();
    pool.create_volume("gone", 4 * BLOCK).unwrap();
    drop(pool);
    // Rewrite the catalog as older versions wrote it: origins by name. "orphan" names
    // "gone", which (created after it) is not the volume it was taken of.
    let path = catalog_path(&dir);
    let mut catalog: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for volume in catalog["volumes"].as_array_mut().unwrap() {
        let object = volume.as_object_mut().unwrap();
        object.remove("origin_id");
        let origin = match object["name"].as_str().unwrap() {
            "snap" => serde_json::json!("base"),
            "orphan" => serde_json::json!("gone"),
            _ => serde_json::Value::Null,
        };
        object.insert("origin".into(), origin);
    }
    std::fs::write(&path, serde_json::to_string_pretty(&catalog).unwrap()).unwrap();

    let pool = Pool::open(&dir, options()).unwrap();
    assert_eq!(origin(&pool, "snap").as_deref(), Some("base"));
    assert_eq!(origin(&pool, "orphan"), None, "a later volume of that name");
    // The next change writes origins by id.
    pool.create_volume("new", BLOCK).unwrap();
    let text = std::fs::read_to_string(catalog_path(&dir)).unwrap();
    let catalog: serde_json::Value = serde_json::from_str(&text).unwrap();
    let base_id = pool.info("base").unwrap().id.get();
    for volume in catalog["volumes"].as_array().unwrap() {
        assert!(volume.get("origin").is_none(), "{text}");
        let expected = match volume["name"].as_str().unwrap() {
            "snap" => serde_json::json!(base_id),
            _ => serde_json::Value::Null,
        };
        assert_eq!(volume["origin_id"], expected, "{text}");
    }
}

/// Every volume's chain of origins, checked to end (no volume is its own ancestor).
fn assert_no_cycle(pool: &Pool) {
    for volume in pool.list() {
        let mut seen = vec![volume.name.clone()];
        let mut next = volume.origin.clone();
        while let Some(name) = next {
            assert!(!seen.contains(&name), "cycle through {seen:?}");
            seen.push(name.clone());
            next = origin(pool, &name);
        }
    }
}

/// (name, origin) of every volume.
fn origins(pool: &Pool) -> Vec<(String, Option<String>)> {
    pool.list()
        .into_iter()
        .map(|v| (v.name, v.origin))
        .collect()
}

fn pair(name: &str, origin: Option<&str>) -> (String, Option<String>) {
    (name.to_string(), origin.map(str::to_string))
}

#[test]
fn rename_revert_and_recreated_names_keep_ancestry_by_id() {
    let scratch = ScratchDir::new("ancestry-rename-revert");
    let dir = scratch.join("pool");
    let pool = create(&dir);
    pool.create_volume("vm", 4 * BLOCK).unwrap();
    pool.snapshot("vm", "backup", true).unwrap();
    pool.snapshot("backup", "clone", false).unwrap();

    // Revert: no edge is added, so backup is still vm's snapshot and vm has no origin.
    pool.revert_volume("vm", "backup", false).unwrap();
    assert_eq!(
        origins(&pool),
        [
            pair("backup", Some("vm")),
            pair("clone", Some("backup")),
            pair("vm", None)
        ]
    );
    assert_no_cycle(&pool);

    // Rename: the snapshots follow the new names.
    pool.rename_volume("vm", "vm-old").unwrap();
    pool.rename_volume("backup", "b").unwrap();
    assert_eq!(
        origins(&pool),
        [
            pair("b", Some("vm-old")),
            pair("clone", Some("b")),
            pair("vm-old", None)
        ]
    );
    // A new volume under a renamed-away name is nobody's origin.
    pool.create_volume("vm", BLOCK).unwrap();
    pool.create_volume("backup", BLOCK).unwrap();
    assert_eq!(origin(&pool, "b").as_deref(), Some("vm-old"));
    assert_eq!(origin(&pool, "clone").as_deref(), Some("b"));

    // Revert onto a snapshot with delete: its snapshots lose their origin (it is gone),
    // and the reverted volume's origin is cleared when it was that snapshot.
    pool.revert_volume("clone", "b", true).unwrap();
    assert_eq!(origin(&pool, "clone"), None, "its origin b is deleted");
    pool.revert_volume("vm-old", "clone", true).unwrap();
    assert_eq!(
        origins(&pool),
        [pair("backup", None), pair("vm", None), pair("vm-old", None)]
    );

    // A chain reverted both ways round.
    pool.snapshot("vm", "s1", false).unwrap();
    pool.snapshot("s1", "s2", false).unwrap();
    pool.revert_volume("vm", "s2", false).unwrap();
    pool.revert_volume("s2", "vm", false).unwrap();
    pool.rename_volume("s1", "vm-next").unwrap();
    assert_eq!(origin(&pool, "vm-next").as_deref(), Some("vm"));
    assert_eq!(origin(&pool, "s2").as_deref(), Some("vm-next"));
    assert_eq!(origin(&pool, "vm"), None);
    assert_no_cycle(&pool);
    let before = origins(&pool);
    drop(pool);
    let pool = Pool::open(&dir, options()).unwrap();
    assert_eq!(origins(&pool), before, "after reopen");
    assert_no_cycle(&pool);
}
