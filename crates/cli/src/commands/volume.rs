//! `thinpool volume create|snapshot|delete|resize|revert|rename|adopt|forget`: manage
//! volumes, on the pool directly or through the control socket of the server holding it
//! (same syntax, same output). `volume list` is `thinpool list` under the name LVM users
//! look for.

use anyhow::{bail, Context};
use std::process::ExitCode;

use crate::control::{self, Outcome, Request, VolumeRecord};
use crate::pool_dir::{format_size, parse_size_nonzero, PoolArg};
use thinpool_daemon::json::ForgottenRecord;

/// Volume subcommands.
#[derive(clap::Subcommand, Debug)]
#[command(after_help = "\
Examples:
  thinpool volume create vm0 --size 20G --pool /srv/pool
  thinpool volume snapshot vm0 vm0-snap --read-only
  thinpool volume list                    # the same as `thinpool list`
  thinpool volume resize vm0 --size 40G
  thinpool volume delete vm0-snap")]
pub enum Command {
    /// Create a thin volume.
    #[command(after_help = "\
Examples:
  thinpool volume create vm0 --size 20G --pool /srv/pool
  thinpool volume create scratch --size 1T --json   # thin: takes space as it is written")]
    Create {
        /// Volume name (also its NBD export name).
        name: String,
        /// Virtual size (K, M, G, T suffixes).
        #[arg(long = "size", value_name = "SIZE", allow_hyphen_values = true)]
        size: String,
        #[command(flatten)]
        common: Common,
    },
    /// Snapshot a volume.
    #[command(after_help = "\
Examples (a mounted file system: freeze it around the snapshot):
  fsfreeze -f /mnt/vm0 && thinpool volume snapshot vm0 vm0-snap --read-only; fsfreeze -u /mnt/vm0
  thinpool volume snapshot vm0 vm0-clone   # a writable clone")]
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
    #[command(after_help = "\
Example:
  thinpool volume delete vm0-snap --pool /srv/pool")]
    Delete {
        /// Volume name.
        name: String,
        #[command(flatten)]
        common: Common,
    },
    /// Change a volume's virtual size.
    ///
    /// Growing is allowed while clients use the volume; a VM attached through `serve
    /// --vhost-user-blk` is told and sees the new size at once. Shrinking is refused while a
    /// client has it open, and refused if it would unmap mapped data beyond the new end (the
    /// refusal says how much) unless --force is given; a shrink past unmapped space only
    /// needs no --force.
    #[command(after_help = "\
Examples:
  thinpool volume resize vm0 --size 40G            # grow, also while clients use it
  thinpool volume resize vm0 --size 10G --force    # shrink, dropping data beyond 10G")]
    Resize {
        /// Volume name.
        name: String,
        /// New virtual size (K, M, G, T suffixes).
        #[arg(long = "size", value_name = "SIZE", allow_hyphen_values = true)]
        size: String,
        /// Let a shrink unmap (drop) the mapped data beyond the new end.
        #[arg(long = "force")]
        force: bool,
        #[command(flatten)]
        common: Common,
    },
    /// Give a volume the content and size of a snapshot (like `lvconvert --merge`).
    ///
    /// VOLUME keeps its name (its NBD export name), its thin id, its read-only flag and its
    /// own origin; SNAPSHOT stays, unless --delete-snapshot deletes it in the same
    /// transaction. Refused while a client has VOLUME open (or SNAPSHOT, with
    /// --delete-snapshot). A crash leaves the volume either as it was or reverted.
    #[command(after_help = "\
Example:
  thinpool volume snapshot vm0 vm0-before-upgrade --read-only
  ...                                   # the upgrade goes wrong; stop the VM
  thinpool volume revert vm0 vm0-before-upgrade
  thinpool volume revert vm0 vm0-before-upgrade --delete-snapshot   # and drop the snapshot")]
    Revert {
        /// The volume to revert.
        volume: String,
        /// The volume whose content it takes (usually a snapshot of VOLUME).
        snapshot: String,
        /// Delete SNAPSHOT in the same operation.
        #[arg(long = "delete-snapshot")]
        delete_snapshot: bool,
        #[command(flatten)]
        common: Common,
    },
    /// Rename a volume (its NBD export name changes with it).
    ///
    /// Content, thin id and ancestry stay: its snapshots show the new name as their origin.
    /// Refused while a client has the volume open, or if NEW is taken.
    #[command(after_help = "\
Example:
  thinpool volume rename vm0 vm0-old
  thinpool volume rename vm0-next vm0")]
    Rename {
        /// The volume's name.
        old: String,
        /// Its new name.
        new: String,
        #[command(flatten)]
        common: Common,
    },
    /// Name a thin id the metadata holds and the catalog does not know (an "unadopted"
    /// thin id, e.g. made by the kernel's `create_snap`): it is served from then on.
    ///
    /// Nothing is guessed: dm-thin keeps no name or size. SIZE must cover the highest block
    /// the thin id maps; --origin records ORIGIN as the volume it was snapshotted from.
    /// `thinpool list` and `status` show the unadopted thin ids.
    #[command(after_help = "\
Example:
  thinpool list                                    # unadopted thin ids: 5 (4.00 MiB mapped)
  thinpool volume adopt 5 vm0-kernel-snap --size 10G --origin vm0")]
    Adopt {
        /// The thin id (dm-thin's device id).
        id: u32,
        /// The name to give it (also its NBD export name).
        name: String,
        /// Its virtual size (K, M, G, T suffixes).
        #[arg(long = "size", value_name = "SIZE", allow_hyphen_values = true)]
        size: String,
        /// The served volume it is a snapshot of.
        #[arg(long = "origin", value_name = "NAME")]
        origin: Option<String>,
        #[command(flatten)]
        common: Common,
    },
    /// Drop a catalog entry whose thin id is not in the metadata (an "orphaned" volume,
    /// e.g. deleted by the kernel): the catalog entry only.
    ///
    /// Refused for a volume whose thin id exists (that is `volume delete`).
    #[command(after_help = "\
Example:
  thinpool list                          # orphaned: vm0-old (thin id 7 is gone)
  thinpool volume forget vm0-old")]
    Forget {
        /// Volume name.
        name: String,
        #[command(flatten)]
        common: Common,
    },
    /// List volumes (the same as `thinpool list`).
    List(super::list::Args),
}

