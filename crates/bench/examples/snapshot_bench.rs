//! Snapshot and deletion cost against origin size.
//!
//! For origins of 1 000, 100 000 and 1 000 000 mappings (on a metadata file in a temporary
//! directory), measures:
//! - creating a snapshot (and committing it): O(1), one more reference to the origin's root;
//! - deleting that untouched snapshot: O(1), one reference dropped;
//! - deleting a volume that shares nothing: it walks its whole tree, O(leaves).
//!
//! Run: `cargo run --release -p thin-pool --example snapshot_bench`.

use persistent_data::FileDevice;
use std::sync::Arc;
use std::time::{Duration, Instant};
use thin_pool::{PoolMetadata, VirtualBlock, VolumeId};

/// Snapshots timed per origin size (the median is reported).
const SNAPSHOT_ROUNDS: usize = 21;

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("thinpool-snapshot-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    println!(
        "{:>10} {:>12} {:>16} {:>16} {:>18}",
        "mappings", "fill", "snapshot+commit", "delete snapshot", "delete unshared"
    );
    for mapping_count in [1_000u64, 100_000, 1_000_000] {
        let path = dir.join(format!("metadata-{mapping_count}"));
        // Two full copies of the tree at half-full leaves, plus room for the space maps.
        let metadata_blocks = (mapping_count / 126 * 2 + 4096).max(4096);
        let device = Arc::new(FileDevice::create(&path, metadata_blocks)?);
        let mut md = PoolMetadata::format(device, 128, 2 * mapping_count + 1000)?;

        let origin = VolumeId::new(0);
        let fill_start = Instant::now();
        md.create_thin(origin)?;
        for vb in 0..mapping_count {
            let db = md.alloc_data_block()?;
            md.insert(origin, VirtualBlock::new(vb), db)?;
            if vb % 100_000 == 99_999 {
                md.commit()?;
            }
        }
        md.commit()?;
        let fill = fill_start.elapsed();

        let mut snapshot_times = Vec::new();
        let mut delete_times = Vec::new();
        for round in 0..SNAPSHOT_ROUNDS {
            let snapshot = VolumeId::new(1 + round as u32);
            let start = Instant::now();
            md.create_snap(snapshot, origin)?;
            md.commit()?;
            snapshot_times.push(start.elapsed());
            let start = Instant::now();
            md.delete(snapshot)?;
            md.commit()?;
            delete_times.push(start.elapsed());
        }

        // An unshared volume of the same size: delete must release every leaf.
        let unshared = VolumeId::new(100);
        md.create_thin(unshared)?;
        for vb in 0..mapping_count {
            let db = md.alloc_data_block()?;
            md.insert(unshared, VirtualBlock::new(vb), db)?;
            if vb % 100_000 == 99_999 {
                md.commit()?;
            }
        }
        md.commit()?;
        let start = Instant::now();
        md.delete(unshared)?;
        md.commit()?;
        let delete_unshared = start.elapsed();

        println!(
            "{:>10} {:>12.3?} {:>16.3?} {:>16.3?} {:>18.3?}",
            mapping_count,
            fill,
            median(snapshot_times),
            median(delete_times),
            delete_unshared
        );
        drop(md);
        std::fs::remove_file(&path)?;
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
