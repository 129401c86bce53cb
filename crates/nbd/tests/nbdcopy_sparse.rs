//! Goal: `nbdcopy` (libnbd 1.14: structured replies, BLOCK_STATUS without REQ_ONE, four
//! connections when CAN_MULTI_CONN is set, WRITE_ZEROES/TRIM for holes) copies between two
//! exports exactly and keeps the copy sparse.
//! Method: a seeded random sparse source, a target full of junk; `nbdcopy src dst`, then
//! compare bytes directly and compare `nbdinfo --map` of both exports.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use nbd::{Export, MemoryExport};
use rand::{Rng, SeedableRng};

const TIMEOUT: Duration = Duration::from_secs(30);
const SIZE: u64 = 64 * MIB;

#[test]
fn nbdcopy_sparse_copy_stays_sparse() {
    require_tool("nbdcopy", "libnbd-bin");
    require_tool("nbdinfo", "libnbd-bin");
    let report = seed_report();
    let seed = report.seed();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let source = Arc::new(MemoryExport::new("source", SIZE));
    for index in 0..40u64 {
        let block = rng.gen_range(0..SIZE / (64 * 1024));
        let length = rng.gen_range(1..=8u64) * 64 * 1024;
        let length = length.min(SIZE - block * 64 * 1024);
        source
            .write_at(
                block * 64 * 1024,
                &pattern(seed ^ index, length as usize),
                false,
            )
            .unwrap();
    }
    let target = Arc::new(MemoryExport::new("target", SIZE));
    target
        .write_at(0, &vec![0x77; SIZE as usize], false)
        .unwrap();
    let server = TestServer::start(vec![source.clone(), target.clone()]);
    run_ok(
        "nbdcopy",
        &[&server.uri("source"), &server.uri("target")],
        TIMEOUT,
    );
    let mut expected = vec![0u8; SIZE as usize];
    let mut actual = vec![0u8; SIZE as usize];
    source.read_at(0, &mut expected).unwrap();
    target.read_at(0, &mut actual).unwrap();
    assert!(expected == actual, "copy differs");
    let source_map = run_ok("nbdinfo", &["--map", &server.uri("source")], TIMEOUT);
    let target_map = run_ok("nbdinfo", &["--map", &server.uri("target")], TIMEOUT);
    assert_eq!(source_map, target_map, "allocation differs");
    assert_eq!(
        source.allocated_block_count(),
        target.allocated_block_count()
    );
}
