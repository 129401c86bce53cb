//! Goal: `thinpool metadata-snap reserve|release` lets the real thin-provisioning-tools
//! (1.1.0) read a pool that `thinpool serve` is changing: `thin_ls -m`, `thin_delta -m` and
//! `thin_dump -m` see the pool as it was at the reservation, whatever is written after; a
//! second reservation is refused; `list --ids` gives the thin ids the tools speak of;
//! after the release (and the server's exit) thin_check passes and `-m` finds nothing.
//! Method: serve a pool, write over NBD, snapshot, break sharing, reserve, write more, run
//! the tools on the metadata file while serving, release, stop, check.

mod e2e_support;

use e2e_support::*;
use std::collections::BTreeMap;
use testkit::tools::ThinTools;

const BLOCK: u64 = 64 * 1024;

/// name → (thin id, origin's thin id) from `list --ids`.
fn ids(pool: &str) -> BTreeMap<String, (u64, Option<u64>)> {
    let table = thinpool_ok(&["list", "--ids", "--pool", pool]);
    let mut lines = table.lines();
    assert_eq!(
        lines.next().unwrap().split_whitespace().collect::<Vec<_>>(),
        ["THIN_ID", "NAME", "ORIGIN_ID"]
    );
    lines
        .map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let origin = match fields[2] {
                "-" => None,
                id => Some(id.parse().unwrap()),
            };
            (fields[1].to_string(), (fields[0].parse().unwrap(), origin))
        })
        .collect()
}

/// `mapped_blocks` of device `id` in a thin_dump.
fn dumped_mapped_blocks(dump: &str, id: u64) -> u64 {
    let marker = format!("<device dev_id=\"{id}\" mapped_blocks=\"");
    let start = dump.find(&marker).unwrap_or_else(|| panic!("{dump}")) + marker.len();
    dump[start..].split('"').next().unwrap().parse().unwrap()
}

#[test]
fn real_tools_read_a_served_pool_through_a_metadata_snapshot() {
    let tools = ThinTools::v1_1();
    let scratch = ScratchDir::new("metadata-snap");
    let dir = scratch.join("pool");
    let p = dir.to_str().unwrap();
    let metadata = dir.join("metadata");
    create_pool(&dir, &["--data-size", "64M"]);
    create_volume(&dir, "base", "4M");
    let served = serve(&dir, &[]);
    let mut base = Client::open(&served.socket, "base");
    for block in 0..8 {
        base.write(block * BLOCK, &pattern(block, BLOCK as usize));
    }
    base.flush();
    thinpool_ok(&["volume", "snapshot", "base", "snap", "--pool", p]);
    base.write(0, &pattern(100, 2 * BLOCK as usize));
    base.flush();

    let names = ids(p);
    let (base_id, base_origin) = names["base"];
    let (snap_id, snap_origin) = names["snap"];
    assert_eq!(base_origin, None);
    assert_eq!(snap_origin, Some(base_id));

    let reserved = thinpool_ok(&["metadata-snap", "reserve", "--pool", p]);
    assert!(
        reserved.contains("reserved metadata snapshot at block"),
        "{reserved}"
    );
    let status: serde_json::Value =
        serde_json::from_str(&thinpool_ok(&["status", "--json", "--pool", p])).unwrap();
    let block = status["metadata_snap_block"]
        .as_u64()
        .expect("a held snapshot");
    assert!(reserved.contains(&format!("block {block}:")), "{reserved}");
    let again = thinpool_err(&["metadata-snap", "reserve", "--pool", p]);
    assert!(again.contains("EBUSY"), "{again}");

    // Written after the reservation: not in what -m shows.
    for block in 8..12 {
        base.write(block * BLOCK, &pattern(block, BLOCK as usize));
    }
    base.flush();

    let dump = tools.dump(&metadata, &["-m"]);
    assert_eq!(dumped_mapped_blocks(&dump, base_id), 8, "{dump}");
    assert_eq!(dumped_mapped_blocks(&dump, snap_id), 8, "{dump}");
    let live = tools.dump(&metadata, &[]);
    assert_eq!(dumped_mapped_blocks(&live, base_id), 12, "{live}");

    let ls = tools.ls(
        &metadata,
        &["-m", "--no-headers", "-o", "DEV,MAPPED_BLOCKS"],
    );
    ls.assert_success();
    let rows: Vec<Vec<u64>> = ls
        .stdout
        .lines()
        .map(|line| {
            line.split_whitespace()
                .map(|f| f.parse().unwrap())
                .collect()
        })
        .collect();
    assert_eq!(rows, [vec![base_id, 8], vec![snap_id, 8]], "{}", ls.stdout);

    let snap1 = base_id.to_string();
    let snap2 = snap_id.to_string();
    let delta = tools.delta(&metadata, &["-m", "--snap1", &snap1, "--snap2", &snap2]);
    delta.assert_success();
    assert!(
        delta
            .stdout
            .contains(r#"<different begin="0" length="2"/>"#)
            && delta.stdout.contains(r#"<same begin="2" length="6"/>"#),
        "{}",
        delta.stdout
    );

    let released = thinpool_ok(&["metadata-snap", "release", "--pool", p, "--json"]);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&released).unwrap()["metadata_snap_block"],
        serde_json::Value::Null
    );
    let again = thinpool_err(&["metadata-snap", "release", "--pool", p]);
    assert!(
        again.contains("cannot release the metadata snapshot"),
        "{again}"
    );
    base.disconnect();
    assert!(served.stop().success());

    tools.check(&metadata).assert_success();
    tools.ls(&metadata, &["-m"]).assert_failure();

    // Offline too: reserve on a closed pool, read it, release.
    thinpool_ok(&["metadata-snap", "reserve", "--pool", p]);
    let dump = tools.dump(&metadata, &["-m"]);
    assert_eq!(dumped_mapped_blocks(&dump, base_id), 12, "{dump}");
    tools.check(&metadata).assert_success();
    thinpool_ok(&["metadata-snap", "release", "--pool", p]);
    tools.check(&metadata).assert_success();
}
