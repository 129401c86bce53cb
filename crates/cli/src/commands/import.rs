//! `thinpool import`: take over a pool the kernel made (dm-thin metadata written by the
//! kernel, by LVM or by `thin_restore`) on its metadata and data devices.
//!
//! The metadata is checked as a read-write open checks it (thin_check's rules) before
//! anything is written; then the pool directory gets `devices.json`, `pool.json` and a
//! catalog of the metadata's transaction id naming each thin device `thin-ID`. dm-thin's
//! metadata holds no volume sizes (LVM keeps them in its own metadata), so `--volume
//! ID:NAME:SIZE` gives a volume its name and size; a volume without one is sized to its
//! highest mapped block, and the command says so. The import's open rewrites metadata
//! blocks (same content) but changes no mapping, so the pool can go back to the kernel
//! (`docs/lvm.md`). Progress (`crate::progress`): the check's metadata blocks, then a
//! spinner while the imported pool opens (which checks it again).

use anyhow::{bail, Context};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use thin_pool::block_device::{
    holds_pool_metadata, open_metadata_device, BlockDataDevice, DevicePaths,
};
use thin_pool::catalog::{validate_name, Catalog, CatalogStore, CatalogVolume, DirCatalog};
use thin_pool::data_device::DataDevice;
use thin_pool::VolumeId;
use thin_pool::{Pool, PoolMetadata};

use crate::pool_dir::{format_size, parse_size_nonzero, PoolArg, PoolDir, StoredOptions};
use crate::progress::{Bar, Unit};

/// Problems of a failed check shown in the refusal (`thinpool check` gives them all).
const PROBLEMS_SHOWN: usize = 5;

/// Arguments.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Example (an LVM thin pool vg0/pool, deactivated first):
  lvchange -an vg0/pool
  thinpool import --pool /srv/imported --metadata-device /dev/mapper/vg0-pool_tmeta \\
      --data-device /dev/mapper/vg0-pool_tdata --volume 1:root:20G
  thinpool --pool /srv/imported list")]
pub struct Args {
    #[command(flatten)]
    pool: PoolArg,
    /// The pool's metadata device (e.g. LVM's `VG-POOL_tmeta`).
    #[arg(long = "metadata-device", value_name = "DEV")]
    metadata_device: PathBuf,
    /// The pool's data device (e.g. LVM's `VG-POOL_tdata`).
    #[arg(long = "data-device", value_name = "DEV")]
    data_device: PathBuf,
    /// Name and size of thin device ID (repeatable), e.g. `--volume 1:root:20G`; a volume
    /// not named here is `thin-ID`, sized to its highest mapped block.
    #[arg(long = "volume", value_name = "ID:NAME:SIZE")]
    volumes: Vec<String>,
    /// Open the data device with O_DIRECT when the pool is used.
    #[arg(long = "direct-io")]
    direct_io: bool,
    /// Print the imported pool's status as JSON (docs/json.md).
    #[arg(long = "json")]
    json: bool,
}

/// A `--volume` argument.
#[derive(Debug, PartialEq, Eq)]
struct VolumeSpec {
    name: String,
    size_bytes: u64,
}

fn parse_volume(text: &str) -> anyhow::Result<(u32, VolumeSpec)> {
    let mut parts = text.splitn(3, ':');
    let (Some(id), Some(name), Some(size)) = (parts.next(), parts.next(), parts.next()) else {
        bail!("--volume {text:?}: expected ID:NAME:SIZE, e.g. 1:root:20G");
    };
    let id: u32 = id
        .parse()
        .with_context(|| format!("--volume {text:?}: {id:?} is not a thin device id"))?;
    validate_name(name).with_context(|| format!("--volume {text:?}"))?;
    let size_bytes = parse_size_nonzero(size).with_context(|| format!("--volume {text:?}"))?;
    if size_bytes == 0 || !size_bytes.is_multiple_of(512) {
        bail!("--volume {text:?}: the size must be a positive multiple of 512 bytes");
    }
    Ok((
        id,
        VolumeSpec {
            name: name.to_string(),
            size_bytes,
        },
    ))
}

