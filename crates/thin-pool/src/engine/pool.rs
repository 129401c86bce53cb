//! The pool handle: the engine's façade. Every method delegates to the owners `open`
//! assembled (`Meta`, `Volumes`, `Provisioner`, the watch, the health) or to the
//! management functions over them (`manage`, `adopt`, `grow`, `revert`, `usage`, `diff`,
//! `trim`, `listing`); this is the only `impl Pool`.
//!
//! Modes follow dm-thin (spec §10.5): `Write`, `OutOfDataSpace` (writes that need a block
//! error with ENOSPC or wait up to the no-space timeout for growth), `OutOfMetadataSpace`
//! (no metadata changes until the metadata device grows), `ReadOnly` (option, or after a
//! metadata error, with needs_check set) and `Fail`. See ARCHITECTURE.md for the threads,
//! locks and paths.

use crate::engine::adopt::Disagreements;
use crate::engine::block_device::{self, DevicePaths};
use crate::engine::catalog::CatalogStore;
use crate::engine::catalog::PartialReceive;
use crate::engine::catalog_dir::DirCatalog;
use crate::engine::data_device::DataDevice;
use crate::engine::diff::{Delta, VolumeDiff};
use crate::engine::directory::PoolDirectory;
use crate::engine::grow::{Resized, Shrink};
use crate::engine::layout::pool_exists;
use crate::engine::listing::{self, StatusSources};
use crate::engine::open::{self, Owners};
use crate::engine::options::{CreateOptions, PoolMode, PoolOptions, PoolStatus, VolumeInfo};
use crate::engine::receive::{self, ReceiveSpec, VolumeReceiver};
use crate::engine::receive_partial;
use crate::engine::stats::CommitStats;
use crate::engine::usage::VolumeSpace;
use crate::engine::volume::Volume;
use crate::engine::volumes::VolumeGeneration;
use crate::engine::{adopt, diff, grow, manage, revert, trim, usage};
use crate::error::{io_error, Error, Result};
use crate::ids::{TransactionId, VirtualBlock, VolumeId};
use persistent_data::BlockDevice;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// A thin pool, open for I/O and management. Cheap to clone (shared owners).
#[derive(Clone)]
pub struct Pool {
    owners: Arc<Owners>,
    _lock_file: Option<Arc<std::fs::File>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("block_size_bytes", &self.block_size_bytes())
            .finish()
    }
}

impl Pool {
    /// Create a pool in directory `dir` (created if missing; must not hold a pool): files
    /// `metadata` and `data`, and the volume catalog. Returns it open.
    ///
    /// Every limit is checked before a file is made (`open::check_create`). The metadata
    /// file is preallocated (so a full host file system cannot fail a commit); the data
    /// file is sparse, as thin provisioning intends (a host ENOSPC on it reaches the writer
    /// as ENOSPC). A failed create removes what it made.
    pub fn create(dir: &Path, create: &CreateOptions, options: PoolOptions) -> Result<Pool> {
        let layout = open::check_create(dir, create)?;
        let (metadata, data) = open::create_files(dir, &layout)?;
        let pool = Pool::open_parts(
            metadata,
            data,
            Box::new(DirCatalog::new(dir)),
            options,
            None,
        )
        .inspect_err(|_| {
            let _ = std::fs::remove_file(dir.join(crate::engine::layout::METADATA_FILE));
            let _ = std::fs::remove_file(dir.join(crate::engine::layout::DATA_FILE));
        })?;
        pool.owners.watch.set_host_dir(dir.to_path_buf());
        Ok(pool)
    }

    /// Open the pool in directory `dir`, taking an exclusive lock on its metadata. A
    /// directory that names block devices (`devices.json`) opens the pool on them
    /// ([`Pool::open_devices`]).
    pub fn open(dir: &Path, options: PoolOptions) -> Result<Pool> {
        if let Some(devices) = DevicePaths::load(dir)? {
            return Pool::open_devices(dir, &devices, options);
        }
        let directory = Arc::new(
            PoolDirectory::open(dir).map_err(io_error(format!("opening {}", dir.display())))?,
        );
        let (metadata, data, lock) = open::open_files(&directory, &options)?;
        let catalog = Box::new(DirCatalog::in_directory(directory));
        let pool = Pool::open_parts(metadata, data, catalog, options, Some(lock))?;
        pool.owners.watch.set_host_dir(dir.to_path_buf());
        Ok(pool)
    }

