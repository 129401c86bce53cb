//! Counters the pool keeps for monitoring: commits and how long they take.
//!
//! [`DurationHistogram`] is a fixed-bucket histogram of durations kept in relaxed atomics, so
//! recording is a few uncontended adds and never takes a lock; a reader takes a
//! [`HistogramSnapshot`] at any time (the fields are read one by one, so a snapshot taken
//! during a record may count it in one field and not yet in another; every field only
//! grows). The binary uses the same type for its per-connection request histograms.
//!
//! The metadata owner records into its histogram once per metadata commit, from the start
//! of the data flush that precedes it to the end of the superblock write (`meta_state`); [`crate::Pool::commit_stats`] hands out a [`CommitStats`] snapshot.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the buckets every [`DurationHistogram`] has, in nanoseconds: 10 µs to
/// 10 s in steps of 1, 2.5, 5 (a last bucket, +Inf, takes the rest).
pub const DURATION_BUCKET_BOUNDS_NS: [u64; 19] = [
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
];

/// Buckets of a [`DurationHistogram`]: one per bound and the +Inf one.
pub const DURATION_BUCKET_COUNT: usize = DURATION_BUCKET_BOUNDS_NS.len() + 1;

/// A histogram of durations with the fixed buckets of [`DURATION_BUCKET_BOUNDS_NS`].
#[derive(Debug, Default)]
pub struct DurationHistogram {
    /// Observations per bucket (not cumulative).
    buckets: [AtomicU64; DURATION_BUCKET_COUNT],
    /// Sum of all observations, in nanoseconds (wraps after 584 years of observed time).
    sum_ns: AtomicU64,
}

impl DurationHistogram {
    /// Records one observation.
    pub fn record(&self, duration: Duration) {
        let ns = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        let bucket = DURATION_BUCKET_BOUNDS_NS.partition_point(|&bound| bound < ns);
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// The counts so far.
    pub fn snapshot(&self) -> HistogramSnapshot {
        HistogramSnapshot {
            buckets: std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed)),
            sum_ns: self.sum_ns.load(Ordering::Relaxed),
        }
    }
}

/// The counts of a [`DurationHistogram`] at one time; snapshots add up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HistogramSnapshot {
    /// Observations per bucket (not cumulative), the last one for +Inf.
    pub buckets: [u64; DURATION_BUCKET_COUNT],
    /// Sum of all observations, in nanoseconds.
    pub sum_ns: u64,
}

impl HistogramSnapshot {
    /// Observations in all buckets.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &HistogramSnapshot) {
        for (mine, theirs) in self.buckets.iter_mut().zip(other.buckets) {
            *mine += theirs;
        }
        self.sum_ns = self.sum_ns.wrapping_add(other.sum_ns);
    }

    /// `(upper bound in seconds, observations in that bucket)` per bucket, not cumulative,
    /// the last bound +Inf.
    pub fn buckets_seconds(&self) -> Vec<(f64, u64)> {
        self.buckets
            .iter()
            .enumerate()
            .map(|(i, &count)| {
                let bound = DURATION_BUCKET_BOUNDS_NS
                    .get(i)
                    .map_or(f64::INFINITY, |&ns| ns as f64 / 1e9);
                (bound, count)
            })
            .collect()
    }

    /// The sum in seconds.
    pub fn sum_seconds(&self) -> f64 {
        self.sum_ns as f64 / 1e9
    }
}

/// Commits since the pool opened: see [`crate::Pool::commit_stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommitStats {
    /// Metadata commits that succeeded (periodic, on flush or FUA, and after management
    /// operations).
    pub commit_count: u64,
    /// How long each took, from the start of the data flush before it to the end of the
    /// superblock write.
    pub durations: HistogramSnapshot,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_the_first_bucket_whose_bound_holds_them() {
        let histogram = DurationHistogram::default();
        for ns in [0, 10_000, 10_001, 999_999, 10_000_000_000, 10_000_000_001] {
            histogram.record(Duration::from_nanos(ns));
        }
        histogram.record(Duration::MAX);
        let snapshot = histogram.snapshot();
        assert_eq!(snapshot.count(), 7);
        assert_eq!(snapshot.buckets[0], 2, "0 and 10 µs are at or below 10 µs");
        assert_eq!(snapshot.buckets[1], 1, "10.001 µs goes to 25 µs");
        assert_eq!(snapshot.buckets[6], 1, "999.999 µs goes to 1 ms");
        assert_eq!(snapshot.buckets[18], 1, "10 s exactly");
        assert_eq!(snapshot.buckets[19], 2, "beyond 10 s: +Inf");
        let buckets = snapshot.buckets_seconds();
        assert_eq!(buckets.len(), DURATION_BUCKET_COUNT);
        assert_eq!(buckets[0], (1e-5, 2));
        assert_eq!(buckets[6], (1e-3, 1));
        assert_eq!(buckets[18], (10.0, 1));
        assert_eq!(buckets[19].1, 2);
        assert!(buckets[19].0.is_infinite());
    }

    #[test]
    fn snapshots_add_up() {
        let a = DurationHistogram::default();
        let b = DurationHistogram::default();
        a.record(Duration::from_micros(30));
        b.record(Duration::from_micros(30));
        b.record(Duration::from_secs(1));
        let mut total = a.snapshot();
        total.add(&b.snapshot());
        assert_eq!(total.count(), 3);
        assert_eq!(total.buckets[2], 2);
        assert_eq!(total.buckets[15], 1);
        assert_eq!(total.sum_ns, 1_000_060_000);
    }

    #[test]
    fn every_commit_is_counted_once() {
        use crate::engine::catalog::MemoryCatalog;
        use crate::engine::data_device::MemoryDataDevice;
        use crate::{Pool, PoolOptions};
        use persistent_data::MemoryDevice;
        use std::sync::Arc;

        const BLOCK: u64 = 64 * 1024;
        let pool = Pool::format_parts(
            Arc::new(MemoryDevice::new(256)),
            Arc::new(MemoryDataDevice::new(16 * BLOCK)),
            Box::new(MemoryCatalog::default()),
            BLOCK,
            PoolOptions {
                commit_interval: None,
                ..PoolOptions::default()
            },
        )
        .unwrap();
        let before = pool.commit_stats().commit_count;
        pool.create_volume("v", 4 * BLOCK).unwrap();
        let volume = pool.volume("v").unwrap();
        volume.write(0, &[1u8; 4096], false).unwrap();
        pool.commit().unwrap();
        let after = pool.commit_stats();
        assert_eq!(after.commit_count, before + 2, "create_volume and commit");
        assert_eq!(after.durations.count(), after.commit_count);
        drop(volume);
        pool.close().unwrap();
    }
}
