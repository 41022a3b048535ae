//! Allocation of metadata pages in `meta.dat`.
//!
//! Owns: which page numbers are in use, and when a freed page may be written again.
//! Invariants (they are what makes copy-on-write crash safe):
//! - Page 0 is the file header and is never handed out; 0 in a pointer means "no page".
//! - A page referenced by the last durable checkpoint root is never overwritten. A page is
//!   overwritten in place only if it was allocated in the current epoch (after the last
//!   checkpoint was prepared), so no root on disk can reference it.
//! - A page freed in the current epoch that an earlier root may reference is *pending*: it is
//!   neither in use nor allocatable until the next checkpoint, which no longer references it,
//!   is durable ([`PageAlloc::take_pending`] / [`PageAlloc::release`]).
//! - The bitmap saved in a checkpoint root marks exactly the pages that root references, so
//!   pages written after it (lost or garbage after a crash) are free again at open.

use std::collections::HashSet;

#[derive(Default)]
pub struct PageAlloc {
    /// One bit per page: in use by the current in-memory state.
    bits: Vec<u64>,
    /// Pages allocated in the current epoch (free to overwrite in place).
    fresh: HashSet<u64>,
    /// Freed in the current epoch but maybe referenced by a root on disk.
    pending: Vec<u64>,
    /// Freed by the checkpoint in flight; allocatable once it is durable.
    held: HashSet<u64>,
    /// Lowest page that may be free.
    cursor: u64,
    used: u64,
}

impl PageAlloc {
    /// An allocator from a saved bitmap (page 0 is always in use).
    pub fn from_bitmap(bits: Vec<u64>) -> PageAlloc {
        let mut a = PageAlloc {
            bits,
            ..Default::default()
        };
        if a.bits.is_empty() {
            a.bits.push(0);
        }
        a.bits[0] |= 1;
        a.used = a.bits.iter().map(|w| u64::from(w.count_ones())).sum();
        a.cursor = 1;
        a
    }

    pub fn is_used(&self, page: u64) -> bool {
        self.bits
            .get((page / 64) as usize)
            .is_some_and(|w| w & (1 << (page % 64)) != 0)
    }

    fn set(&mut self, page: u64, on: bool) {
        let w = (page / 64) as usize;
        if w >= self.bits.len() {
            self.bits.resize(w + 1, 0);
        }
        let was = self.bits[w] & (1 << (page % 64)) != 0;
        if on {
            self.bits[w] |= 1 << (page % 64);
        } else {
            self.bits[w] &= !(1 << (page % 64));
        }
        match (was, on) {
            (false, true) => self.used += 1,
            (true, false) => self.used -= 1,
            _ => {}
        }
    }

    /// A page to write a new copy of a node to.
    pub fn allocate(&mut self) -> u64 {
        let mut p = self.cursor.max(1);
        loop {
            let w = (p / 64) as usize;
            if w < self.bits.len() && self.bits[w] == u64::MAX {
                p = (w as u64 + 1) * 64;
                continue;
            }
            if !self.is_used(p) && !self.held.contains(&p) {
                break;
            }
            p += 1;
        }
        self.set(p, true);
        self.fresh.insert(p);
        self.cursor = p + 1;
        p
    }

    /// True if `page` may be overwritten in place (no root on disk references it).
    pub fn is_fresh(&self, page: u64) -> bool {
        self.fresh.contains(&page)
    }

    /// The state no longer references `page`.
    pub fn free(&mut self, page: u64) {
        if page == 0 {
            return;
        }
        self.set(page, false);
        if self.fresh.remove(&page) {
            self.cursor = self.cursor.min(page);
        } else {
            self.pending.push(page);
            self.held.insert(page);
        }
    }

    /// At checkpoint preparation: a new epoch starts. Returns the pages freed in the ending
    /// epoch; give them to [`PageAlloc::release`] once that checkpoint is durable.
    pub fn take_pending(&mut self) -> Vec<u64> {
        self.fresh.clear();
        std::mem::take(&mut self.pending)
    }

    /// The checkpoint that stopped referencing `pages` is durable: they may be reused.
    pub fn release(&mut self, pages: Vec<u64>) {
        for p in pages {
            self.held.remove(&p);
            self.cursor = self.cursor.min(p);
        }
    }

    /// The bitmap to save in a checkpoint root (pages the state references now).
    pub fn bitmap(&self) -> &[u64] {
        &self.bits
    }

    /// Pages in use.
    pub fn used_pages(&self) -> u64 {
        self.used
    }

    /// Bytes of RAM this allocator holds.
    pub fn ram_bytes(&self) -> u64 {
        (self.bits.capacity() * 8 + (self.fresh.capacity() + self.held.capacity()) * 16) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_of_a_durable_root_are_reused_only_after_the_next_checkpoint() {
        let mut a = PageAlloc::from_bitmap(Vec::new());
        let p1 = a.allocate();
        let p2 = a.allocate();
        assert_eq!((p1, p2), (1, 2));
        // p1 was just allocated: freeing it makes it reusable at once.
        a.free(p1);
        assert_eq!(a.allocate(), 1);
        // A checkpoint now references 1 and 2.
        let released = a.take_pending();
        assert!(released.is_empty());
        a.free(2);
        assert!(!a.is_fresh(1));
        // 2 is pending: not reused before the next checkpoint is durable.
        assert_eq!(a.allocate(), 3);
        let pending = a.take_pending();
        assert_eq!(pending, vec![2]);
        assert_eq!(a.allocate(), 4);
        a.release(pending);
        assert_eq!(a.allocate(), 2);
        assert_eq!(a.used_pages(), 5); // header + 1, 3, 4, 2
    }
}
