//! Allocation of space for metadata pages in `meta.dat`, in 64-byte units.
//!
//! Owns: which units are in use, and when freed units may be written again.
//! Invariants (they are what makes copy-on-write crash safe):
//! - Units 0..64 (the first 4 KiB) are the file header and are never handed out; 0 in a pointer means "none".
//! - A run referenced by the last durable checkpoint root is never overwritten. A run is
//!   overwritten in place only if it was allocated in the current epoch (after the last
//!   checkpoint was prepared), so no root on disk can reference it.
//! - A run freed in the current epoch that an earlier root may reference is *pending*: it is
//!   neither in use nor allocatable until the next checkpoint, which no longer references it,
//!   is durable ([`PageAlloc::take_pending`] / [`PageAlloc::release`]).
//! - The bitmap saved in a checkpoint root marks exactly the units that root references, so
//!   pages written after it (lost or garbage after a crash) are free again at open.

//!
//! Free space is kept as coalesced extents, indexed by start and by length, so an allocation
//! is a best fit in O(log n) however fragmented the file is (a first-fit scan of the bitmap
//! made every allocation O(file) once the cache evicted under a full file).

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Sectors of the `meta.dat` header.
pub const HEADER_UNITS: u64 = 64;

#[derive(Default)]
pub struct PageAlloc {
    /// One bit per unit: in use by the current in-memory state.
    bits: Vec<u64>,
    /// Runs allocated in the current epoch (free to overwrite in place): start → length.
    fresh: HashMap<u64, u16>,
    /// Freed in the current epoch but maybe referenced by a root on disk.
    pending: Vec<(u64, u16)>,
    /// One bit per unit: freed by a checkpoint not yet durable (not allocatable).
    held: Vec<u64>,
    /// Allocatable extents below `top`, coalesced: start → length.
    free_by_start: BTreeMap<u64, u64>,
    /// The same extents as (length, start), for best fit.
    free_by_len: BTreeSet<(u64, u64)>,
    /// Every unit from here on is free.
    top: u64,
    used: u64,
    /// While metadata is compacted: runs are handed out below this unit when one fits there.
    ceiling: Option<u64>,
}

fn bit(v: &[u64], s: u64) -> bool {
    v.get((s / 64) as usize)
        .is_some_and(|w| w & (1 << (s % 64)) != 0)
}

fn put(v: &mut Vec<u64>, s: u64, on: bool) {
    let w = (s / 64) as usize;
    if w >= v.len() {
        v.resize(w + 1, 0);
    }
    if on {
        v[w] |= 1 << (s % 64);
    } else {
        v[w] &= !(1 << (s % 64));
    }
}

impl PageAlloc {
    /// An allocator from a saved bitmap (the header units are always in use).
    pub fn from_bitmap(bits: Vec<u64>) -> PageAlloc {
        let mut a = PageAlloc {
            bits,
            ..Default::default()
        };
        for s in 0..HEADER_UNITS {
            put(&mut a.bits, s, true);
        }
        a.used = a.bits.iter().map(|w| u64::from(w.count_ones())).sum();
        a.top = a.end();
        // Free extents below the top, one pass over the bitmap (whole words at a time).
        let mut run: Option<u64> = None;
        let mut s = HEADER_UNITS;
        while s < a.top {
            let w = a.bits[(s / 64) as usize];
            let whole = s.is_multiple_of(64) && s + 64 <= a.top && (w == 0 || w == u64::MAX);
            let (free, step) = if whole {
                (w == 0, 64)
            } else {
                (!bit(&a.bits, s), 1)
            };
            match (free, run) {
                (true, None) => run = Some(s),
                (false, Some(r)) => {
                    a.add_free(r, s - r);
                    run = None;
                }
                _ => {}
            }
            s += step;
        }
        if let Some(r) = run {
            a.add_free(r, a.top - r);
        }
        a
    }

    fn add_free(&mut self, start: u64, len: u64) {
        self.free_by_start.insert(start, len);
        self.free_by_len.insert((len, start));
    }

    fn remove_free(&mut self, start: u64, len: u64) {
        self.free_by_start.remove(&start);
        self.free_by_len.remove(&(len, start));
    }

