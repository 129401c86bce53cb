//! Diffs of two volumes on an open pool: [`diff`] (the virtual block ranges that
//! differ, for `thinpool diff` and the NBD meta context `x-thinpool:diff:BASE`) and
//! [`delta`] (`thin_delta`'s report, `same` ranges included).
//!
//! Both walk the mapping trees of one committed transaction with `format::diff`, which skips
//! the subtrees the volumes share, so the cost follows the difference, not the size.
//!
//! Consistency and locks: the walk holds no lock. If either volume has queued ops (writes
//! completed before the call and not committed yet), it commits first (as a flush does).
//! Then, under the metadata mutex for a moment, it checks the volumes (and, for
//! [`diff_bound`], their generations), reads their roots in the committed transaction and a
//! token (metadata generation, commits started), and lets the mutex go; it walks the
//! committed trees through the block manager, then checks the token, as `usage` does:
//! blocks of a committed transaction are never written in place and a block a transaction
//! frees is reused only by a later one, so if at most one commit started meanwhile every
//! block the walk read was the committed one. Otherwise it walks again; the last of
//! `OPTIMISTIC_TRIES` holds the commit lock (never the metadata mutex). So writes, reads,
//! flushes and management operations go on during a walk. When the first commit is refused
//! (a read-only pool, or out of metadata space with writes queued), the diff fails with the
//! same error rather than answer without those writes.
//!
//! Bounds: [`diff_bound`] stops once it has read `nodes_max` btree nodes and answers the
//! blocks it compared (`VolumeDiff::compared_end`), for the NBD context, whose reply may
//! cover less than asked.
//!
//! Volumes of different sizes: blocks past the end of the smaller one count as unmapped in
//! it (the part past its end is walked against an empty tree).

use crate::engine::meta::Meta;
use crate::engine::meta_state::View;
use crate::engine::options::FaultPoint;
use crate::engine::volumes::{VolumeGeneration, VolumeState, Volumes};
use crate::error::{Error, Result};
use crate::format::diff::{self, DeltaHeader, DeltaKind, DeltaRange, DiffRequest};
use crate::ids::{VirtualBlock, VolumeId};
use crate::progress::Progress;
use persistent_data::block_manager::BlockManager;
use persistent_data::MetadataBlock;
use std::ops::Range;
use std::sync::Arc;

/// Walks tried without any lock before one holds the commit lock.
const OPTIMISTIC_TRIES: usize = 3;
/// Btree nodes a counted diff reads between two updates of its progress (a few in unit
/// tests, so that small trees take many parts).
const PROGRESS_CHUNK_NODES: u64 = if cfg!(test) { 2 } else { 1024 };

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
    /// The blocks asked for were compared up to this one (exclusive): the end asked for
    /// (clipped to the larger volume), or less when a bounded diff stopped early.
    pub compared_end: VirtualBlock,
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

/// A volume as the caller names it, and the generation it must still have (None: any).
#[derive(Clone, Copy)]
struct Named<'a> {
    name: &'a str,
    generation: Option<VolumeGeneration>,
}

