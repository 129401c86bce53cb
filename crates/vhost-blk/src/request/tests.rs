//! Hostile chains against [`Worker::serve`], on virtio-queue's mock split queue in a guest
//! memory of two regions with a gap between them: every bad chain gets IOERR or UNSUPP, or
//! is dropped, nothing panics, and no byte outside the chain's writable buffers changes.

use std::sync::Arc;

use thin_pool::testing::memory_pool;
use thin_pool::Pool;
use thinpool_frontend::{Target, VolumeTarget};
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::Worker;

const MIB: u64 = 1 << 20;
/// Region one: [0, 2 MiB); a gap; region two: [3 MiB, 4 MiB).
const REGION_TWO: u64 = 3 * MIB;
const HEADER: u64 = 0x10_0000;
const DATA: u64 = 0x11_0000;
const STATUS: u64 = 0x1f_0000;
const FILL: u8 = 0xee;
const W: u16 = VRING_DESC_F_WRITE as u16;
const NEXT: u16 = VRING_DESC_F_NEXT as u16;

struct Rig {
    pool: Pool,
    target: Arc<VolumeTarget>,
    mem: GuestMemoryMmap,
}

fn rig(read_only: bool) -> Rig {
    rig_on(memory_pool(), read_only)
}

/// A rig whose pool is `pool` (a pool on files lends its reads).
fn rig_on(pool: Pool, read_only: bool) -> Rig {
    pool.create_volume("guest-disk", 4 * MIB).unwrap();
    let volume = pool.volume("guest-disk").unwrap();
    volume.write(0, &[0x42; 8192], false).unwrap();
    drop(volume);
    let name = if read_only {
        pool.snapshot("guest-disk", "frozen", true).unwrap();
        "frozen"
    } else {
        "guest-disk"
    };
    let target = Arc::new(VolumeTarget::new(pool.volume(name).unwrap()));
    let mem = GuestMemoryMmap::from_ranges(&[
        (GuestAddress(0), 2 * MIB as usize),
        (GuestAddress(REGION_TWO), MIB as usize),
    ])
    .unwrap();
    Rig { pool, target, mem }
}

fn desc(addr: u64, len: u32, flags: u16) -> RawDescriptor {
    RawDescriptor::from(Descriptor::new(addr, len, flags, 0))
}

fn header(kind: u32, sector: u64) -> [u8; 16] {
    let mut bytes = [0u8; 16];
    bytes[..4].copy_from_slice(&kind.to_le_bytes());
    bytes[8..].copy_from_slice(&sector.to_le_bytes());
    bytes
}

/// Serves the chain `descs` (linked in order, or as given with `linked = false`); returns the
/// used length and the status byte. Fails if any byte outside the writable descriptors'
/// ranges (in guest memory) changed.
fn serve(rig: &Rig, descs: &[RawDescriptor], linked: bool) -> (u32, u8) {
    let vq = MockSplitQueue::new(&rig.mem, 256);
    let mut queue: Queue = vq.create_queue().unwrap();
    if linked {
        vq.build_desc_chain(descs).unwrap();
    } else {
        vq.add_desc_chains(descs, 0).unwrap();
    }
    let rings = (vq.start().0, vq.end().0);
    let before = snapshot(&rig.mem);
    let chain = queue.pop_descriptor_chain(&rig.mem).expect("a chain");
    let used = Worker::new(true).serve(&*rig.target, &rig.mem, chain);
    let after = snapshot(&rig.mem);
    let writable: Vec<(u64, u64)> = descs
        .iter()
        .map(|d| Descriptor::from(*d))
        .filter(|d| d.flags() & W != 0)
        .map(|d| (d.addr().0, d.addr().0.saturating_add(u64::from(d.len()))))
        .collect();
    for (i, (a, b)) in before.iter().zip(&after).enumerate() {
        let address = if i < 2 * MIB as usize {
            i as u64
        } else {
            REGION_TWO + i as u64 - 2 * MIB
        };
        let allowed = writable.iter().any(|&(s, e)| (s..e).contains(&address))
            || (rings.0..rings.1).contains(&address);
        assert!(
            a == b || allowed,
            "byte at {address:#x} changed outside the chain"
        );
    }
    (used, rig.mem.read_obj::<u8>(GuestAddress(STATUS)).unwrap())
}

