use super::*;
use thin_pool::testing::memory_pool;

const MIB: u64 = 1 << 20;

fn target(size: u64) -> (thin_pool::Pool, VolumeTarget) {
    let pool = memory_pool();
    pool.create_volume("v", size).unwrap();
    let target = VolumeTarget::new(pool.volume("v").unwrap());
    (pool, target)
}

#[test]
fn requests_reach_the_volume_and_errors_carry_the_engine_errno() {
    let (pool, target) = target(4 * MIB);
    let geometry = target.geometry();
    assert_eq!(geometry.size_bytes, 4 * MIB);
    assert_eq!(geometry.block_size_bytes, pool.block_size_bytes());
    assert!(!geometry.read_only);
    target.write(4096, &[7u8; 4096], true).unwrap();
    let mut back = vec![1u8; 8192];
    target.read(0, &mut back).unwrap();
    assert!(back[..4096].iter().all(|&b| b == 0));
    assert!(back[4096..].iter().all(|&b| b == 7));
    let past = target.read(4 * MIB, &mut back).unwrap_err();
    assert_eq!(past.errno(), libc::EINVAL, "{past}");
    let unaligned = target.write(100, &[1u8; 512], false).unwrap_err();
    assert_eq!(unaligned.errno(), libc::EINVAL, "{unaligned}");
    target.discard(0, 4 * MIB, true).unwrap();
    target.read(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0));
    drop(target);
    pool.close().unwrap();
}

#[test]
fn fast_zeroing_is_refused_when_it_would_write_data() {
    let (pool, target) = target(4 * MIB);
    let block = target.geometry().block_size_bytes;
    target.write(0, &[9u8; 4096], false).unwrap();
    let fast = ZeroMode {
        may_unmap: true,
        fast: true,
        fua: false,
    };
    // The first block is mapped and only part of it is zeroed: data writes needed.
    let refused = target.write_zeroes(512, 1024, fast).unwrap_err();
    assert!(refused.is_not_supported(), "{refused}");
    let mut back = vec![0u8; 4096];
    target.read(0, &mut back).unwrap();
    assert!(
        back.iter().all(|&b| b == 9),
        "a refused fast zero changed data"
    );
    // Whole blocks unmap without data I/O.
    target.write_zeroes(0, 2 * block, fast).unwrap();
    let status = target.block_status(0, 2 * block, 8).unwrap();
    assert_eq!(
        status,
        vec![Extent {
            length_bytes: 2 * block,
            mapped: false
        }]
    );
    drop(target);
    pool.close().unwrap();
}

#[test]
fn an_attached_volume_counts_as_open() {
    let (pool, target) = target(4 * MIB);
    let error = pool.delete_volume("v").unwrap_err();
    assert_eq!(error.errno(), libc::EBUSY, "{error}");
    drop(target);
    pool.delete_volume("v").unwrap();
    pool.close().unwrap();
}

#[test]
fn lent_reads_and_writes_give_the_bytes_reads_and_writes_give_and_return_the_callers_error() {
    let dir = std::env::temp_dir().join(format!("frontend-lent-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let pool = thin_pool::testing::dir_pool(
        &dir.join("pool"),
        16 * MIB,
        thin_pool::testing::deterministic_options(),
    );
    pool.create_volume("v", 4 * MIB).unwrap();
    let on_file = VolumeTarget::new(pool.volume("v").unwrap());
    std::fs::write(dir.join("img"), vec![0u8; MIB as usize]).unwrap();
    let file = FileTarget::open("raw", &dir.join("img"), false).unwrap();
    for target in [&on_file as &dyn Target, &file] {
        target.write(8192, &[7u8; 8192], false).unwrap();
        let mut lent = Vec::new();
        let done = target
            .read_lent(4096, 16384, &mut |piece| {
                let at = lent.len();
                lent.resize(at + piece.length_bytes() as usize, 0);
                if let LentPiece::File { file, offset, .. } = piece {
                    std::os::unix::fs::FileExt::read_exact_at(file, &mut lent[at..], offset)
                        .unwrap();
                }
                Ok(())
            })
            .unwrap();
        assert!(done, "{}: lends", target.name());
        let mut read = vec![0u8; 16384];
        target.read(4096, &mut read).unwrap();
        assert!(
            lent == read,
            "{}: lent bytes differ from a read",
            target.name()
        );
        let failed = target
            .read_lent(0, 4096, &mut |_| {
                Err(TargetError::new(libc::EFAULT, "guest"))
            })
            .unwrap_err();
        assert_eq!(failed.errno(), libc::EFAULT, "{}", target.name());
        let past = target.read_lent(4 * MIB, 512, &mut |_| Ok(())).unwrap_err();
        assert_eq!(past.errno(), libc::EINVAL, "{}", target.name());
        // A lent write over bytes written before (in place): all of it lent.
        let lent = target
            .write_lent(8192, 4096, true, &mut |piece| {
                let LentPiece::File { file, offset, .. } = piece else {
                    panic!("{}: a lent write gave {piece:?}", target.name());
                };
                std::os::unix::fs::FileExt::write_all_at(file, &[9u8; 4096], offset).unwrap();
                Ok(())
            })
            .unwrap();
        assert_eq!(lent, 4096, "{}", target.name());
        target.read(8192, &mut read[..4096]).unwrap();
        assert!(read[..4096].iter().all(|&b| b == 9), "{}", target.name());
    }
    drop(on_file);
    pool.close().unwrap();

    // A volume on a memory pool has no file to lend.
    let (pool, target) = target(MIB);
    assert!(!target.read_lent(0, 4096, &mut |_| Ok(())).unwrap());
    drop(target);
    pool.close().unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}
