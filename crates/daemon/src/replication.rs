//! Continuous replication's shared parts (`thinpool replicate`, docs/replication.md): the
//! replicas' names, the state file the command keeps in the source pool directory, and the
//! lag that `status` and the metrics read from it.
//!
//! **Names.** Replica `SEQ` of volume `VOLUME` is the read-only snapshot `VOLUME.repl-SEQ`
//! on both sides ([`replica_name`], [`parse_replica`]); `SEQ` only grows, so a name is
//! never used twice, even for a snapshot taken and then dropped unacknowledged.
//!
//! **State** (`DIR/replication.json`, [`StateFile`]): per replicated volume, where it goes,
//! the next `SEQ`, the last acknowledged replica and the one before it (the two kept), and
//! the replica taken but not acknowledged yet (`pending`, written before the snapshot is
//! taken, so a round cut off anywhere is found by the next). Written durably (temporary
//! file, fsync, rename, fsync of the directory) under `DIR/replication.lock` ([`lock`]),
//! which a round holds from its first read of the state to its last write.
//!
//! **Lag** ([`Lag`]): `lag_seconds` is the age of the last acknowledged replica (the time
//! since it was taken: what a fail-over to it would lose, in time); `lag_bytes` the data
//! the next increment would carry now: the bytes of the blocks in which the volume differs
//! from that replica (`Pool::diff`, every write completed so far, whole blocks).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use thin_pool::{DiffKind, Pool, VolumeDiff};

use crate::pool_dir::FILE_MODE;

/// The state file inside the source pool directory.
pub const STATE_FILE: &str = "replication.json";
/// The lock file a round holds (beside [`STATE_FILE`]).
pub const LOCK_FILE: &str = "replication.lock";
/// What separates a volume's name from its replica's sequence number.
pub const REPLICA_MARK: &str = ".repl-";

/// The name of replica `seq` of `volume`.
pub fn replica_name(volume: &str, seq: u64) -> String {
    format!("{volume}{REPLICA_MARK}{seq}")
}

/// The volume and sequence number of a replica's name, if `name` is one.
pub fn parse_replica(name: &str) -> Option<(&str, u64)> {
    let at = name.rfind(REPLICA_MARK)?;
    let (volume, rest) = (&name[..at], &name[at + REPLICA_MARK.len()..]);
    let digits_only = !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit());
    if volume.is_empty() || !digits_only || (rest.len() > 1 && rest.starts_with('0')) {
        return None;
    }
    Some((volume, rest.parse().ok()?))
}

/// Seconds since the Unix epoch, now.
pub fn now_unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

/// `DIR/replication.json`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateFile {
    /// Format version: 1.
    pub version: u32,
    /// Per replicated volume (of this pool), by name.
    pub volumes: BTreeMap<String, VolumeState>,
}

/// One replicated volume's state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeState {
    /// Where it is replicated to: a pool directory or a command, as given with `--to`.
    pub destination: String,
    /// The sequence number the next replica takes.
    pub next_seq: u64,
    /// The last replica the destination acknowledged (the base of the next increment).
    pub acked: Option<Replica>,
    /// The one acknowledged before it (kept too).
    pub previous: Option<Replica>,
    /// A replica taken and not acknowledged (its round was cut off, or is running).
    pub pending: Option<Pending>,
}

impl VolumeState {
    /// A volume not replicated before.
    pub fn new(destination: &str) -> VolumeState {
        VolumeState {
            destination: destination.to_string(),
            next_seq: 1,
            acked: None,
            previous: None,
            pending: None,
        }
    }

    /// Whether `seq` is one of the replicas kept (the acknowledged ones, or the pending one).
    pub fn keeps(&self, seq: u64) -> bool {
        [self.acked.as_ref(), self.previous.as_ref()]
            .into_iter()
            .flatten()
            .any(|replica| replica.seq == seq)
            || self.pending.as_ref().is_some_and(|p| p.seq == seq)
    }
}

/// An acknowledged replica.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Replica {
    /// Its name (on both sides).
    pub name: String,
    /// Its sequence number.
    pub seq: u64,
    /// Its content id, which the destination's acknowledgement named.
    pub content_id: String,
    /// When the snapshot was taken.
    pub taken_at_unix_seconds: u64,
    /// When the destination acknowledged it.
    pub acked_at_unix_seconds: u64,
    /// Bytes of the stream that carried it.
    pub stream_bytes: u64,
    /// Whether that stream was an increment (else a full stream).
    pub incremental: bool,
}

/// A replica taken and not acknowledged.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pending {
    /// Its name.
    pub name: String,
    /// Its sequence number.
    pub seq: u64,
}

/// Reads the state of the pool in `dir` (empty if it was never replicated).
pub fn load(dir: &Path) -> anyhow::Result<StateFile> {
    let path = dir.join(STATE_FILE);
    let mut text = String::new();
    let read = OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(&path)
        .and_then(|mut file| file.read_to_string(&mut text));
    match read {
        Ok(_) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            return Ok(StateFile {
                version: 1,
                volumes: BTreeMap::new(),
            })
        }
        Err(error) => return Err(error).with_context(|| format!("cannot read {}", path.display())),
    }
    let state: StateFile = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a valid replication state", path.display()))?;
    if state.version != 1 {
        bail!(
            "{}: replication state version {} is not supported (expected 1)",
            path.display(),
            state.version
        );
    }
    Ok(state)
}

