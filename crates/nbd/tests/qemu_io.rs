//! Goal: qemu 10's block layer (which asks for extended headers, uses GO with block sizes,
//! BLOCK_STATUS with REQ_ONE, WRITE_ZEROES with and without NO_HOLE, TRIM, FLUSH) reads back
//! exactly what it wrote through our server.
//! Method: run `qemu-io` scripts of write/read patterns (`-P` verification) at aligned and
//! unaligned offsets, `write -z`, `write -z -u`, `discard`, `flush`, then check the same bytes
//! directly in the MemoryExport.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use nbd::{Export, MemoryExport};

const TIMEOUT: Duration = Duration::from_secs(30);

fn qemu_io(server: &TestServer, commands: &[&str]) -> String {
    let uri = server.uri("disk");
    let mut args = vec!["-f", "raw"];
    for command in commands {
        args.push("-c");
        args.push(command);
    }
    args.push(&uri);
    let output = run_ok("qemu-io", &args, TIMEOUT);
    for bad in ["fail", "error", "Error"] {
        assert!(
            !output.contains(bad),
            "qemu-io reported a failure:\n{output}"
        );
    }
    output
}

#[test]
fn qemu_io_write_read_patterns_round_trip() {
    require_tool("qemu-io", "qemu-utils");
    let disk = Arc::new(MemoryExport::new("disk", 64 * MIB));
    let server = TestServer::start(vec![disk.clone()]);
    qemu_io(
        &server,
        &[
            "write -P 0xab 0 1M",
            "write -P 0xcd 1M 64k",
            "write -P 0x11 5000 3000",
            "write -P 0x22 33M 2M",
            "flush",
            "read -P 0xab 0 4096",
            "read -P 0x11 5000 3000",
            "read -P 0xab 8000 1040384",
            "read -P 0xcd 1M 64k",
            "read -P 0x22 33M 2M",
            "read -P 0 2M 1M",
        ],
    );
    let mut buffer = vec![0u8; 3000];
    disk.read_at(5000, &mut buffer).unwrap();
    assert!(buffer.iter().all(|&b| b == 0x11));
    let mut buffer = vec![0u8; 2 * MIB as usize];
    disk.read_at(33 * MIB, &mut buffer).unwrap();
    assert!(buffer.iter().all(|&b| b == 0x22));
    assert!(disk.flush_count() >= 1);
}

#[test]
fn qemu_io_zeroes_and_discards() {
    require_tool("qemu-io", "qemu-utils");
    let disk = Arc::new(MemoryExport::new("disk", 16 * MIB));
    let server = TestServer::start(vec![disk.clone()]);
    qemu_io(
        &server,
        &[
            "write -P 0x5a 0 8M",
            "write -z 0 1M",
            "write -z -u 2M 1M",
            "discard 4M 1M",
            "write -z 6M 4k",
            "read -P 0 0 1M",
            "read -P 0x5a 1M 1M",
            "read -P 0 2M 1M",
            "read -P 0x5a 3M 1M",
            "read -P 0 6M 4k",
            "read -P 0x5a 7M 1M",
        ],
    );
    let mut buffer = vec![0u8; MIB as usize];
    disk.read_at(2 * MIB, &mut buffer).unwrap();
    assert!(buffer.iter().all(|&b| b == 0));
    // `write -z -u` and discard of whole 64 KiB blocks unmap them.
    let extents = disk.block_status(2 * MIB, MIB, 16).unwrap();
    assert!(extents.iter().all(|extent| extent.hole), "{extents:?}");
    let extents = disk.block_status(4 * MIB, MIB, 16).unwrap();
    assert!(extents.iter().all(|extent| extent.hole), "{extents:?}");
}

#[test]
fn qemu_io_many_requests_in_flight() {
    require_tool("qemu-io", "qemu-utils");
    let disk = Arc::new(MemoryExport::new("disk", 32 * MIB));
    let server = TestServer::start(vec![disk.clone()]);
    // aio_write/aio_read keep several requests in flight on one connection.
    let mut commands = Vec::new();
    for index in 0..32u64 {
        commands.push(format!(
            "aio_write -P {} {} 256k",
            index + 1,
            index * 256 * 1024
        ));
    }
    commands.push("aio_flush".into());
    for index in 0..32u64 {
        commands.push(format!(
            "aio_read -P {} {} 256k",
            index + 1,
            index * 256 * 1024
        ));
    }
    commands.push("aio_flush".into());
    let commands: Vec<&str> = commands.iter().map(String::as_str).collect();
    qemu_io(&server, &commands);
    for index in 0..32u64 {
        let mut buffer = vec![0u8; 256 * 1024];
        disk.read_at(index * 256 * 1024, &mut buffer).unwrap();
        assert!(buffer.iter().all(|&b| b == index as u8 + 1));
    }
}
