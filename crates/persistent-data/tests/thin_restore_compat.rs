//! Byte compatibility with metadata written by the real tools.
//!
//! Goal: metadata that `thin_restore` (0.9.0 and 1.1.0) writes is read by this crate exactly
//! as the XML describes it, and its reference counts are what spec §7.8 demands.
//!
//! Method: for every XML fixture and both tool versions, run `thin_restore -i X -o META`
//! into an 8 MiB file, then, with this crate only: check the superblock checksum and fields
//! (read by hand at the offsets of spec §4), open the metadata space map
//! (`TransactionManager::open`) and the data space map (`DataSpaceMap::open`), run
//! `btree::check` on every tree, walk the two-level mapping tree and the details tree and
//! compare every device, mapping (ranges expanded) and details field with the XML (parsed by
//! a small attribute parser here: `thin-pool`'s parser would be a dependency cycle). Finally
//! recount every metadata and data reference from the structures and compare with both
//! space maps, and compare the data counts with the ones the XML implies (no fixture shares
//! leaves, so a data block's count is the number of devices mapping it).

mod common;

use common::{Details, TreeKind};
use persistent_data::block_manager::BlockManager;
use persistent_data::btree::{self, CheckOptions};
use persistent_data::checksum::{self, BlockKind};
use persistent_data::space_map::core::ENTRIES_PER_BITMAP;
use persistent_data::space_map::{DataSpaceMap, IndexEntry, SpaceMapRoot};
use persistent_data::{BlockDevice, FileDevice, MetadataBlock, TransactionManager};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use testkit::{fixtures, ScratchDir, ThinTools, ToolVersion};

const METADATA_SIZE_BYTES: u64 = 8 << 20;
const THIN_MAGIC: u64 = 27_022_010;

/// One device of the XML.
#[derive(Debug, Default)]
struct XmlDevice {
    details: Details,
    /// Virtual block → (data block, time).
    mappings: BTreeMap<u64, (u64, u32)>,
}

/// The XML's superblock and devices.
#[derive(Debug, Default)]
struct XmlPool {
    time: u32,
    transaction: u64,
    data_block_size: u32,
    nr_data_blocks: u64,
    devices: BTreeMap<u64, XmlDevice>,
}

/// `name="value"` pairs of one tag.
fn attributes(tag: &str) -> BTreeMap<&str, &str> {
    let mut out = BTreeMap::new();
    let mut rest = tag;
    while let Some(eq) = rest.find("=\"") {
        let name = rest[..eq]
            .rsplit(|c: char| c.is_whitespace())
            .next()
            .unwrap_or("");
        let after = &rest[eq + 2..];
        let end = after.find('"').expect("closing quote");
        out.insert(name, &after[..end]);
        rest = &after[end + 1..];
    }
    out
}

fn number<T: std::str::FromStr>(attrs: &BTreeMap<&str, &str>, name: &str) -> T {
    let text = attrs
        .get(name)
        .unwrap_or_else(|| panic!("attribute {name} missing in {attrs:?}"));
    text.parse()
        .unwrap_or_else(|_| panic!("attribute {name}={text:?} is not a number"))
}

fn parse_xml(text: &str) -> XmlPool {
    let mut pool = XmlPool::default();
    let mut device: Option<u64> = None;
    for piece in text.split('<').skip(1) {
        let tag = piece.split('>').next().expect("tag");
        let name = tag.split_whitespace().next().unwrap_or("");
        let attrs = attributes(tag);
        match name {
            "superblock" => {
                pool.time = number(&attrs, "time");
                pool.transaction = number(&attrs, "transaction");
                pool.data_block_size = number(&attrs, "data_block_size");
                pool.nr_data_blocks = number(&attrs, "nr_data_blocks");
            }
            "device" => {
                let id = number(&attrs, "dev_id");
                let details = Details {
                    mapped_blocks: number(&attrs, "mapped_blocks"),
                    transaction_id: number(&attrs, "transaction"),
                    creation_time: number(&attrs, "creation_time"),
                    snapshotted_time: number(&attrs, "snap_time"),
                };
                let old = pool.devices.insert(
                    id,
                    XmlDevice {
                        details,
                        mappings: BTreeMap::new(),
                    },
                );
                assert!(old.is_none(), "device {id} twice in the XML");
                device = Some(id);
            }
            "/device" => device = None,
            "single_mapping" | "range_mapping" => {
                let id = device.expect("mapping outside a device");
                let (origin, data, length): (u64, u64, u64) = if name == "single_mapping" {
                    (
                        number(&attrs, "origin_block"),
                        number(&attrs, "data_block"),
                        1,
                    )
                } else {
                    (
                        number(&attrs, "origin_begin"),
                        number::<u64>(&attrs, "data_begin"),
                        number(&attrs, "length"),
                    )
                };
                let time = number(&attrs, "time");
                let mappings = &mut pool.devices.get_mut(&id).expect("device").mappings;
                for i in 0..length {
                    assert!(mappings.insert(origin + i, (data + i, time)).is_none());
                }
            }
            "/superblock" | "" => {}
            other if other.starts_with('?') || other.starts_with('!') => {}
            other => panic!("unexpected XML tag <{other}> (the fixtures hold no <def>/<ref>)"),
        }
    }
    pool
}

