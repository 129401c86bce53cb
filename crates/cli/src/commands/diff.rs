//! `thinpool diff BASE TARGET`: the blocks in which two volumes differ (mapped in one only, or
//! to different data blocks), from the pool or its server. Three forms:
//!
//! - text (default): a table of ranges, blocks and bytes;
//! - `--json`: the control socket's diff record with the version field (docs/json.md):
//!   `{"thinpool_json":1,"base":{volume},"target":{volume},"block_size_bytes":..,
//!   "ranges":[{"begin_block","length_blocks","offset_bytes","length_bytes",
//!   "kind":"changed|base_only|target_only",..}]}`;
//! - `--format xml`: what `thin_delta --thin1 BASE_ID --thin2 TARGET_ID` prints for the same
//!   metadata, byte for byte (`same` ranges included, so this form reads the shared part of
//!   the trees too; the others cost only the difference); with `--verbose`, what
//!   `thin_delta --verbose` prints (ranges grouped by kind, with their first data blocks).
//!
//! A diff changes nothing, so a pool no server holds is opened read-only: no check of the
//! whole metadata first (its cost would dwarf the diff's), no commit at the end. Damaged
//! metadata still gives an error, never a wrong answer or a hang (the walk checks every node
//! it reads). A served pool answers through its control socket. Progress
//! (`crate::progress`): the virtual blocks compared, counted by the pool offline, or by the
//! server in progress lines it sends before its answer when the bar is drawn
//! (`{"op":"diff",...,"progress":true}`, the daemon's `control/progress.rs`); `--format xml`
//! (the full report) has a spinner with the time taken.

use anyhow::Context;
use std::io::Write;
use std::process::ExitCode;

use crate::control::diff::DiffRecord;
use crate::control::progress::ProgressRecord;
use crate::control::{self, OpError, Outcome, Request, Target};
use crate::pool_dir::{format_size, table, PoolArg, PoolDir, StoredOptions};
use crate::progress::{Bar, BlockCounts};
use thin_pool::Pool;

/// Output forms.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// A table of the differing ranges.
    Text,
    /// A JSON object, offsets and lengths in bytes.
    Json,
    /// thin_delta's XML (volumes by thin id, `same` ranges too).
    Xml,
}

/// Arguments.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  thinpool volume snapshot vm1 vm1-snap --pool /srv/pool
  ... vm1 is written ...
  thinpool diff vm1-snap vm1 --pool /srv/pool     # what vm1 changed since the snapshot
  vm1-snap (id 1) -> vm1 (id 0): 3 blocks of 64.00KiB differ in 2 ranges (192.00KiB)
  BLOCK  BLOCKS   OFFSET     LENGTH  KIND
      3       1   196608   64.00KiB  changed
     20       2  1310720  128.00KiB  target_only
  thinpool diff vm1-snap vm1 --json | jq '.ranges[]'   # byte ranges, for a backup tool
  thinpool diff vm1-snap vm1 --format xml              # as thin_delta prints it
  thinpool diff vm1-snap vm1 --format xml --verbose    # as thin_delta --verbose")]
pub struct Args {
    /// The base volume (thin_delta's left).
    base: String,
    /// The target volume (thin_delta's right).
    target: String,
    #[command(flatten)]
    pool: PoolArg,
    /// Output form.
    #[arg(long = "format", value_enum, default_value = "text")]
    format: Format,
    /// Same as `--format json`.
    #[arg(long = "json", conflicts_with = "format")]
    json: bool,
    /// With `--format xml`: thin_delta's `--verbose` form (data blocks of each range).
    #[arg(long = "verbose")]
    verbose: bool,
}

