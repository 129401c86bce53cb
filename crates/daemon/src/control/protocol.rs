//! The control protocol's wire forms: [`Request`], the records answers carry, [`OpError`],
//! the response line, and bounded line reading and strict request parsing.

use std::io::{BufRead, Read};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use thin_pool::VolumeInfo;

use super::diff::DiffRecord;
pub use super::status_record::{
    AutoextendRecord, OrphanedRecord, ServedRecord, StatusRecord, UnadoptedRecord,
};
pub use super::stream::PartialRecord;
use crate::json::{ErrorKind, VERSION};

/// One management request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Create a thin volume.
    CreateVolume {
        /// Volume name.
        name: String,
        /// Virtual size.
        size_bytes: u64,
    },
    /// Snapshot `origin` as `name`.
    Snapshot {
        /// The volume to snapshot.
        origin: String,
        /// The new volume's name.
        name: String,
        /// Refuse writes to the snapshot.
        #[serde(default)]
        read_only: bool,
    },
    /// Delete a volume (refused while a client has it open).
    DeleteVolume {
        /// Volume name.
        name: String,
    },
    /// Change a volume's virtual size. A shrink is refused (EBUSY) while the volume is
    /// open, and refused (EINVAL, saying how much) if it would unmap mapped data, unless
    /// `force` is set.
    ResizeVolume {
        /// Volume name.
        name: String,
        /// New virtual size.
        size_bytes: u64,
        /// Let a shrink unmap the mapped data beyond the new end.
        #[serde(default)]
        force: bool,
    },
    /// Give `name` the content and size of `snapshot` (refused while `name` is open).
    RevertVolume {
        /// The volume to revert.
        name: String,
        /// The volume whose content it takes.
        snapshot: String,
        /// Delete `snapshot` in the same transaction.
        #[serde(default)]
        delete_snapshot: bool,
    },
    /// Rename a volume (refused while it is open).
    RenameVolume {
        /// Its name.
        name: String,
        /// The new name.
        new_name: String,
    },
    /// Name a thin id the catalog does not know (unadopted), served at once.
    AdoptVolume {
        /// The thin id.
        id: u32,
        /// Its name.
        name: String,
        /// Its virtual size (at least its highest mapped block).
        size_bytes: u64,
        /// The served volume recorded as its origin.
        #[serde(default)]
        origin: Option<String>,
    },
    /// Drop a catalog entry whose thin id is not in the metadata (orphaned).
    ForgetVolume {
        /// Its name.
        name: String,
    },
    /// Grow the data device.
    GrowData {
        /// New data size.
        size_bytes: u64,
    },
    /// Grow the metadata to `size_bytes` (a metadata file is extended), or, without it, to
    /// the metadata device's size (after `lvextend`, `losetup -c`, ...). Answers the status.
    GrowMetadata {
        /// New metadata size.
        #[serde(default)]
        size_bytes: Option<u64>,
    },
    /// List volumes.
    List,
    /// Hold a metadata snapshot, for thin_ls -m, thin_delta -m, thin_dump -m on a live pool
    /// (answers with the status, whose `metadata_snap` is its block).
    ReserveMetadataSnap,
    /// Release the held metadata snapshot (answers with the status).
    ReleaseMetadataSnap,
    /// Pool status.
    Status,
    /// The blocks in which two volumes differ (see `control/diff.rs`).
    Diff {
        /// The base volume.
        base: String,
        /// The target volume.
        target: String,
        /// List `same` ranges too, with the superblock fields (`thin_delta`'s report).
        #[serde(default)]
        list_same: bool,
        /// Send progress lines before the answer (`control/progress.rs`; virtual blocks
        /// compared; not with `list_same`, whose report walks whole trees in one go).
        #[serde(default)]
        progress: bool,
    },
    /// Give every free data block back to the host (answers with the bytes trimmed).
    Trim {
        /// Send progress lines before the answer (`control/progress.rs`).
        #[serde(default)]
        progress: bool,
    },
    /// Send a read-only snapshot as a stream (`control/stream.rs`): the answer line, then
    /// the stream's bytes until the server closes the connection.
    SendStream {
        /// The snapshot.
        snapshot: String,
        /// For an incremental stream: its base.
        #[serde(default)]
        base: Option<String>,
        /// Send only the rest a resumable receive did not keep (its resume token).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        resume: Option<String>,
    },
    /// Receive a stream as volume `name` (`control/stream.rs`): the stream's bytes follow
    /// the request line; the answer comes once it was read and applied (or refused).
    ReceiveStream {
        /// The new volume's name.
        name: String,
        /// Keep what was verified if the stream breaks (a partial receive, resumable).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        resumable: bool,
        /// With `resumable`: keep what was verified after every this many data bytes.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        checkpoint_bytes: Option<u64>,
    },
    /// The partial receives kept (resumable receives interrupted), with their tokens.
    PartialReceives,
    /// Drop a partial receive: the blocks it holds are freed.
    AbortReceive {
        /// The name it would have taken.
        name: String,
    },
}

