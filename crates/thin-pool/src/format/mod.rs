//! dm-thin's on-disk metadata and the offline tools that work on it.
//!
//! Everything here reads and writes the format of `docs/on-disk-format.md`; nothing here
//! knows about the engine (volumes open for I/O, the index, the commit thread). The engine
//! (`crate::engine`) uses [`metadata::PoolMetadata`]; the tools (`check`, `dump`, `restore`,
//! `metadata_size`) use only this module and `persistent-data`.
//!
//! Order: `superblock` and `details` (codecs) → `writer` (formatting, building the volume
//! trees, committing: shared by both writers) → `metadata` (dm-thin's operations, one at a
//! time) → `check`, `diff`, `dump`, `restore`, `repair`, `metadata_size` (the tools; `restore` writes
//! through `writer` too, `repair` through `restore`'s `Restorer`).

pub mod check;
pub mod details;
pub mod diff;
pub mod dump;
pub mod metadata;
pub mod metadata_size;
pub mod repair;
pub mod restore;
pub mod superblock;
pub mod writer;
