//! Corruption suite: real pool metadata, built by the engine (volumes, snapshots sharing
//! blocks, about two thousand mappings), is damaged field by field with valid checksums
//! (each block re-stamped with its kind's salt), and every reader must answer with an
//! error or a read-only pool: never a panic, an abort, a hang, an unbounded allocation, or
//! a write that lands on another volume's data.
//!
//! Readers run on each damaged image: the checker (`thinpool check`), the check every
//! read-write open runs first ([`check_before_open`]: what `serve` relies on), `dump`, the
//! engine opened read-only (what `list` and `volume` do) with every volume listed and
//! read, and the engine opened read-write. When a damaged pool opens read-write, new
//! blocks are written to two volumes (fresh blocks, and blocks shared with snapshots) and
//! every other volume's blocks are compared with what they held.
//!
//! Bounds: each case runs in a thread with a deadline (a hang fails the test); the whole
//! run is in a child process whose address space is limited (an allocation sized by a
//! number read from disk aborts it, which fails the test). Seeds from testkit
//! (`THINPOOL_SEED`), case counts scaled by `THINPOOL_CASES`.
//!
//! Not covered: opening with `PoolOptions::skip_check` (the risk its user accepts).

use persistent_data::checksum::{self, BlockKind};
use persistent_data::{Block, BlockDevice, MemoryDevice, BLOCK_SIZE};
use rand::rngs::StdRng;
use rand::Rng;
use std::collections::HashMap;
use std::io;
use std::process::Command;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use thin_pool::catalog::{Catalog, CatalogStore, MemoryCatalog};
use thin_pool::data_device::{DataCounters, DataDevice};
use thin_pool::format::check::{check, check_before_open, CheckOptions, Rule};
use thin_pool::format::dump::metadata::{dump, DumpOptions};
use thin_pool::format::dump::XmlWriter;
use thin_pool::testing::MemoryParts;
use thin_pool::{Pool, PoolMode, PoolOptions, VolumeId};

const BLOCK_BYTES: u64 = 64 * 1024;
const DATA_BLOCKS: u64 = 1024;
const METADATA_BLOCKS: u64 = 256;
const VOLUME_BYTES: u64 = 32 << 20;
/// Bytes of each data block compared (every write here writes whole blocks, each starting
/// with a header naming the volume, block and generation).
const PROBE_BYTES: usize = 512;
/// Longest a case may take before it counts as a hang.
const CASE_DEADLINE: Duration = Duration::from_secs(60);
/// Address space of the child process that runs the cases.
const ADDRESS_SPACE_LIMIT: u64 = 3 << 30;
/// Environment variable naming the test a child process runs.
const CHILD_VARIABLE: &str = "THINPOOL_CORRUPTION_CHILD";
/// Set: print each case's damage before running it (to name the one that aborts).
const VERBOSE_VARIABLE: &str = "THINPOOL_CORRUPTION_VERBOSE";
/// Cases of the seeded run in `scripts/test` (scaled by `THINPOOL_CASES`).
const DEFAULT_CASES: u64 = 2000;
/// The seeded run stops after this long unless `THINPOOL_CASES` is set (`scripts/test`
/// stays bounded on a slow machine; the count run is printed).
const DEFAULT_BUDGET: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------
// The pristine pool.

/// A virtual block and the first bytes it held.
type Probe = (u64, Vec<u8>);

/// A pool image: metadata blocks, data, catalog, and what each volume's mapped blocks hold.
struct Image {
    metadata: Vec<u8>,
    data: Arc<Vec<u8>>,
    catalog: Catalog,
    /// Per volume: (virtual block, probe of its first bytes) for every block written.
    contents: Vec<(String, Vec<Probe>)>,
    /// Kind of every metadata block whose checksum is valid.
    kinds: Vec<Option<BlockKind>>,
}

fn pattern(volume: &str, block: u64, generation: u32) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK_BYTES as usize];
    let header = format!("{volume}:{block}:{generation};");
    let seed = header
        .bytes()
        .fold(0u8, |a, b| a.wrapping_mul(31).wrapping_add(b));
    for (i, byte) in buf.iter_mut().enumerate() {
        *byte = seed.wrapping_add(i as u8);
    }
    buf[..header.len()].copy_from_slice(header.as_bytes());
    buf
}

fn write_blocks(pool: &Pool, volume: &str, blocks: impl IntoIterator<Item = u64>, gen: u32) {
    let v = pool.volume(volume).unwrap();
    for block in blocks {
        v.write(block * BLOCK_BYTES, &pattern(volume, block, gen), false)
            .unwrap();
    }
}

fn options(read_only: bool) -> PoolOptions {
    PoolOptions {
        commit_interval: None,
        read_only,
        error_if_no_space: true,
        ..PoolOptions::default()
    }
}

