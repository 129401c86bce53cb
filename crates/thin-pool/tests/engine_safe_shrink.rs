//! Goal (issue 20, finding 4): a shrink never drops data by surprise. A shrink of a volume
//! a handle has open is refused (busy, naming the handles), whatever the policy; one that
//! would unmap mapped blocks is refused with how many unless `Shrink::DropData` is passed;
//! one past unmapped blocks only goes ahead; a forced one says how much it unmapped, and
//! what it keeps reads the same.
//! Method: a memory pool and a byte model per volume; shrinks of a volume with a built
//! index (ops still queued, not committed) and of a snapshot never opened (no index: its
//! tree is counted); content compared with the model after every step and after a reopen.

use thin_pool::testing::{deterministic_options, MemoryParts};
use thin_pool::{Error, Pool, Shrink};

const BLOCK: u64 = 65536;
const EBUSY: i32 = 16;

fn parts() -> MemoryParts {
    MemoryParts::new(1024, 64 * BLOCK)
}

fn pattern(seed: u8, len: u64) -> Vec<u8> {
    (0..len).map(|i| seed ^ (i % 251) as u8).collect()
}

/// What `name` reads, whole.
fn content(pool: &Pool, name: &str) -> Vec<u8> {
    let volume = pool.volume(name).unwrap();
    let mut bytes = vec![0u8; volume.size_bytes() as usize];
    volume.read(0, &mut bytes).unwrap();
    bytes
}

#[test]
fn a_shrink_is_refused_while_the_volume_is_open() {
    let pool = parts().format(BLOCK, deterministic_options());
    pool.create_volume("vm", 16 * BLOCK).unwrap();
    let vm = pool.volume("vm").unwrap();
    vm.write(12 * BLOCK, &pattern(1, BLOCK), false).unwrap();
    for shrink in [Shrink::KeepData, Shrink::DropData] {
        // Past mapped data and past unmapped space alike: the client may write there.
        for size in [8 * BLOCK, 14 * BLOCK] {
            let refused = pool.resize_volume("vm", size, shrink).unwrap_err();
            assert!(matches!(refused, Error::Busy(_)), "{refused}");
            assert_eq!(refused.errno(), EBUSY);
            let message = refused.to_string();
            assert!(message.contains("open (1 handle)"), "{message}");
        }
    }
    assert_eq!(pool.info("vm").unwrap().size_bytes, 16 * BLOCK);
    // Growing is safe while open, and the handle goes on.
    let grown = pool
        .resize_volume("vm", 32 * BLOCK, Shrink::KeepData)
        .unwrap();
    assert_eq!(
        (grown.volume.size_bytes, grown.unmapped_blocks),
        (32 * BLOCK, 0)
    );
    let mut read = vec![0u8; BLOCK as usize];
    vm.read(12 * BLOCK, &mut read).unwrap();
    assert_eq!(read, pattern(1, BLOCK));
    vm.write(31 * BLOCK, &pattern(2, BLOCK), false).unwrap();
    // Closed: the shrink goes ahead.
    drop(vm);
    let shrunk = pool
        .resize_volume("vm", 8 * BLOCK, Shrink::DropData)
        .unwrap();
    assert_eq!(shrunk.unmapped_blocks, 2);
    assert_eq!(content(&pool, "vm"), vec![0u8; 8 * BLOCK as usize]);
    pool.verify_index().unwrap();
}

