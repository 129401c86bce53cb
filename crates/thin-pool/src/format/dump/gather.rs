//! Step 2 of the dump's sharing analysis (see `dump::metadata`): the [`Gatherer`] splits the
//! devices' leaf sequences into runs of leaves that always occur together, and marks the
//! runs that more than one sequence lists (those become `<def>`s).

use persistent_data::MetadataBlock;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

/// Splits leaf sequences into runs that always occur together.
#[derive(Debug, Default)]
pub(super) struct Gatherer {
    prev: Option<u64>,
    heads: BTreeSet<u64>,
    tails: HashSet<u64>,
    successors: HashMap<u64, BTreeSet<u64>>,
    predecessor: HashMap<u64, u64>,
    shared: HashSet<u64>,
}

impl Gatherer {
    fn mark_head(&mut self, block: u64) {
        if !self.heads.insert(block) {
            self.shared.insert(block);
        }
    }

    pub(super) fn new_seq(&mut self) {
        if let Some(prev) = self.prev.take() {
            self.tails.insert(prev);
        }
    }

    pub(super) fn next(&mut self, block: u64) {
        match self.prev {
            Some(prev) => {
                let successors = self.successors.get_mut(&prev).expect("prev listed");
                if !successors.insert(block) {
                    self.shared.insert(block);
                }
                match self.predecessor.get(&block) {
                    Some(&p) if p != prev => self.mark_head(block),
                    Some(_) => {}
                    None => {
                        self.predecessor.insert(block, prev);
                    }
                }
            }
            None => self.mark_head(block),
        }
        self.successors.entry(block).or_default();
        self.prev = Some(block);
    }

    /// The runs by first leaf, each with whether it is shared. Leaves that form a cycle are
    /// corrupt metadata (the error names the first leaf of the run).
    pub(super) fn gather(mut self) -> persistent_data::Result<BTreeMap<u64, (Vec<u64>, bool)>> {
        self.new_seq();
        let mut extra_tails = Vec::new();
        for (&block, successors) in &self.successors {
            let first = successors.first();
            if successors.len() != 1 || first.is_some_and(|n| self.heads.contains(n)) {
                extra_tails.push(block);
            }
        }
        self.tails.extend(extra_tails);
        let mut follow_tails = Vec::new();
        for tail in &self.tails {
            if let Some(successors) = self.successors.get(tail) {
                follow_tails.extend(successors.iter().copied());
            }
        }
        for block in follow_tails {
            self.mark_head(block);
        }
        let mut runs = BTreeMap::new();
        for &head in &self.heads {
            let mut run = vec![head];
            let mut block = head;
            while !self.tails.contains(&block) {
                if run.len() > self.successors.len() {
                    return Err(persistent_data::Error::corrupt(
                        MetadataBlock::new(head),
                        "mapping leaves form a cycle",
                    ));
                }
                block = *self.successors[&block]
                    .first()
                    .expect("a block with one successor is not a tail");
                run.push(block);
            }
            runs.insert(head, (run, self.shared.contains(&head)));
        }
        Ok(runs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn gather(seqs: &[&[u64]]) -> Vec<(Vec<u64>, bool)> {
        let mut g = Gatherer::default();
        for seq in seqs {
            g.new_seq();
            for &b in *seq {
                g.next(b);
            }
        }
        g.gather().unwrap().into_values().collect()
    }

    #[test]
    fn gatherer_splits_sequences_into_atomic_runs() {
        assert_eq!(gather(&[]), vec![]);
        assert_eq!(gather(&[&[1, 2, 3]]), vec![(vec![1, 2, 3], false)]);
        assert_eq!(
            gather(&[&[1, 2], &[1, 2, 3]]),
            vec![(vec![1, 2], true), (vec![3], false)]
        );
        assert_eq!(
            gather(&[&[2, 3], &[1, 2, 3]]),
            vec![(vec![1], false), (vec![2, 3], true)]
        );
        assert_eq!(
            gather(&[&[1, 2, 3, 4], &[2, 3, 4, 5]]),
            vec![(vec![1], false), (vec![2, 3, 4], true), (vec![5], false)]
        );
        assert_eq!(
            gather(&[&[1, 2, 3, 4], &[2, 3, 4, 5, 6], &[3, 4], &[5, 6]]),
            vec![
                (vec![1], false),
                (vec![2], true),
                (vec![3, 4], true),
                (vec![5, 6], true)
            ]
        );
        assert_eq!(
            gather(&[&[1, 2], &[2, 1]]),
            vec![(vec![1], true), (vec![2], true)]
        );
    }
}
