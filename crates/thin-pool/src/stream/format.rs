//! The stream format (docs/send-stream.md): a header, records of data extents and holes,
//! a trailer. Little-endian; every part carries a CRC-32C (Castagnoli), and the trailer the
//! CRC-32C of every byte before its own checksum, so a flipped byte anywhere is caught.
//!
//! ```text
//! header   "THINSEND" version:u32 flags:u32 block_size:u64 size:u64 stream_id:[16]
//!          base_id:[16] name_len:u32 name [resume_offset:u64 if flag 2]
//!          crc:u32                                        (crc of the header's bytes)
//! record   kind:u32 offset:u64 length:u64 [payload: length bytes if data] crc:u32
//!          kind 1 = data, 2 = hole (no payload: a hole is a length, never zeros)
//! trailer  kind:u32 = 3  records:u64 payload_bytes:u64  crc:u32 (of the whole stream)
//! ```

use crate::error::{Error, Result};
use std::io::{ErrorKind, Read, Write};

/// The first bytes of every stream.
pub const MAGIC: [u8; 8] = *b"THINSEND";
/// The format version this build writes and reads.
pub const VERSION: u32 = 1;
/// Longest data record (longer extents are sent as several records).
pub const DATA_RECORD_MAX: u64 = 1 << 20;
/// Longest volume name in a header.
const NAME_BYTES_MAX: u32 = 4096;

const FLAG_INCREMENTAL: u32 = 1;
/// A resumed stream (`send --resume`): its records start at the header's resume offset.
const FLAG_RESUMED: u32 = 2;
const KIND_DATA: u32 = 1;
const KIND_HOLE: u32 = 2;
const KIND_TRAILER: u32 = 3;

/// What a stream says about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// The sender pool's data block size.
    pub block_size_bytes: u64,
    /// The volume's size.
    pub size_bytes: u64,
    /// The sent snapshot's content id (the received volume gets it).
    pub stream_id: uuid::Uuid,
    /// For an incremental: the base's content id.
    pub base_id: Option<uuid::Uuid>,
    /// The sent snapshot's name.
    pub name: String,
}

/// One record of a stream, as read.
#[derive(Debug, PartialEq, Eq)]
pub enum Item {
    /// Bytes `offset..` are the data read into the caller's buffer (its whole length).
    Data {
        /// First byte.
        offset: u64,
    },
    /// Bytes `offset..offset + length` are unmapped.
    Hole {
        /// First byte.
        offset: u64,
        /// Bytes.
        length: u64,
    },
    /// The trailer, checked, and nothing after it.
    End {
        /// Records before the trailer.
        records: u64,
    },
}

fn bad(why: impl Into<String>) -> Error {
    Error::BadStream(why.into())
}

/// Writes a stream to `W`, keeping the running checksum.
pub struct StreamWriter<W: Write> {
    inner: W,
    crc: u32,
    records: u64,
    payload_bytes: u64,
}

impl<W: Write> StreamWriter<W> {
    /// Write `header` and return the writer for the records.
    pub fn new(inner: W, header: &Header) -> Result<StreamWriter<W>> {
        Self::start(inner, header, None)
    }

    /// Write the header of a resumed stream, whose records start at byte `offset` of the
    /// volume (what the receiver kept of the stream `header` names), and return the writer.
    pub fn new_resumed(inner: W, header: &Header, offset: u64) -> Result<StreamWriter<W>> {
        Self::start(inner, header, Some(offset))
    }

