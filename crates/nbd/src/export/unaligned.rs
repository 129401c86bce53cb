//! Requests of any alignment on exports that take only whole sectors ([`SECTOR_BYTES`],
//! the protocol's 512-byte minimum block size).
//!
//! A client that did not ask for NBD_INFO_BLOCK_SIZE in its GO never agreed to the minimum
//! block size, and the protocol says the server SHOULD serve its unaligned requests (nbdkit
//! and qemu-nbd do). The session wraps every connection's export in [`Unaligned`]; for such
//! a client it serves a READ through a sector-aligned read of the covering range, a WRITE
//! that starts or ends inside a sector by read-modify-write of the covering range, a TRIM
//! rounded inward (a trim may do less), a WRITE_ZEROES as zeroes written into the partial
//! sectors and the export's own zeroing for the whole ones, a CACHE rounded outward. So
//! every implementation of [`Export`] keeps its contract (whole sectors only) and needs no
//! change.
//!
//! Read-modify-write is safe against other writers of the same sectors through one
//! process-wide table of locked sector ranges, keyed by export name (each connection opens
//! its own export value, two servers may serve the same volume; a name collision only
//! serializes more). An RMW locks its covering range; every other write, trim or zeroing
//! (aligned, from any connection, of any client) is a *plain* write, which normally takes
//! no lock: it counts itself in [`PLAIN_IN_FLIGHT`] and goes on while no RMW is active
//! ([`RMW_ACTIVE`]). An RMW counts itself active and then waits until no plain write is in
//! flight; plain writes starting meanwhile see it and lock their range instead. Both sides
//! count themselves before they look at the other's count (sequentially consistent), so
//! either the plain write sees the RMW or the RMW waits for the plain write: an RMW never
//! reads a sector, then writes it back over a plain write that landed in between. While no
//! client sends unaligned writes, the cost is two atomic additions and a load per write.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use super::{Capabilities, Export, Extent, MetaContext, ReadSource, StatusExtent, ZeroOptions};
use crate::error::{Error, ErrorKind, Result};
use crate::protocol::BLOCK_SIZE_MIN;
use crate::sync;

/// The unit the exports take: every offset and length they see is a multiple of it.
pub const SECTOR_BYTES: u64 = BLOCK_SIZE_MIN as u64;

/// RMWs waiting for plain writes to drain or holding their range.
static RMW_ACTIVE: AtomicUsize = AtomicUsize::new(0);
/// Plain writes running without a lock.
static PLAIN_IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// A locked range of sectors of one export.
struct Held {
    export: String,
    /// Sectors `[first, end)`.
    first: u64,
    end: u64,
}

/// The process's locked ranges; `changed` is signalled when one is released and when a
/// plain write ends while an RMW is active.
struct Locks {
    held: Mutex<Vec<Held>>,
    changed: Condvar,
}

fn locks() -> &'static Locks {
    static LOCKS: OnceLock<Locks> = OnceLock::new();
    LOCKS.get_or_init(|| Locks {
        held: Mutex::new(Vec::new()),
        changed: Condvar::new(),
    })
}

/// A locked range, released on drop (a panicking export call included).
struct RangeGuard {
    key: (String, u64, u64),
}

impl RangeGuard {
    /// Waits until no locked range of `export` overlaps the sectors covering
    /// `[offset, offset + length)`, then locks them.
    fn lock(export: &str, offset: u64, length: u64) -> Self {
        let first = offset / SECTOR_BYTES;
        let end = (offset + length).div_ceil(SECTOR_BYTES).max(first + 1);
        let locks = locks();
        let mut held = sync::lock(&locks.held);
        while held
            .iter()
            .any(|range| range.export == export && range.first < end && first < range.end)
        {
            held = sync::wait(&locks.changed, held);
        }
        held.push(Held {
            export: export.to_owned(),
            first,
            end,
        });
        RangeGuard {
            key: (export.to_owned(), first, end),
        }
    }
}

impl Drop for RangeGuard {
    fn drop(&mut self) {
        let locks = locks();
        let mut held = sync::lock(&locks.held);
        let (export, first, end) = &self.key;
        let position = held
            .iter()
            .position(|range| &range.export == export && range.first == *first && range.end == *end)
            .expect("a locked range is in the table");
        held.swap_remove(position);
        locks.changed.notify_all();
    }
}

/// Runs a plain write of `[offset, offset + length)` of `export` (module doc).
fn plain<T>(
    export: &str,
    offset: u64,
    length: u64,
    write: impl FnOnce() -> Result<T>,
) -> Result<T> {
    let counted = PlainCounted::new();
    if RMW_ACTIVE.load(Ordering::SeqCst) == 0 {
        return write();
    }
    drop(counted);
    let _range = RangeGuard::lock(export, offset, length);
    write()
}

