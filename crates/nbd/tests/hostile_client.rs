//! Goal: nothing a hostile client sends panics the server, exhausts its memory, or disturbs
//! another connection.
//! Method: a good client on its own connection writes and reads back seeded random data,
//! checked against a local model, for the whole test; meanwhile hostile connections send
//! garbage client flags, huge and malformed options, thousands of options, bad request magic,
//! oversize and out-of-range requests, seeded random request headers, half-sent payloads and
//! abrupt hang-ups. Afterwards the good client's data must be intact and new connections must
//! still be served.
#![allow(clippy::big_endian_bytes)]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use nbd::MemoryExport;
use rand::{Rng, SeedableRng};

const SIZE: u64 = 8 * MIB;

fn good_client(socket: std::path::PathBuf, seed: u64, stop: Arc<AtomicBool>) -> u64 {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let (mut client, _, _, _) = Client::negotiate(&socket, "disk", Mode::Structured, false);
    let mut model = vec![0u8; SIZE as usize];
    let mut operations = 0;
    while !stop.load(Ordering::SeqCst) || operations < 50 {
        let offset = rng.gen_range(0..SIZE / 512) * 512;
        let length = (rng.gen_range(1..=128u64) * 512).min(SIZE - offset);
        if rng.gen_bool(0.5) {
            let data = pattern(rng.gen(), length as usize);
            client.write(offset, &data);
            model[offset as usize..(offset + length) as usize].copy_from_slice(&data);
        } else {
            let data = client.read(offset, length);
            assert!(
                data == model[offset as usize..(offset + length) as usize],
                "good client read wrong data at {offset}"
            );
        }
        operations += 1;
    }
    let data = client.read(0, SIZE);
    assert!(data == model, "final read differs");
    client.disconnect();
    operations
}

fn hostile_handshakes(socket: &std::path::Path, rng: &mut rand::rngs::SmallRng) {
    // Garbage client flags.
    let mut client = Client::connect(socket);
    client.send(&[0xff, 0xff, 0xff, 0xff, 1, 2, 3]);
    assert!(client.is_closed());
    // Hang up at every point of the greeting.
    for cut in 0..4 {
        let mut client = Client::connect(socket);
        client.send(&vec![0u8; cut]);
        drop(client);
    }
    // Option lengths far beyond the limit, with and without data following.
    for length in [u32::MAX, 1 << 20, 64 * 1024 + 1] {
        let mut client = Client::start(socket);
        client.send(&option_header(OPT_INFO, length));
        assert_eq!(client.read_option_reply().reply_type, REP_ERR_TOO_BIG);
        assert!(client.is_closed());
    }
    // Truncated option data, then hang-up.
    let mut client = Client::start(socket);
    let mut header = option_header(OPT_GO, 1000);
    header.extend_from_slice(&[0u8; 10]);
    client.send(&header);
    drop(client);
    // Malformed GO and meta-context data: ERR_INVALID, and the loop goes on.
    let mut client = Client::start(socket);
    client.option(OPT_STRUCTURED_REPLY, &[]);
    let bad_go: Vec<Vec<u8>> = vec![
        vec![],
        vec![0xff, 0xff, 0xff, 0xff, 0, 0],
        vec![0, 0, 0, 2, 0xc3, 0x28, 0, 0],
        vec![0, 0, 0, 1, 0, 0, 0],
        vec![0, 0, 0, 0, 0xff, 0xff],
    ];
    for data in &bad_go {
        let replies = client.option(OPT_GO, data);
        assert_eq!(replies[0].reply_type, REP_ERR_INVALID, "{data:?}");
    }
    let mut huge_count = 4u32.to_be_bytes().to_vec();
    huge_count.extend_from_slice(b"disk");
    huge_count.extend_from_slice(&u32::MAX.to_be_bytes());
    let replies = client.option(OPT_SET_META_CONTEXT, &huge_count);
    assert_eq!(replies[0].reply_type, REP_ERR_INVALID);
    // Seeded random options (never EXPORT_NAME or ABORT): each gets a final reply.
    for _ in 0..300 {
        let code = loop {
            let code = rng.gen_range(0..16u32);
            if code != OPT_EXPORT_NAME && code != OPT_ABORT {
                break code;
            }
        };
        let length = rng.gen_range(0..300);
        let data: Vec<u8> = (0..length).map(|_| rng.gen()).collect();
        let replies = client.option(code, &data);
        let last = replies.last().unwrap();
        if code == OPT_GO && last.reply_type == REP_ACK {
            return;
        }
    }
    // Thousands of options: the server answers a bounded number, then hangs up.
    let mut client = Client::start(socket);
    let mut closed = false;
    for _ in 0..5000 {
        let option = option_bytes(99, &[]);
        let mut header = [0u8; 20];
        if std::io::Write::write_all(&mut client.stream, &option).is_err()
            || std::io::Read::read_exact(&mut client.stream, &mut header).is_err()
        {
            closed = true;
            break;
        }
        let length = be32(&header[16..]) as usize;
        client.read_bytes(length);
    }
    assert!(closed, "server answered 5000 options");
}

