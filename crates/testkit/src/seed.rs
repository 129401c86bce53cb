//! Seeded randomness for tests: every random test takes its seed from `THINPOOL_SEED` (or a
//! fresh random one) and prints it if it fails, so the failure replays exactly. This is the
//! only place that reads `THINPOOL_SEED` and `THINPOOL_CASES` in tests.
//!
//! A test holds a [`SeedReport`] for its whole run; if the test panics the report prints
//! `seed = 0x… (rerun with THINPOOL_SEED=0x…)`. Threads a test spawns derive their seeds
//! from the report's and panic into the test's thread through `join`, so one report covers
//! them.
//!
//! ```
//! use rand::Rng;
//! let (_report, mut rng) = testkit::seeded_rng();
//! let cases = testkit::case_count(100);
//! for _ in 0..cases {
//!     let _block: u64 = rng.gen_range(0..1000);
//! }
//! ```
//!
//! Environment:
//! - `THINPOOL_SEED=N` (decimal or `0x` hex): use this seed instead of a random one.
//! - `THINPOOL_CASES=N`: run N cases instead of the test's default;
//!   `THINPOOL_CASES=xK` (or `Kx`): run K times the default.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Name of the environment variable holding the seed.
pub const SEED_VARIABLE: &str = "THINPOOL_SEED";
/// Name of the environment variable scaling case counts.
pub const CASES_VARIABLE: &str = "THINPOOL_CASES";

/// The seed for this test: `THINPOOL_SEED` if set, otherwise a random one.
///
/// Panics if `THINPOOL_SEED` is set but is not a number.
pub fn test_seed() -> u64 {
    match std::env::var(SEED_VARIABLE) {
        Ok(text) => parse_u64(&text)
            .unwrap_or_else(|| panic!("{SEED_VARIABLE}={text:?} is not a decimal or 0x-hex u64")),
        Err(_) => rand::thread_rng().gen(),
    }
}

/// A report for [`test_seed`], for tests that need the seed itself (to derive per-thread or
/// per-case seeds). Keep it alive for the whole test.
pub fn seed_report() -> SeedReport {
    SeedReport::new(test_seed())
}

/// A seed report and a deterministic generator seeded with [`test_seed`].
///
/// Keep the report alive for the whole test (`let (_report, mut rng) = seeded_rng();`, not
/// `let (_, ...)`, which drops it at once).
pub fn seeded_rng() -> (SeedReport, StdRng) {
    let report = seed_report();
    let rng = report.rng();
    (report, rng)
}

/// Prints the seed when dropped during a panic, i.e. when the test that owns it fails.
#[derive(Debug)]
pub struct SeedReport {
    seed: u64,
}

impl SeedReport {
    /// A report for `seed`.
    pub fn new(seed: u64) -> SeedReport {
        SeedReport { seed }
    }

    /// The seed being reported.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// What is printed on failure: `seed = 0x… (rerun with THINPOOL_SEED=0x…)`.
    pub fn message(&self) -> String {
        format!(
            "seed = {seed:#x} (rerun with {SEED_VARIABLE}={seed:#x})",
            seed = self.seed
        )
    }

    /// A fresh deterministic generator for the seed (the same sequence every call).
    pub fn rng(&self) -> StdRng {
        StdRng::seed_from_u64(self.seed)
    }
}

impl Drop for SeedReport {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let thread = std::thread::current();
            let test = thread.name().unwrap_or("<unnamed thread>");
            eprintln!("{test}: {}", self.message());
        }
    }
}

/// How many random cases to run: `default`, unless `THINPOOL_CASES` gives a count (`N`) or a
/// multiplier (`xK` / `Kx`). Never less than 1.
///
/// Panics if `THINPOOL_CASES` is set but malformed.
pub fn case_count(default: u64) -> u64 {
    match std::env::var(CASES_VARIABLE) {
        Ok(text) => cases_from(&text, default)
            .unwrap_or_else(|| panic!("{CASES_VARIABLE}={text:?} is neither N nor xK")),
        Err(_) => default.max(1),
    }
}

fn cases_from(text: &str, default: u64) -> Option<u64> {
    let text = text.trim();
    let count = if let Some(factor) = text.strip_prefix('x').or_else(|| text.strip_suffix('x')) {
        default.saturating_mul(parse_u64(factor)?)
    } else {
        parse_u64(text)?
    };
    Some(count.max(1))
}