/// One volume's shrinks against the model: refused past mapped data without the policy
/// (nothing changes), allowed past unmapped blocks only, then forced.
fn shrink_against_model(pool: &Pool, name: &str, model: &mut Vec<u8>) {
    let size = model.len() as u64;
    assert_eq!(size, 16 * BLOCK, "the volume maps blocks 0..8 and 10");
    let refused = pool
        .resize_volume(name, 4 * BLOCK, Shrink::KeepData)
        .unwrap_err();
    match &refused {
        Error::ShrinkWouldUnmap {
            volume,
            size_bytes,
            new_size_bytes,
            mapped_blocks,
            mapped_bytes,
        } => {
            assert_eq!(volume, name);
            assert_eq!((*size_bytes, *new_size_bytes), (size, 4 * BLOCK));
            assert_eq!((*mapped_blocks, *mapped_bytes), (5, 5 * BLOCK));
        }
        other => panic!("{name}: {other}"),
    }
    assert!(
        refused.to_string().contains(&(5 * BLOCK).to_string()),
        "{refused}"
    );
    assert_eq!(
        pool.info(name).unwrap().size_bytes,
        size,
        "a refusal changes nothing"
    );
    assert_eq!(&content(pool, name), model);
    // Past unmapped blocks only (11..16): no policy needed.
    let tail = pool
        .resize_volume(name, 11 * BLOCK, Shrink::KeepData)
        .unwrap();
    assert_eq!((tail.unmapped_blocks, tail.unmapped_bytes), (0, 0));
    model.truncate(11 * BLOCK as usize);
    assert_eq!(&content(pool, name), model);
    // Forced: unmaps blocks 4..8 and 10, says so, and keeps 0..4 as they were.
    let forced = pool
        .resize_volume(name, 4 * BLOCK, Shrink::DropData)
        .unwrap();
    assert_eq!(
        (forced.unmapped_blocks, forced.unmapped_bytes),
        (5, 5 * BLOCK)
    );
    assert_eq!(forced.volume.size_bytes, 4 * BLOCK);
    assert_eq!(forced.volume.mapped_blocks, 4);
    model.truncate(4 * BLOCK as usize);
    assert_eq!(&content(pool, name), model);
    // Grown again: what the shrink dropped reads as zeros.
    pool.resize_volume(name, 16 * BLOCK, Shrink::KeepData)
        .unwrap();
    model.resize(16 * BLOCK as usize, 0);
    assert_eq!(&content(pool, name), model);
}

#[test]
fn a_shrink_past_mapped_data_needs_drop_data_and_keeps_the_rest() {
    let parts = parts();
    let pool = parts.format(BLOCK, deterministic_options());
    pool.create_volume("vm", 16 * BLOCK).unwrap();
    let mut vm_model = vec![0u8; 16 * BLOCK as usize];
    {
        let vm = pool.volume("vm").unwrap();
        let data = pattern(3, 8 * BLOCK);
        vm.write(0, &data, false).unwrap();
        vm_model[..data.len()].copy_from_slice(&data);
        pool.commit().unwrap();
    }
    pool.snapshot("vm", "snap", false).unwrap();
    let mut snap_model = vm_model.clone();
    // Each gets a block 10 of its own; the snapshot is not opened again (no index: the
    // shrink counts its tree).
    for (name, model, seed) in [("vm", &mut vm_model, 4), ("snap", &mut snap_model, 5)] {
        pool.volume(name)
            .unwrap()
            .write(10 * BLOCK, &pattern(seed, BLOCK), false)
            .unwrap();
        model[10 * BLOCK as usize..11 * BLOCK as usize].copy_from_slice(&pattern(seed, BLOCK));
    }
    pool.commit().unwrap();
    drop(pool);
    let pool = parts.reopen(deterministic_options());
    assert!(!pool.index_built("snap").unwrap());
    shrink_against_model(&pool, "snap", &mut snap_model);
    // A write of block 9 not committed (queued: the shrink counts it through the index).
    {
        let vm = pool.volume("vm").unwrap();
        vm.write(9 * BLOCK, &pattern(6, 512), false).unwrap();
        vm_model[9 * BLOCK as usize..9 * BLOCK as usize + 512].copy_from_slice(&pattern(6, 512));
    }
    let refused = pool
        .resize_volume("vm", 4 * BLOCK, Shrink::KeepData)
        .unwrap_err();
    assert!(
        matches!(
            refused,
            Error::ShrinkWouldUnmap {
                mapped_blocks: 6,
                ..
            }
        ),
        "blocks 4..8, 9 and 10: {refused}"
    );
    // Block 9 goes (discarded, queued too) so that vm maps what the helper expects.
    pool.volume("vm")
        .unwrap()
        .discard(9 * BLOCK, BLOCK)
        .unwrap();
    vm_model[9 * BLOCK as usize..10 * BLOCK as usize].fill(0);
    shrink_against_model(&pool, "vm", &mut vm_model);
    pool.verify_index().unwrap();
    pool.commit().unwrap();
    drop(pool);
    let pool = parts.reopen(deterministic_options());
    assert_eq!(content(&pool, "vm"), vm_model);
    assert_eq!(content(&pool, "snap"), snap_model);
    pool.verify_index().unwrap();
}
