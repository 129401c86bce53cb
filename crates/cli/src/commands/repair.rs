//! `thinpool repair`: rebuild damaged pool metadata from what can be read, with the
//! arguments and exit codes of `thin_repair` 1.1.0 (see `thin_pool::format::repair` for what
//! is kept and how the roots are found).
//!
//! The input is only read. The output (file or device) must exist, as with `thin_repair`:
//! its size becomes the metadata size; it may not be the input. A damaged superblock needs
//! `--data-block-size`; the transaction id and the data device's size are then rebuilt
//! from the trees unless given. What was skipped is said on stderr (unless `-q`). Errors
//! exit with status 64, like the 1.x tools.

use anyhow::{bail, Context};
use persistent_data::{BlockDevice, FileDevice};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use thin_pool::format::repair::{self, Recovery, RepairOptions};

use super::{tools_exit, SuperblockOverrides, ToolsVersionFlag};

/// Arguments (those of `thin_repair`).
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  thinpool check /srv/pool/metadata                # reports damage
  thinpool repair -i /srv/pool/metadata -o /tmp/repaired-metadata
  thinpool check /tmp/repaired-metadata && mv /tmp/repaired-metadata /srv/pool/metadata")]
pub struct Args {
    /// The damaged metadata file or device (only read).
    #[arg(short = 'i', long = "input", value_name = "FILE")]
    input: PathBuf,
    /// The metadata file or device to write (must exist; its size is the metadata size).
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    output: PathBuf,
    /// Suppress output messages, return only the exit code.
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    #[command(flatten)]
    overrides: SuperblockOverrides,
    #[command(flatten)]
    version: ToolsVersionFlag,
}

/// Run the command.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if args.version.print() {
        return Ok(ExitCode::SUCCESS);
    }
    Ok(tools_exit(repair_file(&args), args.quiet))
}

fn repair_file(args: &Args) -> anyhow::Result<()> {
    let input = FileDevice::open(&args.input, false)
        .with_context(|| format!("cannot open input {}", args.input.display()))?;
    if !args.output.exists() {
        bail!(
            "output {} does not exist: create it with the metadata size first",
            args.output.display()
        );
    }
    let same = std::fs::canonicalize(&args.input).ok() == std::fs::canonicalize(&args.output).ok();
    if same {
        bail!(
            "the output must not be the input ({})",
            args.input.display()
        );
    }
    let output = FileDevice::open(&args.output, true)
        .with_context(|| format!("cannot open output {}", args.output.display()))?;
    if BlockDevice::block_count(&output) < 8 {
        bail!("output {} is too small for metadata", args.output.display());
    }
    let options = RepairOptions {
        transaction_id: args.overrides.transaction_id,
        data_block_size_sectors: args.overrides.data_block_size,
        data_block_count: args.overrides.nr_data_blocks,
    };
    let recovery =
        repair::repair(Arc::new(input), Arc::new(output), &options).with_context(|| {
            format!(
                "repairing {} into {}",
                args.input.display(),
                args.output.display()
            )
        })?;
    if !args.quiet {
        describe(&recovery);
    }
    Ok(())
}

/// What was lost, on stderr (nothing when nothing was).
fn describe(recovery: &Recovery) {
    let skipped = &recovery.skipped;
    if !skipped.is_empty() {
        eprintln!(
            "skipped {} damaged nodes, {} repeated nodes (cycles), {} references beyond the device, {} bad mappings",
            skipped.bad_nodes, skipped.repeated_nodes, skipped.out_of_range, skipped.bad_values
        );
    }
    if !recovery.devices_without_details.is_empty() {
        eprintln!(
            "devices whose details were lost (new ones written): {:?}",
            recovery.devices_without_details
        );
    }
    if !recovery.devices_without_mappings.is_empty() {
        eprintln!(
            "devices whose mapping tree was lost (not written): {:?}",
            recovery.devices_without_mappings
        );
    }
}