/// Runs [`case_count`]`(default_cases)` independent cases on `threads` threads: case `index`
/// gets seed `test seed + index`, so a failure (whose message should name the index and the
/// case seed) replays alone with `THINPOOL_SEED=<case seed> THINPOOL_CASES=1`. The test seed
/// is printed if any case fails. For cases that mostly wait on external tools.
pub fn run_cases(default_cases: u64, threads: u64, case: impl Fn(u64, u64) + Sync) {
    let report = seed_report();
    let base = report.seed();
    let cases = case_count(default_cases);
    let threads = threads.clamp(1, cases);
    std::thread::scope(|scope| {
        for thread in 0..threads {
            let case = &case;
            scope.spawn(move || {
                for index in (thread..cases).step_by(threads as usize) {
                    case(index, base.wrapping_add(index));
                }
            });
        }
    });
}

/// `length` deterministic pseudo-random bytes for `id` (an xorshift stream): test data whose
/// origin a read can recognise, the same in every run and every crate.
pub fn pattern(id: u64, length: usize) -> Vec<u8> {
    let mut state = id.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..length)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

fn parse_u64(text: &str) -> Option<u64> {
    let text = text.trim();
    match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_gives_same_sequence() {
        let a: Vec<u64> = SeedReport::new(7)
            .rng()
            .sample_iter(rand::distributions::Standard)
            .take(4)
            .collect();
        let b: Vec<u64> = SeedReport::new(7)
            .rng()
            .sample_iter(rand::distributions::Standard)
            .take(4)
            .collect();
        assert_eq!(a, b);
    }

    #[test]
    fn case_count_parses_counts_and_multipliers() {
        assert_eq!(cases_from("250", 10), Some(250));
        assert_eq!(cases_from("x4", 10), Some(40));
        assert_eq!(cases_from("3x", 10), Some(30));
        assert_eq!(cases_from("0", 10), Some(1));
        assert_eq!(cases_from("lots", 10), None);
    }

    #[test]
    fn seeds_parse_in_decimal_and_hex() {
        assert_eq!(parse_u64("42"), Some(42));
        assert_eq!(parse_u64("0x2a"), Some(42));
        assert_eq!(parse_u64(" 18446744073709551615 "), Some(u64::MAX));
        assert_eq!(parse_u64("-1"), None);
    }

    #[test]
    fn run_cases_runs_each_case_once_with_consecutive_seeds() {
        let seen = std::sync::Mutex::new(Vec::new());
        run_cases(10, 3, |index, seed| {
            seen.lock().unwrap().push((index, seed))
        });
        let mut seen = seen.into_inner().unwrap();
        seen.sort();
        let cases = case_count(10);
        assert_eq!(seen.len() as u64, cases);
        let base = seen[0].1;
        for (i, &(index, seed)) in seen.iter().enumerate() {
            assert_eq!(index, i as u64);
            assert_eq!(seed, base.wrapping_add(index));
        }
    }

    #[test]
    fn patterns_differ_by_id_and_repeat_by_id() {
        assert_eq!(pattern(3, 100), pattern(3, 100));
        assert_ne!(pattern(3, 100), pattern(4, 100));
        assert_eq!(pattern(3, 40), pattern(3, 100)[..40]);
    }

    #[test]
    fn message_gives_the_seed_in_hex_and_parses_back() {
        let report = SeedReport::new(0xdead_beef);
        let message = report.message();
        assert_eq!(
            message,
            "seed = 0xdeadbeef (rerun with THINPOOL_SEED=0xdeadbeef)"
        );
        let value = message.rsplit('=').next().unwrap().trim_end_matches(')');
        assert_eq!(parse_u64(value), Some(0xdead_beef));
    }

    #[test]
    fn report_prints_seed_only_when_panicking() {
        // Not panicking: dropping prints nothing and must not panic itself.
        drop(SeedReport::new(1));
        let result = std::panic::catch_unwind(|| {
            let _report = SeedReport::new(99);
            panic!("deliberate failure to exercise the report");
        });
        assert!(result.is_err());
    }
}
