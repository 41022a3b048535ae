//! The merge pass's sort: every live chunk's fingerprint and id, sorted by fingerprint within
//! a RAM budget, so that chunks holding the same data come together (docs/ARCHITECTURE.md
//! "Merge pass").
//!
//! Owns: a buffer of at most `budget / 24` entries; when it is full it is sorted and written
//! as a run to a [`Spill`] array (three words an entry, its pages sealed in a scratch file
//! past the array's own page budget), and [`FingerprintSort::finish`] merges the runs, one
//! cursor per run under a heap, into the pairs of duplicates.
//!
//! Invariants: entries come out in (fingerprint, id) order, so a pair `(id, to)` has `to` the
//! lowest id holding that fingerprint and `id` any other; RAM stays within the budget plus
//! the array's page budget; a scratch file failing is an error at the end, never a wrong pair.

use crate::attribution::SpillTo;
use crate::spill::Spill;
use condense_format::{Error, Fingerprint, Result};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Bytes an entry takes in the buffer (fingerprint and id).
const ENTRY_BYTES: u64 = 24;
/// Words an entry takes in a run.
const ENTRY_WORDS: u64 = 3;

/// An entry as it sorts: the fingerprint as two big-endian words (so the order is the bytes'
/// order), then the id.
type Key = (u64, u64, u64);

fn key(fp: &Fingerprint, id: u64) -> Key {
    let w = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&fp[at..at + 8]);
        u64::from_be_bytes(b)
    };
    (w(0), w(8), id)
}

/// The sort. See the module documentation.
pub struct FingerprintSort {
    buf: Vec<Key>,
    cap: usize,
    /// Runs written: (first entry, entries).
    runs: Vec<(u64, u64)>,
    store: Spill,
    entries: u64,
}

impl FingerprintSort {
    /// A sort holding at most `budget` bytes of entries in RAM (at least 1,024 entries), its
    /// runs going where `to` says.
    pub fn new(budget: u64, to: &SpillTo) -> FingerprintSort {
        let cap = (budget / ENTRY_BYTES).max(1024);
        FingerprintSort {
            buf: Vec::with_capacity(cap.min(1 << 20) as usize),
            cap: cap as usize,
            runs: Vec::new(),
            store: to.array(),
            entries: 0,
        }
    }

    pub fn push(&mut self, fp: &Fingerprint, id: u64) {
        self.buf.push(key(fp, id));
        if self.buf.len() >= self.cap {
            self.write_run();
        }
    }

    /// Entries pushed so far.
    pub fn len(&self) -> u64 {
        self.entries + self.buf.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Runs written so far (1 + the times the buffer filled).
    pub fn runs(&self) -> usize {
        self.runs.len()
    }

    fn write_run(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        self.buf.sort_unstable();
        let first = self.entries;
        for (i, &(a, b, id)) in self.buf.iter().enumerate() {
            let at = (first + i as u64) * ENTRY_WORDS;
            self.store.set(at, a);
            self.store.set(at + 1, b);
            self.store.set(at + 2, id);
        }
        self.runs.push((first, self.buf.len() as u64));
        self.entries += self.buf.len() as u64;
        self.buf.clear();
    }

    /// The duplicates: every chunk whose fingerprint a lower id holds, with that id.
    pub fn finish(mut self) -> Result<Duplicates> {
        self.write_run();
        self.buf = Vec::new();
        let mut d = Duplicates {
            store: self.store,
            cursors: self.runs,
            heap: BinaryHeap::new(),
            keeper: None,
            met: 0,
        };
        for run in 0..d.cursors.len() {
            d.advance(run);
        }
        d.check()?;
        Ok(d)
    }
}

/// The pairs of [`FingerprintSort::finish`], in fingerprint order: `(id, to)`.
pub struct Duplicates {
    store: Spill,
    /// Per run: its next entry and the entries left.
    cursors: Vec<(u64, u64)>,
    heap: BinaryHeap<Reverse<(Key, usize)>>,
    /// The fingerprint being met and its lowest id.
    keeper: Option<(u64, u64, u64)>,
    /// Entries taken from the runs so far (of [`FingerprintSort::len`]): the pass's progress.
    met: u64,
}

impl Duplicates {
    /// Put run `run`'s next entry on the heap, if it has one left.
    fn advance(&mut self, run: usize) {
        let Some(&(at, left)) = self.cursors.get(run) else {
            return;
        };
        if left == 0 {
            return;
        }
        let w = at * ENTRY_WORDS;
        let k = (
            self.store.get(w),
            self.store.get(w + 1),
            self.store.get(w + 2),
        );
        self.cursors[run] = (at + 1, left - 1);
        self.heap.push(Reverse((k, run)));
    }

    /// Entries met so far, pairs or not: of [`FingerprintSort::len`] in all.
    pub fn met(&self) -> u64 {
        self.met
    }

    /// The scratch file's first failure, if any: the pairs since may be wrong.
    pub fn check(&self) -> Result<()> {
        match self.store.error() {
            Some(e) => Err(Error::Invalid(format!(
                "the merge pass's sort failed: {e}; check the pool directory's free space"
            ))),
            None => Ok(()),
        }
    }
}

impl Iterator for Duplicates {
    type Item = (u64, u64);

    fn next(&mut self) -> Option<(u64, u64)> {
        while let Some(Reverse(((a, b, id), run))) = self.heap.pop() {
            self.advance(run);
            self.met += 1;
            match self.keeper {
                Some((ka, kb, to)) if (ka, kb) == (a, b) => return Some((id, to)),
                _ => self.keeper = Some((a, b, id)),
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(n: u64) -> Fingerprint {
        let mut f = [0u8; 16];
        f[..8].copy_from_slice(&n.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
        f
    }

    /// Ids with the fingerprint of `id % distinct`, pushed in a scrambled order: every id
    /// at or past `distinct` pairs with `id % distinct`, the lowest holder, in one run or
    /// in many.
    #[test]
    fn every_duplicate_pairs_with_the_lowest_id_across_runs() -> Result<()> {
        let (n, distinct) = (10_000u64, 3_000u64);
        for budget in [1 << 30, 1024 * ENTRY_BYTES] {
            let mut s = FingerprintSort::new(budget, &SpillTo::default());
            for i in 0..n {
                let id = (i * 7919) % n;
                s.push(&fp(id % distinct), id);
            }
            let runs = s.runs() + 1;
            let mut d = s.finish()?;
            let mut pairs: Vec<(u64, u64)> = d.by_ref().collect();
            assert_eq!(d.met(), n, "every entry met once");
            pairs.sort_unstable();
            let want: Vec<(u64, u64)> = (distinct..n).map(|id| (id, id % distinct)).collect();
            assert_eq!(pairs, want, "budget {budget} ({runs} runs)");
        }
        Ok(())
    }

    #[test]
    fn nothing_pushed_gives_nothing() -> Result<()> {
        let s = FingerprintSort::new(1 << 20, &SpillTo::default());
        assert_eq!(s.finish()?.count(), 0);
        Ok(())
    }
}
