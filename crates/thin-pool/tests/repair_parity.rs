//! Goal: `repair` recovers at least what `thin_repair` 1.1.0 recovers from each kind of
//! damage thin-provisioning-tools' own test generator makes (a corrupt node: bad checksum,
//! bad structure; a corrupted superblock field; a damaged space-map bitmap or index;
//! leaked blocks; a cycle in a btree), its output passes both thin_check versions, and
//! every mapping it keeps points at the data block (and time) it did before the damage.
//! Method: build metadata with `PoolMetadata` (three volumes with internal-node trees, one
//! a diverged snapshot sharing leaves), remember every mapping, then for each damage copy
//! it, patch blocks (`testkit::metadata_patch`), repair with ours and with `thin_repair`
//! 1.1.0 and 0.9.0 (where it succeeds), and compare what each output maps. The table is
//! printed (run with `--nocapture`).

use persistent_data::btree::node::{Node, HEADER_SIZE};
use persistent_data::checksum::BlockKind;
use persistent_data::{BlockDevice, FileDevice, MetadataBlock};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use testkit::metadata_patch::{
    data_bitmap, leak, metadata_bitmap, patch, put_u32, put_u64, read_block, u64_at,
};
use testkit::scratch::{sized_file, ScratchDir};
use testkit::tools::ThinTools;
use thin_pool::format::dump::expand::Expanded;
use thin_pool::format::dump::metadata::{dump, DumpOptions};
use thin_pool::format::dump::Flavour;
use thin_pool::format::repair::{repair, RepairOptions};
use thin_pool::format::superblock::Superblock;
use thin_pool::{PoolMetadata, TransactionId, VirtualBlock, VolumeId};

const METADATA_BLOCKS: u64 = 2048;
const DATA_BLOCKS: u64 = 20_000;
const TRANSACTION_ID: u64 = 7;
const OUTPUT_BYTES: u64 = 8 << 20;

/// Volume → virtual block → (data block, time).
type Mappings = BTreeMap<u32, BTreeMap<u64, (u64, u32)>>;

/// Where the damage goes.
struct Layout {
    superblock: Superblock,
    /// Volume 0's internal root and its leaves.
    root: u64,
    leaves: Vec<u64>,
    /// Volume 2's root (a tree of its own).
    other_root: u64,
}

fn map(md: &mut PoolMetadata, id: u32, blocks: impl Iterator<Item = u64>) {
    for vb in blocks {
        let db = md.alloc_data_block().unwrap();
        md.insert(VolumeId::new(id), VirtualBlock::new(vb), db)
            .unwrap();
    }
    md.commit().unwrap();
}

fn build(path: &Path) -> Layout {
    let device = Arc::new(FileDevice::create(path, METADATA_BLOCKS).unwrap());
    let mut md = PoolMetadata::format(device.clone(), 128, DATA_BLOCKS).unwrap();
    md.create_thin(VolumeId::new(0)).unwrap();
    map(&mut md, 0, (0..3000).map(|v| v * 3));
    md.create_snap(VolumeId::new(1), VolumeId::new(0)).unwrap();
    md.commit().unwrap();
    map(&mut md, 1, (0..200).map(|v| v * 7));
    md.create_thin(VolumeId::new(2)).unwrap();
    map(&mut md, 2, (0..1500).rev());
    md.set_transaction_id(TransactionId::new(0), TransactionId::new(TRANSACTION_ID))
        .unwrap();
    md.commit().unwrap();
    let root = md.volume_root(VolumeId::new(0)).unwrap().get();
    let other_root = md.volume_root(VolumeId::new(2)).unwrap().get();
    drop(md);
    let bm = persistent_data::block_manager::BlockManager::new(device, 64);
    let superblock = Superblock::read(&bm, MetadataBlock::SUPERBLOCK).unwrap();
    let data = read_block(path, root);
    let node = Node::parse(MetadataBlock::new(root), &data, 8).unwrap();
    assert!(!node.is_leaf(), "volume 0 needs an internal root");
    let leaves = (0..node.len()).map(|i| node.child(i).get()).collect();
    Layout {
        superblock,
        root,
        leaves,
        other_root,
    }
}