fn build() -> Image {
    let parts = MemoryParts::new(METADATA_BLOCKS, DATA_BLOCKS * BLOCK_BYTES);
    let (metadata, data, catalog) = (&parts.metadata, &parts.data, &parts.catalog);
    let pool = parts.format(BLOCK_BYTES, options(false));
    pool.create_volume("a", VOLUME_BYTES).unwrap();
    write_blocks(&pool, "a", 0..400, 0);
    pool.snapshot("a", "a1", false).unwrap();
    write_blocks(&pool, "a", 350..420, 1);
    pool.create_volume("b", VOLUME_BYTES).unwrap();
    write_blocks(&pool, "b", (0..200).map(|i| i * 2), 0);
    pool.snapshot("b", "b1", false).unwrap();
    pool.snapshot("a", "a2", true).unwrap();
    write_blocks(&pool, "b", 0..30, 1);
    pool.snapshot("a1", "a3", false).unwrap();
    pool.create_volume("c", VOLUME_BYTES).unwrap();
    write_blocks(&pool, "c", 100..110, 0);
    pool.commit().unwrap();
    let mut contents = Vec::new();
    for info in pool.list() {
        let v = pool.volume(&info.name).unwrap();
        let mut probes = Vec::new();
        let blocks = info.size_bytes / BLOCK_BYTES;
        for block in 0..blocks {
            let mut probe = vec![0u8; PROBE_BYTES];
            v.read(block * BLOCK_BYTES, &mut probe).unwrap();
            if probe.iter().any(|&b| b != 0) {
                probes.push((block, probe));
            }
        }
        contents.push((info.name.clone(), probes));
    }
    pool.close().unwrap();
    drop(pool);
    let bytes = metadata.to_bytes();
    let live = live_blocks(&bytes);
    let kinds = bytes
        .chunks_exact(BLOCK_SIZE)
        .enumerate()
        .map(|(i, chunk)| {
            checksum::identify(&to_block(chunk)).filter(|_| live.get(i) == Some(&true))
        })
        .collect();
    let transaction = thin_pool::PoolMetadata::open(Arc::new(MemoryDevice::from_bytes(&bytes)))
        .unwrap()
        .transaction_id()
        .get();
    Image {
        metadata: bytes,
        data: Arc::new(data.contents()),
        catalog: catalog.load(transaction).unwrap(),
        contents,
        kinds,
    }
}

/// Which metadata blocks the live metadata space map counts as in use (its index block,
/// then its bitmaps): the blocks of the current transaction, not stale copies.
fn live_blocks(metadata: &[u8]) -> Vec<bool> {
    let index = u64_at(metadata, 208) as usize;
    let index_block = &metadata[index * BLOCK_SIZE..(index + 1) * BLOCK_SIZE];
    let mut live = vec![false; metadata.len() / BLOCK_SIZE];
    for bitmap in 0..live.len().div_ceil(16_320) {
        let location = u64_at(index_block, 16 + 16 * bitmap) as usize;
        let b = &metadata[location * BLOCK_SIZE..(location + 1) * BLOCK_SIZE];
        for (e, slot) in live
            .iter_mut()
            .enumerate()
            .skip(bitmap * 16_320)
            .take(16_320)
        {
            let entry = e - bitmap * 16_320;
            *slot = (b[16 + entry / 4] >> (2 * (entry % 4))) & 3 != 0;
        }
    }
    live
}

fn to_block(chunk: &[u8]) -> Block {
    let mut block = [0u8; BLOCK_SIZE];
    block.copy_from_slice(chunk);
    block
}

// ---------------------------------------------------------------------------------------
// A data device that shares the pristine data and keeps its own writes.

#[derive(Debug)]
struct OverlayData {
    base: Arc<Vec<u8>>,
    blocks: Mutex<HashMap<u64, Vec<u8>>>,
    counters: DataCounters,
}

impl OverlayData {
    fn new(base: Arc<Vec<u8>>) -> OverlayData {
        OverlayData {
            base,
            blocks: Mutex::new(HashMap::new()),
            counters: DataCounters::default(),
        }
    }

    fn range(&self, offset: u64, len: u64) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.base.len() as u64 => Ok(()),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "beyond the data device",
            )),
        }
    }

    /// Apply `f` to each block-sized piece of `offset..offset + len`.
    fn each(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&mut Vec<u8>, usize, usize, usize),
    ) -> io::Result<()> {
        self.range(offset, len)?;
        let mut blocks = self.blocks.lock().unwrap_or_else(|e| e.into_inner());
        let mut done = 0u64;
        while done < len {
            let at = offset + done;
            let block = at / BLOCK_BYTES;
            let within = (at % BLOCK_BYTES) as usize;
            let n = (BLOCK_BYTES as usize - within).min((len - done) as usize);
            let start = (block * BLOCK_BYTES) as usize;
            let copy = blocks
                .entry(block)
                .or_insert_with(|| self.base[start..start + BLOCK_BYTES as usize].to_vec());
            f(copy, within, n, done as usize);
            done += n as u64;
        }
        Ok(())
    }
}

