//! Progress of the long commands (check, restore, dump, trim, import, diff, send, receive) on
//! stderr, drawn by indicatif: the one facility they all use.
//!
//! When: `--progress[=auto|always|never]` (global; `--progress` alone is `always`,
//! `--no-progress` is `never`). `auto`, the default, draws when stderr is a terminal;
//! `always` draws on stderr whatever it is (a pipe, a file: the bar's lines, with their
//! escape sequences, end up there), `never` never. Progress goes to stderr only, so the
//! stdout of `--json` (or of `dump`, `check`'s figures) is the same with or without it; a
//! bar is cleared when its operation ends. `serve` never draws one: its stderr is its log.
//!
//! The engine crates know nothing of this: they count into a [`thin_pool::progress::Progress`]
//! (atomics) or call a closure, and [`Bar::follow`] copies the counters into the bar from a
//! thread of its own, so the operation's loop only stores two numbers now and then.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::mpsc;
use std::sync::{Once, OnceLock};
use std::time::Duration;
use thin_pool::progress::Progress;

use crate::control::progress::ProgressRecord;

/// When progress is drawn (`--progress`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum When {
    /// When stderr is a terminal.
    #[default]
    Auto,
    /// Always, on stderr (also a pipe or a file).
    Always,
    /// Never.
    Never,
}

/// The command line's choice, set once by `main` before the command runs.
static WHEN: OnceLock<When> = OnceLock::new();

/// How often a followed counter is copied into its bar, and a spinner turns.
const REFRESH: Duration = Duration::from_millis(100);

/// Sets when progress is drawn, for the rest of the process (`main`, once).
pub fn init(when: When) {
    let set = WHEN.set(when);
    assert!(set.is_ok(), "progress::init called twice");
}

/// Where bars are drawn now, if anywhere.
fn draw_target() -> Option<ProgressDrawTarget> {
    match WHEN.get().copied().unwrap_or_default() {
        When::Never => None,
        // indicatif's stderr target hides itself off a terminal; a term-like one does not.
        When::Always => Some(ProgressDrawTarget::term_like(Box::new(
            console::Term::stderr(),
        ))),
        When::Auto => std::io::stderr()
            .is_terminal()
            .then(ProgressDrawTarget::stderr),
    }
}

/// Whether progress is drawn (for a command that draws something else otherwise, like
/// `check`'s phase lines).
pub fn shown() -> bool {
    match WHEN.get().copied().unwrap_or_default() {
        When::Never => false,
        When::Always => true,
        When::Auto => std::io::stderr().is_terminal(),
    }
}

/// Whether progress was asked for (`--progress`), rather than drawn because stderr is a
/// terminal (a command may then skip the bar for a short operation).
pub fn forced() -> bool {
    WHEN.get() == Some(&When::Always)
}

/// One operation's bar (or spinner); hidden, and nearly free, when progress is not drawn.
pub struct Bar {
    bar: ProgressBar,
}

impl Bar {
    /// A bar of `unit`s done out of a total (`None`: not known yet, set later with
    /// [`Bar::set`]), after `what` (the operation: "trim", "check").
    pub fn counting(what: &'static str, unit: Unit, total: Option<u64>) -> Bar {
        let bar = Bar::with_template(what, SPINNER, total);
        bar.count(unit, total.is_some());
        bar
    }

    /// A spinner with `message` and the time since it started, for a step that cannot
    /// count (opening a pool, a server's work, which it answers at the end); it may become
    /// a bar with [`Bar::count`].
    pub fn spinner(what: &'static str, message: &'static str) -> Bar {
        let bar = Bar::with_template(what, SPINNER, None);
        bar.bar.set_message(message);
        bar
    }

    /// Turns the bar into one of `unit`s (with a total when `total_known`; else a spinner
    /// with the count).
    pub fn count(&self, unit: Unit, total_known: bool) {
        if !self.is_shown() {
            return;
        }
        let (template, message) = match (unit, total_known) {
            (Unit::Bytes, true) => (
                "{prefix} [{wide_bar}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta} left)",
                "",
            ),
            (Unit::Bytes, false) => ("{spinner} {prefix} {bytes} ({bytes_per_sec}) {elapsed}", ""),
            (Unit::Blocks, true) => (
                "{prefix} [{wide_bar}] {pos}/{len} {msg} ({eta} left)",
                "blocks",
            ),
            (Unit::Blocks, false) => ("{spinner} {prefix} {pos} {msg} {elapsed}", "blocks"),
            (Unit::Mappings, _) => (
                "{spinner} {prefix} {human_pos} {msg} ({per_sec}) {elapsed}",
                "blocks mapped",
            ),
        };
        self.bar.set_style(style(template));
        self.bar.set_message(message);
        self.bar.tick();
    }

