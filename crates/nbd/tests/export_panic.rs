//! Goal: an export that panics during a request fails that request alone: the client gets
//! EIO for it, the request's share of the connection's and the server's byte budgets is
//! released, and the connection keeps serving (issue 9: a panic used to leave the request
//! unanswered and its budget held forever).
//! Method: a memory export wrapped so that READ, WRITE, FLUSH and BLOCK_STATUS panic in a
//! poisoned range; a raw client sends more large panicking WRITEs than the connection's
//! byte budget could hold if none were released, each answered with EIO, then reads and
//! writes outside the range, on this connection and on a second one.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::*;
use nbd::{Config, Export, ExportMap, Extent, MemoryExport, Server, ZeroOptions};

const SIZE: u64 = 64 * MIB;
/// Requests touching `[POISON, SIZE)` panic.
const POISON: u64 = 32 * MIB;
const NBD_EIO: u32 = 5;

struct PanickingExport {
    inner: MemoryExport,
    panics: AtomicU64,
}

impl PanickingExport {
    fn check(&self, offset: u64, length: u64) {
        if offset + length > POISON {
            self.panics.fetch_add(1, Ordering::SeqCst);
            panic!("test export panics at offset {offset}");
        }
    }
}

impl Export for PanickingExport {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read_at(&self, offset: u64, buffer: &mut [u8]) -> nbd::Result<()> {
        self.check(offset, buffer.len() as u64);
        self.inner.read_at(offset, buffer)
    }
    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> nbd::Result<()> {
        self.check(offset, data.len() as u64);
        self.inner.write_at(offset, data, fua)
    }
    fn write_zeroes(&self, offset: u64, length: u64, options: ZeroOptions) -> nbd::Result<()> {
        self.check(offset, length);
        self.inner.write_zeroes(offset, length, options)
    }
    fn flush(&self) -> nbd::Result<()> {
        if self.inner.flush_count() % 2 == 1 {
            self.inner.flush()?;
            self.check(SIZE, 0);
        }
        self.inner.flush()
    }
    fn block_status(
        &self,
        offset: u64,
        length: u64,
        extents_max: usize,
    ) -> nbd::Result<Vec<Extent>> {
        self.check(offset, length);
        self.inner.block_status(offset, length, extents_max)
    }
}

#[test]
fn panicking_export_answers_eio_and_releases_budget() {
    let export = Arc::new(PanickingExport {
        inner: MemoryExport::new("disk", SIZE),
        panics: AtomicU64::new(0),
    });
    let map = Arc::new(ExportMap::new());
    map.insert(export.clone());
    let dir = ScratchDir::new("nbd-export-panic");
    let socket = dir.join("nbd.sock");
    let config = Config {
        bytes_in_flight_max: 8 * MIB,
        server_bytes_in_flight_max: 16 * MIB,
        ..Config::default()
    };
    let mut server = Server::new(map, config);
    server.listen_unix(&socket).unwrap();

    let (mut client, size, _, _) = Client::negotiate(&socket, "disk", Mode::Structured, false);
    assert_eq!(size, SIZE);
    let good = pattern(7, 1024 * 1024);
    client.write(0, &good);
    // 40 MiB of panicking 1 MiB writes: past both budgets unless each is released.
    let payload = vec![0xA5u8; MIB as usize];
    for i in 0..40 {
        let offset = POISON + (i % 16) * MIB;
        let reply = client
            .try_request(CMD_WRITE, offset, &payload)
            .unwrap_or_else(|e| panic!("write {i} at {offset} got no reply: {e}"));
        assert_eq!(reply.error, NBD_EIO, "write {i}: {reply:?}");
    }
    let reply = client.request(CMD_READ, 0, POISON, 4096, &[]);
    assert_eq!(reply.error, NBD_EIO, "read in the poisoned range");
    // Flush panics on every second call: one of two flushes fails, and both are answered.
    let flushes = [client.flush_errno(), client.flush_errno()];
    assert!(
        flushes.contains(&0) && flushes.contains(&NBD_EIO),
        "{flushes:?}"
    );
    assert!(export.panics.load(Ordering::SeqCst) >= 42);

    // The connection, and a new one, still serve.
    assert_eq!(client.read(0, good.len() as u64), good);
    client.write(MIB, &good);
    let (mut other, _, _, _) = Client::negotiate(&socket, "disk", Mode::Simple, false);
    assert_eq!(other.read(MIB, good.len() as u64), good);
    let reply = other.request(CMD_WRITE, 0, POISON, 4096, &[1u8; 4096]);
    assert_eq!(reply.error, NBD_EIO);
    assert_eq!(other.read(0, 4096), good[..4096]);
    client.disconnect();
    other.disconnect();
    server.shutdown();
}
