//! Goal: the checker rejects metadata breaking each rule of spec §11, as thin_check 1.1.0
//! does, and its report names the rule and the block.
//! Method: build good metadata with `PoolMetadata` (a volume with an internal-node tree,
//! a snapshot that diverged, three untouched snapshots so a root's count overflows to the
//! metadata overflow tree), then for each rule copy it, patch bytes (re-stamping the
//! checksum unless the rule is the checksum itself), and run our checker and both real
//! thin_check versions. Everything is generated at test time. The table of outcomes is
//! printed (run with `--nocapture` to see it).

use persistent_data::btree::node::{Node, HEADER_SIZE};
use persistent_data::btree::Value;
use persistent_data::checksum::BlockKind;
use persistent_data::space_map::core::{decode_field, ENTRIES_PER_BITMAP};
use persistent_data::space_map::disk::decode_index_block;
use persistent_data::space_map::IndexEntry;
use persistent_data::{BlockDevice, FileDevice, MetadataBlock};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use testkit::metadata_patch::{
    bitmap_field, patch, put_u32, put_u64, read_block, set_bitmap_count, u64_at, value_at,
};
use testkit::scratch::ScratchDir;
use testkit::tools::ThinTools;
use thin_pool::format::check::{check, CheckOptions, LeafOccupancy, Report, Rule};
use thin_pool::format::superblock::Superblock;
use thin_pool::{BlockTime, DataBlock, PoolMetadata, Time, VirtualBlock, VolumeId};

const METADATA_BLOCKS: u64 = 2048;
const DATA_BLOCKS: u64 = 20_000;

/// Where things are in the base image.
struct Layout {
    superblock: Superblock,
    /// Volume 0's tree: its internal root and its leaves.
    bottom_root: u64,
    bottom_leaves: Vec<u64>,
    /// The block with a count of 3 or more (volume 0's root: shared by 4 volumes).
    overflowed: u64,
    metadata_bitmap: u64,
    data_bitmap: u64,
}

fn build(path: &Path) -> Layout {
    let device = Arc::new(FileDevice::create(path, METADATA_BLOCKS).unwrap());
    let mut md = PoolMetadata::format(device.clone(), 128, DATA_BLOCKS).unwrap();
    md.create_thin(VolumeId::new(0)).unwrap();
    for vb in 0..3000u64 {
        let db = md.alloc_data_block().unwrap();
        md.insert(VolumeId::new(0), VirtualBlock::new(vb * 3), db)
            .unwrap();
    }
    md.commit().unwrap();
    md.create_snap(VolumeId::new(1), VolumeId::new(0)).unwrap();
    md.commit().unwrap();
    for vb in 0..200u64 {
        let db = md.alloc_data_block().unwrap();
        md.insert(VolumeId::new(1), VirtualBlock::new(vb * 7), db)
            .unwrap();
    }
    md.commit().unwrap();
    for id in 2..5 {
        md.create_snap(VolumeId::new(id), VolumeId::new(0)).unwrap();
    }
    md.commit().unwrap();
    let bottom_root = md.volume_root(VolumeId::new(0)).unwrap().get();
    drop(md);
    let bm = persistent_data::block_manager::BlockManager::new(device, 64);
    let superblock = Superblock::read(&bm, MetadataBlock::new(0)).unwrap();
    let root = read_block(path, bottom_root);
    let node = Node::parse(MetadataBlock::new(bottom_root), &root, 8).unwrap();
    assert!(!node.is_leaf(), "volume 0 needs an internal root");
    let bottom_leaves = (0..node.len()).map(|i| node.child(i).get()).collect();
    let index = decode_index_block(&read_block(path, superblock.metadata_space_map.bitmap_root));
    let data_index = read_block(path, superblock.data_space_map.bitmap_root);
    let data_index = Node::parse(
        MetadataBlock::new(superblock.data_space_map.bitmap_root),
        &data_index,
        16,
    )
    .unwrap();
    let data_bitmap = IndexEntry::unpack(data_index.value_bytes(0)).blocknr;
    Layout {
        superblock,
        bottom_root,
        bottom_leaves,
        overflowed: bottom_root,
        metadata_bitmap: index[0].blocknr,
        data_bitmap,
    }
}

