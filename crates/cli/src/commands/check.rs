//! `thinpool check`: validate pool metadata, with `thin_check`'s arguments, output and exit
//! codes (0: clean; 1: a fatal problem, or a non-fatal one without
//! `--ignore-non-fatal-errors`).
//!
//! Output, as thin_check 1.1.0: the phases ("device details tree", ...) and every problem
//! on stderr, then `TRANSACTION_ID=` and `METADATA_FREE_BLOCKS=` on stdout; `-q` silences
//! both. A progress bar (`crate::progress`) replaces the phase lines when stderr is a
//! terminal and the metadata is large, or whenever `--progress` is given.
//!
//! Leaks, as thin_check 1.1.0 (what LVM's `thin_check -q --clear-needs-check-flag` at
//! activation relies on): blocks with a stored count that nothing references are non-fatal;
//! with `--auto-repair` or `--clear-needs-check-flag` they are freed in place
//! (`check::repair_leaks`), and the check passes if nothing else was wrong. Anything fatal
//! is never repaired here (`thinpool repair` rebuilds). `--clear-needs-check-flag` and
//! `--auto-repair` are refused with `-m` (a metadata snapshot is not what the pool opens),
//! and `--auto-repair` with `--skip-mappings` or `--super-block-only` (the counts are not
//! checked then), each as a usage error (exit 2), as 1.1.0 refuses them.

use anyhow::Context;
use persistent_data::{BlockDevice, FileDevice};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use thin_pool::format::check::{self, CheckOptions, LeafOccupancy, Phase, Progress, Report, Rule};
use thin_pool::PoolMetadata;

use super::{ToolsVersion, ToolsVersionFlag};
use crate::progress::{Bar, Unit};
use thinpool_daemon::json::CheckRecord;

/// Metadata blocks in use above which a terminal gets a progress bar (64 MiB of metadata).
const PROGRESS_BAR_MIN_BLOCKS: u64 = 16_384;

/// Arguments (those of `thin_check`).
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  thinpool check /srv/pool/metadata                   # a pool that is not being served
  thinpool check --super-block-only /dev/vg0/pool_tmeta
  thinpool check -q /srv/pool/metadata || echo damaged # the exit status only")]
pub struct Args {
    /// The metadata file or device to check.
    #[arg(value_name = "INPUT")]
    input: PathBuf,
    /// Suppress output messages, return only the exit code.
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    /// Only check the superblock.
    #[arg(long = "super-block-only")]
    super_block_only: bool,
    /// Don't check the mapping tree (nor the reference counts).
    #[arg(long = "skip-mappings")]
    skip_mappings: bool,
    /// Only return a non-zero exit code if a fatal error is found.
    #[arg(long = "ignore-non-fatal-errors")]
    ignore_non_fatal_errors: bool,
    /// Clear the needs_check flag in the superblock after a clean check (leaks repaired).
    #[arg(long = "clear-needs-check-flag", conflicts_with = "metadata_snap")]
    clear_needs_check_flag: bool,
    /// Check the metadata snapshot's trees (on a live pool).
    #[arg(short = 'm', long = "metadata-snap")]
    metadata_snap: bool,
    /// Auto repair trivial issues: free leaked metadata and data blocks.
    #[arg(
        long = "auto-repair",
        conflicts_with_all = ["metadata_snap", "skip_mappings", "super_block_only"]
    )]
    auto_repair: bool,
    /// Whose leaf occupancy rule to apply: 1 lets bottom-level mapping leaves be less than a
    /// third full; 0.9.0 (the kernel's invariant) wants every non-root node a third full.
    #[arg(
        long = "tools-version",
        value_name = "VERSION",
        default_value = "0.9.0"
    )]
    tools_version: ToolsVersion,
    /// Print the result as one JSON object on stdout instead of the text (docs/json.md);
    /// the exit status is as without it.
    #[arg(long = "json")]
    json: bool,
    #[command(flatten)]
    version: ToolsVersionFlag,
}

/// Run the command.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if args.version.print() {
        return Ok(ExitCode::SUCCESS);
    }
    let repair = args.auto_repair || args.clear_needs_check_flag;
    refuse_directory(&args.input)?;
    let device = FileDevice::open(&args.input, false)
        .with_context(|| format!("cannot open {}", args.input.display()))?;
    let device: Arc<dyn BlockDevice> = Arc::new(device);
    let options = CheckOptions {
        super_block_only: args.super_block_only,
        skip_mappings: args.skip_mappings,
        ignore_non_fatal: args.ignore_non_fatal_errors,
        leaf_occupancy: match args.tools_version {
            ToolsVersion::V1 => LeafOccupancy::SkipBottomLeaves,
            ToolsVersion::V0_9 => LeafOccupancy::Strict,
        },
        metadata_snap: args.metadata_snap,
        data_device_bytes: None,
    };
    // With --json the report is the JSON object alone.
    let quiet = args.quiet || args.json;
    let mut display = Display::new(quiet);
    let mut report = check::check(device, &options, &mut |progress| display.update(progress));
    display.finish();
    if !quiet {
        print_report(&report, repair);
    }
    let leaks_repaired = repair && report.fatal_count == 0 && has_leaks(&report);
    if leaks_repaired {
        report = repair_leaks(&args.input, &options, report, quiet)?;
    }
    let passed = report.passes(args.ignore_non_fatal_errors);
    if passed && args.clear_needs_check_flag && report.summary.flags & 1 != 0 {
        clear_needs_check(&args.input)?;
        report.summary.flags &= !1;
        if !quiet {
            eprintln!("Cleared needs_check flag");
        }
    }
    if args.json {
        let readable = superblock_readable(&report);
        super::json::print(&CheckRecord::new(&report, passed, readable, leaks_repaired))?;
    }
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// A directory is not metadata (reading it fails with a bare "i/o error"): say so, and for
/// a pool directory name the metadata to check instead.
fn refuse_directory(input: &std::path::Path) -> anyhow::Result<()> {
    if !input.is_dir() {
        return Ok(());
    }
    let shown = input.display();
    let metadata = input.join(thin_pool::METADATA_FILE);
    if metadata.is_file() {
        anyhow::bail!(
            "{shown} is a pool directory; check takes the metadata file or device: \
             `thinpool check {}`",
            metadata.display()
        );
    }
    if let Ok(Some(devices)) = thin_pool::block_device::DevicePaths::load(input) {
        anyhow::bail!(
            "{shown} is the directory of a pool on block devices; check takes the metadata \
             device: `thinpool check {}`",
            devices.metadata_device.display()
        );
    }
    anyhow::bail!("{shown} is a directory; check takes a metadata file or device (like thin_check)")
}

