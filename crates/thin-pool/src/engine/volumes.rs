//! The volume registry: the published volumes by name ([`Volumes`]) and each volume's
//! shared state ([`VolumeState`]: size, flags, write gate, block locks, open count, its
//! index once built). Fields are private; every change goes through a method that keeps
//! its rule.
//!
//! A volume's index is built on demand (`Meta::index`): activation, a snapshot and a
//! revert leave it unbuilt (a rename carries it over), and the first handle opened on the
//! volume walks its mapping tree under the commit lock and sets it, once. While a volume
//! has no index no write has touched it (every data-path write goes through an open handle,
//! which built it), so its tree in the current transaction is its whole truth: management
//! operations change or read only the tree, `list` reads its details, and commits, the
//! debug assertion on freed blocks and the resync after a metadata failure skip it.
//!
//! Generations: a state has a [`VolumeGeneration`] no other state of the process had (a
//! counter), and [`Volumes::publish`] gives it a new one: so every path that gives a name
//! another volume, or a volume another content history, bumps it by publishing (create,
//! delete and re-create, revert, rename; adopt must publish too), and one that removes a
//! volume unpublishes it (delete; forget too), after which no generation matches. A path
//! that changes what a published volume is without publishing calls
//! [`VolumeState::renew_generation`]. Writes, discards, snapshots of it and resizes keep
//! it. In memory only: nothing that binds a generation (an NBD diff context) outlives the
//! process.
//!
//! Locks: a volume's gate (paused by snapshot and resize) is taken before the commit lock,
//! a block lock (per virtual block, provisioning only) after it and before the metadata
//! mutex. Block locks guard nothing a panic can leave half-done.

use crate::engine::catalog::CatalogVolume;
use crate::engine::gate::WriteGate;
use crate::engine::index::Index;
use crate::error::{Error, Result};
use crate::ids::{BlockTime, DataBlock, Time, VirtualBlock, VolumeId};
use arc_swap::ArcSwap;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// Which incarnation of a volume a state is: equal only for the same volume with the same
/// content history (see the module doc). Unique within the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct VolumeGeneration(u64);

