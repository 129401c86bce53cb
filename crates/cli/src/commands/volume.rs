//! `thinpool volume create|snapshot|delete|resize`: manage volumes, on the pool directly or
//! through the control socket of the server holding it (same syntax, same output).

use anyhow::{bail, Context};
use std::process::ExitCode;

use crate::control::{self, Outcome, Request, VolumeRecord};
use crate::pool_dir::{format_size, parse_size, PoolArg};

/// Volume subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Create a thin volume.
    Create {
        /// Volume name (also its NBD export name).
        name: String,
        /// Virtual size (K, M, G, T suffixes).
        #[arg(long = "size", value_name = "SIZE")]
        size: String,
        #[command(flatten)]
        common: Common,
    },
    /// Snapshot a volume.
    Snapshot {
        /// The volume to snapshot.
        origin: String,
        /// The snapshot's name.
        name: String,
        /// Refuse writes to the snapshot.
        #[arg(long = "read-only")]
        read_only: bool,
        #[command(flatten)]
        common: Common,
    },
    /// Delete a volume (refused while a client has it open).
    Delete {
        /// Volume name.
        name: String,
        #[command(flatten)]
        common: Common,
    },
    /// Change a volume's virtual size (shrinking unmaps what lies beyond the new end).
    Resize {
        /// Volume name.
        name: String,
        /// New virtual size (K, M, G, T suffixes).
        #[arg(long = "size", value_name = "SIZE")]
        size: String,
        #[command(flatten)]
        common: Common,
    },
}

/// Arguments every volume subcommand takes.
#[derive(clap::Args, Debug)]
pub struct Common {
    #[command(flatten)]
    pool: PoolArg,
    /// Print the result as JSON.
    #[arg(long = "json")]
    json: bool,
}

/// Run the command.
pub fn run(command: Command) -> anyhow::Result<ExitCode> {
    let (request, common, what) = match command {
        Command::Create { name, size, common } => {
            let size_bytes = parse_size(&size)?;
            let what = format!("cannot create volume {name:?}");
            (Request::CreateVolume { name, size_bytes }, common, what)
        }
        Command::Snapshot {
            origin,
            name,
            read_only,
            common,
        } => {
            let what = format!("cannot snapshot {origin:?} as {name:?}");
            (
                Request::Snapshot {
                    origin,
                    name,
                    read_only,
                },
                common,
                what,
            )
        }
        Command::Delete { name, common } => {
            let what = format!("cannot delete volume {name:?}");
            (Request::DeleteVolume { name }, common, what)
        }
        Command::Resize { name, size, common } => {
            let size_bytes = parse_size(&size)?;
            let what = format!("cannot resize volume {name:?}");
            (Request::ResizeVolume { name, size_bytes }, common, what)
        }
    };
    let dir = common.pool.resolve();
    let outcome = control::ask(&dir, &request).context(what)?;
    match (&request, outcome) {
        (Request::DeleteVolume { name }, Outcome::Done) => {
            if common.json {
                println!("{}", serde_json::json!({ "deleted": name }));
            } else {
                println!("deleted volume {name:?}");
            }
        }
        (_, Outcome::Volume(volume)) => {
            if common.json {
                println!("{}", serde_json::to_string_pretty(&volume)?);
            } else {
                println!("{}", describe(&request, &volume));
            }
        }
        (_, other) => bail!("unexpected answer: {other:?}"),
    }
    Ok(ExitCode::SUCCESS)
}

fn describe(request: &Request, volume: &VolumeRecord) -> String {
    let verb = match request {
        Request::CreateVolume { .. } => "created volume".to_string(),
        Request::Snapshot { origin, .. } => format!("created snapshot of {origin:?}:"),
        _ => "resized volume".to_string(),
    };
    let access = if volume.read_only { ", read-only" } else { "" };
    format!(
        "{verb} {:?} (id {}, {}{access})",
        volume.name,
        volume.id,
        format_size(volume.size_bytes)
    )
}
