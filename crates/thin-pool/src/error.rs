//! The thin-pool crate's one error type. Variants carry the volume, block and numbers
//! involved; out of data space and out of metadata space are separate because the pool
//! reacts to them differently.
//!
//! Every error has an [`ErrorKind`] saying who must act: the caller (refused), whoever checks
//! the metadata (corrupt), whoever looks after the device (I/O), or whoever fixes thinpool
//! (internal). [`Error::errno`] is the one mapping from an error to a Linux errno; the NBD
//! adapter and the control socket both use it, so a client sees the same failure either way.
//!
//! Messages are short and lowercase and never repeat their source: a variant that wraps an
//! error keeps it as its `source()` and says only what was being done, so printing the chain
//! (anyhow's `{:#}`, or [`Error::report`]) names each cause once.

use crate::ids::{DataBlock, TransactionId, VirtualBlock, VolumeId};
use persistent_data::error::ErrorKind as MetadataErrorKind;
use std::io;

mod catalog;
pub use catalog::CatalogRefusal;

/// Result with the crate's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong in the pool.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Metadata could not be read, written or understood (its message names the metadata
    /// block, or says "metadata i/o error").
    #[error(transparent)]
    Metadata(persistent_data::Error),
    /// The metadata file or data device failed outside persistent-data.
    #[error("{what}")]
    Io {
        /// What was being done, with the path.
        what: String,
        /// The device's error.
        #[source]
        source: io::Error,
    },
    /// A volume id is already in use.
    #[error("volume {0} already exists")]
    VolumeExists(VolumeId),
    /// No volume has this id.
    #[error("volume {0} does not exist")]
    VolumeNotFound(VolumeId),
    /// A volume id beyond what dm-thin accepts.
    #[error("volume id {0} is out of range (0..=16777215)")]
    BadVolumeId(u64),
    /// `set_transaction_id` with a wrong current id.
    #[error("transaction id is {actual}, not {expected}")]
    TransactionMismatch {
        /// What the caller thought it was.
        expected: TransactionId,
        /// What it is.
        actual: TransactionId,
    },
    /// A metadata snapshot is already held.
    #[error("a metadata snapshot is already held (block {0})")]
    MetadataSnapExists(u64),
    /// No metadata snapshot is held.
    #[error("no metadata snapshot is held")]
    NoMetadataSnap,
    /// The pool is read-only (by option, or after a metadata error).
    #[error("pool is read-only{}", if *.needs_check { " and needs a check" } else { "" })]
    ReadOnly {
        /// Whether the metadata is marked as needing a check.
        needs_check: bool,
    },
    /// No free data block.
    #[error("out of data space ({block_count} data blocks, all in use)")]
    OutOfDataSpace {
        /// Data blocks in the pool.
        block_count: u64,
    },
    /// No free metadata block.
    #[error("out of metadata space ({block_count} metadata blocks, all in use)")]
    OutOfMetadataSpace {
        /// Metadata blocks in the pool.
        block_count: u64,
    },
    /// Another process holds the pool.
    #[error("{path} is in use by another process")]
    Locked {
        /// The metadata path.
        path: String,
    },
    /// No volume has this name.
    #[error("no volume named {0:?}")]
    NoSuchVolume(String),
    /// A volume with this name exists.
    #[error("a volume named {0:?} exists")]
    NameExists(String),
    /// The object is in use (an open volume cannot be deleted).
    #[error("{0}")]
    Busy(String),
    /// A block size dm-thin does not accept. Nothing was changed.
    #[error("block size {bytes} bytes: must be a multiple of 64 KiB from 64 KiB to 1 GiB")]
    BadBlockSize {
        /// The size asked for.
        bytes: u64,
    },
    /// A volume size that is not a positive multiple of 512.
    #[error("volume size {size_bytes} bytes: must be a positive multiple of 512")]
    BadVolumeSize {
        /// The size asked for.
        size_bytes: u64,
    },
    /// A size or count beyond what the engine or the format addresses.
    #[error("{}", over_limit(*.what, *.requested, *.max))]
    SizeOverLimit {
        /// What was too large.
        what: Limit,
        /// What was asked for (in `what`'s unit).
        requested: u64,
        /// The most there may be.
        max: u64,
    },
    /// The data is smaller than one data block.
    #[error("data size {data_bytes} bytes is smaller than one {block_size_bytes}-byte block")]
    DataSmallerThanBlock {
        /// The data size.
        data_bytes: u64,
        /// The block size.
        block_size_bytes: u64,
    },
    /// The metadata is below the smallest the pool takes.
    #[error("metadata of {blocks} blocks of 4 KiB: at least 64 (256 KiB)")]
    MetadataTooSmall {
        /// Its 4 KiB blocks.
        blocks: u64,
    },
    /// The metadata cannot hold the data space map beside the reserve.
    #[error("metadata of {metadata_blocks} blocks cannot map {data_blocks} data blocks: their space map needs {space_map_blocks} metadata blocks, {reserve_blocks} stay reserved and {formatted_blocks} hold the rest")]
    MetadataCannotMap {
        /// The metadata's blocks.
        metadata_blocks: u64,
        /// The data blocks to map.
        data_blocks: u64,
        /// What their space map needs.
        space_map_blocks: u64,
        /// What stays reserved for management.
        reserve_blocks: u64,
        /// What the formatted metadata holds.
        formatted_blocks: u64,
    },
    /// A data grow whose space map does not fit in the free metadata beside the reserve.
    #[error("growing the data from {from_blocks} to {to_blocks} blocks needs {cost_blocks} metadata blocks for the data space map's bitmaps and index, and {reserve_blocks} stay reserved: {free_blocks} of the {total_blocks} metadata blocks are free; grow the metadata first")]
    GrowNeedsMetadata {
        /// Data blocks now.
        from_blocks: u64,
        /// Data blocks asked for.
        to_blocks: u64,
        /// Metadata blocks the grow may take.
        cost_blocks: u64,
        /// Metadata blocks kept for management.
        reserve_blocks: u64,
        /// Free metadata blocks.
        free_blocks: u64,
        /// All metadata blocks.
        total_blocks: u64,
    },
    /// The host file system has no room for the preallocated metadata.
    #[error("{path}: the host file system has {free_bytes} bytes free, the metadata needs {needed_bytes} (it is preallocated)")]
    HostFull {
        /// The pool directory.
        path: String,
        /// Bytes free.
        free_bytes: u64,
        /// Bytes needed.
        needed_bytes: u64,
    },
    /// A shrink to a size that is not a whole number of blocks.
    #[error("shrinking to {size_bytes} bytes: a smaller size must be a multiple of the {block_size_bytes}-byte block size")]
    ShrinkNotAligned {
        /// The size asked for.
        size_bytes: u64,
        /// The block size.
        block_size_bytes: u64,
    },
    /// A shrink that would unmap mapped blocks, asked for without
    /// [`Shrink::DropData`](crate::Shrink::DropData). Nothing was changed.
    #[error("shrinking volume {volume:?} from {size_bytes} to {new_size_bytes} bytes would unmap {mapped_bytes} bytes ({mapped_blocks} blocks) of mapped data; only a forced shrink drops it")]
    ShrinkWouldUnmap {
        /// The volume.
        volume: String,
        /// Its size now.
        size_bytes: u64,
        /// The size asked for.
        new_size_bytes: u64,
        /// Mapped blocks at or beyond the new end.
        mapped_blocks: u64,
        /// Their bytes (`mapped_blocks` whole data blocks).
        mapped_bytes: u64,
    },
    /// Volume I/O whose offset or length is not a whole number of sectors.
    #[error("offset {offset} and length {length} must be multiples of {sector_bytes}")]
    Unaligned {
        /// The offset asked for.
        offset: u64,
        /// The length asked for.
        length: u64,
        /// The sector size.
        sector_bytes: u64,
    },
    /// Volume I/O beyond the volume's end.
    #[error("range {offset}+{length} is beyond the volume's {size_bytes} bytes")]
    BeyondVolume {
        /// The offset asked for.
        offset: u64,
        /// The length asked for.
        length: u64,
        /// The volume's size.
        size_bytes: u64,
    },
    /// A mapping beyond the volume's blocks (it shrank meanwhile).
    #[error("volume {volume:?}: block {block} is beyond its {block_count} blocks")]
    BlockBeyondVolume {
        /// The volume's name.
        volume: String,
        /// The block.
        block: VirtualBlock,
        /// The volume's blocks.
        block_count: u64,
    },
    /// A data block the engine's index cannot hold.
    #[error("data block {block} beyond the engine's range")]
    DataBlockBeyondEngine {
        /// The block.
        block: DataBlock,
    },
    /// A mapping to a data block beyond the data device.
    #[error("data block {block} beyond the data device ({block_count} blocks)")]
    DataBlockBeyondDevice {
        /// The block.
        block: DataBlock,
        /// The data device's blocks.
        block_count: u64,
    },
    /// A mapping made after the pool's time.
    #[error("mapping time {time} is after the pool time {pool_time}")]
    TimeAfterPoolTime {
        /// The mapping's time.
        time: u32,
        /// The pool's.
        pool_time: u32,
    },
    /// 2^24 snapshots: the pool time cannot advance.
    #[error("pool time exhausted (2^24 snapshots)")]
    TimeExhausted,
    /// Every thin id is taken.
    #[error("every volume id is in use")]
    IdsExhausted,
    /// The data device is smaller than the pool records.
    #[error(
        "data device holds {device_blocks} blocks, the pool records {recorded_blocks}: it shrank"
    )]
    DataDeviceShrank {
        /// Blocks on the device.
        device_blocks: u64,
        /// Blocks the pool records.
        recorded_blocks: u64,
    },
    /// A directory that already holds a pool.
    #[error("{path} already holds a pool")]
    PoolExists {
        /// The directory.
        path: String,
    },
    /// A metadata device that already holds dm-thin metadata.
    #[error("{path} already holds dm-thin pool metadata: `thinpool import` takes that pool over; to make a new pool, wipe its first 4 KiB first")]
    MetadataExists {
        /// The device.
        path: String,
    },
    /// A path that should be a block device is not.
    #[error("{path} is not a block device (a pool on files keeps them in its directory)")]
    NotBlockDevice {
        /// The path.
        path: String,
    },
    /// A device at a path `devices.json` names is not the one recorded there.
    #[error(
        "device {path} is not this pool's {role} device (expected {expected}, found {found}); if the pool's devices moved, name them in devices.json, or attach the right ones at these paths"
    )]
    NotThisPoolsDevice {
        /// The path.
        path: String,
        /// `metadata` or `data`.
        role: &'static str,
        /// The recorded identity, described.
        expected: String,
        /// The identity found, described.
        found: String,
    },
    /// A loop device's backing file was replaced between finding and opening it.
    #[error("{file}, the backing file of {device}, changed while it was opened")]
    BackingFileChanged {
        /// The backing file.
        file: String,
        /// The loop device.
        device: String,
    },
    /// A `devices.json` of a version this build does not read.
    #[error("{path}: version {version} is not supported (expected 1)")]
    UnsupportedVersion {
        /// The file.
        path: String,
        /// Its version.
        version: u32,
    },
    /// A revert of a volume to itself.
    #[error("cannot revert volume {volume:?} to itself")]
    RevertToItself {
        /// The volume.
        volume: String,
    },
    /// A volume bound by its generation (an NBD diff context's base or target) is not that
    /// volume any more: deleted, re-created, reverted or renamed since.
    #[error("volume {name:?} was deleted, reverted, renamed or replaced since it was bound")]
    VolumeChanged {
        /// The name it was bound by.
        name: String,
    },
    /// A volume name that breaks the naming rule.
    #[error("the volume name {why} (names: {rule})")]
    BadName {
        /// What is wrong with it ("is empty", "contains a space", ...).
        why: String,
        /// The rule names follow.
        rule: &'static str,
    },
    /// The volume catalog holds a name no version accepted.
    #[error("volume catalog holds an impossible name {name}")]
    BadCatalogName {
        /// The name, quoted and escaped.
        name: String,
    },
    /// The volume catalog cannot be parsed.
    #[error("volume catalog {path} is damaged: {why}")]
    CatalogDamaged {
        /// The file.
        path: String,
        /// What the parser said.
        why: String,
    },
    /// The volume catalog belongs to another transaction.
    #[error("volume catalog {path} belongs to transaction {found}, expected {expected}")]
    CatalogMismatch {
        /// The file.
        path: String,
        /// Its transaction.
        found: u64,
        /// The metadata's.
        expected: u64,
    },
    /// No volume catalog for the metadata's transaction.
    #[error("no volume catalog for transaction {transaction_id}")]
    NoCatalog {
        /// The metadata's transaction.
        transaction_id: u64,
    },
    /// Block 0 of the metadata device is not the superblock the pool last wrote: someone
    /// else wrote the metadata (the commit wrote nothing; the pool fails safe).
    #[error(
        "metadata changed under the server (superblock transaction id {found}, expected {expected}): another writer? pool is now read-only (fail mode: nothing more is written; reopen the pool to use what is on disk)"
    )]
    MetadataChangedUnderServer {
        /// The transaction id on disk (or why it cannot be read).
        found: String,
        /// The one the pool last committed.
        expected: u64,
    },
    /// The volume catalog file is not the one the pool last wrote or read.
    #[error(
        "volume catalog {path} changed under the server (expected the catalog of transaction {expected} it last wrote): another writer? pool is now read-only (fail mode: nothing more is written; reopen the pool to use what is on disk)"
    )]
    CatalogChangedUnderServer {
        /// The file.
        path: String,
        /// The transaction of the catalog the pool last wrote or read.
        expected: u64,
    },
    /// A restore input (a dump) that breaks a rule of the format.
    #[error("{0}")]
    BadDump(String),
    /// A send/receive stream refused: cut off, corrupted, replayed or for another base.
    #[error("{0}")]
    BadStream(String),
    /// What is on disk breaks a format rule (even with a valid checksum): the pool goes
    /// read-only with needs_check.
    #[error("corrupt metadata: {0}")]
    Corrupt(String),
    /// A broken internal invariant: a bug in thinpool, not the caller's fault.
    #[error("internal error: {0}")]
    Internal(String),
    /// An adopt or forget refused, or a name whose thin id is gone (see [`CatalogRefusal`]).
    #[error(transparent)]
    Catalog(#[from] CatalogRefusal),
}

