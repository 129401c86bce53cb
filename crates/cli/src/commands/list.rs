//! `thinpool list`: the volumes, one row each like `lvs` (name, thin id, size, mapped %, the
//! bytes mapped, exclusive and shared, origin, read-only), `--ids` (thin id, name and the
//! origin's thin id, in thin id order, to read beside thin_ls, thin_delta or thin_dump), or
//! `--json` (`{"thinpool_json":1,"volumes":[...],"unadopted":[...],"orphaned":[...]}`), from the pool or its
//! server. Thin ids the metadata holds and the catalog does not know (unadopted) and
//! catalog entries whose thin id is gone (orphaned) follow the table, and a warning on
//! stderr names them.
//!
//! MAPPED, EXCLUSIVE and SHARED have thin_ls's meaning (`-o MAPPED_BYTES,EXCLUSIVE_BYTES,
//! SHARED_BYTES`): EXCLUSIVE is what deleting the volume would free, SHARED what it shares
//! with its snapshots, origin or itself. Every figure of a row (MAPPED% and MAPPED too) is
//! from one view, the last commit (at most a commit interval behind the writes); a volume
//! made since then shows its live mapped count and `-` for the bytes, as does a pool whose
//! metadata cannot be read. OPEN is the number of clients that have the volume open now.

use anyhow::Context;
use std::process::ExitCode;

use crate::control::{self, Request, StatusRecord, VolumeRecord};
use crate::pool_dir::{format_size, table, PoolArg};
use thinpool_daemon::json::ListRecord;

/// Arguments.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  thinpool list                 # NAME ID SIZE MAPPED% MAPPED EXCLUSIVE SHARED ORIGIN READ-ONLY OPEN
Figures are those of the last commit (at most a commit interval behind the writes).
  thinpool list --ids           # thin id of each name, for thin_ls -m / thin_delta -m
  thinpool list --names         # one name a line (what shell completion offers)
  thinpool list --json | jq '.volumes[] | {name, exclusive_bytes}'")]
pub struct Args {
    #[command(flatten)]
    pool: PoolArg,
    /// Print `{"volumes":[...],"unadopted":[...],"orphaned":[...]}` (docs/json.md), sizes
    /// in bytes (`mapped_bytes`, `exclusive_bytes`, `shared_bytes` as thin_ls counts them).
    #[arg(long = "json")]
    json: bool,
    /// Print each volume's thin id (dm-thin's device id, as thin_ls and thin_delta show it)
    /// and its origin's, in thin id order (with --json: the volumes in thin id order).
    #[arg(long = "ids")]
    ids: bool,
    /// Print the volumes' names only, one a line (for scripts and shell completion; the
    /// pool is opened read-only).
    #[arg(long = "names", conflicts_with_all = ["json", "ids"])]
    names: bool,
}

/// Run the command.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let dir = args.pool.resolve();
    if args.names {
        let volumes = super::diff::ask_read_only(&dir, &Request::List)
            .context("cannot list volumes")?
            .into_volumes()?;
        for volume in volumes {
            println!("{}", volume.name);
        }
        return Ok(ExitCode::SUCCESS);
    }
    let volumes = control::ask(&dir, &Request::List)
        .context("cannot list volumes")?
        .into_volumes()?;
    let status = control::ask(&dir, &Request::Status)
        .context("cannot list volumes")?
        .into_status()?;
    let disagreements = render_disagreements(&status);
    if !disagreements.is_empty() {
        eprint!("thinpool: warning: the catalog and the metadata disagree:\n{disagreements}");
    }
    if args.json {
        let mut volumes = volumes;
        if args.ids {
            volumes.sort_by_key(|volume| volume.id);
        }
        super::json::print(&ListRecord {
            volumes,
            unadopted: status.unadopted,
            orphaned: status.orphaned,
        })?;
    } else if args.ids {
        print!("{}", render_ids(&volumes));
    } else {
        print!("{}", render(&volumes));
        if !disagreements.is_empty() {
            print!("\n{disagreements}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The lines naming the thin ids the catalog lacks and the entries whose thin id is gone,
/// with the command that settles each ("" when the two agree).
pub fn render_disagreements(status: &StatusRecord) -> String {
    let mut out = String::new();
    if !status.unadopted.is_empty() {
        let ids: Vec<String> = status
            .unadopted
            .iter()
            .map(|thin| format!("{} ({} mapped)", thin.id, format_size(thin.mapped_bytes)))
            .collect();
        out.push_str(&format!(
            "unadopted thin ids: {} (in the metadata, not in the catalog: not served, blocks kept; `thinpool volume adopt ID NAME --size SIZE [--origin NAME]` names one)\n",
            ids.join(", ")
        ));
    }
    if !status.orphaned.is_empty() {
        let names: Vec<String> = status
            .orphaned
            .iter()
            .map(|v| {
                format!(
                    "{:?} (thin id {}, {})",
                    v.name,
                    v.id,
                    format_size(v.size_bytes)
                )
            })
            .collect();
        out.push_str(&format!(
            "orphaned volumes: {} (in the catalog, thin id not in the metadata: not served; `thinpool volume forget NAME` drops one)\n",
            names.join(", ")
        ));
    }
    out
}

fn size_or_dash(bytes: Option<u64>) -> String {
    bytes.map_or_else(|| "-".to_string(), format_size)
}

/// The `lvs`-like table.
pub fn render(volumes: &[VolumeRecord]) -> String {
    let rows: Vec<Vec<String>> = volumes
        .iter()
        .map(|volume| {
            vec![
                volume.name.clone(),
                volume.id.to_string(),
                format_size(volume.size_bytes),
                format!("{:.2}", volume.mapped_percent),
                size_or_dash(volume.mapped_bytes),
                size_or_dash(volume.exclusive_bytes),
                size_or_dash(volume.shared_bytes),
                volume.origin.clone().unwrap_or_else(|| "-".into()),
                if volume.read_only { "yes" } else { "no" }.into(),
                volume.open_count.to_string(),
            ]
        })
        .collect();
    table(
        &[
            "NAME",
            "ID",
            "SIZE",
            "MAPPED%",
            "MAPPED",
            "EXCLUSIVE",
            "SHARED",
            "ORIGIN",
            "READ-ONLY",
            "OPEN",
        ],
        &rows,
        &[1, 2, 3, 4, 5, 6, 9],
    )
}

/// The `--ids` table: thin id, name, origin's thin id.
fn render_ids(volumes: &[VolumeRecord]) -> String {
    let mut sorted: Vec<&VolumeRecord> = volumes.iter().collect();
    sorted.sort_by_key(|volume| volume.id);
    let rows: Vec<Vec<String>> = sorted
        .iter()
        .map(|volume| {
            vec![
                volume.id.to_string(),
                volume.name.clone(),
                volume
                    .origin_id
                    .map_or_else(|| "-".to_string(), |id| id.to_string()),
            ]
        })
        .collect();
    table(&["THIN_ID", "NAME", "ORIGIN_ID"], &rows, &[0, 2])
}