/// One volume, as `list` and the volume commands report it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VolumeRecord {
    /// Name (also the NBD export name).
    pub name: String,
    /// Id in the metadata (dm-thin's device id).
    pub id: u64,
    /// Virtual size.
    pub size_bytes: u64,
    /// Mapped data blocks.
    pub mapped_blocks: u64,
    /// Mapped share of the virtual size, in percent.
    pub mapped_percent: f64,
    /// Data block size.
    pub block_size_bytes: u64,
    /// The volume it is a snapshot of.
    pub origin: Option<String>,
    /// Writes refused.
    pub read_only: bool,
    /// Open handles (NBD connections using it).
    pub open_count: usize,
    /// The origin's thin id.
    pub origin_id: Option<u64>,
    /// Bytes mapped, as of the last commit (thin_ls's MAPPED_BYTES; `list` only, and null
    /// for a volume made since the last commit).
    pub mapped_bytes: Option<u64>,
    /// Bytes no other mapping shares: freed if the volume is deleted (EXCLUSIVE_BYTES).
    pub exclusive_bytes: Option<u64>,
    /// Bytes shared with other mappings (SHARED_BYTES).
    pub shared_bytes: Option<u64>,
    /// Bytes of mapped data a shrink unmapped (`resize_volume` only, else null).
    pub unmapped_bytes: Option<u64>,
    /// The content id a send or receive gave it (docs/send-stream.md; `list` and
    /// `receive` only; null if it has none).
    #[serde(default)]
    pub content_id: Option<String>,
}

impl From<&VolumeInfo> for VolumeRecord {
    fn from(info: &VolumeInfo) -> Self {
        VolumeRecord {
            name: info.name.clone(),
            id: u64::from(info.id.get()),
            size_bytes: info.size_bytes,
            mapped_blocks: info.mapped_blocks,
            mapped_percent: info.mapped_percent(),
            block_size_bytes: info.block_size_bytes,
            origin: info.origin.clone(),
            read_only: info.read_only,
            open_count: info.open_count,
            origin_id: info.origin_id.map(|id| u64::from(id.get())),
            mapped_bytes: None,
            exclusive_bytes: None,
            shared_bytes: None,
            unmapped_bytes: None,
            content_id: None,
        }
    }
}

/// What a successful request produced.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// A volume was created, snapshotted, resized, reverted, renamed, adopted, received or
    /// deleted (as it was before).
    Volume(VolumeRecord),
    /// The volume list.
    Volumes(Vec<VolumeRecord>),
    /// The pool status (also after growing the data device).
    Status(StatusRecord),
    /// Done; nothing to report (a stream sent).
    Done,
    /// A catalog entry whose thin id was gone, dropped (forget).
    Forgotten(OrphanedRecord),
    /// Two volumes compared.
    Diff(Box<DiffRecord>),
    /// Free data blocks given back to the host (trim), in bytes.
    Trimmed(u64),
    /// The partial receives kept.
    Partial(Vec<PartialRecord>),
}

impl Outcome {
    /// The volumes of a `list` answer.
    pub fn into_volumes(self) -> anyhow::Result<Vec<VolumeRecord>> {
        match self {
            Outcome::Volumes(volumes) => Ok(volumes),
            other => bail!("unexpected answer: {other:?}"),
        }
    }

