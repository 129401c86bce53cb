//! Shared by persistent-data's integration tests: a tiny test pool (a superblock holding both
//! space-map roots and up to 16 tree roots), the reference counters trees need, value types
//! of every size dm-thin uses, and a full reference recount (spec §7.8) to compare with both
//! space maps.
//!
//! Test superblock (block 0), laid out like dm-thin's where they overlap:
//!
//! ```text
//!    32  magic                u64   TEST_MAGIC
//!    40  tree count           u32
//!    64  data space-map root  32 bytes
//!   192  meta space-map root  32 bytes
//!   320  tree roots           u64 × tree count (at most 16, so everything ends before 512)
//! ```
//!
//! All of it lies in the first 512-byte sector and the rest of the block is zero, so a torn
//! superblock write is either the old or the new superblock, as with dm-thin's 364-byte one.
#![allow(dead_code)]

use persistent_data::block_manager::BlockManager;
use persistent_data::btree::node::Node;
use persistent_data::btree::{self, CheckOptions, NoRefs, RefCounter, Value};
use persistent_data::checksum::BlockKind;
use persistent_data::space_map::core::bitmap_count;
use persistent_data::space_map::{disk, DataSpaceMap, IndexEntry, SpaceMapRoot};
use persistent_data::{
    BlockDevice, BlockSource, CopyOnWrite, Error, MetadataBlock, Result, TransactionManager,
};
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

/// Identifies a test superblock.
pub const TEST_MAGIC: u64 = 0x7465_7374_706f_6f6c;
const MAGIC_AT: usize = 32;
const TREE_COUNT_AT: usize = 40;
pub const DATA_SM_AT: usize = 64;
pub const META_SM_AT: usize = 192;
pub const ROOTS_AT: usize = 320;
pub const TREES_MAX: usize = 16;
/// Cache of the block manager a pool opens with: small, so tests exercise eviction.
pub const CACHE_BLOCKS: usize = 512;

/// What a tree's leaf values are, which decides what they reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TreeKind {
    /// u64 values, each a data block (like a bottom-level mapping tree, minus the time).
    Data,
    /// Values of this many bytes (4, 8, 16 or 24) that reference nothing.
    Plain(usize),
    /// Two levels like dm-thin's mapping tree: top-level u64 values are roots of `Data` trees.
    TwoLevel,
    /// The data space map's index tree: 16-byte entries, each referencing a bitmap block.
    SpaceMapIndex,
    /// dm-thin's mapping tree: like `TwoLevel`, but bottom-level values are block_time
    /// (`data_block << 24 | time`, spec §6.1).
    ThinMapping,
    /// A bottom level of `ThinMapping`.
    BlockTime,
}

impl TreeKind {
    /// Size of the values in this tree's leaves.
    pub fn value_size(self) -> usize {
        match self {
            TreeKind::Data | TreeKind::TwoLevel | TreeKind::ThinMapping | TreeKind::BlockTime => 8,
            TreeKind::Plain(size) => size,
            TreeKind::SpaceMapIndex => 16,
        }
    }
}

/// A value of any size, as raw bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Raw<const N: usize>(pub [u8; N]);

impl<const N: usize> Value for Raw<N> {
    const SIZE: usize = N;
    fn unpack(bytes: &[u8]) -> Self {
        Raw(bytes.try_into().expect("value of N bytes"))
    }
    fn pack(&self, out: &mut [u8]) {
        out.copy_from_slice(&self.0);
    }
}

/// dm-thin's device details (spec §6.2): the 24-byte value type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Details {
    pub mapped_blocks: u64,
    pub transaction_id: u64,
    pub creation_time: u32,
    pub snapshotted_time: u32,
}

impl Value for Details {
    const SIZE: usize = 24;
    fn unpack(bytes: &[u8]) -> Details {
        Details {
            mapped_blocks: u64::from_le_bytes(bytes[0..8].try_into().expect("8 bytes")),
            transaction_id: u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes")),
            creation_time: u32::from_le_bytes(bytes[16..20].try_into().expect("4 bytes")),
            snapshotted_time: u32::from_le_bytes(bytes[20..24].try_into().expect("4 bytes")),
        }
    }
    fn pack(&self, out: &mut [u8]) {
        out[0..8].copy_from_slice(&self.mapped_blocks.to_le_bytes());
        out[8..16].copy_from_slice(&self.transaction_id.to_le_bytes());
        out[16..20].copy_from_slice(&self.creation_time.to_le_bytes());
        out[20..24].copy_from_slice(&self.snapshotted_time.to_le_bytes());
    }
}