/// One plain write counted in [`PLAIN_IN_FLIGHT`]; uncounts it on drop.
struct PlainCounted;

impl PlainCounted {
    fn new() -> Self {
        PLAIN_IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
        PlainCounted
    }
}

impl Drop for PlainCounted {
    fn drop(&mut self) {
        let before = PLAIN_IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
        assert!(before > 0, "plain write uncounted twice");
        if RMW_ACTIVE.load(Ordering::SeqCst) > 0 {
            let locks = locks();
            let _held = sync::lock(&locks.held);
            locks.changed.notify_all();
        }
    }
}

/// An RMW counted in [`RMW_ACTIVE`], holding its range.
struct RmwGuard {
    _range: RangeGuard,
}

impl RmwGuard {
    /// Counts an RMW active, waits for the plain writes in flight, and locks the sectors
    /// covering `[offset, offset + length)` of `export`.
    fn lock(export: &str, offset: u64, length: u64) -> Self {
        RMW_ACTIVE.fetch_add(1, Ordering::SeqCst);
        let locks = locks();
        let mut held = sync::lock(&locks.held);
        while PLAIN_IN_FLIGHT.load(Ordering::SeqCst) > 0 {
            held = sync::wait(&locks.changed, held);
        }
        drop(held);
        RmwGuard {
            _range: RangeGuard::lock(export, offset, length),
        }
    }
}

impl Drop for RmwGuard {
    fn drop(&mut self) {
        RMW_ACTIVE.fetch_sub(1, Ordering::SeqCst);
    }
}

fn aligned(offset: u64, length: u64) -> bool {
    offset.is_multiple_of(SECTOR_BYTES) && length.is_multiple_of(SECTOR_BYTES)
}

/// The sector-aligned range covering `[offset, offset + length)`: (start, length).
fn covering(offset: u64, length: u64) -> (u64, u64) {
    let start = offset / SECTOR_BYTES * SECTOR_BYTES;
    let end = (offset + length).next_multiple_of(SECTOR_BYTES);
    (start, end - start)
}

fn buffer_length(length: u64) -> Result<usize> {
    usize::try_from(length).map_err(|_| Error::export(ErrorKind::Overflow, "range too long"))
}

/// An export served to one connection: plain writes coordinated with read-modify-writes
/// (module doc), and, if `any_alignment`, requests of any alignment.
pub(crate) struct Unaligned {
    inner: Arc<dyn Export>,
    any_alignment: bool,
}

impl Unaligned {
    pub(crate) fn new(inner: Arc<dyn Export>, any_alignment: bool) -> Self {
        Unaligned {
            inner,
            any_alignment,
        }
    }

    fn check(&self, offset: u64, length: u64) {
        assert!(
            self.any_alignment || aligned(offset, length),
            "unaligned request at {offset} length {length} passed the session's checks"
        );
    }

    /// Writes `data` at `offset` by reading the sectors it starts and ends in, merging, and
    /// writing the covering range, under the RMW lock.
    fn read_modify_write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let length = data.len() as u64;
        let (start, covering_length) = covering(offset, length);
        let _guard = RmwGuard::lock(self.inner.name(), offset, length);
        let mut buffer = vec![0u8; buffer_length(covering_length)?];
        let head = (offset - start) as usize;
        if head > 0 {
            self.inner
                .read_at(start, &mut buffer[..SECTOR_BYTES as usize])?;
        }
        let end = head + data.len();
        let last = buffer.len() - SECTOR_BYTES as usize;
        // The sector it ends in, unless that is the one just read.
        if !end.is_multiple_of(SECTOR_BYTES as usize) && (last > 0 || head == 0) {
            self.inner
                .read_at(start + last as u64, &mut buffer[last..])?;
        }
        buffer[head..end].copy_from_slice(data);
        self.inner.write_at(start, &buffer, fua)
    }
}

impl Export for Unaligned {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn description(&self) -> &str {
        self.inner.description()
    }

    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn read_at(&self, offset: u64, buffer: &mut [u8]) -> Result<()> {
        let length = buffer.len() as u64;
        self.check(offset, length);
        if aligned(offset, length) {
            return self.inner.read_at(offset, buffer);
        }
        let (start, covering_length) = covering(offset, length);
        let mut covered = vec![0u8; buffer_length(covering_length)?];
        self.inner.read_at(start, &mut covered)?;
        let head = (offset - start) as usize;
        buffer.copy_from_slice(&covered[head..head + buffer.len()]);
        Ok(())
    }

