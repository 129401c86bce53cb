//! `thinpool-bench --metadata-device DEV --data-device DEV`: the read comparisons on a pool
//! on block devices (a loop device, a disk), against `pread` of the same data device.
//!
//! Each section's pool is made afresh on the same two devices: the metadata device's
//! superblock is wiped first (the devices are the benchmark's to overwrite: say so in the
//! help), and the pool directory in the scratch directory names them. The data device must
//! hold what the section writes (`--quick`: 160 MiB; else 2.1 GiB).

use super::dir::BenchDir;
use anyhow::{bail, Context};
use persistent_data::{BlockDevice, MetadataBlock};
use std::path::PathBuf;
use thin_pool::block_device::{device_size_bytes, open_metadata_device, DevicePaths};
use thin_pool::{Pool, PoolOptions};

/// Creates the pool `name` on `devices`, wiping the metadata device's superblock first.
pub(crate) fn create_pool_on(
    dir: &BenchDir,
    devices: &DevicePaths,
    name: &str,
    data_size_bytes: u64,
    block_size_bytes: u64,
) -> anyhow::Result<Pool> {
    let data = std::fs::File::open(&devices.data_device)
        .with_context(|| format!("opening {}", devices.data_device.display()))?;
    let size = device_size_bytes(&data)?;
    if size < data_size_bytes {
        bail!(
            "{} holds {size} bytes; this section needs {data_size_bytes}",
            devices.data_device.display()
        );
    }
    drop(data);
    let metadata = open_metadata_device(&devices.metadata_device, true)?;
    metadata
        .write(
            MetadataBlock::new(0),
            &persistent_data::block::zeroed_block(),
        )
        .and_then(|()| metadata.flush())
        .with_context(|| format!("wiping {}", devices.metadata_device.display()))?;
    drop(metadata);
    let path = dir.pool_path(name);
    Pool::create_on_devices(&path, devices, block_size_bytes, PoolOptions::default())
        .with_context(|| format!("creating a pool on {}", devices.data_device.display()))
}

/// The data the `pread` baseline reads: the data device.
pub(crate) fn data_path(devices: &DevicePaths) -> PathBuf {
    devices.data_device.clone()
}
