//! A repair of healthy metadata describes it exactly; a repair of damaged metadata keeps
//! every mapping outside the damage, each pointing where it did; a cycle ends the walk.
//! (The comparison with `thin_repair` is in `tests/repair_parity.rs`.)

use super::*;
use crate::format::dump::expand::Expanded;
use crate::format::dump::metadata::{dump, DumpOptions};
use crate::format::dump::Flavour;
use crate::{PoolMetadata, VirtualBlock};
use persistent_data::btree::node::{Node, HEADER_SIZE};
use persistent_data::checksum::{self, BlockKind};
use persistent_data::{Block, MemoryDevice, BLOCK_SIZE};

fn image() -> (Arc<MemoryDevice>, Vec<MetadataBlock>) {
    let device = Arc::new(MemoryDevice::new(1024));
    let mut md = PoolMetadata::format(device.clone(), 128, 10_000).unwrap();
    md.create_thin(VolumeId::new(0)).unwrap();
    for vb in 0..2_000u64 {
        let db = md.alloc_data_block().unwrap();
        md.insert(VolumeId::new(0), VirtualBlock::new(vb * 2), db)
            .unwrap();
    }
    md.create_snap(VolumeId::new(5), VolumeId::new(0)).unwrap();
    md.commit().unwrap();
    let root = md.volume_root(VolumeId::new(0)).unwrap();
    drop(md);
    let mut data: Block = [0; BLOCK_SIZE];
    device.read(root, &mut data).unwrap();
    let node = Node::parse(root, &data, 8).unwrap();
    assert!(!node.is_leaf(), "volume 0 needs an internal root");
    let leaves = (0..node.len()).map(|i| node.child(i)).collect();
    (device, leaves)
}

fn expanded(device: Arc<dyn BlockDevice>) -> Expanded {
    let mut out = Expanded::new();
    let options = DumpOptions {
        flavour: Flavour::V0_9,
        ..DumpOptions::default()
    };
    dump(device, &options, &mut out).unwrap();
    out
}

fn recovered(device: Arc<dyn BlockDevice>) -> (Expanded, Recovery) {
    let mut out = Expanded::new();
    let recovery = recover(device, &RepairOptions::default(), &mut out).unwrap();
    (out, recovery)
}

fn patch(device: &MemoryDevice, block: MetadataBlock, edit: impl FnOnce(&mut Block)) {
    let mut data: Block = [0; BLOCK_SIZE];
    device.read(block, &mut data).unwrap();
    edit(&mut data);
    checksum::stamp(&mut data, BlockKind::Node);
    device.write(block, &data).unwrap();
}

#[test]
fn healthy_metadata_is_recovered_exactly() {
    let (device, _) = image();
    let before = expanded(device.clone());
    let (after, recovery) = recovered(device);
    assert!(recovery.skipped.is_empty(), "{recovery:?}");
    assert_eq!(recovery.mapping_count, 4_000);
    assert_eq!(after.devices, before.devices);
}

#[test]
fn a_bad_leaf_loses_its_mappings_and_no_other() {
    let (device, leaves) = image();
    let before = expanded(device.clone());
    let mut data: Block = [0; BLOCK_SIZE];
    device.read(leaves[1], &mut data).unwrap();
    let lost: Vec<u64> = {
        let node = Node::parse(leaves[1], &data, 8).unwrap();
        (0..node.len()).map(|i| node.key(i)).collect()
    };
    data[3000] ^= 1;
    device.write(leaves[1], &data).unwrap();
    let (after, recovery) = recovered(device);
    // The leaf is volume 0's and its snapshot's: each walk meets it once.
    assert_eq!(recovery.skipped.bad_nodes, 2, "{recovery:?}");
    for (id, device) in &before.devices {
        let kept = &after.devices[id].mappings;
        for (vb, mapping) in &device.mappings {
            match kept.get(vb) {
                Some(found) => assert_eq!(found, mapping),
                None => assert!(lost.contains(vb), "volume {id} lost block {vb}"),
            }
        }
        assert_eq!(kept.len() + lost.len(), device.mappings.len());
        assert_eq!(after.devices[id].info.mapped_block_count, kept.len() as u64);
    }
}

#[test]
fn a_cycle_is_cut_and_the_rest_kept() {
    let (device, leaves) = image();
    assert!(leaves.len() > 2);
    let sb = crate::format::superblock::Superblock::read(
        &BlockManager::new(device.clone(), 16),
        MetadataBlock::SUPERBLOCK,
    )
    .unwrap();
    let mut roots = BTreeMap::new();
    let bm = BlockManager::new(device.clone(), 16);
    Walker::new(&bm).entries(sb.data_mapping_root, 8, &mut |k, v| {
        roots.insert(k, u64::unpack(v));
        true
    });
    let root = MetadataBlock::new(roots[&0]);
    // Point the root's second child at the root itself.
    patch(&device, root, |d| {
        let max = u32::from_le_bytes(d[20..24].try_into().unwrap()) as usize;
        let at = HEADER_SIZE + 8 * max + 8;
        d[at..at + 8].copy_from_slice(&root.get().to_le_bytes());
    });
    let (after, recovery) = recovered(device);
    assert!(recovery.skipped.repeated_nodes >= 1, "{recovery:?}");
    assert!(after.devices[&0].mappings.len() < 2_000);
    assert!(!after.devices[&0].mappings.is_empty());
}

#[test]
fn a_damaged_superblock_needs_the_data_block_size() {
    let (device, _) = image();
    let before = expanded(device.clone());
    let mut data: Block = [0; BLOCK_SIZE];
    device.read(MetadataBlock::SUPERBLOCK, &mut data).unwrap();
    data[100] ^= 1;
    device.write(MetadataBlock::SUPERBLOCK, &data).unwrap();
    let mut out = Expanded::new();
    let error = recover(device.clone(), &RepairOptions::default(), &mut out).unwrap_err();
    assert!(matches!(error, Error::DataBlockSizeNeeded), "{error:?}");
    let options = RepairOptions {
        data_block_size_sectors: Some(128),
        ..RepairOptions::default()
    };
    let recovery = recover(device, &options, &mut out).unwrap();
    assert_eq!(recovery.source, RootSource::DamagedSuperblock);
    assert_eq!(out.devices, before.devices);
    assert_eq!(out.superblock.data_block_count, 2_000);
}
