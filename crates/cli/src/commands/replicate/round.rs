//! One round of `thinpool replicate`, under the source pool's `replication.lock`:
//!
//! 1. a replica a cut-off round left unacknowledged (`pending`) is deleted here (the
//!    destination may hold it: it prunes it at its next receive);
//! 2. `pending` = the next sequence number, stored; then the read-only snapshot is taken;
//! 3. the stream (the increment from the last acknowledged replica, else full) goes to the
//!    receiver's stdin; its exit status 0 and last line (the received volume as JSON, with
//!    the content id the source gave the snapshot) are the acknowledgement. A receiver
//!    that makes no progress for `--timeout` is killed (`receiver.rs`) and the round fails
//!    as any failed send does: the unacknowledged replica deleted, no step 4;
//! 4. stored: acknowledged = it, previous = the one before; pending cleared;
//! 5. the source's other replicas of the volume are deleted (only now: the destination
//!    holds the new one).
//!
//! A round killed anywhere leaves a state the next round starts from: before 4 the
//! acknowledged base is unchanged, and both sides still hold it (the destination keeps the
//! base of what it receives).

use anyhow::{bail, Context};
use std::time::Duration;

use super::receiver::Receiver;
use super::Destination;
use crate::control::{self, stream, Outcome, Request, VolumeRecord};
use crate::pool_dir::PoolDir;
use thinpool_daemon::replication::{self, Pending, Replica, StateFile, VolumeState};

/// What a round sends its replica from.
#[derive(Clone, Debug)]
pub enum Start {
    /// The last acknowledged replica (a full stream if there is none).
    Acked,
    /// Nothing: a full stream (`--full`).
    Full,
    /// This read-only snapshot, which the destination holds too (`--base`).
    From(String),
}

/// Carry out one round (module doc); returns the replica acknowledged.
pub fn run(
    dir: &PoolDir,
    volume: &str,
    destination: &Destination,
    start: &Start,
    timeout: Duration,
) -> anyhow::Result<Replica> {
    let _lock = replication::lock(&dir.path)?;
    let mut state = replication::load(&dir.path)?;
    let (pending, base) = begin(dir, &mut state, volume, destination, start)?;
    let name = pending.name.clone();
    let taken_at = replication::now_unix_seconds();
    control::ask(
        dir,
        &Request::Snapshot {
            origin: volume.to_string(),
            name: name.clone(),
            read_only: true,
        },
    )
    .with_context(|| format!("cannot take the snapshot {name}"))?;
    let base_name = base.as_ref().map(|base| base.name.as_str());
    let sent = send(dir, &name, base_name, destination, timeout).and_then(|(ack, stream_bytes)| {
        let content_id = content_id(dir, &name)?;
        if ack.name != name || ack.content_id.as_deref() != Some(content_id.as_str()) {
            bail!(
                "the destination acknowledged {} with content id {:?}, not {name} with {content_id}",
                ack.name,
                ack.content_id
            );
        }
        Ok((content_id, stream_bytes))
    });
    let entry = state.volumes.get_mut(volume).expect("begun");
    let (content_id, stream_bytes) = match sent {
        Ok(sent) => sent,
        Err(error) => {
            delete_if_present(dir, &name, "the unacknowledged replica");
            entry.pending = None;
            replication::store(&dir.path, &state)?;
            return Err(match base_name {
                Some(base) => error.context(format!(
                    "sending {name} (the increment from {base}) failed; if the destination \
                     no longer holds {base} (deleted, or it diverged), start over with --full"
                )),
                None => error.context(format!("sending {name} (a full stream) failed")),
            });
        }
    };
    let replica = Replica {
        name,
        seq: pending.seq,
        content_id,
        taken_at_unix_seconds: taken_at,
        acked_at_unix_seconds: replication::now_unix_seconds(),
        stream_bytes,
        incremental: base.is_some(),
    };
    entry.previous = entry.acked.replace(replica.clone());
    entry.pending = None;
    let kept = entry.clone();
    replication::store(&dir.path, &state)?;
    prune(dir, volume, &kept)?;
    Ok(replica)
}

/// Steps 1 and 2 up to the snapshot: the volume's entry (made if new) with a cut-off
/// round's replica dropped, the base checked, the new replica stored as pending. Returns
/// it and the base.
fn begin(
    dir: &PoolDir,
    state: &mut StateFile,
    volume: &str,
    destination: &Destination,
    start: &Start,
) -> anyhow::Result<(Pending, Option<Replica>)> {
    let described = destination.describe();
    let entry = state
        .volumes
        .entry(volume.to_string())
        .or_insert_with(|| VolumeState::new(&described));
    // A destination without the base refuses the increment (by content id), whatever
    // the state recorded of where replicas went: the latest one is recorded.
    entry.destination = described;
    if let Some(pending) = entry.pending.take() {
        delete_if_present(dir, &pending.name, "the replica a cut-off round left");
        replication::store(&dir.path, state)?;
    }
    let entry = state.volumes.get_mut(volume).expect("entered above");
    if let Start::From(base) = start {
        seed(dir, entry, base)?;
    }
    let base = match start {
        Start::Full => None,
        Start::Acked | Start::From(_) => entry.acked.clone(),
    };
    let names = volume_names(dir)?;
    if !names.iter().any(|name| name == volume) {
        bail!("there is no volume {volume:?} to replicate");
    }
    if let Some(base) = &base {
        if !names.contains(&base.name) {
            bail!(
                "the last acknowledged replica {} is gone from this pool: start over with --full",
                base.name
            );
        }
    }
    let seq = entry.next_seq;
    let pending = Pending {
        name: replication::replica_name(volume, seq),
        seq,
    };
    entry.next_seq += 1;
    entry.pending = Some(pending.clone());
    replication::store(&dir.path, state)?;
    Ok((pending, base))
}

