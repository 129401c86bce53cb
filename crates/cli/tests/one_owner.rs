//! Goal: one owner at a time (issue 20, finding 2): no command writes a served pool behind
//! its server. `thinpool restore -i x.xml -o POOL/metadata` used to return 0 while `serve`
//! held the pool (the server's lock on the metadata file was not consulted); the server's
//! next commit then interleaved with it and the pool no longer opened.
//!
//! Method: a served pool; each command that writes a pool is run against it from outside.
//! `restore -o` must be refused, naming the serving pid, and leave the metadata's bytes as
//! they were; the management commands (volume, trim, metadata-snap) must go through the
//! server's control socket (the server reports them in its log) rather than write the files;
//! `create` and `import` into the served directory are refused. After the server stops, the
//! pool opens and its volumes are all there.

mod e2e_support;

use e2e_support::*;
use std::path::Path;

fn file_bytes(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

#[test]
fn restore_over_a_served_pools_metadata_is_refused_naming_the_server() {
    let temp = ScratchDir::new("one-owner-restore");
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "64M"]);
    create_volume(&pool, "keep", "16M");
    // Metadata of another pool, as XML.
    let other = temp.join("other");
    create_pool(&other, &["--data-size", "64M"]);
    let xml = temp.join("other.xml");
    thinpool_ok(&[
        "dump",
        other.join("metadata").to_str().unwrap(),
        "-o",
        xml.to_str().unwrap(),
    ]);

    let served = serve(&pool, &[]);
    let metadata = pool.join("metadata");
    let before = file_bytes(&metadata);
    let output = thinpool(&[
        "restore",
        "-i",
        xml.to_str().unwrap(),
        "-o",
        metadata.to_str().unwrap(),
    ]);
    let error = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "restore over a served pool: {error}"
    );
    assert!(
        error.contains(&format!("held by pid {}", served.pid())),
        "the refusal names the server: {error}"
    );
    assert_eq!(file_bytes(&metadata), before, "the metadata is untouched");

    let (status, log) = served.stop_with_log();
    assert!(status.success(), "{log}");
    let listed = thinpool_ok(&["list", "--pool", pool.to_str().unwrap()]);
    assert!(listed.contains("keep"), "{listed}");
    // Not served, the same restore is the operator's to make.
    thinpool_ok(&[
        "restore",
        "-i",
        xml.to_str().unwrap(),
        "-o",
        metadata.to_str().unwrap(),
    ]);
}

#[test]
fn management_commands_go_through_the_server_and_creates_are_refused() {
    let temp = ScratchDir::new("one-owner-manage");
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap().to_string();
    create_pool(&pool, &["--data-size", "64M"]);
    create_volume(&pool, "base", "16M");
    let served = serve(&pool, &[]);
    for args in [
        vec!["volume", "create", "v2", "--size", "8M", "--pool", &p],
        vec!["volume", "snapshot", "base", "snap", "--pool", &p],
        vec!["trim", "--pool", &p],
        vec!["metadata-snap", "reserve", "--pool", &p],
        vec!["metadata-snap", "release", "--pool", &p],
        vec!["volume", "delete", "v2", "--pool", &p],
    ] {
        thinpool_ok(&args);
    }
    let error = thinpool_err(&["create", "--pool", &p, "--data-size", "64M"]);
    assert!(error.contains("already holds a pool"), "{error}");
    let (status, log) = served.stop_with_log();
    assert!(status.success(), "{log}");
    let done = log
        .lines()
        .filter(|line| line.contains("management operation done"))
        .count();
    assert!(done >= 6, "the server carried out every request:\n{log}");
    let listed = thinpool_ok(&["list", "--pool", &p]);
    assert!(
        listed.contains("base") && listed.contains("snap") && !listed.contains("v2"),
        "{listed}"
    );
    thinpool_ok(&["check", pool.join("metadata").to_str().unwrap()]);
}

#[test]
fn a_served_pool_whose_metadata_is_written_behind_its_back_fails_safe() {
    let temp = ScratchDir::new("one-owner-foreign");
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap().to_string();
    create_pool(&pool, &["--data-size", "64M"]);
    create_volume(&pool, "keep", "16M");
    // Another pool's metadata, the same size (and another transaction: two pools made the
    // same way have the same metadata bytes, names and sizes being in the catalog): what a
    // writer that ignores the lock (dd, thin-provisioning-tools' own thin_restore) leaves.
    let other = temp.join("other");
    create_pool(&other, &["--data-size", "64M"]);
    create_volume(&other, "theirs", "8M");
    create_volume(&other, "theirs-too", "8M");
    let foreign = file_bytes(&other.join("metadata"));

    let served = serve(&pool, &[]);
    let metadata = pool.join("metadata");
    assert_eq!(file_bytes(&metadata).len(), foreign.len());
    {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .open(&metadata)
            .unwrap();
        file.write_all(&foreign).unwrap();
        file.sync_all().unwrap();
    }
    let error = thinpool_err(&["volume", "create", "v2", "--size", "8M", "--pool", &p]);
    assert!(
        error.contains("metadata changed under the server") && error.contains("another writer?"),
        "{error}"
    );
    let again = thinpool_err(&["volume", "create", "v3", "--size", "8M", "--pool", &p]);
    assert!(!again.is_empty(), "a failed pool refuses further changes");
    let (_status, log) = served.stop_with_log();
    assert!(log.contains("changed under the server"), "logged:\n{log}");
    assert_eq!(file_bytes(&metadata), foreign, "nothing written over it");
    thinpool_ok(&["check", metadata.to_str().unwrap()]);
}
