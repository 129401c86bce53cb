//! The `thinpool` binary: argument parsing and one module per subcommand.
//!
//! Offline metadata commands take the same arguments as the thin-provisioning-tools they
//! mirror (`thin_check`, `thin_dump`, `thin_restore`, `thin_repair`, `thin_metadata_size`),
//! so scripts can switch between them; `-V` on them prints the tools' version they follow.
//!
//! `--pool DIR` is a global option: accepted before the subcommand as after it, and refused
//! (by [`cli_command`]) by the commands that take no pool directory. Man pages ([`man`]) and
//! shell completions (`thinpool completions SHELL`) are generated from this definition.
#![forbid(unsafe_code)]

mod commands;
mod man;
mod progress;

use thinpool_daemon::{control, logging, pool_dir};

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

/// What the top-level `--help` ends with.
const AFTER_HELP: &str = "\
Environment:
  THINPOOL_POOL   the pool directory when --pool is not given (else ./thinpool-pool)
  RUST_LOG        the log filter of `serve` (over -v and -q)

Examples:
  thinpool create --pool /srv/pool --data-size 100G
  export THINPOOL_POOL=/srv/pool
  thinpool volume create vm0 --size 20G
  thinpool serve &                      # NBD on /srv/pool/nbd.sock
  nbdinfo 'nbd+unix:///vm0?socket=/srv/pool/nbd.sock'
  thinpool --pool /srv/pool list        # --pool before or after the subcommand
  thinpool completions bash > /etc/bash_completion.d/thinpool
  thinpool help serve                   # or `man thinpool-serve`";

/// thinpool: dm-thin compatible thin provisioning in userspace, served over NBD.
#[derive(Parser, Debug)]
#[command(name = "thinpool", version, about, after_help = AFTER_HELP)]
struct Cli {
    /// Pool directory, for the commands that work on one; given before the subcommand or
    /// after it [default: $THINPOOL_POOL, else ./thinpool-pool].
    #[arg(long = "pool", value_name = "DIR", global = true)]
    pool: Option<PathBuf>,
    /// Progress of long operations on stderr: auto (when stderr is a terminal), always or
    /// never; `--progress` alone is always. Never on stdout.
    #[arg(
        long = "progress",
        value_name = "WHEN",
        global = true,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "always",
        default_value = "auto"
    )]
    progress: progress::When,
    /// Draw no progress (`--progress=never`).
    #[arg(long = "no-progress", global = true, conflicts_with = "progress")]
    no_progress: bool,
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
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions(commands::completions::Args),
    /// Write the man pages (thinpool.1, thinpool-serve.1, ...) to a directory.
    ManPages(man::Args),
    /// Write a read-only snapshot (or what changed since a base) as a stream.
    Send(commands::send::Args),
    /// Make a stream of `send` a volume of this pool.
    Receive(commands::receive::Args),
    /// Replicate a volume continuously: a snapshot each interval, its increment sent on.
    Replicate(commands::replicate::Args),
    /// Grow the pool's data or metadata (online while served; `create --grow` for data).
    Grow(commands::grow::Args),
}

/// The command line's definition: [`Cli`]'s, with a hidden `--pool` that refuses any value
/// on each command that takes no pool directory (else the global `--pool` would be listed,
/// and accepted, there too).
pub fn cli_command() -> clap::Command {
    refuse_pool_where_unused(Cli::command())
}

/// The definition the shell completions are generated from: [`Cli`]'s with `--pool` on the
/// top level and on each command that has its own, not propagated (clap_complete's bash
/// script would offer the hidden refusals of [`cli_command`], and a propagated `--pool` on
/// the commands without a pool directory).
pub fn completion_command() -> clap::Command {
    Cli::command().mut_arg("pool", |arg| arg.global(false))
}

/// [`cli_command`] for `command`'s subcommands, before clap propagates the global `--pool`.
fn refuse_pool_where_unused(command: clap::Command) -> clap::Command {
    let names: Vec<String> = command
        .get_subcommands()
        .map(|sub| sub.get_name().to_owned())
        .collect();
    names.iter().fold(command, |command, name| {
        command.mut_subcommand(name, |sub| {
            if sub.has_subcommands() {
                refuse_pool_where_unused(sub)
            } else if sub.get_arguments().any(|arg| arg.get_id() == "pool") {
                sub
            } else {
                sub.arg(pool_refusal())
            }
        })
    })
}

