//! Goal: a crash on either side of a pool shared by the real kernel's dm-thin (User-Mode
//! Linux, `testkit::uml`) and thinpool loses no write that a completed flush covered.
//!
//! - The kernel crashes: a writer inside UML overwrites 64 KiB slots of a thin volume
//!   (activated with `dmsetup` over a pool thinpool made) with self-describing sectors and
//!   `fsync`s the device every few writes (a flush, which makes dm-thin commit), recording
//!   each flushed generation in the result directory only after the `fsync` returned. UML is
//!   killed (SIGKILL to its process group) mid-run; thinpool's check and both thin_check
//!   versions are clean, and every slot thinpool serves holds at least its flushed
//!   generation.
//! - thinpool crashes: a client writes and flushes the same way through `thinpool serve`,
//!   which is killed (SIGKILL by pid) mid-run; the kernel activates the pool and every slot
//!   it reads holds at least the generation thinpool acknowledged with a flush.
//!
//! Each sector is (slot, generation, sector index, then a fill byte of all three), so a
//! misplaced, stale or torn sector is told apart. Seeded by testkit (`THINPOOL_SEED`).

mod e2e_support;

use e2e_support::*;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use testkit::slots::{check_volume, slot_image};
use testkit::tools::ThinTools;
use testkit::uml::{Boot, Uml, DM_THIN_MODULES};

const SLOT_BYTES: usize = 64 * 1024;
const SLOTS: u64 = 64;
const VOLUME_BYTES: u64 = SLOTS * SLOT_BYTES as u64;
const WRITES_PER_FLUSH: usize = 4;
/// Flushed writes to wait for before the crash.
const RECORDS_BEFORE_CRASH: usize = 48;

