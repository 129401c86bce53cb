//! The pool handle: create, open and close a pool, and read its state (status, volume
//! list, events). Management operations are in `manage`, commits in `commit`, volume I/O in
//! `volume` (through `provision`), the commit thread in `committer`.
//!
//! Threads and locks:
//!
//! - **Reads and overwrites** of provisioned, unshared blocks consult the volume's lock-free
//!   [`Index`](crate::engine::index::Index) and do positional I/O on the caller's thread. They pass the volume's
//!   write gate (writes only; a per-thread counter, not a lock).
//! - **Provisioning** (first write, breaking sharing) is ordered per virtual block by one of
//!   the volume's hashed block locks, reserves a data block in the metadata (a short
//!   critical section), writes the data outside any pool lock, then queues an insert and
//!   publishes the mapping in the index.
//! - **Commit** (periodic, on flush/FUA, on every management operation) takes the queued
//!   operations present when it starts, flushes the data device (so their data is durable),
//!   applies them to the btrees and commits the metadata. Operations queued during the flush
//!   wait for the next commit; their data blocks stay reserved, outside the committed space
//!   map, so a crash never leaves a mapping without its data nor a leaked block. Commits
//!   never block reads.
//! - **Snapshots** pause only the origin's writers (its gate), commit, share the origin's
//!   mapping root in the metadata (O(1)); the snapshot gets no index until it is used.
//! - **Indexes** are built on demand: activation builds none; the first [`Pool::volume`] of
//!   a volume walks its mapping tree under the commit lock (`Shared::index`). Memory goes
//!   to the volumes in use, not to every snapshot.
//!
//! Modes follow dm-thin (spec §10.5): `Write`, `OutOfDataSpace` (writes that need a block
//! error with ENOSPC or wait up to the no-space timeout for growth), `OutOfMetadataSpace`
//! (no metadata changes until the metadata device grows), `ReadOnly` (option, or after a
//! metadata error, with needs_check set) and `Fail`.

use crate::engine::autoextend::SpaceWatch;
use crate::engine::catalog::{Catalog, CatalogStore, DirCatalog};
use crate::engine::commit::{metadata_blocks_for_ops, metadata_reserve_blocks};
use crate::engine::committer::Committer;
use crate::engine::data_device::{DataDevice, FileDataDevice};
use crate::engine::index::INDEX_DATA_BLOCK_MAX;
use crate::engine::load::{check_before_writing, check_catalog, load_volumes};
use crate::engine::manage::data_grow_metadata_blocks;
use crate::engine::provision::Provisioner;
use crate::engine::shared::{io_error, MetaState, Shared, VolumeState};
use crate::engine::stats::CommitStats;
use crate::engine::volume::Volume;
use crate::error::{Error, Result};
use crate::format::metadata::PoolMetadata;
use crate::ids::{VirtualBlock, VolumeId};
use persistent_data::space_map::core::ENTRIES_PER_BITMAP;
use persistent_data::space_map::METADATA_BLOCKS_MAX;
use persistent_data::{BlockDevice, FileDevice};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

pub use crate::engine::options::{CreateOptions, PoolMode, PoolOptions, PoolStatus, VolumeInfo};

/// File names inside a pool directory.
pub const METADATA_FILE: &str = "metadata";
/// The data file inside a pool directory.
pub const DATA_FILE: &str = "data";

/// Default data block size: 64 KiB.
pub const BLOCK_SIZE_DEFAULT_BYTES: u64 = 64 * 1024;

/// A thin pool, open for I/O and management. Cheap to clone (shared state).
#[derive(Clone)]
pub struct Pool {
    pub(crate) shared: Arc<Shared>,
    committer: Arc<Committer>,
    _lock_file: Option<Arc<std::fs::File>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("block_size_bytes", &self.shared.block_size_bytes)
            .finish()
    }
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
    (estimate * 4).clamp(
        4 << 20,
        persistent_data::space_map::METADATA_BLOCKS_MAX * 4096,
    )
}

