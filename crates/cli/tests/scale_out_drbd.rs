//! Goal: a pool on a real replicated block device survives the loss of its machine
//! (issue 24 item 3, `docs/scale-out.md`): DRBD 8.4 (the kernel's `drbd.ko` in User-Mode
//! Linux, Debian's `drbd-utils`) between two UML kernels on a loopback UDP link
//! (`testkit::uml::net`), nothing leaving the machine.
//!
//! One resource of three volumes, protocol C: `/dev/drbd0` the pool's metadata device,
//! `/dev/drbd1` its data device, `/dev/drbd2` an ext4 file system holding the pool
//! directory (configuration and catalog move with the devices). Node 0 is primary: it
//! creates the pool on the DRBD devices, `thinpool serve`s it, and the kernel's NBD client
//! writes rounds of data, each acknowledged by a flush (`fsync` of `/dev/nbd0`, an NBD
//! flush, a pool commit), then keeps writing without flushing; the host kills node 0's UML
//! (SIGKILL to its process group, by pid: a power cut, which is also the fencing). Node 1
//! notices the peer gone, is promoted, mounts the directory, and checks the metadata
//! (`thinpool check`, `thin_check` 0.9.0 and 1.1.0: clean); it serves the pool and the
//! volume read through NBD holds every flushed round (content compared with the host's
//! copy), the unflushed region whole-or-absent per 4 KiB sector; a write flushed on the new
//! primary is there after a restart of the server.
//!
//! The cost test runs the same `fio` jobs (4 KiB random writes each followed by a flush,
//! random writes, random reads, through `/dev/nbd0`) on the pool on DRBD and on the same
//! pool on node 0's own ubd disks, in one boot, passes alternating, and prints both side by
//! side (figures in `docs/scale-out.md`, taken with this test run alone; nothing is asserted
//! on them).

mod e2e_support;

use e2e_support::*;
use std::path::{Path, PathBuf};
use std::time::Duration;
use testkit::tools::ThinTools;
use testkit::uml::drbd::{parse_proc_drbd, DrbdResource, MinorState};
use testkit::uml::nbd::{GuestServe, NBD_MODULES};
use testkit::uml::net::UcastLink;
use testkit::uml::{shell_quote, Boot, RunningUml, Uml};

const KIB: u64 = 1024;
/// Backing disk sizes, per volume: metadata, data, the pool directory's file system (DRBD
/// keeps its own metadata at their end).
const BACKING_BYTES: [u64; 3] = [12 * MIB, 72 * MIB, 16 * MIB];
const VOLUME_BYTES: u64 = 32 * MIB;
/// Flushed rounds: round r writes `ROUND_BYTES` at `r * 2 MiB + 4 KiB` (partial first and
/// last pool blocks).
const ROUNDS: u64 = 6;
const ROUND_BYTES: u64 = 384 * KIB;
/// The unflushed writes: `UNFLUSHED_CHUNKS` chunks of 256 KiB from 16 MiB, rewritten in a
/// loop until the kill.
const UNFLUSHED_OFFSET: u64 = 16 * MIB;
const UNFLUSHED_CHUNKS: u64 = 32;
const CHUNK_BYTES: u64 = 256 * KIB;
/// The write made on the new primary after the fail-over.
const AFTER_OFFSET: u64 = 28 * MIB;
const AFTER_BYTES: u64 = 128 * KIB;
const GUEST_SOCKET: &str = "/run/thinpool-nbd.sock";
/// Where each guest mounts the pool directory's file system (`/dev/drbd2`).
const DIR_MOUNT: &str = "/run/pool-dir";
const POOL: &str = "/run/pool-dir/pool";
const BOOT_TIMEOUT: Duration = Duration::from_secs(420);

fn round_offset(round: u64) -> u64 {
    round * 2 * MIB + 4 * KIB
}

fn round_data(round: u64) -> Vec<u8> {
    pattern(0xd0bd_0000 + round, ROUND_BYTES as usize)
}

