//! dm-thin semantics on top of `persistent-data`: pool metadata, volumes and the I/O engine.
//!
//! Two halves, and the second uses the first, never the reverse:
//!
//! - [`format`](mod@format): dm-thin's on-disk metadata (superblock, details, mapping trees) with its
//!   operations, and the offline tools (`check`, `dump`, `restore`, `metadata_size`);
//! - [`engine`](mod@engine): the pool open for I/O (volumes, index, commits, catalog, data device).
//!
//! `error` and `ids` are the vocabulary both share.
#![forbid(unsafe_code)]

pub mod engine;
pub mod error;
pub mod format;
pub mod ids;
pub mod owner;
#[cfg(feature = "testing")]
pub mod testing;

pub use engine::diff::{Delta, DiffKind, DiffRange, VolumeDiff};
pub use engine::options::{
    Autoextend, CreateOptions, ExtendBy, PoolMode, PoolOptions, PoolStatus, VolumeInfo,
};
pub use engine::pool::Pool;
pub use engine::usage::VolumeSpace;
pub use engine::volume::{Extent, Volume};
pub use error::{Error, Result};
pub use format::metadata::{Mapping, PoolMetadata};
pub use ids::{BlockTime, DataBlock, Time, TransactionId, VirtualBlock, VolumeId};
