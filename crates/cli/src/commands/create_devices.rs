//! `thinpool create --metadata-device DEV --data-device DEV`: a pool on two block devices.
//! The pool directory then holds only `devices.json` (naming them), the catalog,
//! `pool.json` and the sockets; sizes come from the devices, which every open claims
//! exclusively (see `thin_pool::block_device`). `create --grow` without a size grows
//! such a pool to its data device's size (after `losetup -c`, `lvextend`, ...).

use anyhow::{bail, Context};
use std::path::PathBuf;
use thin_pool::block_device::{device_size_bytes, DevicePaths};
use thin_pool::Pool;

use crate::control;
use crate::pool_dir::{PoolDir, StoredOptions};
use thinpool_daemon::create::create_pool_with;

/// The block-device arguments of `create`.
#[derive(clap::Args, Debug)]
pub struct DeviceArgs {
    /// Metadata block device (the pool is then made on block devices; sizes come from them).
    #[arg(long = "metadata-device", value_name = "DEV", requires = "data_device")]
    metadata_device: Option<PathBuf>,
    /// Data block device.
    #[arg(long = "data-device", value_name = "DEV", requires = "metadata_device")]
    data_device: Option<PathBuf>,
    /// Open the data device with O_DIRECT (no host page cache; for clients that cache
    /// themselves, such as VMs).
    #[arg(long = "direct-io", requires = "data_device")]
    direct_io: bool,
}

impl DeviceArgs {
    /// The devices named, if any; sizes given beside them are refused (the devices have
    /// theirs).
    pub fn paths(
        &self,
        data_size: &Option<String>,
        metadata_size: &Option<String>,
    ) -> anyhow::Result<Option<DevicePaths>> {
        let (Some(metadata), Some(data)) = (&self.metadata_device, &self.data_device) else {
            return Ok(None);
        };
        if data_size.is_some() || metadata_size.is_some() {
            bail!("--data-size and --metadata-size do not go with block devices: their sizes are the devices'");
        }
        if metadata == data {
            bail!("the metadata and data devices must be two devices");
        }
        Ok(Some(DevicePaths::new(metadata, data, self.direct_io)))
    }
}

/// The size `create --grow` without `--data-size` grows to: the data device's, for a pool
/// on block devices.
pub fn grow_size(dir: &PoolDir, devices: &DeviceArgs) -> anyhow::Result<u64> {
    if devices.metadata_device.is_some() || devices.data_device.is_some() {
        bail!("--grow takes the devices from the pool directory: do not name them");
    }
    data_device_size(dir)
}

/// The size of the data device of the pool in `dir`, for a grow to it (refused for a pool
/// whose data is a file: it needs a size).
pub fn data_device_size(dir: &PoolDir) -> anyhow::Result<u64> {
    dir.require_pool()?;
    let Some(paths) = DevicePaths::load(&dir.path)? else {
        bail!(
            "growing the pool in {} needs --data-size: its data is a file",
            dir.path.display()
        );
    };
    // A plain open: the serving process holds the exclusive claim.
    let file = std::fs::File::open(&paths.data_device)
        .with_context(|| format!("cannot open {}", paths.data_device.display()))?;
    device_size_bytes(&file).with_context(|| format!("cannot size {}", paths.data_device.display()))
}

/// Creates a pool on `devices` recorded in a private directory, and its options file;
/// returns its status.
pub fn create_device_pool(
    dir: &PoolDir,
    devices: &DevicePaths,
    block_size_bytes: u64,
    stored: StoredOptions,
) -> anyhow::Result<control::StatusRecord> {
    let options = stored.pool_options();
    create_pool_with(dir, stored, |path| {
        let pool = Pool::create_on_devices(path, devices, block_size_bytes, options).with_context(
            || {
                format!(
                    "cannot create a pool on {} and {}",
                    devices.metadata_device.display(),
                    devices.data_device.display()
                )
            },
        )?;
        for event in pool.events() {
            eprintln!("thinpool: {event}");
        }
        Ok(pool)
    })
}
