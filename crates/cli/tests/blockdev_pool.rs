//! Goal: a pool on block devices (loop devices over files) behaves as a pool on files:
//! create, serve, write, snapshot, crash (SIGKILL) and reopen with every flushed byte kept,
//! grow after the data device grew (`losetup -c`), metadata that both thin_check versions
//! accept on the metadata device after the crash and at the end, and a second server on the
//! same devices refused by the kernel's exclusive open; trimmed blocks passed down to the
//! device (the loop device punches them out of its file); direct I/O on 4 KiB sectors.
//!
//! The data device starts full of 0xA5 bytes, so a block read back as zeros where it was not
//! written proves the zeroing of new blocks on the device. Skipped (saying so) where loop
//! devices cannot be attached, unless `THINPOOL_REQUIRE_LOOP_DEVICES=1`.

mod e2e_support;

use e2e_support::*;
use std::io::Write;
use std::path::Path;
use testkit::loop_device::LoopDevice;
use testkit::tools::ThinTools;

const BLOCK: u64 = 64 * 1024;
const DATA_BYTES: u64 = 32 * MIB;
const GROWN_DATA_BYTES: u64 = 48 * MIB;
const METADATA_BYTES: u64 = 8 * MIB;

/// A file of `size` bytes, every byte `fill`.
fn filled_file(path: &Path, size: u64, fill: u8) {
    let mut file = std::fs::File::create(path).unwrap();
    let chunk = vec![fill; MIB as usize];
    for _ in 0..size / MIB {
        file.write_all(&chunk).unwrap();
    }
    file.sync_all().unwrap();
}

fn status_field(pool: &Path, field: &str) -> serde_json::Value {
    let text = thinpool_ok(&["status", "--pool", &pool.display().to_string(), "--json"]);
    let status: serde_json::Value = serde_json::from_str(&text).unwrap();
    status[field].clone()
}

fn thin_check_both(device: &LoopDevice, when: &str) {
    for tools in ThinTools::all() {
        let output = tools.check(device.path());
        assert!(
            output.success(),
            "thin_check {} on {} {when}:\n{output}",
            tools.version.as_str(),
            device.arg()
        );
    }
}

/// Two loop devices over fresh files: metadata zeroed, data full of 0xA5 (with
/// `data_options` for its `losetup`).
fn devices(
    scratch: &ScratchDir,
    test: &str,
    data_options: &[&str],
) -> Option<(LoopDevice, LoopDevice)> {
    let metadata_file = scratch.join("metadata.img");
    sized_file(&metadata_file, METADATA_BYTES);
    let data_file = scratch.join("data.img");
    filled_file(&data_file, DATA_BYTES, 0xa5);
    let metadata = LoopDevice::attach(&metadata_file, test)?;
    let data = LoopDevice::attach_with(&data_file, test, data_options)?;
    Some((metadata, data))
}