/// Leaf values are data blocks.
pub struct DataRefs<'a>(pub &'a mut DataSpaceMap);

impl RefCounter<u64> for DataRefs<'_> {
    fn inc(&mut self, _: &mut dyn CopyOnWrite, value: &u64) -> Result<()> {
        self.0.inc(*value)
    }
    fn dec(&mut self, _: &mut dyn CopyOnWrite, value: &u64) -> Result<()> {
        self.0.dec(*value).map(|_| ())
    }
}

/// Top-level values are subtree roots: a copy of a shared leaf takes a reference to each;
/// a removed value releases its whole subtree.
pub struct SubtreeRefs<'a>(pub &'a mut DataSpaceMap);

impl RefCounter<u64> for SubtreeRefs<'_> {
    fn inc(&mut self, tm: &mut dyn CopyOnWrite, value: &u64) -> Result<()> {
        tm.inc(MetadataBlock::new(*value))
    }
    fn dec(&mut self, tm: &mut dyn CopyOnWrite, value: &u64) -> Result<()> {
        btree::delete_tree::<u64, _>(tm, &mut DataRefs(&mut *self.0), MetadataBlock::new(*value))
    }
}

/// For replacing a subtree root by its shadow: the shadow already dropped the old root's
/// reference, so a replaced value releases nothing (copies still take references).
pub struct RootUpdateRefs;

impl RefCounter<u64> for RootUpdateRefs {
    fn inc(&mut self, tm: &mut dyn CopyOnWrite, value: &u64) -> Result<()> {
        tm.inc(MetadataBlock::new(*value))
    }
    fn dec(&mut self, _: &mut dyn CopyOnWrite, _: &u64) -> Result<()> {
        Ok(())
    }
}

/// Create an empty tree of `kind`.
pub fn create_empty(tm: &mut TransactionManager, kind: TreeKind) -> Result<MetadataBlock> {
    match kind.value_size() {
        4 => btree::create_empty::<u32>(tm),
        8 => btree::create_empty::<u64>(tm),
        16 => btree::create_empty::<IndexEntry>(tm),
        24 => btree::create_empty::<Details>(tm),
        other => panic!("no value type of {other} bytes"),
    }
}

/// Contents of one tree, value bytes by key (two levels for a `TwoLevel` tree).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Contents {
    Flat(BTreeMap<u64, Vec<u8>>),
    TwoLevel(BTreeMap<u64, BTreeMap<u64, u64>>),
}

fn walk_raw<const N: usize>(
    source: &dyn BlockSource,
    root: MetadataBlock,
) -> Result<BTreeMap<u64, Vec<u8>>> {
    let mut out = BTreeMap::new();
    btree::walk::<Raw<N>, _>(source, root, &mut |k, v| {
        out.insert(k, v.0.to_vec());
        Ok(())
    })?;
    Ok(out)
}

/// Read a whole tree.
pub fn contents(source: &dyn BlockSource, kind: TreeKind, root: MetadataBlock) -> Result<Contents> {
    Ok(match kind {
        TreeKind::TwoLevel | TreeKind::ThinMapping => {
            let mut tops = Vec::new();
            btree::walk::<u64, _>(source, root, &mut |k, v| {
                tops.push((k, v));
                Ok(())
            })?;
            let mut out = BTreeMap::new();
            for (key, bottom) in tops {
                let mut inner = BTreeMap::new();
                btree::walk::<u64, _>(source, MetadataBlock::new(bottom), &mut |k, v| {
                    inner.insert(k, v);
                    Ok(())
                })?;
                out.insert(key, inner);
            }
            Contents::TwoLevel(out)
        }
        _ => Contents::Flat(match kind.value_size() {
            4 => walk_raw::<4>(source, root)?,
            8 => walk_raw::<8>(source, root)?,
            16 => walk_raw::<16>(source, root)?,
            24 => walk_raw::<24>(source, root)?,
            other => panic!("no value type of {other} bytes"),
        }),
    })
}

