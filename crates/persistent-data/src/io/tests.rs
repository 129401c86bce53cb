//! One conformance suite run against every `BlockDevice` implementation.

use super::*;
use crate::block::BLOCK_SIZE;

fn conformance(device: &dyn BlockDevice) {
    let count = device.block_count();
    assert!(count >= 4);
    let mut buf = [0u8; BLOCK_SIZE];
    device.read(MetadataBlock::new(1), &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0), "a fresh device reads zeros");

    let mut pattern = [0u8; BLOCK_SIZE];
    for (i, byte) in pattern.iter_mut().enumerate() {
        *byte = (i * 7 + 3) as u8;
    }
    device.write(MetadataBlock::new(2), &pattern).unwrap();
    device.flush().unwrap();
    device.read(MetadataBlock::new(2), &mut buf).unwrap();
    assert_eq!(buf, pattern);
    device.read(MetadataBlock::new(3), &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0), "neighbouring block untouched");

    let err = device
        .read(MetadataBlock::new(count), &mut buf)
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    let err = device
        .write(MetadataBlock::new(u64::MAX), &pattern)
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
}

#[test]
fn memory_device_conforms() {
    conformance(&MemoryDevice::new(8));
}

#[test]
fn file_device_conforms() {
    let dir = std::env::temp_dir().join(format!("pd-io-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("metadata");
    let device = FileDevice::create(&path, 8).unwrap();
    conformance(&device);
    drop(device);
    let reopened = FileDevice::open(&path, false).unwrap();
    assert_eq!(reopened.block_count(), 8);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn file_device_create_and_open_no_follow_refuse_links() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("pd-io-link-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let victim = dir.join("victim");
    std::fs::write(&victim, b"keep").unwrap();
    let link = dir.join("metadata");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    assert!(FileDevice::create(&link, 8).is_err());
    assert!(FileDevice::open_no_follow(&link, true).is_err());
    assert!(
        FileDevice::open(&link, false).is_ok(),
        "user-named links are followed"
    );
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
    let path = dir.join("fresh");
    drop(FileDevice::create(&path, 8).unwrap());
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn memory_device_round_trips_bytes() {
    let device = MemoryDevice::new(3);
    let block = [0xabu8; BLOCK_SIZE];
    device.write(MetadataBlock::new(1), &block).unwrap();
    let copy = MemoryDevice::from_bytes(&device.to_bytes());
    let mut buf = [0u8; BLOCK_SIZE];
    copy.read(MetadataBlock::new(1), &mut buf).unwrap();
    assert_eq!(buf, block);
}

/// `read_blocks` reads what `read` reads, block by block, and refuses a run past the end.
fn read_blocks_conformance(device: &dyn BlockDevice) {
    let count = device.block_count();
    for b in 0..count {
        let block = [b as u8 ^ 0x5a; BLOCK_SIZE];
        device.write(MetadataBlock::new(b), &block).unwrap();
    }
    for (first, len) in [(0, count), (1, 3), (count - 1, 1), (2, 0)] {
        let mut blocks = vec![[0u8; BLOCK_SIZE]; len as usize];
        let mut bufs: Vec<&mut Block> = blocks.iter_mut().collect();
        device
            .read_blocks(MetadataBlock::new(first), &mut bufs)
            .unwrap();
        for (i, data) in blocks.iter().enumerate() {
            let mut one = [0u8; BLOCK_SIZE];
            device
                .read(MetadataBlock::new(first + i as u64), &mut one)
                .unwrap();
            assert_eq!(data[..], one[..], "block {} of run {first}+{len}", i);
        }
    }
    let mut blocks = vec![[0u8; BLOCK_SIZE]; 2];
    let mut bufs: Vec<&mut Block> = blocks.iter_mut().collect();
    let err = device
        .read_blocks(MetadataBlock::new(count - 1), &mut bufs)
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
}

#[test]
fn read_blocks_reads_runs_like_single_reads() {
    read_blocks_conformance(&MemoryDevice::new(9));
    let dir = std::env::temp_dir().join(format!("pd-io-runs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let device = FileDevice::create(&dir.join("metadata"), 9).unwrap();
    read_blocks_conformance(&device);
    // Through an Arc, as the block manager holds its device.
    read_blocks_conformance(&std::sync::Arc::new(device));
    std::fs::remove_dir_all(&dir).unwrap();
}
