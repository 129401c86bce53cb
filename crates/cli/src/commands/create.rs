//! `thinpool create`: make a pool in a directory (files `metadata`, `data`, the catalog, and
//! `pool.json` with the options every later open uses: zeroing, the no-space policy, and the
//! space options of `space`), or with `--grow`, grow an existing pool's data device to
//! `--data-size` (through the control socket when it is served).
//! With `--metadata-device` and `--data-device` the pool is made on block devices, which
//! the directory names (`create_devices`); `--grow` without a size then grows to the data
//! device's size.

use anyhow::Context;
use std::process::ExitCode;
use thin_pool::CreateOptions;

use crate::pool_dir::{format_size, parse_size_nonzero, PoolArg, StoredOptions};
use thinpool_daemon::create::{create_pool, DATA_SIZE_DEFAULT};

/// Arguments.
#[derive(clap::Args, Debug)]
#[command(after_help = thinpool_daemon::space::SPACE_HELP_EXAMPLE)]
pub struct Args {
    #[command(flatten)]
    pool: PoolArg,
    /// Data device size (K, M, G, T suffixes) [default: 16G; the file is sparse].
    #[arg(long = "data-size", value_name = "SIZE", allow_hyphen_values = true)]
    data_size: Option<String>,
    /// Data block size, 64K to 1G in multiples of 64K.
    #[arg(
        long = "block-size",
        value_name = "SIZE",
        default_value = "64K",
        allow_hyphen_values = true
    )]
    block_size: String,
    /// Metadata device size [default: estimated from the data size].
    #[arg(
        long = "metadata-size",
        value_name = "SIZE",
        allow_hyphen_values = true
    )]
    metadata_size: Option<String>,
    /// Don't zero the unwritten part of newly provisioned blocks.
    #[arg(long = "no-zero")]
    no_zero: bool,
    /// Fail writes at once when out of data space, instead of queueing them for a while.
    #[arg(long = "error-if-no-space")]
    error_if_no_space: bool,
    /// Don't give freed data blocks back to the host (no hole punched in the data file
    /// when blocks are freed; `thinpool trim` still does).
    #[arg(long = "no-discard-passdown")]
    no_discard_passdown: bool,
    #[command(flatten)]
    space: thinpool_daemon::space::SpaceArgs,
    /// Grow an existing pool's data device to --data-size instead of creating a pool
    /// (a pool on block devices: to the data device's size when no --data-size is given);
    /// the same as `thinpool grow`, which grows the metadata too.
    #[arg(long = "grow", conflicts_with_all = ["block_size", "metadata_size", "no_zero", "error_if_no_space"])]
    grow: bool,
    /// Print the pool's status as JSON (docs/json.md).
    #[arg(long = "json")]
    json: bool,
    #[command(flatten)]
    devices: super::create_devices::DeviceArgs,
}

/// Run the command.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let dir = args.pool.resolve();
    if args.grow {
        let data_size_bytes = match args.data_size.as_deref() {
            Some(size) => parse_size_nonzero(size).context("--data-size")?,
            None => super::create_devices::grow_size(&dir, &args.devices)?,
        };
        return super::grow::grow_data(&dir, data_size_bytes, args.json);
    }
    let data_size_bytes =
        parse_size_nonzero(args.data_size.as_deref().unwrap_or(DATA_SIZE_DEFAULT))
            .context("--data-size")?;
    let mut stored = StoredOptions {
        zero_new_blocks: !args.no_zero,
        error_if_no_space: args.error_if_no_space,
        ..StoredOptions::default()
    };
    stored.space = args.space.apply(stored.space)?;
    stored.space.discard_passdown = !args.no_discard_passdown;
    let create = CreateOptions {
        data_size_bytes,
        block_size_bytes: parse_size_nonzero(&args.block_size).context("--block-size")?,
        metadata_size_bytes: args
            .metadata_size
            .as_deref()
            .map(parse_size_nonzero)
            .transpose()
            .context("--metadata-size")?,
    };
    let status = if let Some(devices) = args.devices.paths(&args.data_size, &args.metadata_size)? {
        super::create_devices::create_device_pool(&dir, &devices, create.block_size_bytes, stored)?
    } else {
        if let Some(warning) = host_space_warning(&dir.path, create.data_size_bytes) {
            eprintln!("{warning}");
        }
        create_pool(&dir, &create, stored)?
    };
    if args.json {
        super::json::print(&status)?;
    } else {
        println!(
            "created pool {}: data {} ({} blocks of {}), metadata {} blocks, zeroing {}, error_if_no_space {}",
            dir.path.display(),
            format_size(status.data_total_blocks * status.block_size_bytes),
            status.data_total_blocks,
            format_size(status.block_size_bytes),
            status.metadata_total_blocks,
            on_off(status.zero_new_blocks),
            on_off(status.error_if_no_space),
        );
        println!(
            "low water {}%, autoextend {}, no-space timeout {}",
            status.low_water_percent,
            thinpool_daemon::space::describe_autoextend(stored.space.autoextend.as_ref()),
            super::status::describe_timeout(status.no_space_timeout_seconds),
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// A pool whose data is larger than the host file system's free space is allowed (the data
/// file is sparse, as thin provisioning intends), with this warning: writes beyond that space
/// will fail with ENOSPC. (Metadata that does not fit is refused by [`thin_pool::Pool::create`]: it is
/// preallocated.)
fn host_space_warning(dir: &std::path::Path, data_size_bytes: u64) -> Option<String> {
    let free = thin_pool::host_free_bytes(dir)?;
    (data_size_bytes > free).then(|| {
        format!(
            "warning: the data file ({}, sparse) is larger than the {} free on the host file system of {}: writes beyond that will fail with ENOSPC",
            format_size(data_size_bytes),
            format_size(free),
            dir.display()
        )
    })
}

fn on_off(value: bool) -> &'static str {
    if value {
        "on"
    } else {
        "off"
    }
}
