//! The Prometheus metrics of a served pool (`thinpool serve --metrics`): where requests are
//! counted, how the counts are summed, and the text a scrape returns.
//!
//! Counting stays off the shared path. Every export an NBD connection opens is wrapped in a
//! [`CountedExport`] with the connection's own [`StripedCounters`] (relaxed atomics on
//! cache lines of their own, one stripe per thread of that connection): a request costs two
//! clock reads (`quanta`'s, cheap where `std`'s are not) and two or three uncontended atomic
//! adds, and never a lock. The nbd crate
//! knows nothing of this; [`CountingRegistry`] wraps the registry the servers look exports up
//! in. [`Metrics`] keeps the list of live counters, touched only when an export is opened and
//! at a scrape; counters whose connection ended (the registry holds the last reference) are
//! folded into per-volume totals there, so counters never go down. Totals of a volume that
//! no longer exists are dropped at the next scrape (a volume created again under the same
//! name starts from zero, which Prometheus reads as a counter reset).
//!
//! Pool values (sizes, mode, transaction id, mapped bytes) are read at scrape time from
//! [`Pool::status`] and [`Pool::list`], commit counts from [`Pool::commit_stats`]; the
//! connection gauge follows the NBD servers' `Connected`/`Disconnected` events.
//!
//! Units: bytes and seconds. A request is counted when the export returns, failed or not;
//! read and written bytes only when it succeeded. Durations are the export's service time
//! (the pool's work), not the network's.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use thin_pool::stats::{CommitStats, DurationHistogram, HistogramSnapshot};
use thin_pool::{Pool, PoolMode, PoolStatus};

mod counted;
mod replication;

pub use counted::{CountedExport, CountingRegistry};

/// The requests counted, in the order of [`OP_NAMES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// NBD_CMD_READ.
    Read,
    /// NBD_CMD_WRITE.
    Write,
    /// NBD_CMD_FLUSH.
    Flush,
    /// NBD_CMD_TRIM.
    Trim,
    /// NBD_CMD_WRITE_ZEROES.
    Zero,
    /// NBD_CMD_BLOCK_STATUS.
    BlockStatus,
}

/// Number of [`Op`]s.
pub const OP_COUNT: usize = 6;
/// The `op` label of each [`Op`].
pub const OP_NAMES: [&str; OP_COUNT] = ["read", "write", "flush", "trim", "zero", "block_status"];

/// Every mode, with its `mode` label (one name each: dm-thin's status words, with
/// out-of-metadata-space apart from read-only).
const MODES: [(PoolMode, &str); 5] = [
    (PoolMode::Write, "rw"),
    (PoolMode::OutOfDataSpace, "out_of_data_space"),
    (PoolMode::OutOfMetadataSpace, "out_of_metadata_space"),
    (PoolMode::ReadOnly, "ro"),
    (PoolMode::Fail, "fail"),
];

/// What one stripe of a connection counts. Aligned to 128 bytes (two cache lines, as adjacent-line
/// prefetch pairs them), so no other allocation's data shares its lines.
#[repr(align(128))]
#[derive(Debug, Default)]
pub struct ConnectionCounters {
    read_bytes: AtomicU64,
    written_bytes: AtomicU64,
    /// Per [`Op`]: how long each request took; their counts are the request counts.
    durations: [DurationHistogram; OP_COUNT],
}

/// Stripes of counters per connection: a connection's worker threads (up to 4 by default)
/// each count into the stripe their thread index picks, so two threads of one connection
/// rarely write the same cache line; a scrape sums the stripes.
const STRIPES: usize = 4;

/// One connection's counters, striped by thread (`STRIPES`).
#[derive(Debug, Default)]
pub struct StripedCounters {
    stripes: [ConnectionCounters; STRIPES],
}

impl StripedCounters {
    /// The stripe the calling thread counts into.
    #[inline]
    fn mine(&self) -> &ConnectionCounters {
        &self.stripes[thread_stripe()]
    }
}

