//! The NBD metadata context `x-thinpool:diff:BASE` of a served volume (the target): flag 1
//! (`NBD_STATE_DIRTY` in qemu's terms) on the bytes where the target differs from the
//! volume BASE, 0 where they are the same; for incremental backups (`docs/backup.md`).
//!
//! "Differs" is [`Pool::diff`]'s block-level answer: a block mapped in one volume only, or
//! mapped to different data blocks in the two. So the dirty set covers every byte that
//! differs (a superset: a block rewritten with the same bytes is still dirty); a block
//! mapped in the base only (discarded in the target, or past the target's old end) is dirty
//! and reads as zeros in the target. Nothing is reported past the target's end.
//!
//! Cost: each BLOCK_STATUS asks [`Pool::diff_bound`] for the blocks of the request only (at
//! most `BLOCK_STATUS_BLOCKS_MAX` of them), which walks only the mapping subtrees the two
//! volumes do not share inside that range, holds no pool lock while it walks, and stops
//! after [`DIFF_NODES_MAX`] btree nodes: the reply then covers the part walked (the
//! protocol lets a reply cover less than asked; the client asks again for the rest). A
//! one-extent request (REQ_ONE) diffs a window of `REQ_ONE_WINDOW_BLOCKS` first and widens
//! it only while a single extent covers it.
//!
//! Identity: the context binds the base and the target by name and
//! [`VolumeGeneration`] when the client selects it (NBD_OPT_SET_META_CONTEXT); it holds
//! no handle on the base, so the base can still be deleted. A generation changes with
//! every delete and re-create (the thin id may be the same), revert and rename, never with
//! writes or resizes. Once either volume is not the one bound, every BLOCK_STATUS of the
//! context fails with `NBD_EIO` and a message saying so (logged once per context); the
//! connection goes on (reads and writes still work), and a new connection can select the
//! new volume.
//!
//! Boundaries: the context names its base as its subject
//! ([`nbd::Export::meta_context_subject`]), so a connection whose listener may not open
//! BASE (`--tcp-export`) is neither offered nor given it.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

use nbd::{Error as NbdError, ErrorKind, MetaContext, StatusExtent};
use thin_pool::{DiffRange, Pool, VirtualBlock, VolumeGeneration};

use super::{nbd_error, BLOCK_STATUS_BLOCKS_MAX};

/// Prefix of the diff contexts; the base volume's name follows.
pub const DIFF_CONTEXT_PREFIX: &str = "x-thinpool:diff:";

/// Flag of a byte range where the target differs from the base.
pub const DIRTY: u32 = 1;

/// Btree nodes one diff of a BLOCK_STATUS reads at most (about: it stops at the first
/// boundary past it). 32 nodes are at least a few thousand differing blocks (hundreds of
/// MiB for the client to copy), a few hundred microseconds of walking.
pub const DIFF_NODES_MAX: u64 = 32;

/// Blocks of the first window a one-extent request diffs (then 16 times more each round).
const REQ_ONE_WINDOW_BLOCKS: u64 = 64;

/// `x-thinpool:diff:BASE` selected on the export of `target`.
pub struct DiffContext {
    pool: Pool,
    base: String,
    base_generation: VolumeGeneration,
    target: String,
    target_generation: VolumeGeneration,
    /// Set once a BLOCK_STATUS found either volume changed (and logged it).
    lost: AtomicBool,
}

/// The base `name` compares against, if it is a diff context's name.
pub fn base_of(name: &str) -> Option<&str> {
    name.strip_prefix(DIFF_CONTEXT_PREFIX)
        .filter(|base| !base.is_empty())
}

