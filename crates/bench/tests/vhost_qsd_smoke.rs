//! Goal: `thinpool-bench vhost` runs end to end against its peer and its limit — direct
//! `pread`, `qemu-storage-daemon`'s vhost-user-blk export and the raw export over
//! vhost-user-blk (`thinpool-bench vhost-raw-serve`) driven by the `blkio` load
//! generator, every workload on 1 and 2 queues — and prints one JSON row per workload and
//! target; the thin volume over vhost-user-blk is skipped, with the reason printed, when the
//! `thinpool` binary has no `--vhost-user-blk`.
//!
//! Method: tiny sizes and short runs in a scratch directory; the generator itself checks,
//! before each timed run, that the vhost-user-blk device has the file's size and serves its
//! first and last 4 KiB, so a row cannot come from a backend serving other bytes. Timings
//! depend on the machine: nothing asserts on them beyond "some I/O was done".

use serde_json::Value;
use std::process::{Command, Output};
use testkit::scratch::ScratchDir;

fn bench(scratch: &ScratchDir, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_thinpool-bench"))
        .arg("vhost")
        .args(args)
        .arg("--dir")
        .arg(scratch.path())
        .output()
        .expect("run thinpool-bench vhost")
}

#[test]
fn pread_and_qsd_rows_for_every_workload() {
    testkit::require_tool("qemu-storage-daemon", "qemu-utils");
    let scratch = ScratchDir::new("bench-vhost");
    let output = bench(
        &scratch,
        &[
            "--json",
            "--targets",
            "pread,qsd,raw-vhost",
            "--rounds",
            "2",
            "--runtime-ms",
            "30",
            "--size",
            "8M",
            "--queues",
            "1,2",
        ],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "bench failed: {stderr}");
    let rows: Value = serde_json::from_slice(&output.stdout).expect("stdout is JSON");
    let rows = rows.as_array().expect("a JSON list");
    // 5 workloads on each of 2 queue counts, 3 targets.
    assert_eq!(rows.len(), 30, "{rows:?}");
    for row in rows {
        let key = row["key"].as_str().expect("key");
        assert!(["pread", "qsd", "raw-vhost"].contains(&key), "{row}");
        assert_eq!(row["rounds"].as_u64(), Some(2), "{row}");
        assert!(row["iops"].as_f64().is_some_and(|x| x > 0.0), "{row}");
        assert!(row["mb_per_s"].as_f64().is_some_and(|x| x > 0.0), "{row}");
        assert!(row["latency_us"].as_f64().is_some_and(|x| x > 0.0), "{row}");
        assert!(
            row["vs_pread"].as_f64().is_some_and(f64::is_finite),
            "{row}"
        );
        // The server's CPU is measured for the daemon, not for pread.
        assert_eq!(
            row["server_cpu_us_per_io"].is_null(),
            key == "pread",
            "{row}"
        );
    }
    for queues in ["×1q", "×2q"] {
        for shape in [
            "4 KiB random QD1",
            "4 KiB random QD32",
            "4 KiB sequential QD1",
        ] {
            let name = format!("{shape} {queues}");
            let found = rows.iter().filter(|row| row["workload"] == name.as_str());
            assert_eq!(found.count(), 3, "{name}");
        }
    }
    let left: Vec<_> = std::fs::read_dir(scratch.path()).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn thin_vhost_is_skipped_with_a_reason_without_the_option() {
    let scratch = ScratchDir::new("bench-vhost-skip");
    // `true serve --help` prints nothing: a thinpool without --vhost-user-blk.
    let output = bench(
        &scratch,
        &[
            "--json",
            "--targets",
            "pread,thin-vhost",
            "--thinpool",
            "/bin/true",
            "--rounds",
            "1",
            "--runtime-ms",
            "10",
            "--size",
            "4M",
            "--queues",
            "1",
        ],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "bench failed: {stderr}");
    assert!(
        stderr.contains(
            "thin volume over vhost-user-blk skipped: /bin/true serve has no --vhost-user-blk"
        ),
        "{stderr}"
    );
    let rows: Value = serde_json::from_slice(&output.stdout).expect("stdout is JSON");
    let rows = rows.as_array().expect("a JSON list");
    assert_eq!(rows.len(), 5);
    assert!(rows.iter().all(|row| row["key"] == "pread"), "{rows:?}");
}
