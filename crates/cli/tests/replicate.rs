//! Goal: `thinpool replicate VOLUME --to DEST --once` replicates a volume round by round
//! (served source with a writer, or offline; DEST a pool directory or a command): each
//! replica on the destination holds exactly what the source volume held when it was
//! taken; two replicas are kept on each side; a round killed between the send and the
//! acknowledgement is resumed by the next from the acknowledged base; a destination that
//! lost the base is refused with a pointer to `--full`; a receiver that stops reading or
//! never answers is killed (with its process group) at the idle `--timeout`, the state
//! left at the acknowledged base; `status --json` and the metrics report the lag; the
//! fail-over and fail-back of docs/replication.md work as written;
//! a round while a client writes holds one point of its writes; without `--once` rounds
//! follow each other, and a kill of the loop is resumed from.
//! Method: two pools in scratch directories; writes of seeded patterns recorded in a model
//! (a byte vector), through NBD while the source is served, through the library while it
//! is not; every replica read back (NBD on the served source, the library on closed pools)
//! and compared with the model of its round.

mod e2e_support;

use e2e_support::*;
use rand::{rngs::StdRng, Rng};
use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use thin_pool::{Pool, PoolOptions};

const SIZE: u64 = 16 * MIB;
const PIECE: u64 = 64 * 1024;

/// Two pools, `src` (with volume `vm`) and `dst`.
fn two_pools(label: &str) -> (ScratchDir, String, String) {
    let temp = ScratchDir::new(label);
    let (src, dst) = (temp.path().join("src"), temp.path().join("dst"));
    create_pool(&src, &["--data-size", "256M"]);
    create_pool(&dst, &["--data-size", "256M"]);
    create_volume(&src, "vm", "16M");
    let path = |p: &Path| p.to_str().unwrap().to_string();
    (temp, path(&src), path(&dst))
}

/// `thinpool replicate vm --to TO --once --pool POOL EXTRA...`.
fn replicate(pool: &str, to: &str, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["replicate", "vm", "--to", to, "--once", "--pool", pool];
    args.extend_from_slice(extra);
    thinpool(&args)
}

