//! `thinpool receive NAME [-i FILE]`: a stream of `thinpool send` (stdin by default) made
//! volume NAME, read-only: a full stream becomes a new volume, an incremental one a
//! snapshot of the volume holding its base's content. Nothing is visible until the whole
//! stream was read and checked; a cut-off, damaged, replayed or wrong-base stream leaves
//! the pool as it was. Through the control socket when the pool is served.

use anyhow::Context;
use std::io::Read;
use std::process::ExitCode;

use super::send::progress_bar;
use crate::control::stream;
use crate::pool_dir::{format_size, PoolArg};

/// Arguments.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  thinpool send vm0-s1 --pool /srv/pool | thinpool receive vm0-s1 --pool /srv/copy
  thinpool send vm0-s2 --base vm0-s1 | ssh backup thinpool receive vm0-s2 --pool /srv/copy
  thinpool receive vm0-s2 -i vm0-s2.stream --pool /srv/copy
  thinpool volume snapshot vm0-s2 vm0 --pool /srv/copy     # a writable volume from it")]
pub struct Args {
    /// The new volume's name.
    name: String,
    /// Read the stream from FILE instead of stdin.
    #[arg(short = 'i', long = "input", value_name = "FILE")]
    input: Option<std::path::PathBuf>,
    #[command(flatten)]
    pool: PoolArg,
    /// Print the new volume as JSON (docs/json.md).
    #[arg(long = "json")]
    json: bool,
}

/// Run the command.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let dir = args.pool.resolve();
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
        super::json::print(&volume)?;
    } else {
        println!(
            "received {} ({}, {} blocks mapped)",
            volume.name,
            format_size(volume.size_bytes),
            volume.mapped_blocks
        );
    }
    Ok(ExitCode::SUCCESS)
}