/// Run the command.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let dir = args.pool.resolve();
    let mut specs = BTreeMap::new();
    for text in &args.volumes {
        let (id, spec) = parse_volume(text)?;
        if specs.values().any(|s: &VolumeSpec| s.name == spec.name) {
            bail!("--volume: the name {:?} is given twice", spec.name);
        }
        if specs.insert(id, spec).is_some() {
            bail!("--volume: thin device {id} is named twice");
        }
    }
    let made = dir.create_private()?;
    if Pool::exists(&dir.path) {
        bail!("{} already holds a pool", dir.path.display());
    }
    let devices = DevicePaths::new(&args.metadata_device, &args.data_device, args.direct_io);
    // The metadata must pass its check, the directory be written and the pool open (its
    // catalog against its metadata, the check again), or the directory is left as it was
    // (removed, if this made it).
    let opened = read_pool(&devices, &specs).and_then(|catalog| {
        write_directory(&dir, &devices, &catalog)?;
        let bar = Bar::spinner("import", "opening the imported pool");
        let pool = Pool::open(&dir.path, StoredOptions::default().pool_options());
        bar.finish();
        pool.context("the imported pool does not open")
    });
    let pool = match opened {
        Ok(pool) => pool,
        Err(error) => {
            made.undo();
            return Err(error);
        }
    };
    for event in pool.events() {
        eprintln!("thinpool: {event}");
    }
    if args.json {
        return print_status(&dir, pool);
    }
    let status = pool.status();
    println!(
        "imported pool {} from {} and {}: transaction id {}, {} volumes, data {} of {} blocks used ({} each)",
        dir.path.display(),
        devices.metadata_device.display(),
        devices.data_device.display(),
        status.transaction_id,
        status.volume_count,
        status.data_used_blocks,
        status.data_total_blocks,
        format_size(status.block_size_bytes),
    );
    pool.close().context("cannot close the imported pool")?;
    Ok(ExitCode::SUCCESS)
}

/// Prints the status of the imported pool, `--json`, and closes it.
fn print_status(dir: &PoolDir, pool: Pool) -> anyhow::Result<ExitCode> {
    let target = thinpool_daemon::control::Target {
        pool,
        options: StoredOptions::load(dir)?,
        reserved_names: Vec::new(),
        served: None,
    };
    let status = target
        .execute(&thinpool_daemon::control::Request::Status)?
        .into_status()?;
    target
        .pool
        .close()
        .context("cannot close the imported pool")?;
    super::json::print(&status)?;
    Ok(ExitCode::SUCCESS)
}

/// Reads and checks the pool on `devices`; returns its catalog (names and sizes as
/// `specs` give them, else `thin-ID` and the highest mapped block).
fn read_pool(devices: &DevicePaths, specs: &BTreeMap<u32, VolumeSpec>) -> anyhow::Result<Catalog> {
    let metadata_path = &devices.metadata_device;
    // Both claimed for the import: nobody else may change them meanwhile.
    let metadata = open_metadata_device(metadata_path, false)
        .with_context(|| format!("cannot open {}", metadata_path.display()))?;
    let data = BlockDataDevice::open(&devices.data_device, false)
        .with_context(|| format!("cannot open {}", devices.data_device.display()))?;
    if !holds_pool_metadata(&metadata)? {
        bail!(
            "{} holds no dm-thin pool metadata (no superblock magic in its first block)",
            metadata_path.display()
        );
    }
    let metadata: Arc<dyn persistent_data::BlockDevice> = Arc::new(metadata);
    require_passing_check(&metadata, data.size_bytes(), metadata_path)?;
    let md = PoolMetadata::open(metadata)
        .with_context(|| format!("cannot read the metadata on {}", metadata_path.display()))?;
    let block_size_bytes = u64::from(md.data_block_size_sectors()) * 512;
    let ids = md.volumes();
    for id in specs.keys() {
        if !ids.iter().any(|known| known.get() == *id) {
            bail!(
                "--volume names thin device {id}, which the metadata does not hold (it holds {})",
                list_ids(&ids)
            );
        }
    }
    let mut volumes = Vec::new();
    for id in ids {
        let highest = md
            .highest_mapped(id)
            .with_context(|| format!("cannot read the mappings of thin device {id}"))?;
        let mapped_bytes = highest
            .map_or(0, |block| block.get().saturating_add(1))
            .saturating_mul(block_size_bytes);
        let (name, size_bytes) =
            name_and_size(id, specs.get(&id.get()), mapped_bytes, block_size_bytes)?;
        volumes.push(CatalogVolume {
            name,
            id,
            size_bytes,
            read_only: false,
            origin: None,
            content_id: None,
        });
    }
    if let Some(taken) = volumes
        .iter()
        .find(|v| volumes.iter().filter(|w| w.name == v.name).count() > 1)
    {
        bail!(
            "two volumes would be named {:?}: give the other one a name with --volume",
            taken.name
        );
    }
    Ok(Catalog {
        transaction_id: md.transaction_id().get(),
        volumes,
        partial: Vec::new(),
    })
}

