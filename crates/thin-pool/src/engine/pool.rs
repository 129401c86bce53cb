//! The pool: pool metadata + a data device + the volume catalog, and the engine that serves
//! volume I/O on them.
//!
//! Threads and locks:
//!
//! - **Reads and overwrites** of provisioned, unshared blocks consult the volume's lock-free
//!   [`Index`] and do positional I/O on the caller's thread. They pass the volume's
//!   [`WriteGate`] (writes only; a per-thread counter, not a lock).
//! - **Provisioning** (first write, breaking sharing) is ordered per virtual block by one of
//!   the volume's hashed block locks, allocates a data block under the metadata mutex (a short
//!   critical section), writes the data outside any pool lock, then queues an `Op::Insert`
//!   and publishes the mapping in the index.
//! - **Commit** (periodic, on flush/FUA, on every management operation) takes the queued
//!   operations present when it starts, flushes the data device (so their data is durable),
//!   applies them to the btrees and commits the metadata. Operations queued during the flush
//!   wait for the next commit, and data blocks allocated for them are left out of the
//!   committed space map (released around the metadata commit and taken back after), so a
//!   crash never leaves a mapping without its data nor a leaked block. Commits never block
//!   reads.
//! - **Snapshots** pause only the origin's writers (its gate), commit, share the origin's
//!   mapping root in the metadata (O(1)) and copy its index.
//!
//! Modes follow dm-thin (spec §10.5): `Write`, `OutOfDataSpace` (writes that need a block
//! error with ENOSPC or wait up to the no-space timeout for growth), `OutOfMetadataSpace`
//! (no metadata changes until the metadata device grows), `ReadOnly` (option, or after a
//! metadata error, with needs_check set) and `Fail`.

use crate::engine::catalog::{validate_name, Catalog, CatalogStore, CatalogVolume, DirCatalog};
use crate::engine::data_device::{DataDevice, FileDataDevice};
use crate::engine::gate::WriteGate;
use crate::engine::index::{Index, IndexEntry, INDEX_DATA_BLOCK_MAX};
use crate::engine::volume::Volume;
use crate::error::{Error, Result};
use crate::format::metadata::PoolMetadata;
use crate::ids::{DataBlock, TransactionId, VirtualBlock, VolumeId};
use arc_swap::ArcSwap;
use persistent_data::{BlockDevice, FileDevice};
use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// File names inside a pool directory.
pub const METADATA_FILE: &str = "metadata";
/// The data file inside a pool directory.
pub const DATA_FILE: &str = "data";

/// Default data block size: 64 KiB.
pub const BLOCK_SIZE_DEFAULT_BYTES: u64 = 64 * 1024;

/// Block locks per volume (hashed by virtual block).
const BLOCK_LOCKS: usize = 256;

/// Options of a pool, as dm-thin's feature arguments.
#[derive(Clone, Debug)]
pub struct PoolOptions {
    /// Zero the part of a new block that its first write does not cover.
    pub zero_new_blocks: bool,
    /// Discard freed data blocks on the data device.
    pub discard_passdown: bool,
    /// Fail writes that need space at once when out of data space (else queue them).
    pub error_if_no_space: bool,
    /// How long a queued write waits for space before failing.
    pub no_space_timeout: Duration,
    /// Refuse every change.
    pub read_only: bool,
    /// Free data blocks at or below which a low-water event fires.
    pub low_water_mark_blocks: u64,
    /// Commit this often when something changed (None: only on flush and management).
    pub commit_interval: Option<Duration>,
}

impl Default for PoolOptions {
    fn default() -> PoolOptions {
        PoolOptions {
            zero_new_blocks: true,
            discard_passdown: true,
            error_if_no_space: false,
            no_space_timeout: Duration::from_secs(60),
            read_only: false,
            low_water_mark_blocks: 0,
            commit_interval: Some(Duration::from_secs(1)),
        }
    }
}

/// How a new pool is laid out.
#[derive(Clone, Debug)]
pub struct CreateOptions {
    /// Data device size in bytes (rounded down to whole blocks).
    pub data_size_bytes: u64,
    /// Data block size in bytes (64 KiB to 1 GiB, a multiple of 64 KiB).
    pub block_size_bytes: u64,
    /// Metadata device size in bytes (None: estimated from the data size).
    pub metadata_size_bytes: Option<u64>,
}

/// The pool's mode (spec §10.5), most to least capable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum PoolMode {
    /// Normal operation.
    Write = 0,
    /// No free data block: writes needing one error or queue.
    OutOfDataSpace = 1,
    /// No free metadata: no metadata changes.
    OutOfMetadataSpace = 2,
    /// No changes at all.
    ReadOnly = 3,
    /// Every I/O errors.
    Fail = 4,
}

impl PoolMode {
    fn from_u8(v: u8) -> PoolMode {
        match v {
            0 => PoolMode::Write,
            1 => PoolMode::OutOfDataSpace,
            2 => PoolMode::OutOfMetadataSpace,
            3 => PoolMode::ReadOnly,
            _ => PoolMode::Fail,
        }
    }

    /// dm-thin's status word.
    pub fn as_str(self) -> &'static str {
        match self {
            PoolMode::Write => "rw",
            PoolMode::OutOfDataSpace => "out_of_data_space",
            PoolMode::OutOfMetadataSpace | PoolMode::ReadOnly => "ro",
            PoolMode::Fail => "fail",
        }
    }
}