impl DataDevice for OverlayData {
    fn size_bytes(&self) -> u64 {
        self.base.len() as u64
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.each(offset, buf.len() as u64, |block, within, n, done| {
            buf[done..done + n].copy_from_slice(&block[within..within + n]);
        })
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.each(offset, data.len() as u64, |block, within, n, done| {
            block[within..within + n].copy_from_slice(&data[done..done + n]);
        })
    }
    fn zero(&self, offset: u64, len: u64) -> io::Result<()> {
        self.each(offset, len, |block, within, n, _| {
            block[within..within + n].fill(0)
        })
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.range(offset, len)
    }
    fn copy(&self, from: u64, to: u64, len: u64) -> io::Result<()> {
        let mut buf = vec![0u8; usize::try_from(len).map_err(io::Error::other)?];
        self.read_at(from, &mut buf)?;
        self.write_at(to, &buf)
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    fn counters(&self) -> &DataCounters {
        &self.counters
    }
    fn grow_to(&self, _size_bytes: u64) -> io::Result<u64> {
        Ok(self.size_bytes())
    }
}

/// It keeps the data device contract (it cannot grow, and counts nothing).
#[test]
fn overlay_data_keeps_the_data_device_contract() {
    use thin_pool::testing::data_device_contract::{conforms, Growth, Subject, DEVICE_BYTES};
    conforms("OverlayData", || {
        let base = Arc::new(vec![0u8; DEVICE_BYTES as usize]);
        let device = Arc::new(OverlayData::new(base));
        Some(
            Subject::new(device)
                .without_counters()
                .growing(Growth::Fixed),
        )
    });
}

// ---------------------------------------------------------------------------------------
// Mutations (each re-stamps the block it changes).

/// What was damaged, for the failure message.
#[derive(Clone, Debug)]
struct Damage {
    what: Vec<String>,
    metadata: Vec<u8>,
    catalog: Catalog,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}
fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// A value worth trying in place of `old`.
fn interesting(rng: &mut StdRng, old: u64) -> u64 {
    match rng.gen_range(0..16) {
        0 => 0,
        1 => 1,
        2 => old.wrapping_add(1),
        3 => old.wrapping_sub(1),
        4 => old ^ (1 << rng.gen_range(0..64)),
        5 => u64::MAX,
        6 => 1 << 32,
        7 => (1 << 40) - 1,
        8 => 1 << 40,
        9 => 1 << 63,
        10 => rng.gen_range(0..METADATA_BLOCKS),
        11 => rng.gen_range(0..DATA_BLOCKS),
        12 => rng.gen_range(DATA_BLOCKS..4 * DATA_BLOCKS),
        13 => old.wrapping_mul(2),
        14 => u64::from(u32::MAX),
        _ => rng.gen(),
    }
}

fn block_of(metadata: &mut [u8], index: usize) -> &mut [u8] {
    &mut metadata[index * BLOCK_SIZE..(index + 1) * BLOCK_SIZE]
}

fn restamp(metadata: &mut [u8], index: usize, kind: BlockKind) {
    let mut block = to_block(block_of(metadata, index));
    checksum::stamp(&mut block, kind);
    block_of(metadata, index).copy_from_slice(&block);
}

/// Superblock fields: (offset, width, name).
const SUPERBLOCK_FIELDS: &[(usize, usize, &str)] = &[
    (4, 4, "flags"),
    (8, 8, "blocknr"),
    (40, 4, "version"),
    (44, 4, "time"),
    (48, 8, "transaction_id"),
    (56, 8, "metadata_snap"),
    (64, 8, "data sm nr_blocks"),
    (72, 8, "data sm nr_allocated"),
    (80, 8, "data sm bitmap_root"),
    (88, 8, "data sm ref_count_root"),
    (192, 8, "metadata sm nr_blocks"),
    (200, 8, "metadata sm nr_allocated"),
    (208, 8, "metadata sm bitmap_root"),
    (216, 8, "metadata sm ref_count_root"),
    (320, 8, "data_mapping_root"),
    (328, 8, "device_details_root"),
    (336, 4, "data_block_size"),
    (344, 8, "metadata_nr_blocks"),
    (352, 4, "compat_flags"),
    (356, 4, "compat_ro_flags"),
    (360, 4, "incompat_flags"),
];

fn set_field(rng: &mut StdRng, b: &mut [u8], at: usize, width: usize) -> (u64, u64) {
    if width == 4 {
        let old = u64::from(u32_at(b, at));
        let new = interesting(rng, old) as u32;
        put_u32(b, at, new);
        (old, u64::from(new))
    } else {
        let old = u64_at(b, at);
        let new = interesting(rng, old);
        put_u64(b, at, new);
        (old, new)
    }
}

fn mutate_superblock(rng: &mut StdRng, metadata: &mut [u8]) -> String {
    let (at, width, name) = SUPERBLOCK_FIELDS[rng.gen_range(0..SUPERBLOCK_FIELDS.len())];
    let (old, new) = set_field(rng, block_of(metadata, 0), at, width);
    restamp(metadata, 0, BlockKind::Superblock);
    format!("superblock {name}: {old} -> {new}")
}

fn mutate_node(rng: &mut StdRng, metadata: &mut [u8], index: usize) -> String {
    let b = block_of(metadata, index);
    let nr = u32_at(b, 16) as usize;
    let max = (u32_at(b, 20) as usize).max(1);
    let value_size = u32_at(b, 24) as usize;
    let what = match rng.gen_range(0..10) {
        0 => {
            let (old, new) = set_field(rng, b, 4, 4);
            format!("flags {old} -> {new}")
        }
        1 => {
            let (old, new) = set_field(rng, b, 16, 4);
            format!("nr_entries {old} -> {new}")
        }
        2 => {
            let (old, new) = set_field(rng, b, 20, 4);
            format!("max_entries {old} -> {new}")
        }
        3 => {
            let (old, new) = set_field(rng, b, 24, 4);
            format!("value_size {old} -> {new}")
        }
        4 | 5 => {
            let i = rng.gen_range(0..nr.clamp(1, max));
            let (old, new) = set_field(rng, b, 32 + 8 * i, 8);
            format!("key {i} {old} -> {new}")
        }
        _ => {
            let i = rng.gen_range(0..nr.clamp(1, max));
            let words = (value_size / 4).max(1);
            let word = rng.gen_range(0..words);
            let at = 32 + 8 * max + value_size * i + 4 * word;
            if at + 8 > BLOCK_SIZE {
                return format!("node block {index}: value {i} beyond the block (untouched)");
            }
            if value_size == 8 && rng.gen_bool(0.5) {
                // A mapping: data block (high 40 bits) or time (low 24).
                let old = u64_at(b, at);
                let new = if rng.gen_bool(0.6) {
                    (interesting(rng, old >> 24) << 24) | (old & 0xff_ffff)
                } else {
                    (old & !0xff_ffff) | (interesting(rng, old & 0xff_ffff) & 0xff_ffff)
                };
                put_u64(b, at, new);
                format!("value {i} (as block/time) {old:#x} -> {new:#x}")
            } else {
                let width = if word % 2 == 0 && at + 8 <= BLOCK_SIZE {
                    8
                } else {
                    4
                };
                let (old, new) = set_field(rng, b, at, width);
                format!("value {i} word {word} {old} -> {new}")
            }
        }
    };
    restamp(metadata, index, BlockKind::Node);
    format!("node block {index} (value size {value_size}): {what}")
}

fn mutate_bitmap(rng: &mut StdRng, metadata: &mut [u8], index: usize) -> String {
    let b = block_of(metadata, index);
    let what = match rng.gen_range(0..5) {
        0 => {
            b[16..].fill(0);
            "all entries zeroed".to_string()
        }
        1 => {
            let (old, new) = set_field(rng, b, 8, 8);
            format!("blocknr {old} -> {new}")
        }
        _ => {
            let entry = rng.gen_range(0..16_320usize);
            let field = rng.gen_range(0..4u8);
            let byte = 16 + entry / 4;
            let shift = 2 * (entry % 4);
            b[byte] = (b[byte] & !(3 << shift)) | (field << shift);
            format!("entry {entry} field {field}")
        }
    };
    restamp(metadata, index, BlockKind::Bitmap);
    format!("bitmap block {index}: {what}")
}

fn mutate_index(rng: &mut StdRng, metadata: &mut [u8], index: usize) -> String {
    let b = block_of(metadata, index);
    let entry = rng.gen_range(0..4usize);
    let (at, width, name) = match rng.gen_range(0..4) {
        0 => (8, 8, "blocknr".to_string()),
        1 => (16 + 16 * entry, 8, format!("entry {entry} blocknr")),
        2 => (24 + 16 * entry, 4, format!("entry {entry} nr_free")),
        _ => (
            28 + 16 * entry,
            4,
            format!("entry {entry} none_free_before"),
        ),
    };
    let (old, new) = set_field(rng, b, at, width);
    restamp(metadata, index, BlockKind::Index);
    format!("index block {index}: {name} {old} -> {new}")
}

fn mutate_byte(rng: &mut StdRng, metadata: &mut [u8], index: usize, kind: BlockKind) -> String {
    let at = rng.gen_range(4..BLOCK_SIZE);
    let b = block_of(metadata, index);
    let old = b[at];
    b[at] = if rng.gen_bool(0.5) {
        old ^ (1 << rng.gen_range(0..8))
    } else {
        rng.gen()
    };
    let new = b[at];
    restamp(metadata, index, kind);
    format!("{kind} block {index}: byte {at} {old:#x} -> {new:#x}")
}

fn mutate_catalog(rng: &mut StdRng, catalog: &mut Catalog) -> String {
    let n = catalog.volumes.len();
    let i = rng.gen_range(0..n);
    match rng.gen_range(0..6) {
        0 => {
            let old = catalog.volumes[i].size_bytes;
            let new = match rng.gen_range(0..5) {
                0 => 0,
                1 => 512,
                2 => u64::MAX - 511,
                3 => (1 << 60) + 512,
                _ => old + 1,
            };
            catalog.volumes[i].size_bytes = new;
            format!("catalog: size of volume {i} {old} -> {new}")
        }
        1 => {
            let old = catalog.volumes[i].id;
            let new = VolumeId::new(interesting(rng, u64::from(old.get())) as u32);
            catalog.volumes[i].id = new;
            format!("catalog: id of volume {i} {old} -> {new}")
        }
        2 => {
            catalog.volumes.remove(i);
            format!("catalog: volume {i} removed")
        }
        3 => {
            let copy = catalog.volumes[i].clone();
            catalog.volumes.push(copy);
            format!("catalog: volume {i} listed twice")
        }
        4 => {
            let j = rng.gen_range(0..n);
            catalog.volumes[i].name = catalog.volumes[j].name.clone();
            format!("catalog: volume {i} named as volume {j}")
        }
        _ => {
            let j = rng.gen_range(0..n);
            catalog.volumes[i].origin = Some(catalog.volumes[j].id);
            catalog.volumes[j].origin = Some(catalog.volumes[i].id);
            format!("catalog: volumes {i} and {j} each other's origin")
        }
    }
}

/// One to three mutations of the pristine image.
fn damage(rng: &mut StdRng, image: &Image) -> Damage {
    let mut metadata = image.metadata.clone();
    let mut catalog = image.catalog.clone();
    let used: Vec<(usize, BlockKind)> = image
        .kinds
        .iter()
        .enumerate()
        .filter_map(|(i, k)| k.map(|k| (i, k)))
        .collect();
    let of_kind = |kind: BlockKind| -> Vec<usize> {
        used.iter()
            .filter(|(_, k)| *k == kind)
            .map(|(i, _)| *i)
            .collect()
    };
    let nodes = of_kind(BlockKind::Node);
    let bitmaps = of_kind(BlockKind::Bitmap);
    let indexes = of_kind(BlockKind::Index);
    let mut what = Vec::new();
    for _ in 0..rng.gen_range(1..=3) {
        let step = match rng.gen_range(0..20) {
            0..=3 => mutate_superblock(rng, &mut metadata),
            4..=11 => {
                let index = nodes[rng.gen_range(0..nodes.len())];
                mutate_node(rng, &mut metadata, index)
            }
            12..=13 => {
                let index = bitmaps[rng.gen_range(0..bitmaps.len())];
                mutate_bitmap(rng, &mut metadata, index)
            }
            14 => {
                let index = indexes[rng.gen_range(0..indexes.len())];
                mutate_index(rng, &mut metadata, index)
            }
            15..=17 => {
                let (index, kind) = used[rng.gen_range(0..used.len())];
                mutate_byte(rng, &mut metadata, index, kind)
            }
            _ => mutate_catalog(rng, &mut catalog),
        };
        what.push(step);
    }
    Damage {
        what,
        metadata,
        catalog,
    }
}

// ---------------------------------------------------------------------------------------
// Running every reader on a damaged image.

/// What one case found.
#[derive(Debug, Default, Clone, Copy)]
struct Outcome {
    check_passed: bool,
    opened_read_write: bool,
}

fn open(
    metadata: &[u8],
    data: Arc<dyn DataDevice>,
    catalog: &Catalog,
    read_only: bool,
) -> thin_pool::Result<Pool> {
    let store = MemoryCatalog::default();
    store.store(catalog).unwrap();
    Pool::open_parts(
        Arc::new(MemoryDevice::from_bytes(metadata)),
        data,
        Box::new(store),
        options(read_only),
        None,
    )
}

/// Write new blocks to one volume (fresh blocks, and blocks it shares with snapshots), then
/// compare every other volume's blocks with the pristine ones. Returns whether another
/// volume changed. Errors of the writes themselves are fine (a pool may refuse).
fn write_and_compare(pool: &Pool, image: &Image) -> Result<bool, String> {
    let targets = ["c", "a"];
    for target in targets {
        let Ok(v) = pool.volume(target) else { continue };
        let blocks = v.size_bytes() / BLOCK_BYTES;
        for i in 0..32u64.min(blocks) {
            // c: fresh blocks; a: blocks shared with its snapshots.
            let block = if target == "c" { 200 + i } else { i * 3 };
            if block < blocks {
                let _ = v.write(block * BLOCK_BYTES, &pattern(target, block, ROUND), false);
            }
        }
        let _ = v.flush();
    }
    let _ = pool.commit();
    let mut crossed = false;
    for (name, probes) in &image.contents {
        if targets.contains(&name.as_str()) {
            continue;
        }
        let Ok(v) = pool.volume(name) else { continue };
        for (block, probe) in probes {
            let mut now = vec![0u8; PROBE_BYTES];
            if v.read(block * BLOCK_BYTES, &mut now).is_ok() && &now != probe {
                // Only this round's writes (generation `ROUND`) count: a damaged catalog may
                // name another volume's unchanged blocks, which is not a crossed write.
                crossed |= targets.iter().any(|t| written_here(&now, t));
            }
        }
    }
    Ok(crossed)
}

/// The generation of the writes `write_and_compare` makes.
const ROUND: u32 = 9;

/// Whether `block` starts with the header of a write `write_and_compare` made to `target`.
fn written_here(block: &[u8], target: &str) -> bool {
    let Some(end) = block.iter().position(|&b| b == b';') else {
        return false;
    };
    let Ok(header) = std::str::from_utf8(&block[..end]) else {
        return false;
    };
    let mut fields = header.split(':');
    fields.next() == Some(target)
        && fields.next().is_some_and(|b| b.parse::<u64>().is_ok())
        && fields.next() == Some(ROUND.to_string().as_str())
        && fields.next().is_none()
}

/// Every reader on one damaged image.
fn run_case(damage: &Damage, image: &Image) -> Outcome {
    let mut outcome = Outcome::default();
    let device =
        || -> Arc<dyn BlockDevice> { Arc::new(MemoryDevice::from_bytes(&damage.metadata)) };
    let _ = check(device(), &CheckOptions::default(), &mut |_| {});
    let report = check_before_open(device(), image.data.len() as u64);
    outcome.check_passed = report.passes(true);
    let mut xml = XmlWriter::new(io::sink());
    let _ = dump(device(), &DumpOptions::default(), &mut xml);
    // `list` and `volume`: read-only, every volume listed and read.
    let data: Arc<dyn DataDevice> = Arc::new(OverlayData::new(image.data.clone()));
    if let Ok(pool) = open(&damage.metadata, data, &damage.catalog, true) {
        assert_ne!(pool.mode(), PoolMode::Write, "a read-only open is writable");
        for info in pool.list() {
            if let Ok(v) = pool.volume(&info.name) {
                let mut buf = vec![0u8; PROBE_BYTES];
                let blocks = v.size_bytes() / BLOCK_BYTES;
                for block in 0..blocks.min(512) {
                    let _ = v.read(block * BLOCK_BYTES, &mut buf);
                }
            }
        }
        let _ = pool.close();
    }
    // `serve` (and every read-write open): the engine checks the metadata, then opens.
    let data: Arc<dyn DataDevice> = Arc::new(OverlayData::new(image.data.clone()));
    if let Ok(pool) = open(&damage.metadata, data, &damage.catalog, false) {
        if pool.mode() == PoolMode::Write {
            assert!(
                outcome.check_passed,
                "opened read-write although the start-up check fails"
            );
            outcome.opened_read_write = true;
            let crossed = write_and_compare(&pool, image).unwrap_or(false);
            assert!(
                !crossed,
                "a read-write open let a write land on another volume's data"
            );
        }
        let _ = pool.close();
    }
    outcome
}

/// Run `case` in a thread with a deadline: a panic or a hang fails the test, naming the
/// damage.
fn with_deadline(damage: Damage, image: Arc<Image>) -> Outcome {
    let (tx, rx) = mpsc::channel();
    let what = damage.what.clone();
    std::thread::Builder::new()
        .name("corruption-case".to_string())
        .spawn(move || {
            let outcome = run_case(&damage, &image);
            let _ = tx.send(outcome);
        })
        .unwrap();
    match rx.recv_timeout(CASE_DEADLINE) {
        Ok(outcome) => outcome,
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("hang: no answer within {CASE_DEADLINE:?} for damage {what:?}")
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("panic for damage {what:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// The memory-limited child process.

/// Run `body` in a child process (this test binary, running only `name`) whose address
/// space is limited, so that an allocation sized by a number read from disk aborts it and
/// fails the test. Returns in the parent once the child succeeded.
fn in_limited_child(name: &str, body: impl FnOnce()) {
    if std::env::var(CHILD_VARIABLE).as_deref() == Ok(name) {
        let limit = rustix::process::Rlimit {
            current: Some(ADDRESS_SPACE_LIMIT),
            maximum: Some(ADDRESS_SPACE_LIMIT),
        };
        rustix::process::setrlimit(rustix::process::Resource::As, limit).unwrap();
        body();
        return;
    }
    let report = testkit::seed_report();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_VARIABLE, name)
        .env(
            testkit::seed::SEED_VARIABLE,
            format!("{:#x}", report.seed()),
        )
        .env("MALLOC_ARENA_MAX", "2")
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(1800);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{name}: the child process hung");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        status.success(),
        "{name} failed in its memory-limited child ({status}); {} (and {VERBOSE_VARIABLE}=1 to name each case)",
        report.message()
    );
}

// ---------------------------------------------------------------------------------------
// Tests.

fn seeded_cases(default: u64) {
    let image = Arc::new(build());
    let (_report, mut rng) = testkit::seeded_rng();
    let cases = testkit::case_count(default);
    let mut totals = HashMap::<&str, usize>::new();
    let started = Instant::now();
    let verbose = std::env::var_os(VERBOSE_VARIABLE).is_some();
    let budget = std::env::var_os(testkit::seed::CASES_VARIABLE)
        .is_none()
        .then_some(DEFAULT_BUDGET);
    for _ in 0..cases {
        if budget.is_some_and(|budget| started.elapsed() > budget) {
            break;
        }
        let damage = damage(&mut rng, &image);
        if verbose {
            eprintln!("case: {:?}", damage.what);
        }
        let outcome = with_deadline(damage, image.clone());
        *totals.entry("cases").or_default() += 1;
        for (flag, key) in [
            (outcome.check_passed, "check passed"),
            (outcome.opened_read_write, "opened read-write"),
        ] {
            if flag {
                *totals.entry(key).or_default() += 1;
            }
        }
    }
    let mut totals: Vec<_> = totals.into_iter().collect();
    totals.sort();
    println!(
        "corruption suite: {totals:?} in {:.1} s (every case: no panic, hang, abort, unbounded allocation or cross-volume write)",
        started.elapsed().as_secs_f64()
    );
}

/// The seeded run of `scripts/test` (THINPOOL_CASES scales it; `scripts/fuzz` runs more).
#[test]
fn damaged_metadata_never_panics_hangs_aborts_or_crosses_volumes() {
    in_limited_child(
        "damaged_metadata_never_panics_hangs_aborts_or_crosses_volumes",
        || seeded_cases(DEFAULT_CASES),
    );
}

fn pristine_damage(image: &Image) -> Damage {
    Damage {
        what: vec!["none".to_string()],
        metadata: image.metadata.clone(),
        catalog: image.catalog.clone(),
    }
}

#[test]
fn the_pristine_image_passes_and_opens_read_write() {
    let image = Arc::new(build());
    let mappings: usize = image.contents.iter().map(|(_, p)| p.len()).sum();
    assert!(mappings >= 1500, "{mappings} mapped blocks");
    let outcome = with_deadline(pristine_damage(&image), image.clone());
    assert!(outcome.check_passed);
    assert!(outcome.opened_read_write);
}

/// The blocks of `image` holding data space map bitmaps: the entries of the data space
/// map's index (a one-leaf btree here, its root in the superblock).
fn data_bitmaps(image: &Image) -> Vec<usize> {
    let root = u64_at(&image.metadata, 80) as usize;
    let b = &image.metadata[root * BLOCK_SIZE..(root + 1) * BLOCK_SIZE];
    assert_eq!(u32_at(b, 4), 2, "the data space map's index is one leaf");
    let (nr, max) = (u32_at(b, 16) as usize, u32_at(b, 20) as usize);
    (0..nr)
        .map(|e| u64_at(b, 32 + 8 * max + 16 * e) as usize)
        .collect()
}

/// Repro 5: a zeroed data bitmap (valid checksum) made `serve` open read-write and hand a
/// snapshot's blocks to new writes. The start-up check refuses it.
#[test]
fn a_zeroed_data_bitmap_fails_the_start_up_check() {
    let image = Arc::new(build());
    let bitmaps = data_bitmaps(&image);
    assert_eq!(bitmaps.len(), 1, "one data bitmap for {DATA_BLOCKS} blocks");
    let mut damaged = pristine_damage(&image);
    block_of(&mut damaged.metadata, bitmaps[0])[16..].fill(0);
    restamp(&mut damaged.metadata, bitmaps[0], BlockKind::Bitmap);
    damaged.what = vec!["data bitmap zeroed".to_string()];
    let report = check_before_open(
        Arc::new(MemoryDevice::from_bytes(&damaged.metadata)),
        image.data.len() as u64,
    );
    assert!(!report.passes(true), "{report}");
    assert!(report.has(Rule::DataCount), "{report}");
    // And the whole suite's answer for it: no cross-volume write through serve's path.
    let outcome = with_deadline(damaged, image.clone());
    assert!(!outcome.opened_read_write);
}

/// Repro 6, first part: the data space map's `nr_blocks` sized the checker's arrays
/// (2^32: 4 GiB; 2^40: abort; 2^63: capacity overflow). Now a clear error, in a process
/// whose address space is limited.
#[test]
fn a_huge_data_nr_blocks_is_an_error_not_an_allocation() {
    in_limited_child(
        "a_huge_data_nr_blocks_is_an_error_not_an_allocation",
        || {
            let image = Arc::new(build());
            for nr_blocks in [1u64 << 32, 1 << 40, (1 << 40) + 1, 1 << 63, u64::MAX] {
                let mut damaged = pristine_damage(&image);
                put_u64(block_of(&mut damaged.metadata, 0), 64, nr_blocks);
                restamp(&mut damaged.metadata, 0, BlockKind::Superblock);
                damaged.what = vec![format!("data nr_blocks {nr_blocks}")];
                let device = || -> Arc<dyn BlockDevice> {
                    Arc::new(MemoryDevice::from_bytes(&damaged.metadata))
                };
                let report = check(device(), &CheckOptions::default(), &mut |_| {});
                assert!(report.has(Rule::DataDeviceSize), "{nr_blocks}: {report}");
                let report = check_before_open(device(), image.data.len() as u64);
                assert!(!report.passes(true), "{nr_blocks}: {report}");
                let mut xml = XmlWriter::new(io::sink());
                assert!(dump(device(), &DumpOptions::default(), &mut xml).is_err());
                let outcome = with_deadline(damaged, image.clone());
                assert!(!outcome.opened_read_write);
            }
            // Within what the metadata can hold but beyond the data device: the start-up check
            // says so.
            let mut damaged = pristine_damage(&image);
            put_u64(block_of(&mut damaged.metadata, 0), 64, 2 * DATA_BLOCKS);
            restamp(&mut damaged.metadata, 0, BlockKind::Superblock);
            let report = check_before_open(
                Arc::new(MemoryDevice::from_bytes(&damaged.metadata)),
                image.data.len() as u64,
            );
            assert!(report.has(Rule::DataDeviceSize), "{report}");
        },
    );
}

/// The id of volume `name` in `image`'s catalog.
fn volume_id(image: &Image, name: &str) -> u64 {
    u64::from(image.catalog.find(name).unwrap().id.get())
}

/// The value slot of `key` in the leaf at `block` (whose values are `value_size` bytes).
fn leaf_value_at(metadata: &[u8], block: usize, key: u64) -> usize {
    let b = &metadata[block * BLOCK_SIZE..(block + 1) * BLOCK_SIZE];
    assert_eq!(u32_at(b, 4), 2, "block {block} is a leaf");
    let (nr, max, value_size) = (
        u32_at(b, 16) as usize,
        u32_at(b, 20) as usize,
        u32_at(b, 24) as usize,
    );
    let i = (0..nr).find(|&i| u64_at(b, 32 + 8 * i) == key).unwrap();
    block * BLOCK_SIZE + 32 + 8 * max + value_size * i
}

/// The first leaf of the tree rooted at `block`.
fn first_leaf(metadata: &[u8], mut block: usize) -> usize {
    loop {
        let b = &metadata[block * BLOCK_SIZE..(block + 1) * BLOCK_SIZE];
        if u32_at(b, 4) == 2 {
            return block;
        }
        let max = u32_at(b, 20) as usize;
        block = u64_at(b, 32 + 8 * max) as usize;
    }
}

/// Repro 6, second part: a mapping to data block 2^40 - 1 (valid checksum) panicked
/// `list`, `serve` and `volume` in the index. Now every reader answers with an error.
#[test]
fn a_mapping_beyond_the_data_device_is_an_error() {
    let image = Arc::new(build());
    let mut damaged = pristine_damage(&image);
    let top = u64_at(&image.metadata, 320) as usize;
    let slot = leaf_value_at(&image.metadata, top, volume_id(&image, "a"));
    let root = u64_at(&image.metadata, slot) as usize;
    let leaf = first_leaf(&image.metadata, root);
    let b = block_of(&mut damaged.metadata, leaf);
    let max = u32_at(b, 20) as usize;
    let old = u64_at(b, 32 + 8 * max);
    put_u64(
        b,
        32 + 8 * max,
        (((1u64 << 40) - 1) << 24) | (old & 0xff_ffff),
    );
    restamp(&mut damaged.metadata, leaf, BlockKind::Node);
    damaged.what = vec![format!("leaf {leaf}: first mapping to data block 2^40 - 1")];
    let report = check_before_open(
        Arc::new(MemoryDevice::from_bytes(&damaged.metadata)),
        image.data.len() as u64,
    );
    assert!(report.has(Rule::DataBlockOutOfRange), "{report}");
    for read_only in [true, false] {
        let data: Arc<dyn DataDevice> = Arc::new(OverlayData::new(image.data.clone()));
        let opened = open(&damaged.metadata, data, &damaged.catalog, read_only);
        assert!(opened.is_err(), "read_only {read_only}: opened");
    }
    let outcome = with_deadline(damaged, image.clone());
    assert!(!outcome.check_passed);
}

/// Repro 6, third part: details whose `mapped_blocks` undercount the tree panicked a
/// connection thread inside the commit (and the client's FLUSH never returned). Now the
/// start-up check refuses it and the engine does not open it read-write.
#[test]
fn mapped_blocks_that_undercount_the_tree_are_an_error() {
    let image = Arc::new(build());
    let details_root = u64_at(&image.metadata, 328) as usize;
    for mapped in [0u64, 5] {
        let mut damaged = pristine_damage(&image);
        let slot = leaf_value_at(&image.metadata, details_root, volume_id(&image, "c"));
        put_u64(&mut damaged.metadata, slot, mapped);
        restamp(&mut damaged.metadata, details_root, BlockKind::Node);
        damaged.what = vec![format!("details of c: mapped_blocks 10 -> {mapped}")];
        let report = check_before_open(
            Arc::new(MemoryDevice::from_bytes(&damaged.metadata)),
            image.data.len() as u64,
        );
        assert!(report.has(Rule::MappedBlocks), "{report}");
        let data: Arc<dyn DataDevice> = Arc::new(OverlayData::new(image.data.clone()));
        if let Ok(pool) = open(&damaged.metadata, data, &damaged.catalog, false) {
            // Opened: it must not be writable, or survive discarding every mapped block.
            if pool.mode() == PoolMode::Write {
                let v = pool.volume("c").unwrap();
                let discarded = v.write_zeroes(100 * BLOCK_BYTES, 10 * BLOCK_BYTES, true, false);
                let flushed = v.flush();
                panic!("mapped_blocks {mapped}: opened read-write ({discarded:?}, {flushed:?})");
            }
        }
        let outcome = with_deadline(damaged, image.clone());
        assert!(!outcome.check_passed && !outcome.opened_read_write);
    }
}
