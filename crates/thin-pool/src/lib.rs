//! dm-thin semantics on top of `persistent-data`: pool metadata, volumes and the I/O engine.
#![forbid(unsafe_code)]

pub mod check;
pub mod details;
pub mod dump;
pub mod error;
pub mod ids;
pub mod metadata;
pub mod metadata_size;
pub mod restore;
pub mod superblock;

pub use error::{Error, Result};
pub use ids::{DataBlock, TransactionId, VirtualBlock, VolumeId};
pub use metadata::{Mapping, PoolMetadata};