fn check_raw<const N: usize>(
    source: &dyn BlockSource,
    root: MetadataBlock,
    options: CheckOptions,
    visit_value: &mut dyn FnMut(u64, &[u8]),
) -> Result<btree::TreeStats> {
    btree::check::<Raw<N>, _>(source, root, options, &mut |_| {}, &mut |k, v| {
        visit_value(k, &v.0);
        Ok(())
    })
}

/// Run `btree::check` over a tree of `kind` (both levels of a two-level tree).
pub fn check_tree(
    source: &dyn BlockSource,
    kind: TreeKind,
    root: MetadataBlock,
    options: CheckOptions,
) -> Result<()> {
    let mut bottoms = Vec::new();
    let mut visit = |_: u64, v: &[u8]| {
        if matches!(kind, TreeKind::TwoLevel | TreeKind::ThinMapping) {
            bottoms.push(MetadataBlock::new(u64::from_le_bytes(
                v.try_into().expect("8 bytes"),
            )));
        }
    };
    match kind.value_size() {
        4 => check_raw::<4>(source, root, options, &mut visit)?,
        8 => check_raw::<8>(source, root, options, &mut visit)?,
        16 => check_raw::<16>(source, root, options, &mut visit)?,
        24 => check_raw::<24>(source, root, options, &mut visit)?,
        other => panic!("no value type of {other} bytes"),
    };
    let mut seen = HashSet::new();
    for bottom in bottoms {
        if seen.insert(bottom) {
            check_raw::<8>(source, bottom, options, &mut |_, _| {})?;
        }
    }
    Ok(())
}

/// Reference counts recomputed from the structures (spec §7.8).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counts {
    pub meta: Vec<u32>,
    pub data: Vec<u32>,
}

fn bump(counts: &mut [u32], index: u64, what: &str, from: MetadataBlock) -> Result<()> {
    match usize::try_from(index).ok().and_then(|i| counts.get_mut(i)) {
        Some(count) => {
            *count += 1;
            Ok(())
        }
        None => Err(Error::corrupt(
            from,
            format!(
                "recount: {what} {index} beyond the map ({} blocks)",
                counts.len()
            ),
        )),
    }
}

/// Recount every reference reachable from the space-map roots and `trees`. A node shared by
/// several parents is counted once per parent, its contents once; a leaf referencing a data
/// block counts once however many trees share it.
pub fn recount(
    source: &dyn BlockSource,
    meta_root: &SpaceMapRoot,
    data_root: &SpaceMapRoot,
    trees: &[(TreeKind, MetadataBlock)],
) -> Result<Counts> {
    let mut counts = Counts {
        meta: vec![0; meta_root.block_count as usize],
        data: vec![0; data_root.block_count as usize],
    };
    let mut seen = HashSet::new();
    bump(&mut counts.meta, 0, "superblock", MetadataBlock::new(0))?;
    for &(kind, root) in trees {
        count_tree(source, kind, root, 0, &mut counts, &mut seen)?;
    }
    count_tree(
        source,
        TreeKind::SpaceMapIndex,
        MetadataBlock::new(data_root.bitmap_root),
        0,
        &mut counts,
        &mut seen,
    )?;
    for root in [data_root.ref_count_root, meta_root.ref_count_root] {
        count_tree(
            source,
            TreeKind::Plain(4),
            MetadataBlock::new(root),
            0,
            &mut counts,
            &mut seen,
        )?;
    }
    let index_block = MetadataBlock::new(meta_root.bitmap_root);
    bump(
        &mut counts.meta,
        index_block.get(),
        "index block",
        MetadataBlock::new(0),
    )?;
    let index = source.read_block(index_block, BlockKind::Index)?;
    for entry in disk::decode_index_block(&index)
        .iter()
        .take(bitmap_count(meta_root.block_count))
    {
        bump(
            &mut counts.meta,
            entry.blocknr,
            "metadata bitmap",
            index_block,
        )?;
    }
    Ok(counts)
}

