//! A fault-injecting wrapper around any metadata device: [`FaultDevice`].
//!
//! It counts reads, writes and flushes (1-based, from creation, failed attempts included)
//! and, per rule:
//!
//! - fails the Nth operation of chosen kinds ([`FaultDevice::fail_nth`]), or the Nth and
//!   every later one ([`FaultDevice::fail_from`]), with an `io::Error` of kind `Other`;
//! - corrupts what reads of one block return ([`FaultDevice::corrupt_reads`]), leaving the
//!   stored block intact;
//! - misdirects the Nth write to another block ([`FaultDevice::misdirect_write`]): the data
//!   lands on the wrong block and the intended block keeps its old contents, and the write
//!   reports success, as a buggy disk would.
//!
//! The "fail the 1st, 2nd, 3rd... I/O in turn" loop: run the workload once and read
//! [`FaultDevice::counts`]; then for each `n` in `1..=counts.total()`, rerun on a fresh
//! device with `fail_nth(Ops::ANY, n)` and require a clean error and a recoverable image.

use persistent_data::{Block, BlockDevice, MetadataBlock};
use std::fmt;
use std::io;
use std::ops::BitOr;
use std::sync::{Mutex, MutexGuard};

/// A set of operation kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ops {
    read: bool,
    write: bool,
    flush: bool,
}

impl Ops {
    /// Reads only.
    pub const READ: Ops = Ops {
        read: true,
        write: false,
        flush: false,
    };
    /// Writes only.
    pub const WRITE: Ops = Ops {
        read: false,
        write: true,
        flush: false,
    };
    /// Flushes only.
    pub const FLUSH: Ops = Ops {
        read: false,
        write: false,
        flush: true,
    };
    /// Any operation.
    pub const ANY: Ops = Ops {
        read: true,
        write: true,
        flush: true,
    };

    fn contains(self, kind: OpKind) -> bool {
        match kind {
            OpKind::Read => self.read,
            OpKind::Write => self.write,
            OpKind::Flush => self.flush,
        }
    }

    /// How many operations of these kinds `counts` holds.
    pub fn count_in(self, counts: OpCounts) -> u64 {
        u64::from(self.read) * counts.reads
            + u64::from(self.write) * counts.writes
            + u64::from(self.flush) * counts.flushes
    }
}

impl BitOr for Ops {
    type Output = Ops;
    fn bitor(self, other: Ops) -> Ops {
        Ops {
            read: self.read || other.read,
            write: self.write || other.write,
            flush: self.flush || other.flush,
        }
    }
}

/// Operations seen so far (attempted, including those that failed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpCounts {
    /// Reads.
    pub reads: u64,
    /// Writes.
    pub writes: u64,
    /// Flushes.
    pub flushes: u64,
}

impl OpCounts {
    /// Reads plus writes plus flushes.
    pub fn total(&self) -> u64 {
        self.reads + self.writes + self.flushes
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OpKind {
    Read,
    Write,
    Flush,
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OpKind::Read => "read",
            OpKind::Write => "write",
            OpKind::Flush => "flush",
        })
    }
}

#[derive(Clone, Copy, Debug)]
struct FailRule {
    ops: Ops,
    nth: u64,
    /// Fail every matching operation from the Nth on, not only the Nth.
    sticky: bool,
}

#[derive(Clone, Copy, Debug)]
struct Corruption {
    block: MetadataBlock,
    byte_offset: usize,
    xor_mask: u8,
}

#[derive(Clone, Copy, Debug)]
struct Misdirection {
    nth_write: u64,
    target: MetadataBlock,
}

#[derive(Debug, Default)]
struct State {
    counts: OpCounts,
    fail_rules: Vec<FailRule>,
    corruptions: Vec<Corruption>,
    misdirections: Vec<Misdirection>,
    faults_injected: u64,
}

/// Wraps a device and injects faults by rule; see the module documentation.
#[derive(Debug)]
pub struct FaultDevice<D: BlockDevice> {
    inner: D,
    state: Mutex<State>,
}

impl<D: BlockDevice> FaultDevice<D> {
    /// A wrapper with no faults configured.
    pub fn new(inner: D) -> FaultDevice<D> {
        FaultDevice {
            inner,
            state: Mutex::new(State::default()),
        }
    }