impl VolumeGeneration {
    /// A generation no state had before.
    fn fresh() -> VolumeGeneration {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        VolumeGeneration(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// Block locks per volume (hashed by virtual block).
const BLOCK_LOCKS: usize = 256;

/// `open_count` of a volume claimed by a delete (or a revert or rename).
const DELETING: usize = usize::MAX;

/// [`VolumeState`]'s origin when it has none (thin ids are 24 bits).
const NO_ORIGIN: u32 = u32::MAX;

/// What a lookup of a virtual block tells its caller to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lookup {
    /// No data: reads see zeros, a write provisions a new block.
    Unmapped,
    /// Mapped and this volume's alone: read and write it in place.
    Exclusive(DataBlock),
    /// Mapped and maybe shared with a snapshot (made before the volume's last snapshot;
    /// spec §8.5): read it in place, a write breaks sharing (copy to a new block).
    Shared(DataBlock),
}

impl Lookup {
    /// The data block, if mapped.
    #[inline]
    pub(crate) fn data_block(self) -> Option<DataBlock> {
        match self {
            Lookup::Unmapped => None,
            Lookup::Exclusive(block) | Lookup::Shared(block) => Some(block),
        }
    }
}

/// One volume's state, shared by its handles and the pool.
pub(crate) struct VolumeState {
    name: String,
    id: VolumeId,
    /// A [`VolumeGeneration`]'s value; only [`VolumeState::renew_generation`] changes it.
    generation: AtomicU64,
    size_bytes: AtomicU64,
    read_only: AtomicBool,
    /// Every mapping of the volume, committed or queued, once built; unset while nothing
    /// used the volume since activation (or its snapshot, revert or rename).
    index: OnceLock<Arc<Index>>,
    /// Pool time of the volume's last snapshot: mappings older than it may be shared.
    snapshotted_time: AtomicU32,
    gate: WriteGate,
    block_locks: Vec<Mutex<()>>,
    /// Handles alive, or [`DELETING`] once a delete claimed the volume.
    open_count: AtomicUsize,
    /// The thin id of the volume it was snapshotted from ([`NO_ORIGIN`]: none, or deleted).
    origin: AtomicU32,
}

impl VolumeState {
    /// A volume's state; `index` None leaves it to be built on first use.
    pub(crate) fn new(
        entry: &CatalogVolume,
        index: Option<Arc<Index>>,
        snapshotted_time: Time,
    ) -> VolumeState {
        assert!(entry.size_bytes > 0, "volume {:?} has a size", entry.name);
        VolumeState {
            name: entry.name.clone(),
            id: entry.id,
            generation: AtomicU64::new(VolumeGeneration::fresh().0),
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

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn id(&self) -> VolumeId {
        self.id
    }

    /// Which incarnation of the volume this is (see the module doc).
    pub(crate) fn generation(&self) -> VolumeGeneration {
        VolumeGeneration(self.generation.load(Ordering::Acquire))
    }

    /// Give the volume a new generation: whoever bound the old one (an NBD diff context)
    /// is told it changed. [`Volumes::publish`] calls it; call it under the metadata lock
    /// for any other change of what the volume is.
    pub(crate) fn renew_generation(&self) {
        self.generation
            .store(VolumeGeneration::fresh().0, Ordering::Release);
    }

    #[inline]
    pub(crate) fn size_bytes(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }

    /// Set the size (a resize, under the metadata lock with the volume's writers paused).
    pub(crate) fn set_size_bytes(&self, size_bytes: u64) {
        assert!(size_bytes > 0 && size_bytes.is_multiple_of(512));
        self.size_bytes.store(size_bytes, Ordering::Release);
    }

    #[inline]
    pub(crate) fn read_only(&self) -> bool {
        self.read_only.load(Ordering::Acquire)
    }

    pub(crate) fn gate(&self) -> &WriteGate {
        &self.gate
    }

    /// Pool time of the volume's last snapshot.
    pub(crate) fn snapshotted_time(&self) -> Result<Time> {
        Time::new(self.snapshotted_time.load(Ordering::Acquire))
            .ok_or_else(|| Error::Internal("a volume's snapshot time beyond 24 bits".to_string()))
    }

    /// The volume was snapshotted (or reverted to) at `time`: its older mappings may now be
    /// shared. Times only grow.
    pub(crate) fn snapshotted_at(&self, time: Time) {
        let before = self.snapshotted_time.swap(time.get(), Ordering::AcqRel);
        assert!(before <= time.get(), "snapshot times only grow");
    }

    /// What the caller must do with `mapping`, this volume's entry of a block.
    #[inline]
    pub(crate) fn classify(&self, mapping: Option<BlockTime>) -> Lookup {
        match mapping {
            None => Lookup::Unmapped,
            Some(m) if self.snapshotted_time.load(Ordering::Acquire) > m.time().get() => {
                Lookup::Shared(m.data_block())
            }
            Some(m) => Lookup::Exclusive(m.data_block()),
        }
    }

    /// The index, if built.
    pub(crate) fn loaded_index(&self) -> Option<&Arc<Index>> {
        self.index.get()
    }

    /// The index of a volume that has one: every volume with an open handle does, and only
    /// such a volume is provisioned or unmapped.
    pub(crate) fn index(&self) -> &Index {
        self.index
            .get()
            .unwrap_or_else(|| panic!("volume {:?} is used before its index is built", self.name))
    }

    /// Set the index built from the volume's tree (once: builds are serialized by the commit
    /// lock, and the caller checked there was none).
    pub(crate) fn set_index(&self, index: Index, block_size_bytes: u64) -> &Arc<Index> {
        assert_eq!(
            index.block_count(),
            self.size_bytes().div_ceil(block_size_bytes),
            "volume {:?}: the index covers the volume",
            self.name
        );
        let built = self.index.set(Arc::new(index)).is_ok();
        assert!(built, "index builds are serialized by the commit lock");
        self.index.get().expect("just set")
    }

    /// The thin id of the volume this one was snapshotted from, while that volume exists.
    pub(crate) fn origin(&self) -> Option<VolumeId> {
        match self.origin.load(Ordering::Acquire) {
            NO_ORIGIN => None,
            id => Some(VolumeId::new(id)),
        }
    }

    /// Forget the origin if it is `deleted` (its thin id may be reused).
    fn forget_origin(&self, deleted: VolumeId) {
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
                    "volume {:?} is being deleted, reverted, renamed or shrunk",
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

    /// Claim the volume for deletion (or a revert, rename or shrink): refused while any handle is
    /// alive; from then on no handle can be opened until [`VolumeState::end_delete`] (a
    /// failed operation) or forever.
    pub(crate) fn begin_delete(&self) -> Result<()> {
        self.open_count
            .compare_exchange(0, DELETING, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
            .map_err(|_| Error::Busy(format!("volume {:?} is open", self.name)))
    }

    /// Claim the volume for an operation no client may see half-done (a revert, a rename,
    /// a shrink): [`VolumeState::begin_delete`]'s rule, refused (busy) with what holds the
    /// volume and what the caller is `doing` ("shrinking it"). Released with
    /// [`VolumeState::end_delete`] unless the operation replaces or removes the volume.
    pub(crate) fn claim(&self, doing: &str) -> Result<()> {
        self.begin_delete().map_err(|_| match self.open_count() {
            0 => Error::Busy(format!(
                "volume {:?} is being deleted, reverted, renamed or shrunk: try again after that",
                self.name
            )),
            count => Error::Busy(format!(
                "volume {:?} is open ({count} {}): disconnect its clients before {doing}",
                self.name,
                if count == 1 { "handle" } else { "handles" }
            )),
        })
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
}

/// Which of a volume's [`BLOCK_LOCKS`] orders provisioning of `block`.
fn block_lock_index(block: VirtualBlock) -> usize {
    (block.get().wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as usize % BLOCK_LOCKS
}

/// The published volumes by name: a copy-on-write map, read lock-free. Publishing and
/// unpublishing happen under the metadata lock (management operations), which `list`, the
/// commit's assertion and the resync after a metadata failure read it under.
pub(crate) struct Volumes {
    published: ArcSwap<BTreeMap<String, Arc<VolumeState>>>,
}

impl Volumes {
    pub(crate) fn new(volumes: BTreeMap<String, Arc<VolumeState>>) -> Volumes {
        assert!(volumes.iter().all(|(name, v)| name == v.name()));
        Volumes {
            published: ArcSwap::from_pointee(volumes),
        }
    }

    /// Every volume, in name order (a snapshot of the map).
    pub(crate) fn all(&self) -> Arc<BTreeMap<String, Arc<VolumeState>>> {
        self.published.load_full()
    }

    pub(crate) fn count(&self) -> usize {
        self.published.load().len()
    }

    pub(crate) fn named(&self, name: &str) -> Result<Arc<VolumeState>> {
        self.published
            .load()
            .get(name)
            .cloned()
            .ok_or_else(|| Error::NoSuchVolume(name.to_string()))
    }

    /// Whether `volume`, looked up before the commit lock was taken, is still the one
    /// published as `name`: a delete (and a create reusing its thin id) may have run in
    /// between.
    pub(crate) fn still_published(&self, name: &str, volume: &Arc<VolumeState>) -> Result<()> {
        match self.named(name) {
            Ok(now) if Arc::ptr_eq(&now, volume) => Ok(()),
            _ => Err(Error::NoSuchVolume(name.to_string())),
        }
    }

    /// Publish `volume` under its name (replacing a state of that name) with a new
    /// generation.
    pub(crate) fn publish(&self, volume: Arc<VolumeState>) {
        volume.renew_generation();
        let mut volumes = (**self.published.load()).clone();
        let name = volume.name.clone();
        volumes.insert(name.clone(), volume);
        self.published.store(Arc::new(volumes));
        debug_assert!(self.named(&name).is_ok());
    }

    /// Remove `name`; with `deleted`, the volumes snapshotted from it forget it (its id and
    /// name may be reused).
    pub(crate) fn unpublish(&self, name: &str, deleted: Option<VolumeId>) {
        let mut volumes = (**self.published.load()).clone();
        let removed = volumes.remove(name);
        assert!(removed.is_some(), "volume {name:?} was published");
        self.published.store(Arc::new(volumes));
        if let Some(id) = deleted {
            for other in self.published.load().values() {
                other.forget_origin(id);
            }
        }
    }
}