fn count_tree(
    source: &dyn BlockSource,
    kind: TreeKind,
    block: MetadataBlock,
    depth: usize,
    counts: &mut Counts,
    seen: &mut HashSet<MetadataBlock>,
) -> Result<()> {
    bump(&mut counts.meta, block.get(), "tree node", block)?;
    if !seen.insert(block) {
        return Ok(()); // shared: its contents were counted through its first parent
    }
    if depth >= btree::MAX_DEPTH {
        return Err(Error::corrupt(block, "recount: tree too deep"));
    }
    let data = source.read_block(block, BlockKind::Node)?;
    let node = Node::parse(block, &data, kind.value_size())?;
    for i in 0..node.len() {
        if !node.is_leaf() {
            count_tree(source, kind, node.child(i), depth + 1, counts, seen)?;
            continue;
        }
        let bytes = node.value_bytes(i);
        match kind {
            TreeKind::Data => bump(&mut counts.data, u64::unpack(bytes), "data block", block)?,
            TreeKind::BlockTime => bump(
                &mut counts.data,
                u64::unpack(bytes) >> 24,
                "data block",
                block,
            )?,
            TreeKind::TwoLevel | TreeKind::ThinMapping => {
                let bottom_kind = if kind == TreeKind::TwoLevel {
                    TreeKind::Data
                } else {
                    TreeKind::BlockTime
                };
                let bottom = MetadataBlock::new(u64::unpack(bytes));
                count_tree(source, bottom_kind, bottom, 0, counts, seen)?;
            }
            TreeKind::SpaceMapIndex => {
                bump(
                    &mut counts.meta,
                    IndexEntry::unpack(bytes).blocknr,
                    "data bitmap",
                    block,
                )?;
            }
            TreeKind::Plain(_) => {}
        }
    }
    Ok(())
}

/// Compare recounted references with the space maps: `Err(Invalid)` listing the first
/// differences.
pub fn compare_counts(
    counts: &Counts,
    meta_count: &dyn Fn(u64) -> u32,
    data_count: &dyn Fn(u64) -> u32,
) -> Result<()> {
    let mut differences = Vec::new();
    for (b, &expected) in counts.meta.iter().enumerate() {
        let actual = meta_count(b as u64);
        if actual != expected {
            differences.push(format!(
                "metadata block {b}: space map {actual}, recount {expected}"
            ));
        }
    }
    for (b, &expected) in counts.data.iter().enumerate() {
        let actual = data_count(b as u64);
        if actual != expected {
            differences.push(format!(
                "data block {b}: space map {actual}, recount {expected}"
            ));
        }
    }
    if differences.is_empty() {
        return Ok(());
    }
    let total = differences.len();
    differences.truncate(8);
    Err(Error::Invalid(format!(
        "reference counts differ in {total} blocks: {}",
        differences.join("; ")
    )))
}

/// The decoded test superblock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub data_root: SpaceMapRoot,
    pub meta_root: SpaceMapRoot,
    pub roots: Vec<MetadataBlock>,
}

impl Superblock {
    /// Every tree reachable from the superblock with its kind: the pool's trees (of `kinds`,
    /// in root order), the data space map's index and overflow ref-count trees, and the
    /// metadata space map's overflow ref-count tree.
    pub fn trees(&self, kinds: &[TreeKind]) -> Vec<(TreeKind, MetadataBlock)> {
        let mut trees: Vec<(TreeKind, MetadataBlock)> = kinds
            .iter()
            .copied()
            .zip(self.roots.iter().copied())
            .collect();
        trees.push((
            TreeKind::SpaceMapIndex,
            MetadataBlock::new(self.data_root.bitmap_root),
        ));
        trees.push((
            TreeKind::Plain(4),
            MetadataBlock::new(self.data_root.ref_count_root),
        ));
        trees.push((
            TreeKind::Plain(4),
            MetadataBlock::new(self.meta_root.ref_count_root),
        ));
        trees
    }
}

/// Read and decode the test superblock of a device.
pub fn read_superblock(bm: &BlockManager) -> Result<Superblock> {
    let sb = bm.read(MetadataBlock::SUPERBLOCK, BlockKind::Superblock)?;
    let magic = u64::from_le_bytes(sb[MAGIC_AT..MAGIC_AT + 8].try_into().expect("8 bytes"));
    if magic != TEST_MAGIC {
        return Err(Error::corrupt(
            MetadataBlock::new(0),
            format!("test superblock magic {magic:#x}"),
        ));
    }
    let count = u32::from_le_bytes(
        sb[TREE_COUNT_AT..TREE_COUNT_AT + 4]
            .try_into()
            .expect("4 bytes"),
    ) as usize;
    if count > TREES_MAX {
        return Err(Error::corrupt(
            MetadataBlock::new(0),
            format!("{count} tree roots"),
        ));
    }
    let roots = (0..count)
        .map(|i| {
            let at = ROOTS_AT + 8 * i;
            MetadataBlock::new(u64::from_le_bytes(
                sb[at..at + 8].try_into().expect("8 bytes"),
            ))
        })
        .collect();
    Ok(Superblock {
        data_root: SpaceMapRoot::decode(&sb[DATA_SM_AT..DATA_SM_AT + 32]),
        meta_root: SpaceMapRoot::decode(&sb[META_SM_AT..META_SM_AT + 32]),
        roots,
    })
}

