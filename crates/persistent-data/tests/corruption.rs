//! Corrupt metadata gives a corruption error, never a panic, a hang or a wrong answer.
//!
//! Goal: whatever single committed block is damaged, opening the metadata and walking,
//! checking and looking up everything returns `Err` (a checksum error or `Corrupt`, naming
//! the damaged block when its checksum breaks), never panics and never hangs; a lookup that
//! does succeed returns the right value; and trying to change the damaged metadata fails
//! cleanly too.
//!
//! Method: build and commit metadata with several trees (a data-block tree, a details tree
//! of 24-byte values, a two-level tree with a subtree shared three ways so the metadata
//! overflow tree is used, a u32 tree) and a data space map of three bitmaps with counts up
//! to 3 (its overflow tree is used too). Then, for every committed block (sampled if there
//! are more than `THINPOOL_CASES`, default 400), serve a damaged copy of it through an
//! overlay device: random bytes flipped; a byte flipped in a part of the block no reader
//! looks at (caught by the checksum all the same); the block zeroed; a valid block of
//! another kind written there; and, for blocks holding pointers, a pointer redirected (with
//! a valid checksum) beyond the device, at a free block, or at the block itself. Each case
//! runs on its own thread under `catch_unwind` with a time limit; a panic or a timeout fails
//! the test naming the block, the damage and the seed.

mod common;

use common::{Details, Pool, TreeKind};
use persistent_data::block_manager::BlockManager;
use persistent_data::btree::node::Node;
use persistent_data::btree::{self, CheckOptions};
use persistent_data::checksum::{self, BlockKind};
use persistent_data::space_map::core::bitmap_count;
use persistent_data::space_map::{disk, IndexEntry};
use persistent_data::{Block, BlockDevice, Error, MemoryDevice, MetadataBlock, BLOCK_SIZE};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap};
use std::io;
use std::panic::{self, AssertUnwindSafe};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

const KINDS: [TreeKind; 4] = [
    TreeKind::Data,
    TreeKind::Plain(24),
    TreeKind::TwoLevel,
    TreeKind::Plain(4),
];
const DATA_BLOCKS: u64 = 40_000;
const CASE_TIME_LIMIT: Duration = Duration::from_secs(30);

/// A device that serves some blocks from an overlay: the damaged block, and whatever the
/// engine writes (so the pristine image underneath is shared by every case).
struct OverlayDevice {
    base: Arc<MemoryDevice>,
    overlay: Mutex<HashMap<u64, Box<Block>>>,
}

impl OverlayDevice {
    fn new(base: Arc<MemoryDevice>, block: MetadataBlock, data: Box<Block>) -> OverlayDevice {
        OverlayDevice {
            base,
            overlay: Mutex::new(HashMap::from([(block.get(), data)])),
        }
    }
}

impl BlockDevice for OverlayDevice {
    fn block_count(&self) -> u64 {
        self.base.block_count()
    }
    fn read(&self, block: MetadataBlock, buf: &mut Block) -> io::Result<()> {
        if let Some(data) = self.overlay.lock().unwrap().get(&block.get()) {
            buf.copy_from_slice(&data[..]);
            return Ok(());
        }
        self.base.read(block, buf)
    }
    fn write(&self, block: MetadataBlock, buf: &Block) -> io::Result<()> {
        if block.get() >= self.base.block_count() {
            return self.base.write(block, buf); // the base reports the error
        }
        self.overlay
            .lock()
            .unwrap()
            .insert(block.get(), Box::new(*buf));
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
}

/// What the pristine metadata holds.
#[derive(Clone, Debug, Default)]
struct Model {
    data: BTreeMap<u64, u64>,
    details: BTreeMap<u64, Details>,
    two_level: BTreeMap<u64, BTreeMap<u64, u64>>,
    small: BTreeMap<u64, u32>,
}

/// What a committed block is, for choosing damage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Superblock,
    MetadataIndex,
    Bitmap,
    /// A node of a tree of this kind (a two-level tree's subtrees are `Data`).
    Node(TreeKind),
}