    /// Make `start..start + len` allocatable, merged with its free neighbours (and into the
    /// free tail when it reaches `top`).
    fn give_back(&mut self, mut start: u64, mut len: u64) {
        if let Some((&ps, &pl)) = self.free_by_start.range(..start).next_back() {
            debug_assert!(ps + pl <= start, "free extents overlap at unit {start}");
            if ps + pl == start {
                self.remove_free(ps, pl);
                start = ps;
                len += pl;
            }
        }
        if let Some(&nl) = self.free_by_start.get(&(start + len)) {
            self.remove_free(start + len, nl);
            len += nl;
        }
        if start + len >= self.top {
            self.top = start;
        } else {
            self.add_free(start, len);
        }
    }

    /// A run of `n` units to write a page to: the smallest free extent that fits (lowest
    /// first among equals; while a ceiling is set, the smallest below it first), else the end
    /// of the file.
    pub fn allocate(&mut self, n: u16) -> u64 {
        let n = u64::from(n.max(1));
        let below = |&&(_, start): &&(u64, u64)| self.ceiling.is_none_or(|c| start + n <= c);
        let fit = match self.free_by_len.range((n, 0)..).find(below) {
            Some(e) => Some(*e),
            None => self.free_by_len.range((n, 0)..).next().copied(),
        };
        let start = match fit {
            Some((len, start)) => {
                self.remove_free(start, len);
                if len > n {
                    self.add_free(start + n, len - n);
                }
                start
            }
            None => {
                let start = self.top.max(HEADER_UNITS);
                self.top = start + n;
                start
            }
        };
        for s in start..start + n {
            debug_assert!(
                !bit(&self.bits, s) && !bit(&self.held, s),
                "unit {s} handed out twice"
            );
            put(&mut self.bits, s, true);
        }
        self.used += n;
        self.fresh.insert(start, n as u16);
        start
    }

    /// The length of the run at `start` if it was allocated in this epoch (no root on disk
    /// names it, so it may be overwritten in place).
    pub fn fresh_len(&self, start: u64) -> Option<u16> {
        self.fresh.get(&start).copied()
    }

    /// The state no longer references the run of `n` units at `start`.
    pub fn free(&mut self, start: u64, n: u16) {
        if start == 0 {
            return;
        }
        for s in start..start + u64::from(n) {
            if bit(&self.bits, s) {
                put(&mut self.bits, s, false);
                self.used -= 1;
            }
        }
        if self.fresh.remove(&start).is_some() {
            self.give_back(start, u64::from(n));
        } else {
            for s in start..start + u64::from(n) {
                put(&mut self.held, s, true);
            }
            self.pending.push((start, n));
        }
    }

    /// At checkpoint preparation: a new epoch starts. Returns the runs freed in the ending
    /// epoch; give them to [`PageAlloc::release`] once that checkpoint is durable.
    pub fn take_pending(&mut self) -> Vec<(u64, u16)> {
        self.fresh.clear();
        std::mem::take(&mut self.pending)
    }

    /// The checkpoint that stopped referencing `runs` is durable: they may be reused.
    pub fn release(&mut self, runs: Vec<(u64, u16)>) {
        for (start, n) in runs {
            for s in start..start + u64::from(n) {
                put(&mut self.held, s, false);
            }
            self.give_back(start, u64::from(n));
        }
    }

    /// The bitmap to save in a checkpoint root (units the state references now).
    pub fn bitmap(&self) -> &[u64] {
        &self.bits
    }

    /// Sectors in use.
    pub fn used_units(&self) -> u64 {
        self.used
    }

    /// One past the highest unit in use or held (the file need not be longer).
    pub fn end(&self) -> u64 {
        let last = |v: &[u64]| {
            v.iter()
                .rposition(|&w| w != 0)
                .map_or(0, |i| i as u64 * 64 + 64 - u64::from(v[i].leading_zeros()))
        };
        last(&self.bits).max(last(&self.held))
    }

    /// Compaction: the lowest unit `t` (a multiple of 64) such that the units in use from
    /// `t` on, at most `max_units`, would take at most 4/5 of the free units below it; `None`
    /// unless moving them would cut at least `min_gain` units off the end of the file, or
    /// while runs are held (a checkpoint is not durable yet).
    pub fn compaction_target(&self, max_units: u64, min_gain: u64) -> Option<u64> {
        if self.held.iter().any(|&w| w != 0) {
            return None;
        }
        let end = self.end();
        let mut t = end.div_ceil(64) * 64;
        let mut above = 0u64;
        while t > HEADER_UNITS {
            let w = self.bits.get((t / 64 - 1) as usize).copied().unwrap_or(0);
            let up = above + u64::from(w.count_ones());
            let free_below = (t - 64) - (self.used - up);
            if up > max_units || up * 5 > free_below * 4 {
                break;
            }
            above = up;
            t -= 64;
        }
        (end.saturating_sub(t) >= min_gain.max(1)).then_some(t)
    }

