//! Measurement, not a test (`#[ignore]`; run with `--ignored --nocapture`): a full send of
//! a 1 GiB snapshot beside an incremental send of 1% of its blocks changed, and a full
//! send piped into a receive, both pools in files on tmpfs (/dev/shm). Prints the figures
//! and asserts only the content.

use std::io::{BufReader, BufWriter};
use std::time::Instant;
use thin_pool::testing::{deterministic_options, dir_pool};
use thin_pool::{stream, Pool};

const GIB: u64 = 1 << 30;
const BLOCK: u64 = 64 << 10;

fn fill(pool: &Pool) {
    pool.create_volume("vm", GIB).unwrap();
    let volume = pool.volume("vm").unwrap();
    let chunk: Vec<u8> = (0..4 << 20).map(|i: u32| (i % 251) as u8 + 1).collect();
    for offset in (0..GIB).step_by(chunk.len()) {
        volume.write(offset, &chunk, false).unwrap();
    }
    pool.commit().unwrap();
}

#[test]
#[ignore = "measurement: 2 GiB on /dev/shm"]
fn measure_send_and_receive() {
    let root = std::path::Path::new("/dev/shm").join(format!("sendrecv-{}", std::process::id()));
    let (a, b) = (root.join("a"), root.join("b"));
    let sender = dir_pool(&a, 2 * GIB, deterministic_options());
    let receiver = dir_pool(&b, 2 * GIB, deterministic_options());
    fill(&sender);
    sender.snapshot("vm", "s1", true).unwrap();
    let volume = sender.volume("vm").unwrap();
    let blocks = GIB / BLOCK;
    for i in 0..blocks / 100 {
        volume
            .write((i * 100 + 7) * BLOCK, &[0x5A; 4096], false)
            .unwrap();
    }
    drop(volume);
    sender.snapshot("vm", "s2", true).unwrap();

    let started = Instant::now();
    let full = stream::send(&sender, "s1", None, std::io::sink(), &mut |_| {}).unwrap();
    let full_time = started.elapsed();
    let started = Instant::now();
    let incremental =
        stream::send(&sender, "s2", Some("s1"), std::io::sink(), &mut |_| {}).unwrap();
    let incremental_time = started.elapsed();
    println!(
        "full send of 1 GiB: {:.3} s ({} data bytes); incremental, 1% of blocks changed: {:.4} s ({} data bytes, {:.2}% of the full time)",
        full_time.as_secs_f64(),
        full.data_bytes,
        incremental_time.as_secs_f64(),
        incremental.data_bytes,
        100.0 * incremental_time.as_secs_f64() / full_time.as_secs_f64()
    );

    let (reader, writer) = std::io::pipe().unwrap();
    let started = Instant::now();
    let sending = {
        let sender = sender.clone();
        std::thread::spawn(move || {
            let out = BufWriter::with_capacity(4 << 20, writer);
            stream::send(&sender, "s1", None, out, &mut |_| {}).unwrap()
        })
    };
    let input = BufReader::with_capacity(4 << 20, reader);
    let (info, _) = stream::receive(&receiver, "s1", input, &mut |_| {}).unwrap();
    sending.join().unwrap();
    let pipe_time = started.elapsed();
    println!(
        "full send | receive through a pipe, tmpfs: {:.3} s, {:.2} GB/s",
        pipe_time.as_secs_f64(),
        GIB as f64 / pipe_time.as_secs_f64() / 1e9
    );
    assert_eq!(info.mapped_blocks, blocks);
    let (mut x, mut y) = (vec![0u8; 4 << 20], vec![0u8; 4 << 20]);
    let (va, vb) = (sender.volume("s1").unwrap(), receiver.volume("s1").unwrap());
    for offset in (0..GIB).step_by(x.len()) {
        va.read(offset, &mut x).unwrap();
        vb.read(offset, &mut y).unwrap();
        assert!(x == y, "received bytes at {offset}");
    }
    drop((va, vb, sender, receiver));
    std::fs::remove_dir_all(&root).unwrap();
}
