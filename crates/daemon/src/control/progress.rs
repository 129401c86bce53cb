//! Progress frames: a long request that asks for them (`{"op":"trim","progress":true}`, or a
//! `diff` without `list_same`, in virtual blocks compared) is
//! answered, on its own connection as every request of the command line is, with progress
//! lines before its one answer line, so a client can draw done/total while a server works:
//!
//! ```text
//!   -> {"op":"trim","progress":true}
//!   <- {"thinpool_json":1,"progress":{"done_blocks":4096,"total_blocks":4194304}}
//!   <- ...                                   (at most one every PROGRESS_INTERVAL)
//!   <- {"thinpool_json":1,"progress":{"done_blocks":4194304,"total_blocks":4194304}}
//!   <- {"thinpool_json":1,"ok":true,"trimmed_bytes":N}
//! ```
//!
//! A frame is sent only when the count changed; a successful operation's last frame has
//! `done_blocks == total_blocks`. Frames come from a thread of their own that stops (and is
//! joined) before the answer is written, so a frame never follows or splits the answer. A
//! client that stops reading stops the frames (the write fails after the write timeout); the
//! operation goes on. Without `"progress":true` nothing changes: one answer line.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use thin_pool::progress::Progress;

use super::{OpError, Outcome, Request, Target};
use crate::json::VERSION;

/// Shortest time between two frames.
pub const PROGRESS_INTERVAL: Duration = Duration::from_millis(200);

/// How far the operation has come, in blocks: data blocks looked at (trim), virtual blocks
/// compared (diff).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProgressRecord {
    /// Blocks done.
    pub done_blocks: u64,
    /// Blocks to do.
    pub total_blocks: u64,
}

/// A progress line as it goes on the wire (never an answer: it has no `ok`).
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ProgressLine {
    thinpool_json: u32,
    progress: ProgressRecord,
}

impl ProgressLine {
    /// The frame a line carries, if it is a progress line.
    pub(super) fn parse(line: &[u8]) -> Option<ProgressRecord> {
        let frame: ProgressLine = serde_json::from_slice(line).ok()?;
        Some(frame.progress)
    }
}

/// Whether `request` asks for progress lines.
pub(super) fn is_counted(request: &Request) -> bool {
    matches!(
        request,
        Request::Trim { progress: true } | Request::Diff { progress: true, .. }
    )
}

/// A request [`is_counted`] carried out on `target`, with progress frames written to `writer`.
pub(super) fn counted(
    request: &Request,
    target: &Target,
    writer: &UnixStream,
) -> Result<Outcome, OpError> {
    reporting(target, writer, |target, progress| match request {
        Request::Trim { .. } => target.trim(progress),
        other => target.diff(other, progress),
    })
}

/// A request that counts its progress (a trim, a diff) carried out on `target` by `op`, with
/// progress frames written to `writer` while it runs.
pub(super) fn reporting(
    target: &Target,
    writer: &UnixStream,
    op: impl FnOnce(&Target, &Progress) -> Result<Outcome, OpError>,
) -> Result<Outcome, OpError> {
    let progress = Progress::new();
    let (stop, stopped) = mpsc::channel::<()>();
    std::thread::scope(|scope| {
        let counts = &progress;
        let reporter = scope.spawn(move || report(counts, writer, &stopped));
        let result = op(target, &progress);
        drop(stop);
        // A reporter that panicked only loses frames.
        let _ = reporter.join();
        result
    })
}

/// Writes a frame whenever `progress` changed, every [`PROGRESS_INTERVAL`], and a last one
/// when `stopped` says the operation ended; stops at the first failed write.
fn report(progress: &Progress, mut writer: &UnixStream, stopped: &mpsc::Receiver<()>) {
    let mut last = None;
    loop {
        let ended = stopped.recv_timeout(PROGRESS_INTERVAL) != Err(mpsc::RecvTimeoutError::Timeout);
        let frame = ProgressRecord {
            done_blocks: progress.done(),
            total_blocks: progress.total(),
        };
        if frame.total_blocks > 0 && last != Some(frame) {
            if send(&mut writer, frame).is_err() {
                return;
            }
            last = Some(frame);
        }
        if ended {
            return;
        }
    }
}

fn send(writer: &mut impl Write, progress: ProgressRecord) -> std::io::Result<()> {
    let line = ProgressLine {
        thinpool_json: VERSION,
        progress,
    };
    let mut bytes = serde_json::to_vec(&line).map_err(std::io::Error::other)?;
    bytes.push(b'\n');
    writer.write_all(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_progress_line_is_no_answer_and_an_answer_no_progress_line() {
        let mut line = Vec::new();
        let frame = ProgressRecord {
            done_blocks: 3,
            total_blocks: 8,
        };
        send(&mut line, frame).unwrap();
        assert_eq!(
            String::from_utf8_lossy(&line),
            "{\"thinpool_json\":1,\"progress\":{\"done_blocks\":3,\"total_blocks\":8}}\n"
        );
        assert_eq!(ProgressLine::parse(&line[..line.len() - 1]), Some(frame));
        let answer = br#"{"thinpool_json":1,"ok":true,"trimmed_bytes":0}"#;
        assert_eq!(ProgressLine::parse(answer), None);
    }
}