/// Bytes an unprivileged writer may still allocate on the file system holding `path` (or its
/// nearest existing ancestor), if the file system says.
pub fn host_free_bytes(path: &Path) -> Option<u64> {
    let existing = path.ancestors().find(|p| p.exists())?;
    let stat = rustix::fs::statvfs(existing).ok()?;
    Some(stat.f_bavail.saturating_mul(stat.f_frsize))
}

fn lock_exclusive(file: &std::fs::File, path: &Path) -> Result<()> {
    crate::owner::lock_exclusive(file, path)
}

impl Pool {
    /// Create a pool in directory `dir` (created if missing; must not hold a pool): files
    /// `metadata` and `data`, and the volume catalog. Returns it open.
    ///
    /// Every limit is checked before a file is made: the block size, a data size the index
    /// and the format address, a metadata size within the format that can hold the data
    /// space map beside the reserve, and room on the host file system for the metadata. The
    /// metadata file is preallocated (so a full host file system cannot fail a commit); the
    /// data file is sparse, as thin provisioning intends (a host ENOSPC on it reaches the
    /// writer as ENOSPC). A failed create removes what it made.
    pub fn create(dir: &Path, create: &CreateOptions, options: PoolOptions) -> Result<Pool> {
        let block_size = create.block_size_bytes;
        if !block_size.is_multiple_of(512)
            || !crate::format::superblock::valid_data_block_size(
                (block_size / 512).try_into().unwrap_or(0),
            )
        {
            return Err(Error::Invalid(format!(
                "block size {block_size} bytes: must be a multiple of 64 KiB from 64 KiB to 1 GiB"
            )));
        }
        let data_blocks = create.data_size_bytes / block_size;
        if data_blocks == 0 {
            return Err(Error::Invalid(format!(
                "data size {} bytes is smaller than one {block_size}-byte block",
                create.data_size_bytes
            )));
        }
        if data_blocks > INDEX_DATA_BLOCK_MAX + 1 {
            return Err(Error::Invalid(format!(
                "data size {} bytes is {data_blocks} blocks: a pool holds at most {}",
                create.data_size_bytes,
                INDEX_DATA_BLOCK_MAX + 1
            )));
        }
        let metadata_bytes = create
            .metadata_size_bytes
            .unwrap_or_else(|| default_metadata_size_bytes(create.data_size_bytes, block_size));
        let metadata_blocks = metadata_bytes / 4096;
        if metadata_blocks < 64 {
            return Err(Error::Invalid(format!(
                "metadata size {metadata_bytes} bytes: at least 256 KiB"
            )));
        }
        if metadata_blocks > METADATA_BLOCKS_MAX {
            return Err(Error::Invalid(format!(
                "metadata size {metadata_bytes} bytes: the format addresses at most {} bytes",
                METADATA_BLOCKS_MAX * 4096
            )));
        }
        let space_map = data_grow_metadata_blocks(0, data_blocks);
        let reserve = metadata_reserve_blocks(metadata_blocks);
        // The superblock, the empty trees and the metadata space map's own blocks.
        let formatted = 8 + metadata_blocks.div_ceil(ENTRIES_PER_BITMAP);
        if space_map + reserve + formatted > metadata_blocks {
            return Err(Error::Invalid(format!(
                "metadata of {metadata_blocks} blocks cannot map {data_blocks} data blocks: their space map needs {space_map} metadata blocks, {reserve} stay reserved and {formatted} hold the rest"
            )));
        }
        std::fs::create_dir_all(dir).map_err(io_error(format!("creating {}", dir.display())))?;
        let metadata_path = dir.join(METADATA_FILE);
        if metadata_path.exists() {
            return Err(Error::Invalid(format!(
                "{} already holds a pool",
                dir.display()
            )));
        }
        if let Some(free) = host_free_bytes(dir) {
            if free < metadata_bytes {
                return Err(Error::Invalid(format!(
                    "{}: the host file system has {free} bytes free, the metadata needs {metadata_bytes} (it is preallocated)",
                    dir.display()
                )));
            }
        }
        let data_path = dir.join(DATA_FILE);
        let made = Pool::create_files(dir, block_size, data_blocks, metadata_blocks, options);
        if made.is_err() {
            let _ = std::fs::remove_file(&metadata_path);
            let _ = std::fs::remove_file(&data_path);
        }
        made
    }