    /// The wrapped device.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Unwrap.
    pub fn into_inner(self) -> D {
        self.inner
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Fail the operation that makes the count of `ops` kinds reach `nth` (1-based, counted
    /// from the device's creation), and only that one.
    pub fn fail_nth(&self, ops: Ops, nth: u64) {
        assert!(nth >= 1, "operations are counted from 1");
        self.lock().fail_rules.push(FailRule {
            ops,
            nth,
            sticky: false,
        });
    }

    /// Fail the `nth` operation of `ops` kinds and every later one of those kinds (a device
    /// that died).
    pub fn fail_from(&self, ops: Ops, nth: u64) {
        assert!(nth >= 1, "operations are counted from 1");
        self.lock().fail_rules.push(FailRule {
            ops,
            nth,
            sticky: true,
        });
    }

    /// Reads of `block` return its contents with the byte at `byte_offset` XORed with
    /// `xor_mask` (until [`clear`](Self::clear)). The stored block is not changed.
    pub fn corrupt_reads(&self, block: MetadataBlock, byte_offset: usize, xor_mask: u8) {
        assert!(
            byte_offset < persistent_data::BLOCK_SIZE,
            "offset inside the block"
        );
        assert_ne!(xor_mask, 0, "a zero mask corrupts nothing");
        self.lock().corruptions.push(Corruption {
            block,
            byte_offset,
            xor_mask,
        });
    }

    /// The `nth_write` write (1-based) goes to `target` instead of the block it names, and
    /// reports success.
    pub fn misdirect_write(&self, nth_write: u64, target: MetadataBlock) {
        assert!(nth_write >= 1, "writes are counted from 1");
        self.lock()
            .misdirections
            .push(Misdirection { nth_write, target });
    }

    /// Remove every rule (counts are kept).
    pub fn clear(&self) {
        let mut state = self.lock();
        state.fail_rules.clear();
        state.corruptions.clear();
        state.misdirections.clear();
    }

    /// Operations seen so far.
    pub fn counts(&self) -> OpCounts {
        self.lock().counts
    }

    /// Faults injected so far (failed operations, corrupted reads, misdirected writes).
    pub fn faults_injected(&self) -> u64 {
        self.lock().faults_injected
    }

    /// Count one operation and decide whether it fails.
    fn begin(&self, kind: OpKind) -> io::Result<MutexGuard<'_, State>> {
        let mut state = self.lock();
        match kind {
            OpKind::Read => state.counts.reads += 1,
            OpKind::Write => state.counts.writes += 1,
            OpKind::Flush => state.counts.flushes += 1,
        }
        let counts = state.counts;
        let failing = state.fail_rules.iter().find(|rule| {
            let seen = rule.ops.count_in(counts);
            rule.ops.contains(kind) && (seen == rule.nth || (rule.sticky && seen > rule.nth))
        });
        if let Some(rule) = failing.copied() {
            state.faults_injected += 1;
            return Err(io::Error::other(format!(
                "injected fault: {kind} (operation {} of the selected kinds, rule nth={})",
                rule.ops.count_in(counts),
                rule.nth
            )));
        }
        Ok(state)
    }
}

impl<D: BlockDevice> BlockDevice for FaultDevice<D> {
    fn block_count(&self) -> u64 {
        self.inner.block_count()
    }

    fn read(&self, block: MetadataBlock, buf: &mut Block) -> io::Result<()> {
        let corruptions: Vec<Corruption> = {
            let state = self.begin(OpKind::Read)?;
            state
                .corruptions
                .iter()
                .filter(|c| c.block == block)
                .copied()
                .collect()
        };
        self.inner.read(block, buf)?;
        if !corruptions.is_empty() {
            self.lock().faults_injected += 1;
            for corruption in corruptions {
                buf[corruption.byte_offset] ^= corruption.xor_mask;
            }
        }
        Ok(())
    }

    fn write(&self, block: MetadataBlock, buf: &Block) -> io::Result<()> {
        let target = {
            let mut state = self.begin(OpKind::Write)?;
            let nth = state.counts.writes;
            let target = state
                .misdirections
                .iter()
                .find(|m| m.nth_write == nth)
                .map(|m| m.target);
            if target.is_some() {
                state.faults_injected += 1;
            }
            target
        };
        self.inner.write(target.unwrap_or(block), buf)
    }

