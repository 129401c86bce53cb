//! Goal: `scripts/bench-compare --quick` runs end to end against every server (thinpool's thin
//! volume, its snapshot and its raw export, nbdkit, qemu-nbd raw and qcow2), prints a markdown
//! row with figures for every (workload, target) pair, writes the same rows as JSON, and
//! leaves nothing behind in its scratch directory.
//! Method: run the script with tiny sizes (8 MiB read targets, 2 MiB written, 100 ms per
//! timed fio run) and this build's `thinpool`, then parse the table and the JSON. The figures
//! depend on the machine, so nothing asserts on them beyond being finite numbers. The `dd`
//! replay needs /dev/fuse and loop devices; without them the script runs with `--no-dd`.

use serde_json::Value;
use std::path::Path;
use std::time::Duration;
use testkit::process::{require_tool, run_tool_in};
use testkit::scratch::ScratchDir;

/// (workload as printed, targets) for every fio row of the table.
const ROWS: &[(&str, &[&str])] = &[
    ("4 KiB sequential reads, QD1", READ_TARGETS),
    ("4 KiB random reads, QD64, 1 connection", READ_TARGETS),
    ("4 KiB random reads, QD32, 2 connections", READ_TARGETS),
    ("4 KiB random reads, QD32, 16 connections", READ_TARGETS),
    (
        "4 KiB random overwrites, QD32, 2 connections",
        WRITE_TARGETS,
    ),
    ("1 MiB sequential reads, QD8", READ_TARGETS),
    ("1 MiB sequential first writes, QD8", WRITE_TARGETS),
    ("64 KiB random first writes, QD8", WRITE_TARGETS),
    (
        "4 KiB copy-on-write writes after a snapshot (64 KiB blocks), QD16",
        &["thin", "qemu-qcow2", "raw", IN_PROCESS],
    ),
    ("4 KiB random reads, QD2, 1 connection", CONNECTION_TARGETS),
    (
        "4 KiB random reads, QD2, 16 connections",
        CONNECTION_TARGETS,
    ),
    (
        "4 KiB random reads, QD2, 256 connections",
        CONNECTION_TARGETS,
    ),
];
/// Targets of the connection-count rows, which also get a table of their own (256 vs 16).
const CONNECTION_TARGETS: &[&str] = &["thin", "raw", "nbdkit"];
const READ_TARGETS: &[&str] = &["thin", "snap", "raw", "nbdkit", "qemu-raw", "qemu-qcow2"];
const WRITE_TARGETS: &[&str] = &["thin", "raw", "nbdkit", "qemu-raw", "qemu-qcow2"];
const DD: &str = "dd bs=4k of the whole device, nbdfuse + losetup";
/// The copy-on-write row measured in-process (`thinpool-bench --only cow`): no fio, so its
/// fio CPU cell is empty.
const IN_PROCESS: &str = "in-process";

/// A table cell as a finite number.
fn number(cell: &str, line: &str) -> f64 {
    let value: f64 = cell
        .parse()
        .unwrap_or_else(|_| panic!("{cell:?} is not a number in {line}"));
    assert!(value.is_finite(), "{line}");
    value
}

