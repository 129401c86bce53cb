//! dm-thin semantics on top of `persistent-data`: pool metadata, volumes and the I/O engine.
#![forbid(unsafe_code)]

pub mod catalog;
pub mod check;
pub mod data_device;
pub mod details;
pub mod dump;
pub mod error;
pub mod gate;
pub mod ids;
pub mod index;
pub mod metadata;
pub mod metadata_size;
pub mod pool;
pub mod restore;
pub mod superblock;
pub mod volume;

pub use error::{Error, Result};
pub use ids::{DataBlock, TransactionId, VirtualBlock, VolumeId};
pub use metadata::{Mapping, PoolMetadata};
pub use pool::{CreateOptions, Pool, PoolMode, PoolOptions, PoolStatus, VolumeInfo};
pub use volume::{Extent, Volume};
