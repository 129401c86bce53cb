//! Send and receive streams through the control socket, and the one entry point the `send`
//! and `receive` commands use ([`send`], [`receive`]): the pool opened directly when no
//! server holds it, its control socket otherwise (so a served pool sends while its clients
//! write, and receives while it serves).
//!
//! A stream request has its own connection:
//!
//! ```text
//!   -> {"op":"send_stream","snapshot":"s2","base":"s1"}
//!   <- {"ok":true}                       then the stream's bytes; the server closes the
//!                                        connection at its end (a send failing midway cuts
//!                                        the stream: the receiver refuses it, no trailer)
//!   -> {"op":"receive_stream","name":"s2"}   then the stream's bytes, then a write shutdown
//!   <- {"ok":true,"volume":{...}}        once the stream was read, checked and applied
//! ```
//!
//! `"resume":TOKEN` on a send writes only the rest a resumable receive did not keep;
//! `"resumable":true` on a receive keeps what was verified if the stream breaks (the
//! refusal's message carries the resume token). `partial_receives` and `abort_receive`
//! (ordinary requests) list and drop what such receives kept.
//!
//! Each read or write of the stream may wait [`STREAM_IO_TIMEOUT`] (a slow pipe, ssh).

use std::io::{BufReader, BufWriter, Cursor, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use thin_pool::stream::{self, ReceiveOptions, ResumeToken, Summary};
use thin_pool::Pool;

use super::protocol::{read_line, Line, Response};
use super::server::RequestReader;
use super::{OpError, Outcome, Request, Target, VolumeRecord, RESPONSE_BYTES_MAX};
use crate::pool_dir::{PoolDir, StoredOptions};

/// Longest wait for one read or write of a stream.
pub const STREAM_IO_TIMEOUT: Duration = Duration::from_secs(600);

/// Buffer between the stream and the socket or file: smaller than a data record, whose
/// payload then goes between the pipe and the record's buffer without a copy through it.
const BUFFER_BYTES: usize = 256 << 10;

/// What [`widen_pipe`] asks for (Linux's default `pipe-max-size`).
const PIPE_BYTES: usize = 1 << 20;

/// If `fd` is a pipe, let it hold `PIPE_BYTES` (fewer, larger reads and writes of the
/// stream: a pipe holds 64 KiB by default). Best effort: anything else is left as it is.
pub fn widen_pipe(fd: impl std::os::fd::AsFd) {
    let is_pipe = rustix::fs::fstat(&fd)
        .is_ok_and(|stat| rustix::fs::FileType::from_raw_mode(stat.st_mode).is_fifo());
    if is_pipe {
        let _ = rustix::pipe::fcntl_setpipe_size(&fd, PIPE_BYTES);
    }
}

/// Whether `request` is carried out by [`serve`].
pub(super) fn is_stream(request: &Request) -> bool {
    matches!(
        request,
        Request::SendStream { .. } | Request::ReceiveStream { .. }
    )
}

/// Carry out a stream request on the server's side; the connection ends with it.
pub(super) fn serve(
    request: &Request,
    reader: RequestReader,
    mut writer: UnixStream,
    target: &Target,
) {
    let timeouts = writer
        .set_write_timeout(Some(STREAM_IO_TIMEOUT))
        .and_then(|()| reader.stream.set_read_timeout(Some(STREAM_IO_TIMEOUT)));
    if timeouts.is_err() {
        return;
    }
    match request {
        Request::SendStream {
            snapshot,
            base,
            resume,
        } => {
            let token = match resume.as_deref().map(str::parse::<ResumeToken>).transpose() {
                Ok(token) => token,
                Err(error) => {
                    let _ = answer(&mut writer, Err(error.into()));
                    return;
                }
            };
            if answer(&mut writer, Ok(Outcome::Done)).is_err() {
                return;
            }
            let out = BufWriter::with_capacity(BUFFER_BYTES, &mut writer);
            if let Err(error) = send_to(&target.pool, snapshot, base.as_deref(), token, out) {
                tracing::warn!(snapshot = %snapshot, %error, "send cut off");
            }
        }
        Request::ReceiveStream {
            name,
            resumable,
            checkpoint_bytes,
        } => {
            let RequestReader { stream, buffer } = reader;
            let input = Cursor::new(buffer).chain(BufReader::with_capacity(BUFFER_BYTES, stream));
            let result = target
                .refuse_if_read_only()
                .and_then(|()| target.check_name_free(name))
                .and_then(|()| {
                    let options = resumable.then(|| ReceiveOptions {
                        checkpoint_bytes: checkpoint_bytes
                            .unwrap_or(ReceiveOptions::default().checkpoint_bytes),
                    });
                    let (info, _) =
                        receive_from(&target.pool, name, options.as_ref(), input, &mut |_| {})?;
                    Ok(Outcome::Volume(received(&target.pool, &info)))
                });
            super::log::management(request, &result);
            let _ = answer(&mut writer, result);
        }
        _ => unreachable!("is_stream chose the request"),
    }
}

/// [`stream::send`], or with `token` [`stream::send_resumed`].
fn send_to<W: Write>(
    pool: &Pool,
    snapshot: &str,
    base: Option<&str>,
    token: Option<ResumeToken>,
    out: W,
) -> thin_pool::Result<Summary> {
    match token {
        Some(token) => stream::send_resumed(pool, snapshot, base, &token, out, &mut |_| {}),
        None => stream::send(pool, snapshot, base, out, &mut |_| {}),
    }
}

/// [`stream::receive`], or resumable [`stream::receive_resumable`] (whose refusal names
/// the resume token of what was kept).
fn receive_from<R: Read>(
    pool: &Pool,
    name: &str,
    resumable: Option<&ReceiveOptions>,
    input: R,
    progress: &mut dyn FnMut(&Summary),
) -> Result<(thin_pool::VolumeInfo, Summary), OpError> {
    let Some(options) = resumable else {
        return Ok(stream::receive(pool, name, input, progress)?);
    };
    stream::receive_resumable(pool, name, input, options, progress).map_err(|interrupted| {
        let mut error = OpError::from(*interrupted.error);
        if let Some(token) = interrupted.token {
            error.message = format!("{} (kept: resume token {token})", error.message);
        }
        error
    })
}

/// A partial receive, as `partial_receives` answers it (and `abort_receive`, the one it
/// dropped, as it was).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartialRecord {
    /// The volume it will become.
    pub name: String,
    /// The volume's size.
    pub size_bytes: u64,
    /// Bytes of the volume received and kept (from its start).
    pub received_bytes: u64,
    /// Data blocks it holds (freed by `abort_receive`).
    pub held_blocks: u64,
    /// The stream's id.
    pub stream_id: String,
    /// For an incremental: the base's content id.
    pub base_id: Option<String>,
    /// What `send --resume` takes.
    pub token: String,
}