/// The calling thread's stripe: threads are numbered round robin on their first count.
#[inline]
fn thread_stripe() -> usize {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    thread_local! {
        static STRIPE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
    }
    STRIPE.with(|stripe| *stripe)
}

/// Counts summed over connections (ended or live) of one volume.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VolumeTotals {
    /// Bytes read by successful READs.
    pub read_bytes: u64,
    /// Bytes written by successful WRITEs.
    pub written_bytes: u64,
    /// Per [`Op`]: the request durations (and so their count).
    pub durations: [HistogramSnapshot; OP_COUNT],
}

impl VolumeTotals {
    fn add_counters(&mut self, counters: &StripedCounters) {
        for stripe in &counters.stripes {
            self.read_bytes += stripe.read_bytes.load(Ordering::Relaxed);
            self.written_bytes += stripe.written_bytes.load(Ordering::Relaxed);
            for (total, histogram) in self.durations.iter_mut().zip(&stripe.durations) {
                total.add(&histogram.snapshot());
            }
        }
    }

    fn add(&mut self, other: &VolumeTotals) {
        self.read_bytes += other.read_bytes;
        self.written_bytes += other.written_bytes;
        for (total, theirs) in self.durations.iter_mut().zip(&other.durations) {
            total.add(theirs);
        }
    }
}

/// An export as one connection sees it, with that connection's counters.
struct Live {
    volume: String,
    counters: Arc<StripedCounters>,
}

/// Live counters and the totals of ended connections, per volume.
#[derive(Default)]
struct Table {
    live: Vec<Live>,
    ended: BTreeMap<String, VolumeTotals>,
}

impl Table {
    /// Folds the counters no connection holds any more into `ended`. Once the table holds
    /// the only reference nobody can take another, so nothing is counted after the fold.
    fn sweep(&mut self) {
        let ended = &mut self.ended;
        self.live.retain(|live| {
            if Arc::strong_count(&live.counters) > 1 {
                return true;
            }
            ended
                .entry(live.volume.clone())
                .or_default()
                .add_counters(&live.counters);
            false
        });
    }
}

/// The metrics of one served pool; see the module docs.
pub struct Metrics {
    pool: Pool,
    /// Names of the raw-file exports (counted like volumes, with no mapping).
    raw_names: Vec<String>,
    /// NBD connections open now, in handshake or transmission (both servers).
    connections: AtomicU64,
    table: Mutex<Table>,
    /// The pool directory whose `replication.json` a scrape reads (`crate::replication`).
    replication_dir: std::sync::OnceLock<std::path::PathBuf>,
}

impl Metrics {
    /// Metrics of `pool`, served with raw-file exports `raw_names`.
    pub fn new(pool: Pool, raw_names: Vec<String>) -> Arc<Metrics> {
        // Calibrates the request clock now rather than in the first request.
        let _ = quanta::Instant::now();
        Arc::new(Metrics {
            pool,
            raw_names,
            connections: AtomicU64::new(0),
            table: Mutex::new(Table::default()),
            replication_dir: std::sync::OnceLock::new(),
        })
    }

    /// Follows the NBD servers' connection events (the connection gauge).
    pub fn on_event(&self, event: &nbd::Event) {
        match event {
            nbd::Event::Connected { .. } => {
                self.connections.fetch_add(1, Ordering::Relaxed);
            }
            nbd::Event::Disconnected { .. } => {
                // Each Disconnected follows its Connected; never below zero regardless.
                let _ = self
                    .connections
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
            }
            _ => {}
        }
    }

    /// New counters for a connection that opened export `volume`.
    fn register(&self, volume: &str) -> Arc<StripedCounters> {
        let counters = Arc::new(StripedCounters::default());
        let mut table = nbd::sync::lock(&self.table);
        // Folding here too keeps the list as long as the live connections even if nobody
        // scrapes.
        table.sweep();
        table.live.push(Live {
            volume: volume.to_string(),
            counters: Arc::clone(&counters),
        });
        counters
    }