fn snapshot(mem: &GuestMemoryMmap) -> Vec<u8> {
    let mut bytes = vec![0u8; 3 * MIB as usize];
    mem.read_slice(&mut bytes[..2 * MIB as usize], GuestAddress(0))
        .unwrap();
    mem.read_slice(&mut bytes[2 * MIB as usize..], GuestAddress(REGION_TWO))
        .unwrap();
    bytes
}

/// Guest memory filled, a header written; returns the header's descriptor.
fn prepare(rig: &Rig, kind: u32, sector: u64) -> RawDescriptor {
    let fill = vec![FILL; 2 * MIB as usize];
    rig.mem.write_slice(&fill, GuestAddress(0)).unwrap();
    rig.mem
        .write_slice(&header(kind, sector), GuestAddress(HEADER))
        .unwrap();
    desc(HEADER, 16, 0)
}

const OK: u8 = VIRTIO_BLK_S_OK as u8;
const IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
const UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;

#[test]
fn a_good_read_and_get_id_land_in_their_buffers() {
    let rig = rig(false);
    let h = prepare(&rig, VIRTIO_BLK_T_IN, 8);
    let (used, status) = serve(&rig, &[h, desc(DATA, 8192, W), desc(STATUS, 1, W)], true);
    assert_eq!((used, status), (8193, OK));
    let mut data = vec![0u8; 8192];
    rig.mem.read_slice(&mut data, GuestAddress(DATA)).unwrap();
    assert!(data[..4096].iter().all(|&b| b == 0x42) && data[4096..].iter().all(|&b| b == 0));
    let h = prepare(&rig, VIRTIO_BLK_T_GET_ID, 0);
    let (used, status) = serve(&rig, &[h, desc(DATA, 20, W), desc(STATUS, 1, W)], true);
    assert_eq!((used, status), (21, OK));
    let mut id = [0u8; 20];
    rig.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    assert_eq!(&id[..10], b"guest-disk");
    assert!(id[10..].iter().all(|&b| b == 0));
    drop(rig.target);
    rig.pool.close().unwrap();
}