#[derive(Clone, Copy, Debug)]
enum Damage {
    /// XOR random bytes at these offsets.
    Flip(&'static str),
    Zero,
    /// Put a valid block of another kind here.
    OtherKind,
    /// Redirect the u64 pointer at this byte offset (checksum restamped).
    Pointer {
        offset: usize,
        target: Target,
    },
}

#[derive(Clone, Copy, Debug)]
enum Target {
    BeyondDevice,
    FreeBlock,
    Itself,
}

fn random_data_block(pool: &mut Pool, rng: &mut StdRng) -> u64 {
    loop {
        let block = rng.gen_range(0..DATA_BLOCKS);
        if pool.data.count(block) == 0 {
            pool.data.inc(block).unwrap();
            return block;
        }
    }
}

/// Build the pristine image.
fn build(rng: &mut StdRng) -> (Arc<MemoryDevice>, Model) {
    let device = Arc::new(MemoryDevice::new(4096));
    let mut pool = Pool::format(device.clone(), DATA_BLOCKS, &KINDS).unwrap();
    let mut model = Model::default();
    for _ in 0..6000 {
        let key = rng.gen_range(0..1_000_000);
        let value = random_data_block(&mut pool, rng);
        pool.insert_data(0, key, value).unwrap();
        if let Some(old) = model.data.insert(key, value) {
            assert_ne!(old, value);
        }
    }
    // One data block in three leaves: count 3, in the data space map's overflow tree.
    let shared = random_data_block(&mut pool, rng);
    for key in [1_000_001, 1_500_000, 2_000_000] {
        pool.insert_data(0, key, shared).unwrap();
        model.data.insert(key, shared);
    }
    pool.data.inc(shared).unwrap();
    pool.data.inc(shared).unwrap();
    for _ in 0..400 {
        let key = rng.gen_range(0..5000);
        let value = Details {
            mapped_blocks: rng.gen(),
            transaction_id: rng.gen(),
            creation_time: rng.gen(),
            snapshotted_time: rng.gen(),
        };
        pool.insert_plain(1, key, &value).unwrap();
        model.details.insert(key, value);
    }
    for top in [1u64, 7] {
        for _ in 0..700 {
            let key = rng.gen_range(0..100_000);
            let value = random_data_block(&mut pool, rng);
            if let Some(old) = pool.insert_mapping(2, top, key, value).unwrap() {
                pool.data.dec(old).ok();
            }
            model.two_level.entry(top).or_default().insert(key, value);
        }
    }
    pool.commit().unwrap();
    // Subtree 1 shared by keys 1, 2 and 3: its root has count 3 (metadata overflow tree).
    pool.snapshot_subtree(2, 1, 2).unwrap();
    pool.snapshot_subtree(2, 1, 3).unwrap();
    let subtree = model.two_level[&1].clone();
    model.two_level.insert(2, subtree.clone());
    model.two_level.insert(3, subtree);
    for _ in 0..300 {
        let key = rng.gen_range(0..1_000_000);
        let value = rng.gen();
        pool.insert_plain(3, key, &value).unwrap();
        model.small.insert(key, value);
    }
    pool.commit().unwrap();
    pool.verify().unwrap();
    let root = btree::lookup::<u64, _>(&pool.tm, pool.roots[2], 1)
        .unwrap()
        .unwrap();
    assert_eq!(
        pool.tm.count(MetadataBlock::new(root)),
        3,
        "a subtree shared three ways"
    );
    (device, model)
}

/// Every committed block and what it is.
fn roles(device: &Arc<MemoryDevice>) -> BTreeMap<u64, Role> {
    let pool = Pool::open(device.clone(), &KINDS).unwrap();
    let bm = pool.tm.block_manager().clone();
    let sb = common::read_superblock(&bm).unwrap();
    let mut roles = BTreeMap::from([(0, Role::Superblock)]);
    roles.insert(sb.meta_root.bitmap_root, Role::MetadataIndex);
    let index = bm
        .read(
            MetadataBlock::new(sb.meta_root.bitmap_root),
            BlockKind::Index,
        )
        .unwrap();
    for entry in disk::decode_index_block(&index)
        .iter()
        .take(bitmap_count(sb.meta_root.block_count))
    {
        roles.insert(entry.blocknr, Role::Bitmap);
    }
    let mut trees = sb.trees(&KINDS);
    while let Some((kind, block)) = trees.pop() {
        if roles.insert(block.get(), Role::Node(kind)).is_some() {
            continue;
        }
        let data = bm.read(block, BlockKind::Node).unwrap();
        let node = Node::parse(block, &data, kind.value_size()).unwrap();
        for i in 0..node.len() {
            if !node.is_leaf() {
                trees.push((kind, node.child(i)));
                continue;
            }
            let value = node.value_bytes(i);
            match kind {
                TreeKind::TwoLevel => trees.push((
                    TreeKind::Data,
                    MetadataBlock::new(u64::from_le_bytes(value.try_into().unwrap())),
                )),
                TreeKind::SpaceMapIndex => {
                    let entry = <IndexEntry as btree::Value>::unpack(value);
                    roles.insert(entry.blocknr, Role::Bitmap);
                }
                _ => {}
            }
        }
    }
    let in_use = (0..device.block_count())
        .filter(|&b| pool.tm.count(MetadataBlock::new(b)) > 0)
        .count();
    assert_eq!(roles.len(), in_use, "every block in use has a role");
    roles
}

/// Byte offsets of the u64 pointers a block holds.
fn pointer_offsets(role: Role, data: &Block) -> Vec<usize> {
    match role {
        Role::Superblock => {
            let mut offsets = vec![64 + 16, 64 + 24, 192 + 16, 192 + 24];
            offsets.extend((0..KINDS.len()).map(|i| common::ROOTS_AT + 8 * i));
            offsets
        }
        Role::MetadataIndex => vec![16],
        Role::Bitmap => vec![],
        Role::Node(kind) => {
            let node = Node::parse(MetadataBlock::new(0), data, kind.value_size())
                .or_else(|_| Node::parse(MetadataBlock::new(0), data, 8))
                .unwrap();
            let pointers =
                !node.is_leaf() || matches!(kind, TreeKind::TwoLevel | TreeKind::SpaceMapIndex);
            if !pointers {
                return vec![];
            }
            let value_size = if node.is_leaf() { kind.value_size() } else { 8 };
            let values_at = 32 + 8 * node.max_entries();
            (0..node.len())
                .map(|i| values_at + value_size * i)
                .collect()
        }
    }
}

fn kind_of(role: Role) -> BlockKind {
    match role {
        Role::Superblock => BlockKind::Superblock,
        Role::MetadataIndex => BlockKind::Index,
        Role::Bitmap => BlockKind::Bitmap,
        Role::Node(_) => BlockKind::Node,
    }
}

/// Make the damaged copy of `block`.
fn damage(
    block: u64,
    role: Role,
    damage: Damage,
    device: &MemoryDevice,
    roles: &BTreeMap<u64, Role>,
    rng: &mut StdRng,
) -> Box<Block> {
    let mut data = Box::new([0u8; BLOCK_SIZE]);
    device.read(MetadataBlock::new(block), &mut data).unwrap();
    match damage {
        Damage::Flip("anywhere") => {
            for _ in 0..rng.gen_range(1..=3) {
                let at = rng.gen_range(0..BLOCK_SIZE);
                data[at] ^= rng.gen_range(1..=255u8);
            }
        }
        Damage::Flip(_) => {
            // Bytes no reader interprets: past a node's arrays, past the superblock's fields,
            // past the index block's used entries. (Bitmaps have no unused bytes.)
            let range = match role {
                Role::Superblock => 1024..BLOCK_SIZE,
                Role::MetadataIndex => 16 + 16 * 4..BLOCK_SIZE,
                Role::Bitmap | Role::Node(_) => 4064..BLOCK_SIZE,
            };
            let at = rng.gen_range(range);
            data[at] ^= rng.gen_range(1..=255u8);
        }
        Damage::Zero => data.fill(0),
        Damage::OtherKind => {
            let others: Vec<u64> = roles
                .iter()
                .filter(|(_, r)| kind_of(**r) != kind_of(role))
                .map(|(b, _)| *b)
                .collect();
            let other = *others.choose(rng).unwrap();
            device.read(MetadataBlock::new(other), &mut data).unwrap();
            data[8..16].copy_from_slice(&block.to_le_bytes());
            let kind = checksum::identify(&data_with_location(device, other)).unwrap();
            checksum::stamp(&mut data, kind);
        }
        Damage::Pointer { offset, target } => {
            let target = match target {
                Target::BeyondDevice => device.block_count() + rng.gen_range(0..1u64 << 40),
                Target::FreeBlock => loop {
                    let b = rng.gen_range(1..device.block_count());
                    if !roles.contains_key(&b) {
                        break b;
                    }
                },
                Target::Itself => block,
            };
            data[offset..offset + 8].copy_from_slice(&target.to_le_bytes());
            checksum::stamp(&mut data, kind_of(role));
        }
    }
    data
}

fn data_with_location(device: &MemoryDevice, block: u64) -> Box<Block> {
    let mut data = Box::new([0u8; BLOCK_SIZE]);
    device.read(MetadataBlock::new(block), &mut data).unwrap();
    data
}

/// Look up keys of every tree straight through a block manager (no space maps needed): each
/// lookup may fail, but one that succeeds must give the pristine answer.
fn lookups(device: Arc<dyn BlockDevice>, model: &Model, rng: &mut StdRng) -> Result<(), String> {
    let bm = BlockManager::new(device, 64);
    let Ok(sb) = common::read_superblock(&bm) else {
        return Ok(());
    };
    if sb.roots.len() != KINDS.len() {
        return Ok(());
    }
    fn same<V: PartialEq + std::fmt::Debug>(
        what: &str,
        got: persistent_data::Result<Option<V>>,
        expected: Option<V>,
    ) -> Result<(), String> {
        match got {
            Ok(v) if v != expected => Err(format!("{what}: got {v:?}, expected {expected:?}")),
            _ => Ok(()),
        }
    }
    let keys: Vec<u64> = (0..40).map(|_| rng.gen_range(0..1_000_000)).collect();
    for (i, &key) in keys.iter().chain(model.data.keys().step_by(50)).enumerate() {
        same(
            &format!("lookup {key} in the data tree"),
            btree::lookup::<u64, _>(&bm, sb.roots[0], key),
            model.data.get(&key).copied(),
        )?;
        if i % 4 == 0 {
            same(
                &format!("lookup_ge {key} in the data tree"),
                btree::lookup_ge::<u64, _>(&bm, sb.roots[0], key),
                model.data.range(key..).next().map(|(k, v)| (*k, *v)),
            )?;
        }
        let key = key % 5000;
        same(
            &format!("lookup {key} in the details tree"),
            btree::lookup::<Details, _>(&bm, sb.roots[1], key),
            model.details.get(&key).copied(),
        )?;
        same(
            &format!("lookup {key} in the u32 tree"),
            btree::lookup::<u32, _>(&bm, sb.roots[3], key),
            model.small.get(&key).copied(),
        )?;
    }
    for (top, subtree) in &model.two_level {
        let root = match btree::lookup::<u64, _>(&bm, sb.roots[2], *top) {
            Ok(Some(root)) => root,
            Ok(None) => return Err(format!("subtree {top} missing")),
            Err(_) => continue,
        };
        for &key in subtree.keys().step_by(40).chain(keys.iter().take(10)) {
            same(
                &format!("lookup {top}/{key} in the two-level tree"),
                btree::lookup::<u64, _>(&bm, MetadataBlock::new(root), key),
                subtree.get(&key).copied(),
            )?;
        }
    }
    Ok(())
}

/// Open and check everything; then try changing every tree and committing.
fn open_and_check(device: Arc<dyn BlockDevice>, rng: &mut StdRng) -> persistent_data::Result<()> {
    let pool = Pool::open(device, &KINDS)?;
    let verified = pool.verify();
    for (i, &kind) in KINDS.iter().enumerate() {
        common::check_tree(&pool.tm, kind, pool.roots[i], CheckOptions::default())?;
    }
    pool.contents()?;
    verified?;
    // Nothing found: the damage was not detected. Report it through the caller.
    let _ = rng;
    Ok(())
}

/// Change every tree of the damaged metadata (through paths that may meet the damage), and
/// commit. Errors are fine; panics are not.
fn try_changes(device: Arc<dyn BlockDevice>, model: &Model, rng: &mut StdRng) {
    let Ok(mut pool) = Pool::open(device, &KINDS) else {
        return;
    };
    let _ = (|| -> persistent_data::Result<()> {
        for &key in model.data.keys().step_by(97) {
            if rng.gen_bool(0.5) {
                pool.remove_data(0, key)?;
            } else {
                let value = pool.data.alloc()?;
                pool.insert_data(0, key + 1, value)?;
            }
        }
        for &key in model.details.keys().step_by(31) {
            pool.remove_plain::<Details>(1, key)?;
        }
        pool.insert_mapping(2, 7, 5, 123)?;
        pool.remove_subtree(2, 2)?;
        pool.remove_range_data(0, 0, 300_000)?;
        for tree in 0..KINDS.len() {
            pool.release(tree)?;
        }
        pool.commit()
    })();
}

fn describe(role: Role, damage: Damage) -> String {
    format!("{role:?} damaged by {damage:?}")
}

/// Run one case on its own thread; `Err` describes a panic, a hang or a missed corruption.
fn run_case(
    base: &Arc<MemoryDevice>,
    model: &Arc<Model>,
    block: u64,
    role: Role,
    damaged: Box<Block>,
    damage: Damage,
    case_seed: u64,
) -> Result<(), String> {
    let base = base.clone();
    let model = model.clone();
    let (send, receive) = mpsc::channel();
    std::thread::spawn(move || {
        let outcome = panic::catch_unwind(AssertUnwindSafe(|| {
            let mut rng = StdRng::seed_from_u64(case_seed);
            let overlay = |data: &Block| -> Arc<dyn BlockDevice> {
                Arc::new(OverlayDevice::new(
                    base.clone(),
                    MetadataBlock::new(block),
                    Box::new(*data),
                ))
            };
            // A two-level tree's top-level leaf pointing at itself is a valid-looking bottom
            // leaf (same node format, same value size): a lookup there answers "absent",
            // as it would in dm-thin. Only the full check can tell.
            let self_pointing_top_leaf = matches!(
                damage,
                Damage::Pointer {
                    target: Target::Itself,
                    ..
                }
            ) && role == Role::Node(TreeKind::TwoLevel);
            let looked_up = lookups(overlay(&damaged), &model, &mut rng);
            if !self_pointing_top_leaf {
                looked_up?;
            }
            let result = open_and_check(overlay(&damaged), &mut rng);
            try_changes(overlay(&damaged), &model, &mut rng);
            match result {
                Ok(()) => {
                    Err("the damage went unnoticed: open, check and recount all passed".to_string())
                }
                // A redirected pointer with a valid checksum can make a structure that is valid
                // node by node (a top-level leaf pointing at itself looks like a bottom
                // leaf); then only the reference recount notices, as in thin_check.
                Err(Error::Invalid(message))
                    if matches!(damage, Damage::Pointer { .. })
                        && message.starts_with("reference counts differ") =>
                {
                    Ok(())
                }
                Err(e) if !e.is_corruption() => Err(format!("not a corruption error: {e}")),
                Err(e) => {
                    let checksum_broken =
                        matches!(damage, Damage::Flip(_) | Damage::Zero | Damage::OtherKind);
                    let named = match &e {
                        Error::Checksum { block: b, .. } | Error::Corrupt { block: b, .. } => {
                            b.get()
                        }
                        _ => u64::MAX,
                    };
                    if checksum_broken && named != block {
                        Err(format!(
                            "error names block {named}, not the damaged block: {e}"
                        ))
                    } else {
                        Ok(())
                    }
                }
            }
        }));
        let _ = send.send(outcome.unwrap_or_else(|panic| {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(format!("panicked: {message}"))
        }));
    });
    match receive.recv_timeout(CASE_TIME_LIMIT) {
        Ok(outcome) => outcome,
        Err(_) => Err(format!("no result within {CASE_TIME_LIMIT:?} (a hang?)")),
    }
    .map_err(|message| format!("block {block} ({}): {message}", describe(role, damage)))
}

#[test]
fn damaged_blocks_give_corruption_errors_never_panics_or_wrong_answers() {
    let (report, mut rng) = common::seeded();
    let (base, model) = build(&mut rng);
    let model = Arc::new(model);
    let roles = roles(&base);
    let mut blocks: Vec<(u64, Role)> = roles.iter().map(|(b, r)| (*b, *r)).collect();
    let sample = testkit::case_count(400) as usize;
    if blocks.len() > sample {
        blocks.shuffle(&mut rng);
        blocks.truncate(sample);
        blocks.sort_unstable_by_key(|(b, _)| *b);
    }
    let mut failures = Vec::new();
    let mut cases = 0;
    for &(block, role) in &blocks {
        let original = data_with_location(&base, block);
        let mut damages = vec![
            Damage::Flip("anywhere"),
            Damage::Flip("unused bytes"),
            Damage::Zero,
            Damage::OtherKind,
        ];
        let offsets = pointer_offsets(role, &original);
        if !offsets.is_empty() {
            for target in [Target::BeyondDevice, Target::FreeBlock, Target::Itself] {
                let offset = *offsets.choose(&mut rng).unwrap();
                damages.push(Damage::Pointer { offset, target });
            }
        }
        for damage_kind in damages {
            let damaged = damage(block, role, damage_kind, &base, &roles, &mut rng);
            if damaged[..] == original[..] {
                continue; // a pointer already pointing at itself, say
            }
            cases += 1;
            if let Err(message) =
                run_case(&base, &model, block, role, damaged, damage_kind, rng.gen())
            {
                failures.push(message);
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {cases} cases failed (seed {}):\n{}",
        failures.len(),
        report.seed(),
        failures.join("\n")
    );
    assert!(cases > 200, "only {cases} cases");
}

/// Regression: `btree::delete_tree` asked the space map for the count of a child pointer read
/// from disk before checking it lies inside the map, so a corrupt pointer beyond the map
/// panicked (`CoreSpaceMap::count`'s range assertion) instead of giving an error.
#[test]
fn deleting_a_tree_with_a_child_beyond_the_space_map_is_an_error_not_a_panic() {
    let device = Arc::new(MemoryDevice::new(1024));
    let mut pool = Pool::format(device.clone(), 10_000, &[TreeKind::Data]).unwrap();
    for key in 0..1000 {
        let value = pool.data.alloc().unwrap();
        pool.insert_data(0, key, value).unwrap();
    }
    pool.commit().unwrap();
    // Point the root's second child far beyond the device, with a valid checksum.
    let root = pool.roots[0];
    let mut data = data_with_location(&device, root.get());
    let node = Node::parse(root, &data, 8).unwrap();
    assert!(!node.is_leaf() && node.len() >= 2);
    let at = 32 + 8 * node.max_entries() + 8;
    data[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    checksum::stamp(&mut data, BlockKind::Node);
    device.write(root, &data).unwrap();
    let mut pool = Pool::open(device, &[TreeKind::Data]).unwrap();
    let result = panic::catch_unwind(AssertUnwindSafe(|| pool.release(0)));
    match result {
        Ok(Err(e)) => assert!(e.is_corruption(), "{e}"),
        Ok(Ok(())) => panic!("deleting a tree through a pointer beyond the device succeeded"),
        Err(_) => panic!("deleting a tree through a pointer beyond the device panicked"),
    }
}
