//! Goal: the real kernel's dm-thin (Linux 6.1 in User-Mode Linux, `testkit::uml`) and
//! thinpool run the same pools, both ways, checked by content.
//!
//! - thinpool → kernel → thinpool (file pools with 64 KiB and 8 MiB blocks and a pool on
//!   loop devices, which the kernel opens as its disks too, all in one boot):
//!   thinpool makes volumes and a snapshot with seeded content written through `thinpool
//!   serve`; the kernel activates each pool (`dmsetup create` with a `thin-pool` table over
//!   the pool's metadata and data files or devices as ubd disks, a `thin` table per volume by thin
//!   id) and every volume reads what thinpool served; its transaction id and used data
//!   blocks are thinpool's. The kernel then writes, discards, snapshots (`create_snap`),
//!   deletes that snapshot, reserves and releases a metadata snapshot and removes its
//!   devices; thinpool's check and both thin_check versions are clean and every volume
//!   reads what the kernel read last.
//! - The kernel changes a thinpool pool behind the catalog (issue 20 finding 11, issue 22
//!   item 3): `create_snap` of a volume and a `delete` of another; thinpool opens it,
//!   names the unadopted thin id and the orphaned name, serves the rest, `volume adopt`
//!   names the snapshot (its content is its origin's at snapshot time) and `volume
//!   forget` drops the deleted one; both thin_check versions are clean.
//! - kernel → thinpool → kernel (loop devices over the files for `thinpool import`): the
//!   kernel makes a pool from zeroed metadata, two thins, ext4 on one, a snapshot of each,
//!   and moves the transaction id; `thinpool import` takes it over and every volume reads
//!   what the kernel read; thinpool writes and snapshots; the kernel activates it again and
//!   reads exactly what thinpool served, ext4 passes `fsck -n` and mounts with its files,
//!   and a kernel write to the origin of thinpool's snapshot leaves the snapshot as it was
//!   (the time fields thinpool wrote make the kernel copy). In the first direction too, the
//!   kernel's write to a block `a` shares with thinpool's snapshot `s` leaves `s` alone.
//!
//! Skips nothing: UML comes from `scripts/fetch-uml` (a missing kernel fails the test).

mod e2e_support;

use e2e_support::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use testkit::loop_device::LoopDevice;
use testkit::slots::assert_same_bytes;
use testkit::tools::ThinTools;
use testkit::uml::{Boot, Uml, DM_THIN_MODULES};

const KIB: u64 = 1024;

/// Shell functions every guest script starts with.
const GUEST_PRELUDE: &str = r#"
dm() { dmsetup --noudevsync "$@"; }
# pool_up NAME METADATA_DEV DATA_DEV BLOCK_SECTORS DATA_SECTORS
pool_up() { dm create "$1" --table "0 $5 thin-pool $2 $3 $4 0"; }
# thin_up NAME POOL ID SECTORS
thin_up() { dm create "$1" --table "0 $4 thin /dev/mapper/$2 $3"; }
# image DEVICE FILE: the device's bytes into the result directory
image() { dd if="$1" of="$2" bs=1M status=none; }
"#;

/// A volume as thinpool's catalog names it.
#[derive(Clone, Debug)]
struct Volume {
    name: String,
    id: u32,
    size: u64,
}

fn volumes(pool: &Path) -> Vec<Volume> {
    let text = thinpool_ok(&["list", "--json", "--pool", pool.to_str().unwrap()]);
    let listing: serde_json::Value = serde_json::from_str(&text).expect("list --json");
    listing["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .map(|volume| Volume {
            name: volume["name"].as_str().unwrap().to_string(),
            id: volume["id"].as_u64().unwrap() as u32,
            size: volume["size_bytes"].as_u64().unwrap(),
        })
        .collect()
}

fn status(pool: &Path) -> serde_json::Value {
    let text = thinpool_ok(&["status", "--json", "--pool", pool.to_str().unwrap()]);
    serde_json::from_str(&text).expect("status --json")
}

