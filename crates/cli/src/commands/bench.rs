//! `thinpool bench`: being written.

use std::process::ExitCode;

/// Arguments.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run the command.
pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not implemented yet")
}
