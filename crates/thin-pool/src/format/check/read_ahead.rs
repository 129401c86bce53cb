//! Reading ahead of the walk, on a second thread.
//!
//! The walk (one thread: every rule, every count, every problem reported) would spend about
//! a third of its time reading blocks and computing checksums. A reader thread walks the
//! same trees ahead of it, in the walk's order (depth first, children in key order, each
//! node once), reads the children of a node in runs of consecutive blocks with one request
//! each ([`BlockManager::read_run`]), validates them as the walk would, and queues them;
//! the walk takes each node it needs from the queue ([`ReadAhead::take`]).
//!
//! The reader checks no rule and reports nothing: a block it cannot read or validate is
//! simply not queued, and the walk reads it itself and reports what it finds. So the
//! report is the same, in the same order, whatever the reader did, or if it did nothing
//! (it may be late, descheduled, or follow pointers the walk refuses). Where the two part
//! ways, the walk drops the queued blocks it skipped past, and a full queue the walk finds
//! nothing in is emptied, so the reader is never stuck. A reader fallen behind (the walk
//! marks each block it asks for) skips the leaves the walk has read and catches up.
//!
//! Memory: at most [`WINDOW`] queued blocks, plus one run per tree level being read.

use persistent_data::block_manager::BlockManager;
use persistent_data::btree::node::{self, Node};
use persistent_data::btree::MAX_DEPTH;
use persistent_data::checksum::BlockKind;
use persistent_data::{Block, MetadataBlock, BLOCK_SIZE};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Blocks queued ahead of the walk, at most (1 MiB).
const WINDOW: usize = 256;

/// Blocks read in one request, at most (256 KiB).
const RUN: usize = 64;

/// Buffers kept for reuse, at most.
const SPARES_MAX: usize = WINDOW + RUN;

/// What the walk asks the reader to read, in the order it will need the blocks.
enum Job {
    /// The trees under these roots, in order.
    Trees(Vec<u64>),
    /// These blocks, in order, validated as this kind.
    Blocks(Vec<u64>, BlockKind),
}

/// A block read and validated ahead of the walk.
struct Ready {
    block: u64,
    kind: BlockKind,
    data: Arc<Block>,
}

#[derive(Default)]
struct State {
    jobs: VecDeque<Job>,
    ready: VecDeque<Ready>,
    /// The reader waits for room in `ready`.
    reader_waiting: bool,
    /// The walk is over: the reader stops.
    finished: bool,
    /// Blocks the walk took from the queue.
    served: u64,
    /// Buffers the walk is done with, for the reader to read into again.
    spares: Vec<Arc<Block>>,
}

/// The queue between the reader thread and the walk.
pub(super) struct ReadAhead {
    state: Mutex<State>,
    /// Wakes the reader: a job, room in the queue, or the end.
    reader: Condvar,
    /// The blocks the walk asked for (one bit each, for the metadata space map's blocks).
    asked: Vec<AtomicU64>,
}