/// The names of the diff contexts `target` offers that start with `prefix`: one per other
/// volume of the pool (the handshake keeps those the connection may see).
pub fn diff_context_names(pool: &Pool, target: &str, prefix: &str) -> Vec<String> {
    // Skip listing the pool for queries of other namespaces.
    if !(DIFF_CONTEXT_PREFIX.starts_with(prefix) || prefix.starts_with(DIFF_CONTEXT_PREFIX)) {
        return Vec::new();
    }
    pool.list()
        .into_iter()
        .filter(|info| info.name != target)
        .map(|info| format!("{DIFF_CONTEXT_PREFIX}{}", info.name))
        .filter(|name| name.starts_with(prefix))
        .collect()
}

impl DiffContext {
    /// The context `name` on the export of `target`, if `name` is `x-thinpool:diff:BASE`
    /// for an existing volume BASE other than the target; binds both generations.
    pub fn open(pool: &Pool, target: &str, name: &str) -> Option<Self> {
        let base = base_of(name)?;
        if base == target {
            return None;
        }
        Some(DiffContext {
            pool: pool.clone(),
            base: base.to_string(),
            base_generation: pool.generation(base).ok()?,
            target: target.to_string(),
            target_generation: pool.generation(target).ok()?,
            lost: AtomicBool::new(false),
        })
    }

    /// The NBD error of a diff that failed: EIO with the reason for a changed volume
    /// (logged the first time), the engine's errno otherwise.
    fn diff_error(&self, error: thin_pool::Error, at: u64) -> NbdError {
        let thin_pool::Error::VolumeChanged { name } = &error else {
            return nbd_error(
                error,
                format!("diff of {:?} against {:?} at {at}", self.target, self.base),
            );
        };
        let role = if *name == self.base { "base" } else { "target" };
        let message = format!(
            "{role} volume {name:?} was deleted, reverted, renamed or replaced since x-thinpool:diff:{} was selected on {:?}",
            self.base, self.target
        );
        if !self.lost.swap(true, Ordering::AcqRel) {
            tracing::warn!("{message}: BLOCK_STATUS on that context fails from now on");
        }
        NbdError::export_with_source(ErrorKind::Io, message, error)
    }
}

impl MetaContext for DiffContext {
    fn block_status(
        &self,
        offset: u64,
        length: u64,
        extents_max: usize,
    ) -> nbd::Result<Vec<StatusExtent>> {
        let target_size = match self.pool.info(&self.target) {
            Ok(info) => info.size_bytes,
            Err(e) => return Err(self.diff_error(e, offset)),
        };
        let block = self.pool.block_size_bytes();
        // Walk at most BLOCK_STATUS_BLOCKS_MAX blocks, ending on a block boundary.
        let limit_end = (offset / block + BLOCK_STATUS_BLOCKS_MAX) * block;
        let full_end = offset
            .saturating_add(length)
            .min(limit_end)
            .min(target_size);
        if full_end <= offset {
            return Err(NbdError::export(
                ErrorKind::InvalidArgument,
                format!("block status at {offset} length {length} is past the end"),
            ));
        }
        if extents_max > 1 {
            return self.extents(offset..full_end, extents_max);
        }
        // One extent (REQ_ONE, which qemu always sends while it walks forward): diff a small
        // window first and widen it only while one extent covers it, so a walk over many
        // differences costs about each difference once, not the rest of the range each time.
        let mut window_blocks = REQ_ONE_WINDOW_BLOCKS;
        loop {
            let end = ((offset / block + window_blocks) * block).min(full_end);
            let mut extents = self.extents(offset..end, 2)?;
            let covered = extents.iter().map(|e| e.length_bytes).sum::<u64>();
            if extents.len() > 1 || end == full_end || offset + covered < end {
                extents.truncate(1);
                return Ok(extents);
            }
            window_blocks *= 16;
        }
    }
}