    /// The files of [`Pool::create`], its limits checked.
    fn create_files(
        dir: &Path,
        block_size: u64,
        data_blocks: u64,
        metadata_blocks: u64,
        options: PoolOptions,
    ) -> Result<Pool> {
        let metadata_path = dir.join(METADATA_FILE);
        let metadata =
            FileDevice::create(&metadata_path, metadata_blocks).map_err(io_error(format!(
                "creating and preallocating {} ({} bytes)",
                metadata_path.display(),
                metadata_blocks * 4096
            )))?;
        lock_exclusive(metadata.file(), &metadata_path)?;
        let data_path = dir.join(DATA_FILE);
        let data = FileDataDevice::create(&data_path, data_blocks * block_size)
            .map_err(io_error(format!("creating {}", data_path.display())))?;
        let metadata: Arc<dyn BlockDevice> = Arc::new(metadata);
        let md = PoolMetadata::format(metadata.clone(), (block_size / 512) as u32, data_blocks)?;
        let catalog = DirCatalog::new(dir);
        catalog.store(&Catalog {
            transaction_id: md.transaction_id().get(),
            volumes: vec![],
        })?;
        drop(md);
        let pool = Pool::open_parts(metadata, Arc::new(data), Box::new(catalog), options, None)?;
        pool.shared.watch.set_host_dir(dir.to_path_buf());
        Ok(pool)
    }

    /// Open the pool in directory `dir`, taking an exclusive lock on its metadata.
    /// A directory that names block devices (`devices.json`) opens the pool on them
    /// ([`Pool::open_devices`]).
    pub fn open(dir: &Path, options: PoolOptions) -> Result<Pool> {
        if let Some(devices) = crate::engine::block_device::DevicePaths::load(dir)? {
            return Pool::open_devices(dir, &devices, options);
        }
        let metadata_path = dir.join(METADATA_FILE);
        let metadata = FileDevice::open_no_follow(&metadata_path, !options.read_only)
            .map_err(io_error(format!("opening {}", metadata_path.display())))?;
        let lock = Arc::new(
            metadata
                .file()
                .try_clone()
                .map_err(io_error(format!("opening {}", metadata_path.display())))?,
        );
        lock_exclusive(&lock, &metadata_path)?;
        let data_path = dir.join(DATA_FILE);
        let data = FileDataDevice::open(&data_path)
            .map_err(io_error(format!("opening {}", data_path.display())))?;
        let pool = Pool::open_parts(
            Arc::new(metadata),
            Arc::new(data),
            Box::new(DirCatalog::new(dir)),
            options,
            Some(lock),
        )?;
        pool.shared.watch.set_host_dir(dir.to_path_buf());
        Ok(pool)
    }

    /// Whether `dir` holds a pool.
    pub fn exists(dir: &Path) -> bool {
        dir.join(METADATA_FILE).exists()
            || dir.join(crate::engine::block_device::DEVICES_FILE).exists()
    }

    /// Format new metadata on `metadata`, for `data`, and open the pool (for tests and
    /// embedders with their own devices).
    pub fn format_parts(
        metadata: Arc<dyn BlockDevice>,
        data: Arc<dyn DataDevice>,
        catalog: Box<dyn CatalogStore>,
        block_size_bytes: u64,
        options: PoolOptions,
    ) -> Result<Pool> {
        let data_blocks = data.size_bytes() / block_size_bytes;
        let md = PoolMetadata::format(
            metadata.clone(),
            (block_size_bytes / 512) as u32,
            data_blocks,
        )?;
        catalog.store(&Catalog {
            transaction_id: md.transaction_id().get(),
            volumes: vec![],
        })?;
        drop(md);
        Pool::open_parts(metadata, data, catalog, options, None)
    }

