//! Goal: the real Linux virtio-blk driver (Linux 6.1 in User-Mode Linux, whose built-in
//! `virtio_uml` is a vhost-user front end: `testkit::uml::virtio`) makes, fills and checks an
//! ext4 file system on a vhost-user-blk disk, and the host finds exactly those bytes.
//!
//! - The reference backend: `qemu-storage-daemon`'s vhost-user-blk export of a raw file. In
//!   the guest `/dev/vda` has the file's capacity; `mkfs.ext4`, mount, files written (seeded
//!   content copied in from the host, a text file, a directory of small files), `sync`,
//!   umount, `fsck -n` clean. Then on the host the raw file passes `e2fsck -n -f` and every
//!   file read out of it with `debugfs` has the bytes the guest wrote.
//! - The same against `thinpool serve --vhost-user-blk vm=SOCK` on a thin volume of a file
//!   pool; afterwards the volume is read back through NBD (`nbdcopy` from a fresh `serve`):
//!   the copy passes `e2fsck -n -f` and holds the same files.
//!
//! Every process started (the daemon, `serve`, the kernel's process group) is stopped by its
//! process id. Skips nothing: UML comes from `scripts/fetch-uml`, and qemu-storage-daemon,
//! e2fsprogs and nbdcopy must be installed.

mod e2e_support;

use e2e_support::*;
use std::path::Path;
use std::time::Duration;
use testkit::uml::virtio::QemuStorageDaemon;
use testkit::uml::{Boot, Uml};

/// The disk's size: the guest's `/dev/vda`.
const DISK_BYTES: u64 = 64 * MIB;
/// Files the guest writes, by name in the file system, with their seeded sizes.
const SEEDED_FILES: [(&str, usize); 3] = [("big.bin", 3 << 20), ("odd.bin", 300_001), ("one", 1)];
/// The text file's content.
const TEXT: &str = "written by Linux virtio-blk through vhost-user\n";
/// Small files in `/dir`.
const SMALL_FILES: u64 = 20;

/// The guest's part: capacity, mkfs, mount, write, sync, umount, fsck.
fn guest_script() -> String {
    let mut copies = String::new();
    for (name, _) in SEEDED_FILES {
        copies.push_str(&format!("cp \"$RESULT/input-{name}\" /run/m/{name}\n"));
    }
    format!(
        r#"
cat /sys/block/vda/size > "$RESULT/vda-sectors"
mkfs.ext4 -q -F /dev/vda
mkdir -p /run/m
mount -t ext4 /dev/vda /run/m
{copies}printf '%s' '{TEXT}' > /run/m/text.txt
mkdir /run/m/dir
i=0
while [ $i -lt {SMALL_FILES} ]; do echo "small file $i" > /run/m/dir/f$i; i=$((i + 1)); done
sync
umount /run/m
fsck.ext4 -n -f /dev/vda > "$RESULT/guest-fsck.log" 2>&1
echo guest-done > "$RESULT/guest-done"
"#
    )
}

/// Writes the seeded inputs into the result directory and boots UML against `socket`.
fn run_guest(result: &Path, socket: &Path) {
    let boot = Boot::new(&Uml::find(), result)
        .vhost_user_blk(socket)
        .script(&guest_script());
    for (index, (name, size)) in SEEDED_FILES.iter().enumerate() {
        let input = boot.result_dir().join(format!("input-{name}"));
        std::fs::write(&input, pattern(index as u64, *size)).expect("write an input file");
    }
    let outcome = boot.run();
    outcome.assert_success();
    let sectors = std::fs::read_to_string(result.join("vda-sectors")).expect("vda-sectors");
    assert_eq!(
        sectors.trim().parse::<u64>().expect("sectors"),
        DISK_BYTES / 512,
        "the guest's /dev/vda capacity"
    );
    assert!(result.join("guest-done").exists(), "{}", outcome.console);
}

/// Host side: `e2fsck -n -f` of `image` is clean and `debugfs` reads what the guest wrote.
fn check_image(image: &Path) {
    let image_text = image.to_str().unwrap();
    let fsck = run_tool("e2fsck", &["-n", "-f", image_text], Duration::from_secs(60));
    assert!(
        fsck.status.success(),
        "e2fsck -n -f of the host's image:\n{}{}",
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );
    let cat = |path: &str| -> Vec<u8> {
        let output = run_tool(
            "debugfs",
            &["-R", &format!("cat {path}"), image_text],
            Duration::from_secs(60),
        );
        assert!(output.status.success(), "debugfs cat {path}");
        output.stdout
    };
    for (index, (name, size)) in SEEDED_FILES.iter().enumerate() {
        let bytes = cat(&format!("/{name}"));
        assert!(
            bytes == pattern(index as u64, *size),
            "/{name}: {} bytes read back differ from the {size} the guest wrote",
            bytes.len()
        );
    }
    assert_eq!(String::from_utf8(cat("/text.txt")).unwrap(), TEXT);
    for i in 0..SMALL_FILES {
        let text = String::from_utf8(cat(&format!("/dir/f{i}"))).unwrap();
        assert_eq!(text, format!("small file {i}\n"));
    }
}

fn require_tools() {
    require_tool("qemu-storage-daemon", "qemu-utils");
    require_tool("e2fsck", "e2fsprogs");
    require_tool("debugfs", "e2fsprogs");
}

#[test]
fn ext4_through_qemu_storage_daemon_vhost_user_blk() {
    require_tools();
    let temp = ScratchDir::new("kernel-virtio-qsd");
    let image = temp.join("disk.img");
    drop(sized_file(&image, DISK_BYTES));
    let daemon =
        QemuStorageDaemon::start(&image, &temp.join("vhost.sock"), 1, &temp.join("qsd.log"));
    run_guest(&temp.join("result"), daemon.socket());
    let log = daemon.log();
    assert!(
        daemon.stop().success(),
        "qemu-storage-daemon's exit:\n{log}"
    );
    check_image(&image);
}

#[test]
fn ext4_through_thinpool_vhost_user_blk_reads_back_through_nbd() {
    require_tools();
    require_tool("nbdcopy", "libnbd-bin");
    let temp = ScratchDir::new("kernel-virtio-thin");
    let pool = temp.join("pool");
    create_pool(&pool, &["--data-size", "256M"]);
    create_volume(&pool, "vm", &format!("{}M", DISK_BYTES / MIB));
    let socket = temp.join("vm.sock");
    let vhost = format!("vm={}", socket.display());
    let served = serve(&pool, &["--quiet", "--vhost-user-blk", &vhost]);
    wait_for("the vhost-user-blk socket", Duration::from_secs(30), || {
        socket.exists()
    });
    run_guest(&temp.join("result"), &socket);
    let stderr = served.stderr();
    assert!(served.stop().success(), "serve's exit:\n{stderr}");

    // Read back through NBD from a fresh server: what the guest wrote was made durable.
    let served = serve(&pool, &["--quiet"]);
    let copy = temp.join("copy.img");
    run_ok(
        "nbdcopy",
        &[&served.uri("vm"), copy.to_str().unwrap()],
        Duration::from_secs(120),
    );
    assert!(served.stop().success());
    assert_eq!(std::fs::metadata(&copy).unwrap().len(), DISK_BYTES);
    check_image(&copy);
}
