//! The control socket: management of a pool that `thinpool serve` holds, as JSON lines on a
//! Unix socket (default `control.sock` in the pool directory, mode 0600), and the one entry
//! point the management commands use, [`perform`], which opens the pool directly when no
//! server holds it and asks the server otherwise, so both paths give the same answers.
//!
//! Protocol: the client sends one JSON object per line, the server answers each with one line
//! whose objects are those of the JSON contract (`crate::json`, docs/json.md): every answer
//! has `"thinpool_json":1` and `ok` (left out below), and an error has the contract's `kind`.
//!
//! ```text
//!   -> {"op":"create_volume","name":"vm1","size_bytes":1073741824}
//!   <- {"ok":true,"volume":{"name":"vm1","id":1,"size_bytes":1073741824,...}}
//!   -> {"op":"snapshot","origin":"vm1","name":"snap","read_only":true}
//!   -> {"op":"delete_volume","name":"vm1"}              (answers with the volume as it was)
//!   <- {"ok":false,"error":{"kind":"refused","errno":16,"code":"EBUSY","message":"volume \"vm1\" is open"}}
//!   -> {"op":"resize_volume","name":"vm1","size_bytes":2147483648}
//!   -> {"op":"resize_volume","name":"vm1","size_bytes":1048576,"force":true}
//!   <- {"ok":true,"volume":{...,"unmapped_bytes":6291456}}   (a shrink needs force to unmap data)
//!   -> {"op":"revert_volume","name":"vm1","snapshot":"snap","delete_snapshot":false}
//!   -> {"op":"rename_volume","name":"vm1","new_name":"vm2"}
//!   -> {"op":"adopt_volume","id":5,"name":"snap2","size_bytes":4194304,"origin":"vm1"}
//!   -> {"op":"forget_volume","name":"gone"}              (answers {"ok":true,"forgotten":{...}})
//!   -> {"op":"grow_data","size_bytes":21474836480}      (answers with the status)
//!   -> {"op":"grow_metadata"}                            (to the device's size; or "size_bytes")
//!   -> {"op":"list"}                                     (answers {"ok":true,"volumes":[...]})
//!   -> {"op":"status"}                                   (answers {"ok":true,"status":{...}})
//!   -> {"op":"reserve_metadata_snap"}                    (answers with the status)
//!   -> {"op":"release_metadata_snap"}                    (answers with the status)
//!   -> {"op":"diff","base":"vm1","target":"snap"}        (answers {"ok":true,"diff":{...}})
//!   -> {"op":"trim"}                                     (answers {"ok":true,"trimmed_bytes":N})
//!   -> {"op":"trim","progress":true}                     (progress lines first: progress.rs)
//!   -> {"op":"send_stream","snapshot":"s2","base":"s1"}  (answers {"ok":true}, then the stream)
//!   -> {"op":"receive_stream","name":"s2"} + the stream  (answers with the volume; stream.rs)
//! ```
//!
//! Requests are checked strictly: an unknown `op`, a missing field or a field the request does
//! not have is refused with EINVAL (the connection goes on).
//!
//! Limits: a request line is at most [`REQUEST_BYTES_MAX`] bytes (longer ones get an error and
//! the connection is closed); each request must arrive whole within [`REQUEST_TIMEOUT`] of the
//! previous answer (or of connecting), else the client gets ETIMEDOUT and is closed; at most
//! [`CONNECTIONS_MAX`] clients at once, each on its own thread, and a new client at the cap
//! takes the place of the one idle the longest, so idle clients cannot lock management out
//! (only [`CONNECTIONS_MAX`] requests being carried out at once make a new client get EBUSY).
//! Management is serialized by the engine, not by this server.
//!
//! Shutdown ([`ControlServer::shutdown`]) is bounded: the accept loop polls a stop flag every
//! `ACCEPT_POLL_INTERVAL` (it is never left waiting for a wake-up connection, which could
//! not reach it if the socket file was removed), connections are cut, and requests being
//! carried out get at most [`STOP_WAIT`].

use std::io::{BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context};
use thin_pool::Pool;

use crate::pool_dir::{PoolDir, StoredOptions};

