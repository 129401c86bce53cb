//! One module per subcommand; each exposes `Args` (clap) and `run(Args) -> Result<ExitCode>`.

pub mod check;
pub mod completions;
pub mod create;
pub mod create_devices;
pub mod diff;
pub mod dump;
pub mod grow;
pub mod import;
pub mod json;
pub mod list;
pub mod metadata_size;
pub mod metadata_snap;
pub mod receive;
pub mod repair;
pub mod replicate;
pub mod restore;
pub mod send;
pub mod status;
pub mod trim;
pub mod volume;

use std::ffi::OsString;
use std::process::ExitCode;

/// What `-V`/`--version` of the drop-in subcommands (`check`, `dump`, `restore`, `repair`,
/// `metadata-size`) prints, as `thin_check -V` prints its own: the thin-provisioning-tools
/// release whose arguments, output and exit codes they follow, so that scripts and LVM,
/// which enable options by the version they read, treat them as that release.
/// (`thinpool --version` prints thinpool's own version.)
pub const TOOLS_VERSION: &str = "1.1.0";

/// The drop-in subcommands, by their command-line names.
const DROP_IN_COMMANDS: [&str; 5] = ["check", "dump", "restore", "repair", "metadata-size"];

/// `-V`/`--version` of a drop-in subcommand (listed in its `--help`).
#[derive(clap::Args, Debug)]
pub struct ToolsVersionFlag {
    /// Print the version of thin-provisioning-tools this command follows, and exit.
    #[arg(short = 'V', long = "version")]
    version: bool,
}

impl ToolsVersionFlag {
    /// Print [`TOOLS_VERSION`] if the flag was given; returns whether it was.
    pub fn print(&self) -> bool {
        if self.version {
            println!("{TOOLS_VERSION}");
        }
        self.version
    }
}

/// Whether the command line (program name first) asks a drop-in subcommand for its version:
/// `-V` or `--version` after the subcommand's name (and before any `--`). Checked before
/// parsing, as `thin_check -V` needs no other argument, though the subcommands require some.
pub fn asks_tools_version(args: impl IntoIterator<Item = OsString>) -> bool {
    let mut args = args.into_iter().skip(1);
    let Some(command) = args.next() else {
        return false;
    };
    if !DROP_IN_COMMANDS.iter().any(|name| command == *name) {
        return false;
    }
    args.take_while(|arg| arg != "--")
        .any(|arg| arg == "-V" || arg == "--version")
}

/// Which release of thin-provisioning-tools `check` and `dump` imitate.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolsVersion {
    /// thin-provisioning-tools 1.x.
    #[value(name = "1")]
    V1,
    /// thin-provisioning-tools 0.9.0.
    #[value(name = "0.9.0")]
    V0_9,
}

/// The superblock fields `dump` and `restore` can override, as thin_dump and thin_restore do.
#[derive(clap::Args, Debug)]
pub struct SuperblockOverrides {
    /// Override the transaction id.
    #[arg(long = "transaction-id", value_name = "NUM")]
    pub transaction_id: Option<u64>,
    /// Override the data block size.
    #[arg(long = "data-block-size", value_name = "SECTORS")]
    pub data_block_size: Option<u32>,
    /// Override the number of data blocks.
    #[arg(long = "nr-data-blocks", value_name = "NUM")]
    pub nr_data_blocks: Option<u64>,
}

/// Exit status of thin-provisioning-tools 1.x on any failure.
const TOOLS_EXIT_FAILURE: u8 = 64;

/// How a command that imitates a 1.x tool ends: success, or its error printed as
/// `thinpool: <error with context>` (unless `quiet`) and status 64.
pub fn tools_exit(result: anyhow::Result<()>, quiet: bool) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            if !quiet {
                eprintln!("thinpool: {error:#}");
            }
            ExitCode::from(TOOLS_EXIT_FAILURE)
        }
    }
}
