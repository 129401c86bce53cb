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
//! - A volume grown while the guest has it attached: `thinpool volume resize` through the
//!   control socket makes `serve` send the capacity-change message on the front end's
//!   backend request channel; the guest, polling `/sys/block/vda/size` for a while, sees the
//!   new size without reattaching, and writes and reads back a sector past the old end.
//!
//! Every process started (the daemon, `serve`, the kernel's process group) is stopped by its
//! process id. Skips nothing: UML comes from `scripts/fetch-uml`, and qemu-storage-daemon,
//! e2fsprogs and nbdcopy must be installed.

mod e2e_support;

use e2e_support::*;
use std::path::Path;
use std::time::Duration;
use testkit::uml::virtio::QemuStorageDaemon;
use testkit::uml::{Boot, Uml, DEFAULT_BOOT_TIMEOUT};

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

/// The grown volume's size before and after its resize.
const GROW_FROM_BYTES: u64 = 32 * MIB;
const GROW_TO_BYTES: u64 = 48 * MIB;
/// What the guest writes past the old end once it sees the new size.
const PAST_END: &str = "written past the old end";

/// The guest's part of the grow test: note the size, say it is attached, poll the size for
/// up to 20 s, then use a sector past the old end.
fn grow_script() -> String {
    format!(
        r#"
old=$(cat /sys/block/vda/size)
echo "$old" > "$RESULT/size-before"
touch "$RESULT/attached"
new=$old
i=0
while [ "$new" = "$old" ] && [ $i -lt 200 ]; do
  sleep 0.1
  i=$((i + 1))
  new=$(cat /sys/block/vda/size)
done
echo "$new" > "$RESULT/size-after"
if [ "$new" != "$old" ]; then
  printf '%s' '{PAST_END}' | dd of=/dev/vda bs=512 seek=$old conv=sync,fsync status=none
  dd if=/dev/vda of="$RESULT/past-end" bs=512 skip=$old count=1 iflag=direct status=none
fi
"#
    )
}

#[test]
fn a_volume_grown_while_attached_shows_its_new_size_in_the_guest() {
    let temp = ScratchDir::new("kernel-virtio-grow");
    let pool = temp.join("pool");
    let pool_text = pool.to_str().unwrap();
    create_pool(&pool, &["--data-size", "256M"]);
    create_volume(&pool, "vm", &format!("{}M", GROW_FROM_BYTES / MIB));
    let socket = temp.join("vm.sock");
    let served = serve(
        &pool,
        &["--vhost-user-blk", &format!("vm={}", socket.display())],
    );
    wait_for("the vhost-user-blk socket", Duration::from_secs(30), || {
        socket.exists()
    });
    let result = temp.join("result");
    let mut guest = Boot::new(&Uml::find(), &result)
        .vhost_user_blk(&socket)
        .script(&grow_script())
        .spawn();
    assert!(
        guest.wait_for_file("attached", DEFAULT_BOOT_TIMEOUT),
        "the guest never attached:\n{}",
        guest.console()
    );
    let size = format!("{}M", GROW_TO_BYTES / MIB);
    thinpool_ok(&[
        "volume", "resize", "vm", "--size", &size, "--pool", pool_text,
    ]);
    let outcome = guest.wait(DEFAULT_BOOT_TIMEOUT);
    outcome.assert_success();
    let sectors = |name: &str| -> u64 {
        let text = std::fs::read_to_string(result.join(name)).expect(name);
        text.trim().parse().expect("sectors")
    };
    assert_eq!(sectors("size-before"), GROW_FROM_BYTES / 512);
    assert_eq!(
        sectors("size-after"),
        GROW_TO_BYTES / 512,
        "the guest's /dev/vda after the resize (serve's log:\n{})\n--- console ---\n{}",
        served.stderr(),
        outcome.console
    );
    // The driver's own line for a capacity it reread (virtio_blk's config-change path).
    let new_size = format!(
        "[vda] new size: {} 512-byte logical blocks",
        GROW_TO_BYTES / 512
    );
    assert!(
        outcome.console.contains(&new_size),
        "no {new_size:?} in the console:\n{}",
        outcome.console
    );
    let past_end = std::fs::read(result.join("past-end")).expect("past-end");
    assert_eq!(&past_end[..PAST_END.len()], PAST_END.as_bytes());
    let stderr = served.stderr();
    assert!(
        stderr.contains("vhost-user-blk capacity change sent"),
        "serve's log:\n{stderr}"
    );
    assert!(served.stop().success(), "serve's exit:\n{stderr}");
}
