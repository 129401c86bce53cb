//! One suite of the [`DataDevice`] contract, run against every implementation, real or
//! fake, as thin-provisioning-tools runs one space-map suite against each space map: what
//! the engine tests learn on a fake then holds on the real devices.
//!
//! The contract, from the trait's documentation and what the engine relies on: a completed
//! write reads back at any offset and touches nothing else; `zero` makes its range read as
//! zeros and only its range; `discard` changes nothing outside its range (inside it may
//! leave anything) and leaves the device usable; `copy` moves bytes between non-overlapping
//! ranges; `flush` succeeds; I/O reaching past the end fails with `InvalidInput` and changes
//! nothing; a fresh device reads as zeros; the counters account for every byte; growth
//! keeps the data and the new space reads as zeros, and never shrinks; writers on disjoint
//! ranges in many threads all land.
//!
//! Each check runs on a fresh device of [`DEVICE_BYTES`] from the test's maker, with a
//! byte-for-byte model beside it. A device that offers less than the trait allows (whole
//! sectors only, no counters, no way to grow) says so on its [`Subject`], and the checks
//! that need it are passed over for it.

use crate::engine::data_device::DataDevice;
use std::any::Any;
use std::io;
use std::sync::Arc;

/// Size of every device under test: several of the 1 MiB chunks the devices zero and copy
/// in, and many 64 KiB data blocks.
pub const DEVICE_BYTES: u64 = 8 << 20;
const KIB: u64 = 1024;
const MIB: u64 = 1 << 20;

/// How a device under test grows.
pub enum Growth {
    /// `grow_to` grows it.
    GrowTo,
    /// Something outside grows it (to the size given), then `refresh_size` sees it;
    /// `grow_to` alone only reports the size.
    Outside(Box<dyn Fn(u64)>),
    /// It cannot grow: `grow_to` reports the size.
    Fixed,
}

/// One device under test, with what it offers beyond the contract's core.
pub struct Subject {
    device: Arc<dyn DataDevice>,
    unaligned: bool,
    counts: bool,
    growth: Growth,
    /// Dropped after the device (its loop device, its directory).
    _keep: Vec<Box<dyn Any>>,
}

impl Subject {
    /// A device of [`DEVICE_BYTES`], zeroed, that takes I/O at any byte offset and length,
    /// keeps its counters and grows by `grow_to`.
    pub fn new(device: Arc<dyn DataDevice>) -> Subject {
        assert_eq!(
            device.size_bytes(),
            DEVICE_BYTES,
            "a device under test's size"
        );
        Subject {
            device,
            unaligned: true,
            counts: true,
            growth: Growth::GrowTo,
            _keep: Vec::new(),
        }
    }

    /// It takes whole 512-byte sectors only.
    pub fn sector_aligned_only(mut self) -> Subject {
        self.unaligned = false;
        self
    }

    /// It keeps no counters.
    pub fn without_counters(mut self) -> Subject {
        self.counts = false;
        self
    }

    /// It grows as `growth` says.
    pub fn growing(mut self, growth: Growth) -> Subject {
        self.growth = growth;
        self
    }

    /// Keep `guard` (a loop device, a directory) until after the device is dropped.
    pub fn keeping(mut self, guard: impl Any) -> Subject {
        self._keep.push(Box::new(guard));
        self
    }
}

/// Runs every check of the suite, each on a fresh device from `make` (`None`: the device
/// cannot be made here and the run is skipped, as `make` said), naming on failure the
/// implementation and the check.
pub fn conforms(name: &str, make: impl Fn() -> Option<Subject>) {
    for (check, run) in CHECKS {
        let Some(subject) = make() else { return };
        eprintln!("{name}: {check}");
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&subject)));
        if let Err(panic) = outcome {
            eprintln!("{name} fails {check}");
            std::panic::resume_unwind(panic);
        }
    }
}

