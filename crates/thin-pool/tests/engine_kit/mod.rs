//! Shared helpers for the engine tests (`engine_*.rs`): devices that crash, fail or hold
//! sparse data, a forkable catalog store, self-describing sector and block contents, and
//! the metadata checkers.
//!
//! Power cuts over a device pair: one [`Power`] counts the writes and flushes of both the
//! metadata device ([`PairedMetadata`], around testkit's `CrashDevice`) and the data device
//! ([`CrashDataDevice`]). Once the limit is reached every further operation of either device
//! fails, and the test builds both crash images at the same cut ([`CrashParts`] holds such a
//! pair with its catalog, formats a pool on it and makes the images to reopen).
//!
//! Contents: every 512-byte sector the power-cut tests write starts with a header naming the
//! volume, the virtual sector and a generation, and is filled with bytes derived from it, so a
//! read tells exactly which write (if any) a sector came from; stale data from another
//! volume or a freed block cannot pass for something else.
#![allow(dead_code)]

use persistent_data::{Block, BlockDevice, FileDevice, MemoryDevice, MetadataBlock, BLOCK_SIZE};
use rand::Rng;
use std::collections::BTreeMap;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use testkit::crash::{CrashDevice, CrashMode};
use testkit::fault::{OpCounts, Ops};
use testkit::tools::ThinTools;
use thin_pool::catalog::{Catalog, CatalogStore};
use thin_pool::data_device::{DataCounters, DataDevice, MemoryDataDevice};
use thin_pool::format::check::{check, CheckOptions};
use thin_pool::testing::PoolParts;
use thin_pool::Pool;

/// Sector size of the data device.
pub const SECTOR: usize = 512;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---------------------------------------------------------------------------------------
// Power shared by a device pair.

#[derive(Debug, Default)]
struct PowerState {
    operations: u64,
    limit: Option<u64>,
    cut: bool,
}

/// The power supply of a metadata + data device pair: counts writes and flushes of both and
/// cuts after a limit.
#[derive(Debug, Default)]
pub struct Power {
    state: Mutex<PowerState>,
}

fn power_error() -> io::Error {
    io::Error::other("simulated power cut")
}

impl Power {
    /// Power that never fails until told to.
    pub fn new() -> Arc<Power> {
        Arc::new(Power::default())
    }

    /// Cut once `operations` writes and flushes (of both devices, counted from creation)
    /// have completed.
    pub fn set_cut_after(&self, operations: Option<u64>) {
        lock(&self.state).limit = operations;
    }

    /// Writes and flushes completed so far.
    pub fn operations(&self) -> u64 {
        lock(&self.state).operations
    }

    /// Whether the power is out.
    pub fn is_cut(&self) -> bool {
        lock(&self.state).cut
    }

    /// Count one write or flush, or fail it.
    fn start(&self) -> io::Result<()> {
        let mut s = lock(&self.state);
        if s.cut {
            return Err(power_error());
        }
        if s.limit.is_some_and(|limit| s.operations >= limit) {
            s.cut = true;
            return Err(power_error());
        }
        s.operations += 1;
        Ok(())
    }

    fn check(&self) -> io::Result<()> {
        if lock(&self.state).cut {
            return Err(power_error());
        }
        Ok(())
    }
}

/// The metadata half of a device pair: a `CrashDevice` whose writes and flushes count
/// against the shared [`Power`].
#[derive(Debug)]
pub struct PairedMetadata {
    /// The crash device (for `crash_image`).
    pub device: Arc<CrashDevice>,
    power: Arc<Power>,
}

impl PairedMetadata {
    /// `block_count` zeroed blocks on `power`.
    pub fn new(block_count: u64, power: Arc<Power>) -> PairedMetadata {
        PairedMetadata {
            device: Arc::new(CrashDevice::new(block_count)),
            power,
        }
    }
}