/// Longest request line the server reads.
pub const REQUEST_BYTES_MAX: usize = 64 * 1024;
/// Longest response line the client reads (a listing of many volumes).
pub const RESPONSE_BYTES_MAX: usize = 64 * 1024 * 1024;
/// Control clients served at once (one thread each); see the module notes for what happens
/// to one more.
pub const CONNECTIONS_MAX: usize = 16;
/// How long the server waits for a whole request line before it drops the client.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the server waits for a client to take an answer.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the client waits for an answer (a snapshot or resize commits the pool).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(120);
/// How often the accept loop looks at the stop flag while no client connects.
const ACCEPT_POLL_INTERVAL: Duration = Duration::from_millis(100);
/// Longest wait at shutdown for the accept loop and for requests being carried out.
pub const STOP_WAIT: Duration = Duration::from_secs(5);

pub mod diff;
mod listing;
mod log;
pub mod progress;
mod protocol;
mod server;
mod status_record;
pub mod stream;
mod target;
#[cfg(test)]
mod tests;

pub use protocol::{
    errno_name, AutoextendRecord, OpError, OrphanedRecord, Outcome, Request, ServedRecord,
    StatusRecord, UnadoptedRecord, VolumeRecord,
};
pub use server::ControlServer;
pub use target::{ResizeHook, Served, ServedProbe, Target};

use protocol::{read_line, Line, Response};

/// Carries out `request` on the pool in `dir`: directly if no process holds the pool, through
/// its control socket if a server does. The outer error is a failure to reach the pool; the
/// inner one is the pool's answer.
pub fn perform(dir: &PoolDir, request: &Request) -> anyhow::Result<Result<Outcome, OpError>> {
    perform_reporting(dir, request, &|target| target.execute(request), &|_| {})
}

/// [`perform`], carrying `request` out with `offline` when no server holds the pool (e.g.
/// [`Target::trim`], which counts its progress); a served pool gets `request` itself, and
/// the progress lines its server sends before the answer (a request that asks for them:
/// `control/progress.rs`) go to `on_progress`.
pub fn perform_reporting(
    dir: &PoolDir,
    request: &Request,
    offline: &dyn Fn(&Target) -> Result<Outcome, OpError>,
    on_progress: &dyn Fn(progress::ProgressRecord),
) -> anyhow::Result<Result<Outcome, OpError>> {
    dir.require_pool()?;
    crate::restored::name_restored_volumes(&dir.path)?;
    let options = StoredOptions::load(dir)?;
    match Pool::open(&dir.path, options.pool_options()) {
        Ok(pool) => {
            let target = Target {
                pool,
                options,
                reserved_names: Vec::new(),
                served: None,
            };
            let result = offline(&target);
            target
                .pool
                .close()
                .with_context(|| format!("cannot close the pool in {}", dir.path.display()))?;
            Ok(result)
        }
        Err(thin_pool::Error::Locked { .. }) => {
            let socket = dir.control_socket();
            call_reporting(&socket, request, on_progress).with_context(|| {
                format!(
                    "the pool in {} is held by another process, and its control socket {} does not answer",
                    dir.path.display(),
                    socket.display()
                )
            })
        }
        Err(error) => {
            Err(error).with_context(|| format!("cannot open the pool in {}", dir.path.display()))
        }
    }
}

/// [`perform`] for a command that reports the pool's refusal as its own error.
pub fn ask(dir: &PoolDir, request: &Request) -> anyhow::Result<Outcome> {
    Ok(perform(dir, request)??)
}

/// Sends one request to a control socket and returns the answer.
pub fn call(socket: &Path, request: &Request) -> anyhow::Result<Result<Outcome, OpError>> {
    call_reporting(socket, request, &|_| {})
}

/// [`call`], handing the progress lines before the answer to `on_progress`.
pub fn call_reporting(
    socket: &Path,
    request: &Request,
    on_progress: &dyn Fn(progress::ProgressRecord),
) -> anyhow::Result<Result<Outcome, OpError>> {
    let mut stream = UnixStream::connect(socket)
        .with_context(|| format!("cannot connect to {}", socket.display()))?;
    stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
    let mut line = serde_json::to_vec(request).context("cannot encode the request")?;
    line.push(b'\n');
    stream.write_all(&line).context("cannot send the request")?;
    let mut reader = BufReader::new(stream);
    let answer = loop {
        let line =
            match read_line(&mut reader, RESPONSE_BYTES_MAX).context("cannot read the answer")? {
                Line::Complete(line) => line,
                Line::End => bail!("the server closed the control connection without answering"),
                Line::TooLong => bail!("the answer is longer than {RESPONSE_BYTES_MAX} bytes"),
            };
        match progress::ProgressLine::parse(&line) {
            Some(frame) => on_progress(frame),
            None => break line,
        }
    };
    let response: Response =
        serde_json::from_slice(&answer).context("the answer is not valid JSON")?;
    response.into_result()
}