/// `partial_receives` (the list) or `abort_receive` on `pool` (answered with the list of
/// the one it dropped, as it was, as `delete_volume` answers with the volume).
pub(super) fn partial(pool: &Pool, request: &Request) -> Result<Outcome, OpError> {
    let partial = match request {
        Request::AbortReceive { name } => vec![pool.abort_receive(name)?],
        _ => pool.partial_receives(),
    };
    let records = partial
        .iter()
        .map(partial_record)
        .collect::<Result<_, _>>()?;
    Ok(Outcome::Partial(records))
}

/// A partial receive as the control socket reports it.
fn partial_record(p: &thin_pool::catalog::PartialReceive) -> Result<PartialRecord, OpError> {
    Ok(PartialRecord {
        name: p.name.clone(),
        size_bytes: p.size_bytes,
        received_bytes: p.offset,
        held_blocks: p.blocks,
        stream_id: p.content_id.clone(),
        base_id: p.base_content_id.clone(),
        token: ResumeToken::of(p)?.to_string(),
    })
}

fn answer(writer: &mut UnixStream, result: Result<Outcome, OpError>) -> std::io::Result<()> {
    let response: Response = result.into();
    let mut line = serde_json::to_vec(&response).map_err(std::io::Error::other)?;
    line.push(b'\n');
    writer.write_all(&line)
}

/// The pool in `dir` opened directly, or None when a server holds it.
fn open_direct(dir: &PoolDir) -> anyhow::Result<Option<Pool>> {
    dir.require_pool()?;
    let options = StoredOptions::load(dir)?;
    match Pool::open(&dir.path, options.pool_options()) {
        Ok(pool) => Ok(Some(pool)),
        Err(thin_pool::Error::Locked { .. }) => Ok(None),
        Err(error) => {
            Err(error).with_context(|| format!("cannot open the pool in {}", dir.path.display()))
        }
    }
}

fn connect(dir: &PoolDir, request: &Request) -> anyhow::Result<UnixStream> {
    let socket = dir.control_socket();
    let mut stream = UnixStream::connect(&socket).with_context(|| {
        format!(
            "the pool in {} is held by another process, and its control socket {} does not answer",
            dir.path.display(),
            socket.display()
        )
    })?;
    stream.set_read_timeout(Some(STREAM_IO_TIMEOUT))?;
    stream.set_write_timeout(Some(STREAM_IO_TIMEOUT))?;
    let mut line = serde_json::to_vec(request).context("cannot encode the request")?;
    line.push(b'\n');
    stream.write_all(&line).context("cannot send the request")?;
    Ok(stream)
}

