//! Goal: the management commands work on a pool no server holds, with the documented syntax,
//! text output and `--json` shapes, and the options chosen at create persist.
//!
//! Method: drive the binary: create a pool, create, snapshot, resize and delete volumes, read
//! `list` and `status` as text and JSON, and check errors (duplicates, missing pool, bad
//! sizes). Pool resolution: `--pool`, then `$THINPOOL_POOL`, then `./thinpool-pool`.

mod e2e_support;

use e2e_support::*;
use std::time::Duration;

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}):\n{text}"))
}

#[test]
fn volume_lifecycle_offline_with_text_and_json_output() {
    let temp = ScratchDir::new("volume-cli");
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap();
    let created = thinpool_ok(&[
        "create",
        "--pool",
        p,
        "--data-size",
        "256M",
        "--block-size",
        "128K",
    ]);
    assert!(created.contains("created pool"), "{created}");
    assert!(pool.join("pool.json").is_file());

    let out = thinpool_ok(&["volume", "create", "vm", "--size", "64M", "--pool", p]);
    assert_eq!(out, "created volume \"vm\" (id 0, 64.00MiB)\n");
    let out = thinpool_ok(&[
        "volume",
        "snapshot",
        "vm",
        "snap",
        "--read-only",
        "--pool",
        p,
    ]);
    assert_eq!(
        out,
        "created snapshot of \"vm\": \"snap\" (id 1, 64.00MiB, read-only)\n"
    );
    let out = thinpool_ok(&["volume", "snapshot", "vm", "clone", "--pool", p, "--json"]);
    let clone = json(&out);
    assert_eq!(clone["name"], "clone");
    assert_eq!(clone["origin"], "vm");
    assert_eq!(clone["read_only"], false);
    assert_eq!(clone["id"], 2);

    let out = thinpool_ok(&["volume", "resize", "vm", "--size", "1G", "--pool", p]);
    assert_eq!(out, "resized volume \"vm\" (id 0, 1.00GiB)\n");

    let list = thinpool_ok(&["list", "--pool", p]);
    let expected = "\
NAME   ID      SIZE  MAPPED%  MAPPED  EXCLUSIVE  SHARED  ORIGIN  READ-ONLY  OPEN
clone   2  64.00MiB     0.00      0B         0B      0B  vm      no            0
snap    1  64.00MiB     0.00      0B         0B      0B  vm      yes           0
vm      0   1.00GiB     0.00      0B         0B      0B  -       no            0
";
    assert_eq!(list, expected);

    let listing = json(&thinpool_ok(&["list", "--json", "--pool", p]));
    let volumes = listing["volumes"].as_array().unwrap();
    assert_eq!(volumes.len(), 3);
    let vm = volumes.iter().find(|v| v["name"] == "vm").unwrap();
    for key in [
        "name",
        "id",
        "size_bytes",
        "mapped_blocks",
        "mapped_percent",
        "block_size_bytes",
        "origin",
        "read_only",
        "open_count",
        "mapped_bytes",
        "exclusive_bytes",
        "shared_bytes",
    ] {
        assert!(vm.get(key).is_some(), "list --json lacks {key}: {vm}");
    }
    assert_eq!(vm["size_bytes"], 1u64 << 30);
    assert_eq!(vm["block_size_bytes"], 128 * 1024);
    assert!(vm["origin"].is_null());

    let out = thinpool_ok(&["volume", "delete", "clone", "--pool", p]);
    assert_eq!(out, "deleted volume \"clone\"\n");
    let out = thinpool_ok(&["volume", "delete", "snap", "--pool", p, "--json"]);
    assert_eq!(json(&out)["name"], "snap", "the deleted volume, as it was");

    let status = thinpool_ok(&["status", "--pool", p]);
    for line in [
        "data:              0/2048 blocks (0.00%), 0B of 256.00MiB, block size 128.00KiB",
        "mode:              rw",
        "needs_check:       no",
        "volumes:           1",
    ] {
        assert!(status.contains(line), "status lacks {line:?}:\n{status}");
    }
    assert!(status.contains("metadata:          "), "{status}");
    assert!(status.contains("transaction id:    "), "{status}");
    let status = json(&thinpool_ok(&["status", "--json", "--pool", p]));
    assert_eq!(status["data_total_blocks"], 2048);
    assert_eq!(status["data_used_blocks"], 0);
    assert_eq!(status["mode"], "rw");
    assert_eq!(status["needs_check"], false);
    assert_eq!(status["volume_count"], 1);
    assert!(status["transaction_id"].as_u64().unwrap() >= 5);
    assert!(status["metadata_total_blocks"].as_u64().unwrap() > 0);
    assert!(status["metadata_used_percent"].as_f64().unwrap() > 0.0);

    // The data device grows (offline here).
    let grown = json(&thinpool_ok(&[
        "create",
        "--grow",
        "--data-size",
        "512M",
        "--pool",
        p,
        "--json",
    ]));
    assert_eq!(grown["data_total_blocks"], 4096);
}