    /// Hand out runs below `ceiling` first while it is set (metadata compaction).
    pub fn set_ceiling(&mut self, ceiling: Option<u64>) {
        self.ceiling = ceiling;
    }

    /// Bytes of RAM this allocator holds (a B-tree entry costs about 3 words).
    pub fn ram_bytes(&self) -> u64 {
        ((self.bits.capacity() + self.held.capacity()) * 8
            + self.fresh.capacity() * 16
            + self.free_by_start.len() * 48) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_a_durable_root_are_reused_only_after_the_next_checkpoint() {
        let mut a = PageAlloc::from_bitmap(Vec::new());
        let h = HEADER_UNITS;
        let p1 = a.allocate(2);
        let p2 = a.allocate(8);
        assert_eq!((p1, p2), (h, h + 2));
        // p1 was just allocated: freeing it makes it reusable at once.
        a.free(p1, 2);
        assert_eq!(a.allocate(1), h);
        // A checkpoint now references h and h+2..h+10.
        assert!(a.take_pending().is_empty());
        a.free(h + 2, 8);
        assert_eq!(a.fresh_len(h), None);
        // h+2..h+10 is pending: not reused before the next checkpoint is durable.
        assert_eq!(a.allocate(4), h + 10);
        let pending = a.take_pending();
        assert_eq!(pending, vec![(h + 2, 8)]);
        assert_eq!(a.allocate(1), h + 1);
        assert_eq!(a.allocate(2), h + 14);
        a.release(pending);
        assert_eq!(a.allocate(8), h + 2);
        assert_eq!(a.used_units(), h + 1 + 1 + 4 + 2 + 8);
        assert_eq!(a.end(), h + 16);
    }

    /// Random allocations, frees and checkpoints: runs never overlap, held runs are never
    /// handed out, the bitmap marks exactly the live runs, and an allocator rebuilt from the
    /// bitmap (as at open) hands out only units the old one considered free.
    #[test]
    fn random_workload_keeps_runs_disjoint() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let mut a = PageAlloc::from_bitmap(Vec::new());
        let mut live: Vec<(u64, u16)> = Vec::new();
        let mut pending: Vec<(u64, u16)> = Vec::new();
        for step in 0..20_000 {
            match rnd(10) {
                0..=5 => {
                    let n = 1 + rnd(64) as u16;
                    let s = a.allocate(n);
                    for &(ls, ln) in live.iter().chain(pending.iter()) {
                        let disjoint = s + u64::from(n) <= ls || ls + u64::from(ln) <= s;
                        assert!(disjoint, "step {step}: {s}+{n} overlaps {ls}+{ln}");
                    }
                    live.push((s, n));
                }
                6..=8 if !live.is_empty() => {
                    let (s, n) = live.swap_remove(rnd(live.len() as u64) as usize);
                    let fresh = a.fresh_len(s).is_some();
                    a.free(s, n);
                    if !fresh {
                        pending.push((s, n));
                    }
                }
                _ => {
                    let mut p = a.take_pending();
                    p.sort_unstable();
                    pending.sort_unstable();
                    assert_eq!(p, pending);
                    a.release(p);
                    pending.clear();
                }
            }
        }
        let units: u64 = live.iter().map(|&(_, n)| u64::from(n)).sum();
        assert_eq!(a.used_units(), HEADER_UNITS + units);
        for &(s, n) in &live {
            assert!((s..s + u64::from(n)).all(|u| bit(a.bitmap(), u)));
        }
        // Reopen from the bitmap (pending runs become free, as after a durable checkpoint).
        let mut b = PageAlloc::from_bitmap(a.bitmap().to_vec());
        assert_eq!(b.used_units(), a.used_units());
        for _ in 0..2_000 {
            let n = 1 + rnd(64) as u16;
            let s = b.allocate(n);
            for &(ls, ln) in &live {
                assert!(s + u64::from(n) <= ls || ls + u64::from(ln) <= s);
            }
            live.push((s, n));
        }
    }
}
