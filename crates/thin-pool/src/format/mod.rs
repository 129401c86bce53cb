//! dm-thin's on-disk metadata and the offline tools that work on it.
//!
//! Everything here reads and writes the format of `docs/on-disk-format.md`; nothing here
//! knows about the engine (volumes open for I/O, the index, the commit thread). The engine
//! (`crate::engine`) uses [`metadata::PoolMetadata`]; the tools (`check`, `dump`, `restore`,
//! `metadata_size`) use only this module and `persistent-data`.
//!
//! Order: `superblock` and `details` (codecs) → `metadata` (the one writer, dm-thin's
//! operations) → `check`, `dump`, `restore`, `metadata_size` (the tools).

pub mod check;
pub mod details;
pub mod dump;
pub mod metadata;
pub mod metadata_size;
pub mod restore;
pub mod superblock;