    fn start(inner: W, header: &Header, resume: Option<u64>) -> Result<StreamWriter<W>> {
        let name = header.name.as_bytes();
        let mut bytes = Vec::with_capacity(80 + name.len());
        bytes.extend_from_slice(&MAGIC);
        bytes.extend_from_slice(&VERSION.to_le_bytes());
        let mut flags = if header.base_id.is_some() {
            FLAG_INCREMENTAL
        } else {
            0
        };
        if resume.is_some() {
            flags |= FLAG_RESUMED;
        }
        bytes.extend_from_slice(&flags.to_le_bytes());
        bytes.extend_from_slice(&header.block_size_bytes.to_le_bytes());
        bytes.extend_from_slice(&header.size_bytes.to_le_bytes());
        bytes.extend_from_slice(header.stream_id.as_bytes());
        bytes.extend_from_slice(header.base_id.unwrap_or_default().as_bytes());
        bytes.extend_from_slice(&(name.len() as u32).to_le_bytes());
        bytes.extend_from_slice(name);
        if let Some(offset) = resume {
            bytes.extend_from_slice(&offset.to_le_bytes());
        }
        let crc = crc32c::crc32c(&bytes);
        bytes.extend_from_slice(&crc.to_le_bytes());
        let mut writer = StreamWriter {
            inner,
            crc: 0,
            records: 0,
            payload_bytes: 0,
        };
        writer.put(&bytes)?;
        Ok(writer)
    }

    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.crc = crc32c::crc32c_append(self.crc, bytes);
        self.inner.write_all(bytes).map_err(|source| Error::Io {
            what: "writing the stream".to_string(),
            source,
        })
    }

    fn record(&mut self, kind: u32, offset: u64, length: u64, payload: &[u8]) -> Result<()> {
        let mut head = [0u8; 20];
        head[..4].copy_from_slice(&kind.to_le_bytes());
        head[4..12].copy_from_slice(&offset.to_le_bytes());
        head[12..].copy_from_slice(&length.to_le_bytes());
        let crc = crc32c::crc32c_append(crc32c::crc32c(&head), payload);
        self.put(&head)?;
        self.put(payload)?;
        self.put(&crc.to_le_bytes())?;
        self.records += 1;
        self.payload_bytes += payload.len() as u64;
        Ok(())
    }

    /// Bytes `offset..offset + data.len()` are `data` (split into records of at most
    /// [`DATA_RECORD_MAX`]).
    pub fn data(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        for (i, chunk) in data.chunks(DATA_RECORD_MAX as usize).enumerate() {
            let at = offset + i as u64 * DATA_RECORD_MAX;
            self.record(KIND_DATA, at, chunk.len() as u64, chunk)?;
        }
        Ok(())
    }

    /// Bytes `offset..offset + length` are a hole.
    pub fn hole(&mut self, offset: u64, length: u64) -> Result<()> {
        self.record(KIND_HOLE, offset, length, &[])
    }

    /// Records written so far.
    pub fn records(&self) -> u64 {
        self.records
    }

    /// Write the trailer, flush, and return the inner writer.
    pub fn finish(mut self) -> Result<W> {
        let mut trailer = [0u8; 20];
        trailer[..4].copy_from_slice(&KIND_TRAILER.to_le_bytes());
        trailer[4..12].copy_from_slice(&self.records.to_le_bytes());
        trailer[12..].copy_from_slice(&self.payload_bytes.to_le_bytes());
        self.put(&trailer)?;
        let crc = self.crc;
        self.put(&crc.to_le_bytes())?;
        self.inner.flush().map_err(|source| Error::Io {
            what: "flushing the stream".to_string(),
            source,
        })?;
        Ok(self.inner)
    }
}

/// Reads and checks a stream from `R`.
pub struct StreamReader<R: Read> {
    inner: R,
    crc: u32,
    records: u64,
    payload_bytes: u64,
    /// Bytes read so far (for error messages).
    position: u64,
    ended: bool,
    resume_offset: Option<u64>,
}

impl<R: Read> StreamReader<R> {
    /// Read and check the header.
    pub fn open(inner: R) -> Result<(StreamReader<R>, Header)> {
        let mut reader = StreamReader {
            inner,
            crc: 0,
            records: 0,
            payload_bytes: 0,
            position: 0,
            ended: false,
            resume_offset: None,
        };
        let mut fixed = [0u8; 8 + 4 + 4 + 8 + 8 + 16 + 16 + 4];
        reader.take(&mut fixed, "the header")?;
        if fixed[..8] != MAGIC {
            return Err(bad("not a thinpool send stream (bad magic)"));
        }
        let version = u32_at(&fixed, 8);
        if version != VERSION {
            return Err(bad(format!(
                "stream format version {version}, this thinpool reads version {VERSION} only"
            )));
        }
        let flags = u32_at(&fixed, 12);
        let name_len = u32_at(&fixed, 64);
        if flags & !(FLAG_INCREMENTAL | FLAG_RESUMED) != 0 || name_len > NAME_BYTES_MAX {
            return Err(bad("the stream's header is damaged (flags or name length)"));
        }
        let mut name = vec![0u8; name_len as usize];
        reader.take(&mut name, "the header")?;
        let mut resume = [0u8; 8];
        let resume = match flags & FLAG_RESUMED {
            0 => &resume[..0],
            _ => {
                reader.take(&mut resume, "the header")?;
                reader.resume_offset = Some(u64::from_le_bytes(resume));
                &resume[..]
            }
        };
        let computed = reader.crc;
        let crc = reader.take_u32("the header")?;
        let expected = crc32c::crc32c_append(crc32c::crc32c(&fixed), &name);
        if crc32c::crc32c_append(expected, resume) != crc || computed != crc {
            return Err(bad("the stream's header checksum does not match"));
        }
        let id = |at: usize| uuid::Uuid::from_slice(&fixed[at..at + 16]).expect("16 bytes");
        let header = Header {
            block_size_bytes: u64_at(&fixed, 16),
            size_bytes: u64_at(&fixed, 24),
            stream_id: id(32),
            base_id: (flags & FLAG_INCREMENTAL != 0).then(|| id(48)),
            name: String::from_utf8(name).map_err(|_| bad("the stream's name is not UTF-8"))?,
        };
        Ok((reader, header))
    }

