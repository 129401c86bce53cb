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

pub mod format;

use crate::engine::diff::DiffKind;
use crate::engine::options::VolumeInfo;
use crate::engine::pool::Pool;
use crate::engine::receive::ReceiveSpec;
use crate::error::{Error, Result};
use format::{Header, Item, StreamReader, StreamWriter, DATA_RECORD_MAX};
use std::io::{Read, Write};

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
    let volume = pool.volume(snapshot)?;
    let stream_id = content_uuid(&pool.assign_content_id(snapshot)?)?;
    let size = volume.size_bytes();
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
    let mut writer = StreamWriter::new(out, &header)?;
    let mut summary = Summary::default();
    let extents = match base_volume {
        Some(_) => changed_extents(pool, base.expect("a base"), snapshot, size)?,
        None => mapped_extents(&volume, size)?,
    };
    let mut buf = vec![0u8; DATA_RECORD_MAX as usize];
    for (offset, length, mapped) in extents {
        if !mapped {
            writer.hole(offset, length)?;
            summary.records += 1;
            summary.hole_bytes += length;
            progress(&summary);
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
            progress(&summary);
        }
    }
    assert_eq!(writer.records(), summary.records);
    writer.finish()?;
    drop(base_volume);
    Ok(summary)
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
    let spec = ReceiveSpec {
        name: name.to_string(),
        size_bytes: header.size_bytes,
        base_content_id: header.base_id.map(|id| id.to_string()),
        content_id: header.stream_id.to_string(),
    };
    let mut receiver = pool.receive_volume(spec)?;
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
        progress(&summary);
    }
    receiver.finish()?;
    Ok((pool.info(name)?, summary))
}
