//! `thinpool-bench serve`: `thinpool serve` (the daemon library's, every option of it) plus
//! the benchmark-only exports the NBD comparisons (`scripts/bench-*`) need beside the thin
//! volumes, which the production binary does not offer:
//!
//! - `--raw-export NAME=FILE` ([`raw::RawFileExport`]): a plain file served as is, no thin
//!   mapping, the control for what mapping costs through the same front end;
//! - `--null-export NAME=SIZE` ([`null::NullExport`]): zeroes, writes dropped, no I/O at
//!   all, the control for measuring the front end alone (like `nbdkit null`).

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context};
use nbd::Export;
use thinpool_daemon::logging;

pub mod null;
pub mod raw;

/// Arguments: `thinpool serve`'s, and the benchmark exports. (Named apart from the
/// daemon's `Args`, which it flattens: clap names an argument group after its struct.)
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    serve: thinpool_daemon::serve::Args,
    /// Also serve FILE, a plain file with no thin mapping, as export NAME (repeatable).
    #[arg(long = "raw-export", value_name = "NAME=FILE")]
    raw_export: Vec<String>,
    /// Also serve export NAME of SIZE bytes (K, M, G, T) with nothing behind it: READs give
    /// zeroes, WRITEs are accepted and dropped (repeatable). For measuring the NBD front end
    /// without I/O, like `nbdkit null`. Example: `--null-export null=1G`.
    #[arg(long = "null-export", value_name = "NAME=SIZE")]
    null_export: Vec<String>,
}

/// Run the server until SIGINT or SIGTERM, as `thinpool serve` does.
pub fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    if args.serve.read_only && !(args.raw_export.is_empty() && args.null_export.is_empty()) {
        bail!("--read-only serves nothing writable: it cannot be given with --raw-export or --null-export");
    }
    let mut fixed: Vec<Arc<dyn Export>> = Vec::new();
    for spec in &args.raw_export {
        let (name, file) = spec
            .split_once('=')
            .filter(|(name, file)| !name.is_empty() && !file.is_empty())
            .with_context(|| format!("--raw-export {spec:?}: expected NAME=FILE"))?;
        fixed.push(Arc::new(raw::RawFileExport::open(name, Path::new(file))?));
    }
    for spec in &args.null_export {
        fixed.push(Arc::new(null::NullExport::parse(spec)?));
    }
    // The same log as `thinpool serve`'s.
    logging::init(logging::level(args.serve.verbose, args.serve.quiet))?;
    thinpool_daemon::serve::run_with(args.serve, fixed)
}
