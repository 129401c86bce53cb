//! The `thinpool` binary: argument parsing and one module per subcommand.
//!
//! Offline metadata commands take the same arguments as the thin-provisioning-tools they
//! mirror (`thin_check`, `thin_dump`, `thin_restore`, `thin_repair`, `thin_metadata_size`),
//! so scripts can switch between them; `-V` on them prints the tools' version they follow.
#![forbid(unsafe_code)]

mod commands;

use thinpool_daemon::{control, logging, pool_dir};

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
    /// Rebuild damaged pool metadata from what can be read (like thin_repair).
    Repair(commands::repair::Args),
    /// Estimate the metadata size a pool needs (like thin_metadata_size).
    MetadataSize(commands::metadata_size::Args),
    /// Create a pool in a directory.
    Create(commands::create::Args),
    /// Take over a pool the kernel (dm-thin, LVM) made, on its two block devices.
    Import(commands::import::Args),
    /// Manage volumes: create, snapshot, delete, resize, revert, rename, adopt, forget.
    #[command(subcommand)]
    Volume(commands::volume::Command),
    /// List volumes.
    List(commands::list::Args),
    /// Show the pool's status.
    Status(commands::status::Args),
    /// Hold or release a metadata snapshot, so thin_ls/thin_delta/thin_dump -m read a live pool.
    #[command(subcommand)]
    MetadataSnap(commands::metadata_snap::Command),
    /// Serve the pool's volumes over NBD.
    Serve(thinpool_daemon::serve::Args),
    /// Give every free data block back to the host (like thin_trim; also while serving).
    Trim(commands::trim::Args),
    /// List the blocks in which two volumes differ (like thin_delta).
    Diff(commands::diff::Args),
    /// Grow the pool's data or metadata (online while served; `create --grow` for data).
    Grow(commands::grow::Args),
}

/// `thinpool serve`: the daemon (`thinpool_daemon::serve`), with the binary's log installed.
fn serve(args: thinpool_daemon::serve::Args) -> anyhow::Result<ExitCode> {
    logging::init(logging::level(args.verbose, args.quiet))?;
    thinpool_daemon::serve::run(args)
}

fn main() -> ExitCode {
    if commands::asks_tools_version(std::env::args_os()) {
        println!("{}", commands::TOOLS_VERSION);
        return ExitCode::SUCCESS;
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check(args) => commands::check::run(args),
        Command::Dump(args) => commands::dump::run(args),
        Command::Restore(args) => commands::restore::run(args),
        Command::Repair(args) => commands::repair::run(args),
        Command::MetadataSize(args) => commands::metadata_size::run(args),
        Command::Create(args) => commands::create::run(args),
        Command::Import(args) => commands::import::run(args),
        Command::Volume(command) => commands::volume::run(command),
        Command::List(args) => commands::list::run(args),
        Command::Status(args) => commands::status::run(args),
        Command::MetadataSnap(command) => commands::metadata_snap::run(command),
        Command::Serve(args) => serve(args),
        Command::Trim(args) => commands::trim::run(args),
        Command::Diff(args) => commands::diff::run(args),
        Command::Grow(args) => commands::grow::run(args),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("thinpool: {error:#}");
            ExitCode::FAILURE
        }
    }
}
