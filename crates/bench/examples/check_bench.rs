//! Checker benchmark: builds pool metadata with about a million mappings (several volumes,
//! snapshots sharing and diverging) in a file, then times `thin_pool::format::check::check` on it.
//!
//! ```text
//! cargo run --release -p thin-pool --example check_bench [PATH]   # default /dev/shm/...
//! /usr/bin/time -v target/release/thinpool check PATH             # peak memory (VmHWM)
//! /usr/bin/time -v /usr/sbin/thin_check PATH                      # and the real tools
//! ```
//!
//! The file is left in place for the comparisons above.

use persistent_data::{BlockDevice, FileDevice};
use std::sync::Arc;
use std::time::Instant;
use thin_pool::format::check::{check, CheckOptions};
use thin_pool::{PoolMetadata, VirtualBlock, VolumeId};

const METADATA_BLOCKS: u64 = 32_768;
const DATA_BLOCKS: u64 = 1_200_000;

fn map(md: &mut PoolMetadata, id: u32, blocks: impl Iterator<Item = u64>) {
    for (i, vb) in blocks.enumerate() {
        let db = md.alloc_data_block().expect("data space");
        md.insert(VolumeId::new(id), VirtualBlock::new(vb), db)
            .expect("insert");
        if i % 100_000 == 99_999 {
            md.commit().expect("commit");
        }
    }
    md.commit().expect("commit");
}

fn peak_memory_kib() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM"))
                .map(str::to_string)
        })
        .unwrap_or_default()
}

fn main() {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "/dev/shm/thinpool-check-bench-metadata".to_string());
    let path = std::path::Path::new(&path);
    let started = Instant::now();
    let device = Arc::new(FileDevice::create(path, METADATA_BLOCKS).expect("create"));
    let mut md = PoolMetadata::format(device, 128, DATA_BLOCKS).expect("format");
    md.create_thin(VolumeId::new(0)).unwrap();
    map(&mut md, 0, 0..400_000);
    md.create_snap(VolumeId::new(1), VolumeId::new(0)).unwrap();
    map(&mut md, 1, (0..100_000).map(|i| i * 4));
    md.create_thin(VolumeId::new(2)).unwrap();
    map(&mut md, 2, 0..500_000);
    md.create_snap(VolumeId::new(3), VolumeId::new(2)).unwrap();
    md.commit().unwrap();
    let usage = md.usage();
    drop(md);
    println!(
        "built {} in {:.1?}: {} metadata blocks used, {} data blocks used",
        path.display(),
        started.elapsed(),
        usage.metadata_used_blocks,
        usage.data_used_blocks
    );
    let before = peak_memory_kib();
    let device: Arc<dyn BlockDevice> = Arc::new(FileDevice::open(path, false).expect("open"));
    let started = Instant::now();
    let report = check(device, &CheckOptions::default(), &mut |_| {});
    println!(
        "check: {:.2?}, clean: {}, {} volumes, {} mappings, {} nodes",
        started.elapsed(),
        report.is_clean(),
        report.summary.volume_count,
        report.summary.mapping_count,
        report.summary.node_count
    );
    println!(
        "peak memory before check (incl. build): {before}; after: {}",
        peak_memory_kib()
    );
}