    fn read_source(&self, offset: u64, length: u64) -> Option<ReadSource<'_>> {
        if aligned(offset, length) {
            self.inner.read_source(offset, length)
        } else {
            None
        }
    }

    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let length = data.len() as u64;
        self.check(offset, length);
        if aligned(offset, length) {
            return plain(self.inner.name(), offset, length, || {
                self.inner.write_at(offset, data, fua)
            });
        }
        self.read_modify_write(offset, data, fua)
    }

    fn write_zeroes(&self, offset: u64, length: u64, options: ZeroOptions) -> Result<()> {
        self.check(offset, length);
        if aligned(offset, length) {
            return plain(self.inner.name(), offset, length, || {
                self.inner.write_zeroes(offset, length, options)
            });
        }
        if options.fast {
            return Err(Error::export(
                ErrorKind::NotSupported,
                format!("zeroing part of a sector at {offset} length {length} needs a data write"),
            ));
        }
        let end = offset + length;
        let whole_start = offset.next_multiple_of(SECTOR_BYTES);
        let whole_end = end / SECTOR_BYTES * SECTOR_BYTES;
        if whole_start >= whole_end {
            return self.read_modify_write(offset, &vec![0u8; buffer_length(length)?], options.fua);
        }
        for (start, stop) in [(offset, whole_start), (whole_end, end)] {
            if start < stop {
                self.read_modify_write(start, &vec![0u8; (stop - start) as usize], options.fua)?;
            }
        }
        let whole = whole_end - whole_start;
        plain(self.inner.name(), whole_start, whole, || {
            self.inner.write_zeroes(whole_start, whole, options)
        })
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.check(offset, length);
        // A trim may do less than asked: only the whole sectors inside the range.
        let start = offset.next_multiple_of(SECTOR_BYTES);
        let end = (offset + length) / SECTOR_BYTES * SECTOR_BYTES;
        if start >= end {
            return if fua { self.inner.flush() } else { Ok(()) };
        }
        plain(self.inner.name(), start, end - start, || {
            self.inner.trim(start, end - start, fua)
        })
    }

    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }

    fn cache(&self, offset: u64, length: u64) -> Result<()> {
        self.check(offset, length);
        let (start, covering_length) = covering(offset, length);
        self.inner.cache(start, covering_length)
    }

    fn block_status(&self, offset: u64, length: u64, extents_max: usize) -> Result<Vec<Extent>> {
        self.check(offset, length);
        let (start, covering_length) = covering(offset, length);
        let mut extents = self
            .inner
            .block_status(start, covering_length, extents_max)?;
        if let Some(first) = extents.first_mut() {
            first.length_bytes -= (offset - start).min(first.length_bytes - 1);
        }
        Ok(extents)
    }

    fn meta_contexts(&self, prefix: &str) -> Vec<String> {
        self.inner.meta_contexts(prefix)
    }

    fn meta_context(&self, name: &str) -> Option<Arc<dyn MetaContext>> {
        self.inner.meta_context(name)
    }

    fn meta_context_subject(&self, name: &str) -> Option<String> {
        self.inner.meta_context_subject(name)
    }
}

/// A metadata context answering ranges of any alignment through one that takes sectors.
pub(crate) struct UnalignedContext(pub(crate) Arc<dyn MetaContext>);

impl MetaContext for UnalignedContext {
    fn block_status(
        &self,
        offset: u64,
        length: u64,
        extents_max: usize,
    ) -> Result<Vec<StatusExtent>> {
        let (start, covering_length) = covering(offset, length);
        let mut extents = self.0.block_status(start, covering_length, extents_max)?;
        if let Some(first) = extents.first_mut() {
            first.length_bytes -= (offset - start).min(first.length_bytes - 1);
        }
        Ok(extents)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::MemoryExport;

    #[test]
    fn covering_ranges_are_whole_sectors() {
        assert_eq!(covering(0, 512), (0, 512));
        assert_eq!(covering(1, 1), (0, 512));
        assert_eq!(covering(511, 2), (0, 1024));
        assert_eq!(covering(1000, 100), (512, 1024));
    }

    #[test]
    fn unaligned_writes_keep_the_bytes_around_them() {
        let inner = Arc::new(MemoryExport::new("rmw-unit", 4096));
        inner.write_at(0, &[0xaau8; 4096], false).unwrap();
        let export = Unaligned::new(inner, true);
        export.write_at(510, &[1, 2, 3, 4], false).unwrap();
        let mut buffer = [0u8; 8];
        export.read_at(508, &mut buffer).unwrap();
        assert_eq!(buffer, [0xaa, 0xaa, 1, 2, 3, 4, 0xaa, 0xaa]);
        export
            .write_zeroes(100, 1000, ZeroOptions::default())
            .unwrap();
        let mut all = vec![0u8; 4096];
        export.read_at(0, &mut all).unwrap();
        assert!(all[..100].iter().all(|&byte| byte == 0xaa));
        assert!(all[100..1100].iter().all(|&byte| byte == 0));
        assert!(all[1100..].iter().all(|&byte| byte == 0xaa));
    }
}