/// A tiny pool: a transaction manager, a data space map and a few trees, all reachable from
/// a test superblock.
pub struct Pool {
    pub device: Arc<dyn BlockDevice>,
    pub tm: TransactionManager,
    pub data: DataSpaceMap,
    pub kinds: Vec<TreeKind>,
    pub roots: Vec<MetadataBlock>,
}

impl Pool {
    /// Format `device` with `data_blocks` data blocks and one empty tree per kind, and commit.
    pub fn format(
        device: Arc<dyn BlockDevice>,
        data_blocks: u64,
        kinds: &[TreeKind],
    ) -> Result<Pool> {
        assert!(kinds.len() <= TREES_MAX);
        let bm = Arc::new(BlockManager::new(device.clone(), CACHE_BLOCKS));
        let mut tm = TransactionManager::format(bm, device.block_count())?;
        let data = DataSpaceMap::format(&mut tm, data_blocks)?;
        let mut roots = Vec::new();
        for &kind in kinds {
            roots.push(create_empty(&mut tm, kind)?);
        }
        let mut pool = Pool {
            device,
            tm,
            data,
            kinds: kinds.to_vec(),
            roots,
        };
        pool.commit()?;
        Ok(pool)
    }

    /// Open the committed state of `device`, whose trees are of `kinds`.
    pub fn open(device: Arc<dyn BlockDevice>, kinds: &[TreeKind]) -> Result<Pool> {
        let bm = Arc::new(BlockManager::new(device.clone(), CACHE_BLOCKS));
        let sb = read_superblock(&bm)?;
        if sb.roots.len() != kinds.len() {
            return Err(Error::corrupt(
                MetadataBlock::new(0),
                format!("{} tree roots, expected {}", sb.roots.len(), kinds.len()),
            ));
        }
        let tm = TransactionManager::open(bm.clone(), &sb.meta_root)?;
        let data = DataSpaceMap::open(&*bm, &sb.data_root)?;
        Ok(Pool {
            device,
            tm,
            data,
            kinds: kinds.to_vec(),
            roots: sb.roots,
        })
    }

    /// Commit the transaction: data space map, metadata space map, superblock.
    pub fn commit(&mut self) -> Result<()> {
        let data_root = self.data.commit(&mut self.tm)?;
        let meta_root = self.tm.commit_space_map()?;
        let mut sb = persistent_data::block::zeroed_block();
        sb[MAGIC_AT..MAGIC_AT + 8].copy_from_slice(&TEST_MAGIC.to_le_bytes());
        sb[TREE_COUNT_AT..TREE_COUNT_AT + 4]
            .copy_from_slice(&(self.roots.len() as u32).to_le_bytes());
        data_root.encode(&mut sb[DATA_SM_AT..DATA_SM_AT + 32]);
        meta_root.encode(&mut sb[META_SM_AT..META_SM_AT + 32]);
        for (i, root) in self.roots.iter().enumerate() {
            let at = ROOTS_AT + 8 * i;
            sb[at..at + 8].copy_from_slice(&root.get().to_le_bytes());
        }
        self.tm.commit(sb)
    }

    /// Reopen from the device (dropping anything uncommitted).
    pub fn reopen(&mut self) -> Result<()> {
        *self = Pool::open(self.device.clone(), &self.kinds)?;
        Ok(())
    }

    /// Every tree's contents, as of this transaction.
    pub fn contents(&self) -> Result<Vec<Contents>> {
        self.kinds
            .iter()
            .zip(&self.roots)
            .map(|(&kind, &root)| contents(&self.tm, kind, root))
            .collect()
    }