#[test]
fn quick_run_prints_every_row_with_figures() {
    for (tool, package) in [
        ("fio", "fio"),
        ("nbdkit", "nbdkit"),
        ("qemu-nbd", "qemu-utils"),
        ("qemu-img", "qemu-utils"),
        ("nbdcopy", "libnbd-bin"),
        ("nbdfuse", "libnbd-bin"),
        ("python3", "python3"),
    ] {
        require_tool(tool, package);
    }
    // The script drives both binaries: this build's thinpool-bench and the thinpool built
    // beside it (`cargo test --workspace` builds both; `-p thinpool-bench` alone does not).
    let thinpool = Path::new(env!("CARGO_BIN_EXE_thinpool-bench")).with_file_name("thinpool");
    assert!(
        thinpool.is_file(),
        "no {}: run `cargo build -p thinpool` first",
        thinpool.display()
    );
    let scratch = ScratchDir::new("bench-compare");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/bench-compare");
    let json_path = scratch.path().join("rows.json");
    let bench_dir = scratch.path().join("work");
    std::fs::create_dir(&bench_dir).unwrap();
    let dd = Path::new("/dev/fuse").exists() && Path::new("/dev/loop-control").exists();
    let mut args = vec!["--quick", "--json", json_path.to_str().unwrap()];
    if !dd {
        args.push("--no-dd");
    }
    let output = run_tool_in(
        &script,
        &args,
        Duration::from_secs(600),
        None,
        &[
            ("THINPOOL", thinpool.to_str().unwrap()),
            ("THINPOOL_BENCH", env!("CARGO_BIN_EXE_thinpool-bench")),
            ("BENCH_DIR", bench_dir.to_str().unwrap()),
            ("BENCH_SIZE", "8M"),
            // The copy-on-write row writes 4 KiB per 64 KiB block: 32 MiB makes 512 writes,
            // enough for fio's millisecond runtime to be nonzero on the raw export.
            ("BENCH_WRITE_SIZE", "32M"),
            ("BENCH_RUNTIME", "100ms"),
        ],
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "bench-compare failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("load average"), "{stdout}");

    let mut expected: Vec<(&str, &str)> = ROWS
        .iter()
        .flat_map(|(workload, targets)| targets.iter().map(move |t| (*workload, *t)))
        .collect();
    if dd {
        expected.extend(["thin", "raw", "nbdkit"].map(|t| (DD, t)));
    }
    // The main table, then the connections table (256 vs 16 connections, one line a target).
    let (main, connections) = stdout
        .split_once("\nConnections (")
        .unwrap_or_else(|| panic!("no connections table in {stdout}"));
    for target in CONNECTION_TARGETS {
        let prefix = format!("| {target} | ");
        let line = connections
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("no connections row for {target} in {connections}"));
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(cells.len(), 6, "{line}");
        for cell in &cells[1..4] {
            assert!(number(cell, line) > 0.0, "{line}");
        }
    }
    let lines: Vec<&str> = main
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| workload") && !l.contains("---"))
        .collect();
    assert_eq!(lines.len(), expected.len(), "{stdout}");
    for (line, (workload, target)) in lines.iter().zip(&expected) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(cells.len(), 7, "{line}");
        assert_eq!((cells[0], cells[1]), (*workload, *target), "{line}");
        assert!(number(cells[2], line) > 0.0, "no I/O in {line}");
        assert!(number(cells[3], line) > 0.0, "no bytes in {line}");
        // The ratio to the thin volume: every target but the thin volume itself.
        if *target == "thin" {
            assert_eq!(cells[4], "-", "{line}");
        } else {
            let ratio = cells[4].split_whitespace().next().unwrap();
            assert!(number(ratio, line) > 0.0, "{line}");
        }
        // CPU per I/O for the fio rows, none for dd; the in-process row has the writing
        // thread's CPU and no fio.
        for (i, cell) in cells.iter().enumerate().skip(5) {
            if *workload == DD || (*target == IN_PROCESS && i == 6) {
                assert_eq!(*cell, "-", "{line}");
            } else {
                assert!(number(cell, line) >= 0.0, "{line}");
            }
        }
    }

    let report: Value =
        serde_json::from_slice(&std::fs::read(&json_path).expect("the JSON file")).unwrap();
    let rows = report["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), expected.len());
    for (row, (workload, target)) in rows.iter().zip(&expected) {
        assert_eq!(row["workload"], *workload, "{row}");
        assert_eq!(row["target"], *target, "{row}");
        assert!(row["iops"].as_f64().is_some_and(|x| x > 0.0), "{row}");
    }
    for key in ["load_before", "load_after"] {
        assert!(report[key].as_str().is_some_and(|s| !s.is_empty()), "{key}");
    }

    let left: Vec<_> = std::fs::read_dir(&bench_dir).unwrap().collect();
    assert!(left.is_empty(), "bench-compare left {left:?} behind");
}