#[track_caller]
fn replicate_ok(pool: &str, to: &str, extra: &[&str]) -> String {
    let output = replicate(pool, to, extra);
    assert!(
        output.status.success(),
        "replicate to {to} {extra:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The replicas of `vm` in a pool, in name order.
fn replicas(pool: &str) -> BTreeSet<String> {
    listed_volumes(pool)
        .iter()
        .map(|v| v["name"].as_str().unwrap().to_string())
        .filter(|name| name.starts_with("vm.repl-"))
        .collect()
}

fn names(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|name| name.to_string()).collect()
}

/// `count` seeded 64 KiB writes at piece-aligned offsets, applied to `model` and by `write`.
fn seeded_writes(
    rng: &mut StdRng,
    model: &mut [u8],
    count: usize,
    mut write: impl FnMut(u64, &[u8]),
) -> BTreeSet<u64> {
    let mut pieces = BTreeSet::new();
    for _ in 0..count {
        let offset = rng.gen_range(0..SIZE / PIECE) * PIECE;
        let data = pattern(rng.gen(), PIECE as usize);
        model[offset as usize..(offset + PIECE) as usize].copy_from_slice(&data);
        write(offset, &data);
        pieces.insert(offset);
    }
    pieces
}

/// Seeded writes on `name` of the closed pool in `dir`.
fn write_offline(dir: &str, name: &str, rng: &mut StdRng, model: &mut [u8], count: usize) {
    let pool = Pool::open(Path::new(dir), PoolOptions::default()).unwrap();
    let volume = pool.volume(name).unwrap();
    seeded_writes(rng, model, count, |offset, data| {
        volume.write(offset, data, false).unwrap()
    });
    drop(volume);
    pool.close().unwrap();
}

/// The content of `name` in the closed pool in `dir`.
fn content(dir: &str, name: &str) -> Vec<u8> {
    let pool = Pool::open(Path::new(dir), PoolOptions::default()).unwrap();
    let volume = pool.volume(name).unwrap();
    let mut buf = vec![0; volume.size_bytes() as usize];
    volume.read(0, &mut buf).unwrap();
    drop(volume);
    pool.close().unwrap();
    buf
}

/// The content of export `name` of a served pool.
fn served_content(socket: &Path, name: &str) -> Vec<u8> {
    let mut client = Client::open(socket, name);
    let mut bytes = Vec::new();
    for offset in (0..SIZE).step_by(MIB as usize) {
        bytes.extend(client.read(offset, MIB));
    }
    client.disconnect();
    bytes
}

fn status_json(pool: &str) -> serde_json::Value {
    serde_json::from_str(&thinpool_ok(&["status", "--json", "--pool", pool])).unwrap()
}

/// `GET /metrics` of a served pool (the banner's `metrics:` line).
fn scrape(served: &Served) -> String {
    let url = served
        .banner
        .lines()
        .find_map(|line| line.trim().strip_prefix("metrics:"))
        .expect("a metrics line in the banner")
        .trim()
        .to_string();
    let address = url
        .strip_prefix("http://")
        .and_then(|rest| rest.strip_suffix("/metrics"))
        .expect("http://ADDR/metrics");
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    answer
}

/// The value of the sample `name{volume="vm"}` in a scrape.
fn sample(scrape: &str, name: &str) -> Option<u64> {
    let prefix = format!("{name}{{volume=\"vm\"}} ");
    scrape
        .lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .map(|value| value.trim().parse().unwrap())
}

#[test]
fn served_source_replicates_each_round_and_keeps_two_replicas_on_each_side() {
    let (_temp, src, dst) = two_pools("replicate-served");
    let served = serve(Path::new(&src), &["--metrics", "127.0.0.1:0"]);
    let mut writer = Client::open(&served.socket, "vm");
    let report = seed_report();
    let mut rng = report.rng();
    let mut model = vec![0u8; SIZE as usize];
    for round in 1..=4u64 {
        seeded_writes(&mut rng, &mut model, 24, |offset, data| {
            writer.write(offset, data)
        });
        writer.flush();
        let out = replicate_ok(&src, &dst, &[]);
        let name = format!("vm.repl-{round}");
        assert!(out.contains(&name), "{out}");
        assert!(
            out.contains(if round == 1 { "full" } else { "incremental" }),
            "{out}"
        );
        let kept = match round {
            1 => names(&["vm.repl-1"]),
            _ => names(&[&format!("vm.repl-{}", round - 1), &name]),
        };
        assert_eq!(replicas(&src), kept, "source after round {round}");
        assert_eq!(replicas(&dst), kept, "destination after round {round}");
        assert!(
            served_content(&served.socket, &name) == model,
            "source {name}"
        );
        assert!(content(&dst, &name) == model, "destination {name}");
    }

    // Right after a round nothing is pending; then the writer's pieces are the lag.
    let status = status_json(&src);
    let lag = &status["replication"][0];
    assert_eq!(lag["volume"], "vm");
    assert_eq!(lag["last_acked"], "vm.repl-4");
    assert_eq!(lag["lag_bytes"], 0, "{lag}");
    assert!(lag["lag_seconds"].is_u64(), "{lag}");
    assert!(lag["pending"].is_null(), "{lag}");
    let block = status["block_size_bytes"].as_u64().unwrap();
    assert_eq!(block, PIECE, "the test writes whole blocks");
    let pieces = seeded_writes(&mut rng, &mut model, 5, |offset, data| {
        writer.write(offset, data)
    });
    writer.flush();
    let lag_bytes = pieces.len() as u64 * block;
    let status = status_json(&src);
    assert_eq!(status["replication"][0]["lag_bytes"], lag_bytes);
    let text = thinpool_ok(&["status", "--pool", &src]);
    assert!(
        text.contains("replication:") && text.contains("last acknowledged vm.repl-4"),
        "{text}"
    );
    let scraped = scrape(&served);
    assert_eq!(
        sample(&scraped, "thinpool_replication_lag_bytes"),
        Some(lag_bytes),
        "{scraped}"
    );
    assert!(sample(&scraped, "thinpool_replication_lag_seconds").is_some());
    assert!(sample(&scraped, "thinpool_replication_last_stream_bytes").unwrap() > 0);

    writer.disconnect();
    assert!(served.stop().success());
}

#[test]
fn a_round_killed_before_its_acknowledgement_is_resumed_from_the_acknowledged_base() {
    let (temp, src, dst) = two_pools("replicate-killed");
    let report = seed_report();
    let mut rng = report.rng();
    let mut model = vec![0u8; SIZE as usize];
    // DEST as a command: the replica's name and flags are appended to it.
    let receiver = format!("'{THINPOOL}' --pool '{dst}' receive");
    write_offline(&src, "vm", &mut rng, &mut model, 16);
    replicate_ok(&src, &receiver, &[]);
    assert!(content(&dst, "vm.repl-1") == model);

    // Round 2: the receiver applies the stream, then hangs before it acknowledges; the
    // round is killed there.
    write_offline(&src, "vm", &mut rng, &mut model, 16);
    let pid_file = temp.path().join("receiver.pid");
    let hanging = format!(
        "'{THINPOOL}' --pool '{dst}' receive \"$@\" && echo $$ > '{}' && exec sleep 600",
        pid_file.display()
    );
    let mut command = Command::new(THINPOOL);
    command.args([
        "replicate",
        "vm",
        "--to",
        &hanging,
        "--once",
        "--pool",
        &src,
    ]);
    let mut round = ChildGuard::spawn(command, "thinpool replicate");
    wait_for(
        "the receiver to apply round 2",
        Duration::from_secs(60),
        || std::fs::read_to_string(&pid_file).is_ok_and(|pid| pid.ends_with('\n')),
    );
    round.kill();
    let sleeper = std::fs::read_to_string(&pid_file).unwrap();
    run_ok("kill", &["-9", sleeper.trim()], Duration::from_secs(10));
    assert_eq!(replicas(&dst), names(&["vm.repl-1", "vm.repl-2"]));
    let lag = status_json(&src)["replication"][0].clone();
    assert_eq!(lag["last_acked"], "vm.repl-1", "{lag}");
    assert_eq!(lag["pending"], "vm.repl-2", "{lag}");

    // The next round drops the unacknowledged replica and sends from vm.repl-1.
    write_offline(&src, "vm", &mut rng, &mut model, 16);
    let out = replicate_ok(&src, &receiver, &[]);
    assert!(
        out.contains("vm.repl-3") && out.contains("incremental"),
        "{out}"
    );
    assert!(content(&dst, "vm.repl-3") == model);
    assert!(content(&src, "vm.repl-3") == model);
    assert_eq!(replicas(&src), names(&["vm.repl-1", "vm.repl-3"]));
    assert_eq!(replicas(&dst), names(&["vm.repl-1", "vm.repl-3"]));

    // A destination that lost the base: refused, pointing at --full; nothing kept of it.
    thinpool_ok(&["volume", "delete", "vm.repl-3", "--pool", &dst]);
    write_offline(&src, "vm", &mut rng, &mut model, 4);
    let output = replicate(&src, &receiver, &[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("vm.repl-3") && stderr.contains("--full"),
        "{stderr}"
    );
    assert_eq!(replicas(&src), names(&["vm.repl-1", "vm.repl-3"]));
    let out = replicate_ok(&src, &receiver, &["--full"]);
    assert!(out.contains("vm.repl-5") && out.contains("full"), "{out}");
    assert!(content(&dst, "vm.repl-5") == model);
    assert_eq!(replicas(&dst), names(&["vm.repl-5"]));
    assert_eq!(replicas(&src), names(&["vm.repl-3", "vm.repl-5"]));
}

#[test]
fn fail_over_and_fail_back_as_docs_replication_md_describes() {
    let (_temp, src, dst) = two_pools("replicate-failover");
    let report = seed_report();
    let mut rng = report.rng();
    let mut model = vec![0u8; SIZE as usize];
    for _ in 0..2 {
        write_offline(&src, "vm", &mut rng, &mut model, 16);
        replicate_ok(&src, &dst, &[]);
    }
    // The source is lost. Fail-over: the last received replica becomes the writable vm.
    let status = status_json(&src);
    assert_eq!(status["replication"][0]["last_acked"], "vm.repl-2");
    thinpool_ok(&["volume", "snapshot", "vm.repl-2", "vm", "--pool", &dst]);
    assert!(content(&dst, "vm") == model);
    write_offline(&dst, "vm", &mut rng, &mut model, 16);

    // Fail-back: the old source holds vm.repl-2 too; only what changed since goes back.
    let out = replicate_ok(&dst, &src, &["--base", "vm.repl-2"]);
    assert!(
        out.contains("vm.repl-3") && out.contains("incremental"),
        "{out}"
    );
    thinpool_ok(&["volume", "revert", "vm", "vm.repl-3", "--pool", &src]);
    assert!(content(&src, "vm") == model);

    // And the source replicates to the destination again, from the replica both hold.
    write_offline(&src, "vm", &mut rng, &mut model, 16);
    let out = replicate_ok(&src, &dst, &["--base", "vm.repl-3"]);
    assert!(
        out.contains("vm.repl-4") && out.contains("incremental"),
        "{out}"
    );
    assert!(content(&dst, "vm.repl-4") == model);
    assert_eq!(replicas(&src), names(&["vm.repl-3", "vm.repl-4"]));
    assert_eq!(replicas(&dst), names(&["vm.repl-3", "vm.repl-4"]));
}

#[test]
fn a_round_while_a_client_writes_replicates_a_point_in_its_writes() {
    let (_temp, src, dst) = two_pools("replicate-writing");
    let served = serve(Path::new(&src), &[]);
    const UNIT: u64 = 4096;
    let pieces = SIZE / UNIT;
    // 4 KiB piece i gets pattern(i) in order, one write at a time: at any instant the volume is
    // pieces 0..k written, the rest zeros, for some k.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let socket = served.socket.clone();
    let writing = std::sync::Arc::clone(&stop);
    let writer = std::thread::spawn(move || {
        let mut client = Client::open(&socket, "vm");
        let mut written = 0;
        while written < pieces && !writing.load(std::sync::atomic::Ordering::Relaxed) {
            client.write(written * UNIT, &pattern(written, UNIT as usize));
            written += 1;
        }
        client.disconnect();
        written
    });
    replicate_ok(&src, &dst, &[]);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let written = writer.join().unwrap();
    let replica = content(&dst, "vm.repl-1");
    let piece = |i: u64| &replica[(i * UNIT) as usize..((i + 1) * UNIT) as usize];
    let cut = (0..pieces)
        .find(|&i| piece(i) != pattern(i, UNIT as usize).as_slice())
        .unwrap_or(pieces);
    eprintln!("replicated at a cut of {cut} of {written} pieces written");
    assert!(cut <= written, "{cut} pieces replicated, {written} written");
    for i in cut..pieces {
        assert!(
            piece(i).iter().all(|&b| b == 0),
            "piece {i} is written in the replica but piece {cut} is not"
        );
    }
    // The next round carries the rest.
    replicate_ok(&src, &dst, &[]);
    let replica = content(&dst, "vm.repl-2");
    for i in 0..pieces {
        let expected = if i < written {
            pattern(i, UNIT as usize)
        } else {
            vec![0; UNIT as usize]
        };
        assert!(
            replica[(i * UNIT) as usize..][..UNIT as usize] == expected[..],
            "piece {i}"
        );
    }
    assert!(served.stop().success());
}

#[test]
fn without_once_rounds_follow_each_other_every_interval() {
    let (_temp, src, dst) = two_pools("replicate-loop");
    let report = seed_report();
    let mut rng = report.rng();
    let mut model = vec![0u8; SIZE as usize];
    write_offline(&src, "vm", &mut rng, &mut model, 16);
    let mut command = Command::new(THINPOOL);
    command.args([
        "replicate",
        "vm",
        "--to",
        &dst,
        "--interval",
        "1s",
        "--pool",
        &src,
    ]);
    // Its own process group: the kill below takes its receiver with it.
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    let mut rounds = ChildGuard::spawn(command, "thinpool replicate");
    // The state file, not the pools: the rounds hold them in turn.
    let state = Path::new(&src).join("replication.json");
    wait_for(
        "three acknowledged rounds",
        Duration::from_secs(120),
        || {
            let text = std::fs::read_to_string(&state).unwrap_or_default();
            serde_json::from_str::<serde_json::Value>(&text)
                .is_ok_and(|state| state["volumes"]["vm"]["acked"]["seq"].as_u64() >= Some(3))
        },
    );
    let group = format!("-{}", rounds.pid());
    run_ok("kill", &["-KILL", "--", &group], Duration::from_secs(10));
    rounds.kill();
    // Whatever round the kill cut, the next one goes on from the acknowledged base.
    let out = replicate_ok(&src, &dst, &[]);
    assert!(out.contains("incremental"), "{out}");
    let acked = status_json(&src)["replication"][0]["last_acked"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(content(&dst, &acked) == model, "{acked}");
    assert_eq!(replicas(&src).len(), 2);
    assert_eq!(replicas(&dst).len(), 2);
}

/// The processes of process group `group` that are alive (not zombies), from /proc.
fn live_in_group(group: u32) -> Vec<u32> {
    let mut live = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its ')'.
        let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 1..]
            .split_whitespace()
            .collect();
        if fields[0] != "Z" && fields[2].parse() == Ok(group) {
            live.push(pid);
        }
    }
    live
}

/// A round to `receiver` (which writes its PID to `pid_file`) with `--timeout 2s`: it
/// fails saying it timed out, every process of the receiver's group is gone, and the
/// state still has `acked` as the last acknowledged replica, nothing pending.
fn round_times_out(src: &str, receiver: &str, pid_file: &Path, acked: &str) {
    let output = replicate(src, receiver, &["--timeout", "2s"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("timed out"), "{stderr}");
    let pid: u32 = std::fs::read_to_string(pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(stderr.contains(&format!("pid {pid}")), "{stderr}");
    // SIGKILL was sent to the group; its processes die as soon as they run.
    wait_for(
        "the receiver's process group to be gone",
        Duration::from_secs(60),
        || live_in_group(pid).is_empty(),
    );
    let lag = status_json(src)["replication"][0].clone();
    assert_eq!(lag["last_acked"], acked, "{lag}");
    assert!(lag["pending"].is_null(), "{lag}");
    assert_eq!(replicas(src), names(&[acked]));
}

#[test]
fn a_receiver_that_hangs_is_killed_at_the_timeout_and_the_next_round_sends_again() {
    let (temp, src, dst) = two_pools("replicate-timeout");
    let report = seed_report();
    let mut rng = report.rng();
    let mut model = vec![0u8; SIZE as usize];
    write_offline(&src, "vm", &mut rng, &mut model, 16);
    replicate_ok(&src, &dst, &[]);
    // About 1 MiB of increment: more than a pipe holds.
    write_offline(&src, "vm", &mut rng, &mut model, 16);

    // A receiver that takes 1000 bytes, then neither reads nor answers (its `sleep` keeps
    // the pipe open): the write of the stream waits, and times out.
    let pid_file = temp.path().join("receiver.pid");
    let stalled = format!(
        "echo $$ > '{}'; head -c 1000 >/dev/null; sleep 600; : \"$@\"",
        pid_file.display()
    );
    round_times_out(&src, &stalled, &pid_file, "vm.repl-1");
    // One that takes the whole stream and never answers: the wait for its exit times out.
    let silent = format!(
        "echo $$ > '{}'; cat >/dev/null; sleep 600; : \"$@\"",
        pid_file.display()
    );
    round_times_out(&src, &silent, &pid_file, "vm.repl-1");
    assert_eq!(replicas(&dst), names(&["vm.repl-1"]));

    // A receiver that works: the round sends again from vm.repl-1.
    let out = replicate_ok(&src, &dst, &[]);
    assert!(
        out.contains("vm.repl-4") && out.contains("incremental"),
        "{out}"
    );
    assert!(content(&dst, "vm.repl-4") == model);
    assert_eq!(replicas(&src), names(&["vm.repl-1", "vm.repl-4"]));
    assert_eq!(replicas(&dst), names(&["vm.repl-1", "vm.repl-4"]));
}
