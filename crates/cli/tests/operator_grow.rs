//! Goal (issue 25, item 6): growth with names. `thinpool grow --data-size SIZE` grows the
//! data, `thinpool grow --metadata` the metadata (to `--metadata-size`, or to the metadata
//! device's size after it was extended), both offline and online through the control
//! socket; `create --grow` stays as the data grow's alias.
//!
//! Method: file pools (the metadata file extended by hand stands for an extended metadata
//! device: the engine sizes both the same way), sizes read back from `status --json`.

mod e2e_support;

use e2e_support::*;

fn status(p: &str) -> serde_json::Value {
    serde_json::from_str(&thinpool_ok(&["status", "--json", "--pool", p])).unwrap()
}

#[test]
fn grow_names_data_and_metadata_growth_offline_and_online() {
    let scratch = ScratchDir::new("operator-grow");
    let pool = scratch.join("pool");
    let p = pool.to_str().unwrap();
    create_pool(&pool, &["--data-size", "16M", "--metadata-size", "4M"]);
    assert_eq!(status(p)["data_total_blocks"], 256);

    // Offline: data, then metadata to a size.
    let out = thinpool_ok(&["grow", "--data-size", "32M", "--pool", p]);
    assert!(out.contains("grew pool"), "{out}");
    assert_eq!(status(p)["data_total_blocks"], 512);
    let before = status(p)["metadata_total_blocks"].as_u64().unwrap();
    assert_eq!(before, 1024);
    thinpool_ok(&["grow", "--metadata", "--metadata-size", "6M", "--pool", p]);
    assert_eq!(status(p)["metadata_total_blocks"], 1536);
    // A data grow without a size needs block devices.
    let refused = thinpool_err(&["grow", "--pool", p]);
    assert!(refused.contains("--data-size"), "{refused}");

    // Online, through the control socket of the server holding the pool.
    let served = serve(&pool, &["--quiet"]);
    let grown: serde_json::Value = serde_json::from_str(&thinpool_ok(&[
        "grow",
        "--data-size",
        "48M",
        "--json",
        "--pool",
        p,
    ]))
    .unwrap();
    assert_eq!(grown["data_total_blocks"], 768);
    // The metadata "device" extended behind the pool's back, then grown to its size.
    let metadata = std::fs::OpenOptions::new()
        .write(true)
        .open(pool.join("metadata"))
        .unwrap();
    metadata.set_len(8 * MIB).unwrap();
    thinpool_ok(&["grow", "--metadata", "--pool", p]);
    assert_eq!(status(p)["metadata_total_blocks"], 2048);
    // The old name still grows the data.
    thinpool_ok(&["create", "--grow", "--data-size", "64M", "--pool", p]);
    assert_eq!(status(p)["data_total_blocks"], 1024);
    // Shrinking is refused.
    let refused = thinpool_err(&["grow", "--data-size", "16M", "--pool", p]);
    assert!(refused.contains("cannot shrink"), "{refused}");
    assert!(served.stop().success());
    assert_eq!(status(p)["metadata_total_blocks"], 2048);
}
