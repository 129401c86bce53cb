//! A counted diff (`Pool::diff_with_progress`, walked in parts of `PROGRESS_CHUNK_NODES`,
//! two nodes here) answers exactly what `Pool::diff` does, over the whole volumes and over
//! a range, for volumes of one size and of two, and ends with every block asked for counted.

use crate::progress::Progress;
use crate::testing::MemoryParts;
use crate::{PoolOptions, VirtualBlock};

const BLOCK: u64 = 65536;

#[test]
fn a_counted_diff_answers_what_diff_does_and_counts_every_block() {
    let pool = MemoryParts::new(4096, 4096 * BLOCK).format(
        BLOCK,
        PoolOptions {
            commit_interval: None,
            ..PoolOptions::default()
        },
    );
    pool.create_volume("empty", 1500 * BLOCK).unwrap();
    pool.create_volume("full", 2000 * BLOCK).unwrap();
    let volume = pool.volume("full").unwrap();
    for block in 0..2000u64 {
        volume.write(block * BLOCK, &[1; 512], false).unwrap();
    }
    pool.snapshot("full", "snap", true).unwrap();
    for block in (0..2000u64).step_by(7).chain(1700..1750) {
        volume.write(block * BLOCK, &[2; 512], false).unwrap();
    }
    drop(volume);
    let ranges = [None, Some(300..1800), Some(1999..2600), Some(2500..2600)];
    for (base, target) in [("empty", "full"), ("snap", "full"), ("full", "empty")] {
        for blocks in ranges.clone() {
            let blocks = blocks.map(|r| VirtualBlock::new(r.start)..VirtualBlock::new(r.end));
            let whole = pool.diff(base, target, blocks.clone()).unwrap();
            let progress = Progress::new();
            let counted = pool
                .diff_with_progress(base, target, blocks.clone(), &progress)
                .unwrap();
            assert_eq!(counted, whole, "{base} vs {target} over {blocks:?}");
            let end = whole.base_size_blocks.max(whole.target_size_blocks);
            let asked = blocks.map_or(0..end, |r| r.start.get()..r.end.get().min(end));
            let total = asked.end.saturating_sub(asked.start);
            assert_eq!(
                (progress.done(), progress.total()),
                (total, total),
                "{base} vs {target} over {asked:?}"
            );
        }
    }
}
