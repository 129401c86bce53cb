//! Diffs of two volumes on an open pool: [`diff`] (the virtual block ranges that
//! differ, for `thinpool diff` and the NBD meta context `x-thinpool:diff:BASE`) and
//! [`delta`] (`thin_delta`'s report, `same` ranges included).
//!
//! Both walk the mapping trees of one committed transaction with `format::diff`, which skips
//! the subtrees the volumes share, so the cost follows the difference, not the size.
//!
//! Consistency: the call takes the commit lock, so no commit and no management operation
//! runs until it returns. If either volume has queued ops (writes completed before the call
//! and not committed yet) or the transaction holds changes, it commits first. Then it reads
//! the two roots under the metadata mutex, lets that mutex go, and walks the committed trees
//! through the block manager while holding only the commit lock: blocks of the committed
//! transaction are never written in place and are reused only by a later commit, which the
//! commit lock keeps out. So writes (they only reserve blocks and queue ops under the
//! metadata mutex) and reads (lock-free) go on during the walk; a flush or a management
//! operation waits for it, for a time that follows the difference. When that commit is
//! refused (a read-only pool, or out of metadata space with writes queued), the diff fails
//! with the same error rather than answer without those writes.
//!
//! Volumes of different sizes: blocks past the end of the smaller one count as unmapped in
//! it (the part past its end is walked against an empty tree).

use crate::engine::meta::{Meta, Turn};
use crate::engine::volumes::Volumes;
use crate::error::{Error, Result};
use crate::format::diff::{self, DeltaHeader, DeltaKind, DeltaRange, DiffRequest};
use crate::ids::{VirtualBlock, VolumeId};
use persistent_data::block_manager::BlockManager;
use persistent_data::MetadataBlock;
use std::ops::Range;
use std::sync::Arc;

/// How a range of virtual blocks differs between the base and the target volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DiffKind {
    /// Mapped in both, to different data blocks.
    Changed,
    /// Mapped in the base only (unmapped, or past the end, in the target).
    BaseOnly,
    /// Mapped in the target only (unmapped, or past the end, in the base).
    TargetOnly,
}

impl DiffKind {
    /// The kind's name in `thinpool diff --json`: `changed`, `base_only`, `target_only`.
    pub fn as_str(self) -> &'static str {
        match self {
            DiffKind::Changed => "changed",
            DiffKind::BaseOnly => "base_only",
            DiffKind::TargetOnly => "target_only",
        }
    }
}

/// Virtual blocks `begin..begin + length` that differ in one way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiffRange {
    /// First virtual block.
    pub begin: VirtualBlock,
    /// Number of blocks (at least 1).
    pub length: u64,
    /// How they differ.
    pub kind: DiffKind,
}

/// The blocks in which two volumes differ.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeDiff {
    /// Data (and virtual) block size.
    pub block_size_bytes: u64,
    /// The base volume's size in blocks (a partial last block counts).
    pub base_size_blocks: u64,
    /// The target volume's size in blocks.
    pub target_size_blocks: u64,
    /// Differing ranges only: sorted, non-overlapping, adjacent ranges of one kind merged.
    pub ranges: Vec<DiffRange>,
}

/// `thin_delta`'s report of two volumes: every mapped range, `same` ones included.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delta {
    /// The superblock fields `thin_delta` prints (of the transaction compared).
    pub header: DeltaHeader,
    /// The base volume's thin id (`left`).
    pub base_id: VolumeId,
    /// The target volume's thin id (`right`).
    pub target_id: VolumeId,
    /// Sorted, non-overlapping, adjacent ranges of one kind merged.
    pub ranges: Vec<DeltaRange>,
}

/// The two volumes in one committed transaction, read under the commit lock.
struct Committed<'a> {
    _turn: Turn<'a>,
    block_manager: Arc<BlockManager>,
    header: DeltaHeader,
    ids: [VolumeId; 2],
    roots: [MetadataBlock; 2],
    size_blocks: [u64; 2],
}