/// Bytes that differ from position to position and from `seed` to `seed`.
fn pattern(seed: u64, len: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

/// What the device must hold, byte for byte.
struct Model {
    bytes: Vec<u8>,
}

impl Model {
    fn new() -> Model {
        Model {
            bytes: vec![0; DEVICE_BYTES as usize],
        }
    }

    fn write(&mut self, device: &dyn DataDevice, offset: u64, data: &[u8]) {
        device
            .write_at(offset, data)
            .unwrap_or_else(|e| panic!("write {}+{}: {e}", offset, data.len()));
        self.bytes[offset as usize..offset as usize + data.len()].copy_from_slice(data);
    }

    fn fill(&mut self, device: &dyn DataDevice, offset: u64, len: u64, seed: u64) {
        self.write(device, offset, &pattern(seed, len));
    }

    fn zero(&mut self, device: &dyn DataDevice, offset: u64, len: u64) {
        device
            .zero(offset, len)
            .unwrap_or_else(|e| panic!("zero {offset}+{len}: {e}"));
        self.bytes[offset as usize..(offset + len) as usize].fill(0);
    }

    fn copy(&mut self, device: &dyn DataDevice, from: u64, to: u64, len: u64) {
        device
            .copy(from, to, len)
            .unwrap_or_else(|e| panic!("copy {from}->{to} {len}: {e}"));
        let (from, to, len) = (from as usize, to as usize, len as usize);
        self.bytes.copy_within(from..from + len, to);
    }

    /// The device holds exactly the model.
    fn assert_matches(&self, device: &dyn DataDevice, what: &str) {
        assert_eq!(device.size_bytes(), self.bytes.len() as u64, "{what}: size");
        let mut buf = vec![0u8; MIB as usize];
        for (i, expected) in self.bytes.chunks(MIB as usize).enumerate() {
            let offset = i as u64 * MIB;
            device
                .read_at(offset, &mut buf[..expected.len()])
                .unwrap_or_else(|e| panic!("{what}: read {offset}: {e}"));
            if let Some(at) = (0..expected.len()).find(|&j| buf[j] != expected[j]) {
                panic!(
                    "{what}: byte {} reads {:#04x}, the model says {:#04x}",
                    offset + at as u64,
                    buf[at],
                    expected[at]
                );
            }
        }
    }
}

fn read(device: &dyn DataDevice, offset: u64, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len as usize];
    device
        .read_at(offset, &mut buf)
        .unwrap_or_else(|e| panic!("read {offset}+{len}: {e}"));
    buf
}

fn assert_invalid_input(result: io::Result<()>, what: &str) {
    match result {
        Err(e) => assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{what}: {e}"),
        Ok(()) => panic!("{what} succeeded"),
    }
}

/// (written, zeroed, copied, flushes) so far.
fn counters(device: &dyn DataDevice) -> [u64; 4] {
    use std::sync::atomic::Ordering::Relaxed;
    let c = device.counters();
    [
        c.written_bytes.load(Relaxed),
        c.zeroed_bytes.load(Relaxed),
        c.copied_bytes.load(Relaxed),
        c.flushes.load(Relaxed),
    ]
}

// ---------------------------------------------------------------------------------------
// The checks.

fn fresh_device_reads_zeros_at_its_size(s: &Subject) {
    let device = &*s.device;
    assert_eq!(device.size_bytes(), DEVICE_BYTES);
    assert_eq!(device.refresh_size().unwrap(), DEVICE_BYTES);
    Model::new().assert_matches(device, "fresh device");
}

fn writes_read_back_and_touch_nothing_else(s: &Subject) {
    let device = &*s.device;
    let mut model = Model::new();
    model.fill(device, 0, 4 * KIB, 1);
    model.fill(device, 64 * KIB, 64 * KIB, 2);
    model.fill(device, DEVICE_BYTES - 4 * KIB, 4 * KIB, 3);
    // Across a 1 MiB boundary, and one write of several MiB.
    model.fill(device, MIB - 512, 2 * KIB, 4);
    model.fill(device, 2 * MIB + 512, 3 * MIB, 5);
    // Overwrites: the last write wins.
    model.fill(device, 64 * KIB + 4 * KIB, 8 * KIB, 6);
    if s.unaligned {
        model.fill(device, 1, 1, 7);
        model.fill(device, 4093, 7, 8);
        model.fill(device, 130 * KIB + 3, 70 * KIB + 1, 9);
        model.fill(device, DEVICE_BYTES - 1, 1, 10);
    }
    // Nothing at all.
    device.write_at(DEVICE_BYTES, &[]).unwrap();
    device.read_at(DEVICE_BYTES, &mut []).unwrap();
    assert_eq!(
        read(device, 64 * KIB, 4 * KIB),
        pattern(2, 64 * KIB)[..4096]
    );
    model.assert_matches(device, "after writes");
}

fn io_past_the_end_fails_and_changes_nothing(s: &Subject) {
    let device = &*s.device;
    let mut model = Model::new();
    model.fill(device, DEVICE_BYTES - 64 * KIB, 64 * KIB, 1);
    let past: [(u64, u64); 4] = [
        (DEVICE_BYTES - 4 * KIB, 8 * KIB), // straddles the end
        (DEVICE_BYTES, 512),               // starts at the end
        (DEVICE_BYTES + 4 * KIB, 0),       // nothing, but beyond the end
        (u64::MAX - 511, 1024),            // offset + length overflows
    ];
    for (offset, len) in past {
        let what = |op: &str| format!("{op} {offset}+{len} on {DEVICE_BYTES} bytes");
        let mut buf = vec![0u8; len as usize];
        assert_invalid_input(device.read_at(offset, &mut buf), &what("read"));
        let data = vec![0xee; len as usize];
        assert_invalid_input(device.write_at(offset, &data), &what("write"));
        assert_invalid_input(device.zero(offset, len), &what("zero"));
        assert_invalid_input(device.discard(offset, len), &what("discard"));
        assert_invalid_input(device.copy(0, offset, len), &what("copy to"));
        assert_invalid_input(device.copy(offset, 0, len), &what("copy from"));
    }
    model.assert_matches(device, "after I/O past the end");
}

