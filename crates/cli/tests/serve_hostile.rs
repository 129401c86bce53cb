//! Goal: a hostile client sending malformed, oversize and unknown requests at a served thin
//! volume gets errors or a closed connection, never a crash, a hang or changed data, while a
//! good client on the same volume keeps working.
//!
//! Method: a good client thread writes and verifies numbered blocks in a loop; meanwhile
//! hostile connections send garbage handshakes, huge option lengths, unknown commands, reads
//! and trims past the end, oversize and half-sent writes, bad magics, writes to a read-only
//! snapshot, and seeded random headers. Afterwards the server still answers, the good
//! client's data is intact and the pool's status is clean.

// NBD is big-endian on the wire.
#![allow(clippy::big_endian_bytes)]

mod e2e_support;

use e2e_support::*;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const VOLUME_SIZE: u64 = 32 * MIB;
const CHUNK: usize = 64 * 1024;

fn header(magic: u32, flags: u16, command: u16, handle: u64, offset: u64, length: u32) -> Vec<u8> {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&magic.to_be_bytes());
    bytes.extend_from_slice(&flags.to_be_bytes());
    bytes.extend_from_slice(&command.to_be_bytes());
    bytes.extend_from_slice(&handle.to_be_bytes());
    bytes.extend_from_slice(&offset.to_be_bytes());
    bytes.extend_from_slice(&length.to_be_bytes());
    bytes
}

/// Reads until EOF or error (bounded by the socket's timeout); true if the peer closed.
fn closes(stream: &mut UnixStream) -> bool {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buffer = [0u8; 4096];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(error) => {
                return error.kind() != std::io::ErrorKind::WouldBlock
                    && error.kind() != std::io::ErrorKind::TimedOut
            }
        }
    }
}

