//! What a pool is opened and created with, and what it reports: options, mode, status and
//! volume information. Plain data, no behaviour beyond formatting.

use crate::ids::VolumeId;
use std::sync::Arc;
use std::time::Duration;

/// Options of a pool, as dm-thin's feature arguments.
#[derive(Clone, Debug)]
pub struct PoolOptions {
    /// Zero the part of a new block that its first write does not cover.
    pub zero_new_blocks: bool,
    /// Discard freed data blocks on the data device.
    pub discard_passdown: bool,
    /// Fail writes that need space at once when out of data space (else queue them).
    pub error_if_no_space: bool,
    /// How long a queued write waits for space before failing (zero: forever, as dm-thin's
    /// `no_space_timeout` of 0).
    pub no_space_timeout: Duration,
    /// Refuse every change, and open without writing anything: no check (it may repair),
    /// no commit thread, no catalog clean-up, the metadata file opened read-only.
    pub read_only: bool,
    /// Free data blocks at or below which a low-water event fires.
    pub low_water_mark_blocks: u64,
    /// Used share of the data, and of the metadata, in percent, at which the low-water
    /// event fires (once per crossing; 100: only when full).
    pub low_water_percent: u32,
    /// Grow the data (a regular file) and the metadata when their use crosses a threshold
    /// (None: never, the default). See [`Autoextend`].
    pub autoextend: Option<Autoextend>,
    /// Commit this often when something changed (None: only on flush and management).
    pub commit_interval: Option<Duration>,
    /// Open read-write without checking the metadata first (the check, thin_check's rules,
    /// refuses metadata whose damage could make one volume's writes land on another's
    /// data).
    pub skip_check: bool,
    /// Log a commit (data flush included) that takes at least this long, at warn (None:
    /// never; zero: every commit).
    pub slow_commit_threshold: Option<Duration>,
    /// Tests only: called at the points of [`FaultPoint`], e.g. to inject a panic.
    #[doc(hidden)]
    pub fault_hook: Option<FaultHook>,
    /// Tests only: the host's free bytes as autoextend sees them (instead of the file
    /// system of the pool directory).
    #[doc(hidden)]
    pub host_free_probe: Option<HostFreeProbe>,
}

/// A stand-in for the host file system's free space (tests only): see
/// [`PoolOptions::host_free_probe`].
#[doc(hidden)]
#[derive(Clone)]
pub struct HostFreeProbe(Arc<dyn Fn() -> Option<u64> + Send + Sync>);

impl HostFreeProbe {
    /// A probe answering `probe()`.
    pub fn new(probe: impl Fn() -> Option<u64> + Send + Sync + 'static) -> HostFreeProbe {
        HostFreeProbe(Arc::new(probe))
    }

    pub(crate) fn call(&self) -> Option<u64> {
        (self.0)()
    }
}

impl std::fmt::Debug for HostFreeProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HostFreeProbe")
    }
}

/// [`PoolOptions::low_water_percent`] unless set.
pub const LOW_WATER_PERCENT_DEFAULT: u32 = 80;

/// Automatic growth, as LVM's `thin_pool_autoextend_threshold` and
/// `thin_pool_autoextend_percent`: when the data's use reaches `threshold_percent`, the data
/// device grows by `by`, up to `max_bytes` and to what the host file system has free; when
/// the metadata's use reaches it, the metadata device grows by `by` too (a size counts as
/// the same share of the data size). The growth runs on a thread of its own, off the I/O
/// path; a write that finds no space while the pool can still grow waits for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Autoextend {
    /// Used share, in percent (1 to 100), that triggers a growth.
    pub threshold_percent: u32,
    /// How much each growth adds.
    pub by: ExtendBy,
    /// The data device never grows beyond this many bytes.
    pub max_bytes: u64,
}

/// How much one automatic growth adds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtendBy {
    /// This share of the current size, in percent.
    Percent(u32),
    /// This many bytes (the metadata grows by the same share of its size).
    Bytes(u64),
}

impl std::fmt::Display for ExtendBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExtendBy::Percent(percent) => write!(f, "{percent}%"),
            ExtendBy::Bytes(bytes) => write!(f, "{bytes} bytes"),
        }
    }
}

/// Where the engine calls [`PoolOptions::fault_hook`] (tests only).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultPoint {
    /// A commit is about to apply its queued op number `applied` (from 0).
    ApplyOp {
        /// Ops of this commit applied so far.
        applied: usize,
    },
    /// The metadata is about to be committed.
    Commit,
    /// A management operation is about to change the metadata.
    ManagementChange,
    /// A provisioning write has queued its mapping and not yet published it in the index
    /// (the metadata lock is held).
    Map,
    /// A diff has read its volumes' committed roots and is about to walk their trees (no
    /// lock is held, except on a last try that holds the commit lock).
    DiffWalk,
}

/// A fault-injection hook (tests only): see [`PoolOptions::fault_hook`].
#[doc(hidden)]
#[derive(Clone)]
pub struct FaultHook(Arc<dyn Fn(FaultPoint) + Send + Sync>);

