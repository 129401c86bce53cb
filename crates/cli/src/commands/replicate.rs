//! `thinpool replicate VOLUME --to DEST [--interval 60s] [--timeout 10m] [--once]
//! [--full]`: continuous replication (docs/replication.md). Each round takes a read-only
//! snapshot of VOLUME (replica `VOLUME.repl-SEQ`), sends the increment from the last
//! replica the destination acknowledged (a full stream the first time, or with `--full`),
//! and keeps the last two replicas on both sides; the state is the source pool directory's
//! `replication.json` (`thinpool_daemon::replication`), which `status` and the metrics
//! read for the lag.
//! One round is `round.rs`; its receiver, watched by the idle `--timeout`, `receiver.rs`.
//!
//! DEST is a pool directory (an existing directory: this binary's `receive` is run on it,
//! which goes through its control socket when it is served), or else a shell command that
//! receives the stream on stdin, such as `ssh backup thinpool receive --pool /srv/copy`.

mod receiver;
mod round;

use anyhow::{bail, Context};
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use crate::pool_dir::{format_size, PoolArg};

/// Arguments.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  thinpool replicate vm0 --to /srv/copy --pool /srv/pool             # every 60 s
  thinpool replicate vm0 --to 'ssh backup thinpool receive --pool /srv/copy' --interval 5m
  thinpool replicate vm0 --to /srv/copy --once                       # one round (cron, timers)
  thinpool replicate vm0 --to /srv/copy --once --full                # start over: a full stream
  thinpool replicate vm0 --to /srv/pool --base vm0.repl-7 --pool /srv/copy   # fail-back
  thinpool status --json --pool /srv/pool | jq '.replication[0].lag_seconds'

Replicas are read-only snapshots named VOLUME.repl-SEQ on both sides. A command DEST runs
under `sh -c` with the replica's name and `--json --prune-replicas` appended (or put where
it says \"$@\"); its last line of output, the received volume as JSON, is the
acknowledgement. A receiver that takes no byte of the stream and prints nothing for
--timeout is killed (a command with its process group: it runs in one of its own, so it
cannot prompt on the terminal; use an ssh key) and the round fails; the next one sends
again from the last acknowledged replica. Fail-over and fail-back: docs/replication.md.")]
pub struct Args {
    /// The volume to replicate.
    volume: String,
    /// Where to: a pool directory, or a command that receives the stream on stdin.
    #[arg(long = "to", value_name = "DEST")]
    to: String,
    /// Time between the starts of two rounds (60s, 5m, 1h).
    #[arg(long = "interval", value_name = "DURATION", default_value = "60s",
          value_parser = humantime::parse_duration)]
    interval: Duration,
    /// Kill the receiver and fail the round after this long without progress: no byte of
    /// the stream taken, no output (an idle timeout, not a total one: 30s, 10m).
    #[arg(long = "timeout", value_name = "DURATION", default_value = "10m",
          value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// One round, then exit (its failure is the exit status).
    #[arg(long = "once")]
    once: bool,
    /// Send a full stream rather than the increment from the last acknowledged replica
    /// (when the destination lost it or diverged, or DEST changed).
    #[arg(long = "full", conflicts_with = "base")]
    full: bool,
    /// Start from this read-only snapshot, which the destination holds too (its content
    /// id): the first increment is from it (fail-back, docs/replication.md).
    #[arg(long = "base", value_name = "SNAPSHOT")]
    base: Option<String>,
    #[command(flatten)]
    pool: PoolArg,
}

/// Where replicas go.
#[derive(Clone, Debug)]
pub enum Destination {
    /// A pool directory (canonical path).
    Pool(PathBuf),
    /// A shell command.
    Command(String),
}

impl Destination {
    /// A pool directory if `text` names an existing directory, else a command (which must
    /// have arguments: a lone word that is no directory is a mistyped path).
    fn parse(text: &str) -> anyhow::Result<Destination> {
        let path = std::path::Path::new(text);
        if path.is_dir() {
            let real = std::fs::canonicalize(path)
                .with_context(|| format!("cannot resolve {}", path.display()))?;
            return Ok(Destination::Pool(real));
        }
        if !text.trim().contains(char::is_whitespace) {
            bail!(
                "--to {text:?} is not a directory; a command receiving the stream has \
                 arguments, e.g. --to 'ssh backup thinpool receive --pool /srv/copy'"
            );
        }
        Ok(Destination::Command(text.to_string()))
    }

    /// Whether the receiver is a shell command (run in a process group of its own, so a
    /// timeout kills what it started too), not this binary.
    fn runs_a_command(&self) -> bool {
        matches!(self, Destination::Command(_))
    }

    /// As the state file records it.
    fn describe(&self) -> String {
        match self {
            Destination::Pool(path) => path.display().to_string(),
            Destination::Command(command) => command.clone(),
        }
    }

    /// The process receiving replica `name`: `receive NAME --json --prune-replicas`.
    fn receiver(&self, name: &str) -> anyhow::Result<Command> {
        let args = [name, "--json", "--prune-replicas"];
        match self {
            Destination::Pool(path) => {
                let binary = std::env::current_exe().context("cannot find this binary")?;
                let mut command = Command::new(binary);
                command.arg("--pool").arg(path).arg("receive").args(args);
                Ok(command)
            }
            Destination::Command(text) => {
                let script = if text.contains("\"$@\"") {
                    text.clone()
                } else {
                    format!("{text} \"$@\"")
                };
                let mut command = Command::new("sh");
                command
                    .arg("-c")
                    .arg(script)
                    .arg("thinpool-replicate")
                    .args(args);
                Ok(command)
            }
        }
    }
}

/// Run the command.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let dir = args.pool.resolve();
    dir.require_pool()?;
    let destination = Destination::parse(&args.to)?;
    if let Destination::Pool(path) = &destination {
        let source = std::fs::canonicalize(&dir.path)
            .with_context(|| format!("cannot resolve {}", dir.path.display()))?;
        if *path == source {
            bail!("--to {}: that is the source pool itself", path.display());
        }
    }
    if args.interval.is_zero() {
        bail!("--interval must be longer than 0 s");
    }
    if args.timeout.is_zero() {
        bail!("--timeout must be longer than 0 s");
    }
    let mut start = match (&args.base, args.full) {
        (Some(base), _) => round::Start::From(base.clone()),
        (None, true) => round::Start::Full,
        (None, false) => round::Start::Acked,
    };
    loop {
        let started = Instant::now();
        match round::run(&dir, &args.volume, &destination, &start, args.timeout) {
            Ok(replica) => {
                println!(
                    "replicated {} as {} to {}: {} stream ({})",
                    args.volume,
                    replica.name,
                    destination.describe(),
                    if replica.incremental {
                        "incremental"
                    } else {
                        "full"
                    },
                    format_size(replica.stream_bytes)
                );
                // --full and --base start over once; the rounds after them go on from
                // the last acknowledged replica.
                start = round::Start::Acked;
            }
            Err(error) if args.once => return Err(error),
            Err(error) => eprintln!(
                "thinpool: replicate {}: {error:#} (next round in {})",
                args.volume,
                humantime::format_duration(args.interval)
            ),
        }
        if args.once {
            return Ok(ExitCode::SUCCESS);
        }
        std::thread::sleep(args.interval.saturating_sub(started.elapsed()));
    }
}
