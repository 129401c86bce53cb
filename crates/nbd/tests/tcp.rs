//! Goal: the server works over TCP (127.0.0.1, port 0) with real clients.
//! Method: listen on 127.0.0.1:0, run `nbdinfo --map` and a `qemu-io` write/read pattern
//! script against nbd://127.0.0.1:PORT/disk, and check the export's contents directly.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use nbd::{Config, Export, ExportMap, MemoryExport, Server};

#[test]
fn nbdinfo_and_qemu_io_over_tcp() {
    require_tool("nbdinfo", "libnbd-bin");
    require_tool("qemu-io", "qemu-utils");
    let disk = Arc::new(MemoryExport::new("disk", 16 * MIB));
    let exports = Arc::new(ExportMap::new());
    exports.insert(disk.clone());
    let mut server = Server::new(exports, Config::default());
    let address = server.listen_tcp("127.0.0.1:0").unwrap();
    assert_ne!(address.port(), 0);
    let uri = format!("nbd://127.0.0.1:{}/disk", address.port());
    run_ok(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0x42 1M 1M",
            "-c",
            "read -P 0x42 1M 1M",
            "-c",
            "read -P 0 0 1M",
            &uri,
        ],
        Duration::from_secs(20),
    );
    let map = run_ok("nbdinfo", &["--map", &uri], Duration::from_secs(20));
    assert!(map.contains("1048576     1048576    0  data"), "{map}");
    let mut buffer = vec![0u8; MIB as usize];
    disk.read_at(MIB, &mut buffer).unwrap();
    assert!(buffer.iter().all(|&b| b == 0x42));
    server.shutdown();
}
