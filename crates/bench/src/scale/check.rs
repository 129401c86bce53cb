//! `thinpool check` against `thin_check` 1.1.0 on the scale section's metadata files, both
//! as child processes under GNU time (for their peak RSS), which one goes first alternating.

use super::super::dir::BenchDir;
use super::super::mappings::mapping_label;
use super::super::report::{Row, Target};
use super::super::{progress, Sizes};
use super::CHECK_TIME_SHARE_MAX;
use anyhow::{ensure, Context};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use thin_pool::METADATA_FILE;

/// The two checkers: `thin_check` from `$THINPOOL_TOOLS_DIR`, and this binary.
pub(super) struct CheckTools {
    thin_check: PathBuf,
    thinpool: PathBuf,
}

pub(super) fn check_tools() -> Option<CheckTools> {
    let skip = |why: &str| {
        progress(&format!("scale: no check comparison: {why}"));
        None
    };
    let Some(tools) = std::env::var_os("THINPOOL_TOOLS_DIR") else {
        return skip("THINPOOL_TOOLS_DIR (thin-provisioning-tools 1.1.0's sbin) is not set");
    };
    let thin_check = Path::new(&tools).join("thin_check");
    if !thin_check.is_file() {
        return skip(&format!("no {}", thin_check.display()));
    }
    if !Path::new(TIME).is_file() {
        return skip(&format!("no {TIME} (Debian package time)"));
    }
    // `thinpool check` is the production binary's: $THINPOOL, else the one built beside this.
    let thinpool = match std::env::var_os("THINPOOL") {
        Some(path) => PathBuf::from(path),
        None => std::env::current_exe().ok()?.with_file_name("thinpool"),
    };
    if !thinpool.is_file() {
        return skip(&format!(
            "no {} (build it: cargo build -p thinpool, or set THINPOOL)",
            thinpool.display()
        ));
    }
    Some(CheckTools {
        thin_check,
        thinpool,
    })
}

/// Check pairs with `--quick`.
const QUICK_CHECK_REPETITIONS: usize = 5;

/// GNU time: runs a command and reports its peak RSS.
const TIME: &str = "/usr/bin/time";

/// Paired samples of both checkers on one metadata file.
pub(super) struct CheckSamples {
    thinpool_ms: Vec<f64>,
    thin_check_ms: Vec<f64>,
    thinpool_mib: Vec<f64>,
    thin_check_mib: Vec<f64>,
}

pub(super) fn compare_checks(
    dir: &BenchDir,
    sizes: &Sizes,
    names: &[String],
    counts: &[u64],
    tools: &CheckTools,
) -> anyhow::Result<Vec<CheckSamples>> {
    let mut all = Vec::new();
    for (name, &count) in names.iter().zip(counts) {
        let metadata = dir.pool_path(name).join(METADATA_FILE);
        let rss_file = dir.path().join("check-rss");
        let mut samples = CheckSamples {
            thinpool_ms: Vec::new(),
            thin_check_ms: Vec::new(),
            thinpool_mib: Vec::new(),
            thin_check_mib: Vec::new(),
        };
        let repetition_count = if sizes.quick {
            QUICK_CHECK_REPETITIONS.min(sizes.repetition_count)
        } else {
            sizes.repetition_count
        };
        for repetition in 0..repetition_count {
            dir.check_interrupted()?;
            for turn in 0..2 {
                let ours = (turn + repetition) % 2 == 0;
                let mut command = Command::new(TIME);
                command.arg("-f").arg("%M").arg("-o").arg(&rss_file);
                if ours {
                    command.arg(&tools.thinpool).arg("check");
                } else {
                    command.arg(&tools.thin_check);
                }
                command.arg("-q").arg(&metadata);
                let started = Instant::now();
                let status = command
                    .status()
                    .with_context(|| format!("running {command:?}"))?;
                let ms = started.elapsed().as_secs_f64() * 1e3;
                ensure!(status.success(), "{command:?} failed: {status}");
                let kib: f64 = std::fs::read_to_string(&rss_file)?
                    .trim()
                    .parse()
                    .with_context(|| format!("reading the peak RSS in {}", rss_file.display()))?;
                let (times, mibs) = if ours {
                    (&mut samples.thinpool_ms, &mut samples.thinpool_mib)
                } else {
                    (&mut samples.thin_check_ms, &mut samples.thin_check_mib)
                };
                times.push(ms);
                mibs.push(kib / 1024.0);
            }
            progress(&format!(
                "scale {}/{}: check of {} mappings: thinpool {:.0} ms, {:.0} MiB; thin_check {:.0} ms, {:.0} MiB",
                repetition + 1,
                repetition_count,
                mapping_label(count),
                samples.thinpool_ms[repetition],
                samples.thinpool_mib[repetition],
                samples.thin_check_ms[repetition],
                samples.thin_check_mib[repetition],
            ));
        }
        std::fs::remove_file(&rss_file).ok();
        all.push(samples);
    }
    Ok(all)
}

/// The check comparison's rows: wall time (with its target) and peak RSS per pool.
pub(super) fn rows(counts: &[u64], checks: &[CheckSamples]) -> Vec<Row> {
    let mut rows = Vec::new();
    for (i, check) in checks.iter().enumerate() {
        let label = mapping_label(counts[i]);
        rows.push(
            Row::new(
                format!("thinpool check vs thin_check 1.1.0: {label} mappings, wall time"),
                &check.thinpool_ms,
                &check.thin_check_ms,
                "ms",
            )
            .target(Target::RatioAtMost(CHECK_TIME_SHARE_MAX)),
        );
        rows.push(Row::new(
            format!("thinpool check vs thin_check 1.1.0: {label} mappings, peak RSS"),
            &check.thinpool_mib,
            &check.thin_check_mib,
            "MiB",
        ));
    }
    rows
}
