//! The pool's health: its mode (dm-thin's, spec §10.5), why it failed, and the event log
//! [`crate::Pool::events`] returns. A leaf: every owner above logs here, none reads back.
//!
//! The mode is one atomic byte, read on every I/O; fail mode is final (only a reopen leaves
//! it). Events are kept in a bounded list ([`EVENTS_MAX`]) under their own mutex, which
//! guards nothing a panic can leave half-done.

use crate::engine::options::PoolMode;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

/// Events kept for [`crate::Pool::events`].
const EVENTS_MAX: usize = 1000;

/// Mode, fail reason and event log.
pub(crate) struct Health {
    mode: AtomicU8,
    /// The pool is read-only by option (not after an error): names the mode in logs.
    read_only_option: bool,
    /// Why the pool is in fail mode, once it is.
    fail_reason: Mutex<Option<String>>,
    events: Mutex<Vec<String>>,
}

impl Health {
    pub(crate) fn new(mode: PoolMode, read_only_option: bool) -> Health {
        Health {
            mode: AtomicU8::new(mode as u8),
            read_only_option,
            fail_reason: Mutex::new(None),
            events: Mutex::new(Vec::new()),
        }
    }

    #[inline]
    pub(crate) fn mode(&self) -> PoolMode {
        PoolMode::from_u8(self.mode.load(Ordering::Acquire))
    }

    /// Change the mode. Fail mode is final: nothing leaves it but a reopen.
    pub(crate) fn set_mode(&self, mode: PoolMode) {
        let fail = PoolMode::Fail as u8;
        let changed = self
            .mode
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |old| {
                (old != fail && old != mode as u8).then_some(mode as u8)
            });
        if let Ok(old) = changed {
            let from = self.mode_name(PoolMode::from_u8(old));
            let to = self.mode_name(mode);
            if mode == PoolMode::Write {
                tracing::info!(from, to, "pool mode changed");
            } else {
                tracing::warn!(from, to, "pool mode changed");
            }
            self.record(format!(
                "pool mode {:?} -> {mode:?}",
                PoolMode::from_u8(old)
            ));
        }
        // No read-back check of the mode here: another thread may set another mode at
        // once (out of space against a growth), so only the update itself is atomic
        // (`engine_races::discard_and_reprovision_race_with_other_volumes` hit such a check).
    }

    /// The mode's name in logs: dm-thin's status word, with read-only told apart by cause.
    fn mode_name(&self, mode: PoolMode) -> &'static str {
        match mode {
            PoolMode::OutOfMetadataSpace => "out_of_metadata_space",
            PoolMode::ReadOnly if self.read_only_option => "read_only",
            PoolMode::ReadOnly => "needs_check",
            other => other.as_str(),
        }
    }

    /// Why the pool is in fail mode (None in any other mode).
    pub(crate) fn fail_reason(&self) -> Option<String> {
        if self.mode() != PoolMode::Fail {
            return None;
        }
        self.fail_reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Keep the first reason the pool failed for, for [`Health::fail_reason`].
    pub(crate) fn record_fail_reason(&self, reason: &str) {
        let mut fail_reason = self.fail_reason.lock().unwrap_or_else(|e| e.into_inner());
        if fail_reason.is_none() {
            *fail_reason = Some(reason.to_string());
        }
    }

    /// An event of the pool: logged at info and kept for [`crate::Pool::events`].
    pub(crate) fn log(&self, event: String) {
        tracing::info!("{event}");
        self.record(event);
    }

    /// A failure of the pool: logged at warn and kept for [`crate::Pool::events`].
    pub(crate) fn log_warn(&self, event: String) {
        tracing::warn!("{event}");
        self.record(event);
    }

    /// Keeps `event` for [`crate::Pool::events`] without logging it.
    pub(crate) fn record(&self, event: String) {
        let mut events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        if events.len() >= EVENTS_MAX {
            events.remove(0);
        }
        events.push(event);
        debug_assert!(events.len() <= EVENTS_MAX);
    }

    pub(crate) fn events(&self) -> Vec<String> {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}
