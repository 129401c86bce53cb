//! Goal: fio's nbd engine (libnbd, one connection per job, many requests in flight) writes
//! and verifies random data through our server without a single mismatch.
//! Method: two jobs on disjoint halves of one export, random writes of mixed sizes with
//! `verify=crc32c`, `iodepth=16`; fio exits non-zero on any verify failure.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use nbd::MemoryExport;

#[test]
fn fio_two_jobs_verify_crc32c() {
    require_tool("fio", "fio");
    let report = seed_report();
    let seed = report.seed();
    let server = TestServer::start(vec![Arc::new(MemoryExport::new("disk", 64 * MIB))]);
    let uri = format!("--uri={}", server.uri("disk"));
    // fio parses its seed as a signed 64-bit number.
    let seed_arg = format!("--randseed={}", seed & i64::MAX as u64);
    let output = run_ok(
        "fio",
        &[
            "--name=verify",
            "--ioengine=nbd",
            &uri,
            "--rw=randwrite",
            "--bssplit=4k/50:64k/30:1m/20",
            "--size=32m",
            "--offset_increment=32m",
            "--numjobs=2",
            "--iodepth=16",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--verify_state_save=0",
            &seed_arg,
            "--group_reporting",
        ],
        Duration::from_secs(45),
    );
    // The verify phase reads everything back; fio fails the run on any mismatch.
    assert!(output.contains("read:"), "{output}");
    assert!(output.contains("write:"), "{output}");
    assert!(!output.contains("verify: bad"), "{output}");
}
