//! `thinpool restore`: build pool metadata from an XML dump, with the arguments of
//! `thin_restore` 1.1.0 (see `thin_pool::format::restore` for what is written).
//!
//! Like `thin_restore`, the output (file or device) must already exist: its size becomes
//! the metadata size. Errors exit with status 64, like the 1.x tools. Progress
//! (`crate::progress`, not with `-q`): the bytes of the XML read, out of its size.
//!
//! Restored pools: dm-thin metadata holds no volume names or sizes (LVM keeps them), so a
//! pool directory whose `metadata` was restored here or by LVM's `thin_restore` gets a
//! catalog naming each volume `thin-ID` (`thinpool_daemon::restored`), with the size of the
//! data device (or up to its highest mapped block, if that is further; `volume resize`
//! changes it). `thinpool restore` into a pool
//! directory's `metadata` replaces the directory's catalogs, which described the metadata
//! it overwrote; the management commands and `serve` write the catalog when a pool directory
//! has none at all (the real `thin_restore` writes only the metadata).

use anyhow::{bail, Context};
use persistent_data::{BlockDevice, FileDevice};
use std::fs::File;
use std::io::BufReader;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use thin_pool::format::restore::{self, RestoreOptions};
use thin_pool::METADATA_FILE;

use super::{tools_exit, SuperblockOverrides, ToolsVersionFlag};
use crate::progress::{Bar, Unit};
use thinpool_daemon::restored::{has_catalog, write_restored_catalog};

/// Arguments (those of `thin_restore`).
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  thinpool dump /srv/pool/metadata -o pool.xml     # the pool is not served
  thinpool restore -i pool.xml -o /srv/pool/metadata
  thinpool restore -i pool.xml -o /dev/vg0/pool_tmeta --transaction-id 7")]
pub struct Args {
    /// The XML dump to read.
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

/// Run the command. Failures print `thinpool: <error with context>` (unless `-q`) and exit
/// with status 64, as the 1.x tools do.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if args.version.print() {
        return Ok(ExitCode::SUCCESS);
    }
    Ok(tools_exit(restore_file(&args), args.quiet))
}

fn restore_file(args: &Args) -> anyhow::Result<()> {
    let input = File::open(&args.input)
        .with_context(|| format!("cannot open input {}", args.input.display()))?;
    if !args.output.exists() {
        bail!(
            "output {} does not exist: create it with the metadata size first",
            args.output.display()
        );
    }
    // With the pool's claim, held to the end: refused while a server holds the pool.
    let (device, _claim) = thin_pool::owner::open_for_writing(&args.output)
        .with_context(|| format!("cannot open output {}", args.output.display()))?;
    if device_block_count(&device) < 8 {
        bail!("output {} is too small for metadata", args.output.display());
    }
    let options = RestoreOptions {
        transaction_id: args.overrides.transaction_id,
        data_block_size_sectors: args.overrides.data_block_size,
        data_block_count: args.overrides.nr_data_blocks,
        ..RestoreOptions::default()
    };
    let bar = match args.quiet {
        true => Bar::hidden(),
        false => Bar::counting(
            "restore",
            Unit::Bytes,
            input.metadata().ok().map(|m| m.len()),
        ),
    };
    let restored = restore::restore(
        BufReader::new(bar.wrap_read(input)),
        Arc::new(device),
        &options,
    );
    bar.finish();
    restored.with_context(|| {
        format!(
            "restoring {} to {}",
            args.input.display(),
            args.output.display()
        )
    })?;
    // Into a pool directory: its catalogs described the metadata just overwritten.
    let is_pool_metadata = args.output.file_name() == Some(METADATA_FILE.as_ref());
    if let Some(dir) = args.output.parent().filter(|_| is_pool_metadata) {
        if has_catalog(dir)? {
            write_restored_catalog(dir)?;
        }
    }
    Ok(())
}

fn device_block_count(device: &FileDevice) -> u64 {
    BlockDevice::block_count(device)
}
