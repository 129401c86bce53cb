//! `thinpool receive NAME [-i FILE]`: a stream of `thinpool send` (stdin by default) made
//! volume NAME, read-only: a full stream becomes a new volume, an incremental one a
//! snapshot of the volume holding its base's content. Nothing is visible until the whole
//! stream was read and checked; a cut-off, damaged, replayed or wrong-base stream leaves
//! the pool as it was. Through the control socket when the pool is served.

use anyhow::Context;
use std::io::Read;
use std::process::ExitCode;

use super::send::progress_bar;
use crate::control::{self, stream, Outcome, Request, VolumeRecord};
use crate::pool_dir::{format_size, PoolArg, PoolDir};
use thinpool_daemon::replication;

/// Arguments.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  thinpool send vm0-s1 --pool /srv/pool | thinpool receive vm0-s1 --pool /srv/copy
  thinpool send vm0-s2 --base vm0-s1 | ssh backup thinpool receive vm0-s2 --pool /srv/copy
  thinpool receive vm0-s2 -i vm0-s2.stream --pool /srv/copy
  thinpool volume snapshot vm0-s2 vm0 --pool /srv/copy     # a writable volume from it
  thinpool send vm0.repl-8 --base vm0.repl-7 | thinpool receive vm0.repl-8 --prune-replicas --json

It prints `received NAME (SIZE, N blocks mapped), content id UUID`, or with --json the
volume as JSON (`content_id` included): the acknowledgement `thinpool replicate` reads.")]
pub struct Args {
    /// The new volume's name.
    name: String,
    /// Read the stream from FILE instead of stdin.
    #[arg(short = 'i', long = "input", value_name = "FILE")]
    input: Option<std::path::PathBuf>,
    #[command(flatten)]
    pool: PoolArg,
    /// Print the new volume as JSON.
    #[arg(long = "json")]
    json: bool,
    /// NAME is a replica (VOLUME.repl-SEQ, `thinpool replicate`): once it is received,
    /// delete VOLUME's other replicas but the one it was received on (its base).
    #[arg(long = "prune-replicas")]
    prune_replicas: bool,
}

/// Run the command.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let dir = args.pool.resolve();
    let replica_of = match args.prune_replicas {
        true => Some(
            replication::parse_replica(&args.name)
                .with_context(|| {
                    format!(
                        "--prune-replicas: {:?} is not a replica's name (VOLUME{}SEQ)",
                        args.name,
                        replication::REPLICA_MARK
                    )
                })?
                .0,
        ),
        false => None,
    };
    let mut input: Box<dyn Read> = match &args.input {
        Some(path) => Box::new(
            std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?,
        ),
        None => Box::new(std::io::stdin().lock()),
    };
    let bar = progress_bar("received");
    let volume = stream::receive(&dir, &args.name, &mut input, &mut |bytes| {
        if let Some(bar) = &bar {
            bar.set_position(bytes);
        }
    });
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let volume = volume?;
    if args.json {
        println!("{}", serde_json::to_string(&volume)?);
    } else {
        println!(
            "received {} ({}, {} blocks mapped), content id {}",
            volume.name,
            format_size(volume.size_bytes),
            volume.mapped_blocks,
            volume.content_id.as_deref().unwrap_or("none")
        );
    }
    if let Some(replicated) = replica_of {
        prune_replicas(&dir, replicated, &volume);
    }
    Ok(ExitCode::SUCCESS)
}

/// Deletes the replicas of `replicated` but `kept` and its base (its origin: the replica
/// an incremental stream was received on). A replica that cannot be deleted now (open) is
/// left, with a warning; the next receive tries again.
fn prune_replicas(dir: &PoolDir, replicated: &str, kept: &VolumeRecord) {
    let volumes = match control::ask(dir, &Request::List) {
        Ok(Outcome::Volumes(volumes)) => volumes,
        other => {
            eprintln!("thinpool: warning: cannot list the replicas to prune: {other:?}");
            return;
        }
    };
    for volume in volumes {
        let is_replica =
            replication::parse_replica(&volume.name).is_some_and(|(of, _)| of == replicated);
        if !is_replica || volume.name == kept.name || kept.origin.as_ref() == Some(&volume.name) {
            continue;
        }
        let request = Request::DeleteVolume {
            name: volume.name.clone(),
        };
        if let Err(error) = control::ask(dir, &request) {
            eprintln!(
                "thinpool: warning: cannot delete the older replica {}: {error:#}",
                volume.name
            );
        }
    }
}
