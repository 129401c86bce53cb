//! `thinpool list`: the volumes, one row each like `lvs` (name, id, size, mapped %, origin,
//! read-only), or `--json` (`{"volumes":[...]}`), from the pool or its server.

use anyhow::Context;
use std::process::ExitCode;

use crate::control::{self, Request, VolumeRecord};
use crate::pool_dir::{format_size, table, PoolArg};

/// Arguments.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pool: PoolArg,
    /// Print `{"volumes":[...]}` with every field, sizes in bytes.
    #[arg(long = "json")]
    json: bool,
}

/// Run the command.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let dir = args.pool.resolve();
    let volumes = control::ask(&dir, &Request::List)
        .context("cannot list volumes")?
        .into_volumes()?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&Listing { volumes: &volumes })?
        );
    } else {
        print!("{}", render(&volumes));
    }
    Ok(ExitCode::SUCCESS)
}

/// The `--json` shape.
#[derive(serde::Serialize)]
struct Listing<'a> {
    volumes: &'a [VolumeRecord],
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
                volume.origin.clone().unwrap_or_else(|| "-".into()),
                if volume.read_only { "yes" } else { "no" }.into(),
            ]
        })
        .collect();
    table(
        &["NAME", "ID", "SIZE", "MAPPED%", "ORIGIN", "READ-ONLY"],
        &rows,
        &[1, 2, 3],
    )
}