#[test]
fn pool_on_loop_devices_survives_kill_and_grows_with_its_device() {
    let scratch = ScratchDir::new("blockdev-pool");
    let Some((metadata, data)) = devices(&scratch, "blockdev_pool", &[]) else {
        return;
    };
    let pool = scratch.join("pool");
    let pool_arg = pool.display().to_string();
    let out = thinpool_ok(&[
        "create",
        "--pool",
        &pool_arg,
        "--metadata-device",
        &metadata.arg(),
        "--data-device",
        &data.arg(),
    ]);
    assert!(out.contains("512 blocks"), "{out}");
    // Only the configuration, the catalog and the options are in the directory.
    assert!(!pool.join("metadata").exists() && !pool.join("data").exists());
    assert!(pool.join("devices.json").exists());
    // A second create on the same metadata device would destroy the pool: refused.
    let refused = thinpool_err(&[
        "create",
        "--pool",
        &scratch.join("other").display().to_string(),
        "--metadata-device",
        &metadata.arg(),
        "--data-device",
        &data.arg(),
    ]);
    assert!(
        refused.contains("already holds dm-thin pool metadata"),
        "{refused}"
    );
    create_volume(&pool, "v1", "8M");
    let status = thinpool_ok(&["status", "--pool", &pool_arg]);
    assert!(
        status.contains(&format!("metadata {}, data {}", metadata.arg(), data.arg())),
        "{status}"
    );

    let served = serve(&pool, &[]);
    // A second server on the same devices (another directory naming them) is refused by the
    // kernel's exclusive open, not only by a lock in the directory.
    let twin = scratch.join("twin");
    std::fs::create_dir(&twin).unwrap();
    std::fs::copy(pool.join("devices.json"), twin.join("devices.json")).unwrap();
    std::fs::copy(pool.join("pool.json"), twin.join("pool.json")).unwrap();
    for entry in std::fs::read_dir(&pool).unwrap() {
        let name = entry.unwrap().file_name();
        if name.to_string_lossy().starts_with("catalog-") {
            std::fs::copy(pool.join(&name), twin.join(&name)).unwrap();
        }
    }
    let busy = thinpool_err(&["serve", "--pool", &twin.display().to_string()]);
    assert!(busy.contains("held by another process"), "{busy}");

    // Flushed writes: a whole block, small writes in the middle of fresh blocks (the rest of
    // those blocks must read as zeros, not as the device's 0xA5).
    let whole = pattern(1, BLOCK as usize);
    let small = pattern(2, 4096);
    let odd = pattern(3, 1536);
    let mut client = Client::open(&served.socket, "v1");
    client.write(0, &whole);
    client.write(3 * BLOCK + 8192, &small);
    client.write(5 * BLOCK + 512, &odd);
    client.flush();
    let mut expected = vec![0u8; (8 * BLOCK) as usize];
    expected[..BLOCK as usize].copy_from_slice(&whole);
    expected[(3 * BLOCK + 8192) as usize..(3 * BLOCK + 8192 + 4096) as usize]
        .copy_from_slice(&small);
    expected[(5 * BLOCK + 512) as usize..(5 * BLOCK + 2048) as usize].copy_from_slice(&odd);
    assert!(client.read(0, 8 * BLOCK) == expected, "read back differs");
    drop(client);

    // A snapshot keeps this state; the origin moves on, flushed, then unflushed writes
    // are cut short by SIGKILL.
    thinpool_ok(&["volume", "snapshot", "--pool", &pool_arg, "v1", "s1"]);
    let later = pattern(4, BLOCK as usize);
    let mut client = Client::open(&served.socket, "v1");
    client.write(BLOCK, &later);
    client.flush();
    client.write(2 * BLOCK, &pattern(5, BLOCK as usize));
    served.kill9();
    drop(client);
    thin_check_both(&metadata, "after SIGKILL");

    let served = serve(&pool, &[]);
    let mut origin = Client::open(&served.socket, "v1");
    let mut after = expected.clone();
    after[BLOCK as usize..2 * BLOCK as usize].copy_from_slice(&later);
    let read = origin.read(0, 8 * BLOCK);
    assert!(
        read[..2 * BLOCK as usize] == after[..2 * BLOCK as usize],
        "flushed data lost"
    );
    assert!(
        read[3 * BLOCK as usize..] == after[3 * BLOCK as usize..],
        "flushed data lost"
    );
    let third = &read[2 * BLOCK as usize..3 * BLOCK as usize];
    assert!(
        third.iter().all(|&b| b == 0) || third == pattern(5, BLOCK as usize).as_slice(),
        "an unflushed write left something else than before or after"
    );
    let mut snapshot = Client::open(&served.socket, "s1");
    assert!(snapshot.read(0, 8 * BLOCK) == expected, "snapshot changed");
    drop((origin, snapshot));

    // The data device grows; `create --grow` without a size takes its new size.
    std::fs::OpenOptions::new()
        .write(true)
        .open(data.file())
        .unwrap()
        .set_len(GROWN_DATA_BYTES)
        .unwrap();
    data.refresh_size();
    let out = thinpool_ok(&["create", "--pool", &pool_arg, "--grow"]);
    assert!(out.contains("768 blocks"), "{out}");
    assert_eq!(status_field(&pool, "data_total_blocks"), 768);
    assert!(served.stop().success());
    thin_check_both(&metadata, "after the grow");

    // Reopened, the pool has its grown size and the data.
    assert_eq!(status_field(&pool, "data_total_blocks"), 768);
    let served = serve(&pool, &[]);
    let mut origin = Client::open(&served.socket, "v1");
    assert!(origin.read(BLOCK, BLOCK) == later);
    drop(origin);
    assert!(served.stop().success());
}

