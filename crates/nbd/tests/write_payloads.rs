//! Goal: WRITE payloads reach the export whole and in place however the client cuts them,
//! both those larger than the buffer a thread keeps (received into a fresh buffer that is
//! not zeroed first) and smaller ones: a header sent alone and its payload in pieces with
//! pauses between; a payload sent in one write together with the next request (receiving
//! it must stop at the payload's end, or the next request is lost); several large WRITEs
//! sent back to back before any reply is read; with the spin on and off.
//! Method: a raw client in simple-reply mode against a memory export and a local model of
//! its bytes; every reply is checked, and the whole disk is read back and compared with the
//! model. No timing is asserted.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::*;
use nbd::{Config, MemoryExport};

const SIZE: u64 = 32 * MIB;
const KIB: u64 = 1024;
/// Payload sizes around the buffer a thread keeps between requests (256 KiB).
const LENGTHS: [u64; 6] = [
    4 * KIB,
    64 * KIB,
    256 * KIB,
    256 * KIB + 4 * KIB,
    MIB,
    3 * MIB + 512,
];
const PAUSE: Duration = Duration::from_millis(3);

/// Reads `count` replies and checks that each succeeded.
fn replies(client: &mut Client, count: usize) {
    for _ in 0..count {
        let completed = client.read_completed();
        assert_eq!(completed.error, 0, "request {} failed", completed.cookie);
    }
}

fn check_disk(client: &mut Client, model: &[u8], what: &str) {
    for start in (0..SIZE).step_by(MIB as usize) {
        let data = client.read(start, MIB);
        assert!(
            data == model[start as usize..(start + MIB) as usize],
            "{what}: disk differs from the model in the MiB at {start}"
        );
    }
}

#[test]
fn write_payloads_cut_anywhere_arrive_whole_and_in_place() {
    for spin_max in [Duration::ZERO, Config::default().spin_max] {
        let what = format!("spin {spin_max:?}");
        let config = Config {
            spin_max,
            ..Config::default()
        };
        let disk = std::sync::Arc::new(MemoryExport::new("disk", SIZE));
        let server = TestServer::start_with(vec![disk], config);
        let (mut client, _, _, _) = Client::negotiate(&server.socket, "disk", Mode::Simple, false);
        let mut model = vec![0u8; SIZE as usize];
        let mut seed = 1u64;
        let mut next_data = |length: u64| {
            seed += 1;
            pattern(seed, length as usize)
        };

        // The header alone, then the payload in three pieces with pauses between.
        let mut offset = 0;
        for length in LENGTHS {
            let data = next_data(length);
            client.send_request(CMD_WRITE, 0, offset, length, &[]);
            let cuts = [0, data.len() / 3, data.len() / 3 * 2 + 1, data.len()];
            for piece in cuts.windows(2) {
                std::thread::sleep(PAUSE);
                client.send(&data[piece[0]..piece[1]]);
            }
            replies(&mut client, 1);
            model[offset as usize..(offset + length) as usize].copy_from_slice(&data);
            offset += length.next_multiple_of(4 * KIB);
        }
        check_disk(&mut client, &model, &format!("{what}, payloads in pieces"));

        // A WRITE, its payload and a READ of another range in one write; the READ sees
        // the disk before or after the WRITE, which do not overlap.
        let half = SIZE / 2;
        let mut offset = half;
        for length in LENGTHS {
            let data = next_data(length);
            let read_offset = offset - half;
            let expected = model[read_offset as usize..(read_offset + length) as usize].to_vec();
            // Cookies of our own, far from those `Client` gives out.
            let (write_cookie, read_cookie) = (1 << 40, (1 << 40) + 1);
            let mut bytes =
                request_header(Mode::Simple, CMD_WRITE, 0, write_cookie, offset, length);
            bytes.extend_from_slice(&data);
            bytes.extend_from_slice(&request_header(
                Mode::Simple,
                CMD_READ,
                0,
                read_cookie,
                read_offset,
                length,
            ));
            client.stream.write_all(&bytes).unwrap();
            let mut answered = Vec::new();
            for _ in 0..2 {
                let mut header = [0u8; 16];
                client.stream.read_exact(&mut header).expect("reply header");
                assert_eq!(be32(&header), 0x6744_6698, "simple reply magic");
                assert_eq!(be32(&header[4..]), 0, "{what}: request failed");
                let cookie = be64(&header[8..]);
                if cookie == read_cookie {
                    let mut got = vec![0u8; length as usize];
                    client.stream.read_exact(&mut got).expect("read data");
                    assert!(got == expected, "{what}: READ of {length} beside a WRITE");
                } else {
                    assert_eq!(cookie, write_cookie, "{what}: reply to an unknown cookie");
                }
                answered.push(cookie);
            }
            answered.sort_unstable();
            assert_eq!(
                answered,
                [write_cookie, read_cookie],
                "{what}: one reply each"
            );
            model[offset as usize..(offset + length) as usize].copy_from_slice(&data);
            offset += length.next_multiple_of(4 * KIB);
        }
        check_disk(
            &mut client,
            &model,
            &format!("{what}, payload and next request"),
        );

        // Large WRITEs back to back, every payload in the same write as the next header.
        let mut bytes = Vec::new();
        let mut offset = 0;
        let mut count = 0;
        while offset + 3 * MIB <= SIZE {
            let length = MIB + 4 * KIB;
            let data = next_data(length);
            let cookie = (2 << 40) + count;
            bytes.extend_from_slice(&request_header(
                Mode::Simple,
                CMD_WRITE,
                0,
                cookie,
                offset,
                length,
            ));
            bytes.extend_from_slice(&data);
            model[offset as usize..(offset + length) as usize].copy_from_slice(&data);
            offset += 3 * MIB;
            count += 1;
        }
        client.stream.write_all(&bytes).unwrap();
        let mut answered = Vec::new();
        for _ in 0..count {
            let mut header = [0u8; 16];
            client.stream.read_exact(&mut header).expect("reply header");
            assert_eq!(be32(&header[4..]), 0, "{what}: back-to-back WRITE failed");
            answered.push(be64(&header[8..]));
        }
        answered.sort_unstable();
        let expected: Vec<u64> = (0..count).map(|index| (2 << 40) + index).collect();
        assert_eq!(
            answered, expected,
            "{what}: one reply per back-to-back WRITE"
        );
        check_disk(&mut client, &model, &format!("{what}, back-to-back WRITEs"));
        client.disconnect();
    }
}
