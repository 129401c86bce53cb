//! Making and opening a pool: the limits a create checks before it makes a file, the files
//! of a pool directory, and [`assemble`], which opens the metadata, checks it against the
//! catalog and the data device, builds the owners bottom-up (health, watch, registry, the
//! metadata owner, the provisioner) and starts the workers (commit, autoextend) with
//! handles to them. `Pool` (the façade) holds the result, [`Owners`].

use crate::engine::autoextend::{Autoextender, Grower};
use crate::engine::catalog::{Catalog, CatalogStore};
use crate::engine::catalog_dir::DirCatalog;
use crate::engine::committer::Committer;
use crate::engine::data_device::{DataDevice, FileDataDevice};
use crate::engine::directory::PoolDirectory;
use crate::engine::grace::Readers;
use crate::engine::health::Health;
use crate::engine::index::INDEX_DATA_BLOCK_MAX;
use crate::engine::layout::{DATA_FILE, METADATA_FILE};
use crate::engine::limits::{
    data_grow_metadata_blocks, metadata_blocks_for_ops, metadata_reserve_blocks,
};
use crate::engine::load::{check_before_writing, check_catalog, load_volumes};
use crate::engine::meta::Meta;
use crate::engine::meta_state::MetaParts;
use crate::engine::options::{CreateOptions, PoolMode, PoolOptions};
use crate::engine::provision::{ProvisionParts, Provisioner};
use crate::engine::space::{host_free_bytes, SpaceWatch};
use crate::engine::volumes::Volumes;
use crate::error::{io_error, Error, Limit, Result};
use crate::format::metadata::PoolMetadata;
use persistent_data::space_map::METADATA_BLOCKS_MAX;
use persistent_data::{BlockDevice, FileDevice};
use std::path::Path;
use std::sync::Arc;

/// Everything an open pool is made of: the owners and the workers' handles.
pub(crate) struct Owners {
    pub(crate) meta: Arc<Meta>,
    pub(crate) volumes: Arc<Volumes>,
    pub(crate) provisioner: Provisioner,
    pub(crate) watch: Arc<SpaceWatch>,
    pub(crate) health: Arc<Health>,
    pub(crate) data: Arc<dyn DataDevice>,
    pub(crate) options: Arc<PoolOptions>,
    pub(crate) committer: Committer,
    pub(crate) autoextender: Autoextender,
}

/// A default metadata size for a data size: four times thin_metadata_size's estimate for
/// 1000 volumes, at least 4 MiB, at most the format's 15.87 GiB.
pub fn default_metadata_size_bytes(data_size_bytes: u64, block_size_bytes: u64) -> u64 {
    let estimate = crate::format::metadata_size::estimate(&crate::format::metadata_size::Request {
        data_block_size_bytes: block_size_bytes,
        pool_size_bytes: data_size_bytes.max(block_size_bytes),
        thin_count_max: 1000,
    })
    .unwrap_or(4 << 20);
    (estimate * 4).clamp(4 << 20, METADATA_BLOCKS_MAX * 4096)
}

/// What a checked create makes.
pub(crate) struct Layout {
    pub(crate) block_size_bytes: u64,
    pub(crate) data_blocks: u64,
    pub(crate) metadata_blocks: u64,
}

