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

use std::collections::HashMap;

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
    /// Lowest unit that may be free.
    cursor: u64,
    used: u64,
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
        a.cursor = HEADER_UNITS;
        a
    }

    fn free_at(&self, s: u64) -> bool {
        !bit(&self.bits, s) && !bit(&self.held, s)
    }

    /// A run of `n` units to write a page to.
    pub fn allocate(&mut self, n: u16) -> u64 {
        let n = u64::from(n.max(1));
        let mut start = self.cursor.max(HEADER_UNITS);
        loop {
            // Skip full words quickly.
            let w = (start / 64) as usize;
            if start.is_multiple_of(64) && w < self.bits.len() && self.bits[w] == u64::MAX {
                start += 64;
                continue;
            }
            match (start..start + n).find(|&s| !self.free_at(s)) {
                Some(taken) => start = taken + 1,
                None => break,
            }
        }
        for s in start..start + n {
            put(&mut self.bits, s, true);
        }
        self.used += n;
        self.fresh.insert(start, n as u16);
        if start == self.cursor {
            self.cursor = start + n;
        }
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
            self.cursor = self.cursor.min(start);
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
            self.cursor = self.cursor.min(start);
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

    /// Bytes of RAM this allocator holds.
    pub fn ram_bytes(&self) -> u64 {
        ((self.bits.capacity() + self.held.capacity()) * 8 + self.fresh.capacity() * 16) as u64
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
}