    fn take(&mut self, buf: &mut [u8], what: &str) -> Result<()> {
        self.inner.read_exact(buf).map_err(|e| match e.kind() {
            ErrorKind::UnexpectedEof => bad(format!(
                "the stream is cut off in {what} (after {} bytes, {} records)",
                self.position, self.records
            )),
            _ => Error::Io {
                what: "reading the stream".to_string(),
                source: e,
            },
        })?;
        self.crc = crc32c::crc32c_append(self.crc, buf);
        self.position += buf.len() as u64;
        Ok(())
    }

    fn take_u32(&mut self, what: &str) -> Result<u32> {
        let mut b = [0u8; 4];
        self.take(&mut b, what)?;
        Ok(u32::from_le_bytes(b))
    }

    /// The next record; a data record's payload is read into `data` (resized to it).
    /// After [`Item::End`] nothing more may be read.
    pub fn next(&mut self, data: &mut Vec<u8>) -> Result<Item> {
        assert!(!self.ended, "nothing is read after the trailer");
        let mut head = [0u8; 20];
        self.take(&mut head, "a record")?;
        let (kind, offset, length) = (u32_at(&head, 0), u64_at(&head, 4), u64_at(&head, 12));
        match kind {
            KIND_DATA if length > 0 && length <= DATA_RECORD_MAX => {
                data.resize(length as usize, 0);
                self.take(data, "a data record")?;
            }
            KIND_DATA => return Err(bad(format!("a data record of {length} bytes"))),
            KIND_HOLE => data.clear(),
            KIND_TRAILER => return self.trailer(offset, length),
            other => return Err(bad(format!("unknown record kind {other:#x}"))),
        }
        let crc = self.take_u32("a record")?;
        if crc32c::crc32c_append(crc32c::crc32c(&head), data) != crc {
            return Err(bad(format!(
                "record {} (at byte {offset} of the volume) fails its checksum",
                self.records
            )));
        }
        self.records += 1;
        self.payload_bytes += data.len() as u64;
        Ok(match kind {
            KIND_DATA => Item::Data { offset },
            _ => Item::Hole { offset, length },
        })
    }

    fn trailer(&mut self, records: u64, payload_bytes: u64) -> Result<Item> {
        let computed = self.crc;
        let crc = self.take_u32("the trailer")?;
        if crc != computed {
            return Err(bad(
                "the stream's checksum does not match (a damaged stream)",
            ));
        }
        if records != self.records || payload_bytes != self.payload_bytes {
            return Err(bad(format!(
                "the trailer counts {records} records and {payload_bytes} bytes, the stream \
                 had {} and {}",
                self.records, self.payload_bytes
            )));
        }
        let mut extra = [0u8; 1];
        loop {
            match self.inner.read(&mut extra) {
                Ok(0) => break,
                Ok(_) => return Err(bad("bytes follow the stream's trailer")),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(Error::Io {
                        what: "reading the stream".to_string(),
                        source,
                    })
                }
            }
        }
        self.ended = true;
        Ok(Item::End { records })
    }

    /// For a resumed stream: the byte of the volume its records start at.
    pub fn resume_offset(&self) -> Option<u64> {
        self.resume_offset
    }

    /// Bytes read so far.
    pub fn position(&self) -> u64 {
        self.position
    }
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}