fn read_answer(reader: &mut impl std::io::BufRead) -> anyhow::Result<Outcome> {
    let answer = match read_line(reader, RESPONSE_BYTES_MAX).context("cannot read the answer")? {
        Line::Complete(answer) => answer,
        Line::End => bail!("the server closed the control connection without answering"),
        Line::TooLong => bail!("the answer is longer than {RESPONSE_BYTES_MAX} bytes"),
    };
    let response: Response =
        serde_json::from_slice(&answer).context("the answer is not valid JSON")?;
    Ok(response.into_result()??)
}

/// Write `snapshot` (with `base`, the increment) of the pool in `dir` to `out`. Through the
/// server the stream is copied as it comes; `progress` gets the bytes so far.
pub fn send(
    dir: &PoolDir,
    snapshot: &str,
    base: Option<&str>,
    out: &mut dyn Write,
    progress: &mut dyn FnMut(u64),
) -> anyhow::Result<u64> {
    send_resumed(dir, snapshot, base, None, out, progress)
}

/// [`send`], with `resume` (a resume token) only the rest a resumable receive did not keep.
pub fn send_resumed(
    dir: &PoolDir,
    snapshot: &str,
    base: Option<&str>,
    resume: Option<&str>,
    out: &mut dyn Write,
    progress: &mut dyn FnMut(u64),
) -> anyhow::Result<u64> {
    let token = resume.map(str::parse::<ResumeToken>).transpose()?;
    if let Some(pool) = open_direct(dir)? {
        let mut counted = Counted {
            inner: out,
            bytes: 0,
        };
        let mut out = BufWriter::with_capacity(BUFFER_BYTES, &mut counted);
        let summary = send_to(&pool, snapshot, base, token, &mut out);
        drop(out);
        pool.close().context("cannot close the pool")?;
        summary?;
        return Ok(counted.bytes);
    }
    let request = Request::SendStream {
        snapshot: snapshot.to_string(),
        base: base.map(str::to_string),
        resume: resume.map(str::to_string),
    };
    let mut reader = BufReader::with_capacity(BUFFER_BYTES, connect(dir, &request)?);
    read_answer(&mut reader)?;
    let mut bytes = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = reader
            .read(&mut buf)
            .context("reading the stream from the server")?;
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n]).context("writing the stream")?;
        bytes += n as u64;
        progress(bytes);
    }
    out.flush().context("writing the stream")?;
    Ok(bytes)
}

/// Receive the stream `input` as volume `name` of the pool in `dir`.
pub fn receive(
    dir: &PoolDir,
    name: &str,
    input: &mut dyn Read,
    progress: &mut dyn FnMut(u64),
) -> anyhow::Result<VolumeRecord> {
    receive_resumable(dir, name, None, input, progress)
}

/// [`receive`]; `resumable`: what was verified is kept (at its checkpoints, and when the
/// stream breaks), and the error names its resume token (`thinpool send --resume`).
pub fn receive_resumable(
    dir: &PoolDir,
    name: &str,
    resumable: Option<&ReceiveOptions>,
    input: &mut dyn Read,
    progress: &mut dyn FnMut(u64),
) -> anyhow::Result<VolumeRecord> {
    crate::restored::name_restored_volumes(&dir.path)?;
    if let Some(pool) = open_direct(dir)? {
        let input = BufReader::with_capacity(BUFFER_BYTES, input);
        let result = receive_from(&pool, name, resumable, input, &mut |s: &Summary| {
            progress(s.data_bytes)
        });
        let record = result.map(|(info, _)| received(&pool, &info));
        pool.close().context("cannot close the pool")?;
        return Ok(record?);
    }
    let request = Request::ReceiveStream {
        name: name.to_string(),
        resumable: resumable.is_some(),
        checkpoint_bytes: resumable.map(|options| options.checkpoint_bytes),
    };
    let mut socket = connect(dir, &request)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = input.read(&mut buf).context("reading the stream")?;
        if n == 0 {
            break;
        }
        if socket.write_all(&buf[..n]).is_err() {
            // The server refused the stream early: its answer says why.
            break;
        }
        bytes += n as u64;
        progress(bytes);
    }
    let _ = socket.shutdown(std::net::Shutdown::Write);
    match read_answer(&mut BufReader::new(socket))? {
        Outcome::Volume(volume) => Ok(volume),
        other => bail!("unexpected answer: {other:?}"),
    }
}

/// The answer to a receive: the new volume, with the content id it took from the stream.
fn received(pool: &Pool, info: &thin_pool::VolumeInfo) -> VolumeRecord {
    let mut record = VolumeRecord::from(info);
    record.content_id = pool.content_id(&info.name).ok().flatten();
    record
}

/// A writer that counts what passes.
struct Counted<'a> {
    inner: &'a mut dyn Write,
    bytes: u64,
}

impl Write for Counted<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}