/// What a [`Error::SizeOverLimit`] is about; each says its unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Limit {
    /// A volume's size in bytes (the largest volume, 1 EiB).
    VolumeBytes,
    /// A pool's data blocks (the index's range), for a data size of `size_bytes`.
    DataBlocks {
        /// The data size asked for.
        size_bytes: u64,
    },
    /// The format's data blocks (2^40).
    FormatDataBlocks,
    /// The metadata's size in bytes (the format's).
    MetadataBytes,
}

/// [`Error::SizeOverLimit`]'s message.
fn over_limit(what: Limit, requested: u64, max: u64) -> String {
    match what {
        Limit::VolumeBytes => format!(
            "volume size {requested} bytes is larger than the largest volume, {max} bytes (1 EiB)"
        ),
        Limit::DataBlocks { size_bytes } => format!(
            "data size {size_bytes} bytes is {requested} blocks: a pool holds at most {max}"
        ),
        Limit::FormatDataBlocks => format!("{requested} data blocks: at most 2^40"),
        Limit::MetadataBytes => {
            format!("metadata size {requested} bytes: the format addresses at most {max} bytes")
        }
    }
}

impl From<persistent_data::Error> for Error {
    fn from(e: persistent_data::Error) -> Error {
        match e {
            persistent_data::Error::OutOfDataSpace { block_count } => {
                Error::OutOfDataSpace { block_count }
            }
            persistent_data::Error::OutOfMetadataSpace { block_count } => {
                Error::OutOfMetadataSpace { block_count }
            }
            other => Error::Metadata(other),
        }
    }
}