/// Every limit of a create in `dir`, checked before a file is made: the block size, a data
/// size the index and the format address, a metadata size within the format that can hold
/// the data space map beside the reserve, and room on the host file system for the
/// (preallocated) metadata.
pub(crate) fn check_create(dir: &Path, create: &CreateOptions) -> Result<Layout> {
    let block_size = create.block_size_bytes;
    if !block_size.is_multiple_of(512)
        || !crate::format::superblock::valid_data_block_size(
            (block_size / 512).try_into().unwrap_or(0),
        )
    {
        return Err(Error::BadBlockSize { bytes: block_size });
    }
    let data_blocks = create.data_size_bytes / block_size;
    if data_blocks == 0 {
        return Err(Error::DataSmallerThanBlock {
            data_bytes: create.data_size_bytes,
            block_size_bytes: block_size,
        });
    }
    if data_blocks > INDEX_DATA_BLOCK_MAX + 1 {
        return Err(Error::SizeOverLimit {
            what: Limit::DataBlocks {
                size_bytes: create.data_size_bytes,
            },
            requested: data_blocks,
            max: INDEX_DATA_BLOCK_MAX + 1,
        });
    }
    let metadata_bytes = create
        .metadata_size_bytes
        .unwrap_or_else(|| default_metadata_size_bytes(create.data_size_bytes, block_size));
    let metadata_blocks = metadata_bytes / 4096;
    check_metadata_size(metadata_bytes, metadata_blocks, data_blocks)?;
    std::fs::create_dir_all(dir).map_err(io_error(format!("creating {}", dir.display())))?;
    if dir.join(METADATA_FILE).exists() {
        return Err(Error::PoolExists {
            path: dir.display().to_string(),
        });
    }
    if let Some(free) = host_free_bytes(dir) {
        if free < metadata_bytes {
            return Err(Error::HostFull {
                path: dir.display().to_string(),
                free_bytes: free,
                needed_bytes: metadata_bytes,
            });
        }
    }
    Ok(Layout {
        block_size_bytes: block_size,
        data_blocks,
        metadata_blocks,
    })
}

/// A metadata size within the format that holds the data space map beside the reserve.
fn check_metadata_size(metadata_bytes: u64, metadata_blocks: u64, data_blocks: u64) -> Result<()> {
    if metadata_blocks > METADATA_BLOCKS_MAX {
        return Err(Error::SizeOverLimit {
            what: Limit::MetadataBytes,
            requested: metadata_bytes,
            max: METADATA_BLOCKS_MAX * 4096,
        });
    }
    crate::engine::limits::check_metadata_room(metadata_blocks, data_blocks)
}

/// The files of a checked create in `dir`: the metadata (preallocated, locked, formatted),
/// the sparse data file and the empty catalog. A failure removes what it made.
pub(crate) fn create_files(
    dir: &Path,
    layout: &Layout,
) -> Result<(Arc<dyn BlockDevice>, Arc<dyn DataDevice>)> {
    let metadata_path = dir.join(METADATA_FILE);
    let data_path = dir.join(DATA_FILE);
    let made = (|| {
        let metadata = FileDevice::create(&metadata_path, layout.metadata_blocks).map_err(
            io_error(format!(
                "creating and preallocating {} ({} bytes)",
                metadata_path.display(),
                layout.metadata_blocks * 4096
            )),
        )?;
        lock_exclusive(metadata.file(), &metadata_path)?;
        let data = FileDataDevice::create(&data_path, layout.data_blocks * layout.block_size_bytes)
            .map_err(io_error(format!("creating {}", data_path.display())))?;
        let metadata: Arc<dyn BlockDevice> = Arc::new(metadata);
        let data: Arc<dyn DataDevice> = Arc::new(data);
        format(
            &metadata,
            &data,
            &DirCatalog::new(dir),
            layout.block_size_bytes,
        )?;
        Ok((metadata, data))
    })();
    if made.is_err() {
        let _ = std::fs::remove_file(&metadata_path);
        let _ = std::fs::remove_file(&data_path);
    }
    made
}

/// Format new metadata on `metadata` for `data` and store the empty catalog.
pub(crate) fn format(
    metadata: &Arc<dyn BlockDevice>,
    data: &Arc<dyn DataDevice>,
    catalog: &dyn CatalogStore,
    block_size_bytes: u64,
) -> Result<()> {
    let data_blocks = data.size_bytes() / block_size_bytes;
    let md = PoolMetadata::format(
        metadata.clone(),
        (block_size_bytes / 512) as u32,
        data_blocks,
    )?;
    catalog.store(&Catalog {
        transaction_id: md.transaction_id().get(),
        volumes: vec![],
        partial: Vec::new(),
    })?;
    Ok(())
}

