//! Volume I/O: byte-addressed read, write (with FUA), write-zeroes, discard, flush and
//! allocation status, on the caller's thread.
//!
//! Every request is split at data-block boundaries. For each piece:
//!
//! ```text
//!   read        index lookup ─ unmapped → zeros
//!                            └ mapped   → pread(data block)
//!   write       index lookup ─ mapped, not shared → pwrite in place           (no lock)
//!                            └ otherwise, under the block's lock, look again:
//!                                unmapped → allocate, zero the rest, pwrite, queue Insert
//!                                shared   → allocate, copy the rest, pwrite, queue Insert
//!               whole blocks in a row, none writable in place → one run: their block
//!                 locks, alloc_many, one pwrite per stretch of consecutive data blocks,
//!                 map_many
//!   discard     whole blocks: unmap (queue Remove); partial: zero if mapped and unshared
//! ```
//!
//! A mapping is *shared* when the volume was snapshotted after it was made (spec §8.5);
//! the test is conservative, as in dm-thin.
//!
//! Every lookup whose data block is then read or written runs pinned (`Provisioner::pin`,
//! see `grace`) until that I/O is done, so a block freed meanwhile (a discard, a shrink)
//! is not given to another volume under it. A pinned thread takes no lock and never waits
//! for space. Writes, discards and write-zeroes check their range again once inside the
//! write gate: a resize may have run while they waited at it. A piece waiting for space
//! when its volume is paused (a snapshot, a grow) sits the pause out without its block lock
//! and provisions afresh after it (`Provisioner::alloc`).
//!
//! The pool is reached only through `Provisioner` (data device, mode, alloc / map /
//! unmap); the volume's own state is its `VolumeState` (`volumes`), whose
//! [`Lookup`] says what a block needs: nothing (unmapped), in-place I/O (exclusive) or a
//! copy (shared).

use crate::engine::gate::Pass;
use crate::engine::index::Index;
use crate::engine::options::PoolMode;
use crate::engine::provision::{Alloc, Provisioner};
use crate::engine::volumes::{Lookup, VolumeState};
use crate::error::{Error, Result};
use crate::ids::{DataBlock, VirtualBlock, VolumeId};
use std::sync::Arc;

mod lend;
pub use lend::LentPiece;

/// Sector size: offsets and lengths are multiples of it.
pub const SECTOR_SIZE: u64 = 512;

/// An allocation-status extent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Length in bytes.
    pub length_bytes: u64,
    /// Whether the range is mapped (allocated); unmapped ranges read as zeros.
    pub mapped: bool,
}

/// Most whole blocks one write provisions together (one hold of the metadata lock to
/// reserve them, one to map them).
const RUN_BLOCKS_MAX: u64 = 64;

/// Consecutive whole blocks of one write, none of them writable in place.
struct Run {
    first: VirtualBlock,
    count: u64,
    /// Where the first block's bytes start in the write's data.
    data_start: usize,
}

/// What a write piece carries.
#[derive(Clone, Copy)]
enum Payload<'a> {
    Data(&'a [u8]),
    Zeroes(u64),
}

impl Payload<'_> {
    fn len(&self) -> u64 {
        match self {
            Payload::Data(d) => d.len() as u64,
            Payload::Zeroes(n) => *n,
        }
    }
}

/// An open volume. Cheap to clone; every clone counts as open (delete is refused while any
/// handle exists).
pub struct Volume {
    pool: Provisioner,
    volume: Arc<VolumeState>,
    /// The volume's index, built before the handle was made: lookups cost what they cost
    /// before indexes were built on demand (no check that it is there).
    index: Arc<Index>,
}

impl Clone for Volume {
    fn clone(&self) -> Volume {
        self.volume.open_another();
        Volume {
            pool: self.pool.clone(),
            volume: self.volume.clone(),
            index: self.index.clone(),
        }
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        self.volume.close();
    }
}

