//! The JSON contract (docs/json.md, schema docs/json-schema.json): the objects `--json`
//! prints and the control socket answers with, as one set of types so the two cannot
//! drift. The records themselves are the control socket's ([`VolumeRecord`],
//! [`StatusRecord`](crate::control::StatusRecord), [`DiffRecord`], ...); this module adds what the command line prints
//! around them: the version field ([`VERSION_FIELD`]) on every printed object
//! ([`Versioned`]), the objects only commands print ([`ListRecord`], [`TrimRecord`],
//! [`ForgottenRecord`], [`PartialReceivesRecord`]), and errors ([`ErrorRecord`]) with the control socket's kinds.
//!
//! Rules every object follows: units in every name (`_bytes`, `_blocks`, `_seconds`,
//! `_percent`, `_sectors`), `null` for "not set" (never an omitted field), fields added in a
//! later version only (a removal or rename raises [`VERSION`]).
//!
//! [`DiffRecord`]: crate::control::diff::DiffRecord

use serde::{Deserialize, Serialize};

use crate::control::stream::PartialRecord;
use crate::control::{OpError, OrphanedRecord, UnadoptedRecord, VolumeRecord};

/// The contract's version, in [`VERSION_FIELD`] of every object printed or answered.
pub const VERSION: u32 = 1;

/// The name of the version field.
pub const VERSION_FIELD: &str = "thinpool_json";

/// An object as a command prints it: the version field, then `value`'s own fields.
#[derive(Debug, Serialize)]
pub struct Versioned<'a, T: Serialize> {
    /// Always [`VERSION`].
    pub thinpool_json: u32,
    /// The object.
    #[serde(flatten)]
    pub value: &'a T,
}

/// `value` with the version field.
pub fn versioned<T: Serialize>(value: &T) -> Versioned<'_, T> {
    Versioned {
        thinpool_json: VERSION,
        value,
    }
}

/// Who must act on an error: the engine's kinds (`thin_pool::ErrorKind`), the same on the
/// control socket and on the command line, and `usage` for a command line that does not
/// parse (only the command line gives it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Not allowed: a bad argument, a name taken, no such volume, busy, read-only, no space.
    Refused,
    /// What is on disk is wrong (the pool needs a check).
    Corrupt,
    /// A device or a file failed (the errno is its own).
    Io,
    /// A bug in thinpool.
    Internal,
    /// The command line does not parse (clap's usage error; exit status 2).
    Usage,
}

impl From<thin_pool::ErrorKind> for ErrorKind {
    fn from(kind: thin_pool::ErrorKind) -> Self {
        match kind {
            thin_pool::ErrorKind::Refused => ErrorKind::Refused,
            thin_pool::ErrorKind::Corrupt => ErrorKind::Corrupt,
            thin_pool::ErrorKind::Io => ErrorKind::Io,
            // A kind added to the engine later: who must act is unknown, so a bug here.
            thin_pool::ErrorKind::Internal | _ => ErrorKind::Internal,
        }
    }
}

/// An error as `--json` prints it (`{"thinpool_json":1,"error":{...}}`, on stdout); the
/// control socket's [`OpError`] has the same fields, its errno never null.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorRecord {
    /// Who must act.
    pub kind: ErrorKind,
    /// Linux errno, where there is one (the pool's answer, a failed system call).
    pub errno: Option<i32>,
    /// Its name, e.g. `EBUSY` (null with `errno`).
    pub code: Option<String>,
    /// What went wrong, with every cause.
    pub message: String,
}

/// The object a failed command prints under `--json`.
#[derive(Debug, Serialize, Deserialize)]
pub struct ErrorAnswer {
    /// The error.
    pub error: ErrorRecord,
}