/// A snapshot of the pool's state, like dm-thin's status line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolStatus {
    /// User transaction id.
    pub transaction_id: u64,
    /// Metadata blocks in use.
    pub metadata_used_blocks: u64,
    /// Metadata blocks.
    pub metadata_total_blocks: u64,
    /// Data blocks in use.
    pub data_used_blocks: u64,
    /// Data blocks.
    pub data_total_blocks: u64,
    /// Data block size in bytes.
    pub block_size_bytes: u64,
    /// Held metadata snapshot, if any.
    pub metadata_snap: Option<u64>,
    /// Mode.
    pub mode: PoolMode,
    /// Whether the metadata needs a check.
    pub needs_check: bool,
    /// Discard passdown enabled.
    pub discard_passdown: bool,
    /// error_if_no_space set.
    pub error_if_no_space: bool,
    /// Free data blocks fell to the low water mark.
    pub low_water_reached: bool,
    /// Volumes.
    pub volume_count: usize,
}

/// A metadata change whose data is written, waiting for the next commit.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Op {
    Insert {
        volume: VolumeId,
        block: u64,
        data_block: u64,
        time: u32,
    },
    Remove {
        volume: VolumeId,
        block: u64,
    },
}

pub(crate) struct MetaState {
    pub(crate) md: Option<PoolMetadata>,
    pub(crate) catalog: Catalog,
    pub(crate) ops: Vec<Op>,
    /// Data blocks allocated for provisioning whose Insert is not applied yet.
    pub(crate) unapplied: HashSet<u64>,
    /// Data blocks a discard freed in this transaction: discarded on the data device only
    /// once the commit that frees them is durable (before it, the committed metadata may
    /// still map them, e.g. in a snapshot whose copy-on-write is not committed).
    pub(crate) passdown: Vec<u64>,
}

impl MetaState {
    fn md(&mut self) -> Result<&mut PoolMetadata> {
        self.md
            .as_mut()
            .ok_or(Error::ReadOnly { needs_check: true })
    }
}

/// State shared by a volume's handles.
pub(crate) struct VolumeShared {
    pub(crate) name: String,
    pub(crate) id: VolumeId,
    pub(crate) size_bytes: AtomicU64,
    pub(crate) read_only: AtomicBool,
    pub(crate) index: Index,
    /// Pool time of the volume's last snapshot: mappings older than it may be shared.
    pub(crate) snapshotted_time: AtomicU32,
    pub(crate) gate: WriteGate,
    pub(crate) block_locks: Vec<Mutex<()>>,
    pub(crate) open_count: AtomicUsize,
    pub(crate) origin: Option<String>,
}

