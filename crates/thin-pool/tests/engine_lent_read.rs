//! Goal: a lent read (`Volume::read_lent`) hands out exactly the bytes `Volume::read` gives:
//! its pieces, file ranges read with `pread` and runs of zeroes, cover the range in order,
//! none empty, adjacent runs merged (no two zero runs in a row, no two file ranges that
//! continue each other); a `Break` stops the walk; a pool whose data device has no file
//! lends nothing; bad ranges are refused as reads refuse them.
//! Method: a pool on files (its data device a file), a volume written at seeded random
//! places (some blocks left unmapped, some discarded) and snapshotted, then overwritten in
//! part (so its blocks are a mix of shared, own and unmapped); random ranges of both volumes
//! lent and rebuilt, compared with a byte model and with `Volume::read`. Lent writes
//! (`Volume::write_lent`): only the blocks overwritten in place (mapped, not shared) are
//! lent, from the start up to the first that is not; written through the pieces and the rest
//! with `Volume::write`, the volume holds the new bytes and its snapshot the old.

use std::ops::ControlFlow;
use std::os::unix::fs::FileExt;

use rand::Rng;
use thin_pool::testing::{deterministic_options, dir_pool, memory_pool};
use thin_pool::{LentPiece, Volume};

const MIB: u64 = 1 << 20;
const BLOCK: u64 = 64 << 10;
const SIZE: u64 = 4 * MIB;

/// Rebuilds `length` bytes at `offset` from the lent pieces, checking their shape.
fn lent_bytes(volume: &Volume, offset: u64, length: u64) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(length as usize);
    let mut last: Option<(bool, u64)> = None;
    let lent = volume
        .read_lent(offset, length, &mut |piece| {
            assert!(piece.length_bytes() > 0, "an empty piece");
            match piece {
                LentPiece::Zeroes { length_bytes } => {
                    assert!(!matches!(last, Some((false, _))), "two zero runs in a row");
                    bytes.resize(bytes.len() + length_bytes as usize, 0);
                    last = Some((false, 0));
                }
                LentPiece::File {
                    file,
                    offset,
                    length_bytes,
                } => {
                    assert!(
                        last != Some((true, offset)),
                        "a file range that continues the previous one was not merged"
                    );
                    let at = bytes.len();
                    bytes.resize(at + length_bytes as usize, 0);
                    file.read_exact_at(&mut bytes[at..], offset).unwrap();
                    last = Some((true, offset + length_bytes));
                }
            }
            ControlFlow::Continue(())
        })
        .unwrap();
    assert!(lent, "a pool on files lends");
    assert_eq!(bytes.len() as u64, length, "the pieces cover the range");
    bytes
}

fn range_in_volume(rng: &mut impl Rng) -> (u64, u64) {
    let offset = rng.gen_range(0..SIZE / 512) * 512;
    let length = rng.gen_range(1..=((SIZE - offset) / 512).min(2048)) * 512;
    (offset, length)
}