/// Refuses metadata that fails the check a read-write open runs, listing what it found.
fn require_passing_check(
    metadata: &Arc<dyn persistent_data::BlockDevice>,
    data_size_bytes: u64,
    metadata_path: &std::path::Path,
) -> anyhow::Result<()> {
    let bar = Bar::counting("import: check", Unit::Blocks, None);
    let report = thin_pool::format::check::check_before_open_with_progress(
        metadata.clone(),
        data_size_bytes,
        &mut |progress| bar.set(progress.done_blocks, progress.total_blocks),
    );
    bar.finish();
    if !report.passes(true) {
        let mut findings = String::new();
        for problem in report.problems.iter().take(PROBLEMS_SHOWN) {
            findings.push_str(&format!("\n  {problem}"));
        }
        bail!(
            "the metadata on {} fails its check ({} fatal problems); nothing was imported (`thinpool check {}` gives the full report; `thin_repair` may mend it):{findings}",
            metadata_path.display(),
            report.fatal_count,
            metadata_path.display()
        );
    }
    Ok(())
}

/// Thin device `id`'s name and size: as `spec` gives them (never smaller than what it
/// maps), else `thin-ID` sized to its highest mapped block (said on stderr).
fn name_and_size(
    id: VolumeId,
    spec: Option<&VolumeSpec>,
    mapped_bytes: u64,
    block_size_bytes: u64,
) -> anyhow::Result<(String, u64)> {
    match spec {
        Some(spec) => {
            if spec.size_bytes < mapped_bytes {
                bail!(
                    "--volume {id}:{}:{}: thin device {id} maps blocks up to {} bytes; a smaller size would hide them",
                    spec.name,
                    spec.size_bytes,
                    mapped_bytes
                );
            }
            Ok((spec.name.clone(), spec.size_bytes))
        }
        None => {
            let size = mapped_bytes.max(block_size_bytes);
            eprintln!(
                "thinpool: thin device {id} has no size in its metadata (LVM keeps sizes): named thin-{id}, sized {} to its highest mapped block; give --volume {id}:NAME:SIZE for its real size",
                format_size(size)
            );
            Ok((format!("thin-{id}"), size))
        }
    }
}

fn list_ids(ids: &[VolumeId]) -> String {
    if ids.is_empty() {
        return "none".to_string();
    }
    ids.iter()
        .map(|id| id.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The catalog, `pool.json`, then `devices.json` (the pool exists once they are named).
fn write_directory(dir: &PoolDir, devices: &DevicePaths, catalog: &Catalog) -> anyhow::Result<()> {
    let store = DirCatalog::new(&dir.path);
    store
        .store(catalog)
        .and_then(|()| store.committed(catalog.transaction_id))
        .with_context(|| format!("cannot write the volume catalog in {}", dir.path.display()))?;
    StoredOptions::default().store(dir)?;
    devices
        .store(&dir.path)
        .with_context(|| format!("cannot name the devices in {}", dir.path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_arguments_parse_and_bad_ones_are_refused() {
        let (id, spec) = parse_volume("3:root:20G").unwrap();
        assert_eq!(id, 3);
        assert_eq!(
            spec,
            VolumeSpec {
                name: "root".into(),
                size_bytes: 20 << 30
            }
        );
        for bad in [
            "3:root",
            "x:root:1G",
            "3::1G",
            "3:root:0",
            "3:root:100",
            "3:a/b:1G",
        ] {
            assert!(parse_volume(bad).is_err(), "{bad:?} was accepted");
        }
    }
}