impl BlockDevice for PairedMetadata {
    fn block_count(&self) -> u64 {
        self.device.block_count()
    }
    fn read(&self, block: MetadataBlock, buf: &mut Block) -> io::Result<()> {
        self.power.check()?;
        self.device.read(block, buf)
    }
    fn write(&self, block: MetadataBlock, buf: &Block) -> io::Result<()> {
        if let Err(e) = self.power.start() {
            self.device.cut_power();
            return Err(e);
        }
        self.device.write(block, buf)
    }
    fn flush(&self) -> io::Result<()> {
        if let Err(e) = self.power.start() {
            self.device.cut_power();
            return Err(e);
        }
        self.device.flush()
    }
}

// ---------------------------------------------------------------------------------------
// A data device with volatile writes.

#[derive(Debug)]
struct DataState {
    durable: Vec<u8>,
    current: Vec<u8>,
    /// Writes (offset, bytes) completed since the last flush, in issue order; zeroing,
    /// copying and discarding are writes too.
    volatile: Vec<(u64, Vec<u8>)>,
}

/// A data device that keeps unflushed writes apart and can lose, reorder or tear them at a
/// power cut (per 512-byte sector), like testkit's `CrashDevice` for metadata. `discard`
/// zeroes the range volatilely (a device may return anything after a discard; zeros make
/// a wrongly discarded block visible).
pub struct CrashDataDevice {
    state: Mutex<DataState>,
    power: Arc<Power>,
    counters: DataCounters,
    after_flush: Mutex<Option<FlushHook>>,
    discard_ignored: std::sync::atomic::AtomicBool,
}

/// Run once right after a flush completes (to interleave work at that exact point).
pub type FlushHook = Box<dyn FnOnce() + Send>;

impl std::fmt::Debug for CrashDataDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CrashDataDevice").finish_non_exhaustive()
    }
}

fn range_ok(offset: u64, len: u64, size: usize) -> io::Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size as u64 => Ok(()),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("data range {offset}+{len} outside {size} bytes"),
        )),
    }
}

