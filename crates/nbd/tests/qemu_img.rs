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

/// (start, length, data) entries of `qemu-img map --output=json`, merged.
fn map(server: &TestServer, name: &str) -> Vec<(u64, u64, bool)> {
    let uri = server.uri(name);
    let output = run_ok(
        "qemu-img",
        &["map", "--output=json", "-f", "raw", &uri],
        TIMEOUT,
    );
    let mut entries: Vec<(u64, u64, bool)> = Vec::new();
    for line in output.lines().filter(|line| line.contains("\"start\"")) {
        let field = |key: &str| -> &str {
            let at = line.find(&format!("\"{key}\": ")).unwrap() + key.len() + 4;
            let rest = &line[at..];
            &rest[..rest.find([',', '}']).unwrap()]
        };
        let start: u64 = field("start").trim().parse().unwrap();
        let length: u64 = field("length").trim().parse().unwrap();
        let data = field("data").trim() == "true";
        match entries.last_mut() {
            Some(last) if last.2 == data && last.0 + last.1 == start => last.1 += length,
            _ => entries.push((start, length, data)),
        }
    }
    entries
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
    run_ok(
        "qemu-img",
        &[
            "convert",
            "-n",
            "-f",
            "raw",
            "-O",
            "raw",
            &server.uri("source"),
            &server.uri("target"),
        ],
        TIMEOUT,
    );
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
    run_ok(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            &server.uri("source"),
            &server.uri("target"),
        ],
        TIMEOUT,
    );
    let file = server.dir.join("copy.raw");
    let file = file.to_str().unwrap();
    run_ok(
        "qemu-img",
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            &server.uri("source"),
            file,
        ],
        TIMEOUT,
    );
    assert!(std::fs::read(file).unwrap() == expected);
}