/// Who must act on an [`Error`]. Refusals leave the pool exactly as it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The caller asked for something not allowed (bad argument, name taken, no such volume,
    /// busy, read-only, out of space): EINVAL, EEXIST, ENOENT, ENODATA, EBUSY, EROFS, ENOSPC.
    Refused,
    /// What is on disk is wrong, or the pool stopped trusting it: the pool is read-only with
    /// needs_check until the metadata is checked. EIO.
    Corrupt,
    /// A device failed; the errno is the device's own (a host ENOSPC stays ENOSPC), EIO when
    /// the device gave none.
    Io,
    /// A broken internal invariant: a bug in thinpool. EIO.
    Internal,
}

impl Error {
    /// Who must act on this error.
    pub fn kind(&self) -> ErrorKind {
        self.class().0
    }

    /// The errno a kernel would give for this error: the one mapping, used for NBD replies
    /// and control-socket answers alike.
    pub fn errno(&self) -> i32 {
        self.class().1
    }

    /// The error followed by each of its causes, joined by ": ", for logs and messages that
    /// are not printed through anyhow.
    pub fn report(&self) -> Report<'_> {
        Report(self)
    }

    /// The one table: each variant's kind and errno.
    fn class(&self) -> (ErrorKind, i32) {
        use ErrorKind::{Corrupt, Internal, Io, Refused};
        match self {
            Error::Metadata(persistent_data::Error::Io { source, .. })
            | Error::Io { source, .. } => (Io, io_errno(source)),
            Error::Metadata(error) => metadata_class(error),
            Error::VolumeExists(_) | Error::NameExists(_) => (Refused, libc::EEXIST),
            // dm-thin answers a missing device id with ENODATA, a missing name with ENOENT.
            Error::VolumeNotFound(_) => (Refused, libc::ENODATA),
            Error::NoSuchVolume(_) => (Refused, libc::ENOENT),
            Error::BadVolumeId(_) | Error::TransactionMismatch { .. } | Error::NoMetadataSnap => {
                (Refused, libc::EINVAL)
            }
            // Every refusal of a request that can never succeed: EINVAL.
            Error::BadBlockSize { .. }
            | Error::BadVolumeSize { .. }
            | Error::SizeOverLimit { .. }
            | Error::DataSmallerThanBlock { .. }
            | Error::MetadataTooSmall { .. }
            | Error::MetadataCannotMap { .. }
            | Error::GrowNeedsMetadata { .. }
            | Error::HostFull { .. }
            | Error::ShrinkNotAligned { .. }
            | Error::ShrinkWouldUnmap { .. }
            | Error::Unaligned { .. }
            | Error::BeyondVolume { .. }
            | Error::BlockBeyondVolume { .. }
            | Error::DataBlockBeyondEngine { .. }
            | Error::DataBlockBeyondDevice { .. }
            | Error::TimeAfterPoolTime { .. }
            | Error::TimeExhausted
            | Error::IdsExhausted
            | Error::DataDeviceShrank { .. }
            | Error::PoolExists { .. }
            | Error::MetadataExists { .. }
            | Error::NotBlockDevice { .. }
            | Error::NotThisPoolsDevice { .. }
            | Error::BackingFileChanged { .. }
            | Error::UnsupportedVersion { .. }
            | Error::RevertToItself { .. }
            | Error::BadName { .. }
            | Error::BadCatalogName { .. }
            | Error::CatalogDamaged { .. }
            | Error::CatalogMismatch { .. }
            | Error::NoCatalog { .. }
            | Error::BadDump(_)
            | Error::BadStream(_) => (Refused, libc::EINVAL),
            Error::MetadataSnapExists(_) | Error::Locked { .. } | Error::Busy(_) => {
                (Refused, libc::EBUSY)
            }
            Error::VolumeChanged { .. } => (Refused, libc::ESTALE),
            // dm-thin fails I/O with EIO in read-only mode after a metadata error; a pool or
            // volume read-only by choice refuses writes with EROFS.
            Error::ReadOnly { needs_check: true } => (Corrupt, libc::EIO),
            Error::ReadOnly { needs_check: false } => (Refused, libc::EROFS),
            Error::OutOfDataSpace { .. } | Error::OutOfMetadataSpace { .. } => {
                (Refused, libc::ENOSPC)
            }
            Error::Corrupt(_)
            | Error::MetadataChangedUnderServer { .. }
            | Error::CatalogChangedUnderServer { .. } => (Corrupt, libc::EIO),
            Error::Internal(_) => (Internal, libc::EIO),
            Error::Catalog(refusal) => (Refused, refusal.errno()),
        }
    }
}

