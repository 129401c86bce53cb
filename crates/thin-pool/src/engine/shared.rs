//! The state a pool's threads share: [`Shared`] (devices, options, mode, the metadata
//! behind its mutex, the published volumes) and [`VolumeState`] (one volume's index, gate
//! and block locks).
//!
//! A volume's index is built on demand ([`Shared::index`]): activation, a snapshot and a
//! revert leave it unbuilt (a rename carries it over), and the first handle opened on the
//! volume (`Pool::volume`) walks its mapping tree under the commit lock and sets it, once. While a volume has no index no write has touched it (every data-path write goes
//! through an open handle, which built it), so its tree in the current transaction is its
//! whole truth: management operations (delete, resize, revert, rename, diff, usage) change
//! or read only the tree, `list` reads its details, and commits, the debug assertion on
//! freed blocks and the resync after a metadata failure skip it. The commit lock, held for
//! the build, keeps every commit and management change of that tree out meanwhile.
//!
//! Locks, in the order they are taken: a volume's gate (paused by snapshot and resize), the
//! commit lock (one commit or management operation at a time), a volume's block lock (per
//! virtual block, provisioning only), the metadata mutex (short critical sections: queue an
//! op, reserve a block, or a whole commit's apply-and-write).
//!
//! Panics: a thread that panics holding the metadata or the commit lock may have left the
//! transaction half-applied (some ops in the trees, others drained from the queue). So a
//! poisoned lock is never used as if nothing happened: whoever takes it next abandons the
//! transaction without writing anything ([`Shared::fail`]) and the pool goes to fail mode,
//! with the last committed transaction intact on disk. Commits and management changes catch
//! their own panics the same way ([`Shared::contained`]), so their caller gets an error, not
//! an unwind. Block locks and the event log guard nothing a panic can leave half-done.

use crate::engine::autoextend::SpaceWatch;
use crate::engine::catalog::{Catalog, CatalogStore, CatalogVolume};
use crate::engine::committer::Signal;
use crate::engine::data_device::DataDevice;
use crate::engine::gate::WriteGate;
use crate::engine::grace::{Limbo, Readers};
use crate::engine::index::Index;
use crate::engine::load::{build_index, TreeToIndex};
use crate::engine::options::{PoolMode, PoolOptions};
use crate::engine::stats::CommitCounters;
use crate::error::{Error, Result};
use crate::format::metadata::PoolMetadata;
use crate::ids::{BlockTime, Time, VirtualBlock, VolumeId};
use arc_swap::ArcSwap;
use persistent_data::BlockDevice;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

/// Block locks per volume (hashed by virtual block).
const BLOCK_LOCKS: usize = 256;

/// `open_count` of a volume claimed by a delete (or a revert or rename, `revert`).
const DELETING: usize = usize::MAX;

/// Events kept for [`crate::Pool::events`].
const EVENTS_MAX: usize = 1000;

/// A metadata change whose data is written, waiting for the next commit.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Op {
    /// Map `block` to the reserved data block in `mapping`.
    Insert {
        volume: VolumeId,
        block: VirtualBlock,
        mapping: BlockTime,
    },
    /// Unmap `block`.
    Remove {
        volume: VolumeId,
        block: VirtualBlock,
    },
}

/// What the metadata mutex guards.
pub(crate) struct MetaState {
    /// The metadata; None only while it is being reopened after a failure.
    pub(crate) md: Option<PoolMetadata>,
    /// Bumped each time `md` is reopened after a failure: reservations made before are void.
    pub(crate) generation: u64,
    pub(crate) catalog: Catalog,
    /// Ops queued and not applied, oldest first.
    pub(crate) ops: Vec<Op>,
    /// Ops queued since the pool opened, and ops taken off the queue (applied or dropped):
    /// `ops_queued - ops_taken == ops.len()`, checked at every apply.
    pub(crate) ops_queued: u64,
    pub(crate) ops_taken: u64,
    /// Data blocks freed by commits, held in the metadata until no I/O pinned before they
    /// were unmapped is left (`grace`).
    pub(crate) limbo: Limbo,
    /// When the commit under way started (its data flush, in `flush_and_lock`).
    pub(crate) commit_started: Option<Instant>,
}

