//! Goal: a pool on block devices opens only on its own devices (issue 20, finding 5).
//! `devices.json` used to record `/dev/loop1` and check only the size: after a renumbering
//! another disk at that path was served as the pool's data (and written), a swapped metadata
//! device was reported as "corrupt metadata ... bad checksum", and the same backing files
//! attached as two more loop devices let a second server run the same pool from another
//! directory (`O_EXCL` guards one device node only).
//!
//! Method: loop devices over files; a renumbering is played by detaching a device and
//! attaching another file at its number (`losetup /dev/loopN FILE`). The stranger's file must
//! keep its bytes; the refusal must name the device and what was expected and found. The
//! aliases are two more loop devices over the same files, named by a second pool directory.
//! A `devices.json` written before identities were recorded still opens, and is upgraded.
//! Skipped (saying so) where loop devices cannot be attached, unless
//! `THINPOOL_REQUIRE_LOOP_DEVICES=1`.

mod e2e_support;

use e2e_support::*;
use std::io::Write;
use std::path::{Path, PathBuf};
use testkit::loop_device::LoopDevice;

const DATA_BYTES: u64 = 32 * MIB;
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

/// A pool on two new loop devices with volume `v`: `(pool dir, metadata, data)`.
fn block_pool(scratch: &ScratchDir, test: &str) -> Option<(PathBuf, LoopDevice, LoopDevice)> {
    let metadata_file = scratch.join("metadata.img");
    sized_file(&metadata_file, METADATA_BYTES);
    let data_file = scratch.join("data.img");
    filled_file(&data_file, DATA_BYTES, 0);
    let metadata = LoopDevice::attach(&metadata_file, test)?;
    let data = LoopDevice::attach(&data_file, test)?;
    let pool = scratch.join("pool");
    thinpool_ok(&[
        "create",
        "--pool",
        pool.to_str().unwrap(),
        "--metadata-device",
        &metadata.arg(),
        "--data-device",
        &data.arg(),
    ]);
    create_volume(&pool, "v", "8M");
    Some((pool, metadata, data))
}

fn list(pool: &Path) -> std::process::Output {
    thinpool(&["list", "--pool", pool.to_str().unwrap()])
}

#[test]
fn another_device_at_the_recorded_path_is_refused() {
    let scratch = ScratchDir::new("blockdev-renumbered");
    let Some((pool, metadata, data)) = block_pool(&scratch, "blockdev_identity") else {
        return;
    };
    assert!(list(&pool).status.success());
    // The data device's number now names a stranger's disk.
    let stranger_file = scratch.join("stranger.img");
    filled_file(&stranger_file, DATA_BYTES, 0x5a);
    let data_path = data.path().to_path_buf();
    data.detach();
    let stranger = LoopDevice::attach_at(&data_path, &stranger_file);
    for command in ["list", "serve"] {
        let error = thinpool_err(&[command, "--pool", pool.to_str().unwrap()]);
        assert!(
            error.contains(&format!(
                "device {} is not this pool's data device",
                data_path.display()
            )) && error.contains("data.img")
                && error.contains("stranger.img"),
            "{command}: {error}"
        );
    }
    stranger.detach();
    let bytes = std::fs::read(&stranger_file).unwrap();
    assert!(
        bytes.iter().all(|&byte| byte == 0x5a),
        "the stranger's disk was written"
    );

    // The metadata device's number now names another pool's metadata device: said so, not
    // "corrupt metadata".
    let data = LoopDevice::attach_at(&data_path, &scratch.join("data.img"));
    assert!(list(&pool).status.success(), "its own data device again");
    let other_metadata_file = scratch.join("other-metadata.img");
    sized_file(&other_metadata_file, METADATA_BYTES);
    let metadata_path = metadata.path().to_path_buf();
    metadata.detach();
    let other = LoopDevice::attach_at(&metadata_path, &other_metadata_file);
    let error = thinpool_err(&["list", "--pool", pool.to_str().unwrap()]);
    assert!(
        error.contains(&format!(
            "device {} is not this pool's metadata device",
            metadata_path.display()
        )) && !error.contains("checksum"),
        "{error}"
    );
    other.detach();
    // Its own devices at other numbers, named in devices.json: the pool opens.
    let metadata = LoopDevice::attach(&scratch.join("metadata.img"), "blockdev_identity").unwrap();
    let text = std::fs::read_to_string(pool.join("devices.json")).unwrap();
    let mut devices: serde_json::Value = serde_json::from_str(&text).unwrap();
    devices["metadata_device"] = metadata.arg().into();
    std::fs::write(pool.join("devices.json"), devices.to_string()).unwrap();
    let listed = thinpool_ok(&["list", "--pool", pool.to_str().unwrap()]);
    assert!(listed.contains('v'), "{listed}");
    drop(data);
}

