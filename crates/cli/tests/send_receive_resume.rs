//! Goal: `thinpool receive --resumable` killed with SIGKILL at random points keeps what it
//! verified as a partial receive (no volume; `thin_check` and `thinpool check` clean),
//! `receive --list-partial` gives its token, `send --resume TOKEN` sends the rest, and the
//! result is the sent snapshot byte for byte; a token of another stream is refused; a
//! partial receive dropped with `receive --abort` frees every block it held; the same
//! through a served pool's control socket.
//! Method: pools made with the binary and filled through the library, streams to files,
//! the receiver fed a random prefix through a pipe and killed after a random moment;
//! contents compared through the library (the sender is the model).

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

/// The partial receives of the pool in `dir` (`receive --list-partial --json`).
fn partial(dir: &str) -> Vec<serde_json::Value> {
    let listed = thinpool_ok(&["receive", "--list-partial", "--json", "--pool", dir]);
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    listed["partial_receives"].as_array().unwrap().clone()
}

fn data_used(dir: &str) -> u64 {
    let status: serde_json::Value =
        serde_json::from_str(&thinpool_ok(&["status", "--json", "--pool", dir])).unwrap();
    status["data_used_blocks"].as_u64().unwrap()
}

fn volume_names(dir: &str) -> Vec<String> {
    listed_volumes(dir)
        .iter()
        .map(|v| v["name"].as_str().unwrap().to_string())
        .collect()
}

/// `send ARGS -o FILE` on the pool `a`, and the stream's bytes.
fn send_to_file(a: &str, file: &Path, args: &[&str]) -> Vec<u8> {
    let mut all = vec!["send", "--pool", a, "-o", file.to_str().unwrap()];
    all.extend_from_slice(args);
    thinpool_ok(&all);
    std::fs::read(file).unwrap()
}

#[test]
fn receive_killed_at_random_points_resumes_to_the_snapshot() {
    let (_report, mut rng) = testkit::seeded_rng();
    let tools = testkit::tools::ThinTools::find(testkit::tools::ToolVersion::V1_1);
    let scratch = ScratchDir::new("send-receive-resume");
    let (a, b) = (scratch.join("a"), scratch.join("b"));
    create_pool(&a, &["--data-size", "256M"]);
    create_pool(&b, &["--data-size", "256M", "--block-size", "128K"]);
    write_and_snapshot(&a, &mut rng, 300, "s1");
    write_and_snapshot(&a, &mut rng, 50, "s2");
    let (a_, b_) = (a.to_str().unwrap(), b.to_str().unwrap());
    let file = scratch.join("stream");
    let used_before = data_used(b_);
    let mut stream = send_to_file(a_, &file, &["s1"]);
    let mut resumed = 0;
    for round in 0..8 {
        let cut = rng.gen_range(0..stream.len());
        let mut receiver = Command::new(THINPOOL);
        receiver
            .args(["receive", "s1", "--resumable", "--checkpoint", "1M"])
            .args(["--pool", b_])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut receiver = ChildGuard::spawn(receiver, "thinpool receive");
        let mut input = receiver.child_mut().stdin.take().unwrap();
        input.write_all(&stream[..cut]).unwrap();
        std::thread::sleep(Duration::from_millis(rng.gen_range(0..300)));
        receiver.kill();
        drop(input);
        assert!(
            !volume_names(b_).contains(&"s1".to_string()),
            "round {round}"
        );
        let check = tools.check(&b.join(thin_pool::METADATA_FILE));
        assert!(check.status.success(), "round {round}: {}", check.stderr);
        let metadata = b.join(thin_pool::METADATA_FILE);
        thinpool_ok(&["check", metadata.to_str().unwrap()]);
        let kept = partial(b_);
        assert!(kept.len() <= 1, "{kept:?}");
        stream = match kept.first() {
            Some(p) => {
                assert_eq!(p["name"], "s1");
                resumed += 1;
                let token = p["token"].as_str().unwrap();
                send_to_file(a_, &file, &["s1", "--resume", token])
            }
            None => send_to_file(a_, &file, &["s1"]),
        };
    }
    assert!(resumed > 0, "some kill kept something");
    let file_ = file.to_str().unwrap();
    thinpool_ok(&["receive", "s1", "--resumable", "-i", file_, "--pool", b_]);
    assert!(partial(b_).is_empty());
    assert!(content(&b, "s1") == content(&a, "s1"));

    // A token of another stream is refused by the sender, with nothing written.
    let cut = send_to_file(a_, &file, &["s2", "--base", "s1"]);
    std::fs::write(&file, &cut[..cut.len() / 2]).unwrap();
    let error = thinpool_err(&["receive", "s2", "--resumable", "-i", file_, "--pool", b_]);
    assert!(error.contains("resume token"), "{error}");
    let kept = partial(b_);
    let token = kept[0]["token"].as_str().unwrap().to_string();
    let other = scratch.join("other");
    let error = thinpool_err(
        &["send", "s1", "--resume", &token, "--pool", a_, "-o"]
            .into_iter()
            .chain([other.to_str().unwrap()])
            .collect::<Vec<_>>(),
    );
    assert!(error.contains("another stream"), "{error}");
    assert_eq!(std::fs::metadata(&other).map(|m| m.len()).unwrap_or(0), 0);

    // Dropped: its blocks are free again.
    assert!(kept[0]["held_blocks"].as_u64().unwrap() > 0);
    let used = data_used(b_);
    thinpool_ok(&["receive", "--abort", "s2", "--pool", b_]);
    assert!(partial(b_).is_empty());
    assert_eq!(
        data_used(b_),
        used - kept[0]["held_blocks"].as_u64().unwrap()
    );
    let check = tools.check(&b.join(thin_pool::METADATA_FILE));
    assert!(check.status.success(), "{}", check.stderr);
    thinpool_ok(&["volume", "delete", "s1", "--pool", b_]);
    assert_eq!(data_used(b_), used_before, "nothing leaked");
}

