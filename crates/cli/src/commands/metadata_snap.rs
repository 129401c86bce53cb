//! `thinpool metadata-snap reserve|release`: hold or release dm-thin's metadata snapshot (a
//! frozen copy of the superblock whose trees stay intact while it is held), so that
//! `thin_ls -m`, `thin_delta -m` and `thin_dump -m` read a consistent view of a pool that
//! `thinpool serve` is changing (dm-thin's `reserve_metadata_snap` / `release_metadata_snap`
//! messages). Through the control socket while the pool is served, on the pool directly
//! otherwise; the snapshot stays held across restarts until released. One at a time.

use anyhow::Context;
use std::process::ExitCode;

use crate::control::{self, Request};
use crate::pool_dir::PoolArg;

/// Metadata snapshot subcommands.
#[derive(clap::Subcommand, Debug)]
#[command(after_help = "\
Examples:
  thinpool metadata-snap reserve --pool /srv/pool
  thin_ls -m /srv/pool/metadata
  thinpool metadata-snap release --pool /srv/pool")]
pub enum Command {
    /// Hold a metadata snapshot of the pool as committed now (refused if one is held).
    #[command(after_help = "\
Example (while `thinpool serve` runs):
  thinpool metadata-snap reserve --pool /srv/pool
  thin_ls -m -o DEV,MAPPED_BYTES,EXCLUSIVE_BYTES,SHARED_BYTES /srv/pool/metadata
  thin_delta -m --snap1 0 --snap2 1 /srv/pool/metadata   # ids from `thinpool list --ids`
  thin_dump -m /srv/pool/metadata
  thinpool metadata-snap release --pool /srv/pool")]
    Reserve {
        #[command(flatten)]
        common: Common,
    },
    /// Release the held metadata snapshot (and the metadata only it kept).
    #[command(after_help = "\
Example:
  thinpool metadata-snap release --pool /srv/pool")]
    Release {
        #[command(flatten)]
        common: Common,
    },
}

/// Arguments both subcommands take.
#[derive(clap::Args, Debug)]
pub struct Common {
    #[command(flatten)]
    pool: PoolArg,
    /// Print the pool's status as JSON (docs/json.md): `metadata_snap_block` is the held
    /// snapshot's block, or null.
    #[arg(long = "json")]
    json: bool,
}

/// Run the command.
pub fn run(command: Command) -> anyhow::Result<ExitCode> {
    let (request, common, what) = match command {
        Command::Reserve { common } => (
            Request::ReserveMetadataSnap,
            common,
            "cannot reserve a metadata snapshot",
        ),
        Command::Release { common } => (
            Request::ReleaseMetadataSnap,
            common,
            "cannot release the metadata snapshot",
        ),
    };
    let dir = common.pool.resolve();
    let status = control::ask(&dir, &request).context(what)?.into_status()?;
    if common.json {
        super::json::print(&status)?;
        return Ok(ExitCode::SUCCESS);
    }
    let metadata = dir.path.join(thin_pool::METADATA_FILE);
    match (&request, status.metadata_snap_block) {
        (Request::ReserveMetadataSnap, Some(block)) => println!(
            "reserved metadata snapshot at block {block}: thin_ls -m, thin_delta -m and thin_dump -m read it from {}; release it with `thinpool metadata-snap release`",
            metadata.display()
        ),
        _ => println!("released the metadata snapshot"),
    }
    Ok(ExitCode::SUCCESS)
}