impl ErrorRecord {
    /// The record of a failed command: kind and errno from the first typed cause in the
    /// chain (the pool's answer [`OpError`], an engine error, an I/O error), else a refusal
    /// without errno (the command's own check failed); the message is the whole chain.
    pub fn from_error(error: &anyhow::Error) -> Self {
        let message = format!("{error:#}");
        let typed = error.chain().find_map(|cause| {
            if let Some(refusal) = cause.downcast_ref::<OpError>() {
                return Some((refusal.kind, refusal.errno));
            }
            if let Some(engine) = cause.downcast_ref::<thin_pool::Error>() {
                return Some((engine.kind().into(), engine.errno()));
            }
            cause
                .downcast_ref::<std::io::Error>()
                .and_then(std::io::Error::raw_os_error)
                .map(|errno| (ErrorKind::Io, errno))
        });
        match typed {
            Some((kind, errno)) => ErrorRecord {
                kind,
                errno: Some(errno),
                code: Some(crate::control::errno_name(errno).to_string()),
                message,
            },
            None => ErrorRecord {
                kind: ErrorKind::Refused,
                errno: None,
                code: None,
                message,
            },
        }
    }

    /// A command line that does not parse (EINVAL, as a refused argument).
    pub fn usage(message: impl Into<String>) -> Self {
        ErrorRecord {
            kind: ErrorKind::Usage,
            errno: Some(libc::EINVAL),
            code: Some("EINVAL".to_string()),
            message: message.into(),
        }
    }
}

/// What `list --json` prints: the volumes, and where the catalog and the metadata disagree.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ListRecord {
    /// The volumes, in name order (thin id order with `--ids`).
    pub volumes: Vec<VolumeRecord>,
    /// Thin ids the catalog does not know (`volume adopt`).
    pub unadopted: Vec<UnadoptedRecord>,
    /// Catalog entries whose thin id is gone (`volume forget`).
    pub orphaned: Vec<OrphanedRecord>,
}

/// What `trim --json` prints (the control socket's `trimmed_bytes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrimRecord {
    /// Bytes of free data blocks given back to the host.
    pub trimmed_bytes: u64,
}

/// What `receive --list-partial --json` prints (the control socket's `partial_receives`),
/// and `receive --abort NAME --json` (the one dropped, as it was).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartialReceivesRecord {
    /// The partial receives, with their resume tokens.
    pub partial_receives: Vec<PartialRecord>,
}

/// What `volume forget --json` prints (the control socket's `forgotten`): the catalog entry
/// dropped.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForgottenRecord {
    /// The entry.
    pub forgotten: OrphanedRecord,
}

/// What `check --json` prints: the verdict, the superblock's figures, and every problem.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckRecord {
    /// The check passes (the exit status is 0).
    pub passed: bool,
    /// The superblock's transaction id; null when the superblock could not be read.
    pub transaction_id: Option<u64>,
    /// Free metadata blocks (thin_check's METADATA_FREE_BLOCKS); null likewise.
    pub metadata_free_blocks: Option<u64>,
    /// Metadata blocks the metadata space map manages.
    pub metadata_total_blocks: u64,
    /// Data blocks the data space map manages.
    pub data_total_blocks: u64,
    /// Free data blocks.
    pub data_free_blocks: u64,
    /// Volumes in the details tree.
    pub volume_count: u64,
    /// The superblock's needs_check flag (after the check: cleared with
    /// `--clear-needs-check-flag`).
    pub needs_check: bool,
    /// Block of a held metadata snapshot; null when none is held.
    pub metadata_snap_block: Option<u64>,
    /// Fatal problems found.
    pub fatal_count: u64,
    /// Non-fatal problems found (e.g. leaks).
    pub non_fatal_count: u64,
    /// Warnings (only thinpool's stricter rules object).
    pub warning_count: u64,
    /// Metadata blocks leaked.
    pub metadata_leaked_blocks: u64,
    /// Data blocks leaked.
    pub data_leaked_blocks: u64,
    /// Leaks freed in place (`--auto-repair`, `--clear-needs-check-flag`).
    pub leaks_repaired: bool,
    /// The problems, in the order found (at most thin_pool's limit; the rest counted in
    /// `problems_omitted_count`).
    pub problems: Vec<CheckProblemRecord>,
    /// Problems found beyond those listed.
    pub problems_omitted_count: u64,
}

