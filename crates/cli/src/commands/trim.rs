//! `thinpool trim`: give every free data block back to the host (punch holes in the data
//! file), as `thin_trim` does; through the control socket when the pool is served, so it runs
//! while clients write. Progress (`crate::progress`): data blocks looked at, counted by the
//! pool offline, or by the server in progress lines it sends before its answer when the
//! bar is drawn (`{"op":"trim","progress":true}`, the daemon's `control/progress.rs`).

use anyhow::bail;
use std::process::ExitCode;

use crate::control::{self, Outcome, Request};
use crate::pool_dir::{format_size, PoolArg};
use crate::progress::{Bar, BlockCounts};

/// Arguments.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  thinpool trim --pool /srv/pool            # offline, or through `serve` while it runs
  thinpool trim --pool /srv/pool --json")]
pub struct Args {
    #[command(flatten)]
    pool: PoolArg,
    /// Print the result as JSON (`{"thinpool_json":1,"trimmed_bytes":N}`).
    #[arg(long = "json")]
    json: bool,
}

/// Run the command.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let dir = args.pool.resolve();
    let bar = Bar::spinner("trim", "");
    let request = Request::Trim {
        progress: bar.is_shown(),
    };
    let counts = BlockCounts::new(&bar);
    let answer = counts.follow(|| {
        control::perform_reporting(
            &dir,
            &request,
            &|target| target.trim(counts.offline()),
            &|frame| counts.served(frame),
        )
    });
    bar.finish();
    let bytes = match answer?? {
        Outcome::Trimmed(bytes) => bytes,
        other => bail!("unexpected answer: {other:?}"),
    };
    if args.json {
        super::json::print(&thinpool_daemon::json::TrimRecord {
            trimmed_bytes: bytes,
        })?;
    } else {
        println!(
            "trimmed {} of free data blocks in {}",
            format_size(bytes),
            dir.path.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}
