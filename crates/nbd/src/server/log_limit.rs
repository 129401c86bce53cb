//! A limit on how often the accept loops log refusals and evictions: a client that opens
//! connections in a loop must not flood the log (or slow the accept loop with it).
//!
//! At most [`LINES_PER_WINDOW`] lines per [`WINDOW`]; the lines left out are counted, and
//! the first line of a later window says how many were ([`LogLimit::admit`]'s count). The
//! events ([`super::Event::Refused`], [`super::Event::Evicted`]) are not limited.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::sync;

/// Length of a window.
pub(super) const WINDOW: Duration = Duration::from_secs(60);
/// Lines logged per window.
pub(super) const LINES_PER_WINDOW: u32 = 20;

struct Window {
    started: Instant,
    lines: u32,
    /// Lines left out since the last one logged.
    suppressed: u64,
}

/// Counts log lines per window (module doc).
pub(super) struct LogLimit {
    window: Mutex<Window>,
}

impl LogLimit {
    pub(super) fn new() -> Self {
        LogLimit {
            window: Mutex::new(Window {
                started: Instant::now(),
                lines: 0,
                suppressed: 0,
            }),
        }
    }

    /// `Some(lines left out before this one)` if a line may be logged at `now`; `None` if it
    /// is to be left out (and is counted).
    pub(super) fn admit(&self, now: Instant) -> Option<u64> {
        let mut window = sync::lock(&self.window);
        if now.saturating_duration_since(window.started) >= WINDOW {
            window.started = now;
            window.lines = 0;
        }
        if window.lines >= LINES_PER_WINDOW {
            window.suppressed += 1;
            return None;
        }
        window.lines += 1;
        Some(std::mem::take(&mut window.suppressed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_past_the_window_limit_are_counted_and_reported_later() {
        let limit = LogLimit::new();
        let start = Instant::now();
        for _ in 0..LINES_PER_WINDOW {
            assert_eq!(limit.admit(start), Some(0));
        }
        for _ in 0..5 {
            assert_eq!(limit.admit(start + Duration::from_secs(1)), None);
        }
        let later = start + WINDOW + Duration::from_secs(1);
        assert_eq!(limit.admit(later), Some(5));
        assert_eq!(limit.admit(later), Some(0));
    }
}