    /// Every value a scrape reports, read now.
    pub fn sample(&self) -> Sample {
        let status = self.pool.status();
        let commits = self.pool.commit_stats();
        let list = self.pool.list();
        let mut known: BTreeSet<String> = list.iter().map(|info| info.name.clone()).collect();
        known.extend(self.raw_names.iter().cloned());
        let mut volumes: BTreeMap<String, VolumeSample> = BTreeMap::new();
        {
            let mut table = nbd::sync::lock(&self.table);
            table.sweep();
            // Totals of deleted volumes go; those of live connections stay until they end.
            known.extend(table.live.iter().map(|live| live.volume.clone()));
            table.ended.retain(|name, _| known.contains(name));
            for (name, totals) in &table.ended {
                volumes.entry(name.clone()).or_default().totals.add(totals);
            }
            for live in &table.live {
                volumes
                    .entry(live.volume.clone())
                    .or_default()
                    .totals
                    .add_counters(&live.counters);
            }
        }
        for name in &self.raw_names {
            volumes.entry(name.clone()).or_default();
        }
        for info in &list {
            volumes.entry(info.name.clone()).or_default().mapped_bytes =
                Some(info.mapped_blocks.saturating_mul(info.block_size_bytes));
        }
        Sample {
            status,
            commits,
            connections: self.connections.load(Ordering::Relaxed),
            volumes,
            replication: self.replication(),
        }
    }

    /// The Prometheus text exposition (format 0.0.4) of a [`Sample`] taken now.
    pub fn render(&self) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(self.sample()));
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry)
            .expect("writing to a String cannot fail");
        text
    }
}

/// `Content-Type` of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// One volume (or raw export) at a scrape.
#[derive(Clone, Debug, Default)]
pub struct VolumeSample {
    /// Bytes mapped (data blocks × block size); `None` for a raw export.
    pub mapped_bytes: Option<u64>,
    /// Requests over every connection since the server started.
    pub totals: VolumeTotals,
}

/// Every value of one scrape.
#[derive(Clone, Debug)]
pub struct Sample {
    /// The pool's status.
    pub status: PoolStatus,
    /// Commits since the pool opened.
    pub commits: CommitStats,
    /// NBD connections open.
    pub connections: u64,
    /// Per volume or raw export, by name.
    pub volumes: BTreeMap<String, VolumeSample>,
    /// Per replicated volume: its lag (`crate::replication::Lag`).
    pub replication: Vec<crate::replication::Lag>,
}

/// One counter of [`VolumeTotals`].
type VolumeField = fn(&VolumeTotals) -> u64;

fn gauge(encoder: &mut DescriptorEncoder, name: &str, help: &str, value: u64) -> std::fmt::Result {
    encoder
        .encode_descriptor(name, help, None, MetricType::Gauge)?
        .encode_gauge(&value)
}

fn histogram(
    encoder: &mut prometheus_client::encoding::MetricEncoder,
    snapshot: &HistogramSnapshot,
) -> std::fmt::Result {
    encoder.encode_histogram::<NoLabelSet>(
        snapshot.sum_seconds(),
        snapshot.count(),
        &snapshot.buckets_seconds(),
        None,
    )
}

impl Collector for Sample {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        self.encode_pool(&mut encoder)?;
        self.encode_commits(&mut encoder)?;
        self.encode_volumes(&mut encoder)?;
        self.encode_requests(&mut encoder)?;
        self.encode_replication(&mut encoder)
    }
}

