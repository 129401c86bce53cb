//! Goal: a stream that is cut off, corrupted (a flipped byte anywhere), of another format
//! version, for a base this pool lacks, or replayed, is refused with the pool exactly as
//! it was: same transaction id, same volumes, same data blocks used (every block the
//! receive wrote into is released), and a later good receive still works.
//! Method: a full and an incremental stream of a seeded random volume; every truncation
//! at a record boundary and inside each record (its header, payload and checksum), every
//! byte of the header, of each record header and of the trailer flipped, and random bytes
//! of the payloads flipped, each received and refused.

mod engine_send_receive_kit;

use engine_send_receive_kit::{observe, pool, read_all, receive, send, Model, SIZE};
use rand::Rng;
use thin_pool::stream::format::{Item, StreamReader};
use thin_pool::{Error, Pool};

const BLOCK: u64 = 64 << 10;

/// The byte offsets where each record starts (and the trailer, and the end).
fn boundaries(stream: &[u8]) -> Vec<usize> {
    let (mut reader, _) = StreamReader::open(stream).unwrap();
    let mut data = Vec::new();
    let mut at = vec![reader.position() as usize];
    loop {
        let item = reader.next(&mut data).unwrap();
        at.push(reader.position() as usize);
        if matches!(item, Item::End { .. }) {
            return at;
        }
    }
}

fn refused(pool: &Pool, stream: &[u8], what: &str) {
    let before = observe(pool);
    match receive(pool, "new", stream) {
        Err(Error::BadStream(_)) => {}
        other => panic!("{what}: {other:?}"),
    }
    assert_eq!(observe(pool), before, "{what}: the pool changed");
}

/// A sender with s1 and s2, and a receiver holding s1.
fn setup() -> (Pool, Pool, Vec<u8>, Vec<u8>) {
    let (_report, mut rng) = testkit::seeded_rng();
    let (_sp, sender) = pool(BLOCK, 32);
    sender.create_volume("vm", SIZE).unwrap();
    let mut model = Model::new(SIZE, BLOCK);
    model.mutate(&sender, "vm", &mut rng, 40);
    sender.snapshot("vm", "s1", true).unwrap();
    model.mutate(&sender, "vm", &mut rng, 10);
    sender.snapshot("vm", "s2", true).unwrap();
    let full = send(&sender, "s1", None);
    let increment = send(&sender, "s2", Some("s1"));
    let (_rp, receiver) = pool(BLOCK, 32);
    receive(&receiver, "s1", &full).unwrap();
    (sender, receiver, full, increment)
}

#[test]
fn truncated_streams_are_refused() {
    let (_s, receiver, full, increment) = setup();
    let (_rp, empty) = pool(BLOCK, 32);
    for (stream, target) in [(&full, &empty), (&increment, &receiver)] {
        let edges = boundaries(stream);
        let mut cuts: Vec<usize> = (0..edges[0]).collect();
        for pair in edges.windows(2) {
            let (start, end) = (pair[0], pair[1]);
            cuts.extend([
                start,
                start + 1,
                start + 10,
                start + 20,
                (start + end) / 2,
                end - 4,
                end - 1,
            ]);
        }
        cuts.retain(|&c| c < stream.len());
        cuts.sort_unstable();
        cuts.dedup();
        for cut in cuts {
            refused(
                target,
                &stream[..cut],
                &format!("cut at {cut} of {}", stream.len()),
            );
        }
    }
    // Bytes after the trailer are refused too.
    let mut longer = full.clone();
    longer.push(0);
    refused(&empty, &longer, "a byte after the trailer");
    receive(&empty, "new", &full).unwrap();
}

#[test]
fn flipped_bytes_are_refused() {
    let (_report, mut rng) = testkit::seeded_rng();
    let (_s, receiver, full, increment) = setup();
    let (_rp, empty) = pool(BLOCK, 32);
    for (stream, target) in [(&full, &empty), (&increment, &receiver)] {
        let edges = boundaries(stream);
        let mut positions: Vec<usize> = (0..edges[0]).collect();
        for &edge in &edges[..edges.len() - 1] {
            positions.extend(edge..edge + 20);
        }
        positions.extend(stream.len() - 4..stream.len());
        for _ in 0..300 {
            positions.push(rng.gen_range(0..stream.len()));
        }
        for at in positions {
            let mut bad = stream.clone();
            bad[at] ^= 1 << rng.gen_range(0..8);
            refused(target, &bad, &format!("byte {at} flipped"));
        }
    }
    receive(&receiver, "new", &increment).unwrap();
}

#[test]
fn wrong_version_base_and_replays_are_refused() {
    let (sender, receiver, full, increment) = setup();
    // Another version, its header checksum made right again: the version check refuses it.
    let mut other = full.clone();
    other[8] = 2;
    let header_end = boundaries(&full)[0];
    let crc = crc32c::crc32c(&other[..header_end - 4]);
    other[header_end - 4..header_end].copy_from_slice(&crc.to_le_bytes());
    let (_rp, empty) = pool(BLOCK, 32);
    match receive(&empty, "new", &other) {
        Err(Error::BadStream(why)) => assert!(why.contains("version 2"), "{why}"),
        other => panic!("{other:?}"),
    }
    // An increment for a base this pool lacks.
    refused(&empty, &increment, "no base");
    // A base that is there by name but holds other content.
    sender.create_volume("other", SIZE).unwrap();
    sender.snapshot("other", "s1x", true).unwrap();
    let (_rp2, wrong) = pool(BLOCK, 32);
    receive(&wrong, "s1", &send(&sender, "s1x", None)).unwrap();
    refused(&wrong, &increment, "a base of that name with other content");
    // Replays: the full stream again, and the increment twice.
    refused(&receiver, &full, "the full stream replayed");
    receive(&receiver, "s2", &increment).unwrap();
    refused(&receiver, &increment, "the increment replayed");
    // The refused receives left the received ones intact.
    assert!(read_all(&receiver, "s2") == read_all(&sender, "s2"));
}
