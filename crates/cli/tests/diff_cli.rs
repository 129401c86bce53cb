//! Goal: `thinpool diff` reports what differs between two volumes: `--format xml` (and with
//! `--verbose`) exactly as thin_delta 1.1.0 prints it for the same metadata, `--json` the byte ranges of known
//! writes, and the same answers through a served pool's control socket, including writes
//! not committed yet.
//! Method: a pool made with the binary and filled through the library (writes, overwrites,
//! discards, snapshots of snapshots, an unrelated volume), closed; `thinpool diff` on every
//! pair of volumes against `thin_delta --thin1 ID --thin2 ID` on the pool's metadata file,
//! byte for byte (ours opens the pool read-only: the metadata file stays as it was); then
//! the pool is served, a block written over NBD (no flush), and the diff asked again
//! through the server.

mod e2e_support;

use e2e_support::*;
use testkit::tools::ThinTools;
use thin_pool::{Pool, PoolOptions};

const BLOCK: u64 = 65536;

/// Write 4 KiB at the start of each listed block (provisioning it or writing in place).
fn write_blocks(pool: &Pool, name: &str, blocks: impl IntoIterator<Item = u64>, fill: u8) {
    let volume = pool.volume(name).unwrap();
    let data = vec![fill; 4096];
    for block in blocks {
        volume.write(block * BLOCK, &data, false).unwrap();
    }
}

/// A closed pool in `dir`: `a` with 5000 mapped blocks, snapshots `s1` (of `a`) and `s2`
/// (of `s1`) with changes of their own, `a` changed after the snapshots, `other` unrelated.
fn fill(dir: &std::path::Path) {
    create_pool(dir, &["--data-size", "1G"]);
    let pool = Pool::open(dir, PoolOptions::default()).unwrap();
    pool.create_volume("a", 512 * MIB).unwrap();
    write_blocks(&pool, "a", (0..4000).filter(|b| b % 4 != 1), 1);
    // A run of 2000 mapped blocks, across many leaves.
    write_blocks(&pool, "a", 4000..6000, 1);
    pool.snapshot("a", "s1", false).unwrap();
    write_blocks(&pool, "s1", [3, 4, 5, 100, 2001, 5000], 2);
    pool.volume("s1")
        .unwrap()
        .discard(700 * BLOCK, 50 * BLOCK)
        .unwrap();
    pool.snapshot("s1", "s2", false).unwrap();
    write_blocks(&pool, "s2", (1000..1300).step_by(3), 3);
    write_blocks(&pool, "a", [0, 8, 3999, 7000], 4);
    pool.create_volume("other", 64 * MIB).unwrap();
    write_blocks(&pool, "other", 2..40, 5);
    pool.close().unwrap();
}