/// Makes one broken variant from a copy of the base image.
type Patcher = dyn Fn(&Path, &Layout);

/// One broken variant: what it breaks, how, and what our report must name.
struct Case {
    name: &'static str,
    rule: Rule,
    block: Option<u64>,
    occupancy: LeafOccupancy,
    make: Box<Patcher>,
}

fn case(
    name: &'static str,
    rule: Rule,
    block: Option<u64>,
    make: impl Fn(&Path, &Layout) + 'static,
) -> Case {
    Case {
        name,
        rule,
        block,
        occupancy: LeafOccupancy::Strict,
        make: Box::new(make),
    }
}

fn cases(layout: &Layout) -> Vec<Case> {
    let leaf = layout.bottom_leaves[1];
    let root = layout.bottom_root;
    let sb = &layout.superblock;
    let details_root = sb.device_details_root.get();
    let free_block = sb.metadata_space_map.block_count - 1;
    let leaf_count_block = leaf;
    let overflowed = layout.overflowed;
    fn node(kind: BlockKind) -> Option<BlockKind> {
        Some(kind)
    }
    let mut cases = vec![
        case(
            "bad superblock checksum",
            Rule::SuperblockChecksum,
            Some(0),
            |p, _| patch(p, 0, None, |d| d[100] ^= 1),
        ),
        case(
            "node checksum",
            Rule::Checksum(BlockKind::Node),
            Some(leaf),
            move |p, _| patch(p, leaf, None, |d| d[3000] ^= 1),
        ),
        case(
            "wrong blocknr",
            Rule::Location(BlockKind::Node),
            Some(leaf),
            move |p, _| patch(p, leaf, node(BlockKind::Node), |d| put_u64(d, 8, leaf + 1)),
        ),
        case(
            "wrong value_size",
            Rule::ValueSize,
            Some(leaf),
            move |p, _| patch(p, leaf, node(BlockKind::Node), |d| put_u32(d, 24, 16)),
        ),
        case(
            "max_entries not a multiple of 3",
            Rule::MaxEntries,
            Some(leaf),
            move |p, _| patch(p, leaf, node(BlockKind::Node), |d| put_u32(d, 20, 250)),
        ),
        case(
            "nr_entries > max_entries",
            Rule::EntryCount,
            Some(leaf),
            move |p, _| patch(p, leaf, node(BlockKind::Node), |d| put_u32(d, 16, 253)),
        ),
        case(
            "underfull non-root node",
            Rule::Occupancy,
            Some(leaf),
            move |p, _| patch(p, leaf, node(BlockKind::Node), |d| put_u32(d, 16, 20)),
        ),
        case(
            "keys out of order",
            Rule::KeyOrder,
            Some(leaf),
            move |p, _| {
                patch(p, leaf, node(BlockKind::Node), |d| {
                    let (a, b) = (
                        u64_at(d, HEADER_SIZE + 8 * 5),
                        u64_at(d, HEADER_SIZE + 8 * 6),
                    );
                    put_u64(d, HEADER_SIZE + 8 * 5, b);
                    put_u64(d, HEADER_SIZE + 8 * 6, a);
                })
            },
        ),
        case(
            "parent key > child's first key",
            Rule::ParentKey,
            Some(leaf),
            move |p, _| {
                patch(p, root, node(BlockKind::Node), |d| {
                    let key = u64_at(d, HEADER_SIZE + 8);
                    put_u64(d, HEADER_SIZE + 8, key + 1);
                })
            },
        ),
        case(
            "details/top-level mismatch",
            Rule::DetailsMismatch,
            None,
            move |p, _| {
                // Renumber the last volume in the details tree: 4 -> 9.
                patch(p, details_root, node(BlockKind::Node), |d| {
                    let n = u32::from_le_bytes(d[16..20].try_into().unwrap()) as usize;
                    put_u64(d, HEADER_SIZE + 8 * (n - 1), 9);
                })
            },
        ),
        case(
            "wrong mapped_blocks",
            Rule::MappedBlocks,
            None,
            move |p, _| {
                patch(p, details_root, node(BlockKind::Node), |d| {
                    let at = value_at(126, 24, 0);
                    let mapped = u64_at(d, at);
                    put_u64(d, at, mapped + 1);
                })
            },
        ),
        case(
            "mapping beyond the data space map",
            Rule::DataBlockOutOfRange,
            Some(leaf),
            move |p, _| {
                patch(p, leaf, node(BlockKind::Node), |d| {
                    let at = value_at(252, 8, 3);
                    let value = BlockTime::new(DataBlock::new(DATA_BLOCKS + 5), Time::default());
                    put_u64(d, at, value.pack());
                })
            },
        ),
        case(
            "metadata leak (count too high)",
            Rule::MetadataLeak,
            Some(free_block),
            |p, l| {
                patch(p, l.metadata_bitmap, node(BlockKind::Bitmap), |d| {
                    assert_eq!(bitmap_field(d, free_block_of(l)), 0);
                    set_bitmap_count(d, free_block_of(l), 1)
                })
            },
        ),
        case(
            "metadata under-count",
            Rule::MetadataUnderCount,
            Some(leaf_count_block),
            move |p, l| {
                patch(p, l.metadata_bitmap, node(BlockKind::Bitmap), |d| {
                    set_bitmap_count(d, leaf_count_block, 0)
                })
            },
        ),
        case("data count wrong", Rule::DataCount, None, move |p, l| {
            // The first mapping of volume 0's second leaf.
            let leaf_data = read_block(p, leaf);
            let value = BlockTime::unpack(u64_at(&leaf_data, value_at(252, 8, 0)));
            let data_block = value.data_block().get();
            assert!(data_block < ENTRIES_PER_BITMAP);
            patch(p, l.data_bitmap, node(BlockKind::Bitmap), |d| {
                let count = decode_field(bitmap_field(d, data_block));
                set_bitmap_count(d, data_block, if count == 1 { 2 } else { 1 })
            })
        }),
        case(
            "bitmap checksum",
            Rule::Checksum(BlockKind::Bitmap),
            None,
            |p, l| patch(p, l.metadata_bitmap, None, |d| d[2000] ^= 1),
        ),
        case(
            "index block checksum",
            Rule::Checksum(BlockKind::Index),
            None,
            |p, l| {
                patch(p, l.superblock.metadata_space_map.bitmap_root, None, |d| {
                    d[2000] ^= 1
                })
            },
        ),
        case(
            "overflow entry without bitmap entry 3",
            Rule::OverflowMismatch,
            Some(overflowed),
            move |p, l| {
                patch(p, l.metadata_bitmap, node(BlockKind::Bitmap), |d| {
                    assert_eq!(bitmap_field(d, overflowed), 3, "root count overflows");
                    set_bitmap_count(d, overflowed, 2)
                })
            },
        ),
        case(
            "overflow count too high",
            Rule::MetadataOverCount,
            Some(overflowed),
            move |p, l| {
                let overflow_root = l.superblock.metadata_space_map.ref_count_root;
                patch(p, overflow_root, node(BlockKind::Node), |d| {
                    let n = u32::from_le_bytes(d[16..20].try_into().unwrap()) as usize;
                    let i = (0..n)
                        .find(|&i| u64_at(d, HEADER_SIZE + 8 * i) == overflowed)
                        .expect("overflow entry for the shared root");
                    let at = value_at(336, 4, i);
                    let count = u32::from_le_bytes(d[at..at + 4].try_into().unwrap());
                    put_u32(d, at, count + 1);
                })
            },
        ),
        case(
            "node flags both set",
            Rule::NodeFlags,
            Some(leaf),
            move |p, _| patch(p, leaf, node(BlockKind::Node), |d| put_u32(d, 4, 3)),
        ),
    ];
    let mut lenient = case(
        "underfull bottom leaf, 1.x rule",
        Rule::MappedBlocks,
        None,
        move |p, _| patch(p, leaf, node(BlockKind::Node), |d| put_u32(d, 16, 20)),
    );
    lenient.occupancy = LeafOccupancy::SkipBottomLeaves;
    cases.push(lenient);
    cases
}

