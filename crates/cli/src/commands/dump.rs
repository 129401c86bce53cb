//! `thinpool dump`: print pool metadata as XML or human-readable text, byte for byte as
//! `thin_dump` 1.1.0 prints it (or 0.9.0 with `--tools-version 0.9.0`), with its arguments.
//!
//! Errors exit with status 64, like the 1.x tools. `--repair` is not supported.

use anyhow::{bail, Context};
use persistent_data::{FileDevice, MetadataBlock};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use thin_pool::format::dump::metadata::{self, DumpOptions, Source};
use thin_pool::format::dump::{DumpVisitor, Flavour, HumanWriter, XmlWriter};

/// Output format.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    /// XML, as thin_restore reads it.
    Xml,
    /// Indented text.
    #[value(name = "human_readable")]
    HumanReadable,
}

/// Which thin_dump to imitate.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum ToolsVersion {
    /// thin-provisioning-tools 1.x: shared leaves as `<def>`/`<ref>`.
    #[value(name = "1")]
    V1,
    /// thin-provisioning-tools 0.9.0: every device expanded.
    #[value(name = "0.9.0")]
    V0_9,
}

/// Arguments (those of `thin_dump`).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The metadata file or device to dump.
    #[arg(value_name = "INPUT")]
    input: PathBuf,
    /// Output format.
    #[arg(
        short = 'f',
        long = "format",
        value_name = "TYPE",
        default_value = "xml"
    )]
    format: Format,
    /// Dump the metadata snapshot (held by the superblock, or at BLOCKNR).
    #[arg(
        short = 'm',
        long = "metadata-snap",
        value_name = "BLOCKNR",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "0"
    )]
    metadata_snap: Option<u64>,
    /// Write to FILE instead of stdout.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    output: Option<PathBuf>,
    /// Suppress output messages, return only the exit code.
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    /// Repair the metadata while dumping it (not supported).
    #[arg(short = 'r', long = "repair")]
    repair: bool,
    /// Do not dump the mappings.
    #[arg(long = "skip-mappings")]
    skip_mappings: bool,
    /// Dump only this device (may be repeated).
    #[arg(long = "dev-id", value_name = "THIN_ID")]
    dev_id: Vec<u32>,
    /// Override the transaction id.
    #[arg(long = "transaction-id", value_name = "NUM")]
    transaction_id: Option<u64>,
    /// Override the data block size.
    #[arg(long = "data-block-size", value_name = "SECTORS")]
    data_block_size: Option<u32>,
    /// Override the number of data blocks.
    #[arg(long = "nr-data-blocks", value_name = "NUM")]
    nr_data_blocks: Option<u64>,
    /// Which thin_dump's output to reproduce.
    #[arg(long = "tools-version", value_name = "VERSION", default_value = "1")]
    tools_version: ToolsVersion,
}

/// Exit status of thin-provisioning-tools 1.x on any failure.
const EXIT_FAILURE: u8 = 64;

/// Run the command. Failures print `thinpool: <error with context>` (unless `-q`) and exit
/// with status 64, as the 1.x tools do.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    match dump_file(&args) {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(error) => {
            if !args.quiet {
                eprintln!("thinpool: {error:#}");
            }
            Ok(ExitCode::from(EXIT_FAILURE))
        }
    }
}

fn dump_file(args: &Args) -> anyhow::Result<()> {
    if args.repair {
        bail!("--repair is not supported");
    }
    let device = FileDevice::open(&args.input, false)
        .with_context(|| format!("cannot open {}", args.input.display()))?;
    let options = DumpOptions {
        source: match args.metadata_snap {
            None => Source::Live,
            Some(0) => Source::MetadataSnap(None),
            Some(block) => Source::MetadataSnap(Some(MetadataBlock::new(block))),
        },
        flavour: match args.tools_version {
            ToolsVersion::V1 => Flavour::V1,
            ToolsVersion::V0_9 => Flavour::V0_9,
        },
        skip_mappings: args.skip_mappings,
        dev_ids: (!args.dev_id.is_empty()).then(|| args.dev_id.clone()),
        transaction_id: args.transaction_id,
        data_block_size_sectors: args.data_block_size,
        data_block_count: args.nr_data_blocks,
    };
    let output: Box<dyn Write> = match &args.output {
        Some(path) => Box::new(BufWriter::new(
            File::create(path).with_context(|| format!("cannot create {}", path.display()))?,
        )),
        None => Box::new(BufWriter::new(std::io::stdout().lock())),
    };
    let mut visitor: Box<dyn DumpVisitor> = match args.format {
        Format::Xml => Box::new(XmlWriter::with_flavour(output, options.flavour)),
        Format::HumanReadable => Box::new(HumanWriter::with_flavour(output, options.flavour)),
    };
    metadata::dump(Arc::new(device), &options, visitor.as_mut())
        .with_context(|| format!("dumping {}", args.input.display()))
}
