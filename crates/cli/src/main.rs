//! The `thinpool` binary: argument parsing and one module per subcommand.
//!
//! Offline metadata commands take the same arguments as the thin-provisioning-tools they
//! mirror (`thin_check`, `thin_dump`, `thin_restore`, `thin_metadata_size`), so scripts can
//! switch between them.
#![forbid(unsafe_code)]

mod commands;
mod control;
mod export;
mod metrics;
mod pool_dir;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// thinpool: dm-thin compatible thin provisioning in userspace, served over NBD.
#[derive(Parser, Debug)]
#[command(name = "thinpool", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Validate pool metadata (like thin_check).
    Check(commands::check::Args),
    /// Dump pool metadata as XML or human-readable text (like thin_dump).
    Dump(commands::dump::Args),
    /// Build pool metadata from an XML dump (like thin_restore).
    Restore(commands::restore::Args),
    /// Estimate the metadata size a pool needs (like thin_metadata_size).
    MetadataSize(commands::metadata_size::Args),
    /// Create a pool in a directory.
    Create(commands::create::Args),
    /// Manage volumes: create, snapshot, delete, resize.
    #[command(subcommand)]
    Volume(commands::volume::Command),
    /// List volumes.
    List(commands::list::Args),
    /// Show the pool's status.
    Status(commands::status::Args),
    /// Serve the pool's volumes over NBD.
    Serve(commands::serve::Args),
    /// Measure the engine against the raw data device, side by side.
    Bench(commands::bench::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check(args) => commands::check::run(args),
        Command::Dump(args) => commands::dump::run(args),
        Command::Restore(args) => commands::restore::run(args),
        Command::MetadataSize(args) => commands::metadata_size::run(args),
        Command::Create(args) => commands::create::run(args),
        Command::Volume(command) => commands::volume::run(command),
        Command::List(args) => commands::list::run(args),
        Command::Status(args) => commands::status::run(args),
        Command::Serve(args) => commands::serve::run(args),
        Command::Bench(args) => commands::bench::run(args),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("thinpool: {error:#}");
            ExitCode::FAILURE
        }
    }
}