    /// A bar that is never drawn (`-q`).
    pub fn hidden() -> Bar {
        Bar {
            bar: ProgressBar::hidden(),
        }
    }

    fn with_template(what: &'static str, template: &str, total: Option<u64>) -> Bar {
        let Some(target) = draw_target() else {
            return Bar::hidden();
        };
        let bar = ProgressBar::with_draw_target(total, target)
            .with_style(style(template))
            .with_prefix(what);
        bar.enable_steady_tick(REFRESH);
        // Drawn at once (a steady tick waits for its first interval).
        bar.tick();
        Bar { bar }
    }

    /// Whether the bar is drawn.
    pub fn is_shown(&self) -> bool {
        !self.bar.is_hidden()
    }

    /// Sets the units done and the total.
    pub fn set(&self, done: u64, total: u64) {
        self.bar.set_length(total);
        self.bar.set_position(done);
    }

    /// Sets the text after the count (what is being done: a phase).
    pub fn set_message(&self, message: String) {
        self.bar.set_message(message);
    }

    /// Sets the units done.
    pub fn set_position(&self, done: u64) {
        self.bar.set_position(done);
    }

    /// `read`, counting its bytes into the bar.
    pub fn wrap_read<R: std::io::Read>(&self, read: R) -> impl std::io::Read {
        self.bar.wrap_read(read)
    }

    /// Runs `work`, copying `progress` into the bar every [`REFRESH`] (and once at the
    /// end) from another thread.
    pub fn follow<T>(&self, progress: &Progress, work: impl FnOnce() -> T) -> T {
        if !self.is_shown() {
            return work();
        }
        let (stop, stopped) = mpsc::channel::<()>();
        std::thread::scope(|scope| {
            scope.spawn(move || {
                let copy = || {
                    let total = progress.total();
                    if total > 0 {
                        self.set(progress.done(), total);
                    }
                };
                while stopped.recv_timeout(REFRESH) == Err(mpsc::RecvTimeoutError::Timeout) {
                    copy();
                }
                copy();
            });
            let result = work();
            drop(stop);
            result
        })
    }

    /// Ends the bar, clearing its line (what the command prints next takes its place).
    pub fn finish(self) {
        self.bar.finish_and_clear();
    }
}

/// Block counts for a spinner that becomes a bar of blocks at the first count: the pool's
/// own (offline, [`BlockCounts::offline`]) or a server's progress lines
/// ([`BlockCounts::served`]), for a command that runs either way (trim, diff).
pub struct BlockCounts<'a> {
    bar: &'a Bar,
    progress: Progress,
    counting: Once,
}

impl<'a> BlockCounts<'a> {
    pub fn new(bar: &'a Bar) -> BlockCounts<'a> {
        BlockCounts {
            bar,
            progress: Progress::new(),
            counting: Once::new(),
        }
    }

    /// The counters, for the pool to count into.
    pub fn offline(&self) -> &Progress {
        self.counting
            .call_once(|| self.bar.count(Unit::Blocks, true));
        &self.progress
    }

    /// A server's progress line, into the same counters.
    pub fn served(&self, frame: ProgressRecord) {
        if frame.done_blocks <= frame.total_blocks {
            self.counting
                .call_once(|| self.bar.count(Unit::Blocks, true));
            self.progress.set(frame.done_blocks, frame.total_blocks);
        }
    }

    /// Runs `work`, the bar following the counts ([`Bar::follow`]).
    pub fn follow<T>(&self, work: impl FnOnce() -> T) -> T {
        self.bar.follow(&self.progress, work)
    }
}

/// The template of [`Bar::spinner`].
const SPINNER: &str = "{spinner} {prefix} {msg} {elapsed}";

fn style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template)
        .expect("a valid template")
        .progress_chars("=> ")
}

/// What a bar counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// Bytes (a stream, an XML file).
    Bytes,
    /// Blocks (metadata blocks checked, data blocks trimmed).
    Blocks,
    /// Mapped blocks written (a dump).
    Mappings,
}
