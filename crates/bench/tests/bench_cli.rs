//! Goal: `thinpool-bench --quick --pairs 2 --json` runs end to end (two pairs a row: this shows
//! that every row runs, not what it measures), prints its rows in the documented
//! JSON shape (with each row's `spread`), with a row from every section (the scale section's
//! check comparison only with `THINPOOL_TOOLS_DIR`), and removes every pool it built.
//! Method: run the built binary with `--dir` in a scratch directory, parse stdout, check each
//! row's keys and types, and that the directory is left empty. Timings and `met` depend on
//! the machine, so nothing asserts on them.

use serde_json::Value;
use std::process::Command;
use testkit::scratch::ScratchDir;

#[test]
fn quick_json_run_prints_rows_and_cleans_up() {
    let scratch = ScratchDir::new("bench-cli");
    let output = Command::new(env!("CARGO_BIN_EXE_thinpool-bench"))
        .args(["--quick", "--pairs", "2", "--json", "--dir"])
        .arg(scratch.path())
        .output()
        .expect("run thinpool-bench");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "bench failed: {stderr}");

    let rows: Value = serde_json::from_slice(&output.stdout).expect("stdout is JSON");
    let rows = rows.as_array().expect("a JSON list");
    assert!(rows.len() >= 10, "only {} rows", rows.len());
    for row in rows {
        let object = row.as_object().expect("each row is an object");
        let mut keys: Vec<&str> = object.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            ["a", "b", "met", "name", "ratio", "spread", "target", "unit"],
            "{row}"
        );
        assert!(!row["name"].as_str().expect("name").is_empty(), "{row}");
        assert!(!row["unit"].as_str().expect("unit").is_empty(), "{row}");
        for key in ["a", "b", "ratio", "spread"] {
            let figure = row[key].as_f64();
            assert!(figure.is_some_and(f64::is_finite), "{key} in {row}");
        }
        // The spread is a relative interquartile range: never negative.
        assert!(row["spread"].as_f64().unwrap() >= 0.0, "{row}");
        // A target comes with a verdict; no target, no verdict.
        match &row["target"] {
            Value::String(_) => assert!(row["met"].is_boolean(), "{row}"),
            Value::Null => assert!(row["met"].is_null(), "{row}"),
            other => panic!("target {other} in {row}"),
        }
    }
    let names: Vec<&str> = rows.iter().filter_map(|r| r["name"].as_str()).collect();
    for wanted in [
        "random 4 KiB reads",
        "sequential",
        "first writes",
        // The 64 KiB provisioning rows compare with first writes into a raw file (both
        // write into holes), not with overwrites.
        "64 KiB writes: first writes vs first writes into a raw file",
        "breaking sharing vs first writes into a raw file",
        "snapshot",
        "activation",
        "diff of",
        "with metrics",
        "16 threads vs 2",
        "snapshot creation: 64K-mapping volume vs 1K",
        "activation in a new process",
        "resident memory kept after activation",
        "copy-on-write",
    ] {
        assert!(
            names.iter().any(|n| n.contains(wanted)),
            "no row about {wanted:?} in {names:?}"
        );
    }

    if std::env::var_os("THINPOOL_TOOLS_DIR").is_some()
        && std::path::Path::new("/usr/bin/time").is_file()
    {
        assert!(
            names.iter().any(|n| n.contains("vs thin_check 1.1.0")),
            "no check comparison in {names:?}"
        );
    }

    let left: Vec<_> = std::fs::read_dir(scratch.path())
        .expect("read the scratch directory")
        .collect();
    assert!(left.is_empty(), "bench left {left:?} behind");
}

#[test]
fn only_cow_with_a_write_size_runs_that_section_alone() {
    let scratch = ScratchDir::new("bench-cli-cow");
    let run = |size: &str| {
        Command::new(env!("CARGO_BIN_EXE_thinpool-bench"))
            .args(["--only", "cow", "--json", "--write-size", size, "--dir"])
            .arg(scratch.path())
            .output()
            .expect("run thinpool-bench")
    };
    let output = run("1M");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "bench failed: {stderr}");
    assert!(stderr.contains("filling a 1 MiB volume"), "{stderr}");
    let rows: Value = serde_json::from_slice(&output.stdout).expect("stdout is JSON");
    let names: Vec<&str> = rows
        .as_array()
        .expect("a JSON list")
        .iter()
        .filter_map(|r| r["name"].as_str())
        .collect();
    assert_eq!(names.len(), 3, "{names:?}");
    assert!(
        names.iter().all(|n| n.contains("copy-on-write")),
        "{names:?}"
    );
    // A progress line on stderr for each row as it is measured, in order (issue 25 item 3).
    for (index, name) in names.iter().enumerate() {
        let line = format!("bench: row {}: {name} (", index + 1);
        assert!(stderr.contains(&line), "no {line:?} in {stderr}");
    }
    // Not a whole number of 64 KiB blocks: refused before anything runs.
    let output = run("100K");
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("multiple of 64 KiB"));
    let left: Vec<_> = std::fs::read_dir(scratch.path())
        .expect("read the scratch directory")
        .collect();
    assert!(left.is_empty(), "bench left {left:?} behind");
}
