//! `thinpool grow`: grow a pool's data (to `--data-size`, or for a pool on block devices to
//! its data device's size) or, with `--metadata`, its metadata (to `--metadata-size`, or
//! to the metadata device's size after the device was extended, as `lvextend
//! --poolmetadatasize` does for LVM). Online through the control socket when the pool is
//! served, else on the pool directly. `create --grow` is the older name of the data grow.

use anyhow::{anyhow, bail, Context};
use std::process::ExitCode;

use crate::control::{self, Outcome, Request, StatusRecord};
use crate::pool_dir::{format_size, parse_size_nonzero, PoolArg, PoolDir};

/// Arguments.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  thinpool grow --data-size 64G        # a pool whose data is a file
  lvextend -L +10G vg/tdata && thinpool grow        # a pool on block devices: to the device's size
  lvextend -L +64M vg/tmeta && thinpool grow --metadata")]
pub struct Args {
    #[command(flatten)]
    pool: PoolArg,
    /// Grow the data to this size (K, M, G, T suffixes) [default, for a pool on block
    /// devices: the data device's size].
    #[arg(long = "data-size", value_name = "SIZE", allow_hyphen_values = true)]
    data_size: Option<String>,
    /// Grow the metadata instead: to --metadata-size, or to the metadata device's size.
    #[arg(long = "metadata", conflicts_with = "data_size")]
    metadata: bool,
    /// The metadata's new size (a metadata file is extended to it).
    #[arg(
        long = "metadata-size",
        value_name = "SIZE",
        requires = "metadata",
        allow_hyphen_values = true
    )]
    metadata_size: Option<String>,
    /// Print the pool's status after the grow as JSON.
    #[arg(long = "json")]
    json: bool,
}

/// Run the command.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let dir = args.pool.resolve();
    if args.metadata {
        let size_bytes = args
            .metadata_size
            .as_deref()
            .map(parse_size_nonzero)
            .transpose()
            .context("--metadata-size")?;
        return grow_metadata(&dir, size_bytes, args.json);
    }
    let data_size_bytes = match args.data_size.as_deref() {
        Some(size) => parse_size_nonzero(size).context("--data-size")?,
        None => super::create_devices::data_device_size(&dir)?,
    };
    grow_data(&dir, data_size_bytes, args.json)
}

/// Grows the data of the pool in `dir` to `data_size_bytes` (also `create --grow`).
pub fn grow_data(dir: &PoolDir, data_size_bytes: u64, json: bool) -> anyhow::Result<ExitCode> {
    let request = Request::GrowData {
        size_bytes: data_size_bytes,
    };
    let what = || {
        format!(
            "cannot grow the data of {} to {}",
            dir.path.display(),
            format_size(data_size_bytes)
        )
    };
    let status = ask_status(dir, &request, what)?;
    if json {
        super::json::print(&status)?;
    } else {
        println!(
            "grew pool {} data to {} ({} blocks)",
            dir.path.display(),
            format_size(status.data_total_blocks * status.block_size_bytes),
            status.data_total_blocks
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Grows the metadata of the pool in `dir`.
fn grow_metadata(dir: &PoolDir, size_bytes: Option<u64>, json: bool) -> anyhow::Result<ExitCode> {
    let request = Request::GrowMetadata { size_bytes };
    let what = || match size_bytes {
        Some(bytes) => format!(
            "cannot grow the metadata of {} to {}",
            dir.path.display(),
            format_size(bytes)
        ),
        None => format!(
            "cannot grow the metadata of {} to its device's size",
            dir.path.display()
        ),
    };
    let status = ask_status(dir, &request, what)?;
    if json {
        super::json::print(&status)?;
    } else {
        println!(
            "grew pool {} metadata to {} ({} blocks, {} used)",
            dir.path.display(),
            format_size(status.metadata_total_blocks * 4096),
            status.metadata_total_blocks,
            status.metadata_used_blocks
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `request`, whose answer is the pool's status; a refusal says `what` failed.
fn ask_status(
    dir: &PoolDir,
    request: &Request,
    what: impl Fn() -> String,
) -> anyhow::Result<StatusRecord> {
    match control::perform(dir, request)? {
        Ok(Outcome::Status(status)) => Ok(status),
        Ok(other) => bail!("unexpected answer: {other:?}"),
        Err(error) => Err(anyhow!(error)).with_context(what),
    }
}
