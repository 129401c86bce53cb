//! dm-thin semantics on top of `persistent-data`: pool metadata, volumes and the I/O engine.
//!
//! Two halves, and the second uses the first, never the reverse:
//!
//! - [`format`](mod@format): dm-thin's on-disk metadata (superblock, details, mapping trees)
//!   with its operations, and the offline tools (`check`, `dump`, `restore`,
//!   `metadata_size`, `diff`): public, the format tools are part of the face;
//! - the engine (private): the pool open for I/O. What its users need is re-exported here:
//!   the pool handle ([`Pool`]), volumes ([`Volume`]), options and status, diffs and space,
//!   the devices and the catalog a pool is made of ([`data_device`], [`block_device`],
//!   [`catalog`]), commit statistics ([`stats`]) and the pool directory's names.
//!
//! [`Error`] (with its one kind → errno table) and the address newtypes ([`VolumeId`],
//! [`DataBlock`], ...) are the vocabulary both halves share.
#![forbid(unsafe_code)]

mod engine;
mod error;
pub mod format;
mod ids;
pub mod owner;
pub mod progress;
pub mod stream;
#[cfg(feature = "testing")]
pub mod testing;

pub use engine::adopt::{Disagreements, OrphanedVolume, UnadoptedThin};
pub use engine::diff::{Delta, DiffKind, DiffRange, VolumeDiff};
pub use engine::directory::PoolDirectory;
pub use engine::grow::{Resized, Shrink};
pub use engine::layout::{BLOCK_SIZE_DEFAULT_BYTES, DATA_FILE, DEVICES_FILE, METADATA_FILE};
pub use engine::limits::VOLUME_SIZE_MAX_BYTES;
pub use engine::open::default_metadata_size_bytes;
pub use engine::options::{
    Autoextend, CreateOptions, ExtendBy, FaultHook, FaultPoint, HostFreeProbe, PoolMode,
    PoolOptions, PoolStatus, VolumeInfo, LOW_WATER_PERCENT_DEFAULT,
};
pub use engine::pool::Pool;
pub use engine::receive::{ReceiveSpec, VolumeReceiver};
pub use engine::space::host_free_bytes;
pub use engine::usage::VolumeSpace;
pub use engine::volume::{Extent, LentPiece, Volume, SECTOR_SIZE};
pub use engine::volumes::VolumeGeneration;
pub use error::{CatalogRefusal, Error, ErrorKind, Limit, Report, Result};
pub use format::metadata::{Mapping, PoolMetadata};
pub use ids::{BlockTime, DataBlock, Time, TransactionId, VirtualBlock, VolumeId};

/// The volume catalog (names, sizes, flags, origins) that goes with the metadata: the
/// trait a pool stores it through, on a directory or in memory.
pub mod catalog {
    pub use crate::engine::catalog::{
        validate_name, Catalog, CatalogStore, CatalogVolume, MemoryCatalog, PartialReceive,
        NAME_LENGTH_MAX, NAME_RULE,
    };
    pub use crate::engine::catalog_dir::DirCatalog;
}

/// Where volume contents live: the data device trait, on a file or in memory.
pub mod data_device {
    pub use crate::engine::data_device::{
        DataCounters, DataDevice, FileDataDevice, MemoryDataDevice,
    };
}

/// Pools on block devices: the directory's `devices.json`, the data device on a block
/// device, the metadata device's probes.
pub mod block_device {
    pub use crate::engine::block_device::{
        device_size_bytes, holds_pool_metadata, metadata_blocks_of, open_metadata_device,
        BlockDataDevice, DevicePaths, QueueLimits,
    };
    pub use crate::engine::layout::DEVICES_FILE;
}

/// Commit counters and the lock-free duration histogram (the binary's request histograms
/// use it too).
pub mod stats {
    pub use crate::engine::stats::{
        CommitStats, DurationHistogram, HistogramSnapshot, DURATION_BUCKET_BOUNDS_NS,
        DURATION_BUCKET_COUNT,
    };
}