fn hostile_transmissions(socket: &std::path::Path, rng: &mut rand::rngs::SmallRng) {
    // Bad request magic closes the connection.
    let (mut client, _, _, _) = Client::negotiate(socket, "disk", Mode::Simple, false);
    client.send(&[0x55; 28]);
    assert!(client.is_closed());
    // Oversize WRITE: an error reply, then the connection closes.
    let (mut client, _, _, _) = Client::negotiate(socket, "disk", Mode::Simple, false);
    client.send(&request_header(
        Mode::Simple,
        CMD_WRITE,
        0,
        7,
        0,
        u64::from(u32::MAX),
    ));
    let reply = client.read_bytes(16);
    assert_eq!(be32(&reply[4..]), EOVERFLOW);
    assert_eq!(be64(&reply[8..]), 7);
    assert!(client.is_closed());
    // Extended headers: a 64-bit payload length far beyond the maximum closes the connection.
    let (mut client, _, _, _) = Client::negotiate(socket, "disk", Mode::Extended, false);
    client.send(&request_header(
        Mode::Extended,
        CMD_WRITE,
        FLAG_PAYLOAD_LEN,
        9,
        0,
        1 << 40,
    ));
    let reply = client.read_bytes(32);
    assert_eq!(be32(&reply), EXTENDED_REPLY_MAGIC);
    assert_eq!(be16(&reply[6..]), CHUNK_ERROR);
    let payload = client.read_bytes(be64(&reply[24..]) as usize);
    assert_eq!(be32(&payload), EOVERFLOW);
    assert!(client.is_closed());
    // Oversize READ and huge trims are refused; the connection goes on.
    let (mut client, _, _, _) = Client::negotiate(socket, "disk", Mode::Structured, false);
    for (command, offset, length) in [
        (CMD_READ, 0, u32::MAX),
        (CMD_TRIM, 0, u32::MAX),
        (CMD_WRITE_ZEROES, u64::MAX - 511, 512),
        (CMD_CACHE, SIZE, 512),
    ] {
        let reply = client.request(command, 0, offset, u64::from(length), &[]);
        assert_ne!(reply.error, 0, "command {command}");
    }
    client.disconnect();
    // Half-sent WRITE payload, then hang-up.
    let (mut client, _, _, _) = Client::negotiate(socket, "disk", Mode::Simple, false);
    client.send(&request_header(Mode::Simple, CMD_WRITE, 0, 1, 0, 1 << 20));
    client.send(&[1u8; 1000]);
    drop(client);
    // Many large reads never read back, then hang-up: workers must not hang.
    let (mut client, _, _, _) = Client::negotiate(socket, "disk", Mode::Simple, false);
    for cookie in 0..200 {
        client.send(&request_header(
            Mode::Simple,
            CMD_READ,
            0,
            cookie,
            0,
            4 << 20,
        ));
    }
    drop(client);
    // Seeded random request headers with a valid magic.
    for round in 0..20 {
        let mode = [Mode::Simple, Mode::Structured, Mode::Extended][round % 3];
        let meta = mode != Mode::Simple && round % 2 == 0;
        let (mut client, _, _, _) = Client::negotiate(socket, "disk", mode, meta);
        for _ in 0..50 {
            let command = rng.gen_range(0..12u16);
            let flags: u16 = rng.gen();
            let offset = if rng.gen_bool(0.5) {
                rng.gen_range(0..SIZE * 2)
            } else {
                rng.gen()
            };
            let length = if rng.gen_bool(0.7) {
                rng.gen_range(0..(1u64 << 20))
            } else {
                rng.gen::<u32>() as u64
            };
            let payload_flagged = mode == Mode::Extended && flags & FLAG_PAYLOAD_LEN != 0;
            let has_payload = command == CMD_WRITE || payload_flagged;
            if command == CMD_DISC {
                continue;
            }
            if has_payload && length > 32 * MIB {
                // The server must answer and hang up; checked above.
                continue;
            }
            let payload = if has_payload {
                vec![0xabu8; length as usize]
            } else {
                Vec::new()
            };
            if has_payload && offset + length <= SIZE {
                // Keep the good client's data intact: never write valid ranges here.
                continue;
            }
            let reply = client.request(command, flags, offset, length, &payload);
            let _ = reply.error;
        }
        client.disconnect();
    }
}

#[test]
fn hostile_clients_do_not_disturb_a_good_one() {
    let report = seed_report();
    let seed = report.seed();
    let disk = Arc::new(MemoryExport::new("disk", SIZE));
    let config = nbd::Config {
        handshake_timeout: Duration::from_secs(5),
        ..Default::default()
    };
    let server = TestServer::start_with(vec![disk], config);
    let stop = Arc::new(AtomicBool::new(false));
    let good = {
        let socket = server.socket.clone();
        let stop = stop.clone();
        std::thread::spawn(move || good_client(socket, seed, stop))
    };
    let started = Instant::now();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ 0xbad);
    hostile_handshakes(&server.socket, &mut rng);
    hostile_transmissions(&server.socket, &mut rng);
    stop.store(true, Ordering::SeqCst);
    let operations = good.join().expect("good client");
    assert!(operations >= 50);
    // Every hostile connection is gone, and new connections are served.
    wait_for(
        "every hostile connection to close",
        Duration::from_secs(10),
        || server.server.as_ref().unwrap().connection_count() == 0,
    );
    let (mut client, _, _, _) = Client::negotiate(&server.socket, "disk", Mode::Simple, false);
    client.read(0, 4096);
    client.disconnect();
    eprintln!("hostile run took {:?}", started.elapsed());
}
