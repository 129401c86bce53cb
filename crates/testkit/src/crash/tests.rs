//! Crash semantics: what survives a power cut in each mode, and when the power goes out.

use super::*;
use rand::rngs::StdRng;
use rand::SeedableRng;

fn filled(byte: u8) -> Block {
    [byte; BLOCK_SIZE]
}

fn read(device: &dyn BlockDevice, block: u64) -> Block {
    let mut buf = [0u8; BLOCK_SIZE];
    device.read(MetadataBlock::new(block), &mut buf).unwrap();
    buf
}

#[test]
fn reads_see_unflushed_writes() {
    let device = CrashDevice::new(4);
    device.write(MetadataBlock::new(1), &filled(7)).unwrap();
    assert_eq!(read(&device, 1), filled(7));
    assert_eq!(read(&device, 2), filled(0));
}

#[test]
fn unflushed_write_is_lost_in_drop_all() {
    let device = CrashDevice::new(4);
    device.write(MetadataBlock::new(1), &filled(1)).unwrap();
    device.flush().unwrap();
    device.write(MetadataBlock::new(1), &filled(2)).unwrap();
    device.write(MetadataBlock::new(2), &filled(3)).unwrap();
    let mut rng = StdRng::seed_from_u64(1);
    let image = device.crash_image(CrashMode::DropAll, &mut rng);
    assert_eq!(read(&image, 1), filled(1));
    assert_eq!(read(&image, 2), filled(0));
    assert_eq!(read(&device.snapshot_durable(), 1), filled(1));
    assert_eq!(read(&device.snapshot_current(), 1), filled(2));
}

#[test]
fn flushed_writes_survive_every_mode() {
    let device = CrashDevice::new(4);
    device.write(MetadataBlock::new(0), &filled(9)).unwrap();
    device.write(MetadataBlock::new(3), &filled(8)).unwrap();
    device.flush().unwrap();
    assert_eq!(device.volatile_write_count(), 0);
    let mut rng = StdRng::seed_from_u64(2);
    for mode in CrashMode::ALL {
        for _ in 0..20 {
            let image = device.crash_image(mode, &mut rng);
            assert_eq!(read(&image, 0), filled(9), "{mode:?}");
            assert_eq!(read(&image, 3), filled(8), "{mode:?}");
        }
    }
}

#[test]
fn random_subset_keeps_and_drops_writes_independently() {
    let device = CrashDevice::new(2);
    device.write(MetadataBlock::new(0), &filled(1)).unwrap();
    device.write(MetadataBlock::new(0), &filled(2)).unwrap();
    let mut rng = StdRng::seed_from_u64(3);
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..200 {
        let image = device.crash_image(CrashMode::KeepRandomSubset, &mut rng);
        let block = read(&image, 0);
        assert!(
            block.iter().all(|&b| b == block[0]),
            "no tearing in this mode"
        );
        seen.insert(block[0]);
    }
    // Neither, the first only (the second was "reordered" before it and lost), the second.
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![0, 1, 2]);
}

#[test]
fn torn_write_mixes_old_and_new_sectors() {
    let device = CrashDevice::new(2);
    device.write(MetadataBlock::new(1), &filled(0xAA)).unwrap();
    device.flush().unwrap();
    device.write(MetadataBlock::new(1), &filled(0xBB)).unwrap();
    let mut rng = StdRng::seed_from_u64(4);
    let mut torn_seen = 0;
    for _ in 0..200 {
        let image = device.crash_image(CrashMode::Tear, &mut rng);
        let block = read(&image, 1);
        let new_sectors = block
            .chunks(SECTOR_SIZE)
            .take_while(|sector| sector.iter().all(|&b| b == 0xBB))
            .count();
        // A prefix of new sectors, then only old sectors: never a sector mixing both.
        for sector in block.chunks(SECTOR_SIZE).skip(new_sectors) {
            assert!(
                sector.iter().all(|&b| b == 0xAA),
                "sector is old or new, never mixed"
            );
        }
        if new_sectors > 0 && new_sectors < SECTORS_PER_BLOCK {
            torn_seen += 1;
        }
    }
    assert!(
        torn_seen > 0,
        "Tear mode produced no torn block in 200 tries"
    );
}

