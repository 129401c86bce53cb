//! One module per subcommand; each exposes `Args` (clap) and `run(Args) -> Result<ExitCode>`.

pub mod bench;
pub mod check;
pub mod create;
pub mod list;
pub mod serve;
pub mod status;
pub mod volume;
pub mod dump;
pub mod metadata_size;
pub mod restore;
