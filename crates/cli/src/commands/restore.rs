//! `thinpool restore`: build pool metadata from an XML dump, with the arguments of
//! `thin_restore` 1.1.0 (see `thin_pool::format::restore` for what is written).
//!
//! Like `thin_restore`, the output (file or device) must already exist: its size becomes
//! the metadata size. Errors exit with status 64, like the 1.x tools.
//!
//! Restored pools: dm-thin metadata holds no volume names or sizes (LVM keeps them), so a
//! pool directory whose `metadata` was restored here or by LVM's `thin_restore` gets a
//! catalog naming each volume `thin-ID` ([`name_restored_volumes`]), with the size of the
//! data device (or up to its highest mapped block, if that is further; `volume resize`
//! changes it). `thinpool restore` into a pool
//! directory's `metadata` replaces the directory's catalogs, which described the metadata
//! it overwrote; the management commands and `serve` write the catalog when a pool directory
//! has none at all (the real `thin_restore` writes only the metadata).

use anyhow::{bail, Context};
use persistent_data::{BlockDevice, FileDevice};
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use thin_pool::catalog::{Catalog, CatalogStore, CatalogVolume, DirCatalog};
use thin_pool::format::restore::{self, RestoreOptions};
use thin_pool::PoolMetadata;
use thin_pool::{DATA_FILE, METADATA_FILE};

use super::{tools_exit, SuperblockOverrides};

/// Arguments (those of `thin_restore`).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The XML dump to read.
    #[arg(short = 'i', long = "input", value_name = "FILE")]
    input: PathBuf,
    /// The metadata file or device to write (must exist; its size is the metadata size).
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    output: PathBuf,
    /// Suppress output messages, return only the exit code.
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    #[command(flatten)]
    overrides: SuperblockOverrides,
}

/// Run the command. Failures print `thinpool: <error with context>` (unless `-q`) and exit
/// with status 64, as the 1.x tools do.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    Ok(tools_exit(restore_file(&args), args.quiet))
}

fn restore_file(args: &Args) -> anyhow::Result<()> {
    let input = File::open(&args.input)
        .with_context(|| format!("cannot open input {}", args.input.display()))?;
    if !args.output.exists() {
        bail!(
            "output {} does not exist: create it with the metadata size first",
            args.output.display()
        );
    }
    let device = FileDevice::open(&args.output, true)
        .with_context(|| format!("cannot open output {}", args.output.display()))?;
    if device_block_count(&device) < 8 {
        bail!("output {} is too small for metadata", args.output.display());
    }
    let options = RestoreOptions {
        transaction_id: args.overrides.transaction_id,
        data_block_size_sectors: args.overrides.data_block_size,
        data_block_count: args.overrides.nr_data_blocks,
        ..RestoreOptions::default()
    };
    restore::restore(BufReader::new(input), Arc::new(device), &options).with_context(|| {
        format!(
            "restoring {} to {}",
            args.input.display(),
            args.output.display()
        )
    })?;
    // Into a pool directory: its catalogs described the metadata just overwritten.
    let is_pool_metadata = args.output.file_name() == Some(METADATA_FILE.as_ref());
    if let Some(dir) = args.output.parent().filter(|_| is_pool_metadata) {
        if has_catalog(dir)? {
            write_restored_catalog(dir)?;
        }
    }
    Ok(())
}

/// If the pool directory `dir` has no volume catalog (its metadata was restored, e.g. by
/// LVM's `thin_restore`), write one naming each volume `thin-ID`. Returns whether it did.
pub fn name_restored_volumes(dir: &Path) -> anyhow::Result<bool> {
    if has_catalog(dir)? {
        return Ok(false);
    }
    write_restored_catalog(dir)?;
    Ok(true)
}

/// Whether `dir` holds any `catalog-N.json`.
fn has_catalog(dir: &Path) -> anyhow::Result<bool> {
    let entries =
        std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?;
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list {}", dir.display()))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("catalog-") && name.ends_with(".json") {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Write the catalog of the metadata in `dir` (volumes `thin-ID`), as the only catalog.
fn write_restored_catalog(dir: &Path) -> anyhow::Result<()> {
    let path = dir.join(METADATA_FILE);
    let device = FileDevice::open(&path, false)
        .with_context(|| format!("cannot open {}", path.display()))?;
    let md = PoolMetadata::open(Arc::new(device))
        .with_context(|| format!("cannot read the metadata in {}", path.display()))?;
    let block_size_bytes = u64::from(md.data_block_size_sectors()) * 512;
    let data_path = dir.join(DATA_FILE);
    let data_bytes = std::fs::metadata(&data_path)
        .with_context(|| format!("cannot stat {}", data_path.display()))?
        .len();
    let data_blocks = data_bytes / block_size_bytes;
    let mut volumes = Vec::new();
    for id in md.volumes() {
        let highest = md
            .highest_mapped(id)
            .with_context(|| format!("cannot read the mappings of volume {id}"))?;
        let blocks = highest.map_or(0, |block| block.get().saturating_add(1));
        let size_bytes = blocks
            .max(data_blocks)
            .max(1)
            .checked_mul(block_size_bytes)
            .with_context(|| format!("volume {id} maps blocks beyond any volume size"))?;
        volumes.push(CatalogVolume {
            name: format!("thin-{id}"),
            id,
            size_bytes,
            read_only: false,
            origin: None,
        });
    }
    let catalog = Catalog {
        transaction_id: md.transaction_id().get(),
        volumes,
    };
    let store = DirCatalog::new(dir);
    store
        .store(&catalog)
        .and_then(|()| store.committed(catalog.transaction_id))
        .with_context(|| format!("cannot write the volume catalog in {}", dir.display()))?;
    Ok(())
}

fn device_block_count(device: &FileDevice) -> u64 {
    BlockDevice::block_count(device)
}
