//! A conformance suite for [`Export`] implementations (feature `testing`): one run checks
//! what the session relies on, against a byte model, so every implementation (the memory
//! export here, the binary's volume, raw-file and null exports) is held to the same rules.
//!
//! [`export_conformance`] makes a fresh export with `make` for each part and checks:
//! reads return what was written (whole sectors, at any sector offset, across one another);
//! WRITE_ZEROES reads back as zeroes, with and without `may_trim`; a refused fast zero
//! changes nothing; TRIM changes nothing outside its range; FLUSH succeeds; BLOCK_STATUS
//! returns 1 to `extents_max` consecutive extents starting at the offset, none past the end,
//! and every extent flagged `zero` reads as zeroes; a read-only export refuses every write.
//! An export that keeps no data (the binary's null export) passes `keeps_data: false`: its
//! reads must then be zeroes. Failures panic with the step and the seed.

use std::sync::Arc;

use crate::error::ErrorKind;
use crate::export::{Export, ZeroOptions, SECTOR_BYTES};

/// Bytes of the export the suite uses (from its start; less if the export is smaller).
const SPAN_BYTES_MAX: u64 = 1 << 20;

/// Random steps per run of the model check.
const STEPS: u32 = 400;

/// A small deterministic generator (xorshift), so a failure replays from its seed.
struct Steps(u64);

impl Steps {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound.max(1)
    }
}

/// What the model knows of each byte: `None` after a TRIM (undefined).
struct Model {
    bytes: Vec<Option<u8>>,
    keeps_data: bool,
}

impl Model {
    fn check(&self, offset: u64, data: &[u8], what: &str) {
        for (index, byte) in data.iter().enumerate() {
            let at = offset as usize + index;
            let expected = if self.keeps_data {
                self.bytes[at]
            } else {
                Some(0)
            };
            if let Some(expected) = expected {
                assert_eq!(*byte, expected, "{what}: byte {at}");
            }
        }
    }

    fn set(&mut self, offset: u64, data: &[u8]) {
        for (index, byte) in data.iter().enumerate() {
            self.bytes[offset as usize + index] = Some(*byte);
        }
    }
}

/// Runs the suite on exports made by `make` (each call a fresh, zero-filled export, as a new
/// volume or a new memory export is). `keeps_data` is false for an export that discards
/// what is written and reads zeroes. Panics, naming the step and `seed`, on a violation.
pub fn export_conformance(make: impl Fn() -> Arc<dyn Export>, keeps_data: bool, seed: u64) {
    let export = make();
    if export.capabilities().read_only {
        read_only_refuses_writes(export.as_ref());
        return;
    }
    model_check(make().as_ref(), keeps_data, seed);
    refused_fast_zero_changes_nothing(make().as_ref(), keeps_data);
    block_status_rules(make().as_ref(), seed);
}

fn span(export: &dyn Export) -> u64 {
    let size = export.size_bytes();
    assert!(
        size.is_multiple_of(SECTOR_BYTES),
        "size {size} is not whole sectors"
    );
    assert!(size > 0, "an export of 0 bytes");
    size.min(SPAN_BYTES_MAX)
}

/// A random sector-aligned range inside `span`: (offset, length), length at least a sector.
fn range(steps: &mut Steps, span: u64) -> (u64, u64) {
    let sectors = span / SECTOR_BYTES;
    let first = steps.below(sectors);
    let count = 1 + steps.below((sectors - first).min(64));
    (first * SECTOR_BYTES, count * SECTOR_BYTES)
}