#[test]
fn lent_pieces_rebuild_what_a_read_gives() {
    let (_report, mut rng) = testkit::seeded_rng();
    let dir = std::env::temp_dir().join(format!("lent-read-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let pool = dir_pool(&dir.join("pool"), 64 * MIB, deterministic_options());
    pool.create_volume("origin", SIZE).unwrap();
    let origin = pool.volume("origin").unwrap();
    assert!(origin.can_lend());
    let mut model = vec![0u8; SIZE as usize];
    let write = |volume: &Volume, model: &mut Vec<u8>, rng: &mut rand::rngs::StdRng| {
        let (offset, length) = range_in_volume(rng);
        let length = length.min(256 << 10);
        let data: Vec<u8> = (0..length).map(|_| rng.gen::<u8>()).collect();
        volume.write(offset, &data, false).unwrap();
        model[offset as usize..(offset + length) as usize].copy_from_slice(&data);
    };
    for _ in 0..24 {
        write(&origin, &mut model, &mut rng);
    }
    for _ in 0..4 {
        let block = rng.gen_range(0..SIZE / BLOCK);
        origin.discard(block * BLOCK, BLOCK).unwrap();
        model[(block * BLOCK) as usize..((block + 1) * BLOCK) as usize].fill(0);
    }
    pool.snapshot("origin", "snap", false).unwrap();
    let snap = pool.volume("snap").unwrap();
    let snap_model = model.clone();
    for _ in 0..12 {
        write(&origin, &mut model, &mut rng);
    }
    for (volume, model) in [(&origin, &model), (&snap, &snap_model)] {
        let whole = lent_bytes(volume, 0, SIZE);
        assert!(whole == *model, "{volume:?}: the whole volume differs");
        for _ in 0..200 {
            let (offset, length) = range_in_volume(&mut rng);
            let lent = lent_bytes(volume, offset, length);
            let mut read = vec![0u8; length as usize];
            volume.read(offset, &mut read).unwrap();
            assert!(
                lent == read,
                "{volume:?}: lent {offset}+{length} differs from a read"
            );
            assert!(
                lent[..] == model[offset as usize..(offset + length) as usize],
                "{volume:?}: lent {offset}+{length} differs from the model"
            );
        }
    }

    // A Break stops the walk at once.
    let mut calls = 0;
    assert!(origin
        .read_lent(0, SIZE, &mut |_| {
            calls += 1;
            ControlFlow::Break(())
        })
        .unwrap());
    assert_eq!(calls, 1);
    // Refused as a read is: unaligned, past the end.
    for (offset, length) in [(1, 512), (0, 100), (SIZE - 512, 1024)] {
        let mut called = false;
        assert!(origin
            .read_lent(offset, length, &mut |_| {
                called = true;
                ControlFlow::Continue(())
            })
            .is_err());
        assert!(!called, "{offset}+{length}: refused, yet lent");
    }
    drop((origin, snap));
    pool.close().unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_pool_without_a_data_file_lends_nothing() {
    let pool = memory_pool();
    pool.create_volume("disk", MIB).unwrap();
    let volume = pool.volume("disk").unwrap();
    volume.write(0, &[5u8; 4096], false).unwrap();
    assert!(!volume.can_lend());
    let mut called = false;
    let lent = volume
        .read_lent(0, 4096, &mut |_| {
            called = true;
            ControlFlow::Continue(())
        })
        .unwrap();
    assert!(!lent && !called);
    drop(volume);
    pool.close().unwrap();
}

#[test]
fn a_lent_write_lends_the_blocks_overwritten_in_place_up_to_the_first_shared_one() {
    let dir = std::env::temp_dir().join(format!("lent-write-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let pool = dir_pool(&dir.join("pool"), 64 * MIB, deterministic_options());
    pool.create_volume("disk", MIB).unwrap();
    let disk = pool.volume("disk").unwrap();
    let old: Vec<u8> = (0..4 * BLOCK).map(|i| (i / 512) as u8).collect();
    disk.write(0, &old, false).unwrap();
    pool.snapshot("disk", "snap", true).unwrap();
    // Blocks 0 and 1 are the volume's own again; 2 and 3 still shared; 4 on unmapped.
    disk.write(0, &old[..2 * BLOCK as usize], false).unwrap();
    let new: Vec<u8> = (0..5 * BLOCK).map(|i| (i / 512) as u8 ^ 0xa5).collect();
    let (offset, length) = (512, 5 * BLOCK - 1024);
    let mut pieces = 0;
    let mut at = 0usize;
    let lent = disk
        .write_lent(offset, length, true, &mut |piece| {
            let LentPiece::File {
                file,
                offset: file_offset,
                length_bytes,
            } = piece
            else {
                panic!("a lent write gave {piece:?}");
            };
            let source = &new[offset as usize + at..][..length_bytes as usize];
            file.write_all_at(source, file_offset).unwrap();
            at += length_bytes as usize;
            pieces += 1;
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(lent, 2 * BLOCK - 512, "lent up to the first shared block");
    assert_eq!(at as u64, lent);
    assert!(pieces >= 1);
    let rest = offset + lent;
    disk.write(rest, &new[rest as usize..(offset + length) as usize], true)
        .unwrap();
    let mut expected = old.clone();
    expected.resize(5 * BLOCK as usize, 0);
    expected[offset as usize..(offset + length) as usize]
        .copy_from_slice(&new[offset as usize..(offset + length) as usize]);
    let mut got = vec![0u8; 5 * BLOCK as usize];
    disk.read(0, &mut got).unwrap();
    assert!(got == expected, "the volume holds the new bytes");
    let snap = pool.volume("snap").unwrap();
    let mut kept = vec![0u8; 4 * BLOCK as usize];
    snap.read(0, &mut kept).unwrap();
    assert!(kept == old, "the snapshot keeps the old bytes");
    // Nothing to lend on an unmapped block, nor on a read-only volume (refused).
    let none = disk
        .write_lent(8 * BLOCK, BLOCK, false, &mut |_| {
            panic!("lent an unmapped block")
        })
        .unwrap();
    assert_eq!(none, 0);
    assert!(snap
        .write_lent(0, BLOCK, false, &mut |_| panic!("lent a read-only block"))
        .is_err());
    drop((disk, snap));
    pool.close().unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}
