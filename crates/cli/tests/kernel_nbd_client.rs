//! Goal: the Linux kernel's own NBD client (`nbd.ko` of Linux 6.1 in User-Mode Linux,
//! `testkit::uml`, configured by Debian's `nbd-client` 3.24) works against `thinpool serve`,
//! checked by content, and the test shows which NBD features that client uses.
//!
//! thinpool serves inside the guest (the binary under test, through hostfs) on a Unix socket
//! in the guest's `/run`; the pool directory is a host scratch directory the guest mounts
//! writable, so the host checks the pool afterwards. No network: the guest's loopback carries
//! only `serve --metrics`, whose request counts by command say what the kernel sent.
//!
//! - Function (one boot): `/dev/nbd0` over four connections (`-C 4`): read what the host
//!   wrote, write, flush (`fsync` of the device; `sync` and `blockdev --flushbufs` send
//!   none, which the test prints), trim (`blkdiscard`: thinpool then lists the blocks
//!   unmapped), a block-status-aware copy (`nbdcopy` reads a sparse source volume with block
//!   status and writes only its data through `/dev/nbd1`, one connection: the copy maps as
//!   many blocks as the source), disconnect (`nbd-client -d`). Every kernel connection
//!   negotiates with NBD_OPT_GO alone, and no request is refused.
//! - A server restart: a write acknowledged by a flush and one written with O_DSYNC (FUA),
//!   thinpool killed (SIGKILL by its pid inside the guest) and started again; `nbd-client
//!   -persist` is given 5 s to reconnect (with Linux 6.1 it does not: the kernel keeps the
//!   device configured but failing, and nbd-client 3.24 reconnects only when NBD_DO_IT
//!   fails, which it does not), else a new `nbd-client` connects; both acknowledged writes
//!   are there, an unflushed one is whole or absent per block, and a write after the
//!   restart lands.
//! - The first dm-devel report's experiment as function: a fully provisioned volume in a
//!   pool of 8 MiB blocks read with `dd bs=4096` through `/dev/nbd0` equals what was written
//!   (SHA-256 of the stream against the host's).

mod e2e_support;

use e2e_support::*;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use testkit::slots::assert_same_bytes;
use testkit::tools::ThinTools;
use testkit::uml::nbd::{
    connections, refused_requests, request_counts, Close, GuestServe, NBD_MODULES,
};
use testkit::uml::{Boot, Outcome, Uml};

const KIB: u64 = 1024;
/// The guest's NBD socket (its own tmpfs: a Unix socket on hostfs would be the host's).
const GUEST_SOCKET: &str = "/run/thinpool-nbd.sock";
const METRICS: &str = "127.0.0.1:9100";
/// NBD_OPT_GO: the only option nbd-client 3.24 sends.
const OPT_GO: u32 = 7;

/// A pool in `dir/pool` with `volumes` (name, size); its path. `dir` is the boot's result
/// directory: the only host directory the guest mounts writable.
fn make_pool(dir: &Path, block_size: &str, data_size: &str, volumes: &[(&str, u64)]) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let pool = dir.join("pool");
    create_pool(
        &pool,
        &["--data-size", data_size, "--block-size", block_size],
    );
    for (name, size) in volumes {
        create_volume(&pool, name, &size.to_string());
    }
    pool
}

/// Writes `extents` (offset, bytes) to `volume` through a host `thinpool serve`, flushed.
fn seed(pool: &Path, volume: &str, extents: &[(u64, Vec<u8>)]) {
    let served = serve(pool, &["--quiet"]);
    let mut client = Client::open(&served.socket, volume);
    for (offset, data) in extents {
        for (index, chunk) in data.chunks(8 * MIB as usize).enumerate() {
            client.write(offset + (index as u64) * 8 * MIB, chunk);
        }
    }
    client.flush();
    client.disconnect();
    assert!(served.stop().success());
}

