//! `thinpool dump`: print pool metadata as XML or human-readable text, byte for byte as
//! `thin_dump` 1.1.0 prints it (or 0.9.0 with `--tools-version 0.9.0`), with its arguments.
//!
//! Errors exit with status 64, like the 1.x tools. `--repair` dumps what can be recovered
//! from damaged metadata (`thin_pool::format::repair`: every trusted mapping, devices
//! expanded, no `<def>`s), with the superblock overrides when the superblock is damaged.
//! Progress (`crate::progress`, not with `-q`): the mapped blocks written so far.

use anyhow::Context;
use persistent_data::{FileDevice, MetadataBlock};
use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use thin_pool::format::dump::metadata::{self, DumpOptions, Source};
use thin_pool::format::dump::{
    DeviceInfo, DumpVisitor, Error as DumpError, Flavour, HumanWriter, Mapping, SuperblockInfo,
    XmlWriter,
};
use thin_pool::format::repair::{self, RepairOptions};

use super::{tools_exit, SuperblockOverrides, ToolsVersion, ToolsVersionFlag};
use crate::progress::{Bar, Unit};

/// Mapping runs written between two updates of the progress bar.
const RUNS_PER_UPDATE: u64 = 1024;

/// Output format.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    /// XML, as thin_restore reads it.
    Xml,
    /// Indented text.
    #[value(name = "human_readable")]
    HumanReadable,
}

/// Arguments (those of `thin_dump`).
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  thinpool dump /srv/pool/metadata -o pool.xml
  thinpool dump --format human_readable /srv/pool/metadata | less
  thinpool dump -m /srv/pool/metadata   # served pool: after `thinpool metadata-snap reserve`")]
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
    /// Dump what can be recovered from damaged metadata.
    #[arg(short = 'r', long = "repair", conflicts_with_all = ["metadata_snap", "skip_mappings", "dev_id"])]
    repair: bool,
    /// Do not dump the mappings.
    #[arg(long = "skip-mappings")]
    skip_mappings: bool,
    /// Dump only this device (may be repeated).
    #[arg(long = "dev-id", value_name = "THIN_ID")]
    dev_id: Vec<u32>,
    #[command(flatten)]
    overrides: SuperblockOverrides,
    /// Which thin_dump's output to reproduce: 1 writes shared leaves as `<def>`/`<ref>`,
    /// 0.9.0 expands every device.
    #[arg(long = "tools-version", value_name = "VERSION", default_value = "1")]
    tools_version: ToolsVersion,
    #[command(flatten)]
    version: ToolsVersionFlag,
}

/// Run the command. Failures print `thinpool: <error with context>` (unless `-q`) and exit
/// with status 64, as the 1.x tools do.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if args.version.print() {
        return Ok(ExitCode::SUCCESS);
    }
    Ok(tools_exit(dump_file(&args), args.quiet))
}

fn dump_file(args: &Args) -> anyhow::Result<()> {
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
        transaction_id: args.overrides.transaction_id,
        data_block_size_sectors: args.overrides.data_block_size,
        data_block_count: args.overrides.nr_data_blocks,
    };
    let output: Box<dyn Write> = match &args.output {
        Some(path) => Box::new(BufWriter::new(
            File::create(path).with_context(|| format!("cannot create {}", path.display()))?,
        )),
        None => Box::new(BufWriter::new(std::io::stdout().lock())),
    };
    let mut writer: Box<dyn DumpVisitor> = match args.format {
        Format::Xml => Box::new(XmlWriter::with_flavour(output, options.flavour)),
        Format::HumanReadable => Box::new(HumanWriter::with_flavour(output, options.flavour)),
    };
    // Not over a dump printed on the same terminal.
    let on_terminal = args.output.is_none() && std::io::stdout().is_terminal();
    let bar = match args.quiet || on_terminal {
        true => Bar::hidden(),
        false => Bar::counting("dump", Unit::Mappings, None),
    };
    let mut counted;
    let visitor: &mut dyn DumpVisitor = if bar.is_shown() {
        counted = Counted {
            inner: writer.as_mut(),
            bar: &bar,
            blocks: 0,
            runs: 0,
        };
        &mut counted
    } else {
        writer.as_mut()
    };
    let dumped = dump_to(args, device, &options, visitor);
    bar.finish();
    dumped
}

fn dump_to(
    args: &Args,
    device: FileDevice,
    options: &DumpOptions,
    visitor: &mut dyn DumpVisitor,
) -> anyhow::Result<()> {
    if args.repair {
        let options = RepairOptions {
            transaction_id: args.overrides.transaction_id,
            data_block_size_sectors: args.overrides.data_block_size,
            data_block_count: args.overrides.nr_data_blocks,
        };
        repair::recover(Arc::new(device), &options, visitor)
            .with_context(|| format!("recovering {}", args.input.display()))?;
        return Ok(());
    }
    metadata::dump(Arc::new(device), options, visitor)
        .with_context(|| format!("dumping {}", args.input.display()))
}

/// A visitor that counts the mapped blocks going through to `inner` into `bar` (every
/// [`RUNS_PER_UPDATE`] runs, so the writer's loop pays an addition per run).
struct Counted<'a> {
    inner: &'a mut dyn DumpVisitor,
    bar: &'a Bar,
    blocks: u64,
    runs: u64,
}

impl DumpVisitor for Counted<'_> {
    fn superblock_begin(&mut self, superblock: &SuperblockInfo) -> Result<(), DumpError> {
        self.inner.superblock_begin(superblock)
    }
    fn superblock_end(&mut self) -> Result<(), DumpError> {
        self.bar.set_position(self.blocks);
        self.inner.superblock_end()
    }
    fn def_begin(&mut self, name: &str) -> Result<(), DumpError> {
        self.inner.def_begin(name)
    }
    fn def_end(&mut self) -> Result<(), DumpError> {
        self.inner.def_end()
    }
    fn device_begin(&mut self, device: &DeviceInfo) -> Result<(), DumpError> {
        self.inner.device_begin(device)
    }
    fn device_end(&mut self) -> Result<(), DumpError> {
        self.inner.device_end()
    }
    fn mapping(&mut self, mapping: &Mapping) -> Result<(), DumpError> {
        self.blocks += mapping.length;
        self.runs += 1;
        if self.runs.is_multiple_of(RUNS_PER_UPDATE) {
            self.bar.set_position(self.blocks);
        }
        self.inner.mapping(mapping)
    }
    fn reference(&mut self, name: &str) -> Result<(), DumpError> {
        self.inner.reference(name)
    }
}