impl FaultHook {
    /// A hook calling `hook` at every [`FaultPoint`].
    pub fn new(hook: impl Fn(FaultPoint) + Send + Sync + 'static) -> FaultHook {
        FaultHook(Arc::new(hook))
    }

    pub(crate) fn call(&self, point: FaultPoint) {
        (self.0)(point)
    }
}

impl std::fmt::Debug for FaultHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FaultHook")
    }
}

impl Default for PoolOptions {
    fn default() -> PoolOptions {
        PoolOptions {
            zero_new_blocks: true,
            discard_passdown: true,
            error_if_no_space: false,
            no_space_timeout: Duration::from_secs(60),
            read_only: false,
            low_water_mark_blocks: 0,
            low_water_percent: LOW_WATER_PERCENT_DEFAULT,
            autoextend: None,
            commit_interval: Some(Duration::from_secs(1)),
            fault_hook: None,
            host_free_probe: None,
            skip_check: false,
            slow_commit_threshold: Some(Duration::from_secs(1)),
        }
    }
}

/// How a new pool is laid out.
#[derive(Clone, Debug)]
pub struct CreateOptions {
    /// Data device size in bytes (rounded down to whole blocks).
    pub data_size_bytes: u64,
    /// Data block size in bytes (64 KiB to 1 GiB, a multiple of 64 KiB).
    pub block_size_bytes: u64,
    /// Metadata device size in bytes (None: estimated from the data size).
    pub metadata_size_bytes: Option<u64>,
}

/// The pool's mode (spec §10.5), most to least capable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum PoolMode {
    /// Normal operation.
    Write = 0,
    /// No free data block: writes needing one error or queue.
    OutOfDataSpace = 1,
    /// No free metadata: no metadata changes.
    OutOfMetadataSpace = 2,
    /// No changes at all.
    ReadOnly = 3,
    /// Every I/O errors.
    Fail = 4,
}

impl PoolMode {
    pub(crate) fn from_u8(v: u8) -> PoolMode {
        match v {
            0 => PoolMode::Write,
            1 => PoolMode::OutOfDataSpace,
            2 => PoolMode::OutOfMetadataSpace,
            3 => PoolMode::ReadOnly,
            _ => PoolMode::Fail,
        }
    }

    /// dm-thin's status word.
    pub fn as_str(self) -> &'static str {
        match self {
            PoolMode::Write => "rw",
            PoolMode::OutOfDataSpace => "out_of_data_space",
            PoolMode::OutOfMetadataSpace | PoolMode::ReadOnly => "ro",
            PoolMode::Fail => "fail",
        }
    }
}

/// A snapshot of the pool's state, like dm-thin's status line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolStatus {
    /// User transaction id.
    pub transaction_id: u64,
    /// Metadata blocks in use.
    pub metadata_used_blocks: u64,
    /// Metadata blocks.
    pub metadata_total_blocks: u64,
    /// Data blocks in use.
    pub data_used_blocks: u64,
    /// Data blocks.
    pub data_total_blocks: u64,
    /// Data block size in bytes.
    pub block_size_bytes: u64,
    /// Held metadata snapshot, if any.
    pub metadata_snap: Option<u64>,
    /// Mode.
    pub mode: PoolMode,
    /// In fail mode: why (e.g. the panic that abandoned the transaction).
    pub fail_reason: Option<String>,
    /// Whether the metadata needs a check.
    pub needs_check: bool,
    /// Discard passdown enabled.
    pub discard_passdown: bool,
    /// error_if_no_space set.
    pub error_if_no_space: bool,
    /// Data use reached the low-water mark (`low_water_percent`, or the free blocks of
    /// `low_water_mark_blocks`).
    pub low_water_reached: bool,
    /// Metadata use reached `low_water_percent`.
    pub metadata_low_water_reached: bool,
    /// The low-water mark, in percent of the data and of the metadata.
    pub low_water_percent: u32,
    /// Automatic growth, if on.
    pub autoextend: Option<Autoextend>,
    /// How long a write waits for space (zero: forever).
    pub no_space_timeout: Duration,
    /// Bytes of free data blocks given back to the host so far (passdown and trim).
    pub data_bytes_passed_down: u64,
    /// Volumes.
    pub volume_count: usize,
}

/// Information about a volume, like a row of `lvs`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeInfo {
    /// Name.
    pub name: String,
    /// Id in the metadata.
    pub id: VolumeId,
    /// Virtual size in bytes.
    pub size_bytes: u64,
    /// Mapped blocks.
    pub mapped_blocks: u64,
    /// Data block size.
    pub block_size_bytes: u64,
    /// The volume it was snapshotted from, if that volume still exists.
    pub origin: Option<String>,
    /// That volume's thin id.
    pub origin_id: Option<VolumeId>,
    /// Read-only.
    pub read_only: bool,
    /// Open handles.
    pub open_count: usize,
}

impl VolumeInfo {
    /// Mapped fraction of the virtual size, in percent.
    pub fn mapped_percent(&self) -> f64 {
        if self.size_bytes == 0 {
            return 0.0;
        }
        ((self.mapped_blocks * self.block_size_bytes) as f64 / self.size_bytes as f64 * 100.0)
            .min(100.0)
    }
}