    /// Whether `dir` holds a pool.
    pub fn exists(dir: &Path) -> bool {
        pool_exists(dir)
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
        open::format(&metadata, &data, &*catalog, block_size_bytes)?;
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
        let owners = open::assemble(metadata, data, catalog_store, options)?;
        if let Some(warning) = adopt::open_warning(&adopt::disagreements(&owners.meta)) {
            owners.health.log_warn(warning);
        }
        Ok(Pool {
            owners: Arc::new(owners),
            _lock_file: lock,
        })
    }

    /// Create a pool on two block devices, recorded in `dir` (`devices.json`, the catalog).
    /// Their sizes are the devices' (the metadata device up to the format's limit). A
    /// metadata device that already holds pool metadata is refused (`thinpool import`
    /// takes such a pool over). Returns the pool open.
    pub fn create_on_devices(
        dir: &Path,
        devices: &DevicePaths,
        block_size_bytes: u64,
        options: PoolOptions,
    ) -> Result<Pool> {
        let (metadata, data, lock) =
            block_device::create_on_devices(dir, devices, block_size_bytes)?;
        Pool::open_on(metadata, data, dir, options, lock)
    }

    /// Open the pool whose devices `dir` names.
    pub fn open_devices(dir: &Path, devices: &DevicePaths, options: PoolOptions) -> Result<Pool> {
        let (metadata, data, lock) = block_device::open_devices(dir, devices, options.read_only)?;
        Pool::open_on(metadata, data, dir, options, lock)
    }

    fn open_on(
        metadata: Arc<dyn BlockDevice>,
        data: block_device::BlockDataDevice,
        dir: &Path,
        mut options: PoolOptions,
        lock: Option<Arc<std::fs::File>>,
    ) -> Result<Pool> {
        let refusal = block_device::passdown_refusal(&data, &mut options);
        let catalog = Box::new(DirCatalog::new(dir));
        let pool = Pool::open_parts(metadata, Arc::new(data), catalog, options, lock)?;
        if let Some(event) = refusal {
            pool.owners.health.log(event);
        }
        Ok(pool)
    }

    /// Data block size in bytes.
    pub fn block_size_bytes(&self) -> u64 {
        self.owners.meta.block_size_bytes()
    }

    /// The data device (for benchmarks reading its counters).
    pub fn data_device(&self) -> &Arc<dyn DataDevice> {
        &self.owners.data
    }

    /// Current mode.
    pub fn mode(&self) -> PoolMode {
        self.owners.health.mode()
    }

    /// Events logged so far (low water mark, mode changes), oldest first.
    pub fn events(&self) -> Vec<String> {
        self.owners.health.events()
    }

    /// Open a volume by name for I/O. Refused (busy) while a delete of it is under way: a
    /// delete that succeeds leaves no handle behind. The first open of a volume since
    /// activation (or its snapshot or revert) builds its index from its mapping tree,
    /// holding the commit lock for that walk (commits and management operations wait, I/O
    /// goes on); an error there (a tree that breaks a rule) refuses the open.
    pub fn volume(&self, name: &str) -> Result<Volume> {
        let owners = &*self.owners;
        let state = owners
            .volumes
            .named(name)
            .map_err(|e| adopt::orphan_or(&owners.meta, name, e))?;
        Volume::open(owners.provisioner.clone(), state, |state| {
            owners.meta.index(state).cloned()
        })
    }

    /// Every volume, in name order. A volume's mapped blocks come from its index when it
    /// has one (every mapping, committed or queued), else from its details in the metadata
    /// (it has no queued mapping then): listing builds no index.
    pub fn list(&self) -> Vec<VolumeInfo> {
        listing::infos(&self.owners.meta, &self.owners.volumes, None)
    }

    /// Information about one volume (as [`Pool::list`] gives it, counting only its own
    /// mappings).
    pub fn info(&self, name: &str) -> Result<VolumeInfo> {
        listing::infos(&self.owners.meta, &self.owners.volumes, Some(name))
            .pop()
            .ok_or_else(|| Error::NoSuchVolume(name.to_string()))
    }

