//! `thinpool volume ...`: being written.

use std::process::ExitCode;

/// Volume subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Create a volume.
    Create,
}

/// Run the command.
pub fn run(_command: Command) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not implemented yet")
}
