//! Goal: a power cut at any write or flush of a revert (with and without deleting the
//! snapshot) or a rename leaves a pool that reopens either as it was before the operation
//! or as after it, never a mix (a catalog of one and metadata of the other), with metadata
//! our checker accepts.
//! Method: a small pool on a device pair sharing one power supply (`engine_kit`), set up
//! with flushed writes and a snapshot; a reference run counts the device operations of the
//! operation; then for every cut point the setup and the operation rerun with the power cut
//! there, and each crash mode's images are reopened and compared with both outcomes.

mod engine_kit;

use engine_kit::{check_metadata, CrashParts};
use rand::rngs::StdRng;
use rand::SeedableRng;
use std::collections::BTreeMap;
use testkit::crash::CrashMode;
use thin_pool::{Pool, PoolOptions};

const BLOCK: u64 = 65536;

/// Each volume's bytes.
type Contents = BTreeMap<String, Vec<u8>>;

#[derive(Clone, Copy, Debug)]
enum Operation {
    Revert { delete_snapshot: bool },
    Rename,
}

fn options() -> PoolOptions {
    thin_pool::testing::deterministic_options()
}

struct Rig {
    parts: CrashParts,
    pool: Pool,
}

/// The pool before the operation: vm (6 blocks written, 2 of them after the snapshot, and
/// grown), snap (its snapshot, 4 blocks).
fn rig() -> (Rig, Contents) {
    let parts = CrashParts::new(256, 64 * BLOCK);
    let pool = parts.format(BLOCK, options());
    pool.create_volume("vm", 8 * BLOCK).unwrap();
    let vm = pool.volume("vm").unwrap();
    let mut contents = Contents::new();
    let mut bytes = vec![0u8; 8 * BLOCK as usize];
    let first = testkit::pattern(1, 4 * BLOCK as usize);
    vm.write(0, &first, false).unwrap();
    bytes[..first.len()].copy_from_slice(&first);
    vm.flush().unwrap();
    drop(vm);
    pool.snapshot("vm", "snap", false).unwrap();
    contents.insert("snap".into(), bytes.clone());
    let vm = pool.volume("vm").unwrap();
    let second = testkit::pattern(2, 2 * BLOCK as usize);
    vm.write(3 * BLOCK, &second, false).unwrap();
    bytes[3 * BLOCK as usize..5 * BLOCK as usize].copy_from_slice(&second);
    vm.flush().unwrap();
    drop(vm);
    pool.resize_volume("vm", 10 * BLOCK, thin_pool::Shrink::DropData)
        .unwrap();
    bytes.resize(10 * BLOCK as usize, 0);
    contents.insert("vm".into(), bytes);
    let rig = Rig { parts, pool };
    (rig, contents)
}

fn after(before: &Contents, operation: Operation) -> Contents {
    let mut contents = before.clone();
    match operation {
        Operation::Revert { delete_snapshot } => {
            contents.insert("vm".into(), before["snap"].clone());
            if delete_snapshot {
                contents.remove("snap");
            }
        }
        Operation::Rename => {
            let vm = contents.remove("vm").unwrap();
            contents.insert("vm-renamed".into(), vm);
        }
    }
    contents
}

fn run(pool: &Pool, operation: Operation) -> thin_pool::Result<()> {
    match operation {
        Operation::Revert { delete_snapshot } => pool
            .revert_volume("vm", "snap", delete_snapshot)
            .map(|_| ()),
        Operation::Rename => pool.rename_volume("vm", "vm-renamed").map(|_| ()),
    }
}

fn read_all(pool: &Pool) -> Contents {
    pool.list()
        .into_iter()
        .map(|info| {
            let volume = pool.volume(&info.name).unwrap();
            let mut bytes = vec![0u8; info.size_bytes as usize];
            volume.read(0, &mut bytes).unwrap();
            (info.name, bytes)
        })
        .collect()
}

fn crash_everywhere(operation: Operation) -> usize {
    let (reference, before) = rig();
    let setup = reference.parts.power.operations();
    run(&reference.pool, operation).unwrap();
    let total = reference.parts.power.operations();
    assert_eq!(read_all(&reference.pool), after(&before, operation));
    drop(reference);
    assert!(total > setup, "{operation:?} wrote nothing");

    let mut images = 0;
    for cut in setup..=total {
        let (rig, before) = rig();
        rig.parts.power.set_cut_after(Some(cut));
        let result = run(&rig.pool, operation);
        for (m, mode) in CrashMode::ALL.into_iter().enumerate() {
            let mut rng = StdRng::seed_from_u64(cut.wrapping_mul(31) ^ m as u64);
            let image = rig.parts.image(mode, &mut rng);
            let context = format!("{operation:?}, cut after {cut} ({setup}..{total}), {mode:?}");
            check_metadata(image.metadata.clone(), None)
                .unwrap_or_else(|e| panic!("{context}: {e}"));
            let pool = image
                .try_reopen(options())
                .unwrap_or_else(|e| panic!("{context}: reopen: {e}"));
            let found = read_all(&pool);
            let expected_after = after(&before, operation);
            assert!(
                found == before || found == expected_after,
                "{context}: reopened with volumes {:?}, neither before nor after",
                found.keys().collect::<Vec<_>>()
            );
            if result.is_ok() {
                // Returned: durable (the cut came after the last write of the operation).
                assert!(
                    found == expected_after,
                    "{context}: a completed change was lost"
                );
            }
            pool.verify_index()
                .unwrap_or_else(|e| panic!("{context}: {e}"));
            images += 1;
        }
    }
    images
}

#[test]
fn power_cut_during_revert_leaves_before_or_after() {
    let images = crash_everywhere(Operation::Revert {
        delete_snapshot: false,
    }) + crash_everywhere(Operation::Revert {
        delete_snapshot: true,
    });
    eprintln!("{images} crash images reopened");
}

#[test]
fn power_cut_during_rename_leaves_before_or_after() {
    let images = crash_everywhere(Operation::Rename);
    eprintln!("{images} crash images reopened");
}