impl CrashDataDevice {
    /// A zeroed device of `size_bytes` on `power`.
    pub fn new(size_bytes: u64, power: Arc<Power>) -> CrashDataDevice {
        CrashDataDevice {
            state: Mutex::new(DataState {
                durable: vec![0; size_bytes as usize],
                current: vec![0; size_bytes as usize],
                volatile: Vec::new(),
            }),
            power,
            counters: DataCounters::default(),
            after_flush: Mutex::new(None),
            discard_ignored: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Make `discard` leave the data as it was (still a write and flush operation for the
    /// power count) instead of zeroing it.
    pub fn set_discard_ignored(&self, ignored: bool) {
        self.discard_ignored.store(ignored, Ordering::Release);
    }

    /// Whether the power is out.
    pub fn power_is_cut(&self) -> bool {
        self.power.is_cut()
    }

    /// Run `hook` right after the next flush completes, on the flushing thread.
    pub fn on_next_flush(&self, hook: FlushHook) {
        *lock(&self.after_flush) = Some(hook);
    }

    /// Grow (the new space is durable zeros), as an administrator growing the device.
    pub fn grow(&self, size_bytes: u64) {
        let mut s = lock(&self.state);
        if size_bytes as usize > s.current.len() {
            s.durable.resize(size_bytes as usize, 0);
            s.current.resize(size_bytes as usize, 0);
        }
    }

    /// Writes completed since the last flush.
    pub fn volatile_write_count(&self) -> usize {
        lock(&self.state).volatile.len()
    }

    fn write_volatile(&self, offset: u64, bytes: Vec<u8>) -> io::Result<()> {
        let mut s = lock(&self.state);
        range_ok(offset, bytes.len() as u64, s.current.len())?;
        self.power.start()?;
        let at = offset as usize;
        s.current[at..at + bytes.len()].copy_from_slice(&bytes);
        s.volatile.push((offset, bytes));
        Ok(())
    }

    /// The device with every completed write kept (what reads see now): one of the images
    /// a power cut may leave, chosen deterministically.
    pub fn image_keeping_all(&self) -> MemoryDataDevice {
        let s = lock(&self.state);
        let device = MemoryDataDevice::new(s.current.len() as u64);
        device.write_at(0, &s.current).expect("image fits");
        device
    }

    /// The device as it could look after a power cut now (see [`CrashMode`]; `Tear` keeps
    /// a random subset of a surviving write's sectors).
    pub fn crash_image<R: Rng + ?Sized>(&self, mode: CrashMode, rng: &mut R) -> MemoryDataDevice {
        let s = lock(&self.state);
        let mut bytes = s.durable.clone();
        for (offset, data) in &s.volatile {
            let at = *offset as usize;
            match mode {
                CrashMode::DropAll => {}
                CrashMode::KeepRandomSubset => {
                    if rng.gen_bool(0.5) {
                        bytes[at..at + data.len()].copy_from_slice(data);
                    }
                }
                CrashMode::Tear => {
                    if !rng.gen_bool(0.5) {
                        continue;
                    }
                    let torn = rng.gen_bool(0.5);
                    for (i, sector) in data.chunks(SECTOR).enumerate() {
                        if !torn || rng.gen_bool(0.5) {
                            let from = at + i * SECTOR;
                            bytes[from..from + sector.len()].copy_from_slice(sector);
                        }
                    }
                }
            }
        }
        let device = MemoryDataDevice::new(bytes.len() as u64);
        device.write_at(0, &bytes).expect("image fits");
        device
    }
}

impl DataDevice for CrashDataDevice {
    fn size_bytes(&self) -> u64 {
        lock(&self.state).current.len() as u64
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.power.check()?;
        let s = lock(&self.state);
        range_ok(offset, buf.len() as u64, s.current.len())?;
        let at = offset as usize;
        buf.copy_from_slice(&s.current[at..at + buf.len()]);
        Ok(())
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.write_volatile(offset, data.to_vec())
    }
    fn zero(&self, offset: u64, len: u64) -> io::Result<()> {
        self.write_volatile(offset, vec![0; len as usize])
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        if self.discard_ignored.load(Ordering::Acquire) {
            let old = {
                let s = lock(&self.state);
                range_ok(offset, len, s.current.len())?;
                s.current[offset as usize..(offset + len) as usize].to_vec()
            };
            return self.write_volatile(offset, old);
        }
        self.write_volatile(offset, vec![0; len as usize])
    }
    fn copy(&self, from: u64, to: u64, len: u64) -> io::Result<()> {
        let bytes = {
            let s = lock(&self.state);
            range_ok(from, len, s.current.len())?;
            s.current[from as usize..(from + len) as usize].to_vec()
        };
        self.write_volatile(to, bytes)
    }
    fn flush(&self) -> io::Result<()> {
        {
            let mut s = lock(&self.state);
            self.power.start()?;
            for (offset, data) in std::mem::take(&mut s.volatile) {
                let at = offset as usize;
                s.durable[at..at + data.len()].copy_from_slice(&data);
            }
        }
        let hook = lock(&self.after_flush).take();
        if let Some(hook) = hook {
            hook();
        }
        Ok(())
    }
    fn counters(&self) -> &DataCounters {
        &self.counters
    }
}

// ---------------------------------------------------------------------------------------
// A data device that fails the Nth operation.

#[derive(Debug, Default)]
struct FaultState {
    counts: OpCounts,
    rule: Option<(Ops, u64)>,
    injected: u64,
}

/// Wraps a data device and fails the Nth operation of chosen kinds (1-based). Writes,
/// zeroing, copies and discards count as writes.
pub struct FaultDataDevice {
    inner: Arc<dyn DataDevice>,
    state: Mutex<FaultState>,
}

impl FaultDataDevice {
    /// No faults yet.
    pub fn new(inner: Arc<dyn DataDevice>) -> FaultDataDevice {
        FaultDataDevice {
            inner,
            state: Mutex::new(FaultState::default()),
        }
    }

    /// Fail the operation that makes the count of `ops` kinds reach `nth`.
    pub fn fail_nth(&self, ops: Ops, nth: u64) {
        lock(&self.state).rule = Some((ops, nth));
    }

    /// Operations seen (failed ones included).
    pub fn counts(&self) -> OpCounts {
        lock(&self.state).counts
    }

    /// Faults injected so far.
    pub fn injected(&self) -> u64 {
        lock(&self.state).injected
    }

    fn begin(&self, kind: OpCounts) -> io::Result<()> {
        let mut s = lock(&self.state);
        s.counts.reads += kind.reads;
        s.counts.writes += kind.writes;
        s.counts.flushes += kind.flushes;
        if let Some((ops, nth)) = s.rule {
            if ops.count_in(kind) > 0 && ops.count_in(s.counts) == nth {
                s.injected += 1;
                return Err(io::Error::other(format!(
                    "injected data device fault #{nth}"
                )));
            }
        }
        Ok(())
    }
}

const READ: OpCounts = OpCounts {
    reads: 1,
    writes: 0,
    flushes: 0,
};
const WRITE: OpCounts = OpCounts {
    reads: 0,
    writes: 1,
    flushes: 0,
};
const FLUSH: OpCounts = OpCounts {
    reads: 0,
    writes: 0,
    flushes: 1,
};

impl DataDevice for FaultDataDevice {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.begin(READ)?;
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.begin(WRITE)?;
        self.inner.write_at(offset, data)
    }
    fn zero(&self, offset: u64, len: u64) -> io::Result<()> {
        self.begin(WRITE)?;
        self.inner.zero(offset, len)
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.begin(WRITE)?;
        self.inner.discard(offset, len)
    }
    fn copy(&self, from: u64, to: u64, len: u64) -> io::Result<()> {
        self.begin(WRITE)?;
        self.inner.copy(from, to, len)
    }
    fn flush(&self) -> io::Result<()> {
        self.begin(FLUSH)?;
        self.inner.flush()
    }
    fn counters(&self) -> &DataCounters {
        self.inner.counters()
    }
    fn refresh_size(&self) -> io::Result<u64> {
        self.inner.refresh_size()
    }
    fn grow_to(&self, size_bytes: u64) -> io::Result<u64> {
        self.inner.grow_to(size_bytes)
    }
}

// ---------------------------------------------------------------------------------------
// A large, sparse data device in memory.

/// A data device of any size that stores only non-zero sectors (for tests that need many
/// data blocks but write little into each).
#[derive(Debug)]
pub struct SparseDataDevice {
    sectors: Mutex<BTreeMap<u64, Box<[u8; SECTOR]>>>,
    size_bytes: AtomicU64,
    counters: DataCounters,
}

impl SparseDataDevice {
    /// A zeroed device of `size_bytes`.
    pub fn new(size_bytes: u64) -> SparseDataDevice {
        SparseDataDevice {
            sectors: Mutex::new(BTreeMap::new()),
            size_bytes: AtomicU64::new(size_bytes),
            counters: DataCounters::default(),
        }
    }

    /// Grow to `size_bytes`.
    pub fn grow(&self, size_bytes: u64) {
        self.size_bytes.fetch_max(size_bytes, Ordering::AcqRel);
    }

    fn check(&self, offset: u64, len: u64) -> io::Result<()> {
        if !offset.is_multiple_of(SECTOR as u64) || !len.is_multiple_of(SECTOR as u64) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "unaligned sparse I/O",
            ));
        }
        range_ok(
            offset,
            len,
            self.size_bytes.load(Ordering::Acquire) as usize,
        )
    }
}