impl MetaState {
    pub(crate) fn new(mut md: PoolMetadata, catalog: Catalog) -> MetaState {
        md.hold_freed_data_blocks();
        MetaState {
            md: Some(md),
            generation: 0,
            catalog,
            ops: Vec::new(),
            ops_queued: 0,
            ops_taken: 0,
            limbo: Limbo::default(),
            commit_started: None,
        }
    }

    pub(crate) fn md(&mut self) -> Result<&mut PoolMetadata> {
        self.md
            .as_mut()
            .ok_or(Error::ReadOnly { needs_check: true })
    }

    /// Queue an op behind the others.
    pub(crate) fn push(&mut self, op: Op) {
        self.ops.push(op);
        self.ops_queued += 1;
    }

    /// Take the `count` oldest ops off the queue.
    pub(crate) fn take_ops(&mut self, count: usize) -> Vec<Op> {
        assert_eq!(
            self.ops_queued - self.ops_taken,
            self.ops.len() as u64,
            "every queued op is taken exactly once"
        );
        let ops: Vec<Op> = self.ops.drain(..count).collect();
        self.ops_taken += ops.len() as u64;
        ops
    }
}

/// One volume's state, shared by its handles and the pool.
pub(crate) struct VolumeState {
    pub(crate) name: String,
    pub(crate) id: VolumeId,
    pub(crate) size_bytes: AtomicU64,
    pub(crate) read_only: AtomicBool,
    /// Every mapping of the volume, committed or queued, once built ([`Shared::index`]);
    /// unset while nothing used the volume since activation (or its snapshot, revert or
    /// rename): then its mapping tree alone holds its mappings.
    index: OnceLock<Arc<Index>>,
    /// Pool time of the volume's last snapshot: mappings older than it may be shared.
    pub(crate) snapshotted_time: AtomicU32,
    pub(crate) gate: WriteGate,
    block_locks: Vec<Mutex<()>>,
    /// Handles alive, or [`DELETING`] once a delete claimed the volume (then no handle
    /// can be opened; see [`VolumeState::open`]).
    open_count: AtomicUsize,
    /// The thin id of the volume it was snapshotted from ([`NO_ORIGIN`]: none, or deleted).
    origin: AtomicU32,
}

/// [`VolumeState`]'s origin when it has none (thin ids are 24 bits).
const NO_ORIGIN: u32 = u32::MAX;

impl VolumeState {
    /// A volume's state; `index` None leaves it to be built on first use.
    pub(crate) fn new(
        entry: &CatalogVolume,
        index: Option<Arc<Index>>,
        snapshotted_time: Time,
    ) -> VolumeState {
        VolumeState {
            name: entry.name.clone(),
            id: entry.id,
            size_bytes: AtomicU64::new(entry.size_bytes),
            read_only: AtomicBool::new(entry.read_only),
            index: index.map(OnceLock::from).unwrap_or_default(),
            snapshotted_time: AtomicU32::new(snapshotted_time.get()),
            gate: WriteGate::default(),
            block_locks: (0..BLOCK_LOCKS).map(|_| Mutex::new(())).collect(),
            open_count: AtomicUsize::new(0),
            origin: AtomicU32::new(entry.origin.map_or(NO_ORIGIN, VolumeId::get)),
        }
    }

    /// The index, if built.
    pub(crate) fn loaded_index(&self) -> Option<&Arc<Index>> {
        self.index.get()
    }