#[test]
fn errors_are_clear_and_fail() {
    let temp = ScratchDir::new("volume-errors");
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap();
    let error = thinpool_err(&["list", "--pool", p]);
    assert!(error.contains("no pool in"), "{error}");
    create_pool(&pool, &["--data-size", "64M"]);
    let error = thinpool_err(&["create", "--pool", p]);
    assert!(error.contains("already holds a pool"), "{error}");
    create_volume(&pool, "a", "1M");
    let error = thinpool_err(&["volume", "create", "a", "--size", "1M", "--pool", p]);
    assert!(error.contains("cannot create volume \"a\""), "{error}");
    assert!(error.contains("exists"), "{error}");
    let error = thinpool_err(&["volume", "create", "b", "--size", "12X", "--pool", p]);
    assert!(error.contains("unknown suffix"), "{error}");
    let error = thinpool_err(&["volume", "delete", "nope", "--pool", p]);
    assert!(error.contains("cannot delete volume \"nope\""), "{error}");
    let error = thinpool_err(&["volume", "snapshot", "nope", "s", "--pool", p]);
    assert!(error.contains("cannot snapshot"), "{error}");
    let error = thinpool_err(&["volume", "resize", "a", "--size", "100K", "--pool", p]);
    assert!(error.contains("cannot resize volume \"a\""), "{error}");
    let error = thinpool_err(&["create", "--grow", "--data-size", "1M", "--pool", p]);
    assert!(error.contains("cannot shrink"), "{error}");
}

#[test]
fn create_options_persist_in_pool_json() {
    let temp = ScratchDir::new("volume-options");
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap();
    create_pool(
        &pool,
        &[
            "--data-size",
            "64M",
            "--metadata-size",
            "4M",
            "--no-zero",
            "--error-if-no-space",
        ],
    );
    let stored = json(&std::fs::read_to_string(pool.join("pool.json")).unwrap());
    assert_eq!(stored["zero_new_blocks"], false);
    assert_eq!(stored["error_if_no_space"], true);
    let status = json(&thinpool_ok(&["status", "--json", "--pool", p]));
    assert_eq!(status["zero_new_blocks"], false);
    assert_eq!(status["error_if_no_space"], true);
    assert_eq!(status["metadata_total_blocks"], 1024);
    let text = thinpool_ok(&["status", "--pool", p]);
    assert!(text.contains("zero new blocks:   no"), "{text}");
    assert!(text.contains("error_if_no_space: yes"), "{text}");
}

#[test]
fn pool_directory_comes_from_the_environment_or_the_working_directory() {
    let temp = ScratchDir::new("volume-env");
    // Default: ./thinpool-pool in the working directory.
    let output = run_tool_in(
        THINPOOL,
        &["create", "--data-size", "64M"],
        Duration::from_secs(60),
        Some(temp.path()),
        &[],
    );
    assert!(output.status.success(), "{output:?}");
    assert!(temp.join("thinpool-pool").join("metadata").is_file());
    // $THINPOOL_POOL.
    let other = temp.join("other");
    let other_str = other.to_str().unwrap();
    let output = run_tool_in(
        THINPOOL,
        &["create", "--data-size", "64M"],
        Duration::from_secs(60),
        Some(temp.path()),
        &[("THINPOOL_POOL", other_str)],
    );
    assert!(output.status.success(), "{output:?}");
    assert!(other.join("metadata").is_file());
    let output = run_tool_in(
        THINPOOL,
        &["volume", "create", "env", "--size", "1M"],
        Duration::from_secs(60),
        Some(temp.path()),
        &[("THINPOOL_POOL", other_str)],
    );
    assert!(output.status.success(), "{output:?}");
    let list = thinpool_ok(&["list", "--pool", other_str]);
    assert!(list.contains("env"), "{list}");
    let list = thinpool_ok(&[
        "list",
        "--pool",
        temp.join("thinpool-pool").to_str().unwrap(),
    ]);
    assert!(!list.contains("env"), "{list}");
}