    /// The status of a `status` or `grow_data` answer.
    pub fn into_status(self) -> anyhow::Result<StatusRecord> {
        match self {
            Outcome::Status(status) => Ok(status),
            other => bail!("unexpected answer: {other:?}"),
        }
    }
}

/// A refused or failed request: who must act, an errno, its symbolic name, and the engine's
/// message (the fields of [`crate::json::ErrorRecord`], errno never null).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpError {
    /// Who must act: the engine's kind; the control socket's own refusals are `refused`.
    pub kind: ErrorKind,
    /// Linux errno.
    pub errno: i32,
    /// Its name, e.g. `EBUSY`.
    pub code: String,
    /// What went wrong.
    pub message: String,
}

impl OpError {
    /// A refusal (kind `refused`).
    pub(crate) fn new(errno: i32, message: impl Into<String>) -> Self {
        OpError::with_kind(ErrorKind::Refused, errno, message)
    }

    /// An error of `kind`.
    pub(super) fn with_kind(kind: ErrorKind, errno: i32, message: impl Into<String>) -> Self {
        OpError {
            kind,
            errno,
            code: errno_name(errno).to_string(),
            message: message.into(),
        }
    }
}

impl From<thin_pool::Error> for OpError {
    /// The engine's errno ([`thin_pool::Error::errno`], the one the NBD adapter uses too) and
    /// its message with every cause.
    fn from(error: thin_pool::Error) -> Self {
        OpError::with_kind(
            error.kind().into(),
            error.errno(),
            error.report().to_string(),
        )
    }
}

impl std::fmt::Display for OpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.code)
    }
}

impl std::error::Error for OpError {}

/// The symbolic name of an errno: those the engine and this module give, and those a device
/// commonly fails with (an I/O error keeps the device's errno).
pub fn errno_name(errno: i32) -> &'static str {
    match errno {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EINTR => "EINTR",
        libc::EIO => "EIO",
        libc::ENXIO => "ENXIO",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EBUSY => "EBUSY",
        libc::EEXIST => "EEXIST",
        libc::ENODEV => "ENODEV",
        libc::EINVAL => "EINVAL",
        libc::EFBIG => "EFBIG",
        libc::ENOSPC => "ENOSPC",
        libc::EROFS => "EROFS",
        libc::ENODATA => "ENODATA",
        libc::EPROTO => "EPROTO",
        libc::EOVERFLOW => "EOVERFLOW",
        libc::ENOTSUP => "ENOTSUP",
        libc::ESHUTDOWN => "ESHUTDOWN",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::EDQUOT => "EDQUOT",
        libc::ENOTDIR => "ENOTDIR",
        libc::EISDIR => "EISDIR",
        libc::ENOTEMPTY => "ENOTEMPTY",
        libc::ECONNREFUSED => "ECONNREFUSED",
        libc::ECONNRESET => "ECONNRESET",
        libc::EPIPE => "EPIPE",
        _ => "EUNKNOWN",
    }
}

/// The wire form of an answer.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(super) struct Response {
    /// [`crate::json::VERSION`] (0 from a server older than the field).
    #[serde(default)]
    thinpool_json: u32,
    ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    volume: Option<VolumeRecord>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    volumes: Option<Vec<VolumeRecord>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    status: Option<StatusRecord>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<OpError>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    diff: Option<Box<DiffRecord>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    trimmed_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    partial_receives: Option<Vec<PartialRecord>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    forgotten: Option<OrphanedRecord>,
}

impl From<Result<Outcome, OpError>> for Response {
    fn from(result: Result<Outcome, OpError>) -> Self {
        let response = Response::answer(result);
        Response {
            thinpool_json: VERSION,
            ..response
        }
    }
}

