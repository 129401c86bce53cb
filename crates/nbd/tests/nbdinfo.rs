//! Goal: libnbd's `nbdinfo` (a client no one here wrote) understands our handshake, LIST,
//! INFO items, meta-context listing and BLOCK_STATUS.
//! Method: serve a MemoryExport with a known allocation layout on a Unix socket in a temp
//! dir, run `nbdinfo`, `nbdinfo --list`, `nbdinfo --json` and `nbdinfo --map`, and compare.
#![allow(clippy::big_endian_bytes)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use nbd::{Export, MemoryExport};

const TIMEOUT: Duration = Duration::from_secs(20);

fn server() -> TestServer {
    let disk = MemoryExport::new("disk", 16 * MIB).with_description("first disk");
    // Data at [1 MiB, 2 MiB) and [8 MiB, 8 MiB + 64 KiB); everything else is a hole.
    disk.write_at(MIB, &vec![0xaa; MIB as usize], false)
        .unwrap();
    disk.write_at(8 * MIB, &vec![0xbb; 64 * 1024], false)
        .unwrap();
    let other = MemoryExport::new("other", 4 * MIB).with_read_only(true);
    TestServer::start(vec![Arc::new(disk), Arc::new(other)])
}

#[test]
fn nbdinfo_shows_size_flags_name_and_description() {
    require_tool("nbdinfo", "libnbd-bin");
    let server = server();
    let output = run_ok("nbdinfo", &[&server.uri("disk")], TIMEOUT);
    assert!(output.contains("export-size: 16777216"), "{output}");
    assert!(output.contains("description: first disk"), "{output}");
    assert!(output.contains("is_read_only: false"), "{output}");
    assert!(output.contains("can_multi_conn: true"), "{output}");
    assert!(output.contains("can_fast_zero: true"), "{output}");
    assert!(output.contains("base:allocation"), "{output}");
    assert!(output.contains("block_size_minimum: 512"), "{output}");
    assert!(output.contains("block_size_maximum: 33554432"), "{output}");
    let output = run_ok("nbdinfo", &[&server.uri("other")], TIMEOUT);
    assert!(output.contains("is_read_only: true"), "{output}");
}

#[test]
fn nbdinfo_list_shows_every_export() {
    require_tool("nbdinfo", "libnbd-bin");
    let server = server();
    let output = run_ok("nbdinfo", &["--list", &server.uri("")], TIMEOUT);
    assert!(output.contains("export=\"disk\""), "{output}");
    assert!(output.contains("export=\"other\""), "{output}");
    assert!(output.contains("first disk"), "{output}");
    let json = run_ok("nbdinfo", &["--json", "--list", &server.uri("")], TIMEOUT);
    assert!(json.contains("\"export-name\": \"disk\""), "{json}");
}

#[test]
fn nbdinfo_map_reports_data_and_holes() {
    require_tool("nbdinfo", "libnbd-bin");
    let server = server();
    let output = run_ok("nbdinfo", &["--map", &server.uri("disk")], TIMEOUT);
    let rows: Vec<(u64, u64, u32)> = output
        .lines()
        .map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (
                fields[0].parse().unwrap(),
                fields[1].parse().unwrap(),
                fields[2].parse().unwrap(),
            )
        })
        .collect();
    let expected = vec![
        (0, MIB, 3),
        (MIB, MIB, 0),
        (2 * MIB, 6 * MIB, 3),
        (8 * MIB, 64 * 1024, 0),
        (8 * MIB + 64 * 1024, 8 * MIB - 64 * 1024, 3),
    ];
    assert_eq!(rows, expected, "{output}");
    let totals = run_ok(
        "nbdinfo",
        &["--map", "--totals", &server.uri("disk")],
        TIMEOUT,
    );
    assert!(totals.contains("hole,zero"), "{totals}");
}