fn ids(pool: &str) -> Vec<(String, u64)> {
    listed_volumes(pool)
        .iter()
        .map(|v| {
            (
                v["name"].as_str().unwrap().to_string(),
                v["id"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn thin_delta(
    tools: &ThinTools,
    metadata: &std::path::Path,
    left: u64,
    right: u64,
    verbose: bool,
) -> String {
    let (left, right) = (left.to_string(), right.to_string());
    let mut args = vec!["--thin1", &left, "--thin2", &right];
    if verbose {
        args.push("--verbose");
    }
    args.push(metadata.to_str().unwrap());
    let output = tools.run("thin_delta", &args);
    output.assert_success();
    output.stdout
}

/// Every pair of volumes, `--format xml` (and `--verbose`) against thin_delta 1.1.0.
fn assert_xml_matches_thin_delta(pool: &str, metadata: &std::path::Path) {
    let tools = ThinTools::v1_1();
    // `list` opens the pool read-write (and commits at close); `diff` opens it read-only.
    let volumes = ids(pool);
    let before = std::fs::read(metadata).unwrap();
    assert_eq!(volumes.len(), 4);
    for (left, left_id) in &volumes {
        for (right, right_id) in &volumes {
            let ours = thinpool_ok(&["diff", left, right, "--format", "xml", "--pool", pool]);
            let theirs = thin_delta(&tools, metadata, *left_id, *right_id, false);
            assert_eq!(ours, theirs, "{left} vs {right}");
            let ours_verbose = thinpool_ok(&[
                "diff",
                left,
                right,
                "--format",
                "xml",
                "--verbose",
                "--pool",
                pool,
            ]);
            let theirs_verbose = thin_delta(&tools, metadata, *left_id, *right_id, true);
            assert_eq!(ours_verbose, theirs_verbose, "{left} vs {right}, --verbose");
            if (left.as_str(), right.as_str()) == ("a", "s1") {
                assert!(ours.contains("\n    <different begin=\"0\" length=\"1\"/>\n    <same begin=\"2\" length=\"1\"/>\n"), "{ours}");
                // Runs longer than a leaf make one range (s1 wrote 5000).
                assert!(ours.contains("\n    <same begin=\"4000\" length=\"1000\"/>\n    <different begin=\"5000\" length=\"1\"/>\n    <same begin=\"5001\" length=\"999\"/>\n"), "{ours}");
            }
        }
    }
    assert!(
        std::fs::read(metadata).unwrap() == before,
        "diff changed the metadata"
    );
}

fn json_ranges(pool: &str, base: &str, target: &str) -> Vec<(u64, u64, String)> {
    let out: serde_json::Value = serde_json::from_str(&thinpool_ok(&[
        "diff", base, target, "--json", "--pool", pool,
    ]))
    .unwrap();
    assert_eq!(out["base"]["name"], base);
    assert_eq!(out["target"]["name"], target);
    assert_eq!(out["block_size_bytes"], BLOCK);
    out["ranges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["offset_bytes"].as_u64().unwrap() / BLOCK,
                r["length_bytes"].as_u64().unwrap() / BLOCK,
                r["kind"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[test]
fn xml_is_thin_deltas_and_json_lists_the_writes() {
    let scratch = ScratchDir::new("diff-cli");
    let dir = scratch.join("pool");
    fill(&dir);
    let pool = dir.to_str().unwrap();
    let metadata = dir.join("metadata");
    assert_xml_matches_thin_delta(pool, &metadata);

    // s1 against a: a's writes after the snapshot (0, 8, 3999 break sharing: changed;
    // 7000 is new), s1's own writes and its discard of 700..750.
    assert_eq!(json_ranges(pool, "a", "s1"), expected_a_s1());
    assert_eq!(
        json_ranges(pool, "s1", "a")[0],
        (0, 1, "changed".to_string())
    );

    // The text form names both volumes and has one row per range.
    let text = thinpool_ok(&["diff", "a", "other", "--pool", pool]);
    assert!(text.starts_with("a (id 0) -> other (id 3): "), "{text}");
    assert_eq!(
        text.lines().count(),
        2 + json_ranges(pool, "a", "other").len()
    );
    let same = thinpool_ok(&["diff", "s2", "s2", "--json", "--pool", pool]);
    assert!(same.contains("\"ranges\": []"), "{same}");
    let missing = thinpool_err(&["diff", "a", "nope", "--pool", pool]);
    assert!(missing.contains("nope"), "{missing}");
}

/// The ranges of `diff a s1 --json`, from the writes `fill` made.
fn expected_a_s1() -> Vec<(u64, u64, String)> {
    let before = |b: u64| (b < 4000 && b % 4 != 1) || (4000..6000).contains(&b);
    let a_mapped = |b: u64| before(b) || b == 7000;
    let mut kinds = std::collections::BTreeMap::new();
    for b in 0..7001u64 {
        let in_s1_before = before(b);
        let s1_mapped =
            (in_s1_before && !(700..750).contains(&b)) || [3, 4, 5, 100, 2001, 5000].contains(&b);
        let s1_own = [3, 4, 5, 100, 2001, 5000].contains(&b);
        let a_own = [0, 8, 3999, 7000].contains(&b);
        let kind = match (a_mapped(b), s1_mapped) {
            (true, true) if s1_own || a_own => "changed",
            (true, false) => "base_only",
            (false, true) => "target_only",
            _ => continue,
        };
        kinds.insert(b, kind);
    }
    let mut ranges: Vec<(u64, u64, String)> = Vec::new();
    for (b, kind) in kinds {
        match ranges.last_mut() {
            Some(last) if last.2 == kind && last.0 + last.1 == b => last.1 += 1,
            _ => ranges.push((b, 1, kind.to_string())),
        }
    }
    ranges
}

#[test]
fn a_served_pool_answers_the_same_and_sees_uncommitted_writes() {
    let scratch = ScratchDir::new("diff-cli-served");
    let dir = scratch.join("pool");
    fill(&dir);
    let pool = dir.to_str().unwrap();
    let offline_json = thinpool_ok(&["diff", "a", "s2", "--json", "--pool", pool]);
    let offline_xml = thinpool_ok(&["diff", "a", "s2", "--format", "xml", "--pool", pool]);
    let offline_text = thinpool_ok(&["diff", "a", "s2", "--pool", pool]);
    let verbose = [
        "diff",
        "a",
        "s2",
        "--format",
        "xml",
        "--verbose",
        "--pool",
        pool,
    ];
    let offline_verbose = thinpool_ok(&verbose);
    let served = serve(&dir, &[]);
    assert_eq!(
        thinpool_ok(&["diff", "a", "s2", "--json", "--pool", pool]),
        offline_json
    );
    assert_eq!(
        thinpool_ok(&["diff", "a", "s2", "--format", "xml", "--pool", pool]),
        offline_xml
    );
    assert_eq!(
        thinpool_ok(&["diff", "a", "s2", "--pool", pool]),
        offline_text
    );
    assert_eq!(thinpool_ok(&verbose), offline_verbose);
    // A write over NBD without a flush: the diff commits it first.
    assert!(!json_ranges(pool, "s2", "other")
        .iter()
        .any(|r| r.0 <= 900 && 900 < r.0 + r.1 && r.2 == "changed"));
    let mut client = Client::open(&served.socket, "other");
    client.write(900 * BLOCK - 4096, &[7u8; 8192]);
    let ranges = json_ranges(pool, "s2", "other");
    assert!(
        ranges.contains(&(899, 2, "changed".to_string())),
        "{ranges:?}"
    );
    drop(client);
    served.stop();
}
