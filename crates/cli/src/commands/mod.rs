//! One module per subcommand; each exposes `Args` (clap) and `run(Args) -> Result<ExitCode>`.

pub mod check;
pub mod dump;
pub mod metadata_size;
pub mod restore;
