//! One module per subcommand; each exposes `Args` (clap) and `run(Args) -> Result<ExitCode>`.

pub mod check;
pub mod create;
pub mod create_devices;
pub mod diff;
pub mod dump;
pub mod import;
pub mod list;
pub mod metadata_size;
pub mod metadata_snap;
pub mod restore;
pub mod status;
pub mod trim;
pub mod volume;

use std::process::ExitCode;

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
