//! The I/O engine: a pool open for I/O and management on a metadata device, a data device
//! and the volume catalog.
//!
//! It uses `crate::format::metadata::PoolMetadata` as its one metadata writer and never
//! touches on-disk structures directly. Files, one job each:
//!
//! - `pool`: the public handle (create, open, close, status, list);
//! - `manage`: management operations (volumes, growth, transaction id, metadata snapshot);
//! - `revert`: revert a volume to a snapshot's content, rename a volume;
//! - `volume`: volume I/O, on the caller's thread;
//! - `provision`: what volume I/O needs from the pool (reserve, map, unmap a data block);
//! - `commit`: applying queued ops and committing the metadata;
//! - `diff`: the difference of two volumes (`thin_delta`), on committed trees;
//! - `committer`: the periodic commit thread;
//! - `shared`: the state the pool's threads share, and one volume's state;
//! - `options`: options, mode, status and volume information;
//! - `usage`: per-volume space accounting (mapped, exclusive, shared) without stalling I/O;
//! - `autoextend`: the low-water marks and the thread that grows the data and metadata;
//! - `trim`: giving every free data block back to the data device (`thinpool trim`);
//! - `stats`: commit counters and the duration histogram monitoring reads;
//! - `grace`: grace periods that keep a freed data block from reuse while lock-free I/O
//!   may still reach it;
//! - `index`, `gate`, `catalog`, `data_device`: the mapping index, the write gate, the
//!   volume catalog and the data device.
//! - `block_device`: pools on block devices (the directory names them; the data device on
//!   a block device, exclusive, with zero-out, passdown and optional `O_DIRECT`).
//!
//! See ARCHITECTURE.md for the read, provisioning-write and commit paths and the files
//! each crosses.

mod autoextend;
pub mod block_device;
pub mod catalog;
mod commit;
mod committer;
pub mod data_device;
pub mod diff;
pub mod gate;
mod grace;
pub mod index;
mod load;
mod manage;
pub mod options;
pub mod pool;
mod provision;
mod revert;
mod shared;
pub mod stats;
mod trim;
pub mod usage;
pub mod volume;
