//! Goal: a hostile client sending malformed, oversize and unknown requests at a served thin
//! volume gets errors or a closed connection, never a crash, a hang or changed data, while a
//! good client on the same volume keeps working.
//!
//! Method: a good client thread writes and verifies numbered blocks in a loop; meanwhile
//! hostile connections send garbage handshakes, huge option lengths, unknown commands, reads
//! and trims past the end, oversize and half-sent writes, bad magics, writes to a read-only
//! snapshot, and seeded random headers. Afterwards the server still answers, the good
//! client's data is intact and the pool's status is clean.

mod e2e_support;

use e2e_support::*;
use rand::Rng;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

const VOLUME_SIZE: u64 = 32 * MIB;
const CHUNK: usize = 64 * 1024;

#[test]
fn hostile_client_cannot_disturb_a_good_one() {
    let temp = ScratchDir::new("serve-hostile");
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap();
    create_pool(&pool, &["--data-size", "256M"]);
    create_volume(&pool, "vol", "32M");
    let served = serve(&pool, &[]);
    let socket = served.socket.clone();

    // The good client: writes block i with pattern (round, i), reads it back, forever.
    let stop = Arc::new(AtomicBool::new(false));
    let good = {
        let stop = Arc::clone(&stop);
        let socket = socket.clone();
        std::thread::spawn(move || {
            let mut client = Client::open(&socket, "vol");
            let blocks = 64u64;
            let mut round = 0u64;
            while !stop.load(Ordering::SeqCst) || round < 2 {
                for block in 0..blocks {
                    let data = pattern(round * 1000 + block, CHUNK);
                    client.write(block * CHUNK as u64, &data);
                    assert_eq!(client.read(block * CHUNK as u64, CHUNK as u64), data);
                }
                client.flush();
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
        let mut client = Client::connect(&socket);
        let _ = client.stream.write_all(&garbage);
        assert!(client.is_closed(), "garbage handshake left open");
    }
    // An option claiming 4 GiB of data.
    {
        let mut client = Client::start(&socket);
        let _ = client.stream.write_all(&option_header(OPT_GO, u32::MAX));
        assert!(client.is_closed(), "huge option left open");
    }
    // Unknown export.
    assert!(Client::try_open(&socket, "no-such-volume").is_err());

    // Bad requests answered with errors; the connection stays usable.
    {
        let mut client = Client::open(&socket, "vol");
        for (command, offset, length) in [
            (99u16, 0u64, 512u32),
            (CMD_READ, VOLUME_SIZE, 512),
            (CMD_READ, VOLUME_SIZE - 512, 1024),
            (CMD_READ, u64::MAX - 511, 512),
            (CMD_TRIM, VOLUME_SIZE - 512, 4096),
            (CMD_READ, 0, 64 << 20),
        ] {
            let reply = client.request(command, 0, offset, u64::from(length), &[]);
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
        let mut client = Client::open(&socket, "vol");
        assert_ne!(client.write_errno(VOLUME_SIZE - 512, &[0x55u8; 1024]), 0);
        let data = client.read(VOLUME_SIZE - 512, 512);
        assert!(data.iter().all(|&b| b == 0), "a refused write changed data");
        client.disconnect();
    }
    // An oversize write: an error or a closed connection, never 4 GiB of buffer.
    {
        let mut client = Client::open(&socket, "vol");
        let header = request_header(Mode::Simple, CMD_WRITE, 0, 5, 0, u64::from(u32::MAX));
        let _ = client.stream.write_all(&header);
        assert!(client.is_closed(), "oversize write left open");
    }
    // A half-sent write, then hang-up.
    {
        let mut client = Client::open(&socket, "vol");
        let header = request_header(Mode::Simple, CMD_WRITE, 0, 6, 0, 1 << 20);
        let _ = client.stream.write_all(&header);
        let _ = client.stream.write_all(&[0xeeu8; 1000]);
        drop(client);
    }
    // A bad request magic closes the connection.
    {
        let mut client = Client::open(&socket, "vol");
        let mut header = request_header(Mode::Simple, CMD_READ, 0, 7, 0, 512);
        header[..4].copy_from_slice(&[0xde, 0xad, 0xbe, 0xef]);
        let _ = client.stream.write_all(&header);
        assert!(client.is_closed(), "bad magic left open");
    }
    // Many reads never collected, then hang-up.
    {
        let mut client = Client::open(&socket, "vol");
        for cookie in 0..200 {
            let header = request_header(Mode::Simple, CMD_READ, 0, cookie, 0, 4 << 20);
            let _ = client.stream.write_all(&header);
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
        let mut client = Client::open(&socket, "ro");
        assert_eq!(client.write_errno(0, &[1u8; 4096]), EPERM);
        let reply = client.request(CMD_TRIM, 0, 0, 65536, &[]);
        assert_eq!(reply.error, EPERM);
        client.disconnect();
    }
    // Seeded random headers with a valid magic; replies are not read.
    let (_report, mut rng) = testkit::seeded_rng();
    for _ in 0..10 {
        let mut client = Client::open(&socket, "ro");
        for cookie in 0..50 {
            // Never a WRITE with a payload we do not send: keep the stream framed.
            let command = match rng.gen_range(0..12u16) {
                CMD_WRITE => CMD_READ,
                command => command,
            };
            let flags = rng.gen_range(0..=0xffu16);
            let offset = match rng.gen_range(0..3) {
                0 => rng.gen_range(0..VOLUME_SIZE),
                1 => rng.gen(),
                _ => VOLUME_SIZE - 512,
            };
            let length = rng.gen_range(0..1u64 << 22);
            let header = request_header(Mode::Simple, command, flags, cookie, offset, length);
            let _ = client.stream.write_all(&header);
        }
        drop(client);
    }

    stop.store(true, Ordering::SeqCst);
    let last_round = good.join().expect("the good client failed");
    // The server is alive and the good client's last round is there.
    let mut client = Client::open(&socket, "vol");
    for block in 0..64u64 {
        assert_eq!(
            client.read(block * CHUNK as u64, CHUNK as u64),
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