/// Every mapping of the metadata at `path` (None if it cannot be dumped).
fn mappings(path: &Path) -> Option<Mappings> {
    let device: Arc<dyn BlockDevice> = Arc::new(FileDevice::open(path, false).ok()?);
    let mut out = Expanded::new();
    let options = DumpOptions {
        flavour: Flavour::V0_9,
        ..DumpOptions::default()
    };
    dump(device, &options, &mut out).ok()?;
    Some(
        out.devices
            .into_iter()
            .map(|(id, device)| (id, device.mappings))
            .collect(),
    )
}

fn count(mappings: &Mappings) -> usize {
    mappings.values().map(BTreeMap::len).sum()
}

/// Makes one damage on a copy of the base image.
type Make = dyn Fn(&Path, &Layout);

/// One kind of damage: its name, whether the superblock is lost (the settings must be
/// given), and how to make it.
struct Damage {
    name: &'static str,
    superblock_lost: bool,
    make: Box<Make>,
}

fn damage(name: &'static str, make: impl Fn(&Path, &Layout) + 'static) -> Damage {
    Damage {
        name,
        superblock_lost: false,
        make: Box::new(make),
    }
}

fn damages() -> Vec<Damage> {
    let node = Some(BlockKind::Node);
    let mut all = vec![
        damage("leaf checksum", |p, l| {
            patch(p, l.leaves[1], None, |d| d[3000] ^= 1)
        }),
        damage("leaf nr_entries > max_entries", move |p, l| {
            patch(p, l.leaves[2], node, |d| put_u32(d, 16, 400))
        }),
        damage("leaf keys out of order", move |p, l| {
            patch(p, l.leaves[1], node, |d| {
                let (a, b) = (
                    u64_at(d, HEADER_SIZE + 8 * 5),
                    u64_at(d, HEADER_SIZE + 8 * 6),
                );
                put_u64(d, HEADER_SIZE + 8 * 5, b);
                put_u64(d, HEADER_SIZE + 8 * 6, a);
            })
        }),
        damage("leaf flags", move |p, l| {
            patch(p, l.leaves[3], node, |d| put_u32(d, 4, 3))
        }),
        damage("internal root checksum", |p, l| {
            patch(p, l.other_root, None, |d| d[200] ^= 1)
        }),
        damage("cycle: a child points at its parent", move |p, l| {
            let root = l.root;
            patch(p, root, node, |d| {
                let max = u32::from_le_bytes(d[20..24].try_into().unwrap()) as usize;
                put_u64(d, HEADER_SIZE + 8 * max + 8, root);
            })
        }),
        damage("details root checksum", |p, l| {
            patch(p, l.superblock.device_details_root.get(), None, |d| {
                d[100] ^= 1
            })
        }),
        damage("metadata bitmap checksum", |p, _| {
            patch(p, metadata_bitmap(p), None, |d| d[2000] ^= 1)
        }),
        damage("metadata index checksum", |p, l| {
            let index = l.superblock.metadata_space_map.bitmap_root;
            patch(p, index, None, |d| d[100] ^= 1)
        }),
        damage("data bitmap checksum", |p, _| {
            patch(p, data_bitmap(p), None, |d| d[2000] ^= 1)
        }),
        damage("leaked metadata and data blocks", |p, _| {
            leak(p, metadata_bitmap(p), METADATA_BLOCKS - 1);
            leak(p, data_bitmap(p), 10_000);
        }),
        damage("superblock field: mapping root", |p, l| {
            let details = l.superblock.device_details_root.get();
            patch(p, 0, Some(BlockKind::Superblock), |d| {
                put_u64(d, 320, details)
            })
        }),
    ];
    all.push(Damage {
        name: "superblock checksum",
        superblock_lost: true,
        make: Box::new(|p, _| patch(p, 0, None, |d| d[100] ^= 1)),
    });
    all.push(Damage {
        name: "superblock field: data block size",
        superblock_lost: true,
        make: Box::new(|p, _| patch(p, 0, Some(BlockKind::Superblock), |d| put_u32(d, 336, 100))),
    });
    all
}