/// The whole of `volume` as a host `thinpool serve` serves it.
fn image(pool: &Path, volume: &str, size: u64) -> Vec<u8> {
    let served = serve(pool, &["--quiet"]);
    let mut client = Client::open(&served.socket, volume);
    let mut bytes = Vec::with_capacity(size as usize);
    while (bytes.len() as u64) < size {
        let length = (size - bytes.len() as u64).min(4 * MIB);
        bytes.extend_from_slice(&client.read(bytes.len() as u64, length));
    }
    client.disconnect();
    assert!(served.stop().success());
    bytes
}

/// Mapped blocks by volume name, from a `thinpool list --json` text.
fn mapped_blocks(listing: &str) -> BTreeMap<String, u64> {
    let listing: serde_json::Value = serde_json::from_str(listing).expect("list --json");
    listing["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .map(|volume| {
            (
                volume["name"].as_str().unwrap().to_string(),
                volume["mapped_blocks"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn listed(pool: &Path) -> BTreeMap<String, u64> {
    mapped_blocks(&thinpool_ok(&[
        "list",
        "--json",
        "--pool",
        pool.to_str().unwrap(),
    ]))
}

/// thinpool's check and both thin_check versions are clean.
fn check_clean(pool: &Path) {
    let metadata = pool.join("metadata");
    thinpool_ok(&["check", metadata.to_str().unwrap()]);
    for tools in ThinTools::all() {
        tools.check(&metadata).assert_success();
    }
}

/// Boots with the nbd module and `script` after the prelude of `serve`; the boot's outcome.
fn boot(result: &Path, serve: &GuestServe, script: &str) -> Outcome {
    let outcome = Boot::new(&Uml::find(), result)
        .modules(&NBD_MODULES)
        .script(&format!("{}\n{script}", serve.prelude()))
        .run();
    eprintln!(
        "UML: {:.1} s wall (kernel up after {:.1} s)",
        outcome.elapsed.as_secs_f64(),
        outcome.script_started.unwrap_or_default().as_secs_f64()
    );
    outcome
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

fn read_text(path: &Path) -> String {
    String::from_utf8(read(path)).expect("text")
}

fn guest_serve(pool: &Path) -> GuestServe {
    GuestServe::new(Path::new(THINPOOL), pool, Path::new(GUEST_SOCKET))
}

/// The function test's guest script.
const FUNCTION_SCRIPT: &str = r#"
ip link set lo up
serve_start serve.log
nbd_up /dev/nbd0 v -C 4 -b 4096
for name in logical_block_size max_hw_sectors_kb discard_max_bytes write_zeroes_max_bytes write_cache fua rotational; do
    echo "$name $(cat /sys/block/nbd0/queue/$name)"
done > queue.txt
echo "ro $(cat /sys/block/nbd0/ro)" >> queue.txt
# read
dd if=/dev/nbd0 of=read-v.bin bs=1M count=4 iflag=direct status=none
# write 2 MiB at 8 MiB; sync and --flushbufs (do they send a flush?), then fsync (it does)
dd if=write.bin of=/dev/nbd0 bs=64k seek=128 oflag=direct status=none
sync
blockdev --flushbufs /dev/nbd0
curl -sS "http://$METRICS/metrics" > metrics-after-sync.txt
nbd_fsync /dev/nbd0
# trim 9..10 MiB (16 blocks), flush, and ask thinpool what stays mapped
blkdiscard -o 9437184 -l 1048576 /dev/nbd0
nbd_fsync /dev/nbd0
"$THINPOOL" list --json --pool "$POOL" > list-after-trim.json
# a block-status-aware copy into the kernel's device
nbd_up /dev/nbd1 dst
nbdcopy --destination-is-zero --flush "nbd+unix:///src?socket=$NBD_SOCKET" /dev/nbd1
nbd_down /dev/nbd1
curl -sS "http://$METRICS/metrics" > metrics.txt
nbd_down /dev/nbd0
serve_stop
"#;

/// The flags thinpool sends, as the kernel took them (its queue attributes).
fn check_kernel_view(result: &Path) {
    let queue = read_text(&result.join("queue.txt"));
    eprintln!("the kernel's view of /dev/nbd0:\n{queue}");
    let queue: BTreeMap<&str, &str> = queue
        .lines()
        .filter_map(|line| line.split_once(' '))
        .collect();
    // The flags thinpool sends, as the kernel took them: writable, a write-back cache it
    // flushes, FUA, trim; 6.1 has no NBD_CMD_WRITE_ZEROES.
    assert_eq!(queue["ro"], "0");
    assert_eq!(queue["write_cache"], "write back");
    assert_eq!(queue["fua"], "1");
    assert_ne!(queue["discard_max_bytes"], "0");
    assert_eq!(queue["logical_block_size"], "4096");
}

/// nbd-client's connections: four to `v` (`-C 4`), one to `dst`, each NBD_OPT_GO alone and
/// ended cleanly by `nbd-client -d` (NBD_CMD_DISC); no request refused.
fn check_connections(result: &Path) {
    let log = read_text(&result.join("serve.log"));
    let served = connections(&log);
    let kernel: Vec<_> = served
        .iter()
        .filter(|c| matches!(c.export.as_deref(), Some("v") | Some("dst")))
        .collect();
    assert_eq!(
        kernel
            .iter()
            .filter(|c| c.export.as_deref() == Some("v"))
            .count(),
        4,
        "-C 4 makes four connections to v:\n{log}"
    );
    assert_eq!(kernel.len(), 5, "and one to dst:\n{log}");
    for connection in &kernel {
        assert_eq!(
            connection.options,
            [OPT_GO],
            "nbd-client's options: {connection:?}"
        );
        assert_eq!(
            connection.closed,
            Some(Close::Clean),
            "nbd-client -d ends every connection cleanly: {connection:?}"
        );
    }
    eprintln!("connections: {served:?}");
    assert_eq!(
        refused_requests(&log),
        Vec::<String>::new(),
        "refused requests"
    );
}

/// What the kernel sent, by command, from `serve --metrics`.
fn check_requests(result: &Path) {
    let after_sync = request_counts(&read_text(&result.join("metrics-after-sync.txt")));
    let sync_flushes = after_sync[&("v".to_string(), "flush".to_string())];
    eprintln!("flushes to v after sync and blockdev --flushbufs: {sync_flushes}");
    let metrics = read_text(&result.join("metrics.txt"));
    let counts = request_counts(&metrics);
    let count = |volume: &str, op: &str| counts[&(volume.to_string(), op.to_string())];
    eprintln!("requests by command: {counts:?}");
    assert!(
        count("v", "flush") >= sync_flushes + 2,
        "each fsync sends a flush"
    );
    for op in ["read", "write", "flush", "trim"] {
        assert!(
            count("v", op) > 0,
            "the kernel sent no {op} to v: {counts:?}"
        );
    }
    for volume in ["v", "dst"] {
        assert_eq!(count(volume, "zero"), 0, "6.1 sends no WRITE_ZEROES");
        assert_eq!(
            count(volume, "block_status"),
            0,
            "the kernel asks no block status"
        );
    }
    assert!(
        count("src", "block_status") > 0,
        "nbdcopy reads with block status"
    );
    assert!(count("dst", "write") > 0 && count("dst", "flush") > 0);
}

const V_SIZE: u64 = 64 * MIB;
const COPY_SIZE: u64 = 32 * MIB;

#[test]
fn kernel_client_reads_writes_flushes_trims_copies_over_four_connections() {
    let temp = ScratchDir::new("kernel-nbd");
    let result = temp.join("result");
    let pool = make_pool(
        &result,
        "64K",
        "256M",
        &[("v", V_SIZE), ("src", COPY_SIZE), ("dst", COPY_SIZE)],
    );
    let seeded = pattern(1, (4 * MIB) as usize);
    seed(&pool, "v", &[(0, seeded.clone())]);
    let src_extents: Vec<(u64, Vec<u8>)> = [(MIB, 2), (12 * MIB, 1), (COPY_SIZE - MIB, 3)]
        .iter()
        .map(|&(offset, id)| (offset, pattern(10 + id, MIB as usize)))
        .collect();
    seed(&pool, "src", &src_extents);
    let written = pattern(2, (2 * MIB) as usize);
    std::fs::write(result.join("write.bin"), &written).unwrap();

    let serve = guest_serve(&pool).args(&["--metrics", METRICS]);
    let script = format!("METRICS={METRICS}\n{FUNCTION_SCRIPT}");
    let outcome = boot(&result, &serve, &script);
    outcome.assert_success();

    check_kernel_view(&result);
    check_connections(&result);
    check_requests(&result);

    // What the kernel read and what thinpool listed after the trim.
    assert_same_bytes(
        "v read through /dev/nbd0",
        &read(&result.join("read-v.bin")),
        &seeded,
    );
    let after_trim = mapped_blocks(&read_text(&result.join("list-after-trim.json")));
    assert_eq!(
        after_trim["v"],
        64 + 32 - 16,
        "4 MiB seeded + 2 MiB written - 1 MiB trimmed"
    );

    check_clean(&pool);
    let mut expected = vec![0u8; V_SIZE as usize];
    expected[..seeded.len()].copy_from_slice(&seeded);
    expected[(8 * MIB) as usize..(9 * MIB) as usize].copy_from_slice(&written[..MIB as usize]);
    assert_same_bytes("v after the kernel", &image(&pool, "v", V_SIZE), &expected);
    let src = image(&pool, "src", COPY_SIZE);
    assert_same_bytes(
        "dst copied by nbdcopy",
        &image(&pool, "dst", COPY_SIZE),
        &src,
    );
    let listing = listed(&pool);
    assert_eq!(
        listing["dst"], listing["src"],
        "the copy maps only the source's data"
    );
    assert_eq!(listing["src"], 3 * 16, "three 1 MiB extents");
}

/// The restart test's guest script: `w1` flushed (fsync), `w4` written with O_DSYNC (FUA),
/// `w2` written unflushed, the server killed and started again; `-persist` gets 5 s to bring
/// the device back; `w3` written and flushed after the restart.
const RESTART_SCRIPT: &str = r#"
serve_start serve-1.log
nbd_up /dev/nbd0 v -persist
dd if=w1.bin of=/dev/nbd0 bs=64k oflag=direct conv=fsync status=none
dd if=w4.bin of=/dev/nbd0 bs=64k seek=96 oflag=direct,dsync status=none
dd if=w2.bin of=/dev/nbd0 bs=64k seek=32 oflag=direct status=none
serve_kill
serve_start serve-2.log
deadline=$(($(date +%s) + 5))
reconnected=no
while [ $(date +%s) -lt $deadline ]; do
    if nbd_connected /dev/nbd0 && dd if=/dev/nbd0 of=/dev/null bs=4k count=1 iflag=direct status=none 2>/dev/null; then
        reconnected=yes
        break
    fi
    sleep 0.5
done
if [ $reconnected = yes ]; then
    echo reconnected > persist.txt
else
    echo "not reconnected: $(nbd_connected /dev/nbd0 && echo connected but failing || echo disconnected)" > persist.txt
    "$NBD_CLIENT" -d /dev/nbd0 || true
    nbd_up /dev/nbd0 v
fi
dd if=/dev/nbd0 of=read-1.bin bs=64k count=16 iflag=direct status=none
dd if=/dev/nbd0 of=read-2.bin bs=64k count=16 skip=32 iflag=direct status=none
dd if=/dev/nbd0 of=read-4.bin bs=64k count=16 skip=96 iflag=direct status=none
dd if=w3.bin of=/dev/nbd0 bs=64k seek=64 oflag=direct conv=fsync status=none
nbd_down /dev/nbd0
serve_stop
"#;

#[test]
fn kernel_client_loses_no_flushed_write_when_the_server_restarts() {
    let temp = ScratchDir::new("kernel-nbd-restart");
    let size = 16 * MIB;
    let result = temp.join("result");
    let pool = make_pool(&result, "64K", "64M", &[("v", size)]);
    let writes: Vec<Vec<u8>> = (1..=4).map(|id| pattern(20 + id, MIB as usize)).collect();
    for (index, data) in writes.iter().enumerate() {
        std::fs::write(result.join(format!("w{}.bin", index + 1)), data).unwrap();
    }

    let outcome = boot(&result, &guest_serve(&pool), RESTART_SCRIPT);
    outcome.assert_success();
    let persist = read_text(&result.join("persist.txt"));
    eprintln!("nbd-client -persist after the restart: {}", persist.trim());

    assert_same_bytes(
        "the flushed write read after the restart",
        &read(&result.join("read-1.bin")),
        &writes[0],
    );
    assert_same_bytes(
        "the FUA write read after the restart",
        &read(&result.join("read-4.bin")),
        &writes[3],
    );
    // The unflushed write: each 64 KiB block either kept or lost, never torn or misplaced.
    let unflushed = read(&result.join("read-2.bin"));
    for (index, (got, new)) in unflushed
        .chunks(64 * KIB as usize)
        .zip(writes[1].chunks(64 * KIB as usize))
        .enumerate()
    {
        assert!(
            got == new || got.iter().all(|&b| b == 0),
            "unflushed block {index}: neither the write nor zeros"
        );
    }
    check_clean(&pool);
    let mut expected = vec![0u8; size as usize];
    expected[..MIB as usize].copy_from_slice(&writes[0]);
    expected[(2 * MIB) as usize..(3 * MIB) as usize].copy_from_slice(&unflushed);
    expected[(4 * MIB) as usize..(5 * MIB) as usize].copy_from_slice(&writes[2]);
    expected[(6 * MIB) as usize..(7 * MIB) as usize].copy_from_slice(&writes[3]);
    assert_same_bytes("v after the restart", &image(&pool, "v", size), &expected);
}

/// SHA-256 of `chunks`, by the host's `sha256sum` (the same tool the guest runs).
fn sha256(chunks: &[Vec<u8>]) -> String {
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("sha256sum");
    let mut stdin = child.stdin.take().unwrap();
    for chunk in chunks {
        stdin.write_all(chunk).unwrap();
    }
    drop(stdin);
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success());
    String::from_utf8(output.stdout)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

#[test]
fn kernel_reads_a_fully_provisioned_8_mib_block_volume_by_4_kib() {
    let temp = ScratchDir::new("kernel-nbd-8m");
    let size = 128 * MIB;
    let result = temp.join("result");
    let pool = make_pool(&result, "8M", "160M", &[("full", size)]);
    let chunks: Vec<Vec<u8>> = (0..size / (8 * MIB))
        .map(|index| pattern(100 + index, (8 * MIB) as usize))
        .collect();
    let extents: Vec<(u64, Vec<u8>)> = chunks
        .iter()
        .enumerate()
        .map(|(index, chunk)| (index as u64 * 8 * MIB, chunk.clone()))
        .collect();
    seed(&pool, "full", &extents);
    assert_eq!(listed(&pool)["full"], 16, "fully provisioned");

    let script = "serve_start serve.log\n\
                  nbd_up /dev/nbd0 full\n\
                  dd if=/dev/nbd0 bs=4096 2> dd.txt | sha256sum > full.sha256\n\
                  nbd_down /dev/nbd0\n\
                  serve_stop\n";
    let outcome = boot(&result, &guest_serve(&pool), script);
    outcome.assert_success();
    let dd = read_text(&result.join("dd.txt"));
    assert!(dd.contains("32768+0 records in"), "dd read it all: {dd}");
    let guest = read_text(&result.join("full.sha256"));
    let guest = guest.split_whitespace().next().unwrap_or_default();
    assert_eq!(
        guest,
        sha256(&chunks),
        "the kernel read other bytes than were written"
    );
    let log = read_text(&result.join("serve.log"));
    assert_eq!(refused_requests(&log), Vec::<String>::new());
    check_clean(&pool);
}