#[test]
fn crash_image_is_reproducible_from_the_seed() {
    let device = CrashDevice::new(16);
    for block in 0..16u8 {
        device
            .write(MetadataBlock::new(u64::from(block)), &filled(block + 1))
            .unwrap();
    }
    let a = device.crash_image(CrashMode::Tear, &mut StdRng::seed_from_u64(5));
    let b = device.crash_image(CrashMode::Tear, &mut StdRng::seed_from_u64(5));
    assert_eq!(a.to_bytes(), b.to_bytes());
}

#[test]
fn power_cut_fails_the_operation_after_the_nth() {
    let device = CrashDevice::new(4);
    device.set_power_cut_after(Some(2));
    device.write(MetadataBlock::new(0), &filled(1)).unwrap();
    device.flush().unwrap();
    assert!(!device.is_power_cut());
    assert!(device.write(MetadataBlock::new(1), &filled(2)).is_err());
    assert!(device.is_power_cut());
    // Everything fails from now on, reads included.
    assert!(device.flush().is_err());
    let mut buf = [0u8; BLOCK_SIZE];
    assert!(device.read(MetadataBlock::new(0), &mut buf).is_err());
    assert_eq!(device.operation_count(), 2);
    let image = device.crash_image(CrashMode::KeepRandomSubset, &mut StdRng::seed_from_u64(6));
    assert_eq!(read(&image, 0), filled(1));
    assert_eq!(
        read(&image, 1),
        filled(0),
        "the failed write never happened"
    );
}

#[test]
fn power_cut_at_zero_fails_the_first_flush() {
    let device = CrashDevice::new(1);
    device.set_power_cut_after(Some(0));
    assert!(device.flush().is_err());
}

#[test]
fn counting_run_then_crash_at_every_operation() {
    // The intended workflow: count a workload's operations, then cut at each point.
    fn workload(device: &CrashDevice) -> io::Result<()> {
        for round in 0..3u8 {
            device.write(MetadataBlock::new(u64::from(round)), &filled(round + 1))?;
            device.write(MetadataBlock::new(3), &filled(round + 10))?;
            device.flush()?;
        }
        Ok(())
    }
    let counting = CrashDevice::new(4);
    workload(&counting).unwrap();
    assert_eq!(counting.write_count(), 6);
    assert_eq!(counting.flush_count(), 3);
    let total = counting.operation_count();
    for cut in 0..total {
        let device = CrashDevice::new(4);
        device.set_power_cut_after(Some(cut));
        assert!(
            workload(&device).is_err(),
            "cut after {cut} must fail the workload"
        );
        let image = device.crash_image(CrashMode::DropAll, &mut StdRng::seed_from_u64(cut));
        let completed_rounds = device.flush_count();
        assert_eq!(
            read(&image, 3)[0],
            if completed_rounds == 0 {
                0
            } else {
                completed_rounds as u8 + 9
            }
        );
    }
    let device = CrashDevice::new(4);
    device.set_power_cut_after(Some(total));
    workload(&device).unwrap();
}

#[test]
fn from_device_starts_durable() {
    let source = MemoryDevice::new(3);
    source.write(MetadataBlock::new(2), &filled(5)).unwrap();
    let device = CrashDevice::from_device(&source).unwrap();
    let image = device.crash_image(CrashMode::DropAll, &mut StdRng::seed_from_u64(7));
    assert_eq!(read(&image, 2), filled(5));
    assert_eq!(image.block_count(), 3);
}

#[test]
fn out_of_range_is_invalid_input() {
    let device = CrashDevice::new(2);
    let mut buf = [0u8; BLOCK_SIZE];
    let err = device.read(MetadataBlock::new(2), &mut buf).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    let err = device
        .write(MetadataBlock::new(u64::MAX), &buf)
        .unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
}
