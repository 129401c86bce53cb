//! `VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD` (protocol feature 12): the region in shared memory
//! where each queue logs the requests it has taken off the available ring and not yet put
//! on the used ring, so that a backend started again after a crash (kill -9, then `serve`
//! again) resubmits exactly those: none lost, none completed twice.
//!
//! The front end asks for the region with `VHOST_USER_GET_INFLIGHT_FD` ([`create`]: a
//! sealed memfd we size and initialize), keeps the fd, and hands it back with
//! `VHOST_USER_SET_INFLIGHT_FD` ([`open`]: mapped, checked) before the rings start, on every
//! connection. Layout (qemu's `docs/interop/vhost-user.rst`, "Inflight I/O tracking", split
//! rings; the spec's native byte order, which is little endian on the hosts we serve, as the
//! relay already assumes for message headers), one queue region after the other, no padding
//! between them:
//!
//! ```text
//!   queue region: features u64 | version u16 | desc_num u16 | last_batch_head u16 | used_idx u16
//!                 then desc_num × DescStateSplit: inflight u8 | padding [u8; 5] | next u16 | counter u64
//! ```
//!
//! A queue ([`QueueLog`], owned by its thread) marks a head inflight with the next counter
//! when it pops the chain ([`QueueLog::take_off`]); before it adds the chain to the used
//! ring it links it as the last batch ([`QueueLog::link_used`]), and after the used index
//! moved it clears the mark and stores the used index ([`QueueLog::used`]). Every chain
//! popped is therefore on the used ring or marked, but for the one batch between the used
//! index store and the clearing, which the region's `used_idx` exposes: at start
//! ([`QueueLog::recover`]) a `used_idx` behind the ring's means the last batch reached the
//! ring, and its marks are cleared. The marked heads are then resubmitted in counter order,
//! and the next chain to pop is `used index + marked`, whatever base the front end sent.
//!
//! The region is untrusted (the front end can write it): every offset is checked at
//! [`open`] (the file must be long enough and sealed against shrinking, so the mapping
//! cannot fault), heads past `desc_num` are ignored, walks are bounded by `desc_num`.
//! Every access goes through vm-memory's atomic references into the mapping: no `unsafe`.

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use rustix::fs::{
    fcntl_add_seals, fcntl_get_seals, fstat, ftruncate, memfd_create, MemfdFlags, SealFlags,
};
use vm_memory::{FileOffset, MmapRegion, VolatileMemory};

use crate::config::QUEUE_SIZE_MAX;

/// `VHOST_USER_GET_INFLIGHT_FD`.
pub(crate) const GET_INFLIGHT_FD: u32 = 31;
/// `VHOST_USER_SET_INFLIGHT_FD`.
pub(crate) const SET_INFLIGHT_FD: u32 = 32;
/// `VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD` as a protocol feature bit.
pub(crate) const PROTOCOL_FEATURE: u64 = 1 << 12;
/// The inflight description: mmap_size u64, mmap_offset u64, num_queues u16, queue_size u16,
/// padded to 8 bytes as the C struct is.
pub(crate) const DESCRIPTION_BYTES: usize = 24;

const QUEUE_HEADER_BYTES: usize = 16;
const DESC_STATE_BYTES: usize = 16;
const VERSION: u16 = 1;
const VERSION_AT: usize = 8;
const DESC_NUM_AT: usize = 10;
const LAST_BATCH_HEAD_AT: usize = 12;
const USED_IDX_AT: usize = 14;
const INFLIGHT_AT: usize = 0;
const NEXT_AT: usize = 6;
const COUNTER_AT: usize = 8;

/// The payload of GET_INFLIGHT_FD, SET_INFLIGHT_FD and GET's reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Description {
    pub mmap_size: u64,
    pub mmap_offset: u64,
    pub num_queues: u16,
    pub queue_size: u16,
}

impl Description {
    /// Parses a message payload, which must be exactly [`DESCRIPTION_BYTES`] long.
    pub(crate) fn parse(payload: &[u8]) -> io::Result<Self> {
        if payload.len() != DESCRIPTION_BYTES {
            return Err(refused(format!(
                "inflight description of {} bytes, not {DESCRIPTION_BYTES}",
                payload.len()
            )));
        }
        let u64_at = |at: usize| u64::from_le_bytes(payload[at..at + 8].try_into().expect("8"));
        let u16_at = |at: usize| u16::from_le_bytes(payload[at..at + 2].try_into().expect("2"));
        Ok(Description {
            mmap_size: u64_at(0),
            mmap_offset: u64_at(8),
            num_queues: u16_at(16),
            queue_size: u16_at(18),
        })
    }

    /// The payload bytes (the padding zero).
    pub(crate) fn encode(&self) -> [u8; DESCRIPTION_BYTES] {
        let mut bytes = [0; DESCRIPTION_BYTES];
        bytes[0..8].copy_from_slice(&self.mmap_size.to_le_bytes());
        bytes[8..16].copy_from_slice(&self.mmap_offset.to_le_bytes());
        bytes[16..18].copy_from_slice(&self.num_queues.to_le_bytes());
        bytes[18..20].copy_from_slice(&self.queue_size.to_le_bytes());
        bytes
    }