    /// The index of a volume that has one: every volume with an open handle does
    /// ([`crate::Pool::volume`] builds it before it hands the handle out), and only such a
    /// volume is provisioned or unmapped.
    pub(crate) fn index(&self) -> &Index {
        self.index
            .get()
            .unwrap_or_else(|| panic!("volume {:?} is used before its index is built", self.name))
    }

    /// The thin id of the volume this one was snapshotted from, while that volume exists.
    pub(crate) fn origin(&self) -> Option<VolumeId> {
        match self.origin.load(Ordering::Acquire) {
            NO_ORIGIN => None,
            id => Some(VolumeId::new(id)),
        }
    }

    /// Forget the origin if it is `deleted` (its thin id may be reused).
    pub(crate) fn forget_origin(&self, deleted: VolumeId) {
        let _ = self.origin.compare_exchange(
            deleted.get(),
            NO_ORIGIN,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// Count a new handle. Refused once a delete claimed the volume, so that a delete and
    /// an open are atomic with respect to each other.
    pub(crate) fn open(&self) -> Result<()> {
        let mut count = self.open_count.load(Ordering::Acquire);
        loop {
            if count == DELETING {
                return Err(Error::Busy(format!(
                    "volume {:?} is being deleted, reverted or renamed",
                    self.name
                )));
            }
            match self.open_count.compare_exchange_weak(
                count,
                count + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(()),
                Err(now) => count = now,
            }
        }
    }

    /// Count one more handle beside an existing one (a clone).
    pub(crate) fn open_another(&self) {
        let before = self.open_count.fetch_add(1, Ordering::AcqRel);
        assert!(
            before != 0 && before != DELETING,
            "a handle is cloned only from a live one"
        );
    }

    /// A handle is dropped.
    pub(crate) fn close(&self) {
        let before = self.open_count.fetch_sub(1, Ordering::AcqRel);
        assert!(
            before != 0 && before != DELETING,
            "volume {:?}: a handle closed twice",
            self.name
        );
    }

    /// Handles alive (0 while being deleted).
    pub(crate) fn open_count(&self) -> usize {
        match self.open_count.load(Ordering::Acquire) {
            DELETING => 0,
            count => count,
        }
    }

    /// Claim the volume for deletion: refused while any handle is alive; from then on no
    /// handle can be opened until [`VolumeState::end_delete`] (a failed delete) or forever.
    pub(crate) fn begin_delete(&self) -> Result<()> {
        self.open_count
            .compare_exchange(0, DELETING, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
            .map_err(|_| Error::Busy(format!("volume {:?} is open", self.name)))
    }

    /// A delete failed: handles may be opened again.
    pub(crate) fn end_delete(&self) {
        let claimed =
            self.open_count
                .compare_exchange(DELETING, 0, Ordering::AcqRel, Ordering::Acquire);
        assert!(
            claimed.is_ok(),
            "volume {:?} was claimed for deletion",
            self.name
        );
    }

    /// The lock ordering provisioning of `block` (hashed: one of [`BLOCK_LOCKS`]).
    pub(crate) fn block_lock(&self, block: VirtualBlock) -> MutexGuard<'_, ()> {
        self.block_locks[block_lock_index(block)]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The locks of every block in `blocks`, each taken once, in the order of their
    /// indexes: two threads locking overlapping sets take their common locks in the same
    /// order, so they cannot deadlock (a thread holding one block lock never takes another).
    pub(crate) fn block_locks(
        &self,
        blocks: impl Iterator<Item = VirtualBlock>,
    ) -> Vec<MutexGuard<'_, ()>> {
        let mut indexes: Vec<usize> = blocks.map(block_lock_index).collect();
        indexes.sort_unstable();
        indexes.dedup();
        indexes
            .into_iter()
            .map(|i| {
                self.block_locks[i]
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
            })
            .collect()
    }

    /// Whether a mapping may be shared with a snapshot (made before the volume's last
    /// snapshot; spec §8.5), so a write must break sharing instead of writing in place.
    pub(crate) fn is_shared(&self, mapping: BlockTime) -> bool {
        self.snapshotted_time.load(Ordering::Acquire) > mapping.time().get()
    }
}

/// Which of a volume's [`BLOCK_LOCKS`] orders provisioning of `block`.
fn block_lock_index(block: VirtualBlock) -> usize {
    (block.get().wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as usize % BLOCK_LOCKS
}

/// Everything the pool's threads share.
pub(crate) struct Shared {
    pub(crate) data: Arc<dyn DataDevice>,
    pub(crate) metadata_device: Arc<dyn BlockDevice>,
    pub(crate) block_size_bytes: u64,
    pub(crate) options: PoolOptions,
    pub(crate) meta: Mutex<MetaState>,
    /// Serializes commits (and everything that applies queued ops).
    commit_lock: Mutex<()>,
    /// Signalled when data space may have appeared.
    pub(crate) space: Condvar,
    pub(crate) volumes: ArcSwap<BTreeMap<String, Arc<VolumeState>>>,
    mode: AtomicU8,
    /// The pool time new mappings are made at (the metadata's, mirrored for the data path).
    time: AtomicU32,
    /// Low-water marks and automatic growth (`autoextend`).
    pub(crate) watch: SpaceWatch,
    /// Wakes and stops the commit thread.
    pub(crate) committer: Signal,
    pub(crate) catalog_store: Box<dyn CatalogStore>,
    events: Mutex<Vec<String>>,
    /// Why the pool is in fail mode, once it is.
    fail_reason: Mutex<Option<String>>,
    /// Threads doing lock-free I/O on data blocks they looked up (`grace`).
    pub(crate) readers: Readers,
    /// Commits and their durations, for monitoring (`stats`).
    pub(crate) commit_counters: CommitCounters,
}

impl Shared {
    /// Shared state over open metadata and devices.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        data: Arc<dyn DataDevice>,
        metadata_device: Arc<dyn BlockDevice>,
        block_size_bytes: u64,
        options: PoolOptions,
        meta: MetaState,
        volumes: BTreeMap<String, Arc<VolumeState>>,
        mode: PoolMode,
        time: Time,
        catalog_store: Box<dyn CatalogStore>,
    ) -> Shared {
        Shared {
            watch: SpaceWatch::new(&options),
            data,
            metadata_device,
            block_size_bytes,
            options,
            meta: Mutex::new(meta),
            commit_lock: Mutex::new(()),
            space: Condvar::new(),
            volumes: ArcSwap::from_pointee(volumes),
            mode: AtomicU8::new(mode as u8),
            time: AtomicU32::new(time.get()),
            committer: Signal::default(),
            catalog_store,
            events: Mutex::new(Vec::new()),
            fail_reason: Mutex::new(None),
            readers: Readers::default(),
            commit_counters: CommitCounters::default(),
        }
    }

    pub(crate) fn mode(&self) -> PoolMode {
        PoolMode::from_u8(self.mode.load(Ordering::Acquire))
    }

    /// Change the mode. Fail mode is final: nothing leaves it but a reopen.
    pub(crate) fn set_mode(&self, mode: PoolMode) {
        let fail = PoolMode::Fail as u8;
        let changed = self
            .mode
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |old| {
                (old != fail && old != mode as u8).then_some(mode as u8)
            });
        if let Ok(old) = changed {
            let from = self.mode_name(PoolMode::from_u8(old));
            let to = self.mode_name(mode);
            if mode == PoolMode::Write {
                tracing::info!(from, to, "pool mode changed");
            } else {
                tracing::warn!(from, to, "pool mode changed");
            }
            self.record(format!(
                "pool mode {:?} -> {mode:?}",
                PoolMode::from_u8(old)
            ));
        }
    }

    /// The mode's name in logs: dm-thin's status word, with read-only told apart by cause.
    fn mode_name(&self, mode: PoolMode) -> &'static str {
        match mode {
            PoolMode::OutOfMetadataSpace => "out_of_metadata_space",
            PoolMode::ReadOnly if self.options.read_only => "read_only",
            PoolMode::ReadOnly => "needs_check",
            other => other.as_str(),
        }
    }

