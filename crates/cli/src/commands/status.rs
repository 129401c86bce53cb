//! `thinpool status`: the pool's data and metadata use (used/total blocks and %), transaction
//! id, mode and `needs_check`, the thin ids the catalog and the metadata disagree on
//! (`unadopted`, `orphaned`), the lag of each volume `thinpool replicate` replicates
//! (`replication`, from the pool directory's `replication.json`), or `--json`, from the
//! pool or its server.

use anyhow::Context;
use std::process::ExitCode;

use crate::control::{self, Request, StatusRecord};
use crate::pool_dir::{format_size, PoolArg};
use thinpool_daemon::replication;

/// Arguments.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  thinpool status --pool /srv/pool
  THINPOOL_POOL=/srv/pool thinpool status --json | jq .data_used_percent")]
pub struct Args {
    #[command(flatten)]
    pool: PoolArg,
    /// Print the status as a JSON object (docs/json.md).
    #[arg(long = "json")]
    json: bool,
}

/// Run the command.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let dir = args.pool.resolve();
    let mut status = control::ask(&dir, &Request::Status)
        .context("cannot read the pool status")?
        .into_status()?;
    status.replication = replication_lags(&dir).unwrap_or_else(|error| {
        // The pool's status stands without it.
        eprintln!("thinpool: warning: no replication lag: {error:#}");
        Vec::new()
    });
    if args.json {
        super::json::print(&status)?;
    } else {
        print!("{}", render(&status));
        print!("{}", render_served(&status));
        print!("{}", super::list::render_disagreements(&status));
        print!("{}", render_replication(&status.replication));
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

/// Who serves the pool and the volumes' sizes against the data: `served` (by which pid,
/// with its connections per front end, or no) and `provisioned` (with the over-provisioning
/// warning).
pub fn render_served(status: &StatusRecord) -> String {
    let served = match &status.served {
        Some(served) => format!(
            "yes, by pid {}: NBD connections {} on the Unix socket, {} over TCP; \
             vhost-user-blk sockets {}",
            served.pid,
            served.nbd_unix_connections,
            served.nbd_tcp_connections,
            served.vhost_user_blk_sockets
        ),
        None => "no (no server holds the pool)".to_string(),
    };
    let data_bytes = status.data_total_blocks * status.block_size_bytes;
    let mut provisioned = format!(
        "{} in volumes, {:.0}% of the {} data",
        format_size(status.volumes_size_bytes),
        crate::pool_dir::percent(status.volumes_size_bytes, data_bytes),
        format_size(data_bytes)
    );
    if status.overprovisioned {
        provisioned.push_str(
            " (over-provisioned: writes can run out of space before the volumes are full)",
        );
    }
    format!(
        "{:<19}{served}\n{:<19}{provisioned}\n",
        "served:", "provisioned:"
    )
}

/// Warns on stderr when the volumes' sizes add up to more than the pool's data (after a
/// `volume create` or `resize`), as `lvcreate` does.
pub fn warn_if_overprovisioned(status: &StatusRecord) {
    if status.overprovisioned {
        let data_bytes = status.data_total_blocks * status.block_size_bytes;
        eprintln!(
            "thinpool: warning: the volumes' sizes add up to {}, more than the pool's {} of data \
             (over-provisioned): writes fail or wait for space once the data is full; grow it \
             with `thinpool grow` or turn autoextend on",
            format_size(status.volumes_size_bytes),
            format_size(data_bytes)
        );
    }
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
            thinpool_daemon::space::describe_autoextend(
                status.autoextend.map(|on| on.stored()).as_ref(),
            ),
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
                format_size(status.data_passed_down_bytes)
            ),
        ),
    ]
}

/// The lag of each replicated volume (`thinpool_daemon::replication`): the bytes changed
/// since its last acknowledged replica are a `diff` of the two, asked of the pool or its
/// server (null if that fails: the replica or the volume is gone).
fn replication_lags(dir: &crate::pool_dir::PoolDir) -> anyhow::Result<Vec<replication::Lag>> {
    let state = replication::load(&dir.path)?;
    let now = replication::now_unix_seconds();
    Ok(replication::lags(&state, now, |base, volume| {
        let request = Request::Diff {
            base: base.to_string(),
            target: volume.to_string(),
            list_same: false,
            progress: false,
        };
        match control::perform(dir, &request) {
            Ok(Ok(control::Outcome::Diff(diff))) => Some(
                diff.ranges
                    .iter()
                    .filter(|range| range.kind != "base_only")
                    .map(|range| range.length_bytes)
                    .sum(),
            ),
            _ => None,
        }
    }))
}

/// One `replication:` line per replicated volume.
pub fn render_replication(lags: &[replication::Lag]) -> String {
    lags.iter()
        .map(|lag| {
            let state = match (&lag.last_acked, lag.lag_seconds) {
                (Some(name), Some(seconds)) => format!(
                    "last acknowledged {name}, lag {seconds} s, {} changed since",
                    lag.lag_bytes
                        .map_or_else(|| "unknown".to_string(), format_size)
                ),
                _ => "nothing acknowledged yet".to_string(),
            };
            let pending = lag
                .pending
                .as_ref()
                .map(|name| format!(" ({name} taken, not acknowledged)"))
                .unwrap_or_default();
            format!(
                "{:<19}{} to {}: {state}{pending}\n",
                "replication:", lag.volume, lag.destination
            )
        })
        .collect()
}