/// Ours: the library's repair into a new file.
fn our_repair(input: &Path, output: &Path, superblock_lost: bool) -> Result<(), String> {
    sized_file(output, OUTPUT_BYTES);
    let options = if superblock_lost {
        RepairOptions {
            data_block_size_sectors: Some(128),
            data_block_count: Some(DATA_BLOCKS),
            transaction_id: Some(TRANSACTION_ID),
        }
    } else {
        RepairOptions::default()
    };
    let input = Arc::new(FileDevice::open(input, false).unwrap());
    let output = Arc::new(FileDevice::open(output, true).unwrap());
    repair(input, output, &options)
        .map(|_| ())
        .map_err(|e| format!("{e:#?}"))
}

/// The real thin_repair into a new file; the mappings of its output if it succeeded.
fn their_repair(
    tools: &ThinTools,
    input: &Path,
    output: &Path,
    superblock_lost: bool,
) -> Option<Mappings> {
    sized_file(output, OUTPUT_BYTES);
    let mut args = vec![
        "-i".to_string(),
        input.display().to_string(),
        "-o".to_string(),
        output.display().to_string(),
    ];
    if superblock_lost {
        let overrides = [
            ("--data-block-size", "128".to_string()),
            ("--nr-data-blocks", DATA_BLOCKS.to_string()),
            ("--transaction-id", TRANSACTION_ID.to_string()),
        ];
        for (flag, value) in overrides {
            args.extend([flag.to_string(), value]);
        }
    }
    let run = tools.run("thin_repair", &args);
    if !run.success() {
        return None;
    }
    mappings(output)
}

/// Every mapping `recovered` keeps is one of `before`, with the same data block and time.
fn assert_faithful(name: &str, before: &Mappings, recovered: &Mappings) {
    for (id, mappings) in recovered {
        let original = before
            .get(id)
            .unwrap_or_else(|| panic!("{name}: volume {id} was never there"));
        for (vb, mapping) in mappings {
            assert_eq!(
                original.get(vb),
                Some(mapping),
                "{name}: volume {id} block {vb} recovered as {mapping:?}"
            );
        }
    }
}

#[test]
fn repair_recovers_at_least_what_thin_repair_1_1_recovers() {
    let dir = ScratchDir::new("repair-parity");
    let base = dir.join("base");
    let layout = build(&base);
    let before = mappings(&base).unwrap();
    let [v09, v11] = [ThinTools::v0_9(), ThinTools::v1_1()];
    println!(
        "{:<40} {:>6} {:>6} {:>6} {:>6}",
        "damage", "before", "ours", "1.1.0", "0.9.0"
    );
    for case in damages() {
        let input = dir.join("damaged");
        std::fs::copy(&base, &input).unwrap();
        (case.make)(&input, &layout);
        let ours_path = dir.join("ours");
        let _ = std::fs::remove_file(&ours_path);
        if let Err(error) = our_repair(&input, &ours_path, case.superblock_lost) {
            panic!("{}: our repair failed: {error}", case.name);
        }
        for tools in [&v09, &v11] {
            let check = tools.check(&ours_path);
            assert!(check.success(), "{}: {check}", case.name);
        }
        let ours = mappings(&ours_path).unwrap();
        assert_faithful(case.name, &before, &ours);
        let mut counts = Vec::new();
        for tools in [&v11, &v09] {
            let path = dir.join(format!("theirs-{}", tools.version));
            let _ = std::fs::remove_file(&path);
            counts
                .push(their_repair(tools, &input, &path, case.superblock_lost).map(|m| count(&m)));
        }
        let show = |c: Option<usize>| c.map_or("failed".to_string(), |c| c.to_string());
        println!(
            "{:<40} {:>6} {:>6} {:>6} {:>6}",
            case.name,
            count(&before),
            count(&ours),
            show(counts[0]),
            show(counts[1])
        );
        assert!(
            count(&ours) >= counts[0].unwrap_or(0),
            "{}: thin_repair 1.1.0 recovered {:?} mappings, we {}",
            case.name,
            counts[0],
            count(&ours)
        );
    }
}