/// Every volume's bytes as `thinpool serve` serves them.
fn served_images(pool: &Path) -> BTreeMap<String, Vec<u8>> {
    let served = serve(pool, &["--quiet"]);
    let mut images = BTreeMap::new();
    for volume in volumes(pool) {
        let mut client = Client::open(&served.socket, &volume.name);
        let mut image = Vec::with_capacity(volume.size as usize);
        let mut offset = 0;
        while offset < volume.size {
            let length = (volume.size - offset).min(4 * MIB);
            image.extend_from_slice(&client.read(offset, length));
            offset += length;
        }
        client.disconnect();
        images.insert(volume.name.clone(), image);
    }
    assert!(served.stop().success());
    images
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// The fields of `dmsetup status POOL`'s thin-pool line after "0 LENGTH thin-pool".
struct KernelPoolStatus {
    transaction_id: u64,
    used_metadata_blocks: u64,
    total_metadata_blocks: u64,
    used_data_blocks: u64,
    held_metadata_root: String,
    line: String,
}

fn kernel_pool_status(path: &Path) -> KernelPoolStatus {
    let line = String::from_utf8(read(path)).unwrap();
    let fields: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(fields.get(2), Some(&"thin-pool"), "status: {line}");
    let used_data = fields[5].split('/').next().unwrap();
    let (used_metadata, total_metadata) = fields[4].split_once('/').unwrap();
    KernelPoolStatus {
        transaction_id: fields[3].parse().unwrap(),
        used_metadata_blocks: used_metadata.parse().unwrap(),
        total_metadata_blocks: total_metadata.parse().unwrap(),
        used_data_blocks: used_data.parse().unwrap(),
        held_metadata_root: fields[6].to_string(),
        line: line.trim().to_string(),
    }
}

/// One thinpool pool taken through the kernel: its layout and what it held.
struct PoolCase {
    label: String,
    dir: PathBuf,
    /// The metadata and data files, or the loop devices the pool was created on (the
    /// kernel gets the same paths as ubd disks).
    metadata: PathBuf,
    data: PathBuf,
    block: u64,
    data_bytes: u64,
    /// `thinpool status --json` before the kernel ran.
    status_before: serde_json::Value,
    /// What thinpool served before the kernel ran.
    before: BTreeMap<String, Vec<u8>>,
    volumes: Vec<Volume>,
}

impl PoolCase {
    fn data_sectors(&self) -> u64 {
        self.data_bytes / 512
    }

    fn volume(&self, name: &str) -> &Volume {
        self.volumes.iter().find(|v| v.name == name).unwrap()
    }
}

/// A thinpool pool with volumes `a` and `b` and snapshot `s` of `a`, seeded through NBD:
/// partial and whole blocks, a discard, overwrites of shared blocks after the snapshot.
/// On files in the pool directory, or on `devices` (metadata, data: loop devices).
fn make_thinpool_pool(
    root: &Path,
    label: &str,
    block: u64,
    seed: u64,
    devices: Option<(&Path, &Path)>,
) -> PoolCase {
    let dir = root.join(label);
    let p = dir.to_str().unwrap();
    let volume_size = 4 * block.max(2 * MIB);
    let data_size = 8 * volume_size;
    let block_arg = block.to_string();
    let (metadata, data) = match devices {
        None => {
            create_pool(
                &dir,
                &[
                    "--data-size",
                    &data_size.to_string(),
                    "--block-size",
                    &block_arg,
                ],
            );
            (dir.join("metadata"), dir.join("data"))
        }
        Some((metadata, data)) => {
            create_pool(
                &dir,
                &[
                    "--metadata-device",
                    metadata.to_str().unwrap(),
                    "--data-device",
                    data.to_str().unwrap(),
                    "--block-size",
                    &block_arg,
                ],
            );
            (metadata.to_path_buf(), data.to_path_buf())
        }
    };
    for name in ["a", "b"] {
        create_volume(&dir, name, &volume_size.to_string());
    }
    let served = serve(&dir, &["--quiet"]);
    let mut a = Client::open(&served.socket, "a");
    a.write(0, &pattern(seed, block as usize));
    a.write(block + 4 * KIB, &pattern(seed + 1, 12 * KIB as usize));
    a.write(
        volume_size - 64 * KIB,
        &pattern(seed + 2, 64 * KIB as usize),
    );
    a.flush();
    a.disconnect();
    let mut b = Client::open(&served.socket, "b");
    for index in 0..3 {
        b.write(
            index * block + 4 * KIB,
            &pattern(seed + 3 + (index << 8), 128 * KIB as usize),
        );
    }
    // thinpool discards block 1 whole.
    b.request(CMD_TRIM, 0, block, block, &[]);
    b.flush();
    b.disconnect();
    assert!(served.stop().success());
    thinpool_ok(&["volume", "snapshot", "a", "s", "--pool", p]);
    let served = serve(&dir, &["--quiet"]);
    let mut a = Client::open(&served.socket, "a");
    a.write(8 * KIB, &pattern(seed + 4, 8 * KIB as usize));
    a.flush();
    a.disconnect();
    let mut s = Client::open(&served.socket, "s");
    s.write(2 * block, &pattern(seed + 5, 64 * KIB as usize));
    s.flush();
    s.disconnect();
    assert!(served.stop().success());
    thinpool_ok(&["check", metadata.to_str().unwrap()]);
    let before = served_images(&dir);
    let volumes = volumes(&dir);
    assert_eq!(volumes.len(), 3);
    let status_before = status(&dir);
    let data_bytes = status_before["data_total_blocks"].as_u64().unwrap() * block;
    PoolCase {
        label: label.to_string(),
        dir,
        metadata,
        data,
        block,
        data_bytes,
        status_before,
        before,
        volumes,
    }
}

/// Guest commands for one pool: activate, image every volume (`before-`), let the kernel
/// write, discard, snapshot, delete that snapshot, reserve and release a metadata
/// snapshot, image every volume again (`after-`) and remove the devices.
fn guest_round_trip(case: &PoolCase, metadata_dev: &str, data_dev: &str) -> String {
    let l = &case.label;
    let block_sectors = case.block / 512;
    let mut script = format!(
        "pool_up {l} {metadata_dev} {data_dev} {block_sectors} {}\n\
         dm status {l} > {l}-status-first\n",
        case.data_sectors()
    );
    for volume in &case.volumes {
        script.push_str(&format!(
            "thin_up {l}-{name} {l} {id} {sectors}\nimage /dev/mapper/{l}-{name} {l}-before-{name}\n",
            name = volume.name,
            id = volume.id,
            sectors = volume.size / 512
        ));
    }
    let a = case.volume("a");
    let snap_id = 100;
    script.push_str(&format!(
        "# the kernel writes: part of a block of a, a whole new block of s
dd if=kernel-write of=/dev/mapper/{l}-a bs=4096 seek={a_seek} conv=notrunc,fsync status=none
dd if=kernel-write of=/dev/mapper/{l}-s bs=4096 seek={s_seek} conv=notrunc,fsync status=none
# discards: a whole block and a part of one of b
blkdiscard -o 0 -l {block} /dev/mapper/{l}-b
blkdiscard -o {partial_offset} -l 8192 /dev/mapper/{l}-b
# a snapshot the kernel makes, written to, then deleted
dm suspend {l}-a
dm message {l} 0 'create_snap {snap_id} {a_id}'
dm resume {l}-a
thin_up {l}-k {l} {snap_id} {a_sectors}
cmp /dev/mapper/{l}-k /dev/mapper/{l}-a
dd if=kernel-write of=/dev/mapper/{l}-k bs=4096 seek=0 conv=notrunc,fsync status=none
dm remove {l}-k
dm message {l} 0 'delete {snap_id}'
# a metadata snapshot, reserved and released
dm message {l} 0 reserve_metadata_snap
dm status {l} > {l}-status-held
dm message {l} 0 release_metadata_snap
",
        a_seek = (case.block + 8 * KIB) / 4096,
        s_seek = (3 * case.block) / 4096,
        block = case.block,
        partial_offset = 2 * case.block + 4096,
        a_id = a.id,
        a_sectors = a.size / 512,
    ));
    for volume in &case.volumes {
        script.push_str(&format!(
            "image /dev/mapper/{l}-{name} {l}-after-{name}\ndm remove {l}-{name}\n",
            name = volume.name
        ));
    }
    script.push_str(&format!("dm status {l} > {l}-status-last\ndm remove {l}\n"));
    script
}

#[test]
fn thinpool_pools_run_in_the_kernel_and_come_back() {
    let report = seed_report();
    let seed = report.seed();
    let uml = Uml::find();
    let temp = ScratchDir::new("kernel-dm-thin");
    let mut cases = vec![
        make_thinpool_pool(temp.path(), "p64k", 64 * KIB, seed, None),
        make_thinpool_pool(temp.path(), "p8m", 8 * MIB, seed ^ 0x55, None),
    ];
    // A pool on loop devices, which the kernel opens as its disks too (the loop devices
    // stay attached, so the pool's devices.json keeps naming them).
    let test = "thinpool_pools_run_in_the_kernel_and_come_back";
    let metadata_file = temp.join("loop-metadata");
    let data_file = temp.join("loop-data");
    drop(sized_file(&metadata_file, 4 * MIB));
    drop(sized_file(&data_file, 64 * MIB));
    let loops = LoopDevice::attach(&metadata_file, test)
        .and_then(|metadata| Some((metadata, LoopDevice::attach(&data_file, test)?)));
    if let Some((metadata, data)) = &loops {
        cases.push(make_thinpool_pool(
            temp.path(),
            "l64k",
            64 * KIB,
            seed ^ 0xaa,
            Some((metadata.path(), data.path())),
        ));
    }
    let result = temp.join("result");
    std::fs::create_dir_all(&result).unwrap();
    let kernel_write = pattern(seed ^ 0xdead, 96 * KIB as usize);
    std::fs::write(result.join("kernel-write"), &kernel_write).unwrap();

    let mut boot = Boot::new(&uml, &result).modules(&DM_THIN_MODULES);
    let mut script = GUEST_PRELUDE.to_string();
    for (index, case) in cases.iter().enumerate() {
        boot = boot.disk(&case.metadata).disk(&case.data);
        let letter = |n: usize| (b'a' + n as u8) as char;
        script.push_str(&guest_round_trip(
            case,
            &format!("/dev/ubd{}", letter(2 * index)),
            &format!("/dev/ubd{}", letter(2 * index + 1)),
        ));
    }
    let outcome = boot.script(&script).run();
    outcome.assert_success();
    eprintln!(
        "UML: guest uptime {:?} at script start, {:?} wall time",
        outcome.script_started, outcome.elapsed
    );

    let mut compared = 0;
    for case in &cases {
        let l = &case.label;
        let ours = &case.status_before;
        let first = kernel_pool_status(&result.join(format!("{l}-status-first")));
        assert_eq!(
            first.transaction_id,
            ours["transaction_id"].as_u64().unwrap(),
            "{l}: the kernel's transaction id ({})",
            first.line
        );
        assert_eq!(first.held_metadata_root, "-", "{l}: {}", first.line);
        // The kernel counts its metadata reserve, min(4096 blocks, 10%), as used.
        assert_eq!(
            first.total_metadata_blocks,
            ours["metadata_total_blocks"].as_u64().unwrap(),
            "{l}: {}",
            first.line
        );
        let reserve = (first.total_metadata_blocks / 10).min(4096);
        assert_eq!(
            first.used_metadata_blocks,
            ours["metadata_used_blocks"].as_u64().unwrap() + reserve,
            "{l}: the kernel's used metadata against thinpool's plus the reserve ({})",
            first.line
        );
        assert_eq!(
            first.used_data_blocks,
            ours["data_used_blocks"].as_u64().unwrap(),
            "{l}: used data blocks ({})",
            first.line
        );
        let held = kernel_pool_status(&result.join(format!("{l}-status-held")));
        assert_ne!(held.held_metadata_root, "-", "{l}: {}", held.line);
        let last = kernel_pool_status(&result.join(format!("{l}-status-last")));
        assert_eq!(last.held_metadata_root, "-", "{l}: {}", last.line);
        assert_eq!(
            last.transaction_id, first.transaction_id,
            "{l}: {}",
            last.line
        );

        for volume in &case.volumes {
            let name = &volume.name;
            assert_same_bytes(
                &format!("{l}/{name}: the kernel's read of what thinpool wrote"),
                &read(&result.join(format!("{l}-before-{name}"))),
                &case.before[name],
            );
        }
        // The kernel's writes are where it put them.
        let after_a = read(&result.join(format!("{l}-after-a")));
        let a_offset = (case.block + 8 * KIB) as usize;
        assert_same_bytes(
            &format!("{l}/a: the kernel's write"),
            &after_a[a_offset..a_offset + kernel_write.len()],
            &kernel_write,
        );
        // Its write to a copied the block a shares with thinpool's snapshot s: s is as it
        // was but for the kernel's own write to s.
        let after_s = read(&result.join(format!("{l}-after-s")));
        let s_offset = (3 * case.block) as usize;
        let s_end = s_offset + kernel_write.len();
        assert_same_bytes(
            &format!("{l}/s before the kernel's write to it"),
            &after_s[..s_offset],
            &case.before["s"][..s_offset],
        );
        assert_same_bytes(
            &format!("{l}/s after the kernel's write to it"),
            &after_s[s_end..],
            &case.before["s"][s_end..],
        );
        assert_same_bytes(
            &format!("{l}/s: the kernel's write"),
            &after_s[s_offset..s_end],
            &kernel_write,
        );
        let after_b = read(&result.join(format!("{l}-after-b")));
        assert!(
            after_b[..case.block as usize].iter().all(|&byte| byte == 0),
            "{l}/b: a whole-block discard in the kernel left data"
        );

        // thinpool takes the pool back.
        thinpool_ok(&["check", case.metadata.to_str().unwrap()]);
        ThinTools::check_all(&case.metadata);
        let ours_after = status(&case.dir);
        assert_eq!(
            ours_after["transaction_id"], ours["transaction_id"],
            "{l}: transaction id"
        );
        assert_eq!(
            ours_after["data_used_blocks"].as_u64().unwrap(),
            last.used_data_blocks,
            "{l}: used data blocks, thinpool's against the kernel's last status ({})",
            last.line
        );
        let back = served_images(&case.dir);
        for volume in &case.volumes {
            let name = &volume.name;
            assert_same_bytes(
                &format!("{l}/{name}: thinpool's read of what the kernel left"),
                &back[name],
                &read(&result.join(format!("{l}-after-{name}"))),
            );
            compared += 1;
        }
    }
    eprintln!("kernel round trip thinpool → kernel → thinpool: {compared} volumes compared");
}

/// Guest commands that activate a pool and its thins, image each (`PREFIX-NAME`) and, for
/// ext4 volumes, run `fsck -n`, mount read-only and copy `hello` out.
fn guest_activate_and_image(
    label: &str,
    block: u64,
    data_sectors: u64,
    volumes: &[Volume],
    ext4: &[&str],
    prefix: &str,
    extra: &str,
) -> String {
    let mut script = format!(
        "pool_up {label} /dev/ubda /dev/ubdb {} {data_sectors}\ndm status {label} > {prefix}-status\n",
        block / 512
    );
    for volume in volumes {
        let name = &volume.name;
        script.push_str(&format!(
            "thin_up {label}-{name} {label} {} {}\nimage /dev/mapper/{label}-{name} {prefix}-{name}\n",
            volume.id,
            volume.size / 512
        ));
        if ext4.contains(&name.as_str()) {
            script.push_str(&format!(
                "fsck.ext4 -n /dev/mapper/{label}-{name} > {prefix}-{name}-fsck 2>&1 || {{ cat {prefix}-{name}-fsck; exit 1; }}\n\
                 mkdir -p /run/{name}\n\
                 mount -o ro,noload -t ext4 /dev/mapper/{label}-{name} /run/{name}\n\
                 cat /run/{name}/hello > {prefix}-{name}-hello\n\
                 umount /run/{name}\n"
            ));
        }
    }
    script.push_str(extra);
    for volume in volumes {
        script.push_str(&format!("dm remove {label}-{}\n", volume.name));
    }
    script.push_str(&format!("dm remove {label}\n"));
    script
}

#[test]
fn kernel_pools_come_to_thinpool_and_go_back() {
    let report = seed_report();
    let seed = report.seed();
    let uml = Uml::find();
    let temp = ScratchDir::new("kernel-import");
    let block = 64 * KIB;
    let volume_size = 8 * MIB;
    let metadata = temp.join("metadata");
    let data = temp.join("data");
    drop(sized_file(&metadata, 4 * MIB));
    drop(sized_file(&data, 64 * MIB));
    let data_sectors = 64 * MIB / 512;
    let result = temp.join("result");
    std::fs::create_dir_all(&result).unwrap();
    std::fs::write(
        result.join("raw-content"),
        pattern(seed, 3 * block as usize + 20 * KIB as usize),
    )
    .unwrap();
    std::fs::write(
        result.join("raw-more"),
        pattern(seed + 1, 40 * KIB as usize),
    )
    .unwrap();
    std::fs::write(
        result.join("hello-text"),
        format!("hello from the kernel {seed}\n"),
    )
    .unwrap();

    // 1. The kernel makes the pool: thins 1 (raw) and 2 (ext4), snapshots 3 of 1 and 4 of
    //    2, more writes after the snapshots, transaction id 0 → 5 as LVM would move it.
    let mut script = GUEST_PRELUDE.to_string();
    let v = volume_size / 512;
    script.push_str(&format!(
        "pool_up kp /dev/ubda /dev/ubdb {bs} {data_sectors}
dm message kp 0 'create_thin 1'
dm message kp 0 'create_thin 2'
thin_up kp-1 kp 1 {v}
thin_up kp-2 kp 2 {v}
dd if=raw-content of=/dev/mapper/kp-1 bs=4096 seek=3 conv=notrunc,fsync status=none
mkfs.ext4 -q -F -b 4096 -E nodiscard,lazy_itable_init=0,lazy_journal_init=0 /dev/mapper/kp-2
mkdir -p /run/fs
mount -t ext4 /dev/mapper/kp-2 /run/fs
cp hello-text /run/fs/hello
umount /run/fs
dm suspend kp-1
dm message kp 0 'create_snap 3 1'
dm resume kp-1
dm suspend kp-2
dm message kp 0 'create_snap 4 2'
dm resume kp-2
thin_up kp-3 kp 3 {v}
thin_up kp-4 kp 4 {v}
dd if=raw-more of=/dev/mapper/kp-1 bs=4096 seek=0 conv=notrunc,fsync status=none
dd if=raw-more of=/dev/mapper/kp-3 bs=4096 seek=100 conv=notrunc,fsync status=none
dm message kp 0 'set_transaction_id 0 5'
",
        bs = block / 512
    ));
    for id in 1..=4 {
        script.push_str(&format!("image /dev/mapper/kp-{id} kernel-{id}\n"));
    }
    script.push_str("dm status kp > kernel-status\n");
    for id in 1..=4 {
        script.push_str(&format!("dm remove kp-{id}\n"));
    }
    script.push_str("dm remove kp\n");
    Boot::new(&uml, &result)
        .modules(&DM_THIN_MODULES)
        .disk(&metadata)
        .disk(&data)
        .script(&script)
        .run()
        .assert_success();
    let kernel_status = kernel_pool_status(&result.join("kernel-status"));
    assert_eq!(kernel_status.transaction_id, 5, "{}", kernel_status.line);
    ThinTools::check_all(&metadata);

    // 2. thinpool imports it (from loop devices over the same files).
    let pool = temp.join("pool");
    let p = pool.to_str().unwrap();
    let names = ["raw", "fs", "raw-snap", "fs-snap"];
    let (ours, volumes, transaction_id) = {
        let test = "kernel_pools_come_to_thinpool_and_go_back";
        let Some(metadata_loop) = LoopDevice::attach(&metadata, test) else {
            return;
        };
        let Some(data_loop) = LoopDevice::attach(&data, test) else {
            return;
        };
        let mut args = vec![
            "import".to_string(),
            "--pool".to_string(),
            p.to_string(),
            "--metadata-device".to_string(),
            metadata_loop.path().display().to_string(),
            "--data-device".to_string(),
            data_loop.path().display().to_string(),
        ];
        for (index, name) in names.iter().enumerate() {
            args.push("--volume".to_string());
            args.push(format!("{}:{name}:{volume_size}", index + 1));
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        thinpool_ok(&args);
        let metadata_dev = metadata_loop.path().to_str().unwrap();
        thinpool_ok(&["check", metadata_dev]);
        let imported_status = status(&pool);
        assert_eq!(imported_status["transaction_id"].as_u64(), Some(5));
        assert_eq!(
            imported_status["data_used_blocks"].as_u64(),
            Some(kernel_status.used_data_blocks),
            "used data blocks, thinpool's against the kernel's ({})",
            kernel_status.line
        );
        let imported = served_images(&pool);
        for (index, name) in names.iter().enumerate() {
            assert_same_bytes(
                &format!(
                    "{name} (thin {}): thinpool's read of the kernel's pool",
                    index + 1
                ),
                &imported[*name],
                &read(&result.join(format!("kernel-{}", index + 1))),
            );
        }

        // 3. thinpool writes and snapshots.
        let served = serve(&pool, &["--quiet"]);
        let mut raw = Client::open(&served.socket, "raw");
        raw.write(5 * block + 512, &pattern(seed + 2, 70 * KIB as usize));
        raw.flush();
        raw.disconnect();
        assert!(served.stop().success());
        thinpool_ok(&[
            "volume",
            "snapshot",
            "raw",
            "raw-thinpool-snap",
            "--pool",
            p,
        ]);
        thinpool_ok(&["volume", "snapshot", "fs", "fs-thinpool-snap", "--pool", p]);
        let served = serve(&pool, &["--quiet"]);
        let mut raw = Client::open(&served.socket, "raw");
        raw.write(0, &pattern(seed + 3, block as usize));
        raw.flush();
        raw.disconnect();
        let mut snap = Client::open(&served.socket, "raw-snap");
        snap.write(7 * block, &pattern(seed + 4, block as usize));
        snap.flush();
        snap.disconnect();
        assert!(served.stop().success());
        thinpool_ok(&["check", metadata_dev]);
        ThinTools::check_all(metadata_loop.path());
        let images = served_images(&pool);
        let transaction_id = status(&pool)["transaction_id"].as_u64().unwrap();
        (images, volumes(&pool), transaction_id)
        // The loop devices detach here, before the kernel opens the files.
    };
    assert_eq!(volumes.len(), 6);

    // 4. The kernel activates it again and sees exactly that; ext4 is clean.
    let result2 = temp.join("result-again");
    std::fs::create_dir_all(&result2).unwrap();
    std::fs::copy(result.join("raw-more"), result2.join("raw-more")).unwrap();
    let script = format!(
        "{GUEST_PRELUDE}{}",
        guest_activate_and_image(
            "tp",
            block,
            data_sectors,
            &volumes,
            &["fs", "fs-snap", "fs-thinpool-snap"],
            "again",
            // The kernel overwrites the origin of thinpool's snapshot: the time fields
            // thinpool wrote must make it copy, leaving the snapshot as it was.
            "dd if=raw-more of=/dev/mapper/tp-raw bs=4096 seek=0 conv=notrunc,fsync status=none\n\
             image /dev/mapper/tp-raw late-raw\n\
             image /dev/mapper/tp-raw-thinpool-snap late-raw-thinpool-snap\n",
        )
    );
    Boot::new(&uml, &result2)
        .modules(&DM_THIN_MODULES)
        .disk(&metadata)
        .disk(&data)
        .script(&script)
        .run()
        .assert_success();
    let again = kernel_pool_status(&result2.join("again-status"));
    assert_eq!(again.transaction_id, transaction_id, "{}", again.line);
    for volume in &volumes {
        let name = &volume.name;
        assert_same_bytes(
            &format!("{name}: the kernel's read of what thinpool left"),
            &read(&result2.join(format!("again-{name}"))),
            &ours[name],
        );
    }
    let raw_more = read(&result.join("raw-more"));
    let late_raw = read(&result2.join("late-raw"));
    assert_same_bytes(
        "raw: the kernel's write",
        &late_raw[..raw_more.len()],
        &raw_more,
    );
    assert_same_bytes(
        "raw: beyond the kernel's write",
        &late_raw[raw_more.len()..],
        &ours["raw"][raw_more.len()..],
    );
    assert_same_bytes(
        "raw-thinpool-snap after the kernel wrote its origin",
        &read(&result2.join("late-raw-thinpool-snap")),
        &ours["raw-thinpool-snap"],
    );
    for name in ["fs", "fs-snap", "fs-thinpool-snap"] {
        let hello = String::from_utf8(read(&result2.join(format!("again-{name}-hello")))).unwrap();
        assert_eq!(hello, format!("hello from the kernel {seed}\n"), "{name}");
        let fsck = String::from_utf8_lossy(&read(&result2.join(format!("again-{name}-fsck"))))
            .into_owned();
        assert!(fsck.contains("clean"), "{name}: fsck -n: {fsck}");
    }
    ThinTools::check_all(&metadata);
    eprintln!(
        "kernel round trip kernel → thinpool → kernel: {} + {} volumes compared",
        names.len(),
        volumes.len()
    );
}

/// A metadata snapshot the kernel reserved and left held, with writes after it: the
/// kernel's copy-on-write of a btree leaf shared with the snapshot raises the reference
/// count of every data block in that leaf (both leaves map it), while the live mapping's
/// time still says "write in place" (dm-thin decides sharing by time, not by count). Both
/// thin_check versions accept such metadata; thinpool must open it and read what the
/// kernel wrote, and see the held snapshot.
#[test]
fn a_metadata_snapshot_the_kernel_holds_opens_in_thinpool() {
    let report = seed_report();
    let seed = report.seed();
    let uml = Uml::find();
    let temp = ScratchDir::new("kernel-held-snap");
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "16M", "--block-size", "64K"]);
    create_volume(&pool, "a", "4M");
    let id = volumes(&pool)[0].id;
    let result = temp.join("result");
    std::fs::create_dir_all(&result).unwrap();
    std::fs::write(result.join("first"), pattern(seed, 64 * KIB as usize)).unwrap();
    std::fs::write(result.join("second"), pattern(seed + 1, 64 * KIB as usize)).unwrap();
    let data_sectors = 16 * MIB / 512;
    let script = format!(
        "{GUEST_PRELUDE}pool_up p /dev/ubda /dev/ubdb 128 {data_sectors}
thin_up a p {id} {sectors}
dd if=first of=/dev/mapper/a bs=64k seek=0 conv=notrunc,fsync status=none
dm message p 0 reserve_metadata_snap
dd if=second of=/dev/mapper/a bs=64k seek=1 conv=notrunc,fsync status=none
dd if=second of=/dev/mapper/a bs=64k seek=0 conv=notrunc,fsync status=none
image /dev/mapper/a kernel-a
dm status p > status
dm remove a
dm remove p
",
        sectors = 4 * MIB / 512
    );
    Boot::new(&uml, &result)
        .modules(&DM_THIN_MODULES)
        .disk(&pool.join("metadata"))
        .disk(&pool.join("data"))
        .script(&script)
        .run()
        .assert_success();
    let kernel = kernel_pool_status(&result.join("status"));
    assert_ne!(kernel.held_metadata_root, "-", "{}", kernel.line);
    ThinTools::check_all(&pool.join("metadata"));
    thinpool_ok(&["check", pool.join("metadata").to_str().unwrap()]);
    let ours = status(&pool);
    assert_eq!(
        ours["metadata_snap_block"]
            .as_u64()
            .map(|root| root.to_string()),
        Some(kernel.held_metadata_root.clone()),
        "the held metadata snapshot: {ours}"
    );
    let images = served_images(&pool);
    assert_same_bytes(
        "a: thinpool's read of what the kernel wrote",
        &images["a"],
        &read(&result.join("kernel-a")),
    );
}

