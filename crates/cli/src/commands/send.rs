//! `thinpool send SNAPSHOT [--base BASE] [-o FILE]`: a read-only snapshot as a stream
//! (`thin_pool::stream`, docs/send-stream.md) on stdout or a file: every mapped extent, or
//! with `--base` only what changed since BASE (the diff walk, whose cost follows the
//! change). Through the control socket when the pool is served: the snapshot's committed
//! data is read while clients keep writing its origin. Progress on stderr (`crate::progress`).

use anyhow::{bail, Context};
use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use crate::control::stream;
use crate::pool_dir::PoolArg;
use crate::progress::{Bar, Unit};

/// Arguments.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  thinpool volume snapshot vm0 vm0-s1 --read-only --pool /srv/pool
  thinpool send vm0-s1 --pool /srv/pool | ssh backup thinpool receive vm0-s1 --pool /srv/copy
  ... vm0 is written ...
  thinpool volume snapshot vm0 vm0-s2 --read-only --pool /srv/pool
  thinpool send vm0-s2 --base vm0-s1 --pool /srv/pool | ssh backup thinpool receive vm0-s2 --pool /srv/copy
  thinpool send vm0-s2 --base vm0-s1 -o vm0-s2.stream   # to a file
  thinpool send vm0-s1 --resume 1-5c0d...-full-67108864-1a2b3c4d | thinpool receive vm0-s1 --resumable
                                 # the rest of an interrupted `receive --resumable`

Only read-only snapshots are sent: the stream names its base by the base's content id,
which a snapshot gets when it is first sent or received.")]
pub struct Args {
    /// The read-only snapshot to send.
    snapshot: String,
    /// Send only what changed since this read-only snapshot (which the receiver holds).
    #[arg(long = "base", value_name = "BASE")]
    base: Option<String>,
    /// Send only what an interrupted `receive --resumable` did not keep: TOKEN is what it
    /// printed (or `receive --list-partial` shows).
    #[arg(long = "resume", value_name = "TOKEN")]
    resume: Option<String>,
    /// Write the stream to FILE instead of stdout.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    output: Option<std::path::PathBuf>,
    #[command(flatten)]
    pool: PoolArg,
}

/// Run the command.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let dir = args.pool.resolve();
    let mut out: Box<dyn Write> = match &args.output {
        Some(path) => Box::new(
            std::fs::File::create(path)
                .with_context(|| format!("cannot create {}", path.display()))?,
        ),
        None if std::io::stdout().is_terminal() => {
            bail!("the stream is binary: redirect stdout, pipe it to `thinpool receive`, or use -o FILE")
        }
        None => {
            stream::widen_pipe(std::io::stdout());
            Box::new(std::io::stdout().lock())
        }
    };
    let bar = Bar::counting("send", Unit::Bytes, None);
    let bytes = stream::send_resumed(
        &dir,
        &args.snapshot,
        args.base.as_deref(),
        args.resume.as_deref(),
        &mut out,
        &mut |bytes| bar.set_position(bytes),
    )?;
    out.flush().context("writing the stream")?;
    if bar.is_shown() {
        bar.finish();
        eprintln!("sent {} ({bytes} bytes of stream)", args.snapshot);
    }
    Ok(ExitCode::SUCCESS)
}