impl ReadAhead {
    /// A queue for a walk of `block_count` metadata blocks.
    pub(super) fn new(block_count: u64) -> ReadAhead {
        let words = usize::try_from(block_count.div_ceil(64)).unwrap_or(0);
        ReadAhead {
            state: Mutex::default(),
            reader: Condvar::new(),
            asked: (0..words).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Whether the walk asked for `block` already.
    fn asked(&self, block: u64) -> bool {
        let (word, bit) = bit(block);
        self.asked
            .get(word)
            .is_some_and(|w| w.load(Ordering::Relaxed) & bit != 0)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn push(&self, job: Job) {
        self.lock().jobs.push_back(job);
        self.reader.notify_one();
    }

    /// Read the trees under `roots` ahead, in order.
    pub(super) fn trees(&self, roots: Vec<u64>) {
        self.push(Job::Trees(roots));
    }

    /// Read `blocks` ahead as `kind`, in order.
    pub(super) fn blocks(&self, blocks: Vec<u64>, kind: BlockKind) {
        self.push(Job::Blocks(blocks, kind));
    }

    /// The walk is over: stop the reader.
    pub(super) fn finish(&self) {
        self.lock().finished = true;
        self.reader.notify_all();
    }

    /// Wait until the queue holds `wanted` blocks or a full window, or until `deadline`;
    /// returns how many it holds, at most `wanted`.
    #[cfg(test)]
    pub(super) fn wait_queued(&self, wanted: usize, deadline: std::time::Instant) -> usize {
        loop {
            let queued = self.lock().ready.len();
            if queued >= wanted.min(WINDOW) || std::time::Instant::now() > deadline {
                return queued.min(wanted);
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// Blocks the walk took from the queue so far.
    pub(super) fn served(&self) -> u64 {
        self.lock().served
    }

    /// `block`, read and validated as `kind`, if it is queued. Queued blocks before it were
    /// skipped by the walk and are dropped. `spares` (blocks the walk is done with, each
    /// held by nobody else) go back to the reader.
    pub(super) fn take(
        &self,
        block: u64,
        kind: BlockKind,
        spares: &mut Vec<Arc<Block>>,
    ) -> Option<Arc<Block>> {
        let (word, bit) = bit(block);
        if let Some(word) = self.asked.get(word) {
            word.fetch_or(bit, Ordering::Relaxed);
        }
        let mut state = self.lock();
        let room = SPARES_MAX.saturating_sub(state.spares.len());
        state.spares.extend(spares.drain(..).take(room));
        let Some(position) = state.ready.iter().position(|r| r.block == block) else {
            // A full queue without the block: the reader is out of step (behind the
            // walk, or down a path the walk refused). Let it go on.
            if state.ready.len() >= WINDOW {
                state.ready.clear();
                self.wake_reader(&mut state);
            }
            return None;
        };
        state.ready.drain(..position);
        let ready = state.ready.pop_front()?;
        if state.ready.len() <= WINDOW / 2 {
            self.wake_reader(&mut state);
        }
        if ready.kind != kind {
            return None;
        }
        state.served += 1;
        Some(ready.data)
    }

    fn wake_reader(&self, state: &mut State) {
        if state.reader_waiting {
            state.reader_waiting = false;
            self.reader.notify_one();
        }
    }

    /// Queue blocks for the walk, in order, waiting for room. False: the walk is over.
    fn publish(&self, blocks: Vec<(u64, Arc<Block>)>, kind: BlockKind) -> bool {
        let mut state = self.lock();
        for (block, data) in blocks {
            while state.ready.len() >= WINDOW && !state.finished {
                state.reader_waiting = true;
                state = self.reader.wait(state).unwrap_or_else(|e| e.into_inner());
            }
            if state.finished {
                return false;
            }
            state.ready.push_back(Ready { block, kind, data });
        }
        true
    }

    /// `count` buffers to read into: spares, or new ones.
    fn buffers(&self, count: usize) -> Vec<Arc<Block>> {
        let mut buffers = {
            let mut state = self.lock();
            let keep = state.spares.len().saturating_sub(count);
            state.spares.split_off(keep)
        };
        buffers.resize_with(count, || Arc::new([0u8; BLOCK_SIZE]));
        buffers
    }

    /// The next job, waiting for one; None when the walk is over.
    fn next_job(&self) -> Option<Job> {
        let mut state = self.lock();
        loop {
            if state.finished {
                return None;
            }
            if let Some(job) = state.jobs.pop_front() {
                return Some(job);
            }
            state = self.reader.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The reader thread: serve jobs until [`ReadAhead::finish`]. Blocks at or beyond
    /// `block_count` (the metadata space map's: the walk refuses them) are not read.
    pub(super) fn run(&self, bm: &BlockManager, block_count: u64) {
        let mut reader = Reader {
            read_ahead: self,
            bm,
            block_count,
            seen: vec![0; usize::try_from(block_count.div_ceil(64)).unwrap_or(0)],
            leaf_depth: None,
        };
        while let Some(job) = self.next_job() {
            let going_on = match job {
                Job::Trees(roots) => roots.iter().all(|&root| {
                    reader.leaf_depth = None;
                    reader.nodes(&[root], 0)
                }),
                Job::Blocks(blocks, kind) => blocks
                    .chunks(RUN)
                    .all(|chunk| self.publish(reader.read(chunk, kind, true), kind)),
            };
            if !going_on {
                return;
            }
        }
    }
}

/// The reader thread's state.
struct Reader<'a> {
    read_ahead: &'a ReadAhead,
    bm: &'a BlockManager,
    block_count: u64,
    /// Blocks already read (one bit each): each is queued once, as the walk visits each
    /// node once.
    seen: Vec<u64>,
    /// The depth the current tree's leaves were found at: siblings there are read in runs.
    leaf_depth: Option<usize>,
}

impl Reader<'_> {
    /// Mark `block` seen; false if it was already, or cannot be read.
    fn first_sight(&mut self, block: u64) -> bool {
        if block >= self.block_count {
            return false;
        }
        let (word, bit) = bit(block);
        let new = self.seen[word] & bit == 0;
        self.seen[word] |= bit;
        new
    }

    /// Read `blocks` (new ones only, in runs of consecutive blocks; with `skip_asked`, not
    /// those the walk asked for already) and validate them as `kind`: those that passed,
    /// in order.
    fn read(
        &mut self,
        blocks: &[u64],
        kind: BlockKind,
        skip_asked: bool,
    ) -> Vec<(u64, Arc<Block>)> {
        let wanted: Vec<u64> = blocks
            .iter()
            .copied()
            .filter(|&block| {
                self.first_sight(block) && !(skip_asked && self.read_ahead.asked(block))
            })
            .collect();
        let mut valid = Vec::with_capacity(wanted.len());
        let mut rest = &wanted[..];
        while let Some(&first) = rest.first() {
            let len = 1 + rest
                .windows(2)
                .take_while(|pair| pair[1] == pair[0] + 1)
                .count();
            let buffers = self.read_ahead.buffers(len);
            let results = self.bm.read_run(MetadataBlock::new(first), buffers, kind);
            for (block, result) in rest[..len].iter().zip(results) {
                if let Ok(data) = result {
                    valid.push((*block, data));
                }
            }
            rest = &rest[len..];
        }
        valid
    }

    /// Read and queue the nodes `blocks` (siblings, in key order) and, depth first, the
    /// trees under them. False: the walk is over.
    fn nodes(&mut self, blocks: &[u64], depth: usize) -> bool {
        if depth >= MAX_DEPTH {
            return true;
        }
        let mut next = 0;
        while next < blocks.len() {
            // Leaves are read in runs, and only if the walk has not read them (the reader
            // fell behind); other nodes are read anyway, to find the way.
            let leaves = self.leaf_depth == Some(depth);
            let len = if leaves {
                RUN.min(blocks.len() - next)
            } else {
                1
            };
            let batch = self.read(&blocks[next..next + len], BlockKind::Node, leaves);
            next += len;
            // Queue the leaves of the batch together, each internal node before the tree
            // under it.
            let mut queue = Vec::with_capacity(batch.len());
            for (block, data) in batch {
                let children = internal_children(block, &data);
                if !self.read_ahead.asked(block) {
                    queue.push((block, data));
                }
                match children {
                    Some(children) => {
                        let queued = std::mem::take(&mut queue);
                        if !self.read_ahead.publish(queued, BlockKind::Node)
                            || !self.nodes(&children, depth + 1)
                        {
                            return false;
                        }
                    }
                    None => self.leaf_depth = Some(depth),
                }
            }
            if !self.read_ahead.publish(queue, BlockKind::Node) {
                return false;
            }
        }
        true
    }
}

/// The word and bit of `block` in a bit set.
fn bit(block: u64) -> (usize, u64) {
    ((block / 64) as usize, 1 << (block % 64))
}

/// The children of `data` if it is an internal node the walk could descend (None: a leaf,
/// or not a node).
fn internal_children(block: u64, data: &Block) -> Option<Vec<u64>> {
    let flags = u32::from_le_bytes(data[4..8].try_into().expect("4 bytes"));
    if flags != node::INTERNAL_FLAG {
        return None;
    }
    let node = Node::parse(MetadataBlock::new(block), data, 8).ok()?;
    Some((0..node.len()).map(|i| node.child(i).get()).collect())
}