/// One problem of a check.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckProblemRecord {
    /// `fatal`, `non_fatal` or `warning`.
    pub severity: String,
    /// The metadata block involved; null if none.
    pub block: Option<u64>,
    /// The data block involved; null if none.
    pub data_block: Option<u64>,
    /// The thin id whose tree holds the block; null if none.
    pub volume_id: Option<u64>,
    /// The problem as the text form prints it.
    pub message: String,
}

impl CheckRecord {
    /// The record of `report`; `readable` says whether the superblock could be read.
    pub fn new(
        report: &thin_pool::format::check::Report,
        passed: bool,
        readable: bool,
        leaks_repaired: bool,
    ) -> Self {
        use thin_pool::format::check::Severity;
        let summary = &report.summary;
        let problems = report
            .problems
            .iter()
            .map(|problem| CheckProblemRecord {
                severity: match problem.severity {
                    Severity::Fatal => "fatal",
                    Severity::NonFatal => "non_fatal",
                    Severity::Warning => "warning",
                }
                .to_string(),
                block: problem.block,
                data_block: problem.data_block,
                volume_id: problem.volume.map(|id| u64::from(id.get())),
                message: problem.to_string(),
            })
            .collect();
        CheckRecord {
            passed,
            transaction_id: readable.then_some(summary.transaction_id),
            metadata_free_blocks: readable.then_some(summary.metadata_free_blocks),
            metadata_total_blocks: summary.metadata_block_count,
            data_total_blocks: summary.data_block_count,
            data_free_blocks: summary.data_free_blocks,
            volume_count: summary.volume_count,
            needs_check: summary.flags & 1 != 0,
            metadata_snap_block: summary.metadata_snap,
            fatal_count: report.fatal_count,
            non_fatal_count: report.non_fatal_count,
            warning_count: report.warning_count,
            metadata_leaked_blocks: summary.metadata_leaked_blocks,
            data_leaked_blocks: summary.data_leaked_blocks,
            leaks_repaired,
            problems,
            problems_omitted_count: report.problems_omitted,
        }
    }
}

/// What `metadata-size --json` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetadataSizeRecord {
    /// The metadata size the pool needs.
    pub metadata_size_bytes: u64,
    /// The same in 512-byte sectors.
    pub metadata_size_sectors: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn the_version_field_comes_first_and_the_fields_follow() {
        let text = serde_json::to_string(&versioned(&TrimRecord { trimmed_bytes: 7 })).unwrap();
        assert_eq!(text, r#"{"thinpool_json":1,"trimmed_bytes":7}"#);
    }

    #[test]
    fn an_error_takes_the_kind_and_errno_of_its_first_typed_cause() {
        let refusal = OpError::new(libc::EBUSY, "volume \"x\" is open");
        let error = Err::<(), _>(refusal)
            .context("cannot delete volume \"x\"")
            .unwrap_err();
        let record = ErrorRecord::from_error(&error);
        assert_eq!(record.kind, ErrorKind::Refused);
        assert_eq!(record.errno, Some(libc::EBUSY));
        assert_eq!(record.code.as_deref(), Some("EBUSY"));
        assert!(record.message.starts_with("cannot delete volume \"x\": "));

        let io = std::io::Error::from_raw_os_error(libc::EACCES);
        let error = Err::<(), _>(io).context("cannot open x").unwrap_err();
        let record = ErrorRecord::from_error(&error);
        assert_eq!(
            (record.kind, record.errno),
            (ErrorKind::Io, Some(libc::EACCES))
        );

        let record = ErrorRecord::from_error(&anyhow::anyhow!("no such thing"));
        assert_eq!(
            (record.kind, record.errno, record.code),
            (ErrorKind::Refused, None, None)
        );
    }
}