    /// Open a pool on given devices.
    pub fn open_parts(
        metadata: Arc<dyn BlockDevice>,
        data: Arc<dyn DataDevice>,
        catalog_store: Box<dyn CatalogStore>,
        options: PoolOptions,
        lock: Option<Arc<std::fs::File>>,
    ) -> Result<Pool> {
        if !options.read_only && !options.skip_check {
            check_before_writing(&metadata, data.size_bytes())?;
        }
        let mut md = PoolMetadata::open(metadata.clone())?;
        let block_size_bytes = u64::from(md.data_block_size_sectors()) * 512;
        let transaction_id = md.transaction_id().get();
        let catalog = catalog_store.load(transaction_id)?;
        // A catalog newer than the metadata is a change that never committed: forget it
        // (a read-only open writes nothing, so leaves it for the next read-write one).
        if !options.read_only {
            catalog_store.committed(transaction_id)?;
        }
        check_catalog(&md, &catalog)?;
        let data_blocks = data.size_bytes() / block_size_bytes;
        let recorded = md.data_space_map().block_count();
        if data_blocks < recorded {
            return Err(Error::Invalid(format!(
                "data device holds {data_blocks} blocks, the pool records {recorded}: it shrank"
            )));
        }
        let mut mode = PoolMode::Write;
        let mut unrecorded = None;
        if options.read_only || md.needs_check() {
            mode = PoolMode::ReadOnly;
        } else if data_blocks > recorded {
            // A data device grown outside the pool: take what the metadata can record, as
            // `grow_data` would; the rest waits for a metadata grow (never a failed open).
            let usage = md.usage();
            let total = usage.metadata_total_blocks;
            let free = total - usage.metadata_used_blocks;
            let usable = data_blocks.min(INDEX_DATA_BLOCK_MAX + 1);
            let cost = data_grow_metadata_blocks(recorded, usable);
            if cost + metadata_reserve_blocks(total) + metadata_blocks_for_ops(0) <= free {
                md.extend_data(usable)?;
                md.commit()?;
            } else {
                unrecorded = Some(format!(
                    "the data device holds {data_blocks} blocks, the pool uses its first {recorded}: recording the rest needs {cost} metadata blocks, {free} of {total} are free; grow the metadata, then the data"
                ));
            }
        }
        let time = md.pool_time()?;
        let volumes = load_volumes(&md, &catalog, block_size_bytes, mode != PoolMode::ReadOnly)?;
        let shared = Arc::new(Shared::new(
            data,
            metadata,
            block_size_bytes,
            options.clone(),
            MetaState::new(md, catalog),
            volumes,
            mode,
            time,
            catalog_store,
        ));
        if let Some(event) = unrecorded {
            shared.log(event);
        }
        let interval = options
            .commit_interval
            .filter(|_| mode != PoolMode::ReadOnly);
        let committer = Committer::start(&shared, interval)?;
        if mode != PoolMode::ReadOnly {
            SpaceWatch::start(&shared)?;
        }
        Ok(Pool {
            shared,
            committer: Arc::new(committer),
            _lock_file: lock,
        })
    }

    /// Data block size in bytes.
    pub fn block_size_bytes(&self) -> u64 {
        self.shared.block_size_bytes
    }

    /// The data device (for benchmarks reading its counters).
    pub fn data_device(&self) -> &Arc<dyn DataDevice> {
        &self.shared.data
    }

    /// Current mode.
    pub fn mode(&self) -> PoolMode {
        self.shared.mode()
    }