fn zero_clears_its_range_and_only_its_range(s: &Subject) {
    let device = &*s.device;
    let mut model = Model::new();
    model.fill(device, 0, 6 * MIB, 1);
    model.zero(device, 64 * KIB, 64 * KIB);
    model.zero(device, 4 * KIB, 8 * KIB);
    // Several MiB (the fallbacks work in 1 MiB chunks), and zeros over zeros.
    model.zero(device, MIB + 4 * KIB, 3 * MIB);
    model.zero(device, 7 * MIB, MIB);
    model.zero(device, 64 * KIB, 0);
    if s.unaligned {
        model.zero(device, 130 * KIB + 1, 9 * KIB + 3);
        model.zero(device, 500, 24);
    }
    model.assert_matches(device, "after zeroing");
    // The range is writable again.
    model.fill(device, 64 * KIB, 64 * KIB, 2);
    model.assert_matches(device, "after writing over zeros");
}

fn discard_leaves_its_neighbours_and_the_device_usable(s: &Subject) {
    let device = &*s.device;
    let mut model = Model::new();
    model.fill(device, 0, 4 * MIB, 1);
    let mut ranges = vec![(64 * KIB, 64 * KIB), (MIB, 2 * MIB), (3 * MIB, 0)];
    if s.unaligned {
        ranges.push((200 * KIB + 7, 100 * KIB + 5));
    }
    for &(offset, len) in &ranges {
        device
            .discard(offset, len)
            .unwrap_or_else(|e| panic!("discard {offset}+{len}: {e}"));
        // A discarded range may read as anything: the model takes what it reads.
        let now = read(device, offset, len);
        model.bytes[offset as usize..(offset + len) as usize].copy_from_slice(&now);
    }
    model.assert_matches(device, "after discards");
    for (i, &(offset, len)) in ranges.iter().enumerate() {
        model.fill(device, offset, len, 10 + i as u64);
    }
    model.assert_matches(device, "after writing over discarded ranges");
}

fn copy_moves_bytes_between_ranges(s: &Subject) {
    let device = &*s.device;
    let mut model = Model::new();
    model.fill(device, 0, 256 * KIB, 1);
    model.copy(device, 0, 512 * KIB, 64 * KIB);
    model.copy(device, 64 * KIB, 4 * MIB - 64 * KIB, 128 * KIB);
    // Several MiB, crossing the 1 MiB chunks.
    model.fill(device, MIB, MIB + 4 * KIB, 2);
    model.copy(device, MIB, 5 * MIB + 4 * KIB, 2 * MIB + 8 * KIB);
    // A hole copied over data.
    model.copy(device, 3 * MIB, 0, 64 * KIB);
    model.copy(device, 0, DEVICE_BYTES - 64 * KIB, 0);
    if s.unaligned {
        model.copy(device, 100 * KIB + 3, 700 * KIB + 1, 10 * KIB + 7);
        model.copy(device, 17, DEVICE_BYTES - 1, 1);
    }
    model.assert_matches(device, "after copies");
}

fn flush_keeps_what_was_written(s: &Subject) {
    let device = &*s.device;
    let mut model = Model::new();
    model.fill(device, 128 * KIB, 64 * KIB, 1);
    let before = counters(device);
    device.flush().unwrap();
    device.flush().unwrap();
    if s.counts {
        assert_eq!(counters(device)[3], before[3] + 2, "flushes counted");
    }
    model.assert_matches(device, "after flushes");
}

fn counters_account_for_every_byte(s: &Subject) {
    if !s.counts {
        return;
    }
    let device = &*s.device;
    let mut model = Model::new();
    let [written, zeroed, copied, _] = counters(device);
    model.fill(device, 0, 192 * KIB, 1);
    let after_write = counters(device);
    assert_eq!(
        after_write[0],
        written + 192 * KIB,
        "write_at counts as written"
    );
    assert_eq!((after_write[1], after_write[2]), (zeroed, copied));
    // Zeroing: by the device, or by writing zeros; either way every byte once.
    model.zero(device, 64 * KIB, 64 * KIB + 512);
    let after_zero = counters(device);
    assert_eq!(
        (after_zero[0] - after_write[0]) + (after_zero[1] - after_write[1]),
        64 * KIB + 512,
        "zero counts each byte as written or zeroed"
    );
    assert_eq!(after_zero[2], copied);
    // Copying: by the device, or through a buffer (reads, then writes).
    model.copy(device, 0, MIB, 128 * KIB);
    let after_copy = counters(device);
    assert_eq!(
        (after_copy[0] - after_zero[0]) + (after_copy[2] - after_zero[2]),
        128 * KIB,
        "copy counts each byte as written or copied"
    );
    assert_eq!(after_copy[1], after_zero[1]);
    model.assert_matches(device, "after counted I/O");
}

