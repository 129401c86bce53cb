//! Send and receive streams: a read-only snapshot (or what changed in it since a base)
//! as a stream of data extents and holes, and a stream received as a new volume, on
//! another pool (of any block size) or machine. `thinpool send` / `thinpool receive`; the
//! format is `format` (docs/send-stream.md).
//!
//! **Send** ([`send`]): a full stream has every mapped extent of the snapshot as data and
//! every unmapped range as a hole (a length); an incremental one (`base`) only the
//! ranges `Pool::diff` finds (its walk skips what the two trees share, so its cost follows
//! the difference): data where the snapshot maps, holes where only the base did. It reads
//! the snapshot's data through a volume handle: a read-only snapshot never changes, so the
//! stream is exactly the snapshot while writers keep writing its origin, and the handle
//! keeps it from being deleted meanwhile. Both volumes must be read-only: their content ids
//! (given on first send, see `engine/receive.rs`) are what the stream names.
//!
//! **Receive** ([`receive`]): the header is checked, then each record (its checksum) is
//! fed to a `VolumeReceiver`, which writes into reserved blocks nothing maps; only after the
//! trailer has been checked (record count, checksum of the whole stream, nothing after it)
//! does `VolumeReceiver::finish` make the volume, in one transaction. Any error before that
//! drops the receiver: the pool is as it was.
//!
//! **Resumable** ([`receive_resumable`], [`send_resumed`]): a resumable receive commits
//! what it verified at checkpoints, and once more when the stream breaks, as a partial
//! receive (`engine/receive_partial.rs`: a hidden thin id, no volume); its
//! [`ResumeToken`] names the stream and the offset kept, and `send_resumed` writes a
//! stream of the rest (a header flagged resumed, records from that offset, its own
//! trailer), which the receive applies to the partial one and finishes.

pub mod format;
pub mod resume;

use crate::engine::diff::DiffKind;
use crate::engine::options::VolumeInfo;
use crate::engine::pool::Pool;
use crate::engine::receive::{ReceiveSpec, VolumeReceiver};
use crate::error::{Error, Result};
use format::{Header, Item, StreamReader, StreamWriter, DATA_RECORD_MAX};
use std::io::{Read, Write};

pub use resume::ResumeToken;

/// What a send or receive carried.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Records (data and holes).
    pub records: u64,
    /// Data bytes.
    pub data_bytes: u64,
    /// Bytes sent as holes.
    pub hole_bytes: u64,
}

/// Called after each record with the totals so far.
pub type Progress<'a> = &'a mut dyn FnMut(&Summary);

fn content_uuid(id: &str) -> Result<uuid::Uuid> {
    uuid::Uuid::parse_str(id)
        .map_err(|_| Error::Internal(format!("a content id {id:?} that is not a uuid")))
}

/// Write `snapshot` (with `base`: what changed since `base`) to `out` as a stream.
pub fn send<W: Write>(
    pool: &Pool,
    snapshot: &str,
    base: Option<&str>,
    out: W,
    progress: Progress<'_>,
) -> Result<Summary> {
    send_from(pool, snapshot, base, None, out, progress)
}

/// Write the rest of the stream `token` names (what a resumable receive did not keep):
/// `snapshot` (with `base`) must be the stream's, else refused before anything is written.
pub fn send_resumed<W: Write>(
    pool: &Pool,
    snapshot: &str,
    base: Option<&str>,
    token: &ResumeToken,
    out: W,
    progress: Progress<'_>,
) -> Result<Summary> {
    let id_of = |name: &str| -> Result<Option<uuid::Uuid>> {
        pool.content_id(name)?
            .as_deref()
            .map(content_uuid)
            .transpose()
    };
    if id_of(snapshot)? != Some(token.stream_id) {
        return Err(Error::BadStream(format!(
            "the resume token is of stream {}, which {snapshot:?} is not (a token of \
             another stream)",
            token.stream_id
        )));
    }
    let base_id = base.map(id_of).transpose()?.flatten();
    if base_id != token.base_id || base.is_some() != token.base_id.is_some() {
        return Err(Error::BadStream(match token.base_id {
            Some(id) => format!(
                "the resume token is of an incremental stream on base content {id}: give \
                 --base with that base"
            ),
            None => "the resume token is of a full stream: send it without --base".to_string(),
        }));
    }
    send_from(pool, snapshot, base, Some(token.offset), out, progress)
}