#[test]
fn hostile_client_cannot_disturb_a_good_one() {
    let temp = TempDir::new("serve-hostile");
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap();
    create_pool(&pool, &["--data-size", "256M"]);
    create_volume(&pool, "vol", "32M");
    let served = Served::start(&pool, &[]);
    let socket = served.socket.clone();

    // The good client: writes block i with pattern (round, i), reads it back, forever.
    let stop = Arc::new(AtomicBool::new(false));
    let good = {
        let stop = Arc::clone(&stop);
        let socket = socket.clone();
        std::thread::spawn(move || {
            let mut client = RawClient::connect(&socket, "vol");
            let blocks = 64u64;
            let mut round = 0u64;
            while !stop.load(Ordering::SeqCst) || round < 2 {
                for block in 0..blocks {
                    let data = pattern(round * 1000 + block, CHUNK);
                    assert_eq!(client.write(block * CHUNK as u64, &data), 0);
                    assert_eq!(client.read(block * CHUNK as u64, CHUNK), data);
                }
                assert_eq!(client.flush(), 0);
                round += 1;
            }
            client.disconnect();
            round - 1
        })
    };

    // Garbage instead of client flags and options.
    for garbage in [
        vec![0xffu8; 4],
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        pattern(1, 10_000),
    ] {
        let mut stream = UnixStream::connect(&socket).unwrap();
        let mut greeting = [0u8; 18];
        stream.read_exact(&mut greeting).unwrap();
        let _ = stream.write_all(&garbage);
        assert!(closes(&mut stream), "garbage handshake left open");
    }
    // An option claiming 4 GiB of data.
    {
        let mut stream = UnixStream::connect(&socket).unwrap();
        let mut greeting = [0u8; 18];
        stream.read_exact(&mut greeting).unwrap();
        stream.write_all(&3u32.to_be_bytes()).unwrap();
        let mut option = IHAVEOPT.to_be_bytes().to_vec();
        option.extend_from_slice(&OPT_GO.to_be_bytes());
        option.extend_from_slice(&u32::MAX.to_be_bytes());
        let _ = stream.write_all(&option);
        assert!(closes(&mut stream), "huge option left open");
    }
    // Unknown export.
    assert!(RawClient::try_connect(&socket, "no-such-volume").is_err());

    // Bad requests answered with errors; the connection stays usable.
    {
        let mut client = RawClient::connect(&socket, "vol");
        for (command, offset, length) in [
            (99u16, 0u64, 512u32),
            (CMD_READ, VOLUME_SIZE, 512),
            (CMD_READ, VOLUME_SIZE - 512, 1024),
            (CMD_READ, u64::MAX - 511, 512),
            (CMD_TRIM, VOLUME_SIZE - 512, 4096),
            (CMD_READ, 0, 64 << 20),
        ] {
            let handle = client.send(command, 0, offset, length, &[]);
            let (reply, _) = client.reply(0);
            assert_eq!(reply.handle, handle);
            assert_ne!(
                reply.error, 0,
                "command {command} at {offset}+{length} succeeded"
            );
        }
        // Still works.
        let data = client.read(0, 4096);
        assert_eq!(data.len(), 4096);
        client.disconnect();
    }
    // A write past the end, with its payload: refused, and the stream stays in step.
    {
        let mut client = RawClient::connect(&socket, "vol");
        assert_ne!(client.write(VOLUME_SIZE - 512, &[0x55u8; 1024]), 0);
        let data = client.read(VOLUME_SIZE - 512, 512);
        assert!(data.iter().all(|&b| b == 0), "a refused write changed data");
        client.disconnect();
    }
    // An oversize write: an error or a closed connection, never 4 GiB of buffer.
    {
        let mut client = RawClient::connect(&socket, "vol");
        let _ = client
            .stream
            .write_all(&header(REQUEST_MAGIC, 0, CMD_WRITE, 5, 0, u32::MAX));
        assert!(closes(&mut client.stream), "oversize write left open");
    }
    // A half-sent write, then hang-up.
    {
        let mut client = RawClient::connect(&socket, "vol");
        let _ = client
            .stream
            .write_all(&header(REQUEST_MAGIC, 0, CMD_WRITE, 6, 0, 1 << 20));
        let _ = client.stream.write_all(&[0xeeu8; 1000]);
        drop(client);
    }
    // A bad request magic closes the connection.
    {
        let mut client = RawClient::connect(&socket, "vol");
        let _ = client
            .stream
            .write_all(&header(0xdead_beef, 0, CMD_READ, 7, 0, 512));
        assert!(closes(&mut client.stream), "bad magic left open");
    }
    // Many reads never collected, then hang-up.
    {
        let mut client = RawClient::connect(&socket, "vol");
        for handle in 0..200 {
            let _ =
                client
                    .stream
                    .write_all(&header(REQUEST_MAGIC, 0, CMD_READ, handle, 0, 4 << 20));
        }
        drop(client);
    }
    // Writes to a read-only snapshot are refused with EPERM.
    thinpool_ok(&[
        "volume",
        "snapshot",
        "vol",
        "ro",
        "--read-only",
        "--pool",
        p,
    ]);
    {
        let mut client = RawClient::connect(&socket, "ro");
        assert_eq!(client.write(0, &[1u8; 4096]), EPERM);
        let handle = client.send(CMD_TRIM, 0, 0, 65536, &[]);
        let (reply, _) = client.reply(0);
        assert_eq!(reply.handle, handle);
        assert_eq!(reply.error, EPERM);
        client.disconnect();
    }
    // Seeded random headers with a valid magic; replies are not read.
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..10 {
        let mut client = RawClient::connect(&socket, "ro");
        for handle in 0..50 {
            let command = (next() % 12) as u16;
            // Never a WRITE with a payload we do not send: keep the stream framed.
            let command = if command == CMD_WRITE {
                CMD_READ
            } else {
                command
            };
            let flags = (next() & 0xff) as u16;
            let offset = match next() % 3 {
                0 => next() % VOLUME_SIZE,
                1 => next(),
                _ => VOLUME_SIZE - 512,
            };
            let length = (next() % (1 << 22)) as u32;
            let _ = client.stream.write_all(&header(
                REQUEST_MAGIC,
                flags,
                command,
                handle,
                offset,
                length,
            ));
        }
        drop(client);
    }

    stop.store(true, Ordering::SeqCst);
    let last_round = good.join().expect("the good client failed");
    // The server is alive and the good client's last round is there.
    let mut client = RawClient::connect(&socket, "vol");
    for block in 0..64u64 {
        assert_eq!(
            client.read(block * CHUNK as u64, CHUNK),
            pattern(last_round * 1000 + block, CHUNK),
            "block {block}"
        );
    }
    client.disconnect();
    let status: serde_json::Value =
        serde_json::from_str(&thinpool_ok(&["status", "--json", "--pool", p])).unwrap();
    assert_eq!(status["mode"], "rw");
    assert_eq!(status["needs_check"], false);
    assert!(served.stop().success());
}