/// Zeroed (sparse) backing files for one node, in `dir`.
fn backing_files(dir: &Path) -> Vec<PathBuf> {
    std::fs::create_dir_all(dir).unwrap();
    BACKING_BYTES
        .iter()
        .enumerate()
        .map(|(volume, bytes)| {
            let path = dir.join(format!("backing-{volume}.img"));
            sized_file(&path, *bytes);
            path
        })
        .collect()
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

fn read_text(path: &Path) -> String {
    String::from_utf8(read(path)).expect("text")
}

/// `thin_check` of both versions on `device`, each into `PREFIX-VERSION.txt`: guest lines.
fn thin_checks(device: &str, prefix: &str) -> String {
    ThinTools::all()
        .iter()
        .map(|tools| {
            format!(
                "{} {device} > {prefix}-{}.txt 2>&1\n",
                shell_quote(&tools.tool("thin_check").display().to_string()),
                tools.version.as_str()
            )
        })
        .collect()
}

/// `dd` of a host file (through hostfs) onto `/dev/nbd0` at `offset` (4 KiB aligned).
fn dd_to_nbd(file: &Path, offset: u64) -> String {
    assert_eq!(offset % (4 * KIB), 0);
    format!(
        "dd if={} of=/dev/nbd0 bs=4k seek={} oflag=direct conv=notrunc status=none\n",
        shell_quote(&file.display().to_string()),
        offset / (4 * KIB)
    )
}

/// Node 0's script: promote, create the pool, write and flush the rounds (each
/// acknowledged by `acked-R`), then write without flushing until killed.
fn primary_script(input: &Path) -> String {
    let mut script = format!(
        "drbd_up
drbd_wait_connected 120
drbd_new_data
drbd_primary
drbd_state drbd-primary.txt
mkfs.ext4 -q /dev/drbd2
mkdir -p {DIR_MOUNT}
mount -t ext4 /dev/drbd2 {DIR_MOUNT}
\"$THINPOOL\" create --pool {POOL} --metadata-device /dev/drbd0 --data-device /dev/drbd1 > create.txt
\"$THINPOOL\" volume create v --size {VOLUME_BYTES} --pool {POOL}
serve_start serve.log
nbd_up /dev/nbd0 v -b 4096
"
    );
    for round in 0..ROUNDS {
        script.push_str(&dd_to_nbd(
            &input.join(format!("round-{round}.bin")),
            round_offset(round),
        ));
        script.push_str(&format!("nbd_fsync /dev/nbd0\ntouch acked-{round}\n"));
    }
    let unflushed = input.join("unflushed.bin");
    script.push_str(&format!(
        "while true; do
    for chunk in $(seq 0 {last}); do
        dd if={file} of=/dev/nbd0 bs=256k skip=$chunk seek=$(({first} + chunk)) count=1 oflag=direct conv=notrunc status=none
        [ -e writing ] || touch writing
    done
done
",
        last = UNFLUSHED_CHUNKS - 1,
        file = shell_quote(&unflushed.display().to_string()),
        first = UNFLUSHED_OFFSET / CHUNK_BYTES,
    ));
    script
}

/// Node 1's script: while node 0 serves, DRBD refuses this node a promotion and any open
/// of the devices; then wait for the host's word that node 0 is dead, notice the peer gone,
/// promote, check, serve, read everything, write once more, restart the server, read again.
fn secondary_script(input: &Path, primary_dir: &Path) -> String {
    let checks = format!(
        "\"$THINPOOL\" check /dev/drbd0 > thinpool-check.txt 2>&1\n{}",
        thin_checks("/dev/drbd0", "thin-check")
    );
    let checks_end = format!(
        "\"$THINPOOL\" check /dev/drbd0 > thinpool-check-end.txt 2>&1\n{}",
        thin_checks("/dev/drbd0", "thin-check-end")
    );
    format!(
        "drbd_up
drbd_wait_connected 120
drbd_state drbd-connected.txt
wait_file() {{
    waited=0
    until [ -e \"$1\" ]; do
        [ $waited -lt 3000 ] || {{ echo \"no $1 in 300 s\"; exit 1; }}
        waited=$((waited + 1))
        sleep 0.1
    done
}}
wait_file {acked}
if drbd_primary 2> refused-primary.txt; then echo 'promoted beside a primary'; exit 1; fi
if dd if=/dev/drbd0 of=/dev/null bs=4k count=1 2> refused-open.txt; then
    echo 'a secondary opened its device'; exit 1
fi
wait_file promote
drbd_wait_peer_lost 60
drbd_primary
drbd_state drbd-promoted.txt
mkdir -p {DIR_MOUNT}
mount -t ext4 /dev/drbd2 {DIR_MOUNT}
{checks}serve_start serve.log
nbd_up /dev/nbd0 v -b 4096
dd if=/dev/nbd0 of=after-failover.bin bs=1M iflag=direct status=none
{after}nbd_fsync /dev/nbd0
nbd_down /dev/nbd0
serve_stop
serve_start serve-2.log
nbd_up /dev/nbd0 v -b 4096
dd if=/dev/nbd0 of=final.bin bs=1M iflag=direct status=none
nbd_down /dev/nbd0
serve_stop
\"$THINPOOL\" list --json --pool {POOL} > list.json
{checks_end}umount {DIR_MOUNT}
",
        after = dd_to_nbd(&input.join("after.bin"), AFTER_OFFSET),
        acked = shell_quote(&primary_dir.join("acked-0").display().to_string()),
    )
}

/// Panics unless every minor of the resource is in `roles` with `disks`.
#[track_caller]
fn assert_minors(what: &str, state: &[MinorState], roles: (&str, &str), disks: (&str, &str)) {
    assert_eq!(state.len(), BACKING_BYTES.len(), "{what}: {state:?}");
    for minor in state {
        assert_eq!(
            (minor.roles.0.as_str(), minor.roles.1.as_str()),
            roles,
            "{what}: {minor:?}"
        );
        assert_eq!(
            (minor.disks.0.as_str(), minor.disks.1.as_str()),
            disks,
            "{what}: {minor:?}"
        );
    }
}

/// The flushed rounds are in `image` exactly; each 4 KiB sector of the unflushed region is
/// zeros or what was written there; elsewhere zeros. Returns the unflushed sectors kept.
#[track_caller]
fn assert_flushed_writes(what: &str, image: &[u8], unflushed: &[u8]) -> usize {
    assert_eq!(image.len() as u64, VOLUME_BYTES, "{what}: size");
    let mut expected = vec![0u8; VOLUME_BYTES as usize];
    for round in 0..ROUNDS {
        let start = round_offset(round) as usize;
        expected[start..start + ROUND_BYTES as usize].copy_from_slice(&round_data(round));
    }
    let region = UNFLUSHED_OFFSET as usize..(UNFLUSHED_OFFSET as usize + unflushed.len());
    let mut kept = 0;
    for (index, (got, want)) in image.chunks(4096).zip(expected.chunks(4096)).enumerate() {
        let offset = index * 4096;
        if region.contains(&offset) {
            let written = &unflushed[offset - region.start..offset - region.start + 4096];
            if got == written {
                kept += 1;
            } else {
                assert!(
                    got.iter().all(|&b| b == 0),
                    "{what}: unflushed sector at {offset} is neither written nor zero"
                );
            }
        } else {
            assert!(got == want, "{what}: the sector at byte {offset} differs");
        }
    }
    kept
}

fn guest_serve() -> GuestServe {
    GuestServe::new(
        Path::new(THINPOOL),
        Path::new(POOL),
        Path::new(GUEST_SOCKET),
    )
}

/// Writes the inputs the guests read: the rounds, the unflushed data, the late write.
fn write_inputs(input: &Path) -> Vec<u8> {
    std::fs::create_dir_all(input).unwrap();
    for round in 0..ROUNDS {
        write(
            &input.join(format!("round-{round}.bin")),
            &round_data(round),
        );
    }
    let unflushed = pattern(0xd0bd_1000, (UNFLUSHED_CHUNKS * CHUNK_BYTES) as usize);
    write(&input.join("unflushed.bin"), &unflushed);
    write(
        &input.join("after.bin"),
        &pattern(0xd0bd_2000, AFTER_BYTES as usize),
    );
    unflushed
}

/// Waits for `file` in a running node's result directory; panics with its console if not.
fn await_file(node: &mut RunningUml, file: &str, what: &str) {
    assert!(
        node.wait_for_file(file, BOOT_TIMEOUT),
        "{what}: no {file}\n--- console ---\n{}",
        node.console()
    );
}

#[test]
fn pool_on_drbd_survives_the_primary_killed() {
    let uml = Uml::find();
    let scratch = ScratchDir::new("scale-out-drbd");
    let input = scratch.join("input");
    let unflushed = write_inputs(&input);
    let link = UcastLink::new();
    let resource = DrbdResource::new("pool", BACKING_BYTES.len(), &link);
    let config = scratch.join("drbd.res");
    resource.write_config(&config);
    let serve = guest_serve().prelude();
    let (dir0, dir1) = (scratch.join("node0"), scratch.join("node1"));
    let node = |side: usize, dir: &Path, script: String| {
        let node = resource.node(side);
        node.boot(
            Boot::new(&uml, dir),
            &backing_files(&scratch.join(format!("disks{side}"))),
        )
        .modules(&NBD_MODULES)
        .timeout(BOOT_TIMEOUT)
        .script(&format!("{}\n{serve}\n{script}", node.prelude(&config)))
    };
    let secondary = node(1, &dir1, secondary_script(&input, &dir0));
    let primary = node(0, &dir0, primary_script(&input));
    let mut secondary = secondary.spawn();
    let mut primary = primary.spawn();
    await_file(&mut primary, &format!("acked-{}", ROUNDS - 1), "node 0");
    await_file(&mut primary, "writing", "node 0");
    std::thread::sleep(Duration::from_millis(500));
    // The power cut (and the fencing): node 0 is dead before node 1 may take over.
    primary.kill_group();
    assert!(primary.has_exited());
    let state = parse_proc_drbd(&read_text(&dir0.join("drbd-primary.txt")));
    assert_minors(
        "node 0 promoted",
        &state,
        ("Primary", "Secondary"),
        ("UpToDate", "UpToDate"),
    );
    write(&dir1.join("promote"), b"node 0 killed\n");
    let outcome = secondary.wait(BOOT_TIMEOUT);
    outcome.assert_success();
    eprintln!(
        "node 1: {:.1} s wall; node 0 killed after acknowledging {ROUNDS} flushed rounds",
        outcome.elapsed.as_secs_f64()
    );

    let state = parse_proc_drbd(&read_text(&dir1.join("drbd-promoted.txt")));
    assert_minors(
        "node 1 promoted",
        &state,
        ("Primary", "Unknown"),
        ("UpToDate", "DUnknown"),
    );
    let mut reports = vec![
        "thinpool-check".to_string(),
        "thinpool-check-end".to_string(),
    ];
    for version in ThinTools::all().iter().map(|tools| tools.version.as_str()) {
        reports.push(format!("thin-check-{version}"));
        reports.push(format!("thin-check-end-{version}"));
    }
    for name in reports {
        // Each ran under `sh -e`: a failing check failed the script above.
        let text = read_text(&dir1.join(format!("{name}.txt")));
        eprintln!("{name}: {}", text.trim());
    }
    let image = read(&dir1.join("after-failover.bin"));
    let kept = assert_flushed_writes("after the fail-over", &image, &unflushed);
    eprintln!(
        "unflushed sectors kept: {kept} of {}",
        unflushed.len() / 4096
    );
    let mut expected = image.clone();
    let start = AFTER_OFFSET as usize;
    expected[start..start + AFTER_BYTES as usize].copy_from_slice(&read(&input.join("after.bin")));
    assert!(
        read(&dir1.join("final.bin")) == expected,
        "the write flushed on the new primary is not there after a restart"
    );
    for refusal in ["refused-primary.txt", "refused-open.txt"] {
        eprintln!(
            "node 1 beside the primary, {refusal}: {}",
            read_text(&dir1.join(refusal)).trim()
        );
    }
    let list = read_text(&dir1.join("list.json"));
    assert!(list.contains("\"v\""), "{list}");
}

/// The cost jobs: `(name, fio arguments)`, 4 KiB at queue depth 1 on an 8 MiB region the
/// script wrote (and flushed) first, so every I/O hits mapped blocks.
const COST_JOBS: [(&str, &str); 3] = [
    ("randwrite-flush", "--rw=randwrite --fsync=1"),
    ("randwrite", "--rw=randwrite"),
    ("randread", "--rw=randread"),
];
const COST_SECONDS: u32 = 4;
const COST_REGION: u64 = 8 * MIB;
/// Passes over both pools, alternating (local, DRBD, local, DRBD), so that the machine's
/// load, which changes from minute to minute here, weighs on both alike.
const COST_PASSES: u32 = 2;
/// The local pool: on node 0's own disks after the DRBD backing disks.
const LOCAL_POOL: &str = "/run/local-pool";
const LOCAL_DEVICES: [&str; 2] = ["/dev/ubdd", "/dev/ubde"];

/// Node 0's cost script: both pools made, then `measure LABEL` on each in turn.
fn cost_script() -> String {
    let mut jobs = String::new();
    for (name, args) in COST_JOBS {
        jobs.push_str(&format!(
            "    fio --name={name} --filename=/dev/nbd0 --ioengine=psync --direct=1 --bs=4k \
             --size={COST_REGION} --time_based --runtime={COST_SECONDS} {args} \
             --output-format=json --output=fio-$1-{name}.json\n"
        ));
    }
    let mut script = format!(
        "drbd_up
drbd_wait_connected 120
drbd_new_data
drbd_primary
mkfs.ext4 -q /dev/drbd2
mkdir -p {DIR_MOUNT}
mount -t ext4 /dev/drbd2 {DIR_MOUNT}
\"$THINPOOL\" create --pool {POOL} --metadata-device /dev/drbd0 --data-device /dev/drbd1 > create.txt
\"$THINPOOL\" create --pool {LOCAL_POOL} --metadata-device {} --data-device {} > create-local.txt
for pool in {POOL} {LOCAL_POOL}; do
    \"$THINPOOL\" volume create v --size {VOLUME_BYTES} --pool $pool
done
measure() {{
    serve_start serve-$1.log
    nbd_up /dev/nbd0 v -b 4096
    dd if=/dev/urandom of=/dev/nbd0 bs=1M count={fill} oflag=direct status=none
    nbd_fsync /dev/nbd0
{jobs}    nbd_down /dev/nbd0
    serve_stop
}}
",
        LOCAL_DEVICES[0],
        LOCAL_DEVICES[1],
        fill = COST_REGION / MIB
    );
    for pass in 0..COST_PASSES {
        script.push_str(&format!(
            "POOL={LOCAL_POOL}; measure local-{pass}\nPOOL={POOL}; measure drbd-{pass}\n"
        ));
    }
    script.push_str("drbd_state drbd-end.txt\ntouch done\n");
    script
}

/// One job's figures: IOPS, mean and 99th percentile completion latency (µs) of its
/// reads or writes, and for a flushing job the mean flush latency (µs).
fn fio_figures(path: &Path) -> (f64, f64, f64, Option<f64>) {
    let json: serde_json::Value = serde_json::from_str(&read_text(path)).expect("fio json");
    let job = &json["jobs"][0];
    let side = if job["read"]["io_bytes"].as_u64().unwrap_or(0) > 0 {
        &job["read"]
    } else {
        &job["write"]
    };
    let iops = side["iops"].as_f64().expect("iops");
    let mean = side["clat_ns"]["mean"].as_f64().expect("clat mean") / 1000.0;
    let p99 = side["clat_ns"]["percentile"]["99.000000"]
        .as_f64()
        .unwrap_or(0.0)
        / 1000.0;
    let sync = job["sync"]["lat_ns"]["mean"]
        .as_f64()
        .filter(|mean| *mean > 0.0)
        .map(|mean| mean / 1000.0);
    assert!(iops > 0.0, "{}: no I/O done", path.display());
    (iops, mean, p99, sync)
}

/// Prints one measurement's figures, one line per job.
fn print_figures(label: &str, dir: &Path) {
    for (name, _) in COST_JOBS {
        let (iops, mean, p99, sync) = fio_figures(&dir.join(format!("fio-{label}-{name}.json")));
        let sync = sync.map_or(String::new(), |sync| format!(", flush {sync:.0} µs"));
        eprintln!(
            "{label:>8} {name:>16}: {iops:>7.0} IOPS, latency mean {mean:.0} µs, p99 {p99:.0} µs{sync}"
        );
    }
}

/// Not a timing assertion: the figures are printed for `docs/scale-out.md`; the test fails
/// only if a job did no I/O or the peer fell out of sync.
#[test]
fn pool_on_drbd_costs_beside_local_disks() {
    let uml = Uml::find();
    let scratch = ScratchDir::new("scale-out-drbd-cost");
    let serve = guest_serve().prelude();
    let link = UcastLink::new();
    let resource = DrbdResource::new("pool", BACKING_BYTES.len(), &link);
    let config = scratch.join("drbd.res");
    resource.write_config(&config);
    let (dir0, dir1) = (scratch.join("node0"), scratch.join("node1"));
    let secondary_script = format!(
        "drbd_up\ndrbd_wait_connected 120\nuntil [ -e {done} ]; do sleep 0.2; done\n\
         drbd_state drbd-end.txt\n",
        done = shell_quote(&dir0.join("done").display().to_string())
    );
    let boot = |side: usize, dir: &Path, script: String| {
        let node = resource.node(side);
        let backing = backing_files(&scratch.join(format!("disks{side}")));
        node.boot(Boot::new(&uml, dir), &backing)
            .modules(&NBD_MODULES)
            .timeout(BOOT_TIMEOUT)
            .script(&format!("{}\n{serve}\n{script}", node.prelude(&config)))
    };
    let mut secondary = boot(1, &dir1, secondary_script).spawn();
    // The same pool on node 0's own ubd disks, as big as the DRBD backing disks.
    let local = backing_files(&scratch.join("disks-local"));
    let primary = boot(0, &dir0, cost_script())
        .disk(&local[0])
        .disk(&local[1])
        .run();
    primary.assert_success();
    secondary.wait(BOOT_TIMEOUT).assert_success();
    for dir in [&dir0, &dir1] {
        let state = parse_proc_drbd(&read_text(&dir.join("drbd-end.txt")));
        assert!(
            state.len() == BACKING_BYTES.len()
                && state.iter().all(|minor| minor.connection == "Connected"
                    && minor.disks == ("UpToDate".into(), "UpToDate".into())
                    && minor.out_of_sync_kib == 0),
            "after the jobs: {state:?}"
        );
    }
    eprintln!(
        "4 KiB, queue depth 1, through the kernel's NBD client in UML, {COST_SECONDS} s each, \
         passes alternating:"
    );
    for pass in 0..COST_PASSES {
        print_figures(&format!("local-{pass}"), &dir0);
        print_figures(&format!("drbd-{pass}"), &dir0);
    }
}