    /// Check the committed state completely: every tree (and the space maps' trees) with
    /// `btree::check`, then recount every reference and compare with both space maps.
    /// Call right after `commit` or `open` (the space maps' structures on disk are current
    /// only then).
    pub fn verify(&self) -> Result<()> {
        let bm = self.tm.block_manager().clone();
        let sb = read_superblock(&bm)?;
        let source: &dyn BlockSource = &*bm;
        let options = CheckOptions::default();
        let trees = sb.trees(&self.kinds);
        for &(kind, root) in &trees {
            check_tree(source, kind, root, options)?;
        }
        let counts = recount(
            source,
            &sb.meta_root,
            &sb.data_root,
            &trees[..self.kinds.len()],
        )?;
        if sb.meta_root.block_count != self.tm.space_map().block_count()
            || sb.data_root.block_count != self.data.block_count()
        {
            return Err(Error::Invalid(
                "space-map sizes differ from the superblock".into(),
            ));
        }
        compare_counts(&counts, &|b| self.tm.count(MetadataBlock::new(b)), &|b| {
            self.data.count(b)
        })?;
        let allocated = |c: &[u32]| c.iter().filter(|&&c| c > 0).count() as u64;
        if sb.meta_root.allocated_count != allocated(&counts.meta)
            || sb.data_root.allocated_count != allocated(&counts.data)
        {
            return Err(Error::Invalid(format!(
                "nr_allocated in the superblock ({} metadata, {} data) is not the recount ({}, {})",
                sb.meta_root.allocated_count,
                sb.data_root.allocated_count,
                allocated(&counts.meta),
                allocated(&counts.data)
            )));
        }
        self.tm.space_map().verify();
        self.data.core().verify();
        Ok(())
    }

    fn expect_kind(&self, tree: usize, kinds: &[TreeKind]) {
        assert!(
            kinds.contains(&self.kinds[tree]),
            "tree {tree} is {:?}, not {kinds:?}",
            self.kinds[tree]
        );
    }

    /// Map `key` to data block `value` in a `Data` tree (the tree holds the reference the
    /// caller got from `data.alloc()`).
    pub fn insert_data(&mut self, tree: usize, key: u64, value: u64) -> Result<Option<u64>> {
        self.expect_kind(tree, &[TreeKind::Data]);
        let (root, old) = btree::insert(
            &mut self.tm,
            &mut DataRefs(&mut self.data),
            self.roots[tree],
            key,
            &value,
        )?;
        self.roots[tree] = root;
        Ok(old)
    }

    /// Remove `key` from a `Data` tree.
    pub fn remove_data(&mut self, tree: usize, key: u64) -> Result<Option<u64>> {
        self.expect_kind(tree, &[TreeKind::Data]);
        let (root, old) = btree::remove::<u64, _>(
            &mut self.tm,
            &mut DataRefs(&mut self.data),
            self.roots[tree],
            key,
        )?;
        self.roots[tree] = root;
        Ok(old)
    }

    /// Remove `begin..end` from a `Data` tree.
    pub fn remove_range_data(&mut self, tree: usize, begin: u64, end: u64) -> Result<u64> {
        self.expect_kind(tree, &[TreeKind::Data]);
        let (root, removed) = btree::remove_range::<u64, _>(
            &mut self.tm,
            &mut DataRefs(&mut self.data),
            self.roots[tree],
            begin,
            end,
        )?;
        self.roots[tree] = root;
        Ok(removed)
    }

    /// Insert into a `Plain` tree.
    pub fn insert_plain<V: Value + PartialEq>(
        &mut self,
        tree: usize,
        key: u64,
        value: &V,
    ) -> Result<Option<V>> {
        self.expect_kind(tree, &[TreeKind::Plain(V::SIZE)]);
        let (root, old) = btree::insert(&mut self.tm, &mut NoRefs, self.roots[tree], key, value)?;
        self.roots[tree] = root;
        Ok(old)
    }

    /// Remove from a `Plain` tree.
    pub fn remove_plain<V: Value>(&mut self, tree: usize, key: u64) -> Result<Option<V>> {
        self.expect_kind(tree, &[TreeKind::Plain(V::SIZE)]);
        let (root, old) = btree::remove::<V, _>(&mut self.tm, &mut NoRefs, self.roots[tree], key)?;
        self.roots[tree] = root;
        Ok(old)
    }

