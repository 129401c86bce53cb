//! Goal: a power cut at any write or flush of a `PoolMetadata` workload leaves metadata
//! that reopens to the last committed state (or, if the cut came after the commit's final
//! superblock write, the state that commit was making), and that our checker and both real
//! thin_check versions accept.
//! Method: run a small workload (create, snapshot, map, unmap, delete, metadata snapshot)
//! once on a `CrashDevice`, recording the state after each successful commit and the
//! number of writes plus flushes. Then for every operation count `n` and each crash mode,
//! rerun with the power cut after `n` operations, build the crash image, reopen and compare
//! with the recorded states, and run our checker. thin_check (both versions) runs on a
//! seeded sample of the images, written to a file, to keep the runtime down.

use persistent_data::{BlockDevice, FileDevice, MemoryDevice, MetadataBlock, BLOCK_SIZE};
use rand::Rng;
use std::collections::BTreeMap;
use std::sync::Arc;
use testkit::crash::{CrashDevice, CrashMode};
use testkit::scratch::ScratchDir;
use testkit::tools::ThinTools;
use thin_pool::format::check::{check, CheckOptions};
use thin_pool::{PoolMetadata, VirtualBlock, VolumeId};

const METADATA_BLOCKS: u64 = 256;

/// Volumes, each with its details and all its mappings (virtual → (data, time)).
type State = BTreeMap<u32, (u64, BTreeMap<u64, (u64, u32)>)>;

fn capture(md: &PoolMetadata) -> State {
    let mut state = State::new();
    for id in md.volumes() {
        let mut mappings = BTreeMap::new();
        md.walk_volume(id, &mut |vb, db, time| {
            mappings.insert(vb.get(), (db.get(), time));
            Ok(())
        })
        .unwrap();
        let mapped = md.details(id).unwrap().mapped_blocks;
        state.insert(id.get(), (mapped, mappings));
    }
    state
}

/// The workload. `on_commit` sees the state after each successful commit (format first).
fn workload(
    device: Arc<dyn BlockDevice>,
    on_commit: &mut dyn FnMut(State),
) -> thin_pool::Result<()> {
    let mut md = PoolMetadata::format(device, 128, 4096)?;
    on_commit(capture(&md));
    md.create_thin(VolumeId::new(0))?;
    map(&mut md, 0, 0..300)?;
    md.commit()?;
    on_commit(capture(&md));
    md.create_snap(VolumeId::new(1), VolumeId::new(0))?;
    map(&mut md, 1, 290..320)?;
    md.commit()?;
    on_commit(capture(&md));
    md.reserve_metadata_snap()?;
    on_commit(capture(&md));
    md.remove_range(
        VolumeId::new(0),
        VirtualBlock::new(0),
        VirtualBlock::new(100),
    )?;
    md.create_thin(VolumeId::new(2))?;
    map(&mut md, 2, 1000..1020)?;
    md.commit()?;
    on_commit(capture(&md));
    md.delete(VolumeId::new(0))?;
    md.release_metadata_snap()?;
    on_commit(capture(&md));
    Ok(())
}

fn write_image(image: &MemoryDevice, path: &std::path::Path) {
    let file = FileDevice::create(path, image.block_count()).unwrap();
    let mut block = [0u8; BLOCK_SIZE];
    for b in 0..image.block_count() {
        image.read(MetadataBlock::new(b), &mut block).unwrap();
        if block.iter().any(|&x| x != 0) {
            file.write(MetadataBlock::new(b), &block).unwrap();
        }
    }
    file.flush().unwrap();
}

#[test]
fn crash_at_every_write_and_flush_keeps_a_committed_state() {
    let (seed_report, mut rng) = testkit::seed::seeded_rng();
    let reference = Arc::new(CrashDevice::new(METADATA_BLOCKS));
    let mut states = Vec::new();
    workload(reference.clone(), &mut |s| states.push(s)).unwrap();
    let total = reference.operation_count();
    assert!(states.len() == 6 && total > 20, "{total} operations");

    let dir = ScratchDir::new("metadata-crash");
    let image_path = dir.join("image");
    let tools = ThinTools::all();
    // About this many images go through the real thin_check.
    let tool_samples = testkit::seed::case_count(40);
    let mut tool_runs = 0;
    let cases = total * CrashMode::ALL.len() as u64;
    for n in 0..total {
        for mode in CrashMode::ALL {
            let device = Arc::new(CrashDevice::new(METADATA_BLOCKS));
            device.set_power_cut_after(Some(n));
            let mut committed = 0usize;
            let result = workload(device.clone(), &mut |_| committed += 1);
            assert!(
                result.is_err(),
                "cut after {n} of {total} must fail the workload"
            );
            let memory = Arc::new(device.crash_image(mode, &mut rng));
            let what = format!(
                "cut after {n} of {total}, {mode:?}, {committed} commits done (seed {})",
                seed_report.seed()
            );
            let image: Arc<dyn BlockDevice> = memory.clone();
            let reopened = match PoolMetadata::open(image.clone()) {
                Ok(md) => md,
                Err(e) => {
                    // Only a cut during format may leave no metadata at all.
                    assert_eq!(committed, 0, "{what}: reopen failed: {e}");
                    continue;
                }
            };
            let state = capture(&reopened);
            let acceptable =
                &states[committed.saturating_sub(1)..(committed + 1).min(states.len())];
            assert!(
                acceptable.contains(&state),
                "{what}: reopened state matches no committed state"
            );
            drop(reopened);
            let report = check(image.clone(), &CheckOptions::default(), &mut |_| {});
            assert!(report.is_clean(), "{what}:\n{report}");
            if rng.gen_range(0..cases) < tool_samples {
                tool_runs += 1;
                write_image(&memory, &image_path);
                for t in &tools {
                    let out = t.check(&image_path);
                    assert!(out.success(), "{what}: thin_check {}:\n{out}", t.version);
                }
            }
        }
    }
    println!("{cases} crash images checked, {tool_runs} also by both thin_check versions");
}

fn map(md: &mut PoolMetadata, id: u32, blocks: std::ops::Range<u64>) -> thin_pool::Result<()> {
    for vb in blocks {
        let db = md.alloc_data_block()?;
        md.insert(VolumeId::new(id), VirtualBlock::new(vb), db)?;
    }
    Ok(())
}