/// The hidden `--pool` of a command without a pool directory.
fn pool_refusal() -> clap::Arg {
    clap::Arg::new("pool")
        .long("pool")
        .value_name("DIR")
        .hide(true)
        .value_parser(|_: &str| -> Result<PathBuf, String> {
            Err("this command takes no pool directory (it works on the files it is given)".into())
        })
}

/// Parses the command line; exits as clap does on a usage error, which includes `--pool`
/// given before the name of a command that takes no pool directory (with `--json`, the
/// error is also printed as JSON on stdout). Returns whether the command asked for JSON.
fn parse() -> (Cli, bool) {
    let mut command = cli_command();
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let matches = command
        .try_get_matches_from_mut(&args)
        .unwrap_or_else(|error| usage_exit(error, commands::json::asked_raw(&args)));
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|error| error.exit());
    let json = commands::json::asked(&matches);
    if cli.pool.is_some() {
        let (leaf, path) = chosen_subcommand(&command, &matches);
        let refuses = leaf
            .get_arguments()
            .any(|arg| arg.get_id() == "pool" && arg.is_hide_set());
        if refuses {
            let message = format!("`thinpool {path}` takes no pool directory: drop --pool");
            let error = command.error(clap::error::ErrorKind::ArgumentConflict, message);
            usage_exit(error, json);
        }
    }
    (cli, json)
}

/// Exits as clap does for `error`; a usage error under `--json` is also printed as the JSON
/// contract's error object on stdout (help and version requests are not errors).
fn usage_exit(error: clap::Error, json: bool) -> ! {
    if json && error.use_stderr() {
        let message = error.to_string().trim().to_string();
        commands::json::print_error_record(thinpool_daemon::json::ErrorRecord::usage(message));
    }
    error.exit()
}

/// The innermost subcommand the command line chose, and its path (`volume create`).
fn chosen_subcommand<'a>(
    command: &'a clap::Command,
    matches: &clap::ArgMatches,
) -> (&'a clap::Command, String) {
    let (mut command, mut matches) = (command, matches);
    let mut path = Vec::new();
    while let Some((name, sub_matches)) = matches.subcommand() {
        let Some(sub) = command.find_subcommand(name) else {
            break;
        };
        path.push(name);
        (command, matches) = (sub, sub_matches);
    }
    (command, path.join(" "))
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
    let (cli, json) = parse();
    progress::init(if cli.no_progress {
        progress::When::Never
    } else {
        cli.progress
    });
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
        Command::Completions(args) => commands::completions::run(args),
        Command::ManPages(args) => man::run(args),
        Command::Send(args) => commands::send::run(args),
        Command::Receive(args) => commands::receive::run(args),
        Command::Replicate(args) => commands::replicate::run(args),
        Command::Grow(args) => commands::grow::run(args),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            if json {
                commands::json::print_error(&error);
            }
            eprintln!("thinpool: {error:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every visible command, by its path (`volume create`), the top level as "".
    fn visible_commands(
        command: &clap::Command,
        path: &str,
        found: &mut Vec<(String, clap::Command)>,
    ) {
        found.push((path.to_owned(), command.clone()));
        for sub in command.get_subcommands().filter(|sub| !sub.is_hide_set()) {
            if sub.get_name() == "help" {
                continue;
            }
            let sub_path = format!("{path} {}", sub.get_name());
            visible_commands(sub, sub_path.trim_start(), found);
        }
    }

    #[test]
    fn the_command_line_definition_is_consistent() {
        cli_command().debug_assert();
    }

    #[test]
    fn every_help_ends_with_examples() {
        let mut command = cli_command();
        command.build();
        let mut found = Vec::new();
        visible_commands(&command, "", &mut found);
        assert!(found.len() > 20, "{}", found.len());
        let missing: Vec<&str> = found
            .iter()
            .filter(|(_, command)| {
                let after = command.get_after_long_help().or(command.get_after_help());
                let text = after.map(|text| text.to_string().to_lowercase());
                !text.is_some_and(|text| text.contains("example") && text.contains("thinpool "))
            })
            .map(|(path, _)| path.as_str())
            .collect();
        assert!(
            missing.is_empty(),
            "no examples in the --help of: {missing:?}"
        );
    }
}
