//! Goal: `MemoryExport` keeps the `Export` contract, checked by the shared conformance
//! suite (`nbd::testing::export_conformance`, feature `testing`) that every export
//! implementation runs (issue 21).
//! Method: the suite against memory exports of several block sizes and a read-only one;
//! the seed comes from testkit (`TEST_SEED` replays a failure).

use std::sync::Arc;

use nbd::testing::export_conformance;
use nbd::{Export, MemoryExport};
use testkit::seed_report;

#[test]
fn memory_exports_pass_the_export_conformance_suite() {
    let seed = seed_report().seed();
    for block_size in [512u64, 4096, 65536] {
        export_conformance(
            || {
                Arc::new(MemoryExport::new("disk", 4 << 20).with_block_size(block_size))
                    as Arc<dyn Export>
            },
            true,
            seed,
        );
    }
    export_conformance(
        || Arc::new(MemoryExport::new("ro", 1 << 20).with_read_only(true)) as Arc<dyn Export>,
        true,
        seed,
    );
}
