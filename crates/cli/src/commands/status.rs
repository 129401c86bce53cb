//! `thinpool status`: the pool's data and metadata use (used/total blocks and %), transaction
//! id, mode and `needs_check`, the thin ids the catalog and the metadata disagree on
//! (`unadopted`, `orphaned`), or `--json`, from the pool or its server.

use anyhow::Context;
use std::process::ExitCode;

use crate::control::{self, Request, StatusRecord};
use crate::pool_dir::{format_size, PoolArg};

/// Arguments.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  thinpool status --pool /srv/pool
  THINPOOL_POOL=/srv/pool thinpool status --json | jq .data_used_percent")]
pub struct Args {
    #[command(flatten)]
    pool: PoolArg,
    /// Print the status as a JSON object.
    #[arg(long = "json")]
    json: bool,
}

/// Run the command.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let dir = args.pool.resolve();
    let status = control::ask(&dir, &Request::Status)
        .context("cannot read the pool status")?
        .into_status()?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{}", render(&status));
        print!("{}", super::list::render_disagreements(&status));
        if let Some(devices) = thin_pool::block_device::DevicePaths::load(&dir.path)? {
            println!(
                "devices:           metadata {}, data {}{}",
                devices.metadata_device.display(),
                devices.data_device.display(),
                if devices.direct_io { " (O_DIRECT)" } else { "" }
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn yes_no(value: bool) -> &'static str {
    if value {
        "yes"
    } else {
        "no"
    }
}

/// The no-space timeout for people.
pub fn describe_timeout(seconds: u64) -> String {
    if seconds == 0 {
        "none (writes queue until space comes)".to_string()
    } else {
        format!("{seconds} s")
    }
}

/// The text form: one `label: value` line per field.
pub fn render(status: &StatusRecord) -> String {
    space_lines(status)
        .into_iter()
        .chain(policy_lines(status))
        .map(|(label, value)| format!("{:<19}{value}\n", format!("{label}:")))
        .collect()
}

/// The lines about space and state: data, metadata, transaction, mode, volumes.
fn space_lines(status: &StatusRecord) -> [(&'static str, String); 6] {
    let block = status.block_size_bytes;
    [
        (
            "data",
            format!(
                "{}/{} blocks ({:.2}%), {} of {}, block size {}",
                status.data_used_blocks,
                status.data_total_blocks,
                status.data_used_percent,
                format_size(status.data_used_blocks * block),
                format_size(status.data_total_blocks * block),
                format_size(block),
            ),
        ),
        (
            "metadata",
            format!(
                "{}/{} blocks ({:.2}%)",
                status.metadata_used_blocks,
                status.metadata_total_blocks,
                status.metadata_used_percent,
            ),
        ),
        ("transaction id", status.transaction_id.to_string()),
        (
            "mode",
            match &status.fail_reason {
                Some(reason) => format!("{} ({reason})", status.mode),
                None => status.mode.clone(),
            },
        ),
        ("needs_check", yes_no(status.needs_check).to_string()),
        ("volumes", status.volume_count.to_string()),
    ]
}

/// The lines about the pool's policies: zeroing, no space, alerts, autoextend, passdown.
fn policy_lines(status: &StatusRecord) -> [(&'static str, String); 6] {
    [
        (
            "zero new blocks",
            yes_no(status.zero_new_blocks).to_string(),
        ),
        (
            "error_if_no_space",
            yes_no(status.error_if_no_space).to_string(),
        ),
        (
            "low water",
            format!(
                "{}% (data reached: {}, metadata reached: {})",
                status.low_water_percent,
                yes_no(status.low_water_reached),
                yes_no(status.metadata_low_water_reached)
            ),
        ),
        (
            "autoextend",
            thinpool_daemon::space::describe_autoextend(status.autoextend.as_ref()),
        ),
        (
            "no-space timeout",
            describe_timeout(status.no_space_timeout_seconds),
        ),
        (
            "discard passdown",
            format!(
                "{} ({} given back since open)",
                yes_no(status.discard_passdown),
                format_size(status.data_bytes_passed_down)
            ),
        ),
    ]
}