    /// Events logged so far (low water mark, mode changes), oldest first.
    pub fn events(&self) -> Vec<String> {
        self.shared.events()
    }

    /// Open a volume by name for I/O. Refused (busy) while a delete of it is under way:
    /// a delete that succeeds leaves no handle behind. The first open of a volume since
    /// activation (or its snapshot or revert) builds its index from its mapping tree,
    /// holding the commit lock for that walk (commits and management operations wait, I/O
    /// goes on); an error there (a tree that breaks a rule) refuses the open.
    pub fn volume(&self, name: &str) -> Result<Volume> {
        let state = self.shared.volume_named(name)?;
        let shared = &self.shared;
        Volume::open(Provisioner::new(shared.clone()), state, |state| {
            shared.index(state).cloned()
        })
    }

    /// Every volume, in name order. A volume's mapped blocks come from its index when it has
    /// one (every mapping, committed or queued), else from its details in the metadata (it
    /// has no queued mapping then): listing builds no index.
    pub fn list(&self) -> Vec<VolumeInfo> {
        self.infos(None)
    }

    /// Information about one volume (as [`Pool::list`] gives it, counting only its own
    /// mappings).
    pub fn info(&self, name: &str) -> Result<VolumeInfo> {
        self.infos(Some(name))
            .pop()
            .ok_or_else(|| Error::NoSuchVolume(name.to_string()))
    }

    /// [`Pool::list`], of one volume or all.
    fn infos(&self, only: Option<&str>) -> Vec<VolumeInfo> {
        let wanted = |v: &VolumeState| only.is_none_or(|name| v.name == name);
        let needs_details = self
            .shared
            .volumes
            .load()
            .values()
            .any(|v| wanted(v) && v.loaded_index().is_none());
        // Read under the lock that publishes volumes and sets indexes, so a volume without
        // an index then is counted from its tree's details, and one built since from its
        // index (after the lock is released: counting an index takes no lock). With no
        // metadata (fail mode) a volume without an index lists 0 mapped blocks.
        let (volumes, from_details) = {
            let meta = needs_details.then(|| self.shared.lock_meta());
            let volumes = self.shared.volumes.load_full();
            let from_details: HashMap<VolumeId, u64> = meta
                .as_ref()
                .and_then(|meta| meta.md.as_ref())
                .map(|md| {
                    volumes
                        .values()
                        .filter(|v| wanted(v) && v.loaded_index().is_none())
                        .filter_map(|v| Some((v.id, md.details(v.id).ok()?.mapped_blocks)))
                        .collect()
                })
                .unwrap_or_default();
            (volumes, from_details)
        };
        let mapped_blocks = |v: &VolumeState| match from_details.get(&v.id) {
            Some(&mapped) => mapped,
            None => v.loaded_index().map_or(0, |index| index.mapped_count()),
        };
        let names: HashMap<VolumeId, &str> =
            volumes.values().map(|v| (v.id, v.name.as_str())).collect();
        volumes
            .values()
            .filter(|v| wanted(v))
            .map(|v| VolumeInfo {
                name: v.name.clone(),
                id: v.id,
                size_bytes: v.size_bytes.load(Ordering::Acquire),
                mapped_blocks: mapped_blocks(v),
                block_size_bytes: self.shared.block_size_bytes,
                origin: v
                    .origin()
                    .and_then(|id| names.get(&id))
                    .map(|name| name.to_string()),
                origin_id: v.origin().filter(|id| names.contains_key(id)),
                read_only: v.read_only.load(Ordering::Acquire),
                open_count: v.open_count(),
            })
            .collect()
    }

    /// Whether `name`'s index is built (tests and benchmarks: a volume gets one on its first
    /// open, see [`Pool::volume`]).
    pub fn index_built(&self, name: &str) -> Result<bool> {
        Ok(self.shared.volume_named(name)?.loaded_index().is_some())
    }

