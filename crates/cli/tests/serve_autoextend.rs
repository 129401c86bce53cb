//! Goal: a served pool with autoextend on grows its sparse data file as clients write, so
//! writes never see ENOSPC until `--autoextend-max` (even with `--error-if-no-space`), then
//! do; `status` shows the low-water mark crossed at its threshold (not at 100%) and the
//! autoextend settings; `serve` flags override `pool.json` for the run.
//!
//! Method: a 1 MiB pool (16 blocks of 64 KiB); nbdcopy writes 4 MiB through NBD; our raw
//! client writes past the maximum and reads everything back against what was written.

mod e2e_support;

use e2e_support::*;
use std::time::Duration;

const BLOCK: u64 = 64 * 1024;

fn status(pool: &str) -> serde_json::Value {
    serde_json::from_str(&thinpool_ok(&["status", "--json", "--pool", pool])).unwrap()
}

#[test]
fn writes_see_no_enospc_until_the_autoextend_maximum() {
    require_tool("nbdcopy", "libnbd-bin");
    let temp = ScratchDir::new("serve-autoextend");
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap();
    create_pool(
        &pool,
        &[
            "--data-size",
            "1M",
            "--error-if-no-space",
            "--low-water",
            "75",
            "--autoextend-threshold",
            "50",
            "--autoextend-by",
            "50%",
            "--autoextend-max",
            "4M",
        ],
    );
    create_volume(&pool, "big", "8M");
    let stored = status(p);
    assert_eq!(stored["autoextend"]["threshold_percent"], 50);
    assert_eq!(stored["autoextend"]["max_bytes"], 4 * MIB);
    assert_eq!(stored["low_water_percent"], 75);

    let source = temp.join("source");
    let contents: Vec<u8> = (0..64).flat_map(|b| pattern(b, BLOCK as usize)).collect();
    std::fs::write(&source, &contents).unwrap();
    let served = serve(&pool, &["--quiet"]);
    run_ok(
        "nbdcopy",
        &[source.to_str().unwrap(), &served.uri("big")],
        Duration::from_secs(120),
    );
    let grown = status(p);
    assert_eq!(grown["data_total_blocks"], 64, "grown to the maximum");
    assert_eq!(grown["data_used_blocks"], 64);
    assert_eq!(grown["low_water_reached"], true);
    assert_eq!(grown["mode"], "rw");

    let mut client = Client::open(&served.socket, "big");
    assert_eq!(
        client.write_errno(64 * BLOCK, &pattern(64, BLOCK as usize)),
        ENOSPC,
        "past the maximum"
    );
    assert_eq!(client.read(0, 64 * BLOCK), contents);
    client.disconnect();
    let text = thinpool_ok(&["status", "--pool", p]);
    assert!(text.contains("autoextend:"), "{text}");
    assert!(text.contains("at 50% use, by 50%, up to 4.00MiB"), "{text}");
    assert!(served.stop().success());
    // The data file grew on the host.
    assert_eq!(std::fs::metadata(pool.join("data")).unwrap().len(), 4 * MIB);
}

#[test]
fn the_low_water_mark_is_reached_at_its_threshold_and_serve_overrides_it() {
    let temp = ScratchDir::new("serve-low-water");
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap();
    create_pool(&pool, &["--data-size", "1M", "--error-if-no-space"]);
    create_volume(&pool, "v", "2M");
    assert_eq!(status(p)["low_water_percent"], 80, "the default");
    // For this run: 50%, and autoextend by a size.
    let served = serve(
        &pool,
        &[
            "--quiet",
            "--low-water",
            "50",
            "--autoextend-threshold",
            "90",
            "--autoextend-by",
            "512K",
            "--autoextend-max",
            "2M",
        ],
    );
    let mut client = Client::open(&served.socket, "v");
    for block in 0..7 {
        client.write(block * BLOCK, &pattern(block, BLOCK as usize));
    }
    let below = status(p);
    assert_eq!(below["low_water_reached"], false, "7 of 16 blocks");
    assert_eq!(below["low_water_percent"], 50);
    client.write(7 * BLOCK, &pattern(7, BLOCK as usize));
    let reached = status(p);
    assert_eq!(reached["data_used_blocks"], 8);
    assert_eq!(reached["low_water_reached"], true, "8 of 16 blocks: 50%");
    for block in 8..32 {
        client.write(block * BLOCK, &pattern(block, BLOCK as usize));
    }
    client.flush();
    let full = status(p);
    assert_eq!(full["data_total_blocks"], 32);
    assert_eq!(full["autoextend"]["by_bytes"], 512 * 1024);
    for block in 0..32 {
        assert_eq!(
            client.read(block * BLOCK, BLOCK),
            pattern(block, BLOCK as usize)
        );
    }
    client.disconnect();
    assert!(served.stop().success());
    // pool.json was not changed by serve's flags.
    let after = status(p);
    assert_eq!(after["low_water_percent"], 80);
    assert!(after["autoextend"].is_null(), "{after}");
}

#[test]
fn help_shows_an_example() {
    for command in ["create", "serve"] {
        let help = thinpool_ok(&[command, "--help"]);
        assert!(
            help.contains("--autoextend-threshold 70 --autoextend-by 20% --autoextend-max 100G"),
            "{command} --help: {help}"
        );
    }
}

#[test]
fn serve_sets_the_no_space_timeout_for_the_run() {
    let temp = ScratchDir::new("serve-no-space-timeout");
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap();
    // Queue policy, and a timeout of 60 s in pool.json.
    create_pool(&pool, &["--data-size", "1M"]);
    create_volume(&pool, "v", "2M");
    assert_eq!(status(p)["no_space_timeout_seconds"], 60);
    let served = serve(&pool, &["--quiet", "--no-space-timeout", "1"]);
    assert_eq!(status(p)["no_space_timeout_seconds"], 1);
    let mut client = Client::open(&served.socket, "v");
    for block in 0..16 {
        client.write(block * BLOCK, &pattern(block, BLOCK as usize));
    }
    // Queued for a second (not 60), then ENOSPC.
    assert_eq!(
        client.write_errno(16 * BLOCK, &pattern(16, BLOCK as usize)),
        ENOSPC
    );
    assert_eq!(status(p)["mode"], "out_of_data_space");
    client.disconnect();
    assert!(served.stop().success());
}