/// The virtual blocks in which `target` differs from `base`, at block granularity:
/// mapped in one only, or mapped to different data blocks (times are not compared).
/// `blocks` restricts the comparison to a range of virtual blocks (the cost then follows
/// the difference inside it). Reflects every write completed before the call (see the
/// module notes for the locks it holds).
pub(crate) fn diff(
    meta: &Meta,
    volumes: &Volumes,
    base: &str,
    target: &str,
    blocks: Option<Range<VirtualBlock>>,
) -> Result<VolumeDiff> {
    let view = committed_view(meta, volumes, base, target)?;
    let [base_size, target_size] = view.size_blocks;
    let end = base_size.max(target_size);
    let wanted = blocks.map_or(0..end, |r| r.start.get()..r.end.get().min(end));
    let common = wanted.start..wanted.end.min(base_size.min(target_size));
    let beyond = wanted.start.max(common.end)..wanted.end;
    let [base_root, target_root] = view.roots;
    let mut ranges = Vec::new();
    if !common.is_empty() {
        let walked = diff::diff(
            &*view.block_manager,
            &DiffRequest {
                keys: common.start..=common.end - 1,
                ..DiffRequest::new(Some(base_root), Some(target_root))
            },
        )?;
        append(&mut ranges, walked.ranges);
    }
    if !beyond.is_empty() {
        // Past the smaller volume's end: only the larger one's mappings count.
        let (left, right) = if base_size > target_size {
            (Some(base_root), None)
        } else {
            (None, Some(target_root))
        };
        let walked = diff::diff(
            &*view.block_manager,
            &DiffRequest {
                keys: beyond.start..=beyond.end - 1,
                ..DiffRequest::new(left, right)
            },
        )?;
        append(&mut ranges, walked.ranges);
    }
    Ok(VolumeDiff {
        block_size_bytes: meta.block_size_bytes(),
        base_size_blocks: base_size,
        target_size_blocks: target_size,
        ranges,
    })
}

/// `thin_delta`'s report of `base` (left) and `target` (right): every mapped range of
/// either, `same` included, over the whole trees. Listing `same` ranges reads the shared
/// subtrees, so this costs the mapped size; [`diff`] costs only the difference.
pub(crate) fn delta(meta: &Meta, volumes: &Volumes, base: &str, target: &str) -> Result<Delta> {
    let view = committed_view(meta, volumes, base, target)?;
    let [base_root, target_root] = view.roots;
    let walked = diff::diff(
        &*view.block_manager,
        &DiffRequest {
            list_same: true,
            ..DiffRequest::new(Some(base_root), Some(target_root))
        },
    )?;
    Ok(Delta {
        header: view.header,
        base_id: view.ids[0],
        target_id: view.ids[1],
        ranges: walked.ranges,
    })
}

/// Commit what either volume has queued, then take the commit lock and read both volumes'
/// roots in the committed transaction.
fn committed_view<'a>(
    meta: &'a Meta,
    volumes: &Volumes,
    base: &str,
    target: &str,
) -> Result<Committed<'a>> {
    let turn = meta.turn();
    // Under the commit lock no management operation runs: names, ids and sizes hold.
    let volumes = [volumes.named(base)?, volumes.named(target)?];
    let ids = [volumes[0].id(), volumes[1].id()];
    let read = |view: &crate::engine::meta_state::View<'_>| -> Result<_> {
        let md = view.md()?;
        if md.has_changes() {
            return Err(Error::Internal(
                "the metadata holds uncommitted changes after a commit".to_string(),
            ));
        }
        let header = DeltaHeader {
            time: md.time(),
            transaction_id: md.transaction_id().get(),
            data_block_size_sectors: md.data_block_size_sectors(),
            data_block_count: md.data_space_map().block_count(),
        };
        let roots = [md.volume_root(ids[0])?, md.volume_root(ids[1])?];
        Ok((
            header,
            roots,
            md.transaction_manager().block_manager().clone(),
        ))
    };
    let clean = turn.read(|view| -> Result<_> {
        if view.queue.touches(&ids) || view.md()?.has_changes() {
            return Ok(None);
        }
        read(view).map(Some)
    })?;
    let (turn, (header, roots, block_manager)) = match clean {
        Some(read) => (turn, read),
        None => {
            meta.check_changes_allowed()?;
            let mut change = turn.begin()?;
            change.commit()?;
            let read = read(&change.view())?;
            (change.into_turn(), read)
        }
    };
    let block_size = meta.block_size_bytes();
    let size_blocks = volumes
        .each_ref()
        .map(|v| v.size_bytes().div_ceil(block_size));
    Ok(Committed {
        _turn: turn,
        block_manager,
        header,
        ids,
        roots,
        size_blocks,
    })
}

/// Append the ranges of a walk to `ranges` (differences only, in the engine's terms),
/// merging a range adjacent to the last one of its kind.
fn append(ranges: &mut Vec<DiffRange>, walked: Vec<DeltaRange>) {
    for range in walked {
        let kind = match range.kind {
            DeltaKind::Same => continue,
            DeltaKind::LeftOnly => DiffKind::BaseOnly,
            DeltaKind::RightOnly => DiffKind::TargetOnly,
            DeltaKind::Different => DiffKind::Changed,
        };
        if let Some(last) = ranges.last_mut() {
            if last.kind == kind && last.begin.get() + last.length == range.begin {
                last.length += range.length;
                continue;
            }
        }
        ranges.push(DiffRange {
            begin: VirtualBlock::new(range.begin),
            length: range.length,
            kind,
        });
    }
}