/// Run the command.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let format = if args.json { Format::Json } else { args.format };
    if args.verbose && format != Format::Xml {
        anyhow::bail!("--verbose goes with --format xml");
    }
    let dir = args.pool.resolve();
    let list_same = format == Format::Xml;
    let bar = Bar::spinner("diff", "comparing the volumes");
    let request = Request::Diff {
        base: args.base.clone(),
        target: args.target.clone(),
        list_same,
        progress: bar.is_shown() && !list_same,
    };
    let answer = counted(&dir, &request, &bar, list_same);
    bar.finish();
    let record = match answer.with_context(|| {
        format!(
            "cannot compare volumes {:?} and {:?}",
            args.base, args.target
        )
    })? {
        Outcome::Diff(record) => record,
        other => anyhow::bail!("unexpected answer: {other:?}"),
    };
    let mut out = std::io::stdout().lock();
    match format {
        Format::Text => out.write_all(render(&record).as_bytes())?,
        Format::Json => super::json::print(&record)?,
        Format::Xml => {
            let header = record
                .delta_header()
                .context("the answer has no superblock fields")?;
            let ranges = record.delta_ranges()?;
            thin_pool::format::diff::write_xml(
                &mut out,
                &header,
                u32::try_from(record.base.id)?,
                u32::try_from(record.target.id)?,
                &ranges,
                args.verbose,
            )?;
        }
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

/// [`ask_read_only`] of a diff, its virtual blocks compared counted on `bar` (offline by the
/// pool, served from the server's progress lines), but for `list_same`'s full report,
/// which keeps the spinner.
fn counted(
    dir: &PoolDir,
    request: &Request,
    bar: &Bar,
    list_same: bool,
) -> anyhow::Result<Outcome> {
    if list_same {
        return ask_read_only(dir, request);
    }
    let counts = BlockCounts::new(bar);
    counts.follow(|| {
        ask_read_only_reporting(
            dir,
            request,
            &|target| target.diff(request, counts.offline()),
            &|frame| counts.served(frame),
        )
    })
}

/// Carries out `request` (one that changes nothing) on a read-only open of the pool, or
/// through its server (also `list --names`, which shell completion runs on each TAB).
pub(super) fn ask_read_only(dir: &PoolDir, request: &Request) -> anyhow::Result<Outcome> {
    ask_read_only_reporting(dir, request, &|target| target.execute(request), &|_| {})
}

/// [`ask_read_only`], carried out offline by `offline`; a server's progress lines (for a
/// request that asks for them) go to `on_progress`.
fn ask_read_only_reporting(
    dir: &PoolDir,
    request: &Request,
    offline: &dyn Fn(&Target) -> Result<Outcome, OpError>,
    on_progress: &dyn Fn(ProgressRecord),
) -> anyhow::Result<Outcome> {
    dir.require_pool()?;
    thinpool_daemon::restored::name_restored_volumes(&dir.path)?;
    let options = StoredOptions::load(dir)?;
    let pool_options = thin_pool::PoolOptions {
        read_only: true,
        ..options.pool_options()
    };
    let answer: Result<Outcome, OpError> = match Pool::open(&dir.path, pool_options) {
        Ok(pool) => {
            let target = Target {
                pool,
                options,
                reserved_names: Vec::new(),
                served: None,
            };
            offline(&target)
        }
        Err(thin_pool::Error::Locked { .. }) => {
            let socket = dir.control_socket();
            control::call_reporting(&socket, request, on_progress).with_context(|| {
                format!(
                    "the pool in {} is held by another process, and its control socket {} does not answer",
                    dir.path.display(),
                    socket.display()
                )
            })?
        }
        Err(error) => {
            return Err(error)
                .with_context(|| format!("cannot open the pool in {}", dir.path.display()))
        }
    };
    Ok(answer?)
}

/// The text form: a summary line, then one row per range.
pub fn render(record: &DiffRecord) -> String {
    let block = record.block_size_bytes;
    let blocks: u64 = record.ranges.iter().map(|r| r.length_blocks).sum();
    let mut out = format!(
        "{} (id {}) -> {} (id {}): {} blocks of {} differ in {} ranges ({})\n",
        record.base.name,
        record.base.id,
        record.target.name,
        record.target.id,
        blocks,
        format_size(block),
        record.ranges.len(),
        format_size(blocks * block),
    );
    if record.ranges.is_empty() {
        return out;
    }
    let rows: Vec<Vec<String>> = record
        .ranges
        .iter()
        .map(|range| {
            vec![
                range.begin_block.to_string(),
                range.length_blocks.to_string(),
                (range.begin_block * block).to_string(),
                format_size(range.length_blocks * block),
                range.kind.clone(),
            ]
        })
        .collect();
    out.push_str(&table(
        &["BLOCK", "BLOCKS", "OFFSET", "LENGTH", "KIND"],
        &rows,
        &[0, 1, 2, 3],
    ));
    out
}