impl DataDevice for SparseDataDevice {
    fn size_bytes(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check(offset, buf.len() as u64)?;
        let sectors = lock(&self.sectors);
        for (i, chunk) in buf.chunks_mut(SECTOR).enumerate() {
            match sectors.get(&(offset / SECTOR as u64 + i as u64)) {
                Some(s) => chunk.copy_from_slice(&s[..]),
                None => chunk.fill(0),
            }
        }
        Ok(())
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.check(offset, data.len() as u64)?;
        let mut sectors = lock(&self.sectors);
        for (i, chunk) in data.chunks(SECTOR).enumerate() {
            let key = offset / SECTOR as u64 + i as u64;
            if chunk.iter().all(|&b| b == 0) {
                sectors.remove(&key);
            } else {
                sectors.insert(key, Box::new(chunk.try_into().expect("a sector")));
            }
        }
        Ok(())
    }
    fn zero(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check(offset, len)?;
        let first = offset / SECTOR as u64;
        let end = first + len / SECTOR as u64;
        let mut sectors = lock(&self.sectors);
        let keys: Vec<u64> = sectors.range(first..end).map(|(k, _)| *k).collect();
        for k in keys {
            sectors.remove(&k);
        }
        Ok(())
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.zero(offset, len)
    }
    fn copy(&self, from: u64, to: u64, len: u64) -> io::Result<()> {
        let mut buf = vec![0; len as usize];
        self.read_at(from, &mut buf)?;
        self.write_at(to, &buf)
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    fn counters(&self) -> &DataCounters {
        &self.counters
    }
}

// ---------------------------------------------------------------------------------------
// A catalog store that can be forked for each crash image.

/// Catalogs in memory, durable as soon as stored (the engine stores the catalog of a
/// transaction before committing the metadata), and forkable so that several crash images
/// of one run each reopen against their own copy.
#[derive(Debug, Default)]
pub struct ForkableCatalog {
    catalogs: Mutex<BTreeMap<u64, Catalog>>,
}

impl ForkableCatalog {
    /// An empty store.
    pub fn new() -> Arc<ForkableCatalog> {
        Arc::new(ForkableCatalog::default())
    }

