//! Goal: every `DataDevice` in the workspace keeps the contract the trait documents, so the
//! engine can run on any of them and what the engine tests learn on a fake holds on the real
//! devices (the contract and the checks: `thin_pool::testing::data_device_contract`).
//! Method: the one suite, run here against `FileDataDevice` (a sparse file on the temporary
//! directory's file system, and on tmpfs, where zeroing falls back to punching holes),
//! `BlockDataDevice` on a loop device (buffered, and `O_DIRECT` on 4096-byte sectors),
//! `MemoryDataDevice`, and the engine tests' fakes (`CrashDataDevice`, `FaultDataDevice`,
//! `SparseDataDevice`); `engine_races` and `pool_corruption` run it on their own fakes. The
//! loop device runs are skipped, saying so, where loop devices cannot be attached, unless
//! `THINPOOL_REQUIRE_LOOP_DEVICES=1`.

mod engine_kit;

use engine_kit::{CrashDataDevice, FaultDataDevice, Power, SparseDataDevice};
use std::path::Path;
use std::sync::Arc;
use testkit::loop_device::LoopDevice;
use testkit::scratch::{sized_file, ScratchDir};
use thin_pool::block_device::BlockDataDevice;
use thin_pool::data_device::{FileDataDevice, MemoryDataDevice};
use thin_pool::testing::data_device_contract::{conforms, Growth, Subject, DEVICE_BYTES};

fn file_subject(dir: ScratchDir) -> Subject {
    let device =
        FileDataDevice::create(&dir.join("data"), DEVICE_BYTES).expect("create the data file");
    Subject::new(Arc::new(device)).keeping(dir)
}

/// A `BlockDataDevice` on a loop device over a sparse file, or `None` (skipped) where loop
/// devices cannot be attached.
fn block_subject(direct_io: bool, losetup_options: &[&str]) -> Option<Subject> {
    let dir = ScratchDir::new("data-device-contract-loop");
    let file = dir.join("data.img");
    sized_file(&file, DEVICE_BYTES);
    let test = if direct_io {
        "data_device_contract block device, direct I/O"
    } else {
        "data_device_contract block device"
    };
    let loop_device = Arc::new(LoopDevice::attach_with(&file, test, losetup_options)?);
    let device = BlockDataDevice::open(loop_device.path(), direct_io)
        .unwrap_or_else(|e| panic!("open {}: {e}", loop_device.arg()));
    assert_eq!(device.direct_io(), direct_io);
    let grower = loop_device.clone();
    let grow = move |size_bytes: u64| {
        sized_file(grower.file(), size_bytes);
        grower.refresh_size();
    };
    // Kept in this order: the loop device is detached after the device's descriptors
    // close, the directory removed after that.
    Some(
        Subject::new(Arc::new(device))
            .growing(Growth::Outside(Box::new(grow)))
            .keeping(loop_device)
            .keeping(dir),
    )
}

#[test]
fn file_data_device_conforms() {
    conforms("FileDataDevice", || {
        Some(file_subject(ScratchDir::new("data-device-contract-file")))
    });
}

/// On tmpfs `fallocate` has no zero-range: zeroing punches holes instead.
#[test]
fn file_data_device_on_tmpfs_conforms() {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("SKIPPED file_data_device_on_tmpfs_conforms: no /dev/shm");
        return;
    }
    conforms("FileDataDevice on tmpfs", || {
        let dir = ScratchDir::new_in(shm, "data-device-contract-tmpfs");
        Some(file_subject(dir))
    });
}

#[test]
fn block_data_device_conforms() {
    conforms("BlockDataDevice", || block_subject(false, &[]));
}

#[test]
fn block_data_device_with_direct_io_conforms() {
    conforms("BlockDataDevice, O_DIRECT, 4096-byte sectors", || {
        block_subject(true, &["--sector-size", "4096"])
    });
}

#[test]
fn memory_data_device_conforms() {
    conforms("MemoryDataDevice", || {
        Some(Subject::new(Arc::new(MemoryDataDevice::new(DEVICE_BYTES))))
    });
}

/// The engine tests' power-cut device, the power on. It grows by `grow`, as an
/// administrator grows a device, and keeps no counters.
#[test]
fn crash_data_device_conforms() {
    conforms("CrashDataDevice", || {
        let device = Arc::new(CrashDataDevice::new(DEVICE_BYTES, Power::new()));
        let grower = device.clone();
        Some(
            Subject::new(device)
                .without_counters()
                .growing(Growth::Outside(Box::new(move |size| grower.grow(size)))),
        )
    });
}

/// The engine tests' failing wrapper, no fault armed, around a memory device.
#[test]
fn fault_data_device_conforms() {
    conforms("FaultDataDevice", || {
        let inner = Arc::new(MemoryDataDevice::new(DEVICE_BYTES));
        Some(Subject::new(Arc::new(FaultDataDevice::new(inner))))
    });
}

/// The engine tests' sparse device: whole 512-byte sectors only, no counters.
#[test]
fn sparse_data_device_conforms() {
    conforms("SparseDataDevice", || {
        let device = Arc::new(SparseDataDevice::new(DEVICE_BYTES));
        let grower = device.clone();
        Some(
            Subject::new(device)
                .sector_aligned_only()
                .without_counters()
                .growing(Growth::Outside(Box::new(move |size| grower.grow(size)))),
        )
    });
}