    /// Why the pool is in fail mode (None in any other mode).
    pub(crate) fn fail_reason(&self) -> Option<String> {
        if self.mode() != PoolMode::Fail {
            return None;
        }
        self.fail_reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Keep the first reason the pool failed for, for [`Shared::fail_reason`].
    pub(crate) fn record_fail_reason(&self, reason: &str) {
        let mut fail_reason = self.fail_reason.lock().unwrap_or_else(|e| e.into_inner());
        if fail_reason.is_none() {
            *fail_reason = Some(reason.to_string());
        }
    }

    /// Abandon the transaction and enter fail mode: the in-memory metadata (with whatever
    /// part of the transaction was applied) is dropped without writing anything, so the
    /// device keeps the last committed transaction; queued ops and reservations go with it
    /// (writes holding a reservation fail), and waiters for space wake up to fail.
    /// Reads, writes and changes then fail with EIO until the pool is reopened.
    pub(crate) fn fail(&self, meta: &mut MetaState, reason: String) {
        self.record_fail_reason(&reason);
        self.log_warn(format!(
            "pool failed: {reason}; the transaction is abandoned, the last commit stays on disk"
        ));
        meta.md = None;
        meta.generation += 1;
        meta.ops.clear();
        meta.ops_taken = meta.ops_queued;
        self.set_mode(PoolMode::Fail);
        self.space.notify_all();
    }

    /// Run `operation` on the locked metadata; if it panics, fail the pool ([`Shared::fail`])
    /// and return the panic as an error instead of unwinding further.
    pub(crate) fn contained<T>(
        &self,
        meta: &mut MetaState,
        what: &str,
        operation: impl FnOnce(&mut MetaState) -> Result<T>,
    ) -> Result<T> {
        let result = catch_unwind(AssertUnwindSafe(|| operation(&mut *meta)));
        result.unwrap_or_else(|payload| {
            let reason = format!("{what} panicked: {}", panic_message(&*payload));
            self.fail(meta, reason.clone());
            Err(Error::Internal(reason))
        })
    }

    /// The pool time new mappings are made at.
    pub(crate) fn time(&self) -> Time {
        Time::new(self.time.load(Ordering::Acquire)).expect("only 24-bit times are stored")
    }

    pub(crate) fn set_time(&self, time: Time) {
        self.time.store(time.get(), Ordering::Release);
    }

    /// An event of the pool: logged at info and kept for [`crate::Pool::events`].
    pub(crate) fn log(&self, event: String) {
        tracing::info!("{event}");
        self.record(event);
    }

    /// A failure of the pool: logged at warn and kept for [`crate::Pool::events`].
    pub(crate) fn log_warn(&self, event: String) {
        tracing::warn!("{event}");
        self.record(event);
    }

    /// Keeps `event` for [`crate::Pool::events`] without logging it.
    pub(crate) fn record(&self, event: String) {
        let mut events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        if events.len() >= EVENTS_MAX {
            events.remove(0);
        }
        events.push(event);
    }

    pub(crate) fn events(&self) -> Vec<String> {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The metadata lock. Poisoned (a thread panicked holding it, maybe half-way through
    /// changing the transaction): the pool fails first ([`Shared::fail`]).
    pub(crate) fn lock_meta(&self) -> MutexGuard<'_, MetaState> {
        match self.meta.lock() {
            Ok(meta) => meta,
            Err(poisoned) => {
                let mut meta = poisoned.into_inner();
                self.fail(
                    &mut meta,
                    "a thread panicked holding the metadata lock".to_string(),
                );
                self.meta.clear_poison();
                meta
            }
        }
    }

    /// The commit lock. Poisoned (a commit or management operation panicked, maybe between
    /// its catalog and its metadata change): the pool fails first ([`Shared::fail`]).
    pub(crate) fn lock_commit(&self) -> MutexGuard<'_, ()> {
        match self.commit_lock.lock() {
            Ok(guard) => guard,
            Err(poisoned) => {
                let guard = poisoned.into_inner();
                let mut meta = self.lock_meta();
                if self.mode() != PoolMode::Fail {
                    self.fail(
                        &mut meta,
                        "a commit or management operation panicked".to_string(),
                    );
                }
                drop(meta);
                self.commit_lock.clear_poison();
                guard
            }
        }
    }

    /// Whether the mode lets metadata change (allocations, commits, management).
    pub(crate) fn check_changes_allowed(&self) -> Result<()> {
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

    pub(crate) fn flush_data(&self) -> Result<()> {
        self.data
            .flush()
            .map_err(io_error("flushing the data device".to_string()))
    }

    pub(crate) fn volume_named(&self, name: &str) -> Result<Arc<VolumeState>> {
        self.volumes
            .load()
            .get(name)
            .cloned()
            .ok_or_else(|| Error::NoSuchVolume(name.to_string()))
    }

    /// `volume`'s index, built from its mapping tree if it has none yet (see the module
    /// doc). Once built this is one atomic load. The build holds the commit lock for a walk
    /// of the volume's tree (17 ms for 1M mappings, 0.36 s for 10M; commits and management
    /// operations wait, reads and writes go on) and the metadata mutex only for a moment
    /// before and after it; concurrent first uses build it once and wait for it. Fails if
    /// the metadata is gone (fail mode) or the tree breaks a rule the index relies on
    /// (corruption: the volume cannot be opened).
    pub(crate) fn index<'a>(&self, volume: &'a VolumeState) -> Result<&'a Arc<Index>> {
        if let Some(index) = volume.index.get() {
            return Ok(index);
        }
        // No commit or management change runs until the index is set: the tree of a volume
        // without an index is its committed one (no queued op of it exists, and a change
        // that failed left the transaction or was abandoned with it), whose blocks are never
        // written in place, so it can be read without the metadata mutex.
        let _commit = self.lock_commit();
        if let Some(index) = volume.index.get() {
            return Ok(index);
        }
        let tree = {
            let meta = self.lock_meta();
            let md = meta
                .md
                .as_ref()
                .ok_or(Error::ReadOnly { needs_check: true })?;
            TreeToIndex::of(md, volume)?
        };
        let index = build_index(&tree, volume, self.block_size_bytes).inspect_err(|e| {
            self.log_warn(format!(
                "volume {:?}: building its index failed: {e}",
                volume.name
            ))
        })?;
        // Set under the metadata mutex, which `list`, the commit's assertion and the resync
        // after a metadata failure read indexes under.
        let _meta = self.lock_meta();
        let built = volume.index.set(Arc::new(index)).is_ok();
        assert!(built, "index builds are serialized by the commit lock");
        Ok(volume.index.get().expect("just set"))
    }

    pub(crate) fn publish_volume(&self, volume: Arc<VolumeState>) {
        let mut volumes = (**self.volumes.load()).clone();
        volumes.insert(volume.name.clone(), volume);
        self.volumes.store(Arc::new(volumes));
    }

    pub(crate) fn unpublish_volume(&self, name: &str) {
        let mut volumes = (**self.volumes.load()).clone();
        volumes.remove(name);
        self.volumes.store(Arc::new(volumes));
    }
}

/// The message of a panic's payload (a `&str` or a `String`, as `panic!` makes them).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(message) = payload.downcast_ref::<&str>() {
        (*message).to_string()
    } else if let Some(message) = payload.downcast_ref::<String>() {
        message.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// Map an I/O error outside persistent-data to [`Error::Io`] saying what was being done.
pub(crate) fn io_error(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { what, source }
}
