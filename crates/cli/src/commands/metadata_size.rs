//! `thinpool metadata-size`: how large a metadata device a pool needs, with the arguments,
//! output and exit codes of `thin_metadata_size` 1.1.0 (the estimate itself lives in
//! `thin_pool::format::metadata_size`).
//!
//! Exit codes: 0 with the size on stdout; 2 for a malformed command line (clap); 64 when the
//! arguments are well formed but refused (e.g. a block size that is not a multiple of
//! 64 KiB), with the tool's message on stderr.

use std::process::ExitCode;
use thin_pool::format::metadata_size::{self, OutputStyle, Request, Unit};

/// Exit code of `thin_metadata_size` for refused arguments.
const EXIT_REFUSED: u8 = 64;

/// Arguments (those of `thin_metadata_size`).
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  thinpool metadata-size --block-size 64k --pool-size 1t --max-thins 100
  thinpool metadata-size -b 64k -s 10t -m 1000 --unit m -n   # the number of MiB only")]
pub struct Args {
    /// Data block size, e.g. 64k (unit letters bskmg; sectors if none).
    #[arg(short = 'b', long = "block-size", value_name = "SIZE[bskmg]", value_parser = parse_size)]
    block_size_bytes: u64,
    /// Size of the pool (data) device, e.g. 1t.
    #[arg(short = 's', long = "pool-size", value_name = "SIZE[bskmgtp]", value_parser = parse_size)]
    pool_size_bytes: u64,
    /// Maximum number of thin devices and snapshots.
    #[arg(short = 'm', long = "max-thins", value_name = "NUM")]
    thin_count_max: u64,
    /// Output unit, one of bskKmMgGtTpPeE.
    #[arg(short = 'u', long = "unit", value_name = "UNIT", default_value = "s", value_parser = parse_unit)]
    unit: Unit,
    /// Print the number only; `=short` adds the unit letter, `=long` the unit name.
    #[arg(
        short = 'n',
        long = "numeric-only",
        value_name = "OPT",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "",
        value_parser = parse_style
    )]
    numeric_only: Option<OutputStyle>,
    /// Print `{"thinpool_json":1,"metadata_size_bytes":N,"metadata_size_sectors":N}`
    /// (docs/json.md) instead; --unit and --numeric-only do not apply.
    #[arg(long = "json")]
    json: bool,
    #[command(flatten)]
    version: super::ToolsVersionFlag,
}

fn parse_size(text: &str) -> Result<u64, String> {
    metadata_size::parse_size_bytes(text).map_err(|e| e.to_string())
}

fn parse_unit(text: &str) -> Result<Unit, String> {
    text.parse::<Unit>().map_err(|e| e.to_string())
}

fn parse_style(text: &str) -> Result<OutputStyle, String> {
    match text {
        "" => Ok(OutputStyle::NumericOnly),
        "short" => Ok(OutputStyle::NumericShort),
        "long" => Ok(OutputStyle::NumericLong),
        other => Err(format!("unknown option {other:?}: expected short or long")),
    }
}

/// Run the command.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if args.version.print() {
        return Ok(ExitCode::SUCCESS);
    }
    let request = Request {
        data_block_size_bytes: args.block_size_bytes,
        pool_size_bytes: args.pool_size_bytes,
        thin_count_max: args.thin_count_max,
    };
    match metadata_size::estimate(&request) {
        Ok(size_bytes) if args.json => {
            super::json::print(&thinpool_daemon::json::MetadataSizeRecord {
                metadata_size_bytes: size_bytes,
                metadata_size_sectors: size_bytes / 512,
            })?;
            Ok(ExitCode::SUCCESS)
        }
        Ok(size_bytes) => {
            let style = args.numeric_only.unwrap_or(OutputStyle::Full);
            println!("{}", metadata_size::format(size_bytes, args.unit, style));
            Ok(ExitCode::SUCCESS)
        }
        Err(error) => {
            if args.json {
                super::json::print_error(&anyhow::Error::msg(error.to_string()));
            }
            eprintln!("{error}");
            Ok(ExitCode::from(EXIT_REFUSED))
        }
    }
}
