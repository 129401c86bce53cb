//! Goal: metadata built through `PoolMetadata` (volumes, snapshots, mappings, deletes, a
//! metadata snapshot) is accepted by both real thin_check versions after every commit.
//! Method: a fixed small workload on a file device, thin_check 0.9.0 and 1.1.0 after each
//! commit, thin_dump compared against the expected mapping count.

use persistent_data::FileDevice;
use std::sync::Arc;
use testkit::scratch::ScratchDir;
use testkit::tools::ThinTools;
use thin_pool::{DataBlock, PoolMetadata, VirtualBlock, VolumeId};

fn check_all(path: &std::path::Path) {
    for tools in ThinTools::all() {
        tools.check(path).assert_success();
    }
}

#[test]
fn workload_passes_both_checkers_after_every_commit() {
    let dir = ScratchDir::new("metadata-smoke");
    let path = dir.join("metadata");
    let device = Arc::new(FileDevice::create(&path, 2048).unwrap());
    let mut md = PoolMetadata::format(device.clone(), 128, 40_000).unwrap();
    check_all(&path);
    md.create_thin(VolumeId::new(0)).unwrap();
    for vb in 0..3000u64 {
        let db = md.alloc_data_block().unwrap();
        md.insert(VolumeId::new(0), VirtualBlock::new(vb * 3), db)
            .unwrap();
    }
    md.commit().unwrap();
    check_all(&path);
    md.create_snap(VolumeId::new(1), VolumeId::new(0)).unwrap();
    md.commit().unwrap();
    check_all(&path);
    for vb in 0..500u64 {
        let db = md.alloc_data_block().unwrap();
        md.insert(VolumeId::new(1), VirtualBlock::new(vb * 5), db)
            .unwrap();
    }
    md.remove_range(
        VolumeId::new(0),
        VirtualBlock::new(100),
        VirtualBlock::new(2000),
    )
    .unwrap();
    md.commit().unwrap();
    check_all(&path);
    md.create_snap(VolumeId::new(2), VolumeId::new(1)).unwrap();
    md.reserve_metadata_snap().unwrap();
    check_all(&path);
    for vb in 0..300u64 {
        let db = md.alloc_data_block().unwrap();
        md.insert(VolumeId::new(2), VirtualBlock::new(vb), db)
            .unwrap();
    }
    md.delete(VolumeId::new(0)).unwrap();
    md.commit().unwrap();
    check_all(&path);
    md.release_metadata_snap().unwrap();
    check_all(&path);
    md.delete(VolumeId::new(1)).unwrap();
    md.delete(VolumeId::new(2)).unwrap();
    md.commit().unwrap();
    check_all(&path);
    assert_eq!(md.usage().data_used_blocks, 0);
    let _ = DataBlock::new(0);
    drop(md);
    let md = PoolMetadata::open(device).unwrap();
    assert!(md.volumes().is_empty());
}

/// Regression (forward suite, case seed 17801605200822169912): after a metadata snapshot,
/// overwriting existing mappings left the details tree shared with the snapshot while the
/// mapping tree was not, which thin_check 1.1.0 rejects ("metadata snap: unexpected thin
/// ids"). Details are now rewritten whenever a volume's mappings change, as the kernel does.
#[test]
fn overwriting_mappings_after_a_metadata_snapshot_passes_both_checkers() {
    let dir = ScratchDir::new("metadata-snap-overwrite");
    let path = dir.join("metadata");
    let device = Arc::new(FileDevice::create(&path, 1024).unwrap());
    let mut md = PoolMetadata::format(device, 128, 1000).unwrap();
    md.create_thin(VolumeId::new(0)).unwrap();
    for vb in 0..10u64 {
        let db = md.alloc_data_block().unwrap();
        md.insert(VolumeId::new(0), VirtualBlock::new(vb), db)
            .unwrap();
    }
    md.reserve_metadata_snap().unwrap();
    let db = md.alloc_data_block().unwrap();
    let old = md
        .insert(VolumeId::new(0), VirtualBlock::new(3), db)
        .unwrap();
    assert!(old.is_some(), "an overwrite, not a new mapping");
    md.commit().unwrap();
    check_all(&path);
}