/// The kind and errno of a persistent-data error that is not an I/O error.
fn metadata_class(error: &persistent_data::Error) -> (ErrorKind, i32) {
    match error.kind() {
        MetadataErrorKind::Corrupt => (ErrorKind::Corrupt, libc::EIO),
        MetadataErrorKind::NoSpace => (ErrorKind::Refused, libc::ENOSPC),
        // The pool passed persistent-data a request it should never make.
        MetadataErrorKind::Invalid => (ErrorKind::Internal, libc::EIO),
        // Io is matched before; a kind added later counts as a bug until classified.
        _ => (ErrorKind::Internal, libc::EIO),
    }
}

/// The device's errno; EIO for an error that carries none (a short read, say).
fn io_errno(error: &io::Error) -> i32 {
    match error.raw_os_error() {
        Some(errno) if errno > 0 => errno,
        _ => libc::EIO,
    }
}

/// Displays an error and its causes, outermost first, joined by ": ". Since no message
/// repeats its source, each cause appears once.
///
/// `nbd` has a `Report` of its own: it must not depend on this crate (it serves any
/// export) and shares no workspace crate with it, so the two stay until a small shared
/// crate exists.
pub struct Report<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(error) = cause {
            write!(f, ": {error}")?;
            cause = error.source();
        }
        Ok(())
    }
}

/// Map an I/O error outside persistent-data to [`Error::Io`] saying what was being done.
pub(crate) fn io_error(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { what, source }
}

#[cfg(test)]
mod tests;
