//! Goal: `thinpool send | thinpool receive` copies read-only snapshots between pools of
//! different block sizes, offline and while either pool is served (through the control
//! socket, writers writing the sent snapshot's origin meanwhile); a refused stream leaves
//! the pool's transaction id and `list` as they were; a receive killed with SIGKILL at any
//! point leaves a pool that checks clean and holds no partial volume.
//! Method: pools made with the binary and filled through the library (seeded writes,
//! read-only snapshots), the two commands joined by a pipe; contents compared through the
//! library (or over NBD for a served pool); `thin_check` of the metadata after the kills.

mod e2e_support;

use e2e_support::*;
use rand::Rng;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;
use thin_pool::{Pool, PoolOptions};

const SIZE: u64 = 32 * MIB;

/// Seeded writes (whole 64 KiB pieces) on `vm` of the closed pool in `dir`, then the
/// read-only snapshot `snap`.
fn write_and_snapshot(dir: &Path, rng: &mut impl Rng, writes: usize, snap: &str) {
    let pool = Pool::open(dir, PoolOptions::default()).unwrap();
    if pool.info("vm").is_err() {
        pool.create_volume("vm", SIZE).unwrap();
    }
    let volume = pool.volume("vm").unwrap();
    for _ in 0..writes {
        let offset = rng.gen_range(0..SIZE / 65536) * 65536;
        volume
            .write(offset, &pattern(rng.gen(), 65536), false)
            .unwrap();
    }
    drop(volume);
    pool.snapshot("vm", snap, true).unwrap();
    pool.close().unwrap();
}

fn content(dir: &Path, name: &str) -> Vec<u8> {
    let pool = Pool::open(dir, PoolOptions::default()).unwrap();
    let volume = pool.volume(name).unwrap();
    let mut buf = vec![0; volume.size_bytes() as usize];
    volume.read(0, &mut buf).unwrap();
    buf
}

/// `thinpool send ARGS | thinpool receive ARGS`; both must succeed.
fn pipe(send: &[&str], receive: &[&str]) {
    let mut sender = Command::new(THINPOOL);
    sender.arg("send").args(send).stdout(Stdio::piped());
    let mut sender = ChildGuard::spawn(sender, "thinpool send");
    let out = sender.child_mut().stdout.take().unwrap();
    let mut receiver = Command::new(THINPOOL);
    receiver
        .arg("receive")
        .args(receive)
        .stdin(out)
        .stdout(Stdio::null());
    let mut receiver = ChildGuard::spawn(receiver, "thinpool receive");
    let timeout = Duration::from_secs(120);
    assert!(
        sender.wait_exit(timeout).unwrap().success(),
        "send {send:?}"
    );
    assert!(
        receiver.wait_exit(timeout).unwrap().success(),
        "receive {receive:?}"
    );
}

fn observed(dir: &Path) -> (String, String) {
    let d = dir.to_str().unwrap();
    let status: serde_json::Value =
        serde_json::from_str(&thinpool_ok(&["status", "--json", "--pool", d])).unwrap();
    (
        status["transaction_id"].to_string(),
        thinpool_ok(&["list", "--json", "--pool", d]),
    )
}

#[test]
fn full_and_incremental_through_a_pipe_between_block_sizes() {
    let (_report, mut rng) = testkit::seeded_rng();
    let scratch = ScratchDir::new("send-receive");
    let (a, b) = (scratch.join("a"), scratch.join("b"));
    create_pool(&a, &["--data-size", "256M", "--block-size", "64K"]);
    create_pool(&b, &["--data-size", "256M", "--block-size", "256K"]);
    write_and_snapshot(&a, &mut rng, 200, "s1");
    write_and_snapshot(&a, &mut rng, 20, "s2");
    let (a_, b_) = (a.to_str().unwrap(), b.to_str().unwrap());
    pipe(&["s1", "--pool", a_], &["s1", "--pool", b_]);
    pipe(&["s2", "--base", "s1", "--pool", a_], &["s2", "--pool", b_]);
    assert!(content(&b, "s1") == content(&a, "s1"));
    assert!(content(&b, "s2") == content(&a, "s2"));
    // A refused stream (cut off, then replayed) changes nothing.
    write_and_snapshot(&a, &mut rng, 5, "s3");
    let file = scratch.join("s3.stream");
    let file_ = file.to_str().unwrap();
    thinpool_ok(&["send", "s3", "--base", "s2", "--pool", a_, "-o", file_]);
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let before = observed(&b);
    let error = thinpool_err(&["receive", "s3", "-i", file_, "--pool", b_]);
    assert!(error.contains("cut off"), "{error}");
    assert_eq!(observed(&b), before);
    std::fs::write(&file, &bytes).unwrap();
    thinpool_ok(&["receive", "s3", "-i", file_, "--pool", b_]);
    assert!(content(&b, "s3") == content(&a, "s3"));
    let before = observed(&b);
    let error = thinpool_err(&["receive", "s4", "-i", file_, "--pool", b_]);
    assert!(error.contains("replay"), "{error}");
    assert_eq!(observed(&b), before);
    for command in ["send", "receive"] {
        assert!(thinpool_ok(&[command, "--help"]).contains("Examples:"));
    }
}