fn has_leaks(report: &Report) -> bool {
    report.summary.metadata_leaked_blocks > 0 || report.summary.data_leaked_blocks > 0
}

/// Free the leaks in place (`--auto-repair`, `--clear-needs-check-flag`); returns the check
/// of the repaired metadata.
fn repair_leaks(
    path: &std::path::Path,
    options: &CheckOptions,
    report: Report,
    quiet: bool,
) -> anyhow::Result<Report> {
    if !quiet {
        if report.summary.data_leaked_blocks > 0 {
            eprintln!("Repairing data leaks.");
        }
        if report.summary.metadata_leaked_blocks > 0 {
            eprintln!("Repairing metadata leaks.");
        }
    }
    let device = FileDevice::open(path, true)
        .with_context(|| format!("cannot open {} for writing", path.display()))?;
    let repair = check::repair_leaks(Arc::new(device), options, report)
        .with_context(|| format!("repairing the leaks of {}", path.display()))?;
    if !quiet && !repair.report.is_clean() {
        print_report(&repair.report, true);
    }
    Ok(repair.report)
}

fn print_report(report: &Report, repairing: bool) {
    let mut stderr = std::io::stderr().lock();
    for problem in &report.problems {
        let _ = writeln!(stderr, "{problem}");
    }
    if report.problems_omitted > 0 {
        let _ = writeln!(stderr, "... {} more problems", report.problems_omitted);
    }
    if report.summary.metadata_leaked_blocks > 0 {
        let _ = writeln!(
            stderr,
            "{} metadata blocks have leaked.",
            report.summary.metadata_leaked_blocks
        );
    }
    let data_leaked = report.summary.data_leaked_blocks;
    if data_leaked > 0 {
        let _ = writeln!(stderr, "{data_leaked} data blocks have leaked.");
    }
    if report.summary.data_bad_count_blocks > data_leaked {
        let _ = writeln!(
            stderr,
            "{} data blocks have bad reference counts.",
            report.summary.data_bad_count_blocks - data_leaked
        );
    }
    if has_leaks(report) && report.fatal_count == 0 && !repairing {
        let _ = writeln!(stderr, "perhaps you wanted to run with --auto-repair");
    }
    if report.fatal_count + report.non_fatal_count > 0 {
        let _ = writeln!(
            stderr,
            "{} errors, {} non-fatal errors",
            report.fatal_count, report.non_fatal_count
        );
    }
    // thin_check prints the figures whenever it could read the superblock.
    if superblock_readable(report) {
        println!("TRANSACTION_ID={}", report.summary.transaction_id);
        println!(
            "METADATA_FREE_BLOCKS={}",
            report.summary.metadata_free_blocks
        );
    }
}

/// Whether the check could read the superblock (its figures mean something).
fn superblock_readable(report: &Report) -> bool {
    !report
        .problems
        .iter()
        .any(|p| matches!(p.rule, Rule::SuperblockChecksum | Rule::Io) && p.block == Some(0))
}

fn clear_needs_check(path: &std::path::Path) -> anyhow::Result<()> {
    let (device, _claim) = thin_pool::owner::open_for_writing(path)
        .with_context(|| format!("cannot open {} for writing", path.display()))?;
    let mut metadata = PoolMetadata::open(Arc::new(device))
        .with_context(|| format!("opening {}", path.display()))?;
    metadata
        .clear_needs_check()
        .with_context(|| format!("clearing the needs_check flag of {}", path.display()))
}

/// Phase lines (like thin_check) or a progress bar: on a terminal for large metadata, or
/// always with `--progress`.
struct Display {
    quiet: bool,
    started: bool,
    phase: Option<Phase>,
    bar: Option<Bar>,
}

impl Display {
    fn new(quiet: bool) -> Display {
        Display {
            quiet,
            started: false,
            phase: None,
            bar: None,
        }
    }

    fn update(&mut self, progress: Progress) {
        if self.quiet || progress.phase == Phase::Superblock {
            return;
        }
        if !self.started {
            self.started = true;
            let large = progress.total_blocks >= PROGRESS_BAR_MIN_BLOCKS;
            if crate::progress::shown() && (large || crate::progress::forced()) {
                self.bar = Some(Bar::counting("check", Unit::Blocks, Some(0)));
            } else {
                eprintln!("Checking thin metadata");
            }
        }
        let new_phase = self.phase != Some(progress.phase);
        self.phase = Some(progress.phase);
        match &self.bar {
            Some(bar) => {
                if new_phase {
                    bar.set_message(progress.phase.to_string());
                }
                bar.set(
                    progress.done_blocks,
                    progress.total_blocks.max(progress.done_blocks),
                );
            }
            None if new_phase => eprintln!("{}", progress.phase),
            None => {}
        }
    }

    fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish();
        }
    }
}