    /// Whether `name`'s index is built (tests and benchmarks: a volume gets one on its
    /// first open, see [`Pool::volume`]).
    pub fn index_built(&self, name: &str) -> Result<bool> {
        Ok(self.owners.volumes.named(name)?.loaded_index().is_some())
    }

    /// The pool's status (commits nothing).
    pub fn status(&self) -> PoolStatus {
        let owners = &*self.owners;
        listing::status(&StatusSources {
            meta: &owners.meta,
            volumes: &owners.volumes,
            health: &owners.health,
            watch: &owners.watch,
            options: &owners.options,
        })
    }

    /// Commits since the pool opened, and how long they took (a snapshot of lock-free
    /// counters: takes no lock, commits nothing).
    pub fn commit_stats(&self) -> CommitStats {
        let durations = self.owners.meta.commit_durations();
        CommitStats {
            commit_count: durations.count(),
            durations,
        }
    }

    /// Commit now: flush the data device, then commit the metadata.
    pub fn commit(&self) -> Result<()> {
        self.owners.meta.commit()
    }

    /// Stop the workers and commit. Further I/O through open volumes still works, but is
    /// only committed by explicit flushes.
    pub fn close(&self) -> Result<()> {
        self.owners.autoextender.stop();
        self.owners.committer.stop();
        assert!(
            self.owners.committer.stopped(),
            "no periodic commit after close"
        );
        if matches!(self.mode(), PoolMode::Write | PoolMode::OutOfDataSpace) {
            self.owners.meta.commit()?;
        }
        Ok(())
    }

    /// A consistency check of the engine's in-memory state against the metadata (tests):
    /// after a commit, every built index equals its volume's mapping tree.
    pub fn verify_index(&self) -> Result<()> {
        listing::verify_index(&self.owners.meta, &self.owners.volumes)
    }

    /// Create a thin volume of `size_bytes` (a multiple of 512).
    pub fn create_volume(&self, name: &str, size_bytes: u64) -> Result<VolumeInfo> {
        manage::create_volume(&self.owners.meta, &self.owners.volumes, name, size_bytes)?;
        self.info(name)
    }

    /// Snapshot `origin` as `name`. Pauses only the origin's writes, briefly.
    pub fn snapshot(&self, origin: &str, name: &str, read_only: bool) -> Result<VolumeInfo> {
        let owners = &*self.owners;
        manage::snapshot(&owners.meta, &owners.volumes, origin, name, read_only)?;
        self.info(name)
    }

    /// Delete a volume. Refused (busy) while it is open; from the moment it is claimed
    /// until it is gone no handle can be opened, so when it returns no handle reaches the
    /// volume, and its thin id and data blocks can be given to another.
    pub fn delete_volume(&self, name: &str) -> Result<()> {
        manage::delete_volume(&self.owners.meta, &self.owners.volumes, name)
            .map_err(|e| adopt::orphan_or(&self.owners.meta, name, e))
    }

    /// Where the catalog and the metadata disagree: thin ids only the metadata holds
    /// (unadopted) and entries whose thin id it lacks (orphaned). Neither is served.
    pub fn disagreements(&self) -> Disagreements {
        adopt::disagreements(&self.owners.meta)
    }

    /// Name the unadopted thin id `id` as `name` of `size_bytes` (at least its highest
    /// mapped block), recording `origin` (a served volume) as its origin; served at once.
    /// Refused for an id the catalog has or the metadata lacks, or a name in use.
    pub fn adopt_volume(
        &self,
        id: VolumeId,
        name: &str,
        size_bytes: u64,
        origin: Option<&str>,
    ) -> Result<VolumeInfo> {
        let adoption = adopt::Adoption {
            id,
            name,
            size_bytes,
            origin,
        };
        adopt::adopt(&self.owners.meta, &self.owners.volumes, &adoption)?;
        self.info(name)
    }

    /// Drop the catalog entry `name` whose thin id is not in the metadata. Refused for a
    /// volume the metadata holds (that is [`Pool::delete_volume`]).
    pub fn forget_volume(&self, name: &str) -> Result<()> {
        adopt::forget(&self.owners.meta, &self.owners.volumes, name)
    }