/// Makes `base` (a read-only snapshot with a content id, which the destination holds
/// too) the acknowledged replica of `entry`; the sequence goes on after its number.
fn seed(dir: &PoolDir, entry: &mut VolumeState, base: &str) -> anyhow::Result<()> {
    let content_id = content_id(dir, base).with_context(|| {
        format!(
            "--base {base}: a replica both sides hold has a content id (it was sent or received)"
        )
    })?;
    let seq = replication::parse_replica(base).map_or(0, |(_, seq)| seq);
    let now = replication::now_unix_seconds();
    entry.next_seq = entry.next_seq.max(seq + 1);
    entry.previous = None;
    entry.acked = Some(Replica {
        name: base.to_string(),
        seq,
        content_id,
        taken_at_unix_seconds: now,
        acked_at_unix_seconds: now,
        stream_bytes: 0,
        incremental: false,
    });
    Ok(())
}

/// The names of the source pool's volumes.
fn volume_names(dir: &PoolDir) -> anyhow::Result<Vec<String>> {
    match control::ask(dir, &Request::List)? {
        Outcome::Volumes(volumes) => Ok(volumes.into_iter().map(|v| v.name).collect()),
        other => bail!("unexpected answer to list: {other:?}"),
    }
}

/// The content id the send gave the snapshot `name`.
fn content_id(dir: &PoolDir, name: &str) -> anyhow::Result<String> {
    let Outcome::Volumes(volumes) = control::ask(dir, &Request::List)? else {
        bail!("unexpected answer to list");
    };
    volumes
        .into_iter()
        .find(|volume| volume.name == name)
        .and_then(|volume| volume.content_id)
        .with_context(|| format!("{name} has no content id"))
}

/// Deletes the volume `name` if it is there; a failure (open by a client) is a warning:
/// the next round's pruning tries again.
fn delete_if_present(dir: &PoolDir, name: &str, what: &str) {
    let request = Request::DeleteVolume {
        name: name.to_string(),
    };
    match control::perform(dir, &request) {
        Ok(Ok(_)) => {}
        Ok(Err(error)) if error.code == "ENOENT" => {}
        Ok(Err(error)) => eprintln!("thinpool: warning: cannot delete {what}, {name}: {error}"),
        Err(error) => eprintln!("thinpool: warning: cannot delete {what}, {name}: {error:#}"),
    }
}

/// Deletes the source's replicas of `volume` that `kept` does not keep.
fn prune(dir: &PoolDir, volume: &str, kept: &VolumeState) -> anyhow::Result<()> {
    for name in volume_names(dir)? {
        match replication::parse_replica(&name) {
            Some((of, seq)) if of == volume && !kept.keeps(seq) => {
                delete_if_present(dir, &name, "an older replica");
            }
            _ => {}
        }
    }
    Ok(())
}

/// Sends replica `name` (from `base`) to the destination's receiver, which `timeout`
/// without progress kills (`receiver.rs`); returns its acknowledgement and the stream's
/// bytes.
fn send(
    dir: &PoolDir,
    name: &str,
    base: Option<&str>,
    destination: &Destination,
    timeout: Duration,
) -> anyhow::Result<(VolumeRecord, u64)> {
    let command = destination.receiver(name)?;
    let mut receiver = Receiver::spawn(command, destination.runs_a_command(), timeout)?;
    let sent = stream::send(dir, name, base, receiver.input(), &mut |_| {});
    let finished = receiver
        .finish()
        .with_context(|| format!("the receiver ({})", destination.describe()))?;
    let stderr = String::from_utf8_lossy(&finished.stderr);
    if !finished.status.success() {
        // A send failing midway cuts the stream, which the receiver then refuses: say both.
        let send_error = match &sent {
            Err(error) => format!(" (the send failed first: {error:#})"),
            Ok(_) => String::new(),
        };
        bail!(
            "the receiver ({}) failed, {}: {}{send_error}",
            destination.describe(),
            finished.status,
            stderr.trim()
        );
    }
    // Its warnings (a replica it could not prune) are the operator's.
    eprint!("{stderr}");
    let bytes = sent.context("cannot send the stream")?;
    let stdout = String::from_utf8_lossy(&finished.stdout);
    acknowledgement(&stdout).map(|ack| (ack, bytes))
}

/// The acknowledgement: the last JSON object the receiver printed (`receive --json`: one
/// object, compact or pretty), from the last line that opens one to the end.
fn acknowledgement(stdout: &str) -> anyhow::Result<VolumeRecord> {
    let start = stdout
        .rmatch_indices('\n')
        .map(|(at, _)| at + 1)
        .chain([0])
        .find(|&at| stdout[at..].starts_with('{'))
        .context("the receiver printed no acknowledgement")?;
    let line = stdout[start..].trim();
    serde_json::from_str(line)
        .with_context(|| format!("the receiver's acknowledgement is not a volume: {line:?}"))
}
