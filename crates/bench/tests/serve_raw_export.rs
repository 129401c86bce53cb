//! Goal: `thinpool-bench serve --raw-export NAME=FILE` serves a plain file beside the thin
//! volumes, byte for byte (a write lands in the file at its offset, nothing else changes),
//! lists it with the volumes, and keeps volumes from taking its name.
//!
//! Method: serve a pool with a raw export beside a thin volume; list the exports with
//! `nbdinfo`, write and flush with `qemu-io`, read the file back; create a volume of the raw
//! export's name through the control socket.

mod support;

use std::time::Duration;
use support::*;

#[test]
fn raw_file_export_is_served_byte_for_byte_beside_the_volumes() {
    require_tool("nbdinfo", "libnbd-bin");
    require_tool("qemu-io", "qemu-utils");
    let temp = ScratchDir::new("serve-raw");
    let pool = temp.join("pool");
    create_pool(&pool, 64 * MIB);
    create_volume(&pool, "thin", 8 * MIB).expect("create volume thin");
    let raw = temp.join("raw.img");
    sized_file(&raw, 4 * MIB);
    let raw_spec = format!("plain={}", raw.display());
    let served = serve(&pool, &["--raw-export", &raw_spec]);

    let listing = run_ok(
        "nbdinfo",
        &["--list", "--json", &served.uri("")],
        Duration::from_secs(30),
    );
    let listing: serde_json::Value = serde_json::from_str(&listing).unwrap();
    let mut names: Vec<&str> = listing["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|export| export["export-name"].as_str().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["plain", "thin"]);

    run_ok(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0x5a 1M 64K",
            "-c",
            "flush",
            &served.uri("plain"),
        ],
        Duration::from_secs(30),
    );
    let bytes = std::fs::read(&raw).unwrap();
    assert!(bytes[MIB as usize..MIB as usize + 65536]
        .iter()
        .all(|&b| b == 0x5a));
    assert!(bytes[..MIB as usize].iter().all(|&b| b == 0));
    assert!(bytes[MIB as usize + 65536..].iter().all(|&b| b == 0));
    // A volume may not take a raw export's name.
    let error = create_volume(&pool, "plain", MIB).expect_err("a volume named plain");
    assert!(error.to_string().contains("\"plain\""), "{error}");
    assert!(served.stop().success());
}
