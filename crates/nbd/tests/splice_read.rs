//! Goal: READ replies of an export that offers `Export::read_source` (sent by splice from its
//! file when large enough) carry exactly the file's bytes in every reply mode, for ranges on
//! and off page boundaries, larger than a pipe may grow, and many in flight at once; a file
//! that ends early makes the splice fall back to `read_at`, whose error reaches the client,
//! and the next replies carry no leftover bytes.
//! Method: a file export over a scratch file of random bytes, served on a Unix socket; the
//! raw client reads ranges and compares them with the file; then the file is cut short.
#![allow(clippy::big_endian_bytes)]

mod common;

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use common::*;
use nbd::{Config, Error, ErrorKind, Export, ExportMap, ReadSource, Server, SpliceReads};

const SIZE: u64 = 8 * MIB;

/// A file served as is, offering its bytes for splicing.
struct FileExport {
    file: File,
}

impl Export for FileExport {
    fn name(&self) -> &str {
        "file"
    }

    fn size_bytes(&self) -> u64 {
        SIZE
    }

    fn read_at(&self, offset: u64, buffer: &mut [u8]) -> nbd::Result<()> {
        self.file
            .read_exact_at(buffer, offset)
            .map_err(|error| Error::export(ErrorKind::Io, format!("read at {offset}: {error}")))
    }

    fn read_source(&self, offset: u64, _length: u64) -> Option<ReadSource<'_>> {
        Some(ReadSource {
            file: self.file.as_fd(),
            offset,
        })
    }

    fn write_at(&self, offset: u64, data: &[u8], _fua: bool) -> nbd::Result<()> {
        self.file
            .write_all_at(data, offset)
            .map_err(|error| Error::export(ErrorKind::Io, format!("write at {offset}: {error}")))
    }

    fn flush(&self) -> nbd::Result<()> {
        Ok(())
    }
}

struct Served {
    server: Option<Server>,
    socket: std::path::PathBuf,
    path: std::path::PathBuf,
    contents: Vec<u8>,
    _dir: ScratchDir,
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            server.shutdown();
        }
    }
}

fn serve_file() -> Served {
    let dir = ScratchDir::new("nbd-splice");
    let path = dir.join("disk.img");
    let contents = pattern(7, SIZE as usize);
    std::fs::write(&path, &contents).unwrap();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let map = Arc::new(ExportMap::new());
    map.insert(Arc::new(FileExport { file }));
    let socket = dir.join("nbd.sock");
    // The test's client speaks over a Unix socket, where splicing is off by default.
    let config = Config {
        splice_reads: SpliceReads::Always,
        ..Config::default()
    };
    let mut server = Server::new(map, config);
    server.listen_unix(&socket).unwrap();
    Served {
        server: Some(server),
        socket,
        path,
        contents,
        _dir: dir,
    }
}

fn expected(contents: &[u8], offset: u64, length: u64) -> &[u8] {
    &contents[offset as usize..(offset + length) as usize]
}

#[test]
fn spliced_reads_match_the_file_in_every_mode() {
    let served = serve_file();
    let mut contents = served.contents.clone();
    for mode in [Mode::Simple, Mode::Structured, Mode::Extended] {
        let (mut client, size, _, _) = Client::negotiate(&served.socket, "file", mode, false);
        assert_eq!(size, SIZE);
        // (offset, length): small (copied), page-aligned, off page boundaries (one pipe
        // slot more), the largest a default pipe takes, and beyond it (copied unless the
        // pipe may grow that far).
        let ranges = [
            (0, 4096),
            (MIB, 64 * 1024),
            (512, 64 * 1024 + 512),
            (3 * 512, MIB - 1024),
            (2 * MIB, MIB),
            (MIB + 512, MIB),
            (4 * MIB, 3 * MIB),
        ];
        for (offset, length) in ranges {
            let data = client.read(offset, length);
            assert!(
                data == expected(&contents, offset, length),
                "{mode:?}: read of {length} at {offset} differs from the file"
            );
        }
        // Many in flight at once, answered in any order.
        let mut cookies = std::collections::HashMap::new();
        for index in 0..16u64 {
            let offset = (index * 3 * 64 * 1024 + index * 512) % (SIZE - MIB);
            let length = 64 * 1024 * (1 + index % 4);
            let cookie = client.send_request(CMD_READ, 0, offset, length, &[]);
            cookies.insert(cookie, (offset, length));
        }
        for _ in 0..16 {
            let reply = client.read_completed();
            let (offset, length) = cookies.remove(&reply.cookie).expect("known cookie");
            assert_eq!(reply.error, 0);
            assert!(reply.data == expected(&contents, offset, length));
        }
        // A write is seen by the next read.
        let fresh = pattern(9 + mode as u64, 128 * 1024);
        client.write(5 * MIB, &fresh);
        contents[5 * MIB as usize..][..fresh.len()].copy_from_slice(&fresh);
        assert_eq!(client.read(5 * MIB, 128 * 1024), fresh);
        client.disconnect();
    }
}

#[test]
fn a_file_cut_short_falls_back_and_leaves_no_stale_bytes() {
    let served = serve_file();
    let (mut client, _, _, _) = Client::negotiate(&served.socket, "file", Mode::Structured, false);
    assert!(client.read(0, MIB) == expected(&served.contents, 0, MIB));
    std::fs::OpenOptions::new()
        .write(true)
        .open(&served.path)
        .unwrap()
        .set_len(2 * MIB + 256 * 1024)
        .unwrap();
    // Splice gets 256 KiB, then end of file: nothing is sent, `read_at` fails, the client
    // gets an error and the connection goes on.
    let reply = client.request(CMD_READ, 0, 2 * MIB, 512 * 1024, &[]);
    assert_ne!(reply.error, 0, "read past the cut end succeeded");
    let data = client.read(MIB, 512 * 1024);
    assert!(
        data == expected(&served.contents, MIB, 512 * 1024),
        "the read after a failed splice differs from the file"
    );
    let data = client.read(2 * MIB, 128 * 1024);
    assert!(data == expected(&served.contents, 2 * MIB, 128 * 1024));
    client.disconnect();
}