impl Sample {
    /// The pool's sizes, mode and transaction id.
    fn encode_pool(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        let status = &self.status;
        let block = status.block_size_bytes;
        gauge(
            e,
            "thinpool_data_size_bytes",
            "Size of the pool's data device.",
            status.data_total_blocks.saturating_mul(block),
        )?;
        gauge(
            e,
            "thinpool_data_used_bytes",
            "Data blocks in use (mapped or reserved by writes in flight), in bytes.",
            status.data_used_blocks.saturating_mul(block),
        )?;
        const METADATA_BLOCK_BYTES: u64 = 4096;
        gauge(
            e,
            "thinpool_metadata_size_bytes",
            "Size of the pool's metadata device.",
            status.metadata_total_blocks * METADATA_BLOCK_BYTES,
        )?;
        gauge(
            e,
            "thinpool_metadata_used_bytes",
            "Metadata blocks in use, in bytes.",
            status.metadata_used_blocks * METADATA_BLOCK_BYTES,
        )?;
        let mut family = e.encode_descriptor(
            "thinpool_mode",
            "The pool's mode: 1 for the current one, 0 for the others.",
            None,
            MetricType::Gauge,
        )?;
        for (mode, label) in MODES {
            family
                .encode_family(&[("mode", label)])?
                .encode_gauge(&u64::from(mode == status.mode))?;
        }
        gauge(
            e,
            "thinpool_needs_check",
            "1 if the metadata needs a check (thin_check) before it is trusted again.",
            u64::from(status.needs_check),
        )?;
        gauge(
            e,
            "thinpool_transaction_id",
            "The user transaction id in the superblock.",
            status.transaction_id,
        )?;
        Ok(())
    }

    /// Commits, their durations, and the NBD connections open.
    fn encode_commits(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        e.encode_descriptor(
            "thinpool_commits",
            "Metadata commits since the pool opened.",
            None,
            MetricType::Counter,
        )?
        .encode_counter::<NoLabelSet, u64, u64>(&self.commits.commit_count, None)?;
        let mut family = e.encode_descriptor(
            "thinpool_commit_duration_seconds",
            "Commit time, from the start of the data flush to the end of the superblock write.",
            None,
            MetricType::Histogram,
        )?;
        histogram(&mut family, &self.commits.durations)?;
        gauge(
            e,
            "thinpool_nbd_connections",
            "NBD connections open (in handshake or transmission).",
            self.connections,
        )?;
        Ok(())
    }

    /// Per volume: bytes mapped, read and written.
    fn encode_volumes(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        let mut family = e.encode_descriptor(
            "thinpool_volume_mapped_bytes",
            "Bytes of the volume mapped to data blocks.",
            None,
            MetricType::Gauge,
        )?;
        for (name, volume) in &self.volumes {
            if let Some(mapped) = volume.mapped_bytes {
                family
                    .encode_family(&[("volume", name.as_str())])?
                    .encode_gauge(&mapped)?;
            }
        }
        let counters: [(&str, &str, VolumeField); 2] = [
            (
                "thinpool_volume_read_bytes",
                "Bytes read from the export by successful NBD reads.",
                |t| t.read_bytes,
            ),
            (
                "thinpool_volume_written_bytes",
                "Bytes written to the export by successful NBD writes.",
                |t| t.written_bytes,
            ),
        ];
        for (name, help, value) in counters {
            let mut family = e.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (volume, sample) in &self.volumes {
                family
                    .encode_family(&[("volume", volume.as_str())])?
                    .encode_counter::<NoLabelSet, u64, u64>(&value(&sample.totals), None)?;
            }
        }
        Ok(())
    }