    fn flush(&self) -> io::Result<()> {
        drop(self.begin(OpKind::Flush)?);
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use persistent_data::{MemoryDevice, BLOCK_SIZE};

    fn filled(byte: u8) -> Block {
        [byte; BLOCK_SIZE]
    }

    #[test]
    fn fails_exactly_the_nth_write() {
        let device = FaultDevice::new(MemoryDevice::new(8));
        device.fail_nth(Ops::WRITE, 3);
        let results: Vec<bool> = (0..5)
            .map(|i| device.write(MetadataBlock::new(i), &filled(1)).is_ok())
            .collect();
        assert_eq!(results, [true, true, false, true, true]);
        assert_eq!(device.counts().writes, 5);
        assert_eq!(device.faults_injected(), 1);
        let mut buf = [0u8; BLOCK_SIZE];
        device
            .inner()
            .read(MetadataBlock::new(2), &mut buf)
            .unwrap();
        assert_eq!(buf, filled(0), "the failed write did not reach the device");
    }

    #[test]
    fn any_kind_counts_all_operations() {
        let device = FaultDevice::new(MemoryDevice::new(2));
        device.fail_nth(Ops::ANY, 3);
        let mut buf = [0u8; BLOCK_SIZE];
        assert!(device.write(MetadataBlock::new(0), &filled(1)).is_ok());
        assert!(device.read(MetadataBlock::new(0), &mut buf).is_ok());
        assert!(device.flush().is_err());
        assert!(device.flush().is_ok());
        assert_eq!(
            device.counts(),
            OpCounts {
                reads: 1,
                writes: 1,
                flushes: 2
            }
        );
    }

    #[test]
    fn kinds_outside_the_rule_never_fail() {
        let device = FaultDevice::new(MemoryDevice::new(2));
        device.fail_nth(Ops::READ | Ops::FLUSH, 1);
        assert!(device.write(MetadataBlock::new(0), &filled(1)).is_ok());
        assert!(device.flush().is_err());
        let mut buf = [0u8; BLOCK_SIZE];
        assert!(device.read(MetadataBlock::new(0), &mut buf).is_ok());
    }

    #[test]
    fn fail_from_keeps_failing() {
        let device = FaultDevice::new(MemoryDevice::new(2));
        device.fail_from(Ops::FLUSH, 2);
        assert!(device.flush().is_ok());
        assert!(device.flush().is_err());
        assert!(device.flush().is_err());
        assert!(device.write(MetadataBlock::new(0), &filled(1)).is_ok());
        device.clear();
        assert!(device.flush().is_ok());
    }

    #[test]
    fn corrupted_reads_leave_the_stored_block_alone() {
        let device = FaultDevice::new(MemoryDevice::new(2));
        device.write(MetadataBlock::new(1), &filled(0x10)).unwrap();
        device.corrupt_reads(MetadataBlock::new(1), 100, 0xFF);
        let mut buf = [0u8; BLOCK_SIZE];
        device.read(MetadataBlock::new(1), &mut buf).unwrap();
        assert_eq!(buf[100], 0xEF);
        assert_eq!(buf[99], 0x10);
        device
            .inner()
            .read(MetadataBlock::new(1), &mut buf)
            .unwrap();
        assert_eq!(buf, filled(0x10));
        device.read(MetadataBlock::new(0), &mut buf).unwrap();
        assert_eq!(buf, filled(0), "other blocks are not corrupted");
    }

    #[test]
    fn misdirected_write_lands_on_the_target() {
        let device = FaultDevice::new(MemoryDevice::new(4));
        device.misdirect_write(2, MetadataBlock::new(3));
        device.write(MetadataBlock::new(0), &filled(1)).unwrap();
        device.write(MetadataBlock::new(1), &filled(2)).unwrap();
        device.write(MetadataBlock::new(2), &filled(3)).unwrap();
        let mut buf = [0u8; BLOCK_SIZE];
        device.read(MetadataBlock::new(1), &mut buf).unwrap();
        assert_eq!(buf, filled(0), "the intended block keeps its old contents");
        device.read(MetadataBlock::new(3), &mut buf).unwrap();
        assert_eq!(buf, filled(2));
        device.read(MetadataBlock::new(2), &mut buf).unwrap();
        assert_eq!(buf, filled(3));
        assert_eq!(device.faults_injected(), 1);
    }

    #[test]
    fn fault_loop_fails_each_operation_once() {
        fn workload(device: &dyn BlockDevice) -> io::Result<()> {
            let mut buf = [0u8; BLOCK_SIZE];
            device.write(MetadataBlock::new(0), &filled(1))?;
            device.read(MetadataBlock::new(0), &mut buf)?;
            device.flush()
        }
        let counting = FaultDevice::new(MemoryDevice::new(1));
        workload(&counting).unwrap();
        let total = counting.counts().total();
        assert_eq!(total, 3);
        for nth in 1..=total {
            let device = FaultDevice::new(MemoryDevice::new(1));
            device.fail_nth(Ops::ANY, nth);
            assert!(workload(&device).is_err());
            assert_eq!(
                device.counts().total(),
                nth,
                "the workload stops at the fault"
            );
        }
    }
}