    /// Checks the queue count (1 to `queues`, what the device offers) and size (1 to
    /// [`QUEUE_SIZE_MAX`]).
    fn check_dimensions(&self, queues: u16) -> io::Result<()> {
        if !(1..=queues).contains(&self.num_queues) {
            return Err(refused(format!(
                "inflight region for {} queues: the device has {queues}",
                self.num_queues
            )));
        }
        if !(1..=QUEUE_SIZE_MAX).contains(&self.queue_size) {
            return Err(refused(format!(
                "inflight region for queues of {}: 1 to {QUEUE_SIZE_MAX}",
                self.queue_size
            )));
        }
        Ok(())
    }

    /// Bytes the region of these dimensions takes.
    fn region_bytes(&self) -> usize {
        usize::from(self.num_queues) * queue_bytes(self.queue_size)
    }
}

fn queue_bytes(queue_size: u16) -> usize {
    QUEUE_HEADER_BYTES + DESC_STATE_BYTES * usize::from(queue_size)
}

fn refused(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what)
}

/// GET_INFLIGHT_FD: a fresh memfd for the queues `asked` for (at most `queues`), zeroed (the
/// spec's uninitialized region), sealed so it can neither shrink nor grow; and the
/// description to answer with.
pub(crate) fn create(asked: &Description, queues: u16) -> io::Result<(Description, File)> {
    asked.check_dimensions(queues)?;
    let bytes = asked.region_bytes();
    let fd = memfd_create(
        "thinpool-vhost-inflight",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )?;
    ftruncate(&fd, bytes as u64)?;
    let file = File::from(fd);
    // All zeros: version 0, an uninitialized region, which [`open`] initializes.
    fcntl_add_seals(&file, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
    let answer = Description {
        mmap_size: bytes as u64,
        mmap_offset: 0,
        num_queues: asked.num_queues,
        queue_size: asked.queue_size,
    };
    Ok((answer, file))
}

/// A mapped inflight region (SET_INFLIGHT_FD), shared by the queues' logs.
pub(crate) struct Region {
    map: MmapRegion<()>,
    num_queues: u16,
    queue_size: u16,
}

/// SET_INFLIGHT_FD: maps the region `given` describes in `file`, after checking it fits a
/// device of `queues` queues, lies inside the file, which is sealed against shrinking, and
/// holds queue headers of this layout (version 1 and `desc_num` = the queue size; an
/// all-zero header, version 0, is initialized).
pub(crate) fn open(given: &Description, file: File, queues: u16) -> io::Result<Arc<Region>> {
    given.check_dimensions(queues)?;
    let bytes = given.region_bytes();
    if given.mmap_size < bytes as u64 {
        return Err(refused(format!(
            "inflight region of {} bytes: {} queues of {} need {bytes}",
            given.mmap_size, given.num_queues, given.queue_size
        )));
    }
    let seals = fcntl_get_seals(&file)?;
    if !seals.contains(SealFlags::SHRINK) {
        return Err(refused(
            "inflight region file not sealed against shrinking".into(),
        ));
    }
    let file_bytes = u64::try_from(fstat(&file)?.st_size).unwrap_or(0);
    let inside = given
        .mmap_offset
        .checked_add(bytes as u64)
        .is_some_and(|end| end <= file_bytes);
    if !inside {
        return Err(refused(format!(
            "inflight region at {} of {bytes} bytes past its file's {file_bytes}",
            given.mmap_offset
        )));
    }
    let map = MmapRegion::<()>::from_file(FileOffset::new(file, given.mmap_offset), bytes)
        .map_err(|e| io::Error::other(format!("mapping the inflight region: {e}")))?;
    let region = Region {
        map,
        num_queues: given.num_queues,
        queue_size: given.queue_size,
    };
    for queue in 0..region.num_queues {
        region.check_header(queue)?;
    }
    Ok(Arc::new(region))
}

impl Region {
    fn base(&self, queue: u16) -> usize {
        assert!(
            queue < self.num_queues,
            "queue {queue} of {}",
            self.num_queues
        );
        usize::from(queue) * queue_bytes(self.queue_size)
    }

    fn u8_at(&self, offset: usize) -> &AtomicU8 {
        self.map
            .get_atomic_ref::<AtomicU8>(offset)
            .expect("offsets inside the checked mapping")
    }

    fn u16_at(&self, offset: usize) -> &AtomicU16 {
        self.map
            .get_atomic_ref::<AtomicU16>(offset)
            .expect("aligned offsets inside the checked mapping")
    }

    fn u64_at(&self, offset: usize) -> &AtomicU64 {
        self.map
            .get_atomic_ref::<AtomicU64>(offset)
            .expect("aligned offsets inside the checked mapping")
    }

    /// Initializes a zero header; refuses one of another layout.
    fn check_header(&self, queue: u16) -> io::Result<()> {
        let base = self.base(queue);
        let version = self.u16_at(base + VERSION_AT).load(Ordering::Acquire);
        let desc_num = self.u16_at(base + DESC_NUM_AT).load(Ordering::Acquire);
        match (version, desc_num) {
            (0, _) => {
                self.u16_at(base + DESC_NUM_AT)
                    .store(self.queue_size, Ordering::Release);
                self.u16_at(base + VERSION_AT)
                    .store(VERSION, Ordering::Release);
                Ok(())
            }
            (VERSION, n) if n == self.queue_size => Ok(()),
            _ => Err(refused(format!(
                "inflight queue {queue}: version {version}, {desc_num} descriptors \
                 (expected version {VERSION}, {})",
                self.queue_size
            ))),
        }
    }
}

/// One queue's part of the region, used only by that queue's thread.
pub(crate) struct QueueLog {
    region: Arc<Region>,
    base: usize,
    /// The counter the next chain taken off the ring gets.
    counter: u64,
    /// Set by SET_INFLIGHT_FD: the queue thread recovers before it pops anything.
    pub pending: bool,
}

impl QueueLog {
    /// Queue `queue`'s log, or `None` if the region has no such queue.
    pub(crate) fn new(region: Arc<Region>, queue: u16) -> Option<Self> {
        if queue >= region.num_queues {
            return None;
        }
        let base = region.base(queue);
        Some(QueueLog {
            region,
            base,
            counter: 1,
            pending: true,
        })
    }

    /// Descriptors the log tracks (the queue size it was made for).
    pub(crate) fn size(&self) -> u16 {
        self.region.queue_size
    }

    fn desc(&self, head: u16) -> Option<usize> {
        (head < self.size())
            .then(|| self.base + QUEUE_HEADER_BYTES + usize::from(head) * DESC_STATE_BYTES)
    }

    fn header(&self, at: usize) -> &AtomicU16 {
        self.region.u16_at(self.base + at)
    }

    /// The chain at `head` was popped: it is in flight, after every chain popped before.
    pub(crate) fn take_off(&mut self, head: u16) {
        let Some(desc) = self.desc(head) else { return };
        self.region
            .u64_at(desc + COUNTER_AT)
            .store(self.counter, Ordering::Release);
        // A hostile region can start the counter anywhere: saturate, never wrap.
        self.counter = self.counter.saturating_add(1);
        self.region
            .u8_at(desc + INFLIGHT_AT)
            .store(1, Ordering::Release);
    }

    /// The chain at `head` is about to go on the used ring, as a batch of one.
    pub(crate) fn link_used(&self, head: u16) {
        let Some(desc) = self.desc(head) else { return };
        let last = self.header(LAST_BATCH_HEAD_AT).load(Ordering::Acquire);
        self.region
            .u16_at(desc + NEXT_AT)
            .store(last, Ordering::Release);
        self.header(LAST_BATCH_HEAD_AT)
            .store(head, Ordering::Release);
    }

    /// The chain at `head` is on the used ring, whose index is now `used_idx`.
    pub(crate) fn used(&self, head: u16, used_idx: u16) {
        if let Some(desc) = self.desc(head) {
            self.region
                .u8_at(desc + INFLIGHT_AT)
                .store(0, Ordering::Release);
        }
        self.header(USED_IDX_AT).store(used_idx, Ordering::Release);
    }

    /// At queue start, with the used ring's index `used_idx`: clears the marks of a last
    /// batch that reached the used ring, and returns the heads still in flight, in the order
    /// they were taken off the ring (their counters). Later chains get later counters.
    pub(crate) fn recover(&mut self, used_idx: u16) -> Vec<u16> {
        let size = self.size();
        let logged = self.header(USED_IDX_AT).load(Ordering::Acquire);
        if logged != used_idx {
            let batch = used_idx.wrapping_sub(logged).min(size);
            let mut head = self.header(LAST_BATCH_HEAD_AT).load(Ordering::Acquire);
            for _ in 0..batch {
                let Some(desc) = self.desc(head) else { break };
                self.region
                    .u8_at(desc + INFLIGHT_AT)
                    .store(0, Ordering::Release);
                head = self.region.u16_at(desc + NEXT_AT).load(Ordering::Acquire);
            }
            self.header(USED_IDX_AT).store(used_idx, Ordering::Release);
        }
        let mut inflight: Vec<(u64, u16)> = (0..size)
            .filter_map(|head| {
                let desc = self.desc(head)?;
                let marked = self
                    .region
                    .u8_at(desc + INFLIGHT_AT)
                    .load(Ordering::Acquire)
                    == 1;
                marked.then(|| {
                    let counter = self
                        .region
                        .u64_at(desc + COUNTER_AT)
                        .load(Ordering::Acquire);
                    (counter, head)
                })
            })
            .collect();
        inflight.sort_unstable();
        let last = inflight.last().map_or(0, |&(counter, _)| counter);
        self.counter = last.saturating_add(1).max(self.counter);
        inflight.into_iter().map(|(_, head)| head).collect()
    }
}

#[cfg(test)]
mod tests;