/// A read into 96 buffers of 2 KiB, alternately in region one and region two (more buffers
/// than one `preadv` takes), over two mapped blocks and an unmapped one: the bytes a read of
/// the volume gives, on a pool that lends (on files: `preadv` into guest memory) and on one
/// that does not (memory: through the worker's buffer); then a write from the same buffers.
#[test]
fn a_read_into_many_buffers_in_both_regions_gets_the_volumes_bytes() {
    let dir = std::env::temp_dir().join(format!("vhost-request-lent-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let on_files = thin_pool::testing::dir_pool(
        &dir.join("pool"),
        16 * MIB,
        thin_pool::testing::deterministic_options(),
    );
    for (rig, lends) in [(rig_on(on_files, false), true), (rig(false), false)] {
        assert_eq!(rig.target.volume().can_lend(), lends);
        let stamp: Vec<u8> = (0..65536u32).map(|i| (i / 512 * 3 + 1) as u8).collect();
        rig.target.volume().write(65536, &stamp, false).unwrap();
        let buffers = 96u64;
        let h = prepare(&rig, VIRTIO_BLK_T_IN, 0);
        let mut descs = vec![h];
        let addr = |i: u64| {
            if i.is_multiple_of(2) {
                DATA + i * 2048
            } else {
                REGION_TWO + i * 2048
            }
        };
        descs.extend((0..buffers).map(|i| desc(addr(i), 2048, W)));
        descs.push(desc(STATUS, 1, W));
        let (used, status) = serve(&rig, &descs, true);
        assert_eq!((used, status), (buffers as u32 * 2048 + 1, OK));
        let mut expected = vec![0u8; buffers as usize * 2048];
        rig.target.volume().read(0, &mut expected).unwrap();
        assert!(expected[65536..131072] == stamp[..] && expected[..4096] == [0x42; 4096]);
        for i in 0..buffers {
            let mut got = vec![0u8; 2048];
            rig.mem.read_slice(&mut got, GuestAddress(addr(i))).unwrap();
            let at = i as usize * 2048;
            assert!(got == expected[at..at + 2048], "buffer {i}");
        }
        // The same buffers written back with new bytes, at sector 1: in place where the
        // blocks are mapped (lent on files: `pwritev` from guest memory), the rest provisioned.
        let h = prepare(&rig, VIRTIO_BLK_T_OUT, 1);
        let new: Vec<u8> = (0..buffers * 2048)
            .map(|i| (i / 512 * 5 + 7) as u8)
            .collect();
        for i in 0..buffers {
            let at = i as usize * 2048;
            rig.mem
                .write_slice(&new[at..at + 2048], GuestAddress(addr(i)))
                .unwrap();
        }
        descs[0] = h;
        for (i, d) in descs[1..=buffers as usize].iter_mut().enumerate() {
            *d = desc(addr(i as u64), 2048, 0);
        }
        let (used, status) = serve(&rig, &descs, true);
        assert_eq!((used, status), (1, OK));
        let mut back = vec![0u8; new.len()];
        rig.target.volume().read(512, &mut back).unwrap();
        assert!(back == new, "written bytes read back");
        drop(rig.target);
        rig.pool.close().unwrap();
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn chains_outside_guest_memory_are_dropped_untouched() {
    let rig = rig(false);
    let cases: Vec<(&str, RawDescriptor)> = vec![
        ("beyond all memory", desc(0xffff_0000_0000, 4096, W)),
        ("overlong length", desc(DATA, u32::MAX, W)),
        ("into the gap", desc(2 * MIB - 2048, 4096, W)),
        ("address wraps", desc(u64::MAX - 100, 4096, W)),
    ];
    for (what, data) in cases {
        let h = prepare(&rig, VIRTIO_BLK_T_IN, 0);
        let (used, status) = serve(&rig, &[h, data, desc(STATUS, 1, W)], true);
        assert_eq!((used, status), (0, FILL), "{what}");
    }
    // The header itself outside memory.
    prepare(&rig, VIRTIO_BLK_T_IN, 0);
    let (used, status) = serve(&rig, &[desc(5 * MIB, 16, 0), desc(STATUS, 1, W)], true);
    assert_eq!((used, status), (0, FILL));
    // No writable byte at all: nowhere to put a status.
    let h = prepare(&rig, VIRTIO_BLK_T_FLUSH, 0);
    assert_eq!(serve(&rig, &[h], true), (0, FILL));
    drop(rig.target);
    rig.pool.close().unwrap();
}

#[test]
fn malformed_requests_get_an_error_status() {
    let rig = rig(false);
    let status = desc(STATUS, 1, W);
    let data = desc(DATA, 4096, W);
    let cases: Vec<(&str, u32, u64, Vec<RawDescriptor>, u8)> = vec![
        (
            "short header",
            VIRTIO_BLK_T_IN,
            0,
            vec![desc(HEADER, 8, 0), data, status],
            IOERR,
        ),
        (
            "write-only header",
            VIRTIO_BLK_T_IN,
            0,
            vec![desc(HEADER, 16, W), status],
            IOERR,
        ),
        (
            "unknown type",
            99,
            0,
            vec![desc(HEADER, 16, 0), status],
            UNSUPP,
        ),
        (
            "sector overflow",
            VIRTIO_BLK_T_IN,
            u64::MAX,
            vec![desc(HEADER, 16, 0), data, status],
            IOERR,
        ),
        (
            "past the end",
            VIRTIO_BLK_T_IN,
            8191,
            vec![desc(HEADER, 16, 0), data, status],
            IOERR,
        ),
        (
            "partial sector",
            VIRTIO_BLK_T_IN,
            0,
            vec![desc(HEADER, 16, 0), desc(DATA, 100, W), status],
            IOERR,
        ),
        (
            "no discard segment",
            VIRTIO_BLK_T_DISCARD,
            0,
            vec![desc(HEADER, 16, 0), status],
            IOERR,
        ),
        (
            "odd segment bytes",
            VIRTIO_BLK_T_DISCARD,
            0,
            vec![desc(HEADER, 16, 0), desc(DATA, 17, 0), status],
            IOERR,
        ),
    ];
    for (what, kind, sector, descs, expected) in cases {
        prepare(&rig, kind, sector);
        let (_, got) = serve(&rig, &descs, true);
        assert_eq!(got, expected, "{what}");
    }
    drop(rig.target);
    rig.pool.close().unwrap();
}

#[test]
fn discard_and_write_zeroes_segments_are_checked() {
    let rig = rig(false);
    let status = desc(STATUS, 1, W);
    // Discard segments: UNMAP on a discard is unsupported; a segment past the end fails.
    let segment = |sector: u64, sectors: u32, flags: u32| {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&sector.to_le_bytes());
        bytes[8..12].copy_from_slice(&sectors.to_le_bytes());
        bytes[12..].copy_from_slice(&flags.to_le_bytes());
        bytes
    };
    for (kind, seg, expected) in [
        (VIRTIO_BLK_T_DISCARD, segment(0, 8, 1), UNSUPP),
        (VIRTIO_BLK_T_WRITE_ZEROES, segment(0, 8, 2), UNSUPP),
        (VIRTIO_BLK_T_WRITE_ZEROES, segment(8190, 8, 1), IOERR),
        (VIRTIO_BLK_T_WRITE_ZEROES, segment(0, 8, 1), OK),
    ] {
        let h = prepare(&rig, kind, 0);
        rig.mem.write_slice(&seg, GuestAddress(DATA)).unwrap();
        let (_, got) = serve(&rig, &[h, desc(DATA, 16, 0), status], true);
        assert_eq!(got, expected, "{kind} {seg:?}");
    }
    let mut back = vec![1u8; 4096];
    rig.target.read(0, &mut back).unwrap();
    assert!(
        back.iter().all(|&b| b == 0),
        "the good write-zeroes did not zero"
    );
    drop(rig.target);
    rig.pool.close().unwrap();
}

#[test]
fn a_looping_chain_ends_and_stays_in_its_buffers() {
    let rig = rig(false);
    let h = prepare(&rig, VIRTIO_BLK_T_IN, 0);
    let looped = [
        RawDescriptor::from(Descriptor::new(HEADER, 16, NEXT, 1)),
        RawDescriptor::from(Descriptor::new(DATA, 4096, W | NEXT, 0)),
    ];
    let _ = h;
    // Bounded by the queue size: it ends, with whatever status, inside its buffers.
    let (used, _) = serve(&rig, &looped, false);
    assert!(used <= 16 * 4096, "used length {used}");
    drop(rig.target);
    rig.pool.close().unwrap();
}

#[test]
fn a_read_only_volume_refuses_writes_and_discards() {
    let rig = rig(true);
    for kind in [
        VIRTIO_BLK_T_OUT,
        VIRTIO_BLK_T_DISCARD,
        VIRTIO_BLK_T_WRITE_ZEROES,
    ] {
        let h = prepare(&rig, kind, 0);
        let mut seg = [0u8; 16];
        seg[8..12].copy_from_slice(&8u32.to_le_bytes());
        rig.mem.write_slice(&seg, GuestAddress(DATA)).unwrap();
        let (_, status) = serve(&rig, &[h, desc(DATA, 16 * 32, 0), desc(STATUS, 1, W)], true);
        assert_eq!(status, IOERR, "request type {kind}");
    }
    let mut back = vec![0u8; 4096];
    rig.target.read(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0x42));
    drop(rig.target);
    rig.pool.close().unwrap();
}
