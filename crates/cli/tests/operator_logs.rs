//! Goal (issue 25, item 8): each space event is logged once (both `thinpool::space` and the
//! engine's event log wrote it), with a size for people beside the bytes, and the low-water
//! mark crossed again and again while autoextend grows the pool is no warning.
//!
//! Method: a 1 MiB pool with autoextend, served with its log on; a raw client writes 3 MiB
//! (the pool grows step by step); the log is read after the server stopped.

mod e2e_support;

use e2e_support::*;

const BLOCK: u64 = 64 * 1024;

#[test]
fn space_events_are_logged_once_with_human_sizes() {
    let scratch = ScratchDir::new("operator-logs");
    let pool = scratch.join("pool");
    create_pool(
        &pool,
        &[
            "--data-size",
            "1M",
            "--low-water",
            "75",
            "--autoextend-threshold",
            "50",
            "--autoextend-by",
            "50%",
            "--autoextend-max",
            "8M",
            "--no-space-timeout",
            "0",
        ],
    );
    create_volume(&pool, "vm", "8M");
    let served = serve(&pool, &[]);
    let mut client = Client::open(&served.socket, "vm");
    for block in 0..(3 * MIB / BLOCK) {
        client.write(block * BLOCK, &pattern(block, BLOCK as usize));
    }
    client.flush();
    client.disconnect();
    let (status, log) = served.stop_with_log();
    assert!(status.success(), "{log}");
    let grew: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("data grew from"))
        .collect();
    assert!(!grew.is_empty(), "no growth logged:\n{log}");
    for line in &grew {
        let message = &line[line.find("autoextend: data grew").unwrap()..];
        let times = grew.iter().filter(|l| l.ends_with(message)).count();
        assert_eq!(times, 1, "{message:?} logged {times} times:\n{log}");
        assert!(line.contains("MiB") || line.contains("KiB"), "{line}");
    }
    let warned: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("low water"))
        .collect();
    assert!(
        warned.is_empty(),
        "low-water warnings while autoextend works: {warned:?}"
    );
}