/// The same through the control socket of a served pool: a cut resumable receive keeps
/// its part, the list and the abort answer, the resumed stream completes it.
#[test]
fn resumable_receive_through_a_served_pool() {
    let (_report, mut rng) = testkit::seeded_rng();
    let scratch = ScratchDir::new("send-receive-resume-served");
    let (a, b) = (scratch.join("a"), scratch.join("b"));
    create_pool(&a, &["--data-size", "256M"]);
    create_pool(&b, &["--data-size", "256M"]);
    write_and_snapshot(&a, &mut rng, 200, "s1");
    let (a_, b_) = (a.to_str().unwrap(), b.to_str().unwrap());
    let file = scratch.join("stream");
    let file_ = file.to_str().unwrap();
    let whole = send_to_file(a_, &file, &["s1"]);
    let served_b = serve(&b, &[]);
    let used_before = data_used(b_);
    for name in ["r1", "r2"] {
        std::fs::write(&file, &whole[..whole.len() * 2 / 3]).unwrap();
        let args = ["receive", name, "--resumable", "--checkpoint", "1M"];
        let error = thinpool_err(
            &args
                .into_iter()
                .chain(["-i", file_, "--pool", b_])
                .collect::<Vec<_>>(),
        );
        assert!(error.contains("resume token"), "{error}");
    }
    let kept = partial(b_);
    assert_eq!(kept.len(), 2, "{kept:?}");
    assert!(!volume_names(b_).iter().any(|n| n.starts_with('r')));
    thinpool_ok(&["receive", "--abort", "r2", "--pool", b_]);
    let token = kept[0]["token"].as_str().unwrap();
    send_to_file(a_, &file, &["s1", "--resume", token]);
    thinpool_ok(&["receive", "r1", "--resumable", "-i", file_, "--pool", b_]);
    assert!(partial(b_).is_empty());
    served_b.stop();
    assert!(content(&b, "r1") == content(&a, "s1"));
    assert_eq!(
        data_used(b_) - used_before,
        listed_volumes(b_)[0]["mapped_blocks"].as_u64().unwrap(),
        "the aborted receive's blocks are free"
    );
}