impl Response {
    fn answer(result: Result<Outcome, OpError>) -> Self {
        match result {
            Ok(Outcome::Volume(volume)) => Response {
                ok: true,
                volume: Some(volume),
                ..Response::default()
            },
            Ok(Outcome::Volumes(volumes)) => Response {
                ok: true,
                volumes: Some(volumes),
                ..Response::default()
            },
            Ok(Outcome::Status(status)) => Response {
                ok: true,
                status: Some(status),
                ..Response::default()
            },
            Ok(Outcome::Trimmed(bytes)) => Response {
                ok: true,
                trimmed_bytes: Some(bytes),
                ..Response::default()
            },
            Ok(Outcome::Done) => Response {
                ok: true,
                ..Response::default()
            },
            Ok(Outcome::Forgotten(entry)) => Response {
                ok: true,
                forgotten: Some(entry),
                ..Response::default()
            },
            Ok(Outcome::Diff(diff)) => Response {
                ok: true,
                diff: Some(diff),
                ..Response::default()
            },
            Ok(Outcome::Partial(partial)) => Response {
                ok: true,
                partial_receives: Some(partial),
                ..Response::default()
            },
            Err(error) => Response {
                ok: false,
                error: Some(error),
                ..Response::default()
            },
        }
    }

    pub(super) fn into_result(self) -> anyhow::Result<Result<Outcome, OpError>> {
        if !self.ok {
            return Ok(Err(self
                .error
                .context("control socket answered ok=false without an error")?));
        }
        if let Some(diff) = self.diff {
            if self.volume.is_some() || self.volumes.is_some() || self.status.is_some() {
                bail!("control socket answered with more than one result");
            }
            return Ok(Ok(Outcome::Diff(diff)));
        }
        if let Some(bytes) = self.trimmed_bytes {
            return Ok(Ok(Outcome::Trimmed(bytes)));
        }
        if let Some(partial) = self.partial_receives {
            return Ok(Ok(Outcome::Partial(partial)));
        }
        if let Some(entry) = self.forgotten {
            return Ok(Ok(Outcome::Forgotten(entry)));
        }
        Ok(Ok(match (self.volume, self.volumes, self.status) {
            (Some(volume), None, None) => Outcome::Volume(volume),
            (None, Some(volumes), None) => Outcome::Volumes(volumes),
            (None, None, Some(status)) => Outcome::Status(status),
            (None, None, None) => Outcome::Done,
            _ => bail!("control socket answered with more than one result"),
        }))
    }
}

/// One line read with a length limit.
pub(super) enum Line {
    /// A line without its newline (the last line may lack one).
    Complete(Vec<u8>),
    /// End of stream before any byte.
    End,
    /// More than the limit without a newline.
    TooLong,
}

pub(super) fn read_line(reader: &mut impl BufRead, limit: usize) -> std::io::Result<Line> {
    let mut line = Vec::new();
    reader
        .by_ref()
        .take(limit as u64 + 1)
        .read_until(b'\n', &mut line)?;
    if line.is_empty() {
        return Ok(Line::End);
    }
    if line.last() == Some(&b'\n') {
        line.pop();
        return Ok(Line::Complete(line));
    }
    if line.len() > limit {
        return Ok(Line::TooLong);
    }
    Ok(Line::Complete(line))
}

/// Parses one request line, refusing fields the request does not have. `deny_unknown_fields`
/// on [`Request`] covers the variants with fields, but serde lets a unit variant of an
/// internally tagged enum (`list`, `status`) accept any map; so the keys sent are also checked
/// against the request's own wire form.
pub(super) fn parse_request(line: &[u8]) -> Result<Request, String> {
    let value: serde_json::Value =
        serde_json::from_slice(line).map_err(|error| format!("bad request: {error}"))?;
    let request: Request =
        serde_json::from_value(value.clone()).map_err(|error| format!("bad request: {error}"))?;
    let known = serde_json::to_value(&request).map_err(|error| format!("bad request: {error}"))?;
    if let (Some(sent), Some(known)) = (value.as_object(), known.as_object()) {
        if let Some(unknown) = sent.keys().find(|key| !known.contains_key(*key)) {
            return Err(format!(
                "bad request: unknown field {unknown:?} for op {:?}",
                known.get("op").and_then(|op| op.as_str()).unwrap_or("?")
            ));
        }
    }
    Ok(request)
}