/// Whether `error` names `pid` among the holders of a device (a `losetup` of another test
/// may have the device open at the same moment and be named beside it).
fn names_holder(error: &str, pid: u32) -> bool {
    let Some((_, holders)) = error.split_once("held by ") else {
        return false;
    };
    [" (", ",", ")"]
        .iter()
        .any(|end| holders.contains(&format!("pid {pid}{end}")))
}

#[test]
fn aliases_of_the_pools_devices_cannot_serve_it_twice() {
    let scratch = ScratchDir::new("blockdev-aliases");
    let Some((pool, metadata, data)) = block_pool(&scratch, "blockdev_identity") else {
        return;
    };
    let served = serve(&pool, &[]);
    // The same files through two more loop devices, named by another directory.
    let metadata_alias = LoopDevice::attach(metadata.file(), "blockdev_identity").unwrap();
    let data_alias = LoopDevice::attach(data.file(), "blockdev_identity").unwrap();
    let twin = scratch.join("twin");
    std::fs::create_dir(&twin).unwrap();
    let text = std::fs::read_to_string(pool.join("devices.json")).unwrap();
    let mut devices: serde_json::Value = serde_json::from_str(&text).unwrap();
    devices["metadata_device"] = metadata_alias.arg().into();
    devices["data_device"] = data_alias.arg().into();
    std::fs::write(twin.join("devices.json"), devices.to_string()).unwrap();
    for entry in std::fs::read_dir(&pool).unwrap() {
        let name = entry.unwrap().file_name();
        let name = name.to_string_lossy();
        if name.starts_with("catalog-") || name == "pool.json" {
            std::fs::copy(pool.join(&*name), twin.join(&*name)).unwrap();
        }
    }
    std::fs::set_permissions(&twin, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let error = thinpool_err(&["serve", "--pool", twin.to_str().unwrap()]);
    assert!(
        error.contains("held by another process") && names_holder(&error, served.pid()),
        "{error}"
    );
    assert!(!twin.join("nbd.sock").exists());
    // Nor can `restore -o` write the served metadata, through its device or an alias.
    let xml = scratch.join("any.xml");
    std::fs::write(&xml, "").unwrap();
    for device in [&metadata, &metadata_alias] {
        let error = thinpool_err(&["restore", "-i", xml.to_str().unwrap(), "-o", &device.arg()]);
        assert!(
            names_holder(&error, served.pid()),
            "{}: {error}",
            device.arg()
        );
    }
    let (status, log) = served.stop_with_log();
    assert!(status.success(), "{log}");
    // Once the first server is gone, the aliases are the same pool's devices: they open.
    let listed = thinpool_ok(&["list", "--pool", twin.to_str().unwrap()]);
    assert!(listed.contains('v'), "{listed}");
}

#[test]
fn a_devices_file_without_identities_opens_and_is_upgraded() {
    let scratch = ScratchDir::new("blockdev-upgrade");
    let Some((pool, metadata, data)) = block_pool(&scratch, "blockdev_identity") else {
        return;
    };
    let text = std::fs::read_to_string(pool.join("devices.json")).unwrap();
    assert!(
        text.contains("data.img"),
        "identities recorded at create: {text}"
    );
    // As an older thinpool wrote it: the paths only.
    let old = serde_json::json!({
        "version": 1,
        "metadata_device": metadata.arg(),
        "data_device": data.arg(),
        "direct_io": false,
    });
    std::fs::write(pool.join("devices.json"), old.to_string()).unwrap();
    let listed = thinpool_ok(&["list", "--pool", pool.to_str().unwrap()]);
    assert!(listed.contains('v'), "{listed}");
    let text = std::fs::read_to_string(pool.join("devices.json")).unwrap();
    let upgraded: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(
        upgraded["data_identity"]["loop_backing"]["file"]
            .as_str()
            .is_some_and(|file| file.ends_with("data.img")),
        "{text}"
    );
    assert!(
        upgraded["metadata_identity"]["loop_backing"]["file"]
            .as_str()
            .is_some_and(|file| file.ends_with("metadata.img")),
        "{text}"
    );
}
