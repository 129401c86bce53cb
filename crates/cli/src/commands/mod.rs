//! One module per subcommand; each exposes `Args` (clap) and `run(Args) -> Result<ExitCode>`.

pub mod bench;
pub mod check;
pub mod create;
pub mod dump;
pub mod list;
pub mod metadata_size;
pub mod restore;
pub mod serve;
pub mod status;
pub mod volume;
