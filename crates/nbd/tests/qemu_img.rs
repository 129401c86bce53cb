//! Goal: `qemu-img info`, `map` and `convert` (qemu's block-status walk with REQ_ONE, and its
//! FAST_ZERO pre-zeroing of the target) work against our server.
//! Method: a source export with a known sparse layout; check `info --output=json` size,
//! `map --output=json` data/zero ranges, then `convert -n` export-to-export and
//! export-to-file, and compare bytes and allocation.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use nbd::{Export, MemoryExport};

const TIMEOUT: Duration = Duration::from_secs(30);

fn source() -> Arc<MemoryExport> {
    let source = MemoryExport::new("source", 32 * MIB);
    source
        .write_at(0, &pattern(1, MIB as usize), false)
        .unwrap();
    source
        .write_at(10 * MIB, &pattern(2, 3 * MIB as usize), false)
        .unwrap();
    source
        .write_at(31 * MIB, &pattern(3, 512 * 1024), false)
        .unwrap();
    Arc::new(source)
}

fn map(server: &TestServer, name: &str) -> Vec<(u64, u64, bool)> {
    testkit::qemu_img::map(&server.uri(name))
}

#[test]
fn qemu_img_info_and_map() {
    require_tool("qemu-img", "qemu-utils");
    let server = TestServer::start(vec![source()]);
    let uri = server.uri("source");
    let info = run_ok("qemu-img", &["info", "--output=json", &uri], TIMEOUT);
    assert!(info.contains("\"virtual-size\": 33554432"), "{info}");
    let expected = vec![
        (0, MIB, true),
        (MIB, 9 * MIB, false),
        (10 * MIB, 3 * MIB, true),
        (13 * MIB, 18 * MIB, false),
        (31 * MIB, 512 * 1024, true),
        (31 * MIB + 512 * 1024, 512 * 1024, false),
    ];
    assert_eq!(map(&server, "source"), expected);
}

#[test]
fn qemu_img_convert_between_exports_and_to_a_file() {
    require_tool("qemu-img", "qemu-utils");
    let source = source();
    let target = Arc::new(MemoryExport::new("target", 32 * MIB));
    // Junk in the target must be zeroed by the copy.
    target.write_at(20 * MIB, &[0xee; 4096], false).unwrap();
    let server = TestServer::start(vec![source.clone(), target.clone()]);
    testkit::qemu_img::convert_into(&server.uri("source"), &server.uri("target"));
    let mut expected = vec![0u8; 32 * MIB as usize];
    let mut actual = vec![0u8; 32 * MIB as usize];
    source.read_at(0, &mut expected).unwrap();
    target.read_at(0, &mut actual).unwrap();
    assert!(expected == actual, "target differs from source");
    // The holes of the source stay holes in the target (sparse copy).
    let data: u64 = map(&server, "target")
        .iter()
        .filter(|entry| entry.2)
        .map(|entry| entry.1)
        .sum();
    assert!(data <= 5 * MIB, "target has {data} data bytes");
    testkit::qemu_img::compare(&server.uri("source"), &server.uri("target"));
    let file = server.dir.join("copy.raw");
    testkit::qemu_img::convert_to_file(&server.uri("source"), &file);
    assert!(std::fs::read(file).unwrap() == expected);
}
