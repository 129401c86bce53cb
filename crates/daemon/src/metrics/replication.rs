//! The replication lag in the metrics: `thinpool replicate`'s state file in the pool
//! directory (`crate::replication`), read at each scrape, one gauge pair per replicated
//! volume.

use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;

use super::{Metrics, Sample};
use crate::replication::Lag;

impl Metrics {
    /// Report the replication lag `thinpool replicate` keeps in `dir` (the pool directory)
    /// at each scrape.
    pub fn read_replication_from(&self, dir: std::path::PathBuf) {
        let _ = self.replication_dir.set(dir);
    }

    /// The lag of each replicated volume, now (none unless a directory was given).
    pub(super) fn replication(&self) -> Vec<Lag> {
        self.replication_dir
            .get()
            .map(|dir| crate::replication::pool_lags(&self.pool, dir))
            .unwrap_or_default()
    }
}

/// One figure of a [`Lag`] (absent before the first acknowledgement).
type LagField = fn(&Lag) -> Option<u64>;

impl Sample {
    /// Per replicated volume: seconds since its last acknowledged replica was taken, and the
    /// bytes it changed since.
    pub(super) fn encode_replication(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        let gauges: [(&str, &str, LagField); 3] = [
            (
                "thinpool_replication_lag_seconds",
                "Seconds since the last replica the destination acknowledged was taken.",
                |lag| lag.lag_seconds,
            ),
            (
                "thinpool_replication_lag_bytes",
                "Bytes of the blocks the volume changed since its last acknowledged replica.",
                |lag| lag.lag_bytes,
            ),
            (
                "thinpool_replication_last_stream_bytes",
                "Bytes of the stream that carried the last acknowledged replica.",
                |lag| lag.last_stream_bytes,
            ),
        ];
        for (name, help, value) in gauges {
            let mut family = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for lag in &self.replication {
                if let Some(value) = value(lag) {
                    family
                        .encode_family(&[("volume", lag.volume.as_str())])?
                        .encode_gauge(&value)?;
                }
            }
        }
        Ok(())
    }
}
