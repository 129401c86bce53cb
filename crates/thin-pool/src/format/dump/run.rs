//! Run formation for dumps: single mappings in ascending virtual block order become maximal
//! runs, where a run continues while the virtual and the data block both advance by one and
//! the time stays the same (spec §9.1).
//!
//! The caller decides where runs must break in addition to that rule: `thin_dump` 1.x
//! starts a new run at the boundary of a shared leaf (a `<def>`), so a reader that emulates
//! it calls [`RunBuilder::flush`] before each reference and at the end of each definition.
//! Unshared leaves do not break runs.

use super::Mapping;

/// Collects single mappings into maximal runs.
///
/// ```
/// use thin_pool::format::dump::{Mapping, RunBuilder};
/// let mut runs = RunBuilder::new();
/// assert_eq!(runs.push(0, 100, 1), None);
/// assert_eq!(runs.push(1, 101, 1), None);
/// let first = runs.push(2, 500, 1).unwrap();
/// assert_eq!(first, Mapping { virtual_begin: 0, data_begin: 100, length: 2, time: 1 });
/// assert_eq!(runs.flush(), Some(Mapping::single(2, 500, 1)));
/// ```
#[derive(Debug, Clone, Default)]
pub struct RunBuilder {
    pending: Option<Mapping>,
}

impl RunBuilder {
    /// An empty builder.
    pub fn new() -> RunBuilder {
        RunBuilder { pending: None }
    }

    /// Adds the mapping `virtual_block -> data_block` with `time`. Returns the run that this
    /// mapping closes, if it does not extend the pending one.
    ///
    /// Panics if `virtual_block` is not above the previous one since the last flush
    /// (mappings must come in ascending virtual order).
    pub fn push(&mut self, virtual_block: u64, data_block: u64, time: u32) -> Option<Mapping> {
        let Some(run) = self.pending.as_mut() else {
            self.pending = Some(Mapping::single(virtual_block, data_block, time));
            return None;
        };
        let virtual_last = run.virtual_last();
        assert!(
            virtual_block > virtual_last,
            "mappings out of order: virtual block {virtual_block} after {virtual_last}"
        );
        let extends = virtual_block == virtual_last + 1
            && run.data_last().checked_add(1) == Some(data_block)
            && run.time == time;
        if extends {
            run.length += 1;
            None
        } else {
            self.pending
                .replace(Mapping::single(virtual_block, data_block, time))
        }
    }

    /// Closes and returns the pending run, if any. The next push starts a new run.
    pub fn flush(&mut self) -> Option<Mapping> {
        self.pending.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs_of(singles: &[(u64, u64, u32)]) -> Vec<Mapping> {
        let mut builder = RunBuilder::new();
        let mut runs: Vec<Mapping> = singles
            .iter()
            .filter_map(|&(v, d, t)| builder.push(v, d, t))
            .collect();
        runs.extend(builder.flush());
        runs
    }

    #[test]
    fn consecutive_blocks_with_equal_time_form_one_run() {
        assert_eq!(
            runs_of(&[(5, 10, 2), (6, 11, 2), (7, 12, 2)]),
            vec![Mapping {
                virtual_begin: 5,
                data_begin: 10,
                length: 3,
                time: 2
            }]
        );
    }

    #[test]
    fn gap_in_virtual_data_or_time_breaks_the_run() {
        let runs = runs_of(&[(0, 10, 0), (2, 11, 0), (3, 13, 0), (4, 14, 1), (5, 15, 1)]);
        assert_eq!(
            runs,
            vec![
                Mapping::single(0, 10, 0),
                Mapping::single(2, 11, 0),
                Mapping::single(3, 13, 0),
                Mapping {
                    virtual_begin: 4,
                    data_begin: 14,
                    length: 2,
                    time: 1
                },
            ]
        );
    }

    #[test]
    fn descending_data_blocks_do_not_form_a_run() {
        assert_eq!(
            runs_of(&[(0, 10, 0), (1, 9, 0)]),
            vec![Mapping::single(0, 10, 0), Mapping::single(1, 9, 0)]
        );
    }

    #[test]
    fn data_block_at_the_top_of_u64_does_not_overflow() {
        assert_eq!(
            runs_of(&[(0, u64::MAX, 0), (1, 0, 0)]),
            vec![Mapping::single(0, u64::MAX, 0), Mapping::single(1, 0, 0)]
        );
    }

    #[test]
    #[should_panic(expected = "out of order")]
    fn out_of_order_mappings_panic() {
        runs_of(&[(5, 0, 0), (5, 1, 0)]);
    }
}