impl<'a> Named<'a> {
    fn any(name: &'a str) -> Named<'a> {
        Named {
            name,
            generation: None,
        }
    }
}

/// The two volumes in the last committed transaction, read under the metadata mutex.
struct Committed {
    block_manager: Arc<BlockManager>,
    header: DeltaHeader,
    ids: [VolumeId; 2],
    roots: [MetadataBlock; 2],
    size_blocks: [u64; 2],
    /// (metadata generation, commits started) when the roots were read.
    token: (u64, u64),
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
    progress: Option<&Progress>,
) -> Result<VolumeDiff> {
    let named = [Named::any(base), Named::any(target)];
    commit_queued(meta, volumes, &named)?;
    walk_committed(meta, volumes, &named, |view| match progress {
        None => diff_walk(view, blocks.clone(), None, meta.block_size_bytes()),
        Some(progress) => {
            diff_walk_counted(view, blocks.clone(), meta.block_size_bytes(), progress)
        }
    })
}

/// [`diff_walk`] of the whole of `blocks` in bounded parts of [`PROGRESS_CHUNK_NODES`]
/// nodes each, counting the virtual blocks compared in `progress` after each part (out of
/// those asked for): the same answer, from the same committed roots, for a progress bar.
/// Each part walks down from the roots again: a few nodes per part, against the thousands
/// it reads.
fn diff_walk_counted(
    view: &Committed,
    blocks: Option<Range<VirtualBlock>>,
    block_size_bytes: u64,
    progress: &Progress,
) -> Result<VolumeDiff> {
    let end = view.size_blocks[0].max(view.size_blocks[1]);
    let wanted = blocks.map_or(0..end, |r| r.start.get()..r.end.get().min(end));
    let total = wanted.end.saturating_sub(wanted.start);
    progress.set(0, total);
    let mut start = wanted.start;
    let mut whole: Option<VolumeDiff> = None;
    loop {
        let part = diff_walk(
            view,
            Some(VirtualBlock::new(start)..VirtualBlock::new(wanted.end)),
            Some(PROGRESS_CHUNK_NODES),
            block_size_bytes,
        )?;
        let reached = part.compared_end.get();
        match &mut whole {
            None => whole = Some(part),
            Some(whole) => {
                merge(&mut whole.ranges, part.ranges);
                whole.compared_end = part.compared_end;
            }
        }
        progress.set(reached.min(wanted.end).saturating_sub(wanted.start), total);
        if reached >= wanted.end {
            break;
        }
        assert!(reached > start, "a bounded diff answers at least one block");
        start = reached;
    }
    Ok(whole.expect("at least one part"))
}

/// Appends `next` (ranges after those of `ranges`) to `ranges`, joining a range cut at the
/// boundary of two parts.
fn merge(ranges: &mut Vec<DiffRange>, next: Vec<DiffRange>) {
    for range in next {
        push_joined(ranges, range);
    }
}

/// [`diff`] of two volumes bound by their generations, over `blocks`, reading at most
/// about `nodes_max` btree nodes: the answer covers `blocks.start..compared_end` (at least
/// one block). Fails with [`Error::VolumeChanged`] once either volume is not the one of
/// that generation any more (deleted, re-created, reverted or renamed).
pub(crate) fn diff_bound(
    meta: &Meta,
    volumes: &Volumes,
    [base, target]: [(&str, VolumeGeneration); 2],
    blocks: Range<VirtualBlock>,
    nodes_max: u64,
) -> Result<VolumeDiff> {
    let named = [base, target].map(|(name, generation)| Named {
        name,
        generation: Some(generation),
    });
    commit_queued(meta, volumes, &named)?;
    walk_committed(meta, volumes, &named, |view| {
        diff_walk(
            view,
            Some(blocks.clone()),
            Some(nodes_max),
            meta.block_size_bytes(),
        )
    })
}

/// The walk of [`diff`] over `view`'s committed roots.
fn diff_walk(
    view: &Committed,
    blocks: Option<Range<VirtualBlock>>,
    nodes_max: Option<u64>,
    block_size_bytes: u64,
) -> Result<VolumeDiff> {
    let [base_size, target_size] = view.size_blocks;
    let end = base_size.max(target_size);
    let wanted = blocks.map_or(0..end, |r| r.start.get()..r.end.get().min(end));
    let common = wanted.start..wanted.end.min(base_size.min(target_size));
    let beyond = wanted.start.max(common.end)..wanted.end;
    let [base_root, target_root] = view.roots;
    let mut ranges = Vec::new();
    let mut compared_end = wanted.end.max(wanted.start);
    let mut nodes_left = nodes_max;
    let walk = |keys: &Range<u64>, left, right, nodes_max| {
        diff::diff(
            &*view.block_manager,
            &DiffRequest {
                keys: keys.start..=keys.end - 1,
                nodes_max,
                ..DiffRequest::new(left, right)
            },
        )
    };
    if !common.is_empty() {
        let walked = walk(&common, Some(base_root), Some(target_root), nodes_left)?;
        nodes_left = nodes_left.map(|n| n.saturating_sub(walked.nodes_read));
        append(&mut ranges, walked.ranges);
        if let Some(stopped) = walked.stopped_at {
            compared_end = stopped;
        }
    }
    if compared_end == wanted.end && !beyond.is_empty() {
        if nodes_left == Some(0) && !common.is_empty() {
            // The budget is spent and the common part answered: the rest is for next time.
            compared_end = common.end;
        } else {
            // Past the smaller volume's end: only the larger one's mappings count.
            let (left, right) = if base_size > target_size {
                (Some(base_root), None)
            } else {
                (None, Some(target_root))
            };
            let walked = walk(&beyond, left, right, nodes_left)?;
            append(&mut ranges, walked.ranges);
            if let Some(stopped) = walked.stopped_at {
                compared_end = stopped;
            }
        }
    }
    Ok(VolumeDiff {
        block_size_bytes,
        base_size_blocks: base_size,
        target_size_blocks: target_size,
        ranges,
        compared_end: VirtualBlock::new(compared_end),
    })
}

/// `thin_delta`'s report of `base` (left) and `target` (right): every mapped range of
/// either, `same` included, over the whole trees. Listing `same` ranges reads the shared
/// subtrees, so this costs the mapped size; [`diff`] costs only the difference.
pub(crate) fn delta(meta: &Meta, volumes: &Volumes, base: &str, target: &str) -> Result<Delta> {
    let named = [Named::any(base), Named::any(target)];
    commit_queued(meta, volumes, &named)?;
    walk_committed(meta, volumes, &named, |view| {
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
    })
}

/// The volumes `named` are, if they still have their generations.
fn check_named(volumes: &Volumes, named: &[Named<'_>; 2]) -> Result<[Arc<VolumeState>; 2]> {
    let look = |named: &Named<'_>| {
        let found = volumes.named(named.name);
        match (named.generation, found) {
            (None, found) => found,
            (Some(generation), Ok(volume)) if volume.generation() == generation => Ok(volume),
            (Some(_), _) => Err(Error::VolumeChanged {
                name: named.name.to_string(),
            }),
        }
    };
    Ok([look(&named[0])?, look(&named[1])?])
}

/// Commit first if either volume has queued ops (writes completed before the call).
fn commit_queued(meta: &Meta, volumes: &Volumes, named: &[Named<'_>; 2]) -> Result<()> {
    let queued = meta.read(|view| -> Result<bool> {
        let ids = check_named(volumes, named)?.map(|v| v.id());
        Ok(view.queue.touches(&ids))
    })?;
    if queued {
        meta.commit()?;
    }
    Ok(())
}

/// Run `walk` over the committed roots of `named` without any lock, again while commits
/// may have reused a block it read; the last try holds the commit lock (module notes).
fn walk_committed<T>(
    meta: &Meta,
    volumes: &Volumes,
    named: &[Named<'_>; 2],
    walk: impl Fn(&Committed) -> Result<T>,
) -> Result<T> {
    let block_size = meta.block_size_bytes();
    for _ in 0..OPTIMISTIC_TRIES {
        let Some(view) = meta.read(|view| committed(view, volumes, named, block_size))? else {
            // The transaction holds changes (not ops of these volumes): commit them.
            meta.commit()?;
            continue;
        };
        meta.fault_point(FaultPoint::DiffWalk);
        let walked = walk(&view);
        let token = view.token;
        let valid = meta.read(|now| {
            now.generation == token.0
                && now.md.is_some_and(|md| md.commits_started() <= token.1 + 1)
        });
        if valid {
            return walked;
        }
    }
    let turn = meta.turn();
    let (_turn, view) = match turn.read(|view| committed(view, volumes, named, block_size))? {
        Some(view) => (turn, view),
        None => {
            meta.check_changes_allowed()?;
            let mut change = turn.begin()?;
            change.commit()?;
            let view = committed(&change.view(), volumes, named, block_size)?.ok_or_else(|| {
                Error::Internal("the metadata holds changes after a commit".to_string())
            })?;
            (change.into_turn(), view)
        }
    };
    meta.fault_point(FaultPoint::DiffWalk);
    walk(&view)
}

/// Both volumes' roots in the committed transaction; None if the transaction holds changes
/// (its trees are then not the committed ones).
fn committed(
    view: &View<'_>,
    volumes: &Volumes,
    named: &[Named<'_>; 2],
    block_size: u64,
) -> Result<Option<Committed>> {
    // Under the metadata mutex no management operation publishes: names, ids, sizes hold.
    let states = check_named(volumes, named)?;
    let md = view.md()?;
    if md.has_changes() {
        return Ok(None);
    }
    let ids = [states[0].id(), states[1].id()];
    Ok(Some(Committed {
        block_manager: md.transaction_manager().block_manager().clone(),
        header: DeltaHeader {
            time: md.time(),
            transaction_id: md.transaction_id().get(),
            data_block_size_sectors: md.data_block_size_sectors(),
            data_block_count: md.data_space_map().block_count(),
        },
        ids,
        roots: [md.volume_root(ids[0])?, md.volume_root(ids[1])?],
        size_blocks: states
            .each_ref()
            .map(|v| v.size_bytes().div_ceil(block_size)),
        token: (view.generation, md.commits_started()),
    }))
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
        push_joined(
            ranges,
            DiffRange {
                begin: VirtualBlock::new(range.begin),
                length: range.length,
                kind,
            },
        );
    }
}

/// Appends `range` (after every range of `ranges`), joined to the last one if it is of the
/// same kind and follows it.
fn push_joined(ranges: &mut Vec<DiffRange>, range: DiffRange) {
    if let Some(last) = ranges.last_mut() {
        if last.kind == range.kind && last.begin.get() + last.length == range.begin.get() {
            last.length += range.length;
            return;
        }
    }
    ranges.push(range);
}

#[cfg(test)]
mod tests;