fn le_u32(block: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(block[at..at + 4].try_into().unwrap())
}

fn le_u64(block: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(block[at..at + 8].try_into().unwrap())
}

/// Restore `fixture` with `tools` and compare everything with the XML.
fn restore_and_compare(fixture: &str, tools: &ThinTools, scratch: &ScratchDir) {
    let xml_path = fixtures::xml(fixture);
    let xml = parse_xml(&std::fs::read_to_string(&xml_path).expect("fixture readable"));
    let meta = scratch.join(format!("{fixture}-{}.meta", tools.version));
    tools
        .restore_sized(&xml_path, &meta, METADATA_SIZE_BYTES)
        .assert_success();
    let context = format!("{fixture} restored by thin_restore {}", tools.version);
    compare(&meta, &xml, tools.version, &context);
}

fn compare(meta: &Path, xml: &XmlPool, version: ToolVersion, context: &str) {
    let device: Arc<dyn BlockDevice> =
        Arc::new(FileDevice::open(meta, false).expect("open metadata"));
    let bm = Arc::new(BlockManager::new(device, 4096));

    // Superblock, by hand (spec §4).
    let sb = bm.read_raw(MetadataBlock::SUPERBLOCK).unwrap();
    assert!(
        checksum::matches(&sb, BlockKind::Superblock),
        "{context}: superblock checksum"
    );
    assert_eq!(le_u32(&sb[..], 4), 0, "{context}: flags");
    assert_eq!(le_u64(&sb[..], 8), 0, "{context}: blocknr");
    assert_eq!(le_u64(&sb[..], 32), THIN_MAGIC, "{context}: magic");
    assert_eq!(le_u32(&sb[..], 40), 2, "{context}: version");
    assert_eq!(le_u32(&sb[..], 44), xml.time, "{context}: time");
    assert_eq!(
        le_u64(&sb[..], 48),
        xml.transaction,
        "{context}: transaction id"
    );
    assert_eq!(le_u64(&sb[..], 56), 0, "{context}: metadata_snap");
    assert_eq!(
        le_u32(&sb[..], 336),
        xml.data_block_size,
        "{context}: data_block_size"
    );
    assert_eq!(le_u32(&sb[..], 340), 8, "{context}: metadata_block_size");
    let metadata_blocks = METADATA_SIZE_BYTES / 4096;
    assert_eq!(
        le_u64(&sb[..], 344),
        metadata_blocks,
        "{context}: metadata_nr_blocks"
    );
    let data_root = SpaceMapRoot::decode(&sb[64..96]);
    let meta_root = SpaceMapRoot::decode(&sb[192..224]);
    assert!(
        sb[96..192].iter().all(|&b| b == 0),
        "{context}: data sm slot tail"
    );
    assert!(
        sb[224..320].iter().all(|&b| b == 0),
        "{context}: metadata sm slot tail"
    );
    let mapping_root = MetadataBlock::new(le_u64(&sb[..], 320));
    let details_root = MetadataBlock::new(le_u64(&sb[..], 328));
    assert_eq!(
        data_root.block_count, xml.nr_data_blocks,
        "{context}: data sm nr_blocks"
    );
    assert_eq!(
        meta_root.block_count, metadata_blocks,
        "{context}: metadata sm nr_blocks"
    );

    // Space maps.
    let tm = TransactionManager::open(bm.clone(), &meta_root)
        .unwrap_or_else(|e| panic!("{context}: metadata space map: {e}"));
    let data = DataSpaceMap::open(&*bm, &data_root)
        .unwrap_or_else(|e| panic!("{context}: data space map: {e}"));
    // thin_restore 0.9.0 sometimes states one metadata block more in `nr_allocated` than its
    // bitmaps hold (9 vs 10 for empty-pool; the bitmaps agree with our recount). Neither
    // thin_check validates the field (spec §7.2), so accept that one quirk for 0.9.0 only.
    let meta_allocated = tm.space_map().allocated_count();
    let slack = if version == ToolVersion::V0_9 { 1 } else { 0 };
    assert!(
        (meta_allocated..=meta_allocated + slack).contains(&meta_root.allocated_count),
        "{context}: metadata nr_allocated {} in the superblock, {meta_allocated} in the bitmaps",
        meta_root.allocated_count
    );
    assert_eq!(
        data.core().allocated_count(),
        data_root.allocated_count,
        "{context}: data nr_allocated"
    );
    tm.space_map().verify();
    data.core().verify();

    // Structure of every tree.
    let strict = CheckOptions::default();
    // thin_check 1.x does not require bottom-level leaves to be a third full, so 1.x
    // restore need not keep that rule there (spec §11 rule 7).
    let bottom_options = CheckOptions {
        leaf_occupancy: version == ToolVersion::V0_9,
    };
    let mut bottoms = BTreeMap::new();
    btree::check::<u64, _>(&*bm, mapping_root, strict, &mut |_| {}, &mut |dev, root| {
        bottoms.insert(dev, MetadataBlock::new(root));
        Ok(())
    })
    .unwrap_or_else(|e| panic!("{context}: top-level mapping tree: {e}"));
    let mut details = BTreeMap::new();
    btree::check::<Details, _>(&*bm, details_root, strict, &mut |_| {}, &mut |dev, d| {
        details.insert(dev, d);
        Ok(())
    })
    .unwrap_or_else(|e| panic!("{context}: details tree: {e}"));
    for (name, kind, root) in [
        (
            "data sm index",
            TreeKind::SpaceMapIndex,
            data_root.bitmap_root,
        ),
        (
            "data sm overflow",
            TreeKind::Plain(4),
            data_root.ref_count_root,
        ),
        (
            "metadata sm overflow",
            TreeKind::Plain(4),
            meta_root.ref_count_root,
        ),
    ] {
        common::check_tree(&*bm, kind, MetadataBlock::new(root), strict)
            .unwrap_or_else(|e| panic!("{context}: {name} tree: {e}"));
    }

    // Devices, details and mappings.
    let xml_ids: Vec<u64> = xml.devices.keys().copied().collect();
    assert_eq!(
        bottoms.keys().copied().collect::<Vec<_>>(),
        xml_ids,
        "{context}: top-level keys"
    );
    assert_eq!(
        details.keys().copied().collect::<Vec<_>>(),
        xml_ids,
        "{context}: details keys"
    );
    for (id, device) in &xml.devices {
        let mut expected = device.details;
        expected.mapped_blocks = device.mappings.len() as u64;
        assert_eq!(
            device.details.mapped_blocks, expected.mapped_blocks,
            "{context}: the fixture's own mapped_blocks of device {id}"
        );
        assert_eq!(details[id], expected, "{context}: details of device {id}");
        let root = bottoms[id];
        btree::check::<u64, _>(&*bm, root, bottom_options, &mut |_| {}, &mut |_, _| Ok(()))
            .unwrap_or_else(|e| panic!("{context}: bottom tree of device {id}: {e}"));
        let mut found = BTreeMap::new();
        btree::walk::<u64, _>(&*bm, root, &mut |vb, block_time| {
            found.insert(vb, (block_time >> 24, (block_time & 0xFF_FFFF) as u32));
            Ok(())
        })
        .unwrap();
        if found != device.mappings {
            let first = found
                .iter()
                .zip(&device.mappings)
                .find(|(a, b)| a != b)
                .map(|(a, b)| format!("metadata {a:?}, XML {b:?}"));
            panic!(
                "{context}: device {id}: {} mappings in metadata, {} in XML; first difference: {first:?}",
                found.len(),
                device.mappings.len()
            );
        }
        // Lookups agree with the walk (a sample, including absent keys).
        for (&vb, &(data_block, time)) in device.mappings.iter().step_by(97) {
            let value = btree::lookup::<u64, _>(&*bm, root, vb).unwrap();
            assert_eq!(
                value,
                Some(data_block << 24 | u64::from(time)),
                "{context}: lookup {id}/{vb}"
            );
            let absent = vb + 1_000_000_000;
            assert_eq!(btree::lookup::<u64, _>(&*bm, root, absent).unwrap(), None);
        }
    }

    // Reference counts: recount everything and compare with both space maps.
    let trees = [
        (TreeKind::ThinMapping, mapping_root),
        (TreeKind::Plain(24), details_root),
    ];
    let counts = common::recount(&*bm, &meta_root, &data_root, &trees)
        .unwrap_or_else(|e| panic!("{context}: recount: {e}"));
    common::compare_counts(&counts, &|b| tm.count(MetadataBlock::new(b)), &|b| {
        data.count(b)
    })
    .unwrap_or_else(|e| panic!("{context}: {e}"));
    // No fixture shares leaves: a data block's count is the number of devices mapping it.
    let mut expected_data = vec![0u32; xml.nr_data_blocks as usize];
    for device in xml.devices.values() {
        for &(data_block, _) in device.mappings.values() {
            expected_data[data_block as usize] += 1;
        }
    }
    assert!(
        counts.data == expected_data,
        "{context}: data counts recounted from the leaves differ from the XML's"
    );
    // Index entries: `none_free_before` may only under-state the first free entry.
    btree::walk::<IndexEntry, _>(&*bm, MetadataBlock::new(data_root.bitmap_root), &mut |index, entry| {
        let first = index * ENTRIES_PER_BITMAP;
        let end = (first + ENTRIES_PER_BITMAP).min(data_root.block_count);
        let first_free = (first..end).find(|&b| data.count(b) == 0).unwrap_or(end) - first;
        assert!(
            u64::from(entry.none_free_before) <= first_free,
            "{context}: data bitmap {index}: none_free_before {} beyond the first free entry {first_free}",
            entry.none_free_before
        );
        Ok(())
    })
    .unwrap();
}

