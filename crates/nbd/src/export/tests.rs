//! Unit tests for export.rs: the memory export's allocation map and the export map.

use super::*;

fn export() -> MemoryExport {
    MemoryExport::new("m", 1 << 20).with_block_size(4096)
}

#[test]
fn new_export_is_one_hole() {
    let export = export();
    let extents = export.block_status(0, 1 << 20, 100).unwrap();
    assert_eq!(
        extents,
        vec![Extent {
            length_bytes: 1 << 20,
            hole: true,
            zero: true
        }]
    );
    let mut buffer = vec![1u8; 8192];
    export.read_at(4096, &mut buffer).unwrap();
    assert!(buffer.iter().all(|&b| b == 0));
}

#[test]
fn partial_write_allocates_one_block_and_reads_back() {
    let export = export();
    export.write_at(4096 + 512, &[7u8; 512], false).unwrap();
    assert_eq!(export.allocated_block_count(), 1);
    let mut buffer = vec![0u8; 4096];
    export.read_at(4096, &mut buffer).unwrap();
    assert!(buffer[..512].iter().all(|&b| b == 0));
    assert!(buffer[512..1024].iter().all(|&b| b == 7));
    assert!(buffer[1024..].iter().all(|&b| b == 0));
    let extents = export.block_status(0, 3 * 4096, 10).unwrap();
    assert_eq!(extents.len(), 3);
    assert!(!extents[1].hole && !extents[1].zero);
}

#[test]
fn trim_and_write_zeroes_make_holes_only_for_whole_blocks() {
    let export = export();
    export.write_at(0, &[1u8; 3 * 4096], false).unwrap();
    export.trim(512, 3 * 4096 - 1024, false).unwrap();
    assert_eq!(export.allocated_block_count(), 2);
    let options = ZeroOptions {
        may_trim: true,
        ..Default::default()
    };
    export.write_zeroes(0, 512, options).unwrap();
    let mut buffer = vec![9u8; 1024];
    export.read_at(0, &mut buffer).unwrap();
    assert!(buffer[..512].iter().all(|&b| b == 0));
    assert!(buffer[512..].iter().all(|&b| b == 1));
    export.write_zeroes(0, 3 * 4096, options).unwrap();
    assert_eq!(export.allocated_block_count(), 0);
}

#[test]
fn no_hole_zeroing_leaves_blocks_allocated_zero() {
    let export = export();
    export
        .write_zeroes(0, 8192, ZeroOptions::default())
        .unwrap();
    assert_eq!(export.allocated_block_count(), 2);
    let extents = export.block_status(0, 8192, 10).unwrap();
    assert_eq!(
        extents,
        vec![Extent {
            length_bytes: 8192,
            hole: false,
            zero: true
        }]
    );
}

#[test]
fn fast_zero_refuses_partial_data_blocks_and_changes_nothing() {
    let export = export();
    export.write_at(0, &[5u8; 4096], false).unwrap();
    let fast = ZeroOptions {
        may_trim: true,
        fast: true,
        fua: false,
    };
    let error = export.write_zeroes(0, 1024, fast).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::NotSupported);
    let mut buffer = vec![0u8; 4096];
    export.read_at(0, &mut buffer).unwrap();
    assert!(buffer.iter().all(|&b| b == 5));
    export.write_zeroes(0, 4096, fast).unwrap();
    assert_eq!(export.allocated_block_count(), 0);
}

#[test]
fn block_status_respects_extents_max() {
    let export = export();
    for block in (0..16).step_by(2) {
        export.write_at(block * 4096, &[1u8; 4096], false).unwrap();
    }
    let extents = export.block_status(0, 16 * 4096, 3).unwrap();
    assert_eq!(extents.len(), 3);
    assert_eq!(
        extents.iter().map(|e| e.length_bytes).sum::<u64>(),
        3 * 4096
    );
}

#[test]
fn read_only_refuses_writes_and_faults_are_reported() {
    let export = MemoryExport::new("r", 8192).with_read_only(true);
    let error = export.write_at(0, &[0u8; 512], false).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::PermissionDenied);
    export.set_fault(Some(ErrorKind::NoSpace));
    let mut buffer = [0u8; 512];
    assert_eq!(
        export.read_at(0, &mut buffer).unwrap_err().kind(),
        ErrorKind::NoSpace
    );
    export.set_fault(None);
    export.read_at(0, &mut buffer).unwrap();
}

#[test]
fn export_map_opens_by_name_and_default() {
    let map = ExportMap::new();
    map.insert(Arc::new(
        MemoryExport::new("a", 512).with_description("first"),
    ));
    map.insert(Arc::new(MemoryExport::new("b", 512)));
    assert!(map.open("").unwrap().is_none());
    map.set_default(Some("b".into()));
    assert_eq!(map.open("").unwrap().unwrap().name(), "b");
    assert_eq!(map.open("a").unwrap().unwrap().description(), "first");
    assert!(map.open("zzz").unwrap().is_none());
    assert_eq!(map.list().len(), 2);
    map.remove("a");
    assert_eq!(map.list().len(), 1);
}
