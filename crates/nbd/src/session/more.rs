//! When a reader looks for more requests before it sends its batch ([`MoreProbe`]).

/// When to try `Input::receive_more`: a score that found bytes raise by 2 and empty tries
/// lower by 1, so tries go on while at least a third of them find something (a `send`
/// saved is worth about two empty `recv`s); at 0 only every [`MORE_RETRY_EVERY`]th chance
/// tries, to notice when the client starts sending ahead again.
#[derive(Default)]
pub(super) struct MoreProbe {
    score: u32,
    skipped: u32,
}

/// Highest [`MoreProbe`] score: a client that stops sending ahead stops the tries within
/// this many empty ones.
const MORE_SCORE_MAX: u32 = 8;

/// Chances skipped between tries while the [`MoreProbe`] score is 0.
const MORE_RETRY_EVERY: u32 = 16;

impl MoreProbe {
    pub(super) fn should_try(&mut self) -> bool {
        if self.score > 0 {
            return true;
        }
        self.skipped += 1;
        if self.skipped < MORE_RETRY_EVERY {
            return false;
        }
        self.skipped = 0;
        true
    }

    pub(super) fn record(&mut self, came: bool) {
        self.score = if came {
            (self.score + 2).min(MORE_SCORE_MAX)
        } else {
            self.score.saturating_sub(1)
        };
    }
}