fn compare_fixture(fixture: &str) {
    let scratch = ScratchDir::new(&format!("restore-compat-{fixture}"));
    for tools in ThinTools::all() {
        restore_and_compare(fixture, &tools, &scratch);
    }
}

#[test]
fn devices_snapshot_restores_compatibly() {
    compare_fixture("devices-snapshot");
}

#[test]
fn split_leaves_restores_compatibly() {
    compare_fixture("split-leaves");
}

#[test]
fn two_bitmaps_overflow_restores_compatibly() {
    compare_fixture("two-bitmaps-overflow");
}

#[test]
fn empty_pool_restores_compatibly() {
    compare_fixture("empty-pool");
}

#[test]
fn large_three_devices_restores_compatibly() {
    compare_fixture("large-three-devices");
}

#[test]
fn xml_parser_expands_ranges() {
    let xml = parse_xml(
        r#"<superblock uuid="" time="3" transaction="7" flags="0" version="2" data_block_size="128" nr_data_blocks="20">
  <device dev_id="5" mapped_blocks="3" transaction="1" creation_time="2" snap_time="3">
    <range_mapping origin_begin="10" data_begin="4" length="2" time="1"/>
    <single_mapping origin_block="20" data_block="9" time="0"/>
  </device>
</superblock>"#,
    );
    assert_eq!(
        (
            xml.time,
            xml.transaction,
            xml.data_block_size,
            xml.nr_data_blocks
        ),
        (3, 7, 128, 20)
    );
    let device = &xml.devices[&5];
    assert_eq!(device.details.snapshotted_time, 3);
    assert_eq!(
        device
            .mappings
            .iter()
            .map(|(k, v)| (*k, *v))
            .collect::<Vec<_>>(),
        vec![(10, (4, 1)), (11, (5, 1)), (20, (9, 0))]
    );
}
