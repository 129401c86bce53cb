//! Goal: `thinpool list` reports, per volume, the bytes mapped, held exclusively and shared
//! with the meaning of the real `thin_ls -o MAPPED_BYTES,EXCLUSIVE_BYTES,SHARED_BYTES`
//! (1.1.0), on a served pool (against `thin_ls -m` on a metadata snapshot reserved with
//! `thinpool metadata-snap reserve`) and on the closed pool (against `thin_ls`).
//! Method: serve a pool, write blocks over NBD into a volume, snapshot it twice, break
//! sharing in the origin and a snapshot, discard some blocks of the other, write a volume
//! of its own; compare `list --json` (and the table's columns) with thin_ls's rows, by
//! thin id, served and closed.

mod e2e_support;

use e2e_support::*;
use std::collections::BTreeMap;
use testkit::tools::ThinTools;

const BLOCK: u64 = 64 * 1024;

/// thin id → (mapped, exclusive, shared) bytes.
type Figures = BTreeMap<u64, (u64, u64, u64)>;

fn from_list(pool: &str) -> Figures {
    listed_volumes(pool)
        .iter()
        .map(|v| {
            let field = |name: &str| {
                v[name]
                    .as_u64()
                    .unwrap_or_else(|| panic!("list --json lacks {name}: {v}"))
            };
            (
                field("id"),
                (
                    field("mapped_bytes"),
                    field("exclusive_bytes"),
                    field("shared_bytes"),
                ),
            )
        })
        .collect()
}

fn from_thin_ls(metadata: &std::path::Path, snapshot: bool) -> Figures {
    let mut args = vec![
        "--no-headers",
        "-o",
        "DEV,MAPPED_BYTES,EXCLUSIVE_BYTES,SHARED_BYTES",
    ];
    if snapshot {
        args.push("-m");
    }
    let output = ThinTools::v1_1().ls(metadata, &args);
    output.assert_success();
    output
        .stdout
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let numbers: Vec<u64> = line
                .split_whitespace()
                .map(|field| field.parse().unwrap_or_else(|_| panic!("{line:?}")))
                .collect();
            assert_eq!(numbers.len(), 4, "{line:?}");
            (numbers[0], (numbers[1], numbers[2], numbers[3]))
        })
        .collect()
}

fn write_blocks(client: &mut Client, blocks: impl IntoIterator<Item = u64>, seed: u64) {
    for block in blocks {
        client.write(block * BLOCK, &pattern(seed + block, BLOCK as usize));
    }
    client.flush();
}

#[test]
fn list_space_matches_thin_ls_served_and_closed() {
    let scratch = ScratchDir::new("list-accounting");
    let dir = scratch.join("pool");
    let p = dir.to_str().unwrap();
    create_pool(&dir, &["--data-size", "64M", "--block-size", "64K"]);
    create_volume(&dir, "base", "8M");
    create_volume(&dir, "alone", "8M");
    let served = serve(&dir, &[]);

    let mut base = Client::open(&served.socket, "base");
    write_blocks(&mut base, 0..40, 1);
    thinpool_ok(&["volume", "snapshot", "base", "snap1", "--pool", p]);
    thinpool_ok(&["volume", "snapshot", "snap1", "snap2", "--pool", p]);
    // Break sharing in base (10 blocks) and in snap1 (5), add 5 new blocks to snap1.
    write_blocks(&mut base, 0..10, 100);
    let mut snap1 = Client::open(&served.socket, "snap1");
    write_blocks(&mut snap1, (30..35).chain(50..55), 200);
    // Unmap 3 shared blocks from snap2.
    let mut snap2 = Client::open(&served.socket, "snap2");
    let trim = snap2.request(CMD_TRIM, 0, 20 * BLOCK, 3 * BLOCK, &[]);
    assert_eq!(trim.error, 0, "trim");
    snap2.flush();
    let mut alone = Client::open(&served.socket, "alone");
    write_blocks(&mut alone, [0, 7, 100], 300);

    let listed = from_list(p);
    // The model: base maps 40 (10 its own), snap1 45 (10 its own), snap2 37 (none its own);
    // alone 3 of its own.
    let ids: BTreeMap<String, u64> =
        serde_json::from_str::<serde_json::Value>(&thinpool_ok(&["list", "--json", "--pool", p]))
            .unwrap()["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| {
                (
                    v["name"].as_str().unwrap().to_string(),
                    v["id"].as_u64().unwrap(),
                )
            })
            .collect();
    let expect = |name: &str, mapped: u64, exclusive: u64| {
        let figures = listed[&ids[name]];
        assert_eq!(
            figures,
            (
                mapped * BLOCK,
                exclusive * BLOCK,
                (mapped - exclusive) * BLOCK
            ),
            "{name}"
        );
    };
    expect("base", 40, 10);
    expect("snap1", 45, 10);
    expect("snap2", 37, 0);
    expect("alone", 3, 3);

    // Served: thin_ls on a metadata snapshot of the live metadata.
    thinpool_ok(&["metadata-snap", "reserve", "--pool", p]);
    let metadata = dir.join("metadata");
    assert_eq!(from_thin_ls(&metadata, true), listed, "served, thin_ls -m");
    thinpool_ok(&["metadata-snap", "release", "--pool", p]);

    // The table shows the same figures in human units.
    let table = thinpool_ok(&["list", "--pool", p]);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "NAME",
            "ID",
            "SIZE",
            "MAPPED%",
            "MAPPED",
            "EXCLUSIVE",
            "SHARED",
            "ORIGIN",
            "READ-ONLY",
            "OPEN"
        ]
    );
    let row: Vec<&str> = table
        .lines()
        .find(|line| line.starts_with("snap1 "))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(row[4..7], ["2.81MiB", "640.00KiB", "2.19MiB"], "{table}");

    for client in [base, snap1, snap2, alone] {
        client.disconnect();
    }
    assert!(served.stop().success());

    // Closed: thin_ls on the metadata as the pool left it.
    assert_eq!(from_thin_ls(&metadata, false), listed, "closed, thin_ls");
    assert_eq!(from_list(p), listed, "closed, list");
}
