//! `thinpool-bench vhost-raw-serve`: the raw export over vhost-user-blk. The data file itself
//! (a [`FileTarget`]: no thin mapping) served by the same vhost-user-blk front end
//! ([`VhostBlkServer`], the same queue threads, the same poll setting) as `thinpool serve
//! --vhost-user-blk` serves a thin volume, in a process of its own so that its CPU time is
//! measured apart: `thin ÷ raw` over vhost-user-blk is then what thin mapping costs, as the
//! NBD comparisons measure it with `thinpool-bench serve --raw-export`.
//!
//! Prints `thinpool-bench: ready` once the socket accepts, serves until SIGINT or SIGTERM,
//! then removes the socket.

use anyhow::Context;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use thinpool_frontend::FileTarget;
use thinpool_vhost::{ServerOptions, VhostBlkServer};

/// Arguments of `thinpool-bench vhost-raw-serve`.
#[derive(clap::Args, Debug)]
pub struct RawServeArgs {
    /// The file to serve (read-write).
    #[arg(long, value_name = "FILE")]
    file: PathBuf,
    /// The vhost-user-blk socket to create.
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// Queues offered (1 to 64).
    #[arg(long, default_value_t = 1)]
    queues: u16,
    /// The device's name (GET_ID).
    #[arg(long, default_value = "raw")]
    name: String,
}

/// Serves until a signal.
pub fn run(args: RawServeArgs) -> anyhow::Result<ExitCode> {
    let mut signals = Signals::new([SIGINT, SIGTERM]).context("signal handlers")?;
    let target = FileTarget::open(&args.name, &args.file, false)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("opening {}", args.file.display()))?;
    let options = ServerOptions::from_env(args.queues)?;
    let server = VhostBlkServer::start_with(Arc::new(target), &args.socket, options)
        .with_context(|| format!("listening on {}", args.socket.display()))?;
    println!("thinpool-bench: ready");
    let _ = signals.forever().next();
    server.stop();
    Ok(ExitCode::SUCCESS)
}