/// Issue 20 finding 11, issue 22 item 3: the kernel snapshots thinpool's volume `a`
/// (`create_snap`, then writes to `a`) and deletes thin `b`; thinpool opens the pool,
/// names both, serves the rest, adopts the snapshot and forgets `b`.
#[test]
fn a_kernel_snapshot_is_adopted_and_a_kernel_delete_forgotten() {
    let report = seed_report();
    let seed = report.seed();
    let uml = Uml::find();
    let temp = ScratchDir::new("kernel-adopt");
    let case = make_thinpool_pool(temp.path(), "adopt", 64 * KIB, seed, None);
    let (a, b) = (case.volume("a").clone(), case.volume("b").clone());
    let snap_id = 100;
    let result = temp.join("result");
    std::fs::create_dir_all(&result).unwrap();
    let kernel_write = pattern(seed ^ 0xbeef, 96 * KIB as usize);
    std::fs::write(result.join("kernel-write"), &kernel_write).unwrap();
    let l = &case.label;
    let script = format!(
        "{GUEST_PRELUDE}
pool_up {l} /dev/ubda /dev/ubdb {block_sectors} {data_sectors}
thin_up {l}-a {l} {a_id} {a_sectors}
dm suspend {l}-a
dm message {l} 0 'create_snap {snap_id} {a_id}'
dm resume {l}-a
image /dev/mapper/{l}-a {l}-a-at-snap
dd if=kernel-write of=/dev/mapper/{l}-a bs=4096 seek=0 conv=notrunc,fsync status=none
image /dev/mapper/{l}-a {l}-a-after
dm remove {l}-a
dm message {l} 0 'delete {b_id}'
dm remove {l}
",
        block_sectors = case.block / 512,
        data_sectors = case.data_sectors(),
        a_id = a.id,
        a_sectors = a.size / 512,
        b_id = b.id,
    );
    let outcome = Boot::new(&uml, &result)
        .modules(&DM_THIN_MODULES)
        .disk(&case.metadata)
        .disk(&case.data)
        .script(&script)
        .run();
    outcome.assert_success();
    ThinTools::check_all(&case.metadata);

    let p = case.dir.to_str().unwrap();
    let listed = thinpool(&["list", "--pool", p]);
    let stderr = String::from_utf8_lossy(&listed.stderr);
    assert!(listed.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&listed.stdout);
    assert!(
        stderr.contains(&format!("unadopted thin ids: {snap_id} ")) && stderr.contains("\"b\""),
        "{stderr}"
    );
    assert!(
        stdout.contains("unadopted thin ids") && stdout.contains("orphaned"),
        "{stdout}"
    );
    let names: Vec<String> = volumes(&case.dir).into_iter().map(|v| v.name).collect();
    assert_eq!(names, ["a", "s"], "only what both know is listed");
    let found = status(&case.dir);
    assert_eq!(found["unadopted"][0]["id"], snap_id, "{found}");
    assert_eq!(found["orphaned"][0]["name"], "b", "{found}");
    assert_eq!(found["orphaned"][0]["id"], b.id, "{found}");

    thinpool_ok(&[
        "volume",
        "adopt",
        &snap_id.to_string(),
        "k",
        "--size",
        &a.size.to_string(),
        "--origin",
        "a",
        "--pool",
        p,
    ]);
    thinpool_ok(&["volume", "forget", "b", "--pool", p]);
    let found = status(&case.dir);
    assert_eq!(found["unadopted"], serde_json::json!([]), "{found}");
    assert_eq!(found["orphaned"], serde_json::json!([]), "{found}");
    let images = served_images(&case.dir);
    assert_eq!(images.keys().collect::<Vec<_>>(), ["a", "k", "s"]);
    let at_snap = read(&result.join(format!("{l}-a-at-snap")));
    assert_same_bytes("a at the kernel's snapshot", &at_snap, &case.before["a"]);
    assert_same_bytes("the adopted snapshot k", &images["k"], &at_snap);
    assert_same_bytes(
        "a after the kernel's write",
        &images["a"],
        &read(&result.join(format!("{l}-a-after"))),
    );
    assert_same_bytes("s", &images["s"], &case.before["s"]);
    let text = thinpool_ok(&["list", "--json", "--pool", p]);
    let listing: serde_json::Value = serde_json::from_str(&text).unwrap();
    let k = listing["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "k")
        .unwrap();
    assert_eq!(
        (k["id"].as_u64(), k["origin"].as_str()),
        (Some(snap_id), Some("a"))
    );
    thinpool_ok(&["check", case.metadata.to_str().unwrap()]);
    ThinTools::check_all(&case.metadata);
}