/// [`send`], or with `resume` the records from that byte on (a resumed stream).
fn send_from<W: Write>(
    pool: &Pool,
    snapshot: &str,
    base: Option<&str>,
    resume: Option<u64>,
    out: W,
    progress: Progress<'_>,
) -> Result<Summary> {
    let volume = pool.volume(snapshot)?;
    let stream_id = content_uuid(&pool.assign_content_id(snapshot)?)?;
    let size = volume.size_bytes();
    if resume.is_some_and(|offset| offset > size) {
        return Err(Error::BadStream(format!(
            "the resume token's offset is past the end of {snapshot:?} ({size} bytes)"
        )));
    }
    let (base_id, base_volume) = match base {
        Some(base) => {
            let handle = pool.volume(base)?;
            if handle.size_bytes() != size {
                return Err(Error::BadStream(format!(
                    "{base:?} is {} bytes and {snapshot:?} {size}: an incremental stream \
                     needs volumes of one size (send a full stream)",
                    handle.size_bytes()
                )));
            }
            (
                Some(content_uuid(&pool.assign_content_id(base)?)?),
                Some(handle),
            )
        }
        None => (None, None),
    };
    let header = Header {
        block_size_bytes: pool.block_size_bytes(),
        size_bytes: size,
        stream_id,
        base_id,
        name: snapshot.to_string(),
    };
    let mut writer = match resume {
        Some(offset) => StreamWriter::new_resumed(out, &header, offset)?,
        None => StreamWriter::new(out, &header)?,
    };
    let mut summary = Summary::default();
    let extents = match base_volume {
        Some(_) => changed_extents(pool, base.expect("a base"), snapshot, size)?,
        None => mapped_extents(&volume, size)?,
    };
    // A resumed stream: what starts before the offset is cut there.
    let from = resume.unwrap_or(0);
    let extents = extents.into_iter().filter_map(|(offset, length, mapped)| {
        let start = offset.max(from);
        (start < offset + length).then(|| (start, offset + length - start, mapped))
    });
    write_extents(&mut writer, &volume, extents, &mut summary, progress)?;
    assert_eq!(writer.records(), summary.records);
    writer.finish()?;
    drop(base_volume);
    Ok(summary)
}

/// Each extent as a hole, or as data records read from `volume`.
fn write_extents<W: Write>(
    writer: &mut StreamWriter<W>,
    volume: &crate::Volume,
    extents: impl Iterator<Item = (u64, u64, bool)>,
    summary: &mut Summary,
    progress: Progress<'_>,
) -> Result<()> {
    let mut buf = vec![0u8; DATA_RECORD_MAX as usize];
    for (offset, length, mapped) in extents {
        if !mapped {
            writer.hole(offset, length)?;
            summary.records += 1;
            summary.hole_bytes += length;
            progress(summary);
            continue;
        }
        let mut at = offset;
        while at < offset + length {
            let n = (offset + length - at).min(DATA_RECORD_MAX) as usize;
            volume.read(at, &mut buf[..n])?;
            writer.data(at, &buf[..n])?;
            summary.records += 1;
            summary.data_bytes += n as u64;
            at += n as u64;
            progress(summary);
        }
    }
    Ok(())
}

/// Every extent of the volume: (offset, length, mapped).
fn mapped_extents(volume: &crate::Volume, size: u64) -> Result<Vec<(u64, u64, bool)>> {
    let mut offset = 0;
    let mut extents = Vec::new();
    for extent in volume.block_status(0, size)? {
        extents.push((offset, extent.length_bytes, extent.mapped));
        offset += extent.length_bytes;
    }
    assert_eq!(offset, size, "block status covers the volume");
    Ok(extents)
}

/// The extents in which `snapshot` differs from `base` (the diff walk): data where the
/// snapshot maps, holes where only the base did.
fn changed_extents(
    pool: &Pool,
    base: &str,
    snapshot: &str,
    size: u64,
) -> Result<Vec<(u64, u64, bool)>> {
    let diff = pool.diff(base, snapshot, None)?;
    let block = diff.block_size_bytes;
    Ok(diff
        .ranges
        .iter()
        .filter_map(|range| {
            let offset = range.begin.get() * block;
            let end = (offset + range.length * block).min(size);
            (offset < end).then(|| (offset, end - offset, range.kind != DiffKind::BaseOnly))
        })
        .collect())
}

