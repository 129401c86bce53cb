//! The op queue: metadata changes whose data is written, waiting for the next commit, and
//! how one is applied to the metadata. Held inside the metadata owner's mutex (`meta`).
//!
//! Every op is applied exactly once: the queue counts the ops pushed and the ops taken off
//! (applied or dropped with an abandoned transaction), and `queued - taken == len` is
//! asserted at every take.

use crate::error::{Error, Result};
use crate::format::metadata::PoolMetadata;
use crate::ids::{BlockTime, DataBlock, VirtualBlock, VolumeId};

/// A metadata change whose data is written, waiting for the next commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// Map `block` to the reserved data block in `mapping`.
    Insert {
        volume: VolumeId,
        block: VirtualBlock,
        mapping: BlockTime,
    },
    /// Unmap `block`.
    Remove {
        volume: VolumeId,
        block: VirtualBlock,
    },
}

impl Op {
    /// The volume the op changes.
    pub(crate) fn volume(&self) -> VolumeId {
        match self {
            Op::Insert { volume, .. } | Op::Remove { volume, .. } => *volume,
        }
    }
}

/// Ops queued and not applied, oldest first, with the counts that prove each is taken once.
#[derive(Default)]
pub(crate) struct OpQueue {
    ops: Vec<Op>,
    /// Ops queued since the pool opened.
    queued: u64,
    /// Ops taken off the queue (applied or dropped).
    taken: u64,
}

impl OpQueue {
    pub(crate) fn len(&self) -> usize {
        self.ops.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Whether an op of one of `volumes` is queued.
    pub(crate) fn touches(&self, volumes: &[VolumeId]) -> bool {
        self.ops.iter().any(|op| volumes.contains(&op.volume()))
    }

    /// Queue an op behind the others.
    pub(crate) fn push(&mut self, op: Op) {
        self.ops.push(op);
        self.queued += 1;
        assert_eq!(self.queued - self.taken, self.ops.len() as u64);
    }

    /// Take the `count` oldest ops off the queue.
    pub(crate) fn take(&mut self, count: usize) -> Vec<Op> {
        assert!(
            count <= self.ops.len(),
            "take {count} of {}",
            self.ops.len()
        );
        assert_eq!(
            self.queued - self.taken,
            self.ops.len() as u64,
            "every queued op is taken exactly once"
        );
        let ops: Vec<Op> = self.ops.drain(..count).collect();
        self.taken += ops.len() as u64;
        ops
    }

    /// Drop every queued op (the transaction they belong to was abandoned).
    pub(crate) fn drop_all(&mut self) {
        let count = self.ops.len();
        self.take(count);
        debug_assert!(self.ops.is_empty() && self.queued == self.taken);
    }
}

/// Apply one op; a data block it frees (count now zero) is added to `freed`.
pub(crate) fn apply_op(md: &mut PoolMetadata, op: Op, freed: &mut Vec<DataBlock>) -> Result<()> {
    match op {
        Op::Insert {
            volume,
            block,
            mapping,
        } => {
            let data_block = mapping.data_block();
            if md.has_volume(volume) {
                // A replaced block whose count falls to zero is held by the commit and
                // passed down only once that commit is durable (until then the old mapping
                // may be what survives a crash).
                md.insert_at(volume, block, data_block, mapping.time())?;
            } else if !md.release_data_block(data_block) {
                // The volume was deleted: the reservation goes back.
                return Err(Error::Internal(format!(
                    "queued mapping of deleted volume {volume} holds data block {data_block}, which is not reserved"
                )));
            }
            Ok(())
        }
        Op::Remove { volume, block } => {
            if !md.has_volume(volume) {
                return Ok(());
            }
            if let Some(old) = md.remove(volume, block)? {
                if md.data_block_count(old) == 0 {
                    freed.push(old);
                }
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_are_taken_once_in_order() {
        let mut queue = OpQueue::default();
        let op = |b| Op::Remove {
            volume: VolumeId::new(1),
            block: VirtualBlock::new(b),
        };
        queue.push(op(1));
        queue.push(op(2));
        queue.push(op(3));
        assert_eq!(queue.take(2), vec![op(1), op(2)]);
        assert!(queue.touches(&[VolumeId::new(1)]));
        queue.drop_all();
        assert!(queue.is_empty());
        assert!(!queue.touches(&[VolumeId::new(1)]));
    }
}