#[test]
fn direct_io_pool_reads_back_aligned_and_unaligned_writes() {
    let scratch = ScratchDir::new("blockdev-direct");
    // 4 KiB logical blocks: 512-byte-aligned transfers take the buffered path beside the
    // direct one.
    let Some((metadata, data)) =
        devices(&scratch, "blockdev_pool direct", &["--sector-size", "4096"])
    else {
        return;
    };
    let pool = scratch.join("pool");
    let pool_arg = pool.display().to_string();
    thinpool_ok(&[
        "create",
        "--pool",
        &pool_arg,
        "--metadata-device",
        &metadata.arg(),
        "--data-device",
        &data.arg(),
        "--direct-io",
    ]);
    create_volume(&pool, "v", "4M");
    let writes: Vec<(u64, Vec<u8>)> = vec![
        (0, pattern(10, 2 * BLOCK as usize)),
        (4 * BLOCK + 512, pattern(11, 4096)),
        (6 * BLOCK + 1536, pattern(12, 1536)),
        (7 * BLOCK + 4096 - 512, pattern(13, 1024)),
    ];
    let mut model = vec![0u8; (8 * BLOCK) as usize];
    for (offset, bytes) in &writes {
        model[*offset as usize..*offset as usize + bytes.len()].copy_from_slice(bytes);
    }
    let served = serve(&pool, &[]);
    let mut client = Client::open(&served.socket, "v");
    for (offset, bytes) in &writes {
        client.write(*offset, bytes);
    }
    client.flush();
    assert!(client.read(0, 8 * BLOCK) == model, "read back differs");
    // A read not aligned to the device's 4 KiB, across two blocks.
    assert!(
        client.read(BLOCK - 512, 1024) == model[(BLOCK - 512) as usize..(BLOCK + 512) as usize]
    );
    drop(client);
    assert!(served.stop().success());
    thin_check_both(&metadata, "after a direct-I/O run");
    let served = serve(&pool, &[]);
    let mut client = Client::open(&served.socket, "v");
    assert!(
        client.read(0, 8 * BLOCK) == model,
        "read back after reopen differs"
    );
    drop(client);
    assert!(served.stop().success());
}

/// Bytes of the file at `path` that are holes (`SEEK_HOLE` / `SEEK_DATA`): what a punched
/// range becomes, whatever else the file system counts in the file's blocks (the nodes of
/// its extent tree, which a punch may add).
fn hole_bytes(path: &Path) -> u64 {
    use rustix::fs::{seek, SeekFrom};
    let file = std::fs::File::open(path).unwrap();
    let size = file.metadata().unwrap().len();
    let (mut holes, mut offset) = (0, 0);
    while offset < size {
        let hole = seek(&file, SeekFrom::Hole(offset)).unwrap();
        if hole >= size {
            break;
        }
        let data = match seek(&file, SeekFrom::Data(hole)) {
            Ok(data) => data,
            Err(rustix::io::Errno::NXIO) => size,
            Err(e) => panic!("SEEK_DATA in {}: {e}", path.display()),
        };
        holes += data - hole;
        offset = data;
    }
    holes
}

/// Bytes the file at `path` has allocated on its file system (for messages).
fn allocated_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks() * 512
}

/// Regression (timed out under load in CI, not reproduced here): the wait compared the data
/// file's allocated bytes, which also count the file system's own blocks, with the trimmed
/// bytes. It now waits for the holes the passdown punches, and a timeout says what the pool
/// passed down and what the file holds.
#[test]
fn trimmed_blocks_are_passed_down_to_the_device() {
    let scratch = ScratchDir::new("blockdev-passdown");
    let Some((metadata, data)) = devices(&scratch, "blockdev_pool passdown", &[]) else {
        return;
    };
    let pool = scratch.join("pool");
    let pool_arg = pool.display().to_string();
    thinpool_ok(&[
        "create",
        "--pool",
        &pool_arg,
        "--metadata-device",
        &metadata.arg(),
        "--data-device",
        &data.arg(),
    ]);
    // A loop device discards (its file system punches holes), so passdown stays on.
    assert_eq!(status_field(&pool, "discard_passdown"), true);
    create_volume(&pool, "v", "4M");
    let served = serve(&pool, &[]);
    let mut client = Client::open(&served.socket, "v");
    for block in 0..8 {
        client.write(block * BLOCK, &pattern(20 + block, BLOCK as usize));
    }
    client.flush();
    let (holes_before, allocated_before) = (hole_bytes(data.file()), allocated_bytes(data.file()));
    // Unmapping 4 whole blocks frees 4 data blocks; once their grace period is over the
    // pool passes them down and the loop device punches them out of its file.
    let reply = client.request(CMD_TRIM, 0, 0, 4 * BLOCK, &[]);
    assert_eq!(reply.error, 0, "trim: {}", reply.error_message);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut flushes = 0;
    loop {
        // Each flush commits, which releases (and passes down) freed blocks out of grace.
        client.flush();
        flushes += 1;
        if hole_bytes(data.file()) - holes_before >= 4 * BLOCK {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for the trimmed blocks to leave the data device's file: \
             after {flushes} flushes the pool passed down {} bytes (passdown {}); the file \
             has {} bytes of holes (before the trim {holes_before}), {} allocated (before \
             {allocated_before})",
            status_field(&pool, "data_passed_down_bytes"),
            status_field(&pool, "discard_passdown"),
            hole_bytes(data.file()),
            allocated_bytes(data.file()),
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(client.read(0, 4 * BLOCK).iter().all(|&b| b == 0));
    assert!(client.read(4 * BLOCK, BLOCK) == pattern(24, BLOCK as usize));
    drop(client);
    assert!(served.stop().success());
    thin_check_both(&metadata, "after passdown");
}