/// Read a stream from `input` and make it volume `name` (see the module doc). Nothing is
/// changed unless the whole stream was read and checked.
pub fn receive<R: Read>(
    pool: &Pool,
    name: &str,
    input: R,
    progress: Progress<'_>,
) -> Result<(VolumeInfo, Summary)> {
    let (mut reader, header) = StreamReader::open(input)?;
    if reader.resume_offset().is_some() {
        return Err(Error::BadStream(
            "a resumed stream (send --resume) is received with --resumable".to_string(),
        ));
    }
    let mut receiver = pool.receive_volume(spec_of(name, &header))?;
    let summary = receive_records(&mut reader, &mut receiver, &mut |_, _| Ok(()), progress)?;
    receiver.finish()?;
    Ok((pool.info(name)?, summary))
}

/// How a resumable receive keeps what it verified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReceiveOptions {
    /// Commit a checkpoint after this many data bytes (and when the stream breaks).
    pub checkpoint_bytes: u64,
}

impl Default for ReceiveOptions {
    fn default() -> ReceiveOptions {
        ReceiveOptions {
            checkpoint_bytes: 256 << 20,
        }
    }
}

/// A resumable receive that did not finish: why, and the token of what the pool keeps
/// (None: nothing kept, the pool is as it was).
#[derive(Debug)]
pub struct Interrupted {
    /// Why it stopped.
    pub error: Box<Error>,
    /// What `send --resume` takes.
    pub token: Option<ResumeToken>,
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.token {
            Some(token) => write!(f, "{} (kept: resume token {token})", self.error),
            None => write!(f, "{}", self.error),
        }
    }
}

impl std::error::Error for Interrupted {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.error)
    }
}

/// [`receive`], but what was verified is kept (checkpoints, and when the stream breaks)
/// as a partial receive of `name` that a resumed stream ([`send_resumed`]) continues; a
/// resumed stream is applied to it. Nothing is a volume until the final trailer.
pub fn receive_resumable<R: Read>(
    pool: &Pool,
    name: &str,
    input: R,
    options: &ReceiveOptions,
    progress: Progress<'_>,
) -> std::result::Result<(VolumeInfo, Summary), Interrupted> {
    let kept = |error: Error| Interrupted {
        token: pool
            .partial_receives()
            .iter()
            .find(|p| p.name == name)
            .and_then(|p| ResumeToken::of(p).ok()),
        error: Box::new(error),
    };
    let (mut reader, header) = StreamReader::open(input).map_err(kept)?;
    let spec = spec_of(name, &header);
    let receiver = match reader.resume_offset() {
        Some(offset) => pool.resume_receive(spec, offset),
        None => pool.receive_volume(spec),
    };
    let mut receiver = receiver.map_err(kept)?;
    let mut since = 0u64;
    let mut checkpoint = |receiver: &mut VolumeReceiver, summary: &Summary| {
        if summary.data_bytes - since >= options.checkpoint_bytes {
            receiver.checkpoint()?;
            since = summary.data_bytes;
        }
        Ok(())
    };
    match receive_records(&mut reader, &mut receiver, &mut checkpoint, progress) {
        Ok(summary) => {
            receiver.finish().map_err(kept)?;
            Ok((pool.info(name).map_err(kept)?, summary))
        }
        Err(error) => {
            if let Err(failed) = receiver.checkpoint() {
                tracing::warn!(volume = name, error = %failed, "keeping a partial receive failed");
            }
            drop(receiver);
            Err(kept(error))
        }
    }
}

fn spec_of(name: &str, header: &Header) -> ReceiveSpec {
    ReceiveSpec {
        name: name.to_string(),
        size_bytes: header.size_bytes,
        base_content_id: header.base_id.map(|id| id.to_string()),
        content_id: header.stream_id.to_string(),
    }
}

/// Feed every record to `receiver` up to the checked trailer; `after` runs after each.
fn receive_records<R: Read>(
    reader: &mut StreamReader<R>,
    receiver: &mut VolumeReceiver,
    after: &mut dyn FnMut(&mut VolumeReceiver, &Summary) -> Result<()>,
    progress: Progress<'_>,
) -> Result<Summary> {
    let mut summary = Summary::default();
    let mut data = Vec::with_capacity(DATA_RECORD_MAX as usize);
    loop {
        match reader.next(&mut data)? {
            Item::Data { offset } => {
                receiver.data(offset, &data)?;
                summary.data_bytes += data.len() as u64;
            }
            Item::Hole { offset, length } => {
                receiver.hole(offset, length)?;
                summary.hole_bytes += length;
            }
            Item::End { records } => {
                assert_eq!(records, summary.records);
                break;
            }
        }
        summary.records += 1;
        after(receiver, &summary)?;
        progress(&summary);
    }
    Ok(summary)
}