/// Arguments every volume subcommand takes.
#[derive(clap::Args, Debug)]
pub struct Common {
    #[command(flatten)]
    pool: PoolArg,
    /// Print the result as JSON (docs/json.md: the volume; `forget`: the entry dropped).
    #[arg(long = "json")]
    json: bool,
}

/// Run the command.
pub fn run(command: Command) -> anyhow::Result<ExitCode> {
    let command = match command {
        Command::List(args) => return super::list::run(args),
        command => command,
    };
    let (request, common, what) = request(command)?;
    let dir = common.pool.resolve();
    let outcome = control::ask(&dir, &request).context(what)?;
    match (&request, outcome) {
        (Request::ForgetVolume { name }, Outcome::Forgotten(forgotten)) => {
            if common.json {
                super::json::print(&ForgottenRecord { forgotten })?;
            } else {
                println!("forgot volume {name:?} (catalog entry only)");
            }
        }
        (Request::DeleteVolume { name }, Outcome::Volume(volume)) => {
            if common.json {
                super::json::print(&volume)?;
            } else {
                println!("deleted volume {name:?}");
            }
        }
        (_, Outcome::Volume(volume)) => {
            if common.json {
                super::json::print(&volume)?;
            } else {
                println!("{}", describe(&request, &volume));
            }
            if matches!(
                request,
                Request::CreateVolume { .. } | Request::ResizeVolume { .. }
            ) {
                // A warning, not a refusal: thin provisioning allows it (as LVM does).
                if let Ok(status) =
                    control::ask(&dir, &Request::Status).and_then(Outcome::into_status)
                {
                    super::status::warn_if_overprovisioned(&status);
                }
            }
        }
        (_, other) => bail!("unexpected answer: {other:?}"),
    }
    Ok(ExitCode::SUCCESS)
}

