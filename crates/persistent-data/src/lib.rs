//! dm-thin's metadata machinery, in userspace, byte-compatible with the kernel and
//! thin-provisioning-tools.
//!
//! Layers, bottom up (each only uses the ones before it):
//!
//! ```text
//!   io             BlockDevice trait: read/write 4 KiB metadata blocks, flush
//!   checksum       CRC-32C with a per-block-type salt
//!   block_manager  bounded cache + validators on every read and write
//!   transaction    shadowing (copy-on-write), allocation, two-phase commit
//!   space_map      reference counts for metadata and data blocks
//!   btree          dm-thin's btree: lookup, insert, remove, walk, check
//! ```
//!
//! One knot is expected, as in the kernel: the metadata space map keeps counts of 3 and more
//! in a btree whose nodes are themselves metadata blocks counted by that space map. See
//! `space_map` for how the commit resolves it.
//!
//! This crate knows nothing about volumes; `thin-pool` builds dm-thin semantics on top.
#![forbid(unsafe_code)]

pub mod block;
pub mod io;

pub use block::{Block, MetadataBlock, BLOCK_SIZE};
pub use io::{BlockDevice, FileDevice, MemoryDevice};
pub mod block_manager;
pub mod btree;
pub mod checksum;
pub mod error;
pub mod space_map;
pub mod transaction;

pub use error::{Error, Result};
pub use transaction::{BlockSource, TransactionManager};