    /// Change a volume's virtual size. Growing is allowed while the volume is open.
    /// Shrinking is refused (busy) while it is open, and refused
    /// ([`Error::ShrinkWouldUnmap`](crate::Error::ShrinkWouldUnmap), saying how much) if it
    /// would unmap mapped blocks, unless `shrink` is [`Shrink::DropData`]; the answer says
    /// how much it unmapped.
    pub fn resize_volume(&self, name: &str, size_bytes: u64, shrink: Shrink) -> Result<Resized> {
        let owners = &*self.owners;
        let unmapped =
            grow::resize_volume(&owners.meta, &owners.volumes, name, size_bytes, shrink)?;
        Ok(Resized::new(self.info(name)?, unmapped))
    }

    /// Give `volume` the content and size of `snapshot` (the thin-pool equivalent of
    /// `lvconvert --merge`; see `revert`). Refused (busy) while `volume` is open, or
    /// `snapshot` when `delete_snapshot` is set.
    pub fn revert_volume(
        &self,
        volume: &str,
        snapshot: &str,
        delete_snapshot: bool,
    ) -> Result<VolumeInfo> {
        let owners = &*self.owners;
        revert::revert_volume(
            &owners.meta,
            &owners.volumes,
            volume,
            snapshot,
            delete_snapshot,
        )?;
        self.info(volume)
    }

    /// Start receiving a volume (`thin_pool::stream`): nothing is visible until
    /// [`VolumeReceiver::finish`] makes it in one transaction; dropping the receiver
    /// abandons it. Refused, with nothing changed, for a name in use, a replay (the content
    /// id is held already) or an incremental whose base content is not here.
    pub fn receive_volume(&self, spec: ReceiveSpec) -> Result<VolumeReceiver> {
        let owners = &*self.owners;
        VolumeReceiver::begin(
            owners.meta.clone(),
            owners.volumes.clone(),
            owners.data.clone(),
            spec,
            |name| self.volume(name),
        )
    }

    /// Continue the partial receive `spec.name` with a stream whose records start at
    /// `offset` (see `engine/receive_partial.rs`). Refused, with nothing changed, for a
    /// name that keeps none, another stream's, or one at another offset (a stale token).
    pub fn resume_receive(&self, spec: ReceiveSpec, offset: u64) -> Result<VolumeReceiver> {
        let owners = &*self.owners;
        receive_partial::resume(
            owners.meta.clone(),
            owners.volumes.clone(),
            owners.data.clone(),
            spec,
            offset,
            |name| self.volume(name),
        )
    }

    /// The partial receives kept (`thinpool receive --resumable` interrupted).
    pub fn partial_receives(&self) -> Vec<PartialReceive> {
        receive_partial::list(&self.owners.meta)
    }

    /// Drop partial receive `name`: the blocks it holds are freed, in one transaction.
    pub fn abort_receive(&self, name: &str) -> Result<PartialReceive> {
        receive_partial::abort(&self.owners.meta, name)
    }

    /// The content id of a volume (`receive`), if it has one.
    pub fn content_id(&self, name: &str) -> Result<Option<String>> {
        receive::content_id(&self.owners.meta, &self.owners.volumes, name)
    }

    /// The content id of a read-only volume, given one (a transaction) if it has none.
    pub fn assign_content_id(&self, name: &str) -> Result<String> {
        receive::assign_content_id(&self.owners.meta, &self.owners.volumes, name)
    }

    /// Rename a volume (catalog only). Refused while it is open, or if `new` is taken.
    pub fn rename_volume(&self, old: &str, new: &str) -> Result<VolumeInfo> {
        revert::rename_volume(&self.owners.meta, &self.owners.volumes, old, new)?;
        self.info(new)
    }

    /// Grow the data device to `size_bytes` (a regular data file is extended; a block
    /// device must already be that large) and the pool with it, letting queued writes
    /// proceed. Returns the number of data blocks.
    pub fn grow_data(&self, size_bytes: u64) -> Result<u64> {
        let owners = &*self.owners;
        grow::grow_data(&owners.meta, &*owners.data, &owners.health, size_bytes)
    }

    /// Grow the metadata device to `size_bytes` (a regular file is extended; None: use the
    /// device's current size) and the metadata space map with it. Returns the number of
    /// metadata blocks the space map manages.
    pub fn grow_metadata(&self, size_bytes: Option<u64>) -> Result<u64> {
        grow::grow_metadata(&self.owners.meta, size_bytes)
    }