/// A receive killed with SIGKILL after a random share of the stream: the pool opens, its
/// metadata checks clean, the volume is not there, no data block leaked; the stream is
/// then received whole.
#[test]
fn receive_killed_at_random_points_leaves_no_partial_volume() {
    let (_report, mut rng) = testkit::seeded_rng();
    let tools = testkit::tools::ThinTools::find(testkit::tools::ToolVersion::V1_1);
    let scratch = ScratchDir::new("send-receive-kill");
    let (a, b) = (scratch.join("a"), scratch.join("b"));
    create_pool(&a, &["--data-size", "256M"]);
    create_pool(&b, &["--data-size", "256M"]);
    write_and_snapshot(&a, &mut rng, 300, "s1");
    let file = scratch.join("s1.stream");
    let (a_, b_) = (a.to_str().unwrap(), b.to_str().unwrap());
    thinpool_ok(&["send", "s1", "--pool", a_, "-o", file.to_str().unwrap()]);
    let stream = std::fs::read(&file).unwrap();
    let before = observed(&b);
    for round in 0..6 {
        let cut = rng.gen_range(0..stream.len());
        let mut receiver = Command::new(THINPOOL);
        receiver
            .args(["receive", "s1", "--pool", b_])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut receiver = ChildGuard::spawn(receiver, "thinpool receive");
        let mut input = receiver.child_mut().stdin.take().unwrap();
        input.write_all(&stream[..cut]).unwrap();
        // Let it work on what it has, for a random moment, then kill it.
        std::thread::sleep(Duration::from_millis(rng.gen_range(0..200)));
        receiver.kill();
        drop(input);
        assert_eq!(observed(&b), before, "round {round}, cut at {cut}");
        let check = tools.check(&b.join(thin_pool::METADATA_FILE));
        assert!(check.status.success(), "round {round}: {}", check.stderr);
    }
    thinpool_ok(&["receive", "s1", "-i", file.to_str().unwrap(), "--pool", b_]);
    assert!(content(&b, "s1") == content(&a, "s1"));
}

/// Both pools served: the send reads the snapshot while a client writes its origin over
/// NBD, the receive goes through the receiving server's control socket.
#[test]
fn send_and_receive_while_served() {
    let (_report, mut rng) = testkit::seeded_rng();
    let scratch = ScratchDir::new("send-receive-served");
    let (a, b) = (scratch.join("a"), scratch.join("b"));
    create_pool(&a, &["--data-size", "256M"]);
    create_pool(&b, &["--data-size", "256M", "--block-size", "128K"]);
    write_and_snapshot(&a, &mut rng, 200, "s1");
    let expected = content(&a, "s1");
    let served_a = serve(&a, &[]);
    let served_b = serve(&b, &[]);
    let socket = served_a.socket.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut client = Client::open(&socket, "vm");
            let mut writes = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) || writes < 50 {
                client.write((writes * 131_072) % (SIZE - 65536), &[0xAB; 65536]);
                if writes.is_multiple_of(8) {
                    client.flush();
                }
                writes += 1;
            }
            client.disconnect();
        })
    };
    let (a_, b_) = (a.to_str().unwrap(), b.to_str().unwrap());
    pipe(&["s1", "--pool", a_], &["s1", "--pool", b_]);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    let mut client = Client::open(&served_b.socket, "s1");
    let mut received = Vec::new();
    for offset in (0..SIZE).step_by(MIB as usize) {
        received.extend(client.read(offset, MIB));
    }
    client.disconnect();
    assert!(received == expected, "the stream is the snapshot");
    assert!(thinpool_ok(&["list", "--pool", b_]).contains("s1"));
    served_a.stop();
    served_b.stop();
    assert!(content(&b, "s1") == expected);
}