/// A pool directory's files, opened: metadata, data, and the metadata's lock.
pub(crate) type OpenedFiles = (
    Arc<dyn BlockDevice>,
    Arc<dyn DataDevice>,
    Arc<std::fs::File>,
);

/// The files of the pool in `dir` (held open: each file is opened relative to it, never
/// through a link), opened, the metadata locked (the lock is the returned file).
pub(crate) fn open_files(dir: &PoolDirectory, options: &PoolOptions) -> Result<OpenedFiles> {
    let metadata_path = dir.shown(METADATA_FILE);
    let metadata = dir
        .open_file(METADATA_FILE, !options.read_only)
        .and_then(|file| FileDevice::from_file(file, &metadata_path))
        .map_err(io_error(format!("opening {}", metadata_path.display())))?;
    let lock = Arc::new(
        metadata
            .file()
            .try_clone()
            .map_err(io_error(format!("opening {}", metadata_path.display())))?,
    );
    lock_exclusive(&lock, &metadata_path)?;
    let data_path = dir.shown(DATA_FILE);
    let data = dir
        .open_file(DATA_FILE, true)
        .and_then(|file| FileDataDevice::from_file(file, &data_path))
        .map_err(io_error(format!("opening {}", data_path.display())))?;
    Ok((Arc::new(metadata), Arc::new(data), lock))
}

fn lock_exclusive(file: &std::fs::File, path: &Path) -> Result<()> {
    crate::owner::lock_exclusive(file, path)
}

/// Open the metadata on `metadata` for I/O on `data`: check it, build the owners, start the
/// workers.
pub(crate) fn assemble(
    metadata: Arc<dyn BlockDevice>,
    data: Arc<dyn DataDevice>,
    catalog_store: Box<dyn CatalogStore>,
    options: PoolOptions,
) -> Result<Owners> {
    let opened = open_checked(&metadata, &*data, &*catalog_store, &options)?;
    let Opened {
        md,
        catalog,
        mode,
        unrecorded,
        volumes,
    } = opened;
    let block_size_bytes = u64::from(md.data_block_size_sectors()) * 512;
    let options = Arc::new(options);
    let health = Arc::new(Health::new(mode, options.read_only));
    let watch = Arc::new(SpaceWatch::new(&options, health.clone()));
    let volumes = Arc::new(Volumes::new(volumes));
    let readers = Arc::new(Readers::default());
    let parts = MetaParts {
        device: metadata,
        data: data.clone(),
        block_size_bytes,
        options: options.clone(),
        catalog_store,
        volumes: volumes.clone(),
        readers: readers.clone(),
        watch: watch.clone(),
        health: health.clone(),
        space: Default::default(),
        durations: Default::default(),
    };
    let meta = Arc::new(Meta::new(parts, md, catalog)?);
    if let Some(event) = unrecorded {
        health.log(event);
    }
    let provisioner = Provisioner::new(ProvisionParts {
        meta: meta.clone(),
        data: data.clone(),
        options: options.clone(),
        readers,
        watch: watch.clone(),
        health: health.clone(),
    });
    let grower = Grower {
        meta: Arc::downgrade(&meta),
        watch: watch.clone(),
        data: data.clone(),
        health: health.clone(),
        options: options.clone(),
    };
    assert_eq!(health.mode(), mode, "the pool opens in the mode it chose");
    let (committer, autoextender) = start_workers(grower, mode != PoolMode::ReadOnly)?;
    Ok(Owners {
        meta,
        volumes,
        provisioner,
        watch,
        health,
        data,
        options,
        committer,
        autoextender,
    })
}

/// What an open read and checked, before the owners are built.
struct Opened {
    md: PoolMetadata,
    catalog: Catalog,
    mode: PoolMode,
    /// An event saying the data device holds more than the metadata could record.
    unrecorded: Option<String>,
    volumes: std::collections::BTreeMap<String, Arc<crate::engine::volumes::VolumeState>>,
}