    /// Set the user transaction id (the catalog follows it).
    pub fn set_transaction_id(&self, current: TransactionId, new: TransactionId) -> Result<()> {
        manage::set_transaction_id(&self.owners.meta, current, new)
    }

    /// Hold a metadata snapshot (so `thin_dump -m` can read a consistent tree while serving).
    pub fn reserve_metadata_snap(&self) -> Result<u64> {
        manage::reserve_metadata_snap(&self.owners.meta)
    }

    /// Release the held metadata snapshot.
    pub fn release_metadata_snap(&self) -> Result<()> {
        manage::release_metadata_snap(&self.owners.meta)
    }

    /// The space of every volume as of the last commit, in catalog order (see `usage`:
    /// holds the metadata lock only to take and check a token).
    pub fn usage(&self) -> Result<Vec<VolumeSpace>> {
        usage::usage(&self.owners.meta)
    }

    /// The virtual blocks in which `target` differs from `base`, at block granularity:
    /// mapped in one only, or mapped to different data blocks (times are not compared).
    /// `blocks` restricts the comparison to a range of virtual blocks (the cost then follows
    /// the difference inside it). Reflects every write completed before the call (see
    /// `diff` for the locks it holds).
    pub fn diff(
        &self,
        base: &str,
        target: &str,
        blocks: Option<Range<VirtualBlock>>,
    ) -> Result<VolumeDiff> {
        diff::diff(
            &self.owners.meta,
            &self.owners.volumes,
            base,
            target,
            blocks,
            None,
        )
    }

    /// [`Pool::diff`], counting the virtual blocks compared in `progress` (out of those
    /// asked for), for a progress bar another thread draws: the same answer, walked in
    /// bounded parts of the same committed trees.
    pub fn diff_with_progress(
        &self,
        base: &str,
        target: &str,
        blocks: Option<Range<VirtualBlock>>,
        progress: &crate::progress::Progress,
    ) -> Result<VolumeDiff> {
        diff::diff(
            &self.owners.meta,
            &self.owners.volumes,
            base,
            target,
            blocks,
            Some(progress),
        )
    }

    /// [`Pool::diff`] of two volumes bound by their generations ([`Pool::generation`]),
    /// over `blocks`, reading at most about `nodes_max` btree nodes (no lock held, see
    /// `diff`): it answers `blocks.start..compared_end`, at least one block. Fails with
    /// [`Error::VolumeChanged`] once either volume is not that generation any more.
    pub fn diff_bound(
        &self,
        base: (&str, VolumeGeneration),
        target: (&str, VolumeGeneration),
        blocks: Range<VirtualBlock>,
        nodes_max: u64,
    ) -> Result<VolumeDiff> {
        diff::diff_bound(
            &self.owners.meta,
            &self.owners.volumes,
            [base, target],
            blocks,
            nodes_max,
        )
    }

    /// Which incarnation of volume `name` this is: it changes when the name is given to
    /// another volume (delete and re-create), or the volume another content history
    /// (revert) or another name (rename), never with writes or resizes. In memory only.
    pub fn generation(&self, name: &str) -> Result<VolumeGeneration> {
        Ok(self.owners.volumes.named(name)?.generation())
    }

    /// `thin_delta`'s report of `base` (left) and `target` (right): every mapped range of
    /// either, `same` included, over the whole trees. Listing `same` ranges reads the
    /// shared subtrees, so this costs the mapped size; [`Pool::diff`] costs only the
    /// difference.
    pub fn delta(&self, base: &str, target: &str) -> Result<Delta> {
        diff::delta(&self.owners.meta, &self.owners.volumes, base, target)
    }

    /// Discard every free data block on the data device. Returns the bytes given back that
    /// passdown or an earlier trim had not given back since they were freed (every free
    /// block is discarded; each is counted once per free).
    pub fn trim(&self) -> Result<u64> {
        self.trim_with_progress(&crate::progress::Progress::new())
    }

    /// [`Pool::trim`], counting the data blocks looked at in `progress` (out of the data
    /// device's), for a progress bar another thread draws.
    pub fn trim_with_progress(&self, progress: &crate::progress::Progress) -> Result<u64> {
        trim::trim(
            &self.owners.meta,
            &*self.owners.data,
            &self.owners.watch,
            progress,
        )
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        if Arc::strong_count(&self.owners) == 1 {
            let _ = self.close();
        }
    }
}
