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
//! Each read or write of the stream may wait [`STREAM_IO_TIMEOUT`] (a slow pipe, ssh).

use std::io::{BufReader, BufWriter, Cursor, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use anyhow::{bail, Context};
use thin_pool::stream::{self, Summary};
use thin_pool::Pool;

use super::protocol::{read_line, Line, Response};
use super::server::RequestReader;
use super::{OpError, Outcome, Request, Target, VolumeRecord, RESPONSE_BYTES_MAX};
use crate::pool_dir::{PoolDir, StoredOptions};

/// Longest wait for one read or write of a stream.
pub const STREAM_IO_TIMEOUT: Duration = Duration::from_secs(600);

/// Buffer between the stream and the socket or file.
const BUFFER_BYTES: usize = 4 << 20;

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
        Request::SendStream { snapshot, base } => {
            if answer(&mut writer, Ok(Outcome::Done)).is_err() {
                return;
            }
            let out = BufWriter::with_capacity(BUFFER_BYTES, &mut writer);
            if let Err(error) =
                stream::send(&target.pool, snapshot, base.as_deref(), out, &mut |_| {})
            {
                tracing::warn!(snapshot = %snapshot, %error, "send cut off");
            }
        }
        Request::ReceiveStream { name } => {
            let RequestReader { stream, buffer } = reader;
            let input = Cursor::new(buffer).chain(BufReader::with_capacity(BUFFER_BYTES, stream));
            let result = target
                .refuse_if_read_only()
                .and_then(|()| target.check_name_free(name))
                .and_then(|()| {
                    let (info, _) = stream::receive(&target.pool, name, input, &mut |_| {})?;
                    Ok(Outcome::Volume(received(&target.pool, &info)))
                });
            super::log::management(request, &result);
            let _ = answer(&mut writer, result);
        }
        _ => unreachable!("is_stream chose the request"),
    }
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
    if let Some(pool) = open_direct(dir)? {
        let mut counted = Counted {
            inner: out,
            bytes: 0,
        };
        let mut out = BufWriter::with_capacity(BUFFER_BYTES, &mut counted);
        let summary = stream::send(&pool, snapshot, base, &mut out, &mut |s: &Summary| {
            progress(s.data_bytes)
        });
        drop(out);
        pool.close().context("cannot close the pool")?;
        summary?;
        return Ok(counted.bytes);
    }
    let request = Request::SendStream {
        snapshot: snapshot.to_string(),
        base: base.map(str::to_string),
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
    crate::restored::name_restored_volumes(&dir.path)?;
    if let Some(pool) = open_direct(dir)? {
        let input = BufReader::with_capacity(BUFFER_BYTES, input);
        let result = stream::receive(&pool, name, input, &mut |s: &Summary| {
            progress(s.data_bytes)
        });
        let record = result.map(|(info, _)| received(&pool, &info));
        pool.close().context("cannot close the pool")?;
        return Ok(record?);
    }
    let request = Request::ReceiveStream {
        name: name.to_string(),
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