    /// The pool's status (commits nothing).
    pub fn status(&self) -> PoolStatus {
        let volume_count = self.shared.volumes.load().len();
        let meta = self.shared.lock_meta();
        let (usage, transaction_id, snap, needs_check) = match &meta.md {
            Some(md) => (
                Some(md.usage()),
                md.transaction_id().get(),
                md.metadata_snap().map(|b| b.get()),
                md.needs_check(),
            ),
            None => (None, meta.catalog.transaction_id, None, true),
        };
        let mode = self.shared.mode();
        PoolStatus {
            transaction_id,
            metadata_used_blocks: usage.map_or(0, |u| u.metadata_used_blocks),
            metadata_total_blocks: usage.map_or(0, |u| u.metadata_total_blocks),
            data_used_blocks: usage.map_or(0, |u| u.data_used_blocks),
            data_total_blocks: usage.map_or(0, |u| u.data_total_blocks),
            block_size_bytes: self.shared.block_size_bytes,
            metadata_snap: snap,
            mode,
            fail_reason: self.shared.fail_reason(),
            needs_check: needs_check
                || (mode == PoolMode::ReadOnly && !self.shared.options.read_only),
            discard_passdown: self.shared.options.discard_passdown,
            error_if_no_space: self.shared.options.error_if_no_space,
            low_water_reached: self.shared.watch.data_low_water.load(Ordering::Acquire),
            metadata_low_water_reached: self
                .shared
                .watch
                .metadata_low_water
                .load(Ordering::Acquire),
            low_water_percent: self.shared.options.low_water_percent,
            autoextend: self.shared.options.autoextend,
            no_space_timeout: self.shared.options.no_space_timeout,
            data_bytes_passed_down: self.shared.watch.passed_down_bytes.load(Ordering::Relaxed),
            volume_count,
        }
    }

    /// Commits since the pool opened, and how long they took (a snapshot of lock-free
    /// counters: takes no lock, commits nothing).
    pub fn commit_stats(&self) -> CommitStats {
        let durations = self.shared.commit_counters.durations.snapshot();
        CommitStats {
            commit_count: durations.count(),
            durations,
        }
    }

    /// Commit now: flush the data device, then commit the metadata.
    pub fn commit(&self) -> Result<()> {
        self.shared.commit()
    }

    /// Stop the commit thread and commit. Further I/O through open volumes still works, but
    /// is only committed by explicit flushes.
    pub fn close(&self) -> Result<()> {
        self.shared.watch.stop();
        self.committer.stop(&self.shared);
        if matches!(self.mode(), PoolMode::Write | PoolMode::OutOfDataSpace) {
            self.shared.commit()?;
        }
        Ok(())
    }

    /// A consistency check of the engine's in-memory state against the metadata (tests):
    /// after a commit, every built index equals its volume's mapping tree (a volume
    /// without one is read from its tree anyway).
    pub fn verify_index(&self) -> Result<()> {
        self.commit()?;
        let volumes = self.shared.volumes.load();
        let meta = self.shared.lock_meta();
        let md = meta
            .md
            .as_ref()
            .ok_or(Error::ReadOnly { needs_check: true })?;
        for v in volumes.values() {
            let Some(index) = v.loaded_index() else {
                continue;
            };
            let mut from_tree = BTreeMap::new();
            md.walk_mappings(v.id, &mut |block, mapping| {
                from_tree.insert(block, mapping);
                Ok(())
            })?;
            let mut from_index = BTreeMap::new();
            index.for_each_in(
                VirtualBlock::new(0),
                VirtualBlock::new(u64::MAX),
                &mut |block, mapping| {
                    from_index.insert(block, mapping);
                },
            );
            if from_tree != from_index {
                return Err(Error::Internal(format!(
                    "volume {:?}: index and mapping tree differ",
                    v.name
                )));
            }
        }
        Ok(())
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        if Arc::strong_count(&self.committer) == 1 {
            let _ = self.close();
        }
    }
}