    /// Requests by volume and command, and their durations by command.
    fn encode_requests(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        let mut family = e.encode_descriptor(
            "thinpool_volume_requests",
            "NBD requests served (failed ones included), by export and command.",
            None,
            MetricType::Counter,
        )?;
        for (volume, sample) in &self.volumes {
            for (op, durations) in OP_NAMES.iter().zip(&sample.totals.durations) {
                family
                    .encode_family(&[("volume", volume.as_str()), ("op", op)])?
                    .encode_counter::<NoLabelSet, u64, u64>(&durations.count(), None)?;
            }
        }
        let mut family = e.encode_descriptor(
            "thinpool_request_duration_seconds",
            "Time the export took to serve an NBD request, by command (network not included).",
            None,
            MetricType::Histogram,
        )?;
        for (index, op) in OP_NAMES.iter().enumerate() {
            let mut total = HistogramSnapshot::default();
            for sample in self.volumes.values() {
                total.add(&sample.totals.durations[index]);
            }
            histogram(&mut family.encode_family(&[("op", *op)])?, &total)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::PoolRegistry;
    use nbd::ExportRegistry;
    use persistent_data::MemoryDevice;
    use thin_pool::catalog::MemoryCatalog;
    use thin_pool::data_device::MemoryDataDevice;
    use thin_pool::PoolOptions;

    const BLOCK: u64 = 64 * 1024;

    fn served_pool() -> (Pool, Arc<Metrics>, CountingRegistry) {
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
        pool.create_volume("v", 4 * BLOCK).unwrap();
        let registry = Arc::new(PoolRegistry::new(pool.clone(), Vec::new()).unwrap());
        let metrics = Metrics::new(pool.clone(), Vec::new());
        let counting = CountingRegistry::new(registry, Arc::clone(&metrics));
        (pool, metrics, counting)
    }

    fn totals(metrics: &Metrics, volume: &str) -> Option<VolumeTotals> {
        metrics.sample().volumes.get(volume).map(|v| v.totals)
    }

    #[test]
    fn counts_survive_the_connection_and_go_with_the_volume() {
        let (pool, metrics, counting) = served_pool();
        let export = counting.open("v").unwrap().unwrap();
        export.write_at(0, &[7u8; 4096], false).unwrap();
        let mut buffer = vec![0u8; 8192];
        export.read_at(0, &mut buffer).unwrap();
        export.flush().unwrap();
        assert!(
            export.read_at(4 * BLOCK, &mut buffer).is_err(),
            "past the end"
        );
        let live = totals(&metrics, "v").unwrap();
        assert_eq!((live.read_bytes, live.written_bytes), (8192, 4096));
        let counts: Vec<u64> = live.durations.iter().map(|d| d.count()).collect();
        assert_eq!(
            counts,
            [2, 1, 1, 0, 0, 0],
            "the failed read counts as a request"
        );
        let sample = metrics.sample();
        assert_eq!(sample.volumes["v"].mapped_bytes, Some(BLOCK));
        assert!(sample.commits.commit_count >= 1, "the flush committed");

        // The connection ends: nothing is lost, and a new one adds to it.
        drop(export);
        assert_eq!(totals(&metrics, "v"), Some(live));
        assert!(nbd::sync::lock(&metrics.table).live.is_empty());
        let export = counting.open("").unwrap().unwrap();
        export.read_at(0, &mut buffer[..4096]).unwrap();
        assert_eq!(totals(&metrics, "v").unwrap().read_bytes, 8192 + 4096);
        let text = metrics.render();
        for line in [
            "thinpool_volume_read_bytes_total{volume=\"v\"} 12288",
            "thinpool_volume_written_bytes_total{volume=\"v\"} 4096",
            "thinpool_volume_requests_total{volume=\"v\",op=\"read\"} 3",
            "thinpool_volume_mapped_bytes{volume=\"v\"} 65536",
            "thinpool_request_duration_seconds_count{op=\"write\"} 1",
            "thinpool_mode{mode=\"rw\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }

        // A deleted volume's series go.
        drop(export);
        pool.delete_volume("v").unwrap();
        assert_eq!(totals(&metrics, "v"), None);
        assert!(!metrics.render().contains("volume=\"v\""));
        pool.close().unwrap();
    }

    #[test]
    fn the_connection_gauge_follows_connect_and_disconnect() {
        let (pool, metrics, _) = served_pool();
        let connected = |connection| nbd::Event::Connected {
            connection,
            peer: String::new(),
        };
        let disconnected = |connection| nbd::Event::Disconnected {
            connection,
            error: None,
        };
        metrics.on_event(&connected(1));
        metrics.on_event(&connected(2));
        assert_eq!(metrics.sample().connections, 2);
        metrics.on_event(&disconnected(1));
        metrics.on_event(&disconnected(2));
        metrics.on_event(&disconnected(3));
        assert_eq!(metrics.sample().connections, 0, "never below zero");
        pool.close().unwrap();
    }
}
