//! Chains by head index, for the resubmission of the requests an inflight region lists
//! ([`crate::inflight`]): virtio-queue makes a descriptor chain only from an available
//! ring, and the guest's has moved on, so a [`Replay`] is a queue of our own whose available
//! ring, in a scratch region mapped past the end of guest memory, holds the heads to
//! resubmit, in order, over the guest's own descriptor table. The chains come out exactly as
//! the guest's ring would give them (the same bounded walk, indirect tables included).
//!
//! The scratch region is only in the replay's own copy of the memory table, which the chains
//! carry to read descriptors; the caller serves them against the guest's table, so a
//! descriptor that points into the scratch region is outside guest memory and dropped.

use std::io;
use std::sync::Arc;

use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{
    Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestRegionMmap, MmapRegion,
};

use crate::config::QUEUE_SIZE_MAX;

const PAGE_BYTES: u64 = 4096;
/// The scratch region: the available ring at its start (4 + 2 × size + 2 bytes), the used
/// ring, never touched, a page on.
const SCRATCH_BYTES: usize = 4 * PAGE_BYTES as usize;
const USED_AT: u64 = PAGE_BYTES;
const _: () = assert!(4 + 2 * QUEUE_SIZE_MAX as u64 + 2 <= USED_AT);
const _: () = assert!(USED_AT + 4 + 8 * QUEUE_SIZE_MAX as u64 + 2 <= SCRATCH_BYTES as u64);

/// A queue of our own that yields the chains at the heads it was given, in order.
pub(crate) struct Replay {
    mem: GuestMemoryMmap,
    queue: Queue,
}

fn error(what: &str, e: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("resubmission: {what}: {e}"))
}

impl Replay {
    /// A replay of `heads` (at most `size`) over the descriptor table at `desc_table` of a
    /// queue of `size` in `mem`.
    pub(crate) fn new(
        mem: &GuestMemoryMmap,
        desc_table: GuestAddress,
        size: u16,
        heads: &[u16],
    ) -> io::Result<Self> {
        assert!(
            heads.len() <= usize::from(size),
            "{} heads for a queue of {size}",
            heads.len()
        );
        let base = mem
            .last_addr()
            .0
            .checked_add(1)
            .and_then(|end| end.checked_next_multiple_of(PAGE_BYTES))
            .filter(|base| base.checked_add(SCRATCH_BYTES as u64).is_some())
            .ok_or_else(|| error("guest memory", "no room past its end"))?;
        let scratch = MmapRegion::<()>::new(SCRATCH_BYTES).map_err(|e| error("scratch", e))?;
        let scratch = GuestRegionMmap::new(scratch, GuestAddress(base))
            .ok_or_else(|| error("scratch", "region past the address space"))?;
        let mem = mem
            .insert_region(Arc::new(scratch))
            .map_err(|e| error("scratch", e))?;
        for (i, &head) in heads.iter().enumerate() {
            mem.write_obj(head.to_le(), GuestAddress(base + 4 + 2 * i as u64))
                .map_err(|e| error("ring", e))?;
        }
        let count = u16::try_from(heads.len()).expect("at most a queue's size");
        mem.write_obj(count.to_le(), GuestAddress(base + 2))
            .map_err(|e| error("ring", e))?;
        let mut queue = Queue::new(QUEUE_SIZE_MAX).map_err(|e| error("queue", e))?;
        queue.try_set_size(size).map_err(|e| error("size", e))?;
        queue
            .try_set_desc_table_address(desc_table)
            .map_err(|e| error("descriptor table", e))?;
        queue
            .try_set_avail_ring_address(GuestAddress(base))
            .map_err(|e| error("ring", e))?;
        queue
            .try_set_used_ring_address(GuestAddress(base + USED_AT))
            .map_err(|e| error("ring", e))?;
        queue.set_ready(true);
        Ok(Replay { mem, queue })
    }

    /// The next chain, or `None` after the last head.
    pub(crate) fn next_chain(&mut self) -> Option<DescriptorChain<&GuestMemoryMmap>> {
        self.queue.pop_descriptor_chain(&self.mem)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_come_out_at_the_heads_given_in_order() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x1_0000)]).unwrap();
        // Sixteen one-descriptor chains: descriptor i points at 0x1000 + 0x100 × i.
        for i in 0..16u64 {
            let mut d = [0u8; 16];
            d[..8].copy_from_slice(&(0x1000 + 0x100 * i).to_le_bytes());
            d[8..12].copy_from_slice(&16u32.to_le_bytes());
            mem.write_slice(&d, GuestAddress(16 * i)).unwrap();
        }
        let mut replay = Replay::new(&mem, GuestAddress(0), 16, &[5, 0, 9]).unwrap();
        for head in [5u16, 0, 9] {
            let mut chain = replay.next_chain().expect("a chain");
            assert_eq!(chain.head_index(), head);
            let first = chain.next().expect("its descriptor");
            assert_eq!(first.addr(), GuestAddress(0x1000 + 0x100 * u64::from(head)));
            assert!(chain.next().is_none(), "one descriptor");
        }
        assert!(replay.next_chain().is_none(), "only the heads given");
        // The guest's table is untouched by the scratch region, which lies past it.
        assert_eq!(mem.last_addr(), GuestAddress(0xffff));
    }
}
