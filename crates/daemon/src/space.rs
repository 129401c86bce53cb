//! The space options `create` stores in `pool.json` and `serve` overrides for one run:
//! the low-water mark, autoextend (LVM's `thin_pool_autoextend_threshold` and
//! `thin_pool_autoextend_percent`), and the no-space timeout.

use anyhow::{bail, Context};

use crate::pool_dir::{format_size, parse_size, SpaceOptions, StoredAutoextend};

/// An example for the `--help` of `create` and `serve`.
pub const SPACE_HELP_EXAMPLE: &str = "\
Space alerts and autoextend (example):
  thinpool create --pool /srv/pool --data-size 10G \\
      --low-water 80 --autoextend-threshold 70 --autoextend-by 20% --autoextend-max 100G
  A warning is logged once each time data or metadata use crosses 80% (`thinpool status`
  shows low_water_reached); at 70% the sparse data file grows by 20% (and the metadata by
  20% when its use crosses 70%), up to 100G and to what the host file system has free.
  Then writes that need space queue for --no-space-timeout seconds (0: forever) or fail at
  once with --error-if-no-space.";

/// Space options on the command line (all optional: `create` fills in the defaults,
/// `serve` keeps what `pool.json` says).
#[derive(clap::Args, Debug, Default, Clone)]
pub struct SpaceArgs {
    /// Warn (once per crossing, and in `status`) when data or metadata use reaches PERCENT
    /// [create's default: 80].
    #[arg(long = "low-water", value_name = "PERCENT", value_parser = clap::value_parser!(u32).range(1..=100))]
    pub low_water: Option<u32>,
    /// Grow the data file (and the metadata) when its use reaches PERCENT [default: off].
    #[arg(long = "autoextend-threshold", value_name = "PERCENT", value_parser = clap::value_parser!(u32).range(1..=100))]
    pub autoextend_threshold: Option<u32>,
    /// How much each growth adds: a share of the current size (`20%`) or a size (`1G`)
    /// [default: 20%].
    #[arg(long = "autoextend-by", value_name = "PERCENT|SIZE")]
    pub autoextend_by: Option<String>,
    /// Largest data size autoextend grows to [default: no limit but the host's free space].
    #[arg(long = "autoextend-max", value_name = "SIZE")]
    pub autoextend_max: Option<String>,
    /// Stop autoextend (serve: for this run).
    #[arg(long = "no-autoextend", conflicts_with_all = ["autoextend_threshold", "autoextend_by", "autoextend_max"])]
    pub no_autoextend: bool,
    /// How long a write that needs space waits when the pool is out of it before it fails
    /// with ENOSPC; 0 waits forever [create's default: 60].
    #[arg(long = "no-space-timeout", value_name = "SECONDS")]
    pub no_space_timeout: Option<u64>,
}

impl SpaceArgs {
    /// `base` with the options given on the command line.
    pub fn apply(&self, base: SpaceOptions) -> anyhow::Result<SpaceOptions> {
        let mut space = base;
        if let Some(percent) = self.low_water {
            space.low_water_percent = percent;
        }
        if let Some(seconds) = self.no_space_timeout {
            space.no_space_timeout_seconds = seconds;
        }
        if self.no_autoextend {
            space.autoextend = None;
        }
        let given = self.autoextend_threshold.is_some()
            || self.autoextend_by.is_some()
            || self.autoextend_max.is_some();
        if given {
            let mut autoextend = match (space.autoextend, self.autoextend_threshold) {
                (_, Some(threshold)) => StoredAutoextend {
                    threshold_percent: threshold,
                    ..space.autoextend.unwrap_or(StoredAutoextend {
                        threshold_percent: threshold,
                        by_percent: Some(20),
                        by_bytes: None,
                        max_bytes: u64::MAX,
                    })
                },
                (Some(current), None) => current,
                (None, None) => bail!(
                    "--autoextend-by and --autoextend-max need --autoextend-threshold (autoextend is off)"
                ),
            };
            if let Some(by) = &self.autoextend_by {
                let (percent, bytes) = parse_extend_by(by)?;
                autoextend.by_percent = percent;
                autoextend.by_bytes = bytes;
            }
            if let Some(max) = &self.autoextend_max {
                autoextend.max_bytes = parse_size(max).context("--autoextend-max")?;
            }
            space.autoextend = Some(autoextend);
        }
        Ok(space)
    }
}

/// `20%` → a percent, `1G` → bytes.
fn parse_extend_by(text: &str) -> anyhow::Result<(Option<u32>, Option<u64>)> {
    if let Some(number) = text.trim().strip_suffix('%') {
        let percent: u32 = number
            .trim()
            .parse()
            .with_context(|| format!("--autoextend-by {text:?}: not a percent"))?;
        if percent == 0 || percent > 1000 {
            bail!("--autoextend-by {text:?}: from 1% to 1000%");
        }
        return Ok((Some(percent), None));
    }
    let bytes = parse_size(text).context("--autoextend-by")?;
    if bytes == 0 {
        bail!("--autoextend-by {text:?}: must be more than 0");
    }
    Ok((None, Some(bytes)))
}

/// One line describing autoextend, for people.
pub fn describe_autoextend(autoextend: Option<&StoredAutoextend>) -> String {
    match autoextend {
        None => "off".to_string(),
        Some(a) => {
            let by = match (a.by_percent, a.by_bytes) {
                (_, Some(bytes)) => format_size(bytes),
                (percent, None) => format!("{}%", percent.unwrap_or(20)),
            };
            let max = if a.max_bytes == u64::MAX {
                "no limit but the host's free space".to_string()
            } else {
                format!("up to {}", format_size(a.max_bytes))
            };
            format!("at {}% use, by {by}, {max}", a.threshold_percent)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(threshold: Option<u32>, by: Option<&str>, max: Option<&str>) -> SpaceArgs {
        SpaceArgs {
            autoextend_threshold: threshold,
            autoextend_by: by.map(str::to_string),
            autoextend_max: max.map(str::to_string),
            ..SpaceArgs::default()
        }
    }

    #[test]
    fn autoextend_options_combine_with_what_is_stored() {
        let base = SpaceOptions::default();
        let on = args(Some(70), Some("25%"), Some("1G")).apply(base).unwrap();
        let stored = on.autoextend.unwrap();
        assert_eq!(
            (stored.threshold_percent, stored.by_percent, stored.by_bytes),
            (70, Some(25), None)
        );
        assert_eq!(stored.max_bytes, 1 << 30);
        // serve changes only what it is given.
        let bigger = args(None, None, Some("2G")).apply(on).unwrap();
        assert_eq!(bigger.autoextend.unwrap().max_bytes, 2 << 30);
        assert_eq!(bigger.autoextend.unwrap().threshold_percent, 70);
        let by_size = args(None, Some("64M"), None).apply(on).unwrap();
        assert_eq!(by_size.autoextend.unwrap().by_bytes, Some(64 << 20));
        assert!(args(None, Some("10%"), None).apply(base).is_err());
        assert!(args(Some(50), Some("0%"), None).apply(base).is_err());
        assert!(args(Some(50), Some("x"), None).apply(base).is_err());
        let off = SpaceArgs {
            no_autoextend: true,
            ..SpaceArgs::default()
        }
        .apply(on)
        .unwrap();
        assert_eq!(off.autoextend, None);
    }
}