fn model_check(export: &dyn Export, keeps_data: bool, seed: u64) {
    let span = span(export);
    let mut steps = Steps(seed | 1);
    let mut model = Model {
        bytes: vec![Some(0); span as usize],
        keeps_data,
    };
    let trims = export.capabilities().trim;
    for step in 0..STEPS {
        let (offset, length) = range(&mut steps, span);
        let what = format!("step {step} (seed {seed}) at {offset} length {length}");
        match steps.below(6) {
            0 | 1 => {
                let mut buffer = vec![0xa5u8; length as usize];
                export
                    .read_at(offset, &mut buffer)
                    .unwrap_or_else(|e| panic!("read, {what}: {e}"));
                model.check(offset, &buffer, &format!("read, {what}"));
            }
            2 | 3 => {
                let fill = steps.next();
                let data: Vec<u8> = (0..length)
                    .map(|index| (fill ^ index.wrapping_mul(31)) as u8)
                    .collect();
                let fua = steps.below(4) == 0;
                export
                    .write_at(offset, &data, fua)
                    .unwrap_or_else(|e| panic!("write, {what}: {e}"));
                model.set(offset, &data);
            }
            4 => {
                let options = ZeroOptions {
                    may_trim: steps.below(2) == 0,
                    ..ZeroOptions::default()
                };
                export
                    .write_zeroes(offset, length, options)
                    .unwrap_or_else(|e| panic!("write zeroes {options:?}, {what}: {e}"));
                model.set(offset, &vec![0u8; length as usize]);
            }
            _ if trims => {
                export
                    .trim(offset, length, false)
                    .unwrap_or_else(|e| panic!("trim, {what}: {e}"));
                for byte in &mut model.bytes[offset as usize..(offset + length) as usize] {
                    *byte = None;
                }
            }
            _ => export
                .flush()
                .unwrap_or_else(|e| panic!("flush, {what}: {e}")),
        }
    }
    export.flush().expect("flush at the end");
    let mut all = vec![0u8; span as usize];
    export.read_at(0, &mut all).expect("read of the whole span");
    model.check(0, &all, &format!("final read (seed {seed})"));
}

fn refused_fast_zero_changes_nothing(export: &dyn Export, keeps_data: bool) {
    let data = vec![0x5au8; 2 * SECTOR_BYTES as usize];
    export.write_at(0, &data, false).expect("write");
    let fast = ZeroOptions {
        may_trim: true,
        fast: true,
        fua: false,
    };
    match export.write_zeroes(0, data.len() as u64, fast) {
        Ok(()) => {
            assert!(
                export.capabilities().fast_zero,
                "a fast zero succeeded on an export without fast_zero"
            );
            let mut buffer = vec![1u8; data.len()];
            export.read_at(0, &mut buffer).expect("read");
            assert!(
                buffer.iter().all(|&byte| byte == 0),
                "a fast zero left data"
            );
        }
        Err(error) => {
            assert_eq!(
                error.kind(),
                ErrorKind::NotSupported,
                "a refused fast zero: {error}"
            );
            let mut buffer = vec![0u8; data.len()];
            export.read_at(0, &mut buffer).expect("read");
            let expected = if keeps_data {
                data
            } else {
                vec![0u8; buffer.len()]
            };
            assert_eq!(buffer, expected, "a refused fast zero changed data");
        }
    }
}

fn block_status_rules(export: &dyn Export, seed: u64) {
    let span = span(export);
    let size = export.size_bytes();
    let mut steps = Steps(seed.rotate_left(17) | 1);
    for step in 0..64 {
        let (offset, length) = range(&mut steps, span);
        if step % 2 == 0 {
            let data = vec![0xffu8; length as usize];
            export.write_at(offset, &data, false).expect("write");
        }
        let (probe, probe_length) = range(&mut steps, span);
        let extents_max = 1 + steps.below(8) as usize;
        let what = format!("block status {step} (seed {seed}) at {probe} length {probe_length}");
        let extents = export
            .block_status(probe, probe_length, extents_max)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(!extents.is_empty(), "{what}: no extent");
        assert!(
            extents.len() <= extents_max,
            "{what}: {} extents, at most {extents_max}",
            extents.len()
        );
        let mut at = probe;
        for extent in &extents {
            assert!(extent.length_bytes > 0, "{what}: an empty extent");
            let end = at + extent.length_bytes;
            assert!(
                end <= size,
                "{what}: an extent past the end ({end} > {size})"
            );
            if extent.zero {
                let mut buffer = vec![1u8; extent.length_bytes.min(SPAN_BYTES_MAX) as usize];
                export
                    .read_at(at, &mut buffer)
                    .expect("read of a zero extent");
                assert!(
                    buffer.iter().all(|&byte| byte == 0),
                    "{what}: a zero extent at {at} holds data"
                );
            }
            at = end;
        }
    }
}

fn read_only_refuses_writes(export: &dyn Export) {
    let sector = vec![0u8; SECTOR_BYTES as usize];
    assert!(
        export.write_at(0, &sector, false).is_err(),
        "a read-only export took a write"
    );
    assert!(
        export
            .write_zeroes(0, SECTOR_BYTES, ZeroOptions::default())
            .is_err(),
        "a read-only export took a write zeroes"
    );
    let mut buffer = vec![0u8; SECTOR_BYTES as usize];
    export
        .read_at(0, &mut buffer)
        .expect("read of a read-only export");
    export.flush().expect("flush of a read-only export");
}
