//! dm-thin's metadata machinery, in userspace, byte-compatible with the kernel and
//! thin-provisioning-tools.
//!
//! Layers, bottom up; each module uses only the ones above it in this list:
//!
//! ```text
//!   block          the 4 KiB block and its address
//!   io             BlockDevice trait: read/write 4 KiB metadata blocks, flush
//!   checksum       CRC-32C with a per-block-type salt
//!   error          the error type (names blocks and their kinds)
//!   block_manager  bounded cache + validators on every read and write
//!   cow            the traits btrees change blocks through: BlockSource (read),
//!                  CopyOnWrite (shadow, new block, write, reference counts)
//!   btree          dm-thin's btree: lookup, insert, remove, walk, check, bulk build
//!   space_map      reference counts in memory and on disk; the data space map
//!   transaction    TransactionManager: the metadata space map, shadowing, two-phase
//!                  commit; implements CopyOnWrite
//! ```
//!
//! One knot is expected, as in the kernel: the metadata space map keeps counts of 3 and more
//! in a btree whose nodes are themselves metadata blocks counted by that space map. The
//! transaction manager resolves it by handing itself to the btree as a `CopyOnWrite` (the
//! btree never names it) and iterating until an update allocates nothing new
//! (`TransactionManager::commit_space_map`).
//!
//! This crate knows nothing about volumes; `thin-pool` builds dm-thin semantics on top.
#![forbid(unsafe_code)]

pub mod block;
pub mod block_manager;
pub mod btree;
pub mod checksum;
pub mod cow;
pub mod error;
pub mod io;
pub mod space_map;
pub mod transaction;

pub use block::{Block, MetadataBlock, BLOCK_SIZE};
pub use cow::{BlockSource, CopyOnWrite};
pub use error::{Error, Result};
pub use io::{BlockDevice, FileDevice, MemoryDevice};
pub use transaction::TransactionManager;
