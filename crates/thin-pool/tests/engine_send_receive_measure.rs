//! Measurement, not a test (`#[ignore]`; run with `--ignored --nocapture`): a full send of
//! a 1 GiB snapshot beside an incremental send of 1% of its blocks changed, and a full
//! send piped into a receive running in another process (this test binary again, its
//! `receive_child` test), both pools in files on tmpfs (/dev/shm), beside `dd` copying
//! 1 GiB through a pipe at the same time (the machine's single-threaded pipe copy limit),
//! [`ROUNDS`] times each, alternating, with the CPU time of both processes. Prints the
//! figures (best and median) and asserts only the content.

use std::io::{BufReader, BufWriter};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use thin_pool::testing::{deterministic_options, dir_pool};
use thin_pool::{stream, Pool};

const GIB: u64 = 1 << 30;
const BLOCK: u64 = 64 << 10;
const ROUNDS: usize = 5;
/// Set for the child: the receiving pool's directory.
const CHILD_POOL: &str = "THINPOOL_MEASURE_RECEIVE_POOL";

/// The receiving process of `measure_send_and_receive` (does nothing run on its own).
#[test]
#[ignore = "the measurement's child process"]
fn receive_child() {
    let Some(dir) = std::env::var_os(CHILD_POOL) else {
        return;
    };
    let started = Instant::now();
    let pool = Pool::open(std::path::Path::new(&dir), deterministic_options()).unwrap();
    let opened = started.elapsed();
    let input = BufReader::with_capacity(256 << 10, std::io::stdin().lock());
    stream::receive(&pool, "s1", input, &mut |_| {}).unwrap();
    let received = started.elapsed();
    pool.close().unwrap();
    eprintln!(
        "receiver: opened {:.3} s, received {:.3} s, closed {:.3} s",
        opened.as_secs_f64(),
        (received - opened).as_secs_f64(),
        (started.elapsed() - received).as_secs_f64()
    );
    println!("cpu_seconds {}", cpu_seconds());
}

/// CPU time (user and system, every thread) of this process so far, from /proc/self/stat
/// (clock ticks of 10 ms, Linux's USER_HZ).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // The fields after the command name (which is in parentheses).
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    ticks as f64 / 100.0
}

fn best_and_median(mut seconds: Vec<f64>) -> (f64, f64) {
    seconds.sort_by(f64::total_cmp);
    (seconds[0], seconds[seconds.len() / 2])
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// `dd` copying 1 GiB through a pipe.
fn dd_through_a_pipe() -> Duration {
    let started = Instant::now();
    let status = Command::new("sh")
        .args([
            "-c",
            "dd if=/dev/zero bs=1M count=1024 status=none | dd of=/dev/null bs=1M status=none",
        ])
        .status()
        .unwrap();
    assert!(status.success());
    started.elapsed()
}

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

    receiver.close().unwrap();
    drop(receiver);
    let (mut pipe_times, mut dd_times, mut cpu_bound) = (Vec::new(), Vec::new(), Vec::new());
    println!("load average before: {}", load_average());
    for round in 0..ROUNDS {
        dd_times.push(dd_through_a_pipe().as_secs_f64());
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "receive_child",
                "--quiet",
                "--nocapture",
            ])
            .env(CHILD_POOL, &b)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let sender_cpu = cpu_seconds();
        let _ = rustix::pipe::fcntl_setpipe_size(&stdin, 1 << 20);
        let started = Instant::now();
        let out = BufWriter::with_capacity(256 << 10, stdin);
        stream::send(&sender, "s1", None, out, &mut |_| {}).unwrap();
        let sender_cpu = cpu_seconds() - sender_cpu;
        let output = child.wait_with_output().unwrap();
        assert!(output.status.success(), "round {round}: the receive");
        pipe_times.push(started.elapsed().as_secs_f64());
        let stdout = String::from_utf8(output.stdout).unwrap();
        let receiver_cpu: f64 = stdout
            .lines()
            .find_map(|line| line.strip_prefix("cpu_seconds "))
            .expect("the child reports its CPU time")
            .parse()
            .unwrap();
        println!("round {round}: sender {sender_cpu:.2} s of CPU, receiver {receiver_cpu:.2} s");
        // Each process on a core of its own, the busier one sets the pace.
        cpu_bound.push(sender_cpu.max(receiver_cpu));
        if round + 1 < ROUNDS {
            let receiver = Pool::open(&b, deterministic_options()).unwrap();
            receiver.delete_volume("s1").unwrap();
            receiver.close().unwrap();
        }
    }
    let (pipe_best, pipe_median) = best_and_median(pipe_times);
    let (dd_best, dd_median) = best_and_median(dd_times);
    let (cpu_best, cpu_median) = best_and_median(cpu_bound);
    let rate = |seconds: f64| GIB as f64 / seconds / 1e9;
    println!(
        "full send | receive of 1 GiB, two processes, a pipe, tmpfs: best {:.2} GB/s, median {:.2} GB/s; \
         dd through a pipe meanwhile: best {:.2} GB/s, median {:.2} GB/s; send|receive / dd, medians: {:.2} \
         ({ROUNDS} rounds; load average after: {})",
        rate(pipe_best),
        rate(pipe_median),
        rate(dd_best),
        rate(dd_median),
        dd_median / pipe_median,
        load_average()
    );
    println!(
        "the CPU time of the busier process allows: best {:.2} GB/s, median {:.2} GB/s",
        rate(cpu_best),
        rate(cpu_median)
    );
    let receiver = Pool::open(&b, deterministic_options()).unwrap();
    let info = receiver.info("s1").unwrap();
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
