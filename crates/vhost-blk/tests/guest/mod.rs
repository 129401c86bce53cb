//! Guest memory and one split virtqueue, for the tests that play the front end with vhost's
//! `Frontend`: guest memory is a memfd written and read through its file, mapped at guest
//! address 0 (seen by the backend at `UVA`), with the queue's descriptor table, available
//! ring and used ring at fixed offsets (`DESC`, `AVAIL`, `USED`).

#![allow(dead_code)]

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use rustix::fs::{ftruncate, memfd_create, MemfdFlags};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vmm_sys_util::eventfd::EventFd;

/// The front end's address of guest address 0 (what SET_MEM_TABLE and the ring addresses say).
pub const UVA: u64 = 0x7f00_0000_0000;
/// Guest addresses of the queue's descriptor table, available ring and used ring.
pub const DESC: u64 = 0;
pub const AVAIL: u64 = 0x1000;
pub const USED: u64 = 0x2000;
/// Descriptor flags.
pub const NEXT: u16 = 1;
pub const WRITE: u16 = 2;
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;
pub const F_PROTOCOL_FEATURES: u64 = 1 << 30;

/// A memfd of `bytes` (zeroes) to serve as guest memory.
pub fn memfd(name: &str, bytes: u64) -> File {
    let fd = memfd_create(name, MemfdFlags::CLOEXEC).unwrap();
    ftruncate(&fd, bytes).unwrap();
    File::from(fd)
}

/// The memory table entry for `size` bytes of `file` at guest address `guest`.
pub fn region(file: &File, guest: u64, size: u64) -> VhostUserMemoryRegionInfo {
    VhostUserMemoryRegionInfo {
        guest_phys_addr: guest,
        memory_size: size,
        userspace_addr: UVA + guest,
        mmap_offset: 0,
        mmap_handle: file.as_raw_fd(),
    }
}

pub fn put(file: &File, at: u64, bytes: &[u8]) {
    file.write_all_at(bytes, at).unwrap();
}

pub fn get(file: &File, at: u64, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    file.read_exact_at(&mut bytes, at).unwrap();
    bytes
}

pub fn u16_at(file: &File, at: u64) -> u16 {
    u16::from_le_bytes(get(file, at, 2).try_into().unwrap())
}

/// Writes `descs` ((address, length, flags) each) as the chain of descriptors `head`,
/// `head + 1`, ... (each one's `next` the one after it), and makes `head` the available ring's
/// entry `n` of a queue of `queue` entries. The entry counts once [`publish`] passes it.
pub fn post_chain(file: &File, queue: u16, n: u16, head: u16, descs: &[(u64, u32, u16)]) {
    for (i, &(addr, len, flags)) in descs.iter().enumerate() {
        let index = head + i as u16;
        let mut d = [0u8; 16];
        d[..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..16].copy_from_slice(&(index + 1).to_le_bytes());
        put(file, DESC + u64::from(index) * 16, &d);
    }
    put(
        file,
        AVAIL + 4 + u64::from(n % queue) * 2,
        &head.to_le_bytes(),
    );
}

/// Sets the available ring's index to `avail_idx` and kicks.
pub fn publish(file: &File, kick: &EventFd, avail_idx: u16) {
    put(file, AVAIL + 2, &avail_idx.to_le_bytes());
    kick.write(1).unwrap();
}

/// The used ring's index.
pub fn used_idx(file: &File) -> u16 {
    u16_at(file, USED + 2)
}

/// (id, len) of the used ring's entry `n` of a queue of `queue` entries.
pub fn used_entry(file: &File, queue: u16, n: u16) -> (u32, u32) {
    let bytes = get(file, USED + 4 + u64::from(n % queue) * 8, 8);
    (
        u32::from_le_bytes(bytes[..4].try_into().unwrap()),
        u32::from_le_bytes(bytes[4..].try_into().unwrap()),
    )
}

/// Takes the backend and agrees on virtio 1 with protocol features.
pub fn negotiate_features(frontend: &mut Frontend) {
    frontend.set_owner().unwrap();
    let features = frontend.get_features().unwrap();
    assert!(features & F_PROTOCOL_FEATURES != 0);
    frontend
        .set_features(VIRTIO_F_VERSION_1 | F_PROTOCOL_FEATURES)
        .unwrap();
}

/// Starts queue 0 with `queue` entries at `DESC`/`AVAIL`/`USED`, from ring index `base`.
pub fn start_queue(frontend: &mut Frontend, queue: u16, base: u16, call: &EventFd, kick: &EventFd) {
    frontend.set_vring_num(0, queue).unwrap();
    let config = VringConfigData {
        queue_max_size: queue,
        queue_size: queue,
        flags: 0,
        desc_table_addr: UVA + DESC,
        used_ring_addr: UVA + USED,
        avail_ring_addr: UVA + AVAIL,
        log_addr: None,
    };
    frontend.set_vring_addr(0, &config).unwrap();
    frontend.set_vring_base(0, base).unwrap();
    frontend.set_vring_call(0, call).unwrap();
    frontend.set_vring_kick(0, kick).unwrap();
    frontend.set_vring_enable(0, true).unwrap();
}
