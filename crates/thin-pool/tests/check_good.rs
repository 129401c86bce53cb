//! Goal: the checker accepts every metadata the real tools and our writer produce.
//! Method: (1) seeded random workloads through `PoolMetadata` (volumes, snapshots, maps,
//! unmaps, deletes, metadata snapshots), checking after every commit with both occupancy
//! rules and comparing the summary with the model; (2) every XML fixture restored by both
//! real `thin_restore` versions.

use persistent_data::{BlockDevice, FileDevice, MemoryDevice};
use rand::Rng;
use std::collections::BTreeMap;
use std::sync::Arc;
use testkit::scratch::ScratchDir;
use testkit::tools::{ThinTools, ToolVersion};
use thin_pool::format::check::{check, CheckOptions, LeafOccupancy, Report};
use thin_pool::{PoolMetadata, VirtualBlock, VolumeId};

fn run(device: Arc<dyn BlockDevice>, leaf_occupancy: LeafOccupancy) -> Report {
    let options = CheckOptions {
        leaf_occupancy,
        ..CheckOptions::default()
    };
    check(device, &options, &mut |_| {})
}

fn assert_clean(device: Arc<dyn BlockDevice>, what: &str) -> Report {
    for occupancy in [LeafOccupancy::Strict, LeafOccupancy::SkipBottomLeaves] {
        let report = run(device.clone(), occupancy);
        assert!(report.is_clean(), "{what} ({occupancy:?}):\n{report}");
        assert_eq!(report.warning_count, 0, "{what}:\n{report}");
    }
    run(device, LeafOccupancy::Strict)
}

#[test]
fn random_workloads_pass_after_every_commit() {
    let (report_seed, mut rng) = testkit::seed::seeded_rng();
    let seed = report_seed.seed();
    let cases = testkit::seed::case_count(6);
    for case in 0..cases {
        let device = Arc::new(MemoryDevice::new(4096));
        let mut md = PoolMetadata::format(device.clone(), 128, 50_000).unwrap();
        // Volume -> number of mappings.
        let mut model: BTreeMap<u32, u64> = BTreeMap::new();
        let mut next_id = 0u32;
        for step in 0..25 {
            let op = rng.gen_range(0..10);
            let ids: Vec<u32> = model.keys().copied().collect();
            match op {
                0 | 1 => {
                    md.create_thin(VolumeId::new(next_id)).unwrap();
                    model.insert(next_id, 0);
                    next_id += 1;
                }
                2 if !ids.is_empty() => {
                    let origin = ids[rng.gen_range(0..ids.len())];
                    md.create_snap(VolumeId::new(next_id), VolumeId::new(origin))
                        .unwrap();
                    model.insert(next_id, model[&origin]);
                    next_id += 1;
                }
                3 if ids.len() > 1 => {
                    let id = ids[rng.gen_range(0..ids.len())];
                    md.delete(VolumeId::new(id)).unwrap();
                    model.remove(&id);
                }
                4 if !ids.is_empty() => {
                    let id = ids[rng.gen_range(0..ids.len())];
                    let begin = rng.gen_range(0..2000u64);
                    let end = begin + rng.gen_range(1..800u64);
                    let removed = md
                        .remove_range(
                            VolumeId::new(id),
                            VirtualBlock::new(begin),
                            VirtualBlock::new(end),
                        )
                        .unwrap();
                    *model.get_mut(&id).unwrap() -= removed;
                }
                5 => {
                    if md.metadata_snap().is_some() {
                        md.release_metadata_snap().unwrap();
                    } else {
                        md.reserve_metadata_snap().unwrap();
                    }
                }
                _ if !ids.is_empty() => {
                    let id = ids[rng.gen_range(0..ids.len())];
                    for _ in 0..rng.gen_range(1..600) {
                        let vb = rng.gen_range(0..3000u64);
                        let db = md.alloc_data_block().unwrap();
                        if md
                            .insert(VolumeId::new(id), VirtualBlock::new(vb), db)
                            .unwrap()
                            .is_none()
                        {
                            *model.get_mut(&id).unwrap() += 1;
                        }
                    }
                }
                _ => {}
            }
            md.commit().unwrap();
            let report = assert_clean(
                device.clone(),
                &format!("seed {seed} case {case} step {step}"),
            );
            assert_eq!(
                report.summary.volume_count,
                model.len() as u64,
                "seed {seed}"
            );
            assert_eq!(
                report.summary.mapping_count,
                model.values().sum::<u64>(),
                "seed {seed} case {case} step {step}"
            );
            assert_eq!(
                report.summary.metadata_free_blocks,
                md.usage().metadata_total_blocks - md.usage().metadata_used_blocks
            );
        }
    }
}

#[test]
fn thin_restore_output_passes_for_every_fixture_and_version() {
    let dir = ScratchDir::new("check-good-restore");
    for tools in ThinTools::all() {
        for name in testkit::fixtures::all() {
            let xml = testkit::fixtures::xml(name);
            let out = dir.join(format!("{name}-{}", tools.version));
            let restored = tools.restore(&xml, &out);
            if tools.version == ToolVersion::V0_9 && !restored.success() {
                // 0.9.0 cannot restore some 1.x dumps (<def>/<ref>); nothing to check.
                continue;
            }
            restored.assert_success();
            let device: Arc<dyn BlockDevice> = Arc::new(FileDevice::open(&out, false).unwrap());
            let report = assert_clean(device, &format!("{name} restored by {}", tools.version));
            let expected = tools.check(&out);
            assert!(expected.success());
            assert!(
                expected
                    .stdout
                    .contains(&format!("TRANSACTION_ID={}", report.summary.transaction_id)),
                "{}",
                expected.stdout
            );
        }
    }
}