/// Writes the state durably (temporary file, fsync, rename, fsync of the directory).
pub fn store(dir: &Path, state: &StateFile) -> anyhow::Result<()> {
    assert_eq!(state.version, 1);
    let path = dir.join(STATE_FILE);
    let temporary = dir.join(format!("{STATE_FILE}.tmp"));
    let text = serde_json::to_string_pretty(state).context("cannot encode the state")?;
    let write = || -> std::io::Result<()> {
        let mut file = crate::pool_dir::create_private_file(&temporary)?;
        file.write_all(text.as_bytes())?;
        file.write_all(b"\n")?;
        file.sync_all()?;
        std::fs::rename(&temporary, &path)?;
        File::open(dir)?.sync_all()
    };
    write().with_context(|| format!("cannot write {}", path.display()))
}

/// Takes `DIR/replication.lock` (waiting for another round to end); held until dropped.
pub fn lock(dir: &Path) -> anyhow::Result<File> {
    let path = dir.join(LOCK_FILE);
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(FILE_MODE)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    file.lock()
        .with_context(|| format!("cannot lock {}", path.display()))?;
    Ok(file)
}

/// One replicated volume's lag, as `status` and the metrics report it (module doc).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lag {
    /// The replicated volume.
    pub volume: String,
    /// Where it goes.
    pub destination: String,
    /// The last acknowledged replica (null before the first acknowledgement).
    pub last_acked: Option<String>,
    /// Its content id.
    pub last_acked_content_id: Option<String>,
    /// When it was taken.
    pub last_acked_taken_at_unix_seconds: Option<u64>,
    /// Seconds since it was taken.
    pub lag_seconds: Option<u64>,
    /// Bytes of the blocks the volume changed since it (null if that cannot be computed:
    /// no acknowledged replica, or it or the volume is gone).
    pub lag_bytes: Option<u64>,
    /// Bytes of the stream that carried it.
    pub last_stream_bytes: Option<u64>,
    /// A replica taken and not acknowledged.
    pub pending: Option<String>,
}

/// The lag of every volume in `state`, at `now`; `changed_bytes(base, volume)` measures
/// what the volume changed since the replica `base` (None if it cannot).
pub fn lags(
    state: &StateFile,
    now: u64,
    mut changed_bytes: impl FnMut(&str, &str) -> Option<u64>,
) -> Vec<Lag> {
    state
        .volumes
        .iter()
        .map(|(volume, entry)| {
            let acked = entry.acked.as_ref();
            Lag {
                volume: volume.clone(),
                destination: entry.destination.clone(),
                last_acked: acked.map(|r| r.name.clone()),
                last_acked_content_id: acked.map(|r| r.content_id.clone()),
                last_acked_taken_at_unix_seconds: acked.map(|r| r.taken_at_unix_seconds),
                lag_seconds: acked.map(|r| now.saturating_sub(r.taken_at_unix_seconds)),
                lag_bytes: acked.and_then(|r| changed_bytes(&r.name, volume)),
                last_stream_bytes: acked.map(|r| r.stream_bytes),
                pending: entry.pending.as_ref().map(|p| p.name.clone()),
            }
        })
        .collect()
}

/// The bytes of the blocks a diff finds mapped in its target (what an increment from its
/// base carries as data).
pub fn diff_data_bytes(diff: &VolumeDiff) -> u64 {
    diff.ranges
        .iter()
        .filter(|range| range.kind != DiffKind::BaseOnly)
        .map(|range| range.length * diff.block_size_bytes)
        .sum()
}

/// The lag of the volumes the pool in `dir` replicates, measured on the open `pool` (the
/// metrics). A missing or unreadable state file gives no lag.
pub fn pool_lags(pool: &Pool, dir: &Path) -> Vec<Lag> {
    let Ok(state) = load(dir) else {
        return Vec::new();
    };
    lags(&state, now_unix_seconds(), |base, volume| {
        pool.diff(base, volume, None)
            .ok()
            .map(|diff| diff_data_bytes(&diff))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_names_round_trip_and_others_are_not_replicas() {
        assert_eq!(replica_name("vm0", 7), "vm0.repl-7");
        assert_eq!(parse_replica("vm0.repl-7"), Some(("vm0", 7)));
        assert_eq!(parse_replica("a.repl-1.repl-12"), Some(("a.repl-1", 12)));
        for name in ["vm0", "vm0.repl-", "vm0.repl-x", ".repl-3", "vm0.repl-07"] {
            assert_eq!(parse_replica(name), None, "{name}");
        }
    }

    #[test]
    fn lag_is_null_before_the_first_acknowledgement() {
        let mut state = StateFile {
            version: 1,
            volumes: BTreeMap::new(),
        };
        state.volumes.insert("vm".into(), VolumeState::new("/d"));
        let lags = lags(&state, 100, |_, _| unreachable!("no base"));
        assert_eq!(lags[0].lag_seconds, None);
        assert_eq!(lags[0].lag_bytes, None);
        let entry = state.volumes.get_mut("vm").unwrap();
        entry.acked = Some(Replica {
            name: "vm.repl-1".into(),
            seq: 1,
            content_id: "c".into(),
            taken_at_unix_seconds: 40,
            acked_at_unix_seconds: 50,
            stream_bytes: 9,
            incremental: false,
        });
        let lags = super::lags(&state, 100, |base, volume| {
            assert_eq!((base, volume), ("vm.repl-1", "vm"));
            Some(65536)
        });
        assert_eq!(lags[0].lag_seconds, Some(60));
        assert_eq!(lags[0].lag_bytes, Some(65536));
        assert!(state.volumes["vm"].keeps(1) && !state.volumes["vm"].keeps(2));
    }
}