/// The same image, made by the guest's writer (python3 from the host, through hostfs).
const GUEST_WRITER: &str = r#"
import os, struct, sys
device, record_path, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
SLOT, SECTOR, SLOTS, PER_FLUSH = 65536, 4096, 64, 4
def image(slot, generation):
    out = bytearray()
    for sector in range(SLOT // SECTOR):
        fill = (slot * 7 + generation * 13 + sector * 31) & 0xff
        out += struct.pack("<QQQ", slot, generation, sector) + bytes([fill]) * (SECTOR - 24)
    return bytes(out)
fd = os.open(device, os.O_RDWR)
record = open(record_path, "a")
state = seed | 1
generation = 0
while True:
    pending = []
    for _ in range(PER_FLUSH):
        state ^= (state << 13) & 0xffffffffffffffff
        state ^= state >> 7
        state ^= (state << 17) & 0xffffffffffffffff
        slot = state % SLOTS
        generation += 1
        os.pwrite(fd, image(slot, generation), slot * SLOT)
        pending.append((slot, generation))
    os.fsync(fd)
    record.write("".join("%d %d\n" % p for p in pending))
    record.flush()
    os.fsync(record.fileno())
"#;

/// A 64 KiB-block file pool with volume `v`; its thin id.
fn make_pool(pool: &Path) -> u32 {
    create_pool(pool, &["--data-size", "32M", "--block-size", "64K"]);
    create_volume(pool, "v", &VOLUME_BYTES.to_string());
    let text = thinpool_ok(&["list", "--json", "--pool", pool.to_str().unwrap()]);
    let listing: serde_json::Value = serde_json::from_str(&text).unwrap();
    listing["volumes"][0]["id"].as_u64().unwrap() as u32
}

fn activate_script(id: u32, data_sectors: u64) -> String {
    format!(
        "dmsetup --noudevsync create pool --table '0 {data_sectors} thin-pool /dev/ubda /dev/ubdb 128 0'\n\
         dmsetup --noudevsync create v --table '0 {} thin /dev/mapper/pool {id}'\n",
        VOLUME_BYTES / 512
    )
}

#[test]
fn kernel_killed_while_flushing_loses_no_flushed_write() {
    let report = seed_report();
    let seed = report.seed();
    let uml = Uml::find();
    let temp = ScratchDir::new("kernel-crash");
    let pool = temp.join("pool");
    let id = make_pool(&pool);
    let result = temp.join("result");
    std::fs::create_dir_all(&result).unwrap();
    std::fs::write(result.join("writer.py"), GUEST_WRITER).unwrap();
    let data_sectors = std::fs::metadata(pool.join("data")).unwrap().len() / 512;
    let script = format!(
        "{}: > records\nexec /usr/bin/python3 writer.py /dev/mapper/v records {seed}\n",
        activate_script(id, data_sectors)
    );
    let mut running = Boot::new(&uml, &result)
        .modules(&DM_THIN_MODULES)
        .disk(&pool.join("metadata"))
        .disk(&pool.join("data"))
        .script(&script)
        .spawn();
    let records = result.join("records");
    let count = || {
        std::fs::read_to_string(&records)
            .map(|text| text.lines().count())
            .unwrap_or(0)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(240);
    while count() < RECORDS_BEFORE_CRASH {
        assert!(
            std::time::Instant::now() < deadline,
            "the guest writer did not flush {RECORDS_BEFORE_CRASH} writes in time\n--- console ---\n{}",
            running.console()
        );
        assert!(
            !running.has_exited(),
            "UML stopped before the writer flushed {RECORDS_BEFORE_CRASH} writes\n--- console ---\n{}",
            running.console()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Crash at a seeded moment a little later, likely mid-write.
    std::thread::sleep(Duration::from_millis(seed % 700));
    running.kill_group();
    let console = running.console();
    drop(running);

    let mut flushed = vec![0u64; SLOTS as usize];
    let text = std::fs::read_to_string(&records).unwrap();
    for line in text.lines() {
        let mut fields = line.split_whitespace();
        let (Some(slot), Some(generation), None) = (fields.next(), fields.next(), fields.next())
        else {
            // The last line may be torn by the kill: it was not complete, so not relied on.
            continue;
        };
        let (slot, generation): (usize, u64) = (slot.parse().unwrap(), generation.parse().unwrap());
        flushed[slot] = flushed[slot].max(generation);
    }

    let check = thinpool(&["check", pool.join("metadata").to_str().unwrap()]);
    assert!(
        check.status.success(),
        "thinpool check after the kernel crashed:\n{}{}\n--- console ---\n{console}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    ThinTools::check_all(&pool.join("metadata"));
    let served = serve(&pool, &["--quiet"]);
    let mut client = Client::open(&served.socket, "v");
    let image = client.read(0, VOLUME_BYTES);
    client.disconnect();
    assert!(served.stop().success());
    let slots = check_volume("after the kernel crashed, v", &image, SLOT_BYTES, &flushed);
    assert!(slots > 0, "no flushed write recorded");
    eprintln!(
        "kernel crash: {} flushed writes recorded, {slots} slots checked",
        text.lines().count()
    );
}

#[test]
fn thinpool_killed_while_flushing_loses_no_flushed_write_the_kernel_reads() {
    let report = seed_report();
    let seed = report.seed();
    let uml = Uml::find();
    let temp = ScratchDir::new("thinpool-crash-kernel");
    let pool = temp.join("pool");
    let id = make_pool(&pool);
    let flushed = Arc::new(Mutex::new(vec![0u64; SLOTS as usize]));
    let served = serve(&pool, &["--quiet"]);
    let writer = {
        let socket = served.socket.clone();
        let flushed = Arc::clone(&flushed);
        std::thread::spawn(move || {
            let Ok(mut client) = Client::try_open(&socket, "v") else {
                return 0u64;
            };
            let mut state = seed | 1;
            let mut generation = 0u64;
            let mut pending = Vec::new();
            loop {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let slot = state % SLOTS;
                generation += 1;
                let image = slot_image(slot, generation, SLOT_BYTES);
                let ok = client
                    .try_request(CMD_WRITE, slot * SLOT_BYTES as u64, &image)
                    .is_ok_and(|reply| reply.error == 0);
                if !ok {
                    return generation;
                }
                pending.push((slot, generation));
                if pending.len() == WRITES_PER_FLUSH {
                    let ok = client
                        .try_request(CMD_FLUSH, 0, &[])
                        .is_ok_and(|reply| reply.error == 0);
                    if !ok {
                        return generation;
                    }
                    let mut flushed = flushed.lock().unwrap();
                    for (slot, generation) in pending.drain(..) {
                        flushed[slot as usize] = flushed[slot as usize].max(generation);
                    }
                }
            }
        })
    };
    wait_for("flushed writes", Duration::from_secs(120), || {
        flushed.lock().unwrap().iter().filter(|&&g| g > 0).count() >= 24
    });
    std::thread::sleep(Duration::from_millis(seed % 300));
    served.kill9();
    let generations = writer.join().unwrap();
    let flushed = flushed.lock().unwrap().clone();
    ThinTools::check_all(&pool.join("metadata"));

    let result = temp.join("result");
    let data_sectors = std::fs::metadata(pool.join("data")).unwrap().len() / 512;
    let script = format!(
        "{}dmsetup --noudevsync status pool > status\n\
         dd if=/dev/mapper/v of=v.img bs=1M status=none\n\
         dmsetup --noudevsync remove v\ndmsetup --noudevsync remove pool\n",
        activate_script(id, data_sectors)
    );
    Boot::new(&uml, &result)
        .modules(&DM_THIN_MODULES)
        .disk(&pool.join("metadata"))
        .disk(&pool.join("data"))
        .script(&script)
        .run()
        .assert_success();
    let image = std::fs::read(result.join("v.img")).unwrap();
    let slots = check_volume(
        "the kernel's read after thinpool crashed, v",
        &image,
        SLOT_BYTES,
        &flushed,
    );
    assert!(slots > 0);
    ThinTools::check_all(&pool.join("metadata"));
    thinpool_ok(&["check", pool.join("metadata").to_str().unwrap()]);
    eprintln!("thinpool crash: {generations} writes sent, {slots} slots checked in the kernel");
}
