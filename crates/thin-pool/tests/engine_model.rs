//! Goal: the engine behaves like a map of byte arrays per volume, where a snapshot copies
//! its origin's array, across writes, zeroes, discards, flushes, snapshots, deletes, resizes,
//! data and metadata growth and reopens, and every reopened pool's metadata passes
//! `thinpool check` and both thin_check versions.
//! Method: seeded random operations on small volumes (64 KiB blocks) against the model,
//! every read compared; after each reopen every volume is read whole, the index equals the
//! mapping trees, our checker runs on the closed pool's metadata, and both thin_check
//! versions on a sample of them (each run of thin_check 1.1 costs about half a second).

mod engine_kit;

use engine_kit::check_metadata;
use persistent_data::BlockDevice;
use rand::Rng;
use std::collections::BTreeMap;
use testkit::scratch::ScratchDir;
use testkit::tools::ThinTools;
use thin_pool::data_device::DataDevice;
use thin_pool::testing::{deterministic_options as options, MemoryParts};

const BLOCK: u64 = 65536;

#[test]
fn engine_matches_model() {
    let (_report, mut rng) = testkit::seed::seeded_rng();
    let steps = testkit::seed::case_count(3000);
    let parts = MemoryParts::new(1024, 64 * BLOCK);
    let (metadata, data) = (parts.metadata.clone(), parts.data.clone());
    let tools = ThinTools::all();
    let scratch = ScratchDir::new("engine-model");
    let image = scratch.join("metadata");
    let mut reopens = 0u64;
    let tool_reopens = testkit::seed::case_count(6);
    let mut pool = parts.format(BLOCK, options());
    let mut model: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let mut next_name = 0;
    for step in 0..steps {
        let names: Vec<String> = model.keys().cloned().collect();
        let choice = rng.gen_range(0..100);
        if names.is_empty() || choice < 3 {
            let name = format!("v{next_name}");
            next_name += 1;
            let size = rng.gen_range(1..=8u64) * BLOCK + rng.gen_range(0..4u64) * 4096;
            pool.create_volume(&name, size).unwrap();
            model.insert(name, vec![0; size as usize]);
            continue;
        }
        let name = &names[rng.gen_range(0..names.len())];
        let size = model[name].len() as u64;
        let sectors = size / 512;
        let start = rng.gen_range(0..sectors);
        let count = rng.gen_range(1..=(sectors - start).min(300));
        let (offset, len) = (start * 512, count * 512);
        if std::env::var("THINPOOL_TRACE").is_ok() {
            eprintln!("step {step}: choice {choice} {name} {offset}+{len}");
        }
        match choice {
            3..=40 => {
                let volume = pool.volume(name).unwrap();
                let fill: u8 = rng.gen();
                let bytes = vec![fill; len as usize];
                match volume.write(offset, &bytes, rng.gen_bool(0.05)) {
                    Ok(()) => model.get_mut(name).unwrap()
                        [offset as usize..(offset + len) as usize]
                        .fill(fill),
                    Err(thin_pool::Error::OutOfDataSpace { .. }) => {
                        // Out of space: the part written before the error is unknown; re-read it.
                        let mut actual = vec![0; len as usize];
                        volume.read(offset, &mut actual).unwrap();
                        model.get_mut(name).unwrap()[offset as usize..(offset + len) as usize]
                            .copy_from_slice(&actual);
                    }
                    Err(e) => panic!("step {step}: write: {e}"),
                }
            }
            41..=70 => {
                let volume = pool.volume(name).unwrap();
                let mut buf = vec![0; len as usize];
                volume.read(offset, &mut buf).unwrap();
                assert!(
                    buf == model[name][offset as usize..(offset + len) as usize],
                    "step {step}: read {name} {offset}+{len}"
                );
            }
            71..=76 => {
                let volume = pool.volume(name).unwrap();
                let may_unmap = rng.gen_bool(0.5);
                match volume.write_zeroes(offset, len, may_unmap, false) {
                    Ok(()) => model.get_mut(name).unwrap()
                        [offset as usize..(offset + len) as usize]
                        .fill(0),
                    Err(thin_pool::Error::OutOfDataSpace { .. }) => {
                        let mut actual = vec![0; len as usize];
                        volume.read(offset, &mut actual).unwrap();
                        model.get_mut(name).unwrap()[offset as usize..(offset + len) as usize]
                            .copy_from_slice(&actual);
                    }
                    Err(e) => panic!("step {step}: write_zeroes: {e}"),
                }
            }
            77..=82 => {
                let volume = pool.volume(name).unwrap();
                volume.discard(offset, len).unwrap();
                // Whole blocks read as zeros; partial ones are zeroed unless shared (then
                // unchanged or zero): read back what the engine says and check it is one of them.
                let mut actual = vec![0; len as usize];
                volume.read(offset, &mut actual).unwrap();
                let expected = &model[name][offset as usize..(offset + len) as usize];
                for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
                    assert!(
                        a == 0 || a == e,
                        "step {step}: discarded byte {i} is neither zero nor old"
                    );
                }
                model.get_mut(name).unwrap()[offset as usize..(offset + len) as usize]
                    .copy_from_slice(&actual);
            }
            83..=87 => {
                let snap = format!("v{next_name}");
                next_name += 1;
                pool.snapshot(name, &snap, false).unwrap();
                let copy = model[name].clone();
                model.insert(snap, copy);
            }
            88..=90 => {
                pool.delete_volume(name).unwrap();
                model.remove(name);
            }
            91..=92 => {
                let new_size = rng.gen_range(1..=8u64) * BLOCK;
                pool.resize_volume(name, new_size, thin_pool::Shrink::DropData)
                    .unwrap();
                model.get_mut(name).unwrap().resize(new_size as usize, 0);
                // A shrink then grow must read zeros beyond the old end: the model's resize does.
            }
            93..=94 => pool.commit().unwrap(),
            95 => pool.volume(name).unwrap().flush().unwrap(),
            96 => {
                let blocks = data.size_bytes() / BLOCK;
                if blocks < 512 {
                    data.grow((blocks + rng.gen_range(1..=32)) * BLOCK);
                    pool.grow_data(data.size_bytes()).unwrap();
                    assert_eq!(pool.status().data_total_blocks, data.size_bytes() / BLOCK);
                }
            }
            97 => {
                if metadata.block_count() < 4096 {
                    metadata.grow(metadata.block_count() + rng.gen_range(1..=256));
                    pool.grow_metadata(None).unwrap();
                    assert_eq!(pool.status().metadata_total_blocks, metadata.block_count());
                }
            }
            _ => {
                pool.verify_index().unwrap();
                drop(pool);
                reopens += 1;
                let run_tools = reopens <= tool_reopens;
                if let Err(e) = check_metadata(
                    metadata.clone(),
                    run_tools.then_some((&tools[..], image.as_path())),
                ) {
                    panic!("step {step}: closed pool's metadata fails a check: {e}");
                }
                pool = parts.reopen(options());
                for (name, bytes) in &model {
                    let volume = pool.volume(name).unwrap();
                    let mut buf = vec![0; bytes.len()];
                    volume.read(0, &mut buf).unwrap();
                    assert!(&buf == bytes, "step {step}: {name} differs after reopen");
                }
                pool.verify_index().unwrap();
            }
        }
    }
    pool.verify_index().unwrap();
    let status = pool.status();
    assert_eq!(status.volume_count, model.len());
    drop(pool);
    check_metadata(metadata.clone(), Some((&tools[..], image.as_path())))
        .unwrap_or_else(|e| panic!("final metadata fails a check: {e}"));
    println!("{steps} steps, {reopens} reopens");
}