impl DiffContext {
    /// At most `extents_max` extents from the start of `bytes`, from [`Pool::diff_bound`]
    /// over its blocks: all of `bytes` unless the diff stopped at its node budget.
    fn extents(&self, bytes: Range<u64>, extents_max: usize) -> nbd::Result<Vec<StatusExtent>> {
        let block = self.pool.block_size_bytes();
        let blocks =
            VirtualBlock::new(bytes.start / block)..VirtualBlock::new(bytes.end.div_ceil(block));
        let diff = self
            .pool
            .diff_bound(
                (&self.base, self.base_generation),
                (&self.target, self.target_generation),
                blocks,
                DIFF_NODES_MAX,
            )
            .map_err(|e| self.diff_error(e, bytes.start))?;
        let compared = (diff.compared_end.get() * diff.block_size_bytes).min(bytes.end);
        assert!(
            compared > bytes.start,
            "a bounded diff compares at least one block"
        );
        Ok(dirty_extents(
            &diff.ranges,
            diff.block_size_bytes,
            bytes.start..compared,
            extents_max.max(1),
        ))
    }
}

/// Extents covering `bytes` exactly: [`DIRTY`] where a range of `ranges` (sorted, in blocks
/// of `block` bytes) overlaps, 0 elsewhere; neighbours with equal flags merged; at most
/// `extents_max` (the last may then end before `bytes.end`).
pub fn dirty_extents(
    ranges: &[DiffRange],
    block: u64,
    bytes: Range<u64>,
    extents_max: usize,
) -> Vec<StatusExtent> {
    let mut extents: Vec<StatusExtent> = Vec::new();
    let push = |extents: &mut Vec<StatusExtent>, length_bytes: u64, flags: u32| -> bool {
        if length_bytes == 0 {
            return true;
        }
        let full = extents.len() >= extents_max;
        match extents.last_mut() {
            Some(last) if last.flags == flags => last.length_bytes += length_bytes,
            _ if full => return false,
            _ => extents.push(StatusExtent {
                length_bytes,
                flags,
            }),
        }
        true
    };
    let mut position = bytes.start;
    for range in ranges {
        let start = (range.begin.get() * block).clamp(bytes.start, bytes.end);
        let stop = ((range.begin.get() + range.length) * block).clamp(bytes.start, bytes.end);
        if stop <= position {
            continue;
        }
        let start = start.max(position);
        if !push(&mut extents, start - position, 0) || !push(&mut extents, stop - start, DIRTY) {
            return extents;
        }
        position = stop;
    }
    push(&mut extents, bytes.end - position, 0);
    extents
}

#[cfg(test)]
mod tests {
    use super::*;
    use thin_pool::DiffKind;

    fn range(begin: u64, length: u64) -> DiffRange {
        DiffRange {
            begin: VirtualBlock::new(begin),
            length,
            kind: DiffKind::Changed,
        }
    }

    fn pairs(extents: &[StatusExtent]) -> Vec<(u64, u32)> {
        extents
            .iter()
            .map(|extent| (extent.length_bytes, extent.flags))
            .collect()
    }

    #[test]
    fn dirty_extents_cover_the_request_and_clip_ranges() {
        let ranges = [range(1, 2), range(3, 1), range(10, 5)];
        // Blocks of 100 bytes; adjacent ranges merge.
        assert_eq!(
            pairs(&dirty_extents(&ranges, 100, 0..2000, 100)),
            [(100, 0), (300, 1), (600, 0), (500, 1), (500, 0)]
        );
        // A request starting and ending inside ranges.
        assert_eq!(
            pairs(&dirty_extents(&ranges, 100, 150..1250, 100)),
            [(250, 1), (600, 0), (250, 1)]
        );
        // No ranges: one clean extent.
        assert_eq!(pairs(&dirty_extents(&[], 100, 0..700, 1)), [(700, 0)]);
        // The cap stops early, at an extent boundary.
        assert_eq!(
            pairs(&dirty_extents(&ranges, 100, 0..2000, 2)),
            [(100, 0), (300, 1)]
        );
        assert_eq!(pairs(&dirty_extents(&ranges, 100, 0..2000, 1)), [(100, 0)]);
        assert_eq!(
            pairs(&dirty_extents(&ranges, 100, 100..2000, 1)),
            [(300, 1)]
        );
    }
}