fn growth_keeps_the_data_and_the_new_space_reads_zeros(s: &Subject) {
    let device = &*s.device;
    let mut model = Model::new();
    model.fill(device, DEVICE_BYTES - 64 * KIB, 64 * KIB, 1);
    let grown = DEVICE_BYTES + 2 * MIB;
    match &s.growth {
        Growth::GrowTo => assert_eq!(device.grow_to(grown).unwrap(), grown),
        Growth::Fixed => {
            assert_eq!(device.grow_to(grown).unwrap(), DEVICE_BYTES);
            assert_eq!(device.size_bytes(), DEVICE_BYTES);
            return;
        }
        Growth::Outside(grow) => {
            // `grow_to` cannot grow it, and says so by the size it returns.
            assert_eq!(device.grow_to(grown).unwrap(), DEVICE_BYTES);
            grow(grown);
            assert_eq!(device.refresh_size().unwrap(), grown);
        }
    }
    assert_eq!(device.size_bytes(), grown);
    model.bytes.resize(grown as usize, 0);
    model.assert_matches(device, "after growing");
    model.fill(device, DEVICE_BYTES - 4 * KIB, 8 * KIB, 2);
    model.fill(device, grown - 64 * KIB, 64 * KIB, 3);
    model.copy(
        device,
        DEVICE_BYTES - 64 * KIB,
        DEVICE_BYTES + 64 * KIB,
        64 * KIB,
    );
    assert_invalid_input(device.write_at(grown, &[1; 512]), "write past the new end");
    // Never shrinks.
    assert_eq!(device.grow_to(DEVICE_BYTES).unwrap(), grown);
    model.assert_matches(device, "after I/O in the new space");
}

fn writers_on_disjoint_ranges_in_many_threads_all_land(s: &Subject) {
    const THREADS: u64 = 4;
    const WRITES: u64 = 32;
    let device = &*s.device;
    let stripe = DEVICE_BYTES / THREADS;
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            scope.spawn(move || {
                for i in 0..WRITES {
                    let offset = t * stripe + (i * 37 % (stripe / (16 * KIB))) * 16 * KIB;
                    let data = pattern(t << 32 | i, 16 * KIB);
                    device.write_at(offset, &data).unwrap();
                    assert_eq!(read(device, offset, 16 * KIB), data, "thread {t} write {i}");
                }
            });
        }
    });
    // Replay in the same order on the model: within a thread writes are ordered, and the
    // threads' ranges are disjoint.
    let mut model = Model::new();
    for t in 0..THREADS {
        for i in 0..WRITES {
            let offset = t * stripe + (i * 37 % (stripe / (16 * KIB))) * 16 * KIB;
            let data = pattern(t << 32 | i, 16 * KIB);
            model.bytes[offset as usize..(offset + 16 * KIB) as usize].copy_from_slice(&data);
        }
    }
    model.assert_matches(device, "after concurrent writers");
}

/// One check of the suite.
type Check = fn(&Subject);

/// The suite, by name.
const CHECKS: [(&str, Check); 10] = [
    (
        "fresh_device_reads_zeros_at_its_size",
        fresh_device_reads_zeros_at_its_size,
    ),
    (
        "writes_read_back_and_touch_nothing_else",
        writes_read_back_and_touch_nothing_else,
    ),
    (
        "io_past_the_end_fails_and_changes_nothing",
        io_past_the_end_fails_and_changes_nothing,
    ),
    (
        "zero_clears_its_range_and_only_its_range",
        zero_clears_its_range_and_only_its_range,
    ),
    (
        "discard_leaves_its_neighbours_and_the_device_usable",
        discard_leaves_its_neighbours_and_the_device_usable,
    ),
    (
        "copy_moves_bytes_between_ranges",
        copy_moves_bytes_between_ranges,
    ),
    ("flush_keeps_what_was_written", flush_keeps_what_was_written),
    (
        "counters_account_for_every_byte",
        counters_account_for_every_byte,
    ),
    (
        "growth_keeps_the_data_and_the_new_space_reads_zeros",
        growth_keeps_the_data_and_the_new_space_reads_zeros,
    ),
    (
        "writers_on_disjoint_ranges_in_many_threads_all_land",
        writers_on_disjoint_ranges_in_many_threads_all_land,
    ),
];
