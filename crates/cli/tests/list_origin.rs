//! Goal: `thinpool list` shows a snapshot's origin only while that volume exists (issue 9,
//! reproduction 9): after `v1` is deleted and a new `v1` created, the old snapshot shows
//! `-` (null in `--json`), not the new volume; a revert by delete-and-resnapshot shows one
//! origin, no cycle.
//! Method: drive the binary on a pool in a scratch directory and read `list` and
//! `list --json` after each step.

mod e2e_support;

use e2e_support::*;

/// The ORIGIN column of `name`'s row in the `list` table.
fn origin_column(pool: &str, name: &str) -> String {
    let table = thinpool_ok(&["list", "--pool", pool]);
    let row = table
        .lines()
        .find(|line| line.split_whitespace().next() == Some(name))
        .unwrap_or_else(|| panic!("no row for {name}:\n{table}"));
    row.split_whitespace().nth(7).unwrap().to_string()
}

#[test]
fn deleted_origin_shows_as_dash_and_null() {
    let scratch = ScratchDir::new("list-origin");
    let dir = scratch.join("pool");
    create_pool(&dir, &["--data-size", "64M"]);
    let pool = dir.to_str().unwrap();
    create_volume(&dir, "v1", "4M");
    thinpool_ok(&["volume", "snapshot", "v1", "s1", "--pool", pool]);
    assert_eq!(origin_column(pool, "s1"), "v1");
    thinpool_ok(&["volume", "delete", "v1", "--pool", pool]);
    create_volume(&dir, "v1", "4M");
    assert_eq!(origin_column(pool, "s1"), "-");
    assert_eq!(
        origins(pool),
        [("s1".to_string(), None), ("v1".to_string(), None)]
    );

    // Revert v1 to s1 by delete and resnapshot: one origin, no cycle.
    thinpool_ok(&["volume", "delete", "v1", "--pool", pool]);
    thinpool_ok(&["volume", "snapshot", "s1", "v1", "--pool", pool]);
    assert_eq!(
        origins(pool),
        [
            ("s1".to_string(), None),
            ("v1".to_string(), Some("s1".to_string()))
        ]
    );
}