impl std::fmt::Debug for Volume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Volume")
            .field("name", &self.volume.name())
            .finish()
    }
}

fn data_io(what: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |source| Error::Io {
        what: what.to_string(),
        source,
    }
}

impl Volume {
    /// A handle on `volume`, unless a delete claimed it, with its `index` (which the caller
    /// built once the handle counted, so no revert, rename or delete can replace the state
    /// meanwhile: see `Pool::volume`).
    pub(crate) fn open(
        pool: Provisioner,
        volume: Arc<VolumeState>,
        index: impl FnOnce(&VolumeState) -> Result<Arc<Index>>,
    ) -> Result<Volume> {
        volume.open()?;
        match index(&volume) {
            Ok(index) => Ok(Volume {
                pool,
                volume,
                index,
            }),
            Err(e) => {
                volume.close();
                Err(e)
            }
        }
    }

    /// The volume's name.
    pub fn name(&self) -> &str {
        self.volume.name()
    }

    /// The volume's id in the metadata.
    pub fn id(&self) -> VolumeId {
        self.volume.id()
    }

    /// Virtual size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.volume.size_bytes()
    }

    /// Whether writes are refused (read-only volume or pool).
    pub fn read_only(&self) -> bool {
        self.volume.read_only() || self.pool.options().read_only
    }

    /// Data block size in bytes.
    pub fn block_size_bytes(&self) -> u64 {
        self.pool.block_size_bytes()
    }

    /// Whether the data device can discard.
    pub fn can_discard(&self) -> bool {
        true
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        if !offset.is_multiple_of(SECTOR_SIZE) || !len.is_multiple_of(SECTOR_SIZE) {
            return Err(Error::Unaligned {
                offset,
                length: len,
                sector_bytes: SECTOR_SIZE,
            });
        }
        let size = self.size_bytes();
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(Error::BeyondVolume {
                offset,
                length: len,
                size_bytes: size,
            }),
        }
    }

    fn check_writable(&self) -> Result<()> {
        if self.read_only() {
            return Err(Error::ReadOnly { needs_check: false });
        }
        match self.pool.mode() {
            PoolMode::Fail => Err(Error::ReadOnly { needs_check: true }),
            _ => Ok(()),
        }
    }

    /// Byte offset on the data device of `in_block` bytes into data block `block`.
    #[inline]
    fn data_offset(&self, block: DataBlock, in_block: u64) -> u64 {
        debug_assert!(in_block < self.pool.block_size_bytes());
        block.offset_bytes(self.pool.block_size_bytes()) + in_block
    }

    /// What `block` needs (lock-free: one index lookup).
    #[inline]
    fn lookup(&self, block: VirtualBlock) -> Lookup {
        self.volume.classify(self.index.lookup(block))
    }

    /// Split `offset..offset+len` into (virtual block, offset in block, length) pieces.
    fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = (VirtualBlock, u64, u64)> {
        let block_size = self.pool.block_size_bytes();
        let end = offset + len;
        let mut position = offset;
        std::iter::from_fn(move || {
            if position >= end {
                return None;
            }
            let block = position / block_size;
            let in_block = position % block_size;
            let n = (block_size - in_block).min(end - position);
            debug_assert!(
                n > 0 && in_block + n <= block_size,
                "a piece stays in its block"
            );
            position += n;
            Some((VirtualBlock::new(block), in_block, n))
        })
    }

    /// Read `buf.len()` bytes at `offset`.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        if self.pool.mode() == PoolMode::Fail {
            return Err(Error::ReadOnly { needs_check: true });
        }
        let _pin = self.pool.pin();
        let mut done = 0usize;
        for (block, in_block, n) in self.pieces(offset, buf.len() as u64) {
            let piece = &mut buf[done..done + n as usize];
            match self.lookup(block).data_block() {
                None => piece.fill(0),
                Some(data_block) => self
                    .pool
                    .data()
                    .read_at(self.data_offset(data_block, in_block), piece)
                    .map_err(data_io("reading the data device"))?,
            }
            done += n as usize;
        }
        Ok(())
    }

    /// Write `data` at `offset`; with `fua`, durable (data and mapping) when this returns.
    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.check_range(offset, data.len() as u64)?;
        self.check_writable()?;
        {
            let pass = self.volume.gate().enter();
            self.check_range(offset, data.len() as u64)?;
            let block_size = self.pool.block_size_bytes();
            // Whole blocks to provision, consecutive in the volume and in `data`, are
            // provisioned together (`provision_run`) when the run ends.
            let mut run: Option<Run> = None;
            let mut done = 0usize;
            for (block, in_block, n) in self.pieces(offset, data.len() as u64) {
                let payload = Payload::Data(&data[done..done + n as usize]);
                let written = if n == block_size {
                    self.write_in_place(block, in_block, payload, true)
                } else {
                    None
                };
                match (written, run.as_mut()) {
                    (None, Some(run)) if n == block_size && run.count < RUN_BLOCKS_MAX => {
                        run.count += 1;
                    }
                    (None, _) if n == block_size => {
                        if let Some(ended) = run.replace(Run {
                            first: block,
                            count: 1,
                            data_start: done,
                        }) {
                            self.provision_run(&pass, ended, data)?;
                        }
                    }
                    (written, _) => {
                        if let Some(ended) = run.take() {
                            self.provision_run(&pass, ended, data)?;
                        }
                        match written {
                            Some(result) => result?,
                            None => self.write_piece(&pass, block, in_block, payload, true)?,
                        }
                    }
                }
                done += n as usize;
            }
            if let Some(ended) = run {
                self.provision_run(&pass, ended, data)?;
            }
            debug_assert_eq!(done, data.len(), "every byte of the write is placed");
        }
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Make `len` bytes at `offset` read as zeros. With `may_unmap`, whole blocks are
    /// unmapped; without it (NBD's NO_HOLE) the range stays or becomes allocated.
    pub fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool, fua: bool) -> Result<()> {
        self.check_range(offset, len)?;
        self.check_writable()?;
        {
            let pass = self.volume.gate().enter();
            self.check_range(offset, len)?;
            let block_size = self.pool.block_size_bytes();
            for (block, in_block, n) in self.pieces(offset, len) {
                if may_unmap && n == block_size {
                    self.unmap(block);
                } else {
                    let zeroes = Payload::Zeroes(n);
                    self.write_piece(&pass, block, in_block, zeroes, !may_unmap)?;
                }
            }
        }
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Discard: unmap the whole blocks in the range (their data blocks are freed, and
    /// discarded on the data device, at the next commit if nothing else references them) and
    /// zero the parts of partial blocks that are mapped and not shared.
    pub fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.check_range(offset, len)?;
        self.check_writable()?;
        let _pass = self.volume.gate().enter();
        self.check_range(offset, len)?;
        let block_size = self.pool.block_size_bytes();
        for (block, in_block, n) in self.pieces(offset, len) {
            if n == block_size {
                self.unmap(block);
                continue;
            }
            let _pin = self.pool.pin();
            if let Lookup::Exclusive(data_block) = self.lookup(block) {
                self.pool
                    .data()
                    .zero(self.data_offset(data_block, in_block), n)
                    .map_err(data_io("zeroing on the data device"))?;
            }
        }
        Ok(())
    }

    /// Durability point: every write completed before this call, and the mappings they made,
    /// survive a crash once it returns.
    pub fn flush(&self) -> Result<()> {
        self.pool.flush()
    }

    /// Allocation status of `offset..offset+len`, as extents in order.
    pub fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.check_range(offset, len)?;
        let mut extents: Vec<Extent> = Vec::new();
        for (block, _, n) in self.pieces(offset, len) {
            let mapped = self.lookup(block) != Lookup::Unmapped;
            match extents.last_mut() {
                Some(last) if last.mapped == mapped => last.length_bytes += n,
                _ => extents.push(Extent {
                    length_bytes: n,
                    mapped,
                }),
            }
        }
        Ok(extents)
    }

    /// Mapped blocks, counted in the index.
    pub fn mapped_blocks(&self) -> u64 {
        self.index.mapped_count()
    }

    fn unmap(&self, block: VirtualBlock) {
        let _order = self.volume.block_lock(block);
        self.pool.unmap(&self.volume, block);
    }

    fn write_payload(&self, at: u64, payload: Payload<'_>) -> Result<()> {
        debug_assert!(at.is_multiple_of(SECTOR_SIZE), "data I/O is sector-aligned");
        debug_assert!(payload.len().is_multiple_of(SECTOR_SIZE));
        match payload {
            Payload::Data(data) => self
                .pool
                .data()
                .write_at(at, data)
                .map_err(data_io("writing the data device")),
            Payload::Zeroes(n) => self
                .pool
                .data()
                .zero(at, n)
                .map_err(data_io("zeroing on the data device")),
        }
    }

    /// Write one piece of a block. A mapped, unshared block is written in place with no
    /// lock; otherwise (with `provision`) the block is provisioned under its block lock. A
    /// piece waiting for space while its volume is paused sits the pause out, its block lock
    /// dropped (`pass`: the write's place in the gate), then looks again: a snapshot taken
    /// meanwhile made the block shared, and the piece breaks that sharing as any write.
    fn write_piece(
        &self,
        pass: &Pass<'_>,
        block: VirtualBlock,
        in_block: u64,
        payload: Payload<'_>,
        provision: bool,
    ) -> Result<()> {
        if let Some(done) = self.write_in_place(block, in_block, payload, provision) {
            return done;
        }
        let wait = self.pool.space_wait();
        let (order, reservation) = loop {
            let order = self.volume.block_lock(block);
            if let Some(done) = self.write_in_place(block, in_block, payload, provision) {
                return done;
            }
            // Unmapped or shared: provision. No pin while reserving (it may wait for space,
            // and space may wait for pinned threads).
            match self.pool.alloc(&self.volume, &wait)? {
                Alloc::Reserved(reservation) => break (order, reservation),
                Alloc::Paused => {
                    drop(order);
                    pass.sit_out_pause();
                }
            }
        };
        // Under the block lock only a metadata failure (reloading the index) changes the
        // mapping meanwhile.
        if let Some(done) = self.write_in_place(block, in_block, payload, provision) {
            return done;
        }
        let pin = self.pool.pin();
        let current = self.lookup(block);
        let base = reservation
            .data_block()
            .offset_bytes(self.pool.block_size_bytes());
        self.fill_new_block(base, current, in_block, payload.len())?;
        self.write_payload(base + in_block, payload)?;
        drop(pin);
        let mapped = self.pool.map(&self.volume, block, reservation);
        drop(order);
        mapped
    }

    /// Provision a run of whole blocks of a write: under their block locks, reserve a data
    /// block for each under one metadata lock hold, write the data with one `write_at` per
    /// stretch of consecutive data blocks (nothing to zero or copy: the write covers every
    /// block), map them all under one metadata lock hold. A block that became writable in
    /// place meanwhile is written in place; if the pool has too few free blocks for the run,
    /// its blocks are provisioned one by one (`write_piece`, which applies the no-space
    /// policy).
    fn provision_run(&self, pass: &Pass<'_>, run: Run, data: &[u8]) -> Result<()> {
        let block_size = self.pool.block_size_bytes() as usize;
        let blocks = (0..run.count).map(|i| VirtualBlock::new(run.first.get() + i));
        let start_of = |block: VirtualBlock| {
            run.data_start + (block.get() - run.first.get()) as usize * block_size
        };
        let piece = |block: VirtualBlock| &data[start_of(block)..start_of(block) + block_size];
        assert!(run.count >= 1 && run.count <= RUN_BLOCKS_MAX);
        assert!(run.data_start + run.count as usize * block_size <= data.len());
        if run.count == 1 {
            return self.write_piece(pass, run.first, 0, Payload::Data(piece(run.first)), true);
        }
        let locks = self.volume.block_locks(blocks.clone());
        let mut wanted = Vec::with_capacity(run.count as usize);
        for block in blocks.clone() {
            match self.write_in_place(block, 0, Payload::Data(piece(block)), true) {
                Some(result) => result?,
                None => wanted.push(block),
            }
        }
        if wanted.is_empty() {
            return Ok(());
        }
        // No pin while reserving (it may wait for space, and space may wait for pinned
        // threads); none needed after: only the reserved blocks are written.
        let Some(reservations) = self.pool.alloc_many(wanted.len())? else {
            drop(locks);
            for block in wanted {
                self.write_piece(pass, block, 0, Payload::Data(piece(block)), true)?;
            }
            return Ok(());
        };
        assert_eq!(
            reservations.len(),
            wanted.len(),
            "one reserved block per block"
        );
        let mut start = 0;
        for end in 1..=wanted.len() {
            let continues = end < wanted.len()
                && wanted[end].get() == wanted[end - 1].get() + 1
                && reservations[end].data_block().get()
                    == reservations[end - 1].data_block().get() + 1;
            if continues {
                continue;
            }
            let at = reservations[start]
                .data_block()
                .offset_bytes(block_size as u64);
            let first = start_of(wanted[start]);
            let bytes = &data[first..first + (end - start) * block_size];
            self.write_payload(at, Payload::Data(bytes))?;
            start = end;
        }
        self.pool
            .map_many(&self.volume, wanted.into_iter().zip(reservations).collect())?;
        drop(locks);
        Ok(())
    }

    /// The piece's write if it needs no new block: in place (mapped and unshared, looked
    /// up and written pinned), or nothing (unmapped and not to be provisioned). None: the
    /// block must be provisioned.
    fn write_in_place(
        &self,
        block: VirtualBlock,
        in_block: u64,
        payload: Payload<'_>,
        provision: bool,
    ) -> Option<Result<()>> {
        let _pin = self.pool.pin();
        match self.lookup(block) {
            Lookup::Exclusive(data_block) => {
                Some(self.write_payload(self.data_offset(data_block, in_block), payload))
            }
            Lookup::Unmapped if !provision => Some(Ok(())),
            Lookup::Unmapped | Lookup::Shared(_) => None,
        }
    }

    /// Fill what a write of `len` bytes at `in_block` leaves of a new block at byte `base`:
    /// a copy of the block it replaces (`current`, breaking sharing), or zeros.
    fn fill_new_block(&self, base: u64, current: Lookup, in_block: u64, len: u64) -> Result<()> {
        let block_size = self.pool.block_size_bytes();
        let end = in_block + len;
        assert!(
            len > 0 && end <= block_size,
            "a piece stays inside its block"
        );
        assert!(
            base.is_multiple_of(block_size),
            "a new block starts on a block boundary"
        );
        let data = self.pool.data();
        match current.data_block() {
            Some(old) => {
                // Break sharing: copy what the write does not cover.
                assert_ne!(old.offset_bytes(block_size), base, "a block maps once");
                let old_base = old.offset_bytes(block_size);
                if in_block > 0 {
                    data.copy(old_base, base, in_block)
                        .map_err(data_io("copying on the data device"))?;
                }
                if end < block_size {
                    data.copy(old_base + end, base + end, block_size - end)
                        .map_err(data_io("copying on the data device"))?;
                }
            }
            None if self.pool.options().zero_new_blocks && (in_block > 0 || end < block_size) => {
                // One call over the whole block (the write then lands on zeros) costs less
                // than zeroing the parts before and after it.
                data.zero(base, block_size)
                    .map_err(data_io("zeroing on the data device"))?;
            }
            None => {}
        }
        Ok(())
    }
}