    /// An independent copy.
    pub fn fork(&self) -> Arc<ForkableCatalog> {
        Arc::new(ForkableCatalog {
            catalogs: Mutex::new(lock(&self.catalogs).clone()),
        })
    }
}

impl CatalogStore for ForkableCatalog {
    fn load(&self, transaction_id: u64) -> thin_pool::Result<Catalog> {
        lock(&self.catalogs)
            .get(&transaction_id)
            .cloned()
            .ok_or(thin_pool::Error::NoCatalog { transaction_id })
    }
    fn store(&self, catalog: &Catalog) -> thin_pool::Result<()> {
        lock(&self.catalogs).insert(catalog.transaction_id, catalog.clone());
        Ok(())
    }
    fn committed(&self, transaction_id: u64) -> thin_pool::Result<()> {
        lock(&self.catalogs).retain(|id, _| *id == transaction_id);
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Self-describing contents.

const SECTOR_MAGIC: u64 = 0x5448_494e_5345_4354; // "THINSECT"
const BLOCK_MAGIC: u64 = 0x5448_494e_424c_4f4b; // "THINBLOK"

/// What one write put into one sector: the writing volume's tag, the virtual sector and the
/// write's generation (unique over the run).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Stamp {
    /// Tag of the volume written (snapshots keep their origin's stamps).
    pub tag: u32,
    /// Virtual sector in that volume.
    pub sector: u64,
    /// Generation of the write.
    pub generation: u64,
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

fn fill_from(seed: u64, out: &mut [u8]) {
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let v = mix(seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

fn checksum(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for chunk in bytes.chunks(8) {
        let mut v = [0u8; 8];
        v[..chunk.len()].copy_from_slice(chunk);
        h = mix(h ^ u64::from_le_bytes(v));
    }
    h
}

impl Stamp {
    /// The sector's bytes.
    pub fn bytes(&self) -> [u8; SECTOR] {
        let mut out = [0u8; SECTOR];
        out[0..8].copy_from_slice(&SECTOR_MAGIC.to_le_bytes());
        out[8..12].copy_from_slice(&self.tag.to_le_bytes());
        out[16..24].copy_from_slice(&self.sector.to_le_bytes());
        out[24..32].copy_from_slice(&self.generation.to_le_bytes());
        fill_from(
            mix(u64::from(self.tag)) ^ mix(self.sector ^ 0x1234) ^ self.generation,
            &mut out[40..],
        );
        let sum = checksum(&out[40..]) ^ checksum(&out[..32]);
        out[32..40].copy_from_slice(&sum.to_le_bytes());
        out
    }
}

/// What a sector read back holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SectorContent {
    /// All zeros.
    Zero,
    /// One write's sector, intact.
    Written(Stamp),
    /// Anything else.
    Garbage,
}

/// Decode a sector read back.
pub fn decode_sector(bytes: &[u8]) -> SectorContent {
    assert_eq!(bytes.len(), SECTOR);
    if bytes.iter().all(|&b| b == 0) {
        return SectorContent::Zero;
    }
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
    if u64_at(0) != SECTOR_MAGIC {
        return SectorContent::Garbage;
    }
    let stamp = Stamp {
        tag: u32::from_le_bytes(bytes[8..12].try_into().expect("4")),
        sector: u64_at(16),
        generation: u64_at(24),
    };
    if stamp.bytes()[..] != *bytes {
        return SectorContent::Garbage;
    }
    SectorContent::Written(stamp)
}

/// What one whole-block write carries (the concurrency test): volume tag, virtual block and
/// generation in a header, the rest derived from them, and a checksum over all of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockHeader {
    /// Volume tag.
    pub tag: u32,
    /// Virtual block.
    pub block: u64,
    /// Generation.
    pub generation: u64,
}

impl BlockHeader {
    /// The block's bytes.
    pub fn bytes(&self, block_size: usize) -> Vec<u8> {
        let mut out = vec![0u8; block_size];
        out[0..8].copy_from_slice(&BLOCK_MAGIC.to_le_bytes());
        out[8..12].copy_from_slice(&self.tag.to_le_bytes());
        out[16..24].copy_from_slice(&self.block.to_le_bytes());
        out[24..32].copy_from_slice(&self.generation.to_le_bytes());
        fill_from(
            mix(u64::from(self.tag) << 40 ^ self.block) ^ self.generation,
            &mut out[40..],
        );
        let sum = checksum(&out[40..]) ^ checksum(&out[..32]);
        out[32..40].copy_from_slice(&sum.to_le_bytes());
        out
    }

    /// Decode a block read back: `Ok(None)` for zeros, `Err` for anything not intact.
    pub fn decode(bytes: &[u8]) -> Result<Option<BlockHeader>, String> {
        if bytes.iter().all(|&b| b == 0) {
            return Ok(None);
        }
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
        if u64_at(0) != BLOCK_MAGIC {
            return Err(format!("no block header (first word {:#x})", u64_at(0)));
        }
        let header = BlockHeader {
            tag: u32::from_le_bytes(bytes[8..12].try_into().expect("4")),
            block: u64_at(16),
            generation: u64_at(24),
        };
        if header.bytes(bytes.len()) != bytes {
            return Err(format!("{header:?}: checksum or body mismatch"));
        }
        Ok(Some(header))
    }
}

// ---------------------------------------------------------------------------------------
// Checkers.

/// Copy a metadata image to a file (only non-zero blocks) for the real tools.
pub fn write_image(image: &dyn BlockDevice, path: &Path) {
    let file = FileDevice::create(path, image.block_count()).expect("create image file");
    let mut block = [0u8; BLOCK_SIZE];
    for b in 0..image.block_count() {
        image
            .read(MetadataBlock::new(b), &mut block)
            .expect("read image");
        if block.iter().any(|&x| x != 0) {
            file.write(MetadataBlock::new(b), &block)
                .expect("write image");
        }
    }
    file.flush().expect("flush image");
}

/// A copy of a metadata device in memory.
pub fn copy_metadata(device: &dyn BlockDevice) -> MemoryDevice {
    let copy = MemoryDevice::new(device.block_count());
    let mut block = [0u8; BLOCK_SIZE];
    for b in 0..device.block_count() {
        device
            .read(MetadataBlock::new(b), &mut block)
            .expect("read");
        if block.iter().any(|&x| x != 0) {
            copy.write(MetadataBlock::new(b), &block).expect("write");
        }
    }
    copy
}

/// Run our checker on `metadata` and, with `tools`, both thin_check versions on a copy
/// written to `image_path`. Returns a description of the first failure.
pub fn check_metadata(
    metadata: Arc<dyn BlockDevice>,
    tools: Option<(&[ThinTools], &Path)>,
) -> Result<(), String> {
    let report = check(metadata.clone(), &CheckOptions::default(), &mut |_| {});
    if !report.is_clean() {
        return Err(format!("thinpool check:\n{report}"));
    }
    if let Some((tools, image_path)) = tools {
        write_image(&*metadata, image_path);
        for t in tools {
            let out = t.check(image_path);
            if !out.success() {
                return Err(format!("thin_check {}:\n{out}", t.version));
            }
        }
    }
    Ok(())
}

/// Each volume's expected bytes, by name: the model the content tests compare with.
pub type VolumeModel = BTreeMap<String, Vec<u8>>;

/// The pool lists exactly the model's volumes, each reads whole as the model says (which
/// opens it, building its index), and every built index equals its tree.
pub fn assert_volumes_match(pool: &thin_pool::Pool, model: &VolumeModel) {
    let listed: Vec<String> = pool.list().into_iter().map(|v| v.name).collect();
    assert_eq!(listed, model.keys().cloned().collect::<Vec<_>>());
    for (name, expected) in model {
        let volume = pool.volume(name).unwrap();
        assert_eq!(volume.size_bytes(), expected.len() as u64, "{name} size");
        let mut bytes = vec![0u8; expected.len()];
        volume.read(0, &mut bytes).unwrap();
        assert!(bytes == *expected, "{name}: content differs from the model");
    }
    pool.verify_index().unwrap();
}

// ---------------------------------------------------------------------------------------
// A pool's parts on one power supply.

/// What a power cut left of [`CrashParts`]: both devices' images and a fork of the catalog,
/// to reopen the pool on.
pub type CrashImage = PoolParts<MemoryDevice, MemoryDataDevice, ForkableCatalog>;

/// A pool's parts on one [`Power`]: a metadata and a data device that keep unflushed writes
/// apart, and a catalog store that each crash image forks.
pub struct CrashParts {
    /// The power both devices count against.
    pub power: Arc<Power>,
    /// The metadata device.
    pub metadata: Arc<PairedMetadata>,
    /// The data device.
    pub data: Arc<CrashDataDevice>,
    /// The catalog store.
    pub catalog: Arc<ForkableCatalog>,
}

impl CrashParts {
    /// `metadata_blocks` of metadata and `data_bytes` of data, zeroed, on fresh power.
    pub fn new(metadata_blocks: u64, data_bytes: u64) -> CrashParts {
        let power = Power::new();
        CrashParts {
            metadata: Arc::new(PairedMetadata::new(metadata_blocks, power.clone())),
            data: Arc::new(CrashDataDevice::new(data_bytes, power.clone())),
            catalog: ForkableCatalog::new(),
            power,
        }
    }

    /// Formats a new pool on these parts (see [`PoolParts::format`]).
    pub fn format(&self, block_size_bytes: u64, options: thin_pool::PoolOptions) -> Pool {
        PoolParts::on(
            self.metadata.clone(),
            self.data.clone(),
            self.catalog.clone(),
        )
        .format(block_size_bytes, options)
    }

    /// The parts as a power cut now could leave them (see [`CrashMode`]): the metadata
    /// image drawn from `rng` first, then the data image.
    pub fn image<R: Rng + ?Sized>(&self, mode: CrashMode, rng: &mut R) -> CrashImage {
        let metadata = Arc::new(self.metadata.device.crash_image(mode, rng));
        let data = Arc::new(self.data.crash_image(mode, rng));
        PoolParts::on(metadata, data, self.catalog.fork())
    }
}