impl VolumeShared {
    pub(crate) fn block_lock(&self, block: u64) -> MutexGuard<'_, ()> {
        let i = (block.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as usize % BLOCK_LOCKS;
        self.block_locks[i]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
}

/// Everything the pool's threads share.
pub(crate) struct Shared {
    pub(crate) data: Arc<dyn DataDevice>,
    metadata_device: Arc<dyn BlockDevice>,
    pub(crate) block_size_bytes: u64,
    pub(crate) options: PoolOptions,
    pub(crate) meta: Mutex<MetaState>,
    /// Serializes commits (and everything that applies queued ops).
    commit_lock: Mutex<()>,
    /// Signalled when data space may have appeared.
    space: Condvar,
    pub(crate) volumes: ArcSwap<BTreeMap<String, Arc<VolumeShared>>>,
    mode: AtomicU8,
    pub(crate) time: AtomicU32,
    low_water_reached: AtomicBool,
    stop: AtomicBool,
    wake: Condvar,
    wake_lock: Mutex<()>,
    catalog_store: Box<dyn CatalogStore>,
    events: Mutex<Vec<String>>,
}

/// A thin pool, open for I/O and management. Cheap to clone (shared state).
#[derive(Clone)]
pub struct Pool {
    pub(crate) shared: Arc<Shared>,
    committer: Arc<Mutex<Option<JoinHandle<()>>>>,
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

fn io_error(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { what, source }
}

fn lock_exclusive(file: &std::fs::File, path: &Path) -> Result<()> {
    match file.try_lock() {
        Ok(()) => Ok(()),
        Err(std::fs::TryLockError::WouldBlock) => Err(Error::Locked {
            path: path.display().to_string(),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(Error::Io {
            what: format!("locking {}", path.display()),
            source: e,
        }),
    }
}

impl Pool {
    /// Create a pool in directory `dir` (created if missing; must not hold a pool): files
    /// `metadata` and `data`, and the volume catalog. Returns it open.
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
        std::fs::create_dir_all(dir).map_err(io_error(format!("creating {}", dir.display())))?;
        let metadata_path = dir.join(METADATA_FILE);
        if metadata_path.exists() {
            return Err(Error::Invalid(format!(
                "{} already holds a pool",
                dir.display()
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
        let metadata = FileDevice::create(&metadata_path, metadata_blocks)
            .map_err(io_error(format!("creating {}", metadata_path.display())))?;
        lock_exclusive(metadata.file(), &metadata_path)?;
        let data_path = dir.join(DATA_FILE);
        let data = FileDataDevice::create(&data_path, data_blocks * block_size)
            .map_err(io_error(format!("creating {}", data_path.display())))?;
        let metadata: Arc<dyn BlockDevice> = Arc::new(metadata);
        let md = PoolMetadata::format(metadata.clone(), (block_size / 512) as u32, data_blocks)?;
        let catalog = DirCatalog::new(dir);
        catalog.store(&Catalog {
            transaction_id: md.transaction_id().0,
            volumes: vec![],
        })?;
        drop(md);
        Pool::open_parts(metadata, Arc::new(data), Box::new(catalog), options, None)
    }

    /// Open the pool in directory `dir`, taking an exclusive lock on its metadata.
    pub fn open(dir: &Path, options: PoolOptions) -> Result<Pool> {
        let metadata_path = dir.join(METADATA_FILE);
        let metadata = FileDevice::open(&metadata_path, !options.read_only)
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
        Pool::open_parts(
            Arc::new(metadata),
            Arc::new(data),
            Box::new(DirCatalog::new(dir)),
            options,
            Some(lock),
        )
    }

    /// Whether `dir` holds a pool.
    pub fn exists(dir: &Path) -> bool {
        dir.join(METADATA_FILE).exists()
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
            transaction_id: md.transaction_id().0,
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
        let mut md = PoolMetadata::open(metadata.clone())?;
        let block_size_bytes = u64::from(md.data_block_size_sectors()) * 512;
        let catalog = catalog_store.load(md.transaction_id().0)?;
        // A catalog newer than the metadata is a change that never committed: forget it.
        catalog_store.committed(md.transaction_id().0)?;
        let md_ids: Vec<VolumeId> = md.volumes();
        for v in &catalog.volumes {
            if !md_ids.contains(&VolumeId(v.id)) {
                return Err(Error::Invalid(format!(
                    "volume {:?} (id {}) is in the catalog but not in the metadata",
                    v.name, v.id
                )));
            }
        }
        for id in &md_ids {
            if !catalog.volumes.iter().any(|v| v.id == id.0) {
                return Err(Error::Invalid(format!(
                    "metadata volume id {id} is missing from the catalog"
                )));
            }
        }
        let data_blocks = data.size_bytes() / block_size_bytes;
        let recorded = md.data_space_map().block_count();
        if data_blocks < recorded {
            return Err(Error::Invalid(format!(
                "data device holds {data_blocks} blocks, the pool records {recorded}: it shrank"
            )));
        }
        let mut mode = PoolMode::Write;
        if options.read_only || md.needs_check() {
            mode = PoolMode::ReadOnly;
        } else if data_blocks > recorded {
            md.extend_data(data_blocks)?;
            md.commit()?;
        }
        let time = md.time();
        let mut volumes = BTreeMap::new();
        for v in &catalog.volumes {
            let id = VolumeId(v.id);
            let details = md.details(id)?;
            let block_count = v.size_bytes.div_ceil(block_size_bytes);
            let index = Index::new(block_count);
            let mut beyond = None;
            md.walk_volume(id, &mut |vb, db, t| {
                if vb.0 < block_count {
                    index.set(
                        vb.0,
                        IndexEntry {
                            data_block: db.0,
                            time: t,
                        },
                    );
                } else {
                    beyond = Some(vb);
                }
                Ok(())
            })?;
            if let Some(vb) = beyond {
                return Err(Error::Invalid(format!(
                    "volume {:?} maps block {vb} beyond its size of {} bytes",
                    v.name, v.size_bytes
                )));
            }
            volumes.insert(
                v.name.clone(),
                Arc::new(new_volume_shared(v, index, details.snapshotted_time)),
            );
        }
        let shared = Arc::new(Shared {
            data,
            metadata_device: metadata,
            block_size_bytes,
            options: options.clone(),
            meta: Mutex::new(MetaState {
                md: Some(md),
                catalog,
                ops: Vec::new(),
                unapplied: HashSet::new(),
                passdown: Vec::new(),
            }),
            commit_lock: Mutex::new(()),
            space: Condvar::new(),
            volumes: ArcSwap::from_pointee(volumes),
            mode: AtomicU8::new(mode as u8),
            time: AtomicU32::new(time),
            low_water_reached: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            wake: Condvar::new(),
            wake_lock: Mutex::new(()),
            catalog_store,
            events: Mutex::new(Vec::new()),
        });
        let committer = match options.commit_interval {
            Some(interval) if mode != PoolMode::ReadOnly => {
                let weak = Arc::downgrade(&shared);
                Some(
                    std::thread::Builder::new()
                        .name("thinpool-commit".to_string())
                        .spawn(move || commit_loop(weak, interval))
                        .map_err(io_error("starting the commit thread".to_string()))?,
                )
            }
            _ => None,
        };
        Ok(Pool {
            shared,
            committer: Arc::new(Mutex::new(committer)),
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
        self.shared
            .events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Open a volume by name for I/O.
    pub fn volume(&self, name: &str) -> Result<Volume> {
        let volumes = self.shared.volumes.load();
        let shared = volumes
            .get(name)
            .cloned()
            .ok_or_else(|| Error::NoSuchVolume(name.to_string()))?;
        Ok(Volume::new(self.shared.clone(), shared))
    }

    /// Every volume, in name order.
    pub fn list(&self) -> Vec<VolumeInfo> {
        // The index holds every mapping, committed or queued: no need for the metadata.
        let volumes = self.shared.volumes.load();
        volumes
            .values()
            .map(|v| VolumeInfo {
                name: v.name.clone(),
                id: v.id,
                size_bytes: v.size_bytes.load(Ordering::Acquire),
                mapped_blocks: v.index.mapped_count(),
                block_size_bytes: self.shared.block_size_bytes,
                origin: v.origin.clone(),
                read_only: v.read_only.load(Ordering::Acquire),
                open_count: v.open_count.load(Ordering::Acquire),
            })
            .collect()
    }

    /// The pool's status (commits nothing).
    pub fn status(&self) -> PoolStatus {
        let volume_count = self.shared.volumes.load().len();
        let meta = self.shared.lock_meta();
        let (usage, txn, snap, needs_check) = match &meta.md {
            Some(md) => (
                Some(md.usage()),
                md.transaction_id().0,
                md.metadata_snap().map(|b| b.0),
                md.needs_check(),
            ),
            None => (None, meta.catalog.transaction_id, None, true),
        };
        let mode = self.shared.mode();
        PoolStatus {
            transaction_id: txn,
            metadata_used_blocks: usage.map_or(0, |u| u.metadata_used_blocks),
            metadata_total_blocks: usage.map_or(0, |u| u.metadata_total_blocks),
            data_used_blocks: usage.map_or(0, |u| u.data_used_blocks),
            data_total_blocks: usage.map_or(0, |u| u.data_total_blocks),
            block_size_bytes: self.shared.block_size_bytes,
            metadata_snap: snap,
            mode,
            needs_check: needs_check
                || (mode == PoolMode::ReadOnly && !self.shared.options.read_only),
            discard_passdown: self.shared.options.discard_passdown,
            error_if_no_space: self.shared.options.error_if_no_space,
            low_water_reached: self.shared.low_water_reached.load(Ordering::Acquire),
            volume_count,
        }
    }

    /// Create a thin volume of `size_bytes` (a multiple of 512).
    pub fn create_volume(&self, name: &str, size_bytes: u64) -> Result<VolumeInfo> {
        validate_name(name)?;
        check_size(size_bytes)?;
        let shared = &self.shared;
        let _commit = shared.lock_commit();
        shared.check_changes_allowed()?;
        let (mut meta, taken) = shared.flush_and_lock()?;
        if meta.catalog.find(name).is_some() {
            return Err(Error::NameExists(name.to_string()));
        }
        let id = meta.catalog.free_id()?;
        let entry = CatalogVolume {
            name: name.to_string(),
            id,
            size_bytes,
            read_only: false,
            origin: None,
        };
        let mut catalog = meta.catalog.clone();
        catalog.volumes.push(entry.clone());
        shared.catalog_transaction(&mut meta, taken, catalog, |md| md.create_thin(VolumeId(id)))?;
        let time = shared.time.load(Ordering::Acquire);
        let volume = Arc::new(new_volume_shared(
            &entry,
            Index::new(size_bytes.div_ceil(shared.block_size_bytes)),
            time,
        ));
        shared.publish_volume(volume);
        drop(meta);
        self.info(name)
    }

    /// Snapshot `origin` as `name`. Pauses only the origin's writes, briefly.
    pub fn snapshot(&self, origin: &str, name: &str, read_only: bool) -> Result<VolumeInfo> {
        validate_name(name)?;
        let shared = &self.shared;
        let origin_volume = shared.volume_named(origin)?;
        let _pause = origin_volume.gate.pause();
        let _commit = shared.lock_commit();
        shared.check_changes_allowed()?;
        let (mut meta, taken) = shared.flush_and_lock()?;
        if meta.catalog.find(name).is_some() {
            return Err(Error::NameExists(name.to_string()));
        }
        let id = meta.catalog.free_id()?;
        let entry = CatalogVolume {
            name: name.to_string(),
            id,
            size_bytes: origin_volume.size_bytes.load(Ordering::Acquire),
            read_only,
            origin: Some(origin.to_string()),
        };
        let mut catalog = meta.catalog.clone();
        catalog.volumes.push(entry.clone());
        let origin_id = origin_volume.id;
        shared.catalog_transaction(&mut meta, taken, catalog, |md| {
            md.create_snap(VolumeId(id), origin_id)
        })?;
        let time = meta.md()?.time();
        shared.time.store(time, Ordering::Release);
        origin_volume
            .snapshotted_time
            .store(time, Ordering::Release);
        let volume = Arc::new(new_volume_shared(
            &entry,
            origin_volume.index.duplicate(),
            time,
        ));
        shared.publish_volume(volume);
        drop(meta);
        self.info(name)
    }

    /// Delete a volume (refused while it is open).
    pub fn delete_volume(&self, name: &str) -> Result<()> {
        let shared = &self.shared;
        let _commit = shared.lock_commit();
        shared.check_changes_allowed()?;
        let volume = shared.volume_named(name)?;
        if volume.open_count.load(Ordering::Acquire) > 0 {
            return Err(Error::Busy(format!("volume {name:?} is open")));
        }
        let (mut meta, taken) = shared.flush_and_lock()?;
        let mut catalog = meta.catalog.clone();
        catalog.volumes.retain(|v| v.name != name);
        let id = volume.id;
        shared.catalog_transaction(&mut meta, taken, catalog, |md| md.delete(id))?;
        let mut volumes = (**shared.volumes.load()).clone();
        volumes.remove(name);
        shared.volumes.store(Arc::new(volumes));
        drop(meta);
        shared.space.notify_all();
        Ok(())
    }

    /// Change a volume's virtual size. Shrinking unmaps the blocks beyond the new end.
    pub fn resize_volume(&self, name: &str, size_bytes: u64) -> Result<VolumeInfo> {
        check_size(size_bytes)?;
        let shared = &self.shared;
        let volume = shared.volume_named(name)?;
        let _pause = volume.gate.pause();
        let _commit = shared.lock_commit();
        shared.check_changes_allowed()?;
        let (mut meta, taken) = shared.flush_and_lock()?;
        let block_count = size_bytes.div_ceil(shared.block_size_bytes);
        let old_block_count = volume.index.block_count();
        let old_size = volume.size_bytes.load(Ordering::Acquire);
        if size_bytes < old_size && !size_bytes.is_multiple_of(shared.block_size_bytes) {
            return Err(Error::Invalid(format!(
                "shrinking to {size_bytes} bytes: a smaller size must be a multiple of the {}-byte block size",
                shared.block_size_bytes
            )));
        }
        let mut catalog = meta.catalog.clone();
        for v in catalog.volumes.iter_mut().filter(|v| v.name == name) {
            v.size_bytes = size_bytes;
        }
        let id = volume.id;
        shared.catalog_transaction(&mut meta, taken, catalog, |md| {
            if block_count < old_block_count {
                md.remove_range(id, VirtualBlock(block_count), VirtualBlock(u64::MAX))?;
            }
            Ok(())
        })?;
        for block in block_count..old_block_count {
            volume.index.clear(block);
        }
        volume.index.resize(block_count);
        volume.size_bytes.store(size_bytes, Ordering::Release);
        drop(meta);
        self.info(name)
    }

    /// Grow the data device to `size_bytes` (a regular data file is extended; a block device
    /// must already be that large) and the pool with it, letting queued writes proceed.
    /// Returns the number of data blocks.
    pub fn grow_data(&self, size_bytes: u64) -> Result<u64> {
        let shared = &self.shared;
        let _commit = shared.lock_commit();
        let device_bytes = shared
            .data
            .grow_to(size_bytes)
            .map_err(io_error("growing the data device".to_string()))?;
        let blocks = size_bytes.min(device_bytes) / shared.block_size_bytes;
        let (mut meta, taken) = shared.flush_and_lock()?;
        let md = meta.md()?;
        if blocks > md.data_space_map().block_count() {
            md.extend_data(blocks)?;
            shared.commit_locked(&mut meta, taken)?;
        }
        let blocks = meta.md()?.data_space_map().block_count();
        if shared.mode() == PoolMode::OutOfDataSpace {
            shared.set_mode(PoolMode::Write);
        }
        shared.low_water_reached.store(false, Ordering::Release);
        drop(meta);
        shared.space.notify_all();
        Ok(blocks)
    }

    /// Grow the metadata device to `size_bytes` (a regular file is extended; None: use the
    /// device's current size) and the metadata space map with it. Returns the number of
    /// metadata blocks the space map manages.
    pub fn grow_metadata(&self, size_bytes: Option<u64>) -> Result<u64> {
        let shared = &self.shared;
        let _commit = shared.lock_commit();
        let wanted_blocks = size_bytes.map_or(0, |bytes| bytes / 4096);
        let blocks = shared
            .metadata_device
            .extend_to(wanted_blocks)
            .map_err(io_error("growing the metadata device".to_string()))?;
        let (mut meta, taken) = shared.flush_and_lock()?;
        if meta.md.as_ref().is_some_and(|md| md.needs_check()) {
            return Err(Error::ReadOnly { needs_check: true });
        }
        let total = meta.md()?.extend_metadata(blocks)?;
        if shared.mode() == PoolMode::OutOfMetadataSpace {
            shared.set_mode(PoolMode::Write);
        }
        shared.commit_locked(&mut meta, taken)?;
        drop(meta);
        shared.space.notify_all();
        Ok(total)
    }

    /// Commit now: flush the data device, then commit the metadata.
    pub fn commit(&self) -> Result<()> {
        self.shared.commit()
    }

    /// Set the user transaction id (the catalog follows it).
    pub fn set_transaction_id(&self, current: TransactionId, new: TransactionId) -> Result<()> {
        let shared = &self.shared;
        let _commit = shared.lock_commit();
        shared.check_changes_allowed()?;
        let (mut meta, taken) = shared.flush_and_lock()?;
        let mut catalog = meta.catalog.clone();
        catalog.transaction_id = new.0;
        shared.catalog_store.store(&catalog)?;
        let md = meta.md()?;
        md.set_transaction_id(current, new)?;
        shared.commit_locked(&mut meta, taken)?;
        meta.catalog = catalog;
        shared.catalog_store.committed(new.0)?;
        Ok(())
    }

    /// Hold a metadata snapshot (so `thin_dump -m` can read a consistent tree while serving).
    pub fn reserve_metadata_snap(&self) -> Result<u64> {
        let shared = &self.shared;
        let _commit = shared.lock_commit();
        shared.check_changes_allowed()?;
        let (mut meta, taken) = shared.flush_and_lock()?;
        shared.apply_ops(&mut meta, taken)?;
        let result = shared.with_unapplied_released(&mut meta, |md| md.reserve_metadata_snap());
        result.map(|b| b.0)
    }

    /// Release the held metadata snapshot.
    pub fn release_metadata_snap(&self) -> Result<()> {
        let shared = &self.shared;
        let _commit = shared.lock_commit();
        shared.check_changes_allowed()?;
        let (mut meta, taken) = shared.flush_and_lock()?;
        shared.apply_ops(&mut meta, taken)?;
        shared.with_unapplied_released(&mut meta, |md| md.release_metadata_snap())
    }

    /// Information about one volume.
    pub fn info(&self, name: &str) -> Result<VolumeInfo> {
        self.list()
            .into_iter()
            .find(|v| v.name == name)
            .ok_or_else(|| Error::NoSuchVolume(name.to_string()))
    }

    /// Stop the commit thread and commit. Further I/O through open volumes still works, but
    /// is only committed by explicit flushes.
    pub fn close(&self) -> Result<()> {
        self.shared.stop.store(true, Ordering::Release);
        {
            let _guard = self
                .shared
                .wake_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        if let Some(handle) = self
            .committer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = handle.join();
        }
        if matches!(self.mode(), PoolMode::Write | PoolMode::OutOfDataSpace) {
            self.shared.commit()?;
        }
        Ok(())
    }

    /// A consistency check of the engine's in-memory state against the metadata (tests):
    /// after a commit, every volume's index equals its mapping tree.
    pub fn verify_index(&self) -> Result<()> {
        self.commit()?;
        let volumes = self.shared.volumes.load();
        let meta = self.shared.lock_meta();
        let md = meta
            .md
            .as_ref()
            .ok_or(Error::ReadOnly { needs_check: true })?;
        for v in volumes.values() {
            let mut from_tree = BTreeMap::new();
            md.walk_volume(v.id, &mut |vb, db, t| {
                from_tree.insert(vb.0, (db.0, t));
                Ok(())
            })?;
            let mut from_index = BTreeMap::new();
            v.index.for_each_in(0, u64::MAX, &mut |b, e| {
                from_index.insert(b, (e.data_block, e.time));
            });
            if from_tree != from_index {
                return Err(Error::Invalid(format!(
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

/// Information about a volume, like a row of `lvs`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeInfo {
    /// Name.
    pub name: String,
    /// Id in the metadata.
    pub id: VolumeId,
    /// Virtual size in bytes.
    pub size_bytes: u64,
    /// Mapped blocks.
    pub mapped_blocks: u64,
    /// Data block size.
    pub block_size_bytes: u64,
    /// The volume it was snapshotted from.
    pub origin: Option<String>,
    /// Read-only.
    pub read_only: bool,
    /// Open handles.
    pub open_count: usize,
}

impl VolumeInfo {
    /// Mapped fraction of the virtual size, in percent.
    pub fn mapped_percent(&self) -> f64 {
        if self.size_bytes == 0 {
            return 0.0;
        }
        ((self.mapped_blocks * self.block_size_bytes) as f64 / self.size_bytes as f64 * 100.0)
            .min(100.0)
    }
}

fn check_size(size_bytes: u64) -> Result<()> {
    if size_bytes == 0 || !size_bytes.is_multiple_of(512) {
        return Err(Error::Invalid(format!(
            "volume size {size_bytes} bytes: must be a positive multiple of 512"
        )));
    }
    if size_bytes > (1u64 << 60) {
        return Err(Error::Invalid(format!(
            "volume size {size_bytes} bytes is too large"
        )));
    }
    Ok(())
}

fn new_volume_shared(entry: &CatalogVolume, index: Index, snapshotted_time: u32) -> VolumeShared {
    VolumeShared {
        name: entry.name.clone(),
        id: VolumeId(entry.id),
        size_bytes: AtomicU64::new(entry.size_bytes),
        read_only: AtomicBool::new(entry.read_only),
        index,
        snapshotted_time: AtomicU32::new(snapshotted_time),
        gate: WriteGate::default(),
        block_locks: (0..BLOCK_LOCKS).map(|_| Mutex::new(())).collect(),
        open_count: AtomicUsize::new(0),
        origin: entry.origin.clone(),
    }
}

fn commit_loop(shared: std::sync::Weak<Shared>, interval: Duration) {
    loop {
        let Some(strong) = shared.upgrade() else {
            return;
        };
        {
            let guard = strong.wake_lock.lock().unwrap_or_else(|e| e.into_inner());
            if strong.stop.load(Ordering::Acquire) {
                return;
            }
            let _ = strong.wake.wait_timeout(guard, interval);
        }
        if strong.stop.load(Ordering::Acquire) {
            return;
        }
        let dirty = {
            let meta = strong.lock_meta();
            !meta.ops.is_empty() || meta.md.as_ref().is_some_and(|md| md.has_changes())
        };
        if dirty && matches!(strong.mode(), PoolMode::Write | PoolMode::OutOfDataSpace) {
            if let Err(e) = strong.commit() {
                strong.log(format!("periodic commit failed: {e}"));
            }
        }
    }
}

impl Shared {
    pub(crate) fn mode(&self) -> PoolMode {
        PoolMode::from_u8(self.mode.load(Ordering::Acquire))
    }

    fn set_mode(&self, mode: PoolMode) {
        let old = PoolMode::from_u8(self.mode.swap(mode as u8, Ordering::AcqRel));
        if old != mode {
            self.log(format!("pool mode {old:?} -> {mode:?}"));
        }
    }

    fn log(&self, event: String) {
        let mut events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        if events.len() >= 1000 {
            events.remove(0);
        }
        events.push(event);
    }

    pub(crate) fn lock_meta(&self) -> MutexGuard<'_, MetaState> {
        self.meta.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_commit(&self) -> MutexGuard<'_, ()> {
        self.commit_lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the mode lets metadata change (allocations, commits, management).
    fn check_changes_allowed(&self) -> Result<()> {
        match self.mode() {
            PoolMode::Write | PoolMode::OutOfDataSpace => Ok(()),
            PoolMode::OutOfMetadataSpace => Err(Error::OutOfMetadataSpace {
                block_count: self.metadata_device.block_count(),
            }),
            PoolMode::ReadOnly | PoolMode::Fail => Err(Error::ReadOnly {
                needs_check: !self.options.read_only,
            }),
        }
    }

    fn flush_data(&self) -> Result<()> {
        self.data
            .flush()
            .map_err(io_error("flushing the data device".to_string()))
    }

    /// Count the queued ops, flush the data device (their data is now durable), lock the
    /// metadata. Returns the lock and how many ops may be applied: ops queued during the
    /// flush are not covered by it and wait for the next commit.
    fn flush_and_lock(&self) -> Result<(MutexGuard<'_, MetaState>, usize)> {
        let taken = self.lock_meta().ops.len();
        self.flush_data()?;
        Ok((self.lock_meta(), taken))
    }

    fn volume_named(&self, name: &str) -> Result<Arc<VolumeShared>> {
        self.volumes
            .load()
            .get(name)
            .cloned()
            .ok_or_else(|| Error::NoSuchVolume(name.to_string()))
    }

    fn publish_volume(&self, volume: Arc<VolumeShared>) {
        let mut volumes = (**self.volumes.load()).clone();
        volumes.insert(volume.name.clone(), volume);
        self.volumes.store(Arc::new(volumes));
    }

    /// Commit: take the ops queued now, flush data, apply them, commit metadata.
    pub(crate) fn commit(&self) -> Result<()> {
        let _commit = self.lock_commit();
        self.check_changes_allowed()?;
        let taken = self.lock_meta().ops.len();
        self.flush_data()?;
        let mut meta = self.lock_meta();
        self.commit_locked(&mut meta, taken)
    }

    /// Apply the first `count` queued ops (their data is durable) to the metadata.
    fn apply_ops(&self, meta: &mut MetaState, count: usize) -> Result<()> {
        let count = count.min(meta.ops.len());
        if count == 0 {
            return Ok(());
        }
        let reserve = self.metadata_reserve_blocks(meta);
        let md = meta
            .md
            .as_mut()
            .ok_or(Error::ReadOnly { needs_check: true })?;
        let usage = md.usage();
        let free = usage.metadata_total_blocks - usage.metadata_used_blocks;
        // Roughly: a leaf split every 126 inserts, plus a path shadow per volume touched.
        let needed = reserve + count as u64 / 64 + 16;
        if free < needed {
            self.set_mode(PoolMode::OutOfMetadataSpace);
            return Err(Error::OutOfMetadataSpace {
                block_count: usage.metadata_total_blocks,
            });
        }
        let ops: Vec<Op> = meta.ops.drain(..count).collect();
        let mut result = Ok(());
        for op in ops {
            let step = match op {
                Op::Insert {
                    volume,
                    block,
                    data_block,
                    time,
                } => {
                    meta.unapplied.remove(&data_block);
                    let md = meta.md.as_mut().expect("checked above");
                    if !md.has_volume(volume) {
                        // The volume was deleted: the block goes back.
                        md.dec_data_block(DataBlock(data_block)).map(|_| ())
                    } else {
                        md.insert_at(volume, VirtualBlock(block), DataBlock(data_block), time)
                            // No passdown for a replaced block: until this commit is
                            // durable the old mapping may be what survives a crash.
                            .map(|_| ())
                    }
                }
                Op::Remove { volume, block } => {
                    let md = meta.md.as_mut().expect("checked above");
                    if !md.has_volume(volume) {
                        Ok(())
                    } else {
                        md.remove(volume, VirtualBlock(block)).map(|old| {
                            if let Some(db) = old {
                                if self.options.discard_passdown && md.data_block_count(db) == 0 {
                                    meta.passdown.push(db.0);
                                }
                            }
                        })
                    }
                }
            };
            if let Err(e) = step {
                result = Err(e);
                break;
            }
        }
        if let Err(e) = result {
            return Err(self.metadata_failed(meta, e));
        }
        Ok(())
    }

    /// After a durable commit: discard the data blocks discards freed, if nothing took them
    /// since (nothing can: the metadata lock is held from the commit to here).
    fn pass_down(&self, meta: &mut MetaState) {
        let blocks = std::mem::take(&mut meta.passdown);
        let Some(md) = meta.md.as_ref() else { return };
        for block in blocks {
            if md.data_block_count(DataBlock(block)) == 0 {
                // A discard failure only costs space on the data device.
                let _ = self
                    .data
                    .discard(block * self.block_size_bytes, self.block_size_bytes);
            }
        }
    }

    fn metadata_reserve_blocks(&self, meta: &MetaState) -> u64 {
        let total = meta
            .md
            .as_ref()
            .map_or(0, |md| md.usage().metadata_total_blocks);
        (total / 10).clamp(8, 4096)
    }

    /// Run `change` and commit with the unapplied provisioning blocks left out of the
    /// committed space map (they are taken back right after).
    fn with_unapplied_released<T>(
        &self,
        meta: &mut MetaState,
        change: impl FnOnce(&mut PoolMetadata) -> Result<T>,
    ) -> Result<T> {
        let unapplied: Vec<u64> = meta.unapplied.iter().copied().collect();
        let md = meta
            .md
            .as_mut()
            .ok_or(Error::ReadOnly { needs_check: true })?;
        for &b in &unapplied {
            if let Err(e) = md.dec_data_block(DataBlock(b)) {
                return Err(self.metadata_failed(meta, e));
            }
        }
        let md = meta.md.as_mut().expect("present");
        let result = change(md);
        let result = match result {
            Ok(value) => md.commit().map(|()| value),
            Err(e) => Err(e),
        };
        match result {
            Ok(value) => {
                let md = meta.md.as_mut().expect("present");
                for &b in &unapplied {
                    if let Err(e) = md.inc_data_block(DataBlock(b)) {
                        return Err(self.metadata_failed(meta, e));
                    }
                }
                self.pass_down(meta);
                Ok(value)
            }
            Err(
                e @ (Error::VolumeExists(_)
                | Error::VolumeNotFound(_)
                | Error::BadVolumeId(_)
                | Error::TransactionMismatch { .. }
                | Error::MetadataSnapExists(_)
                | Error::NoMetadataSnap
                | Error::Invalid(_)),
            ) => {
                // Refused before changing anything: take the blocks back and go on.
                let md = meta.md.as_mut().expect("present");
                for &b in &unapplied {
                    md.inc_data_block(DataBlock(b))?;
                }
                Err(e)
            }
            Err(e) => Err(self.metadata_failed(meta, e)),
        }
    }

    /// Apply `count` ops and commit; `meta` is locked and the data device was flushed after
    /// those ops were queued.
    fn commit_locked(&self, meta: &mut MetaState, count: usize) -> Result<()> {
        self.apply_ops(meta, count)?;
        self.with_unapplied_released(meta, |_| Ok(()))
    }

    /// A management change: store the new catalog as transaction T + 1, apply queued ops,
    /// make the change and `set_transaction_id(T, T + 1)`, commit.
    fn catalog_transaction(
        &self,
        meta: &mut MetaState,
        taken: usize,
        mut catalog: Catalog,
        change: impl FnOnce(&mut PoolMetadata) -> Result<()>,
    ) -> Result<()> {
        self.apply_ops(meta, taken)?;
        let current = meta.md()?.transaction_id();
        let next = TransactionId(current.0 + 1);
        catalog.transaction_id = next.0;
        self.catalog_store.store(&catalog)?;
        self.with_unapplied_released(meta, |md| {
            change(md)?;
            md.set_transaction_id(current, next)
        })?;
        meta.catalog = catalog;
        self.catalog_store.committed(next.0)?;
        Ok(())
    }

    /// A metadata operation failed: abandon the transaction as dm-thin does. Out of metadata
    /// space → that mode; anything else → read-only with needs_check set on disk.
    fn metadata_failed(&self, meta: &mut MetaState, error: Error) -> Error {
        let out_of_space = matches!(error, Error::OutOfMetadataSpace { .. });
        self.log(format!("metadata operation failed: {error}"));
        meta.md = None;
        meta.ops.clear();
        meta.unapplied.clear();
        meta.passdown.clear();
        if !out_of_space {
            let _ = PoolMetadata::mark_needs_check(&*self.metadata_device);
        }
        match PoolMetadata::open(self.metadata_device.clone()) {
            Ok(md) => {
                meta.md = Some(md);
                self.set_mode(if out_of_space {
                    PoolMode::OutOfMetadataSpace
                } else {
                    PoolMode::ReadOnly
                });
            }
            Err(e) => {
                self.log(format!("reopening the metadata failed: {e}"));
                self.set_mode(PoolMode::Fail);
            }
        }
        error
    }

    /// Allocate a data block for provisioning. Out of space: commit (releasing blocks freed
    /// by discards), then error or wait per the pool's policy.
    pub(crate) fn alloc_data_block(&self) -> Result<u64> {
        let deadline = Instant::now() + self.options.no_space_timeout;
        let mut committed_once = false;
        loop {
            self.check_changes_allowed()?;
            let mut meta = self.lock_meta();
            let md = meta.md()?;
            match md.alloc_data_block() {
                Ok(block) => {
                    let block = block.0;
                    if block > INDEX_DATA_BLOCK_MAX {
                        return Err(Error::Invalid(format!(
                            "data block {block} beyond the engine's range"
                        )));
                    }
                    let free = md.data_space_map().free_count();
                    meta.unapplied.insert(block);
                    drop(meta);
                    if free <= self.options.low_water_mark_blocks
                        && !self.low_water_reached.swap(true, Ordering::AcqRel)
                    {
                        self.log(format!("low water mark reached: {free} free data blocks"));
                    }
                    if self.mode() == PoolMode::OutOfDataSpace {
                        self.set_mode(PoolMode::Write);
                    }
                    return Ok(block);
                }
                Err(Error::OutOfDataSpace { block_count }) => {
                    drop(meta);
                    if !committed_once {
                        committed_once = true;
                        self.commit()?;
                        continue;
                    }
                    self.set_mode(PoolMode::OutOfDataSpace);
                    if self.options.error_if_no_space {
                        return Err(Error::OutOfDataSpace { block_count });
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(Error::OutOfDataSpace { block_count });
                    }
                    let meta = self.lock_meta();
                    let wait = (deadline - now).min(Duration::from_millis(200));
                    let _ = self.space.wait_timeout(meta, wait);
                    committed_once = false;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Give back a block allocated for provisioning that will not be mapped (its write failed).
    pub(crate) fn release_unmapped(&self, block: u64) {
        let mut meta = self.lock_meta();
        if meta.unapplied.remove(&block) {
            if let Some(md) = meta.md.as_mut() {
                let _ = md.dec_data_block(DataBlock(block));
            }
        }
    }

    /// Queue a metadata change whose data is written.
    pub(crate) fn queue(&self, op: Op) {
        let mut meta = self.lock_meta();
        meta.ops.push(op);
    }
}