fn free_block_of(layout: &Layout) -> u64 {
    layout.superblock.metadata_space_map.block_count - 1
}

fn first_error_line(output: &testkit::tools::ToolOutput) -> String {
    let text = format!("{}\n{}", output.stderr, output.stdout);
    text.lines()
        .map(str::trim)
        .find(|l| {
            !l.is_empty()
                && !l.starts_with("examining")
                && !l.starts_with("checking space map")
                && !l.starts_with("Checking thin")
                && !l.starts_with("TRANSACTION_ID")
                && !l.starts_with("METADATA_FREE")
                && !matches!(
                    *l,
                    "device details tree"
                        | "mapping tree"
                        | "data space map"
                        | "metadata space map"
                )
        })
        .unwrap_or("")
        .chars()
        .take(90)
        .collect()
}

fn our_check(path: &Path, occupancy: LeafOccupancy) -> Report {
    let device: Arc<dyn BlockDevice> = Arc::new(FileDevice::open(path, false).unwrap());
    let options = CheckOptions {
        leaf_occupancy: occupancy,
        ..CheckOptions::default()
    };
    check(device, &options, &mut |_| {})
}

#[test]
fn each_broken_rule_is_rejected_like_thin_check_1_1() {
    let dir = ScratchDir::new("check-parity");
    let base: PathBuf = dir.join("base");
    let layout = build(&base);
    let [v09, v11] = [ThinTools::v0_9(), ThinTools::v1_1()];
    v09.check(&base).assert_success();
    v11.check(&base).assert_success();
    let clean = our_check(&base, LeafOccupancy::Strict);
    assert!(clean.is_clean(), "{clean}");
    assert_eq!(clean.warning_count, 0);

    let mut table = vec![format!(
        "| rule broken | thin_check 0.9.0 | thin_check 1.1.0 | ours | with --ignore-non-fatal-errors: 0.9.0 / 1.1.0 / ours |\n| --- | --- | --- | --- | --- |"
    )];
    let mut failures = Vec::new();
    for case in cases(&layout) {
        let path = dir.join(case.name.replace([' ', '/', '>', '\'', ','], "_"));
        std::fs::copy(&base, &path).unwrap();
        (case.make)(&path, &layout);
        let old = v09.check(&path);
        let new = v11.check(&path);
        let ignoring = ["--ignore-non-fatal-errors"];
        let old_ignoring = v09.check_with(&path, &ignoring).success();
        let new_ignoring = v11.check_with(&path, &ignoring).success();
        let report = our_check(&path, case.occupancy);
        let ours_fails = !report.passes(false);
        let verdict = |pass: bool| if pass { "pass" } else { "FAIL" };
        let named = report
            .problems
            .iter()
            .find(|p| p.rule == case.rule && (case.block.is_none() || p.block == case.block));
        let describe = |o: &testkit::tools::ToolOutput| {
            format!(
                "{} `{}`",
                if o.success() { "pass" } else { "FAIL" },
                first_error_line(o)
            )
        };
        table.push(format!(
            "| {} | {} | {} | {} `{}` | {} / {} / {} |",
            case.name,
            describe(&old),
            describe(&new),
            if ours_fails { "FAIL" } else { "pass" },
            named
                .map(|p| p.to_string())
                .or_else(|| report.problems.first().map(|p| p.to_string()))
                .unwrap_or_default(),
            verdict(old_ignoring),
            verdict(new_ignoring),
            verdict(report.passes(true)),
        ));
        if report.passes(true) != new_ignoring {
            failures.push(format!(
                "{}: with non-fatal errors ignored, thin_check 1.1.0 and ours disagree\n{report}",
                case.name
            ));
        }
        if ours_fails == new.success() {
            failures.push(format!(
                "{}: thin_check 1.1.0 and ours disagree\n{report}\n{new}",
                case.name
            ));
        }
        if named.is_none() {
            failures.push(format!(
                "{}: report does not name {:?} at {:?}:\n{report}",
                case.name, case.rule, case.block
            ));
        }
    }
    println!("{}", table.join("\n"));
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
