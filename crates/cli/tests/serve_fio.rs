//! Goal: fio's `nbd` engine, two jobs on two connections, writes random blocks to a thin
//! volume and reads every one back intact (crc32c verification), and a second run on new
//! connections verifies the same data again.
//!
//! Method: each job owns its own 16 MiB region (`offset_increment`), writes it in random
//! order with 4 KiB blocks at queue depth 8 with a fixed seed, then verifies; the verify-only
//! rerun regenerates the same offsets from the seed.

mod e2e_support;

use e2e_support::*;
use std::time::Duration;

fn fio(uri: &str, extra: &[&str]) -> String {
    let uri_arg = format!("--uri={uri}");
    let mut args = vec![
        "--name=thin",
        "--ioengine=nbd",
        uri_arg.as_str(),
        "--rw=randwrite",
        "--bs=4k",
        "--size=16m",
        "--offset_increment=16m",
        "--numjobs=2",
        "--iodepth=8",
        "--randseed=4242",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--group_reporting",
    ];
    args.extend_from_slice(extra);
    let output = run_tool("fio", &args, Duration::from_secs(120));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(stdout.contains("READ:"), "fio verified nothing:\n{stdout}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "fio {extra:?} failed:\n{stdout}\n{stderr}"
    );
    assert!(!stdout.contains("verify: bad"), "{stdout}");
    assert!(!stderr.contains("verify"), "{stderr}");
    stdout
}

#[test]
fn fio_random_writes_verify_over_two_connections() {
    require_tool("fio", "fio");
    let temp = ScratchDir::new("serve-fio");
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "256M"]);
    create_volume(&pool, "fio", "64M");
    let served = serve(&pool, &[]);
    let uri = served.uri("fio");
    fio(&uri, &[]);
    fio(&uri, &["--verify_only"]);
    // Both jobs' regions were provisioned, and nothing else.
    let extents = nbdinfo_data_extents(&uri);
    let mapped: u64 = extents.iter().map(|(_, length)| length).sum();
    assert!(mapped <= 32 * MIB, "{extents:?}");
    assert!(extents
        .iter()
        .all(|(offset, length)| offset + length <= 32 * MIB));
    assert!(
        mapped >= 24 * MIB,
        "random writes left too much unwritten: {extents:?}"
    );
    served.stop();
}