    /// Map (`top`, `key`) to data block `value` in a `TwoLevel` tree, creating the subtree.
    pub fn insert_mapping(
        &mut self,
        tree: usize,
        top: u64,
        key: u64,
        value: u64,
    ) -> Result<Option<u64>> {
        self.expect_kind(tree, &[TreeKind::TwoLevel]);
        let bottom = match btree::lookup::<u64, _>(&self.tm, self.roots[tree], top)? {
            Some(root) => MetadataBlock::new(root),
            None => {
                let root = btree::create_empty::<u64>(&mut self.tm)?;
                let (top_root, _) = btree::insert(
                    &mut self.tm,
                    &mut RootUpdateRefs,
                    self.roots[tree],
                    top,
                    &root.get(),
                )?;
                self.roots[tree] = top_root;
                root
            }
        };
        let (new_bottom, old) = btree::insert(
            &mut self.tm,
            &mut DataRefs(&mut self.data),
            bottom,
            key,
            &value,
        )?;
        let (top_root, _) = btree::insert(
            &mut self.tm,
            &mut RootUpdateRefs,
            self.roots[tree],
            top,
            &new_bottom.get(),
        )?;
        self.roots[tree] = top_root;
        Ok(old)
    }

    /// Remove a whole subtree of a `TwoLevel` tree.
    pub fn remove_subtree(&mut self, tree: usize, top: u64) -> Result<bool> {
        self.expect_kind(tree, &[TreeKind::TwoLevel]);
        let (root, old) = btree::remove::<u64, _>(
            &mut self.tm,
            &mut SubtreeRefs(&mut self.data),
            self.roots[tree],
            top,
        )?;
        self.roots[tree] = root;
        Ok(old.is_some())
    }

    /// Share subtree `from` of a `TwoLevel` tree under the new key `to` (a snapshot).
    pub fn snapshot_subtree(&mut self, tree: usize, from: u64, to: u64) -> Result<()> {
        self.expect_kind(tree, &[TreeKind::TwoLevel]);
        let root = btree::lookup::<u64, _>(&self.tm, self.roots[tree], from)?
            .ok_or_else(|| Error::Invalid(format!("no subtree {from}")))?;
        self.tm.inc(MetadataBlock::new(root))?;
        let (top_root, old) = btree::insert(
            &mut self.tm,
            &mut SubtreeRefs(&mut self.data),
            self.roots[tree],
            to,
            &root,
        )?;
        assert!(old.is_none(), "snapshot over an existing subtree {to}");
        self.roots[tree] = top_root;
        Ok(())
    }

    /// Release tree `tree` completely and give it a new empty root.
    pub fn release(&mut self, tree: usize) -> Result<()> {
        let root = self.roots[tree];
        self.delete(self.kinds[tree], root)?;
        self.roots[tree] = create_empty(&mut self.tm, self.kinds[tree])?;
        Ok(())
    }

    fn delete(&mut self, kind: TreeKind, root: MetadataBlock) -> Result<()> {
        match kind {
            TreeKind::Data => {
                btree::delete_tree::<u64, _>(&mut self.tm, &mut DataRefs(&mut self.data), root)
            }
            TreeKind::TwoLevel => {
                btree::delete_tree::<u64, _>(&mut self.tm, &mut SubtreeRefs(&mut self.data), root)
            }
            other => match other.value_size() {
                4 => btree::delete_tree::<u32, _>(&mut self.tm, &mut NoRefs, root),
                8 => btree::delete_tree::<u64, _>(&mut self.tm, &mut NoRefs, root),
                16 => btree::delete_tree::<IndexEntry, _>(&mut self.tm, &mut NoRefs, root),
                24 => btree::delete_tree::<Details, _>(&mut self.tm, &mut NoRefs, root),
                size => panic!("no value type of {size} bytes"),
            },
        }
    }

    /// Make tree `to` share tree `from`'s root (a clone: O(1), copy-on-write from now on);
    /// `to`'s old tree is released. Both must be of the same kind.
    pub fn share(&mut self, from: usize, to: usize) -> Result<()> {
        assert_eq!(
            self.kinds[from], self.kinds[to],
            "sharing between trees of different kinds"
        );
        let old = self.roots[to];
        self.delete(self.kinds[to], old)?;
        self.tm.inc(self.roots[from])?;
        self.roots[to] = self.roots[from];
        Ok(())
    }
}

/// The seed for a test, its report (prints it on failure) and a generator.
pub fn seeded() -> (testkit::SeedReport, rand::rngs::StdRng) {
    testkit::seeded_rng()
}
