//! `thinpool receive NAME [-i FILE]`: a stream of `thinpool send` (stdin by default) made
//! volume NAME, read-only: a full stream becomes a new volume, an incremental one a
//! snapshot of the volume holding its base's content. Nothing is visible until the whole
//! stream was read and checked; a cut-off, damaged, replayed or wrong-base stream leaves
//! the pool as it was. With `--resumable` what was verified is kept (a partial receive,
//! no volume) and its resume token printed; `--list-partial` and `--abort` list and drop
//! partial receives. Through the control socket when the pool is served.

use anyhow::Context;
use std::io::Read;
use std::process::ExitCode;

use crate::control::stream::{self, PartialRecord};
use crate::control::{self, ask, Outcome, Request, VolumeRecord};
use crate::pool_dir::{format_size, PoolArg, PoolDir};
use crate::progress::{Bar, Unit};
use thin_pool::stream::ReceiveOptions;
use thinpool_daemon::json::PartialReceivesRecord;
use thinpool_daemon::replication;

/// Arguments.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  thinpool send vm0-s1 --pool /srv/pool | thinpool receive vm0-s1 --pool /srv/copy
  thinpool send vm0-s2 --base vm0-s1 | ssh backup thinpool receive vm0-s2 --pool /srv/copy
  thinpool receive vm0-s2 -i vm0-s2.stream --pool /srv/copy
  thinpool volume snapshot vm0-s2 vm0 --pool /srv/copy     # a writable volume from it
  thinpool send vm0-s1 | thinpool receive vm0-s1 --resumable   # cut off: prints a token
  thinpool receive --list-partial                           # partial receives, their tokens
  thinpool send vm0-s1 --resume TOKEN | thinpool receive vm0-s1 --resumable
  thinpool receive --abort vm0-s1                           # drop it, free its blocks
  thinpool send vm0.repl-8 --base vm0.repl-7 | thinpool receive vm0.repl-8 --prune-replicas --json

It prints `received NAME (SIZE, N blocks mapped), content id UUID`, or with --json the
volume as JSON (`content_id` included): the acknowledgement `thinpool replicate` reads.
`--list-partial --json` and `--abort NAME --json` print `{\"partial_receives\": [...]}`.")]
pub struct Args {
    /// The new volume's name.
    #[arg(required_unless_present = "list_partial")]
    name: Option<String>,
    /// Read the stream from FILE instead of stdin.
    #[arg(short = 'i', long = "input", value_name = "FILE")]
    input: Option<std::path::PathBuf>,
    /// Keep what was received and verified if the stream breaks (as `zfs receive -s`): a
    /// partial receive, no volume, that `send --resume TOKEN` completes.
    #[arg(short = 's', long = "resumable")]
    resumable: bool,
    /// With --resumable: keep what was verified after every SIZE of data (and when the
    /// stream breaks); a kill loses at most this much.
    #[arg(long = "checkpoint", value_name = "SIZE", default_value = "256M",
          requires = "resumable", value_parser = parse_size)]
    checkpoint: u64,
    /// List the partial receives kept, with their resume tokens.
    #[arg(long = "list-partial", conflicts_with_all = ["name", "abort", "resumable", "input"])]
    list_partial: bool,
    /// Drop the partial receive NAME: the blocks it holds are freed.
    #[arg(long = "abort", conflicts_with_all = ["resumable", "input"])]
    abort: bool,
    #[command(flatten)]
    pool: PoolArg,
    /// Print the new volume as JSON (docs/json.md); with --list-partial the partial
    /// receives, with --abort the one dropped (`{"partial_receives":[...]}`).
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
    if args.list_partial {
        return list_partial(&dir, args.json);
    }
    let name = args.name.expect("clap requires NAME");
    let replica_of = match args.prune_replicas {
        true => Some(
            replication::parse_replica(&name)
                .with_context(|| {
                    format!(
                        "--prune-replicas: {name:?} is not a replica's name (VOLUME{}SEQ)",
                        replication::REPLICA_MARK
                    )
                })?
                .0,
        ),
        false => None,
    };
    if args.abort {
        return abort(&dir, &name, args.json);
    }
    let (input, total): (Box<dyn Read>, _) = match &args.input {
        Some(path) => {
            let file = std::fs::File::open(path)
                .with_context(|| format!("cannot open {}", path.display()))?;
            let bytes = file.metadata().ok().map(|m| m.len());
            (Box::new(file), bytes)
        }
        None => {
            stream::widen_pipe(std::io::stdin());
            (Box::new(std::io::stdin().lock()), None)
        }
    };
    // The stream's bytes as read (out of the file's), whether the pool or its server
    // takes them.
    let bar = Bar::counting("receive", Unit::Bytes, total);
    let mut input = bar.wrap_read(input);
    let options = args.resumable.then_some(ReceiveOptions {
        checkpoint_bytes: args.checkpoint.max(1),
    });
    let volume = stream::receive_resumable(&dir, &name, options.as_ref(), &mut input, &mut |_| {});
    bar.finish();
    let volume = volume?;
    if args.json {
        super::json::print(&volume)?;
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

fn parse_size(text: &str) -> Result<u64, String> {
    thinpool_daemon::text::parse_size_nonzero(text).map_err(|e| e.to_string())
}

/// The partial receives `request` answers with (the list, or the one dropped).
fn partial_receives(dir: &PoolDir, request: &Request) -> anyhow::Result<Vec<PartialRecord>> {
    match ask(dir, request)? {
        Outcome::Partial(partial) => Ok(partial),
        other => anyhow::bail!("unexpected answer: {other:?}"),
    }
}

/// `--abort NAME`: drops the partial receive; with `--json` prints it as it was.
fn abort(dir: &PoolDir, name: &str, json: bool) -> anyhow::Result<ExitCode> {
    let request = Request::AbortReceive {
        name: name.to_string(),
    };
    let dropped = partial_receives(dir, &request)?;
    if json {
        super::json::print(&PartialReceivesRecord {
            partial_receives: dropped,
        })?;
    } else {
        println!("dropped the partial receive {name}");
    }
    Ok(ExitCode::SUCCESS)
}

fn list_partial(dir: &PoolDir, json: bool) -> anyhow::Result<ExitCode> {
    let partial = partial_receives(dir, &Request::PartialReceives)?;
    if json {
        super::json::print(&PartialReceivesRecord {
            partial_receives: partial,
        })?;
        return Ok(ExitCode::SUCCESS);
    }
    if partial.is_empty() {
        println!("no partial receives");
    }
    for p in &partial {
        println!(
            "{}: {} of {} received, {} blocks held, resume token {}",
            p.name,
            format_size(p.received_bytes),
            format_size(p.size_bytes),
            p.held_blocks,
            p.token
        );
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