/// Open and check the metadata: the checker before a read-write open, the catalog against
/// the metadata, the data device, every volume's tree (`load`).
fn open_checked(
    metadata: &Arc<dyn BlockDevice>,
    data: &dyn DataDevice,
    catalog_store: &dyn CatalogStore,
    options: &PoolOptions,
) -> Result<Opened> {
    if !options.read_only && !options.skip_check {
        check_before_writing(metadata, data.size_bytes())?;
    }
    let mut md = PoolMetadata::open(metadata.clone())?;
    let block_size_bytes = u64::from(md.data_block_size_sectors()) * 512;
    let transaction_id = md.transaction_id().get();
    let catalog = catalog_store.load(transaction_id)?;
    // A catalog newer than the metadata is a change that never committed: forget it (a
    // read-only open writes nothing, so leaves it for the next read-write one).
    if !options.read_only {
        catalog_store.committed(transaction_id)?;
    }
    check_catalog(&catalog)?;
    let (mode, unrecorded) = take_data_device(&mut md, data, options)?;
    let volumes = load_volumes(&md, &catalog, block_size_bytes, mode != PoolMode::ReadOnly)?;
    assert_eq!(
        volumes.len(),
        catalog.volumes.len() - catalog.orphaned(&md.volumes()).len(),
        "one state per volume the catalog and the metadata both hold"
    );
    assert!(
        volumes.values().all(|v| v.loaded_index().is_none()),
        "no index at activation"
    );
    Ok(Opened {
        md,
        catalog,
        mode,
        unrecorded,
        volumes,
    })
}

/// Start the commit and autoextend workers of a pool (none on a read-only one), with
/// handles to the owners `grower` names.
fn start_workers(grower: Grower, writable: bool) -> Result<(Committer, Autoextender)> {
    let meta = grower
        .meta
        .upgrade()
        .expect("the pool holds the metadata owner");
    let interval = grower.options.commit_interval.filter(|_| writable);
    let committer = Committer::start(&meta, &grower.health, interval)?;
    Ok((committer, Autoextender::start(grower, writable)?))
}

/// The mode to open in, and the data device taken: refused if it shrank; grown outside the
/// pool, take what the metadata can record, as `grow_data` would; the rest waits for a
/// metadata grow (never a failed open), said by the returned event.
fn take_data_device(
    md: &mut PoolMetadata,
    data: &dyn DataDevice,
    options: &PoolOptions,
) -> Result<(PoolMode, Option<String>)> {
    let block_size_bytes = u64::from(md.data_block_size_sectors()) * 512;
    let data_blocks = data.size_bytes() / block_size_bytes;
    let recorded = md.data_space_map().block_count();
    if data_blocks < recorded {
        return Err(Error::DataDeviceShrank {
            device_blocks: data_blocks,
            recorded_blocks: recorded,
        });
    }
    if options.read_only || md.needs_check() {
        return Ok((PoolMode::ReadOnly, None));
    }
    if data_blocks == recorded {
        return Ok((PoolMode::Write, None));
    }
    let usage = md.usage();
    let total = usage.metadata_total_blocks;
    let free = total - usage.metadata_used_blocks;
    let usable = data_blocks.min(INDEX_DATA_BLOCK_MAX + 1);
    let cost = data_grow_metadata_blocks(recorded, usable);
    if cost + metadata_reserve_blocks(total) + metadata_blocks_for_ops(0) <= free {
        md.extend_data(usable)?;
        md.commit()?;
        return Ok((PoolMode::Write, None));
    }
    Ok((
        PoolMode::Write,
        Some(format!(
            "the data device holds {data_blocks} blocks, the pool uses its first {recorded}: recording the rest needs {cost} metadata blocks, {free} of {total} are free; grow the metadata, then the data"
        )),
    ))
}