/// The control request a command makes, its common arguments, and what a failure says.
fn request(command: Command) -> anyhow::Result<(Request, Common, String)> {
    Ok(match command {
        Command::Create { name, size, common } => {
            let size_bytes = parse_size_nonzero(&size).context("--size")?;
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
        Command::Resize {
            name,
            size,
            force,
            common,
        } => resize_request(name, &size, force, common)?,
        Command::Revert {
            volume,
            snapshot,
            delete_snapshot,
            common,
        } => {
            let what = format!("cannot revert volume {volume:?} to {snapshot:?}");
            (
                Request::RevertVolume {
                    name: volume,
                    snapshot,
                    delete_snapshot,
                },
                common,
                what,
            )
        }
        Command::Rename { old, new, common } => {
            let what = format!("cannot rename volume {old:?} to {new:?}");
            (
                Request::RenameVolume {
                    name: old,
                    new_name: new,
                },
                common,
                what,
            )
        }
        command @ (Command::Adopt { .. } | Command::Forget { .. }) => catalog_request(command)?,
        Command::List(_) => unreachable!("`volume list` makes no request of its own"),
    })
}

/// The requests of `adopt` and `forget` (thin ids the catalog and the metadata disagree on).
fn catalog_request(command: Command) -> anyhow::Result<(Request, Common, String)> {
    Ok(match command {
        Command::Adopt {
            id,
            name,
            size,
            origin,
            common,
        } => {
            let size_bytes = parse_size_nonzero(&size).context("--size")?;
            let what = format!("cannot adopt thin id {id} as {name:?}");
            let request = Request::AdoptVolume {
                id,
                name,
                size_bytes,
                origin,
            };
            (request, common, what)
        }
        Command::Forget { name, common } => {
            let what = format!("cannot forget volume {name:?}");
            (Request::ForgetVolume { name }, common, what)
        }
        _ => unreachable!("only adopt and forget are catalog requests"),
    })
}

/// [`request`] for `resize`.
fn resize_request(
    name: String,
    size: &str,
    force: bool,
    common: Common,
) -> anyhow::Result<(Request, Common, String)> {
    let size_bytes = parse_size_nonzero(size).context("--size")?;
    let what = format!("cannot resize volume {name:?}");
    let request = Request::ResizeVolume {
        name,
        size_bytes,
        force,
    };
    Ok((request, common, what))
}

fn describe(request: &Request, volume: &VolumeRecord) -> String {
    let access = if volume.read_only { ", read-only" } else { "" };
    let what = format!(
        "{:?} (id {}, {}{access})",
        volume.name,
        volume.id,
        format_size(volume.size_bytes)
    );
    match request {
        Request::CreateVolume { .. } => format!("created volume {what}"),
        Request::Snapshot { origin, .. } => format!("created snapshot of {origin:?}: {what}"),
        Request::RevertVolume {
            snapshot,
            delete_snapshot,
            ..
        } => {
            let deleted = if *delete_snapshot {
                format!("; deleted {snapshot:?}")
            } else {
                String::new()
            };
            format!("reverted volume {what} to the content of {snapshot:?}{deleted}")
        }
        Request::RenameVolume { name, .. } => format!("renamed volume {name:?} to {what}"),
        Request::AdoptVolume { id, origin, .. } => match origin {
            Some(origin) => format!("adopted thin id {id} as {what}, a snapshot of {origin:?}"),
            None => format!("adopted thin id {id} as {what}"),
        },
        _ => match volume.unmapped_bytes {
            Some(bytes) if bytes > 0 => format!(
                "resized volume {what}; unmapped {} of mapped data",
                format_size(bytes)
            ),
            _ => format!("resized volume {what}"),
        },
    }
}
