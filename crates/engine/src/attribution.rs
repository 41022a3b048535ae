//! Space attribution: for every volume and snapshot, the stored chunks only it references
//! (what deleting it would free) and those it shares with other volumes or snapshots.
//!
//! Owns: per chunk, which tree (a volume's or snapshot's block map) names it and how many of
//! that tree's entries do, or, for a chunk several trees name, each of them with its count;
//! and per tree the totals: exclusive chunks and their stored bytes, shared chunks and theirs.
//! Kept in RAM only: built from the block maps and the chunk table the first time a figure is
//! asked for after an open (see [`crate::metadata::Metadata::attribution`]), then changed by
//! every map change [`crate::metadata::Metadata`] applies, so `stats` never walks a map.
//! A daemon counts in steps ([`Counting`]), letting go of the state lock between them, so
//! I/O goes on while the figures are first counted.
//!
//! Invariants:
//! - A chunk is in exactly one state: named by no tree, by one tree (with that tree's entry
//!   count), or by two or more (each with its count, none zero).
//! - The counts are per tree, not per leaf page: a leaf a volume shares with its snapshot
//!   names its chunks for both trees, whatever the chunk table's reference count says.
//! - Sum rule: the exclusive chunks of all trees plus the pool's shared chunks are the live
//!   chunks, and likewise their stored bytes ([`Attribution::totals`]).
//! - A change that contradicts the state (a tree dropping an entry it does not hold) marks the
//!   attribution broken; broken figures are never shown, they are rebuilt.

use crate::format::{MAP_PAGE_ENTRIES, RECORD_HEADER_BYTES};
use std::collections::{HashMap, VecDeque};

/// No tree names the chunk.
const NOBODY: u32 = u32::MAX;
/// Two or more trees name the chunk: see `holders`.
const SEVERAL: u32 = u32::MAX - 1;

/// A number of chunks and their stored (compressed, sealed) payload bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Space {
    pub chunks: u64,
    pub stored_bytes: u64,
}

impl Space {
    /// Bytes of the chunks' records in segments: what GC frees once nothing names them.
    pub fn record_bytes(&self) -> u64 {
        self.stored_bytes + self.chunks * RECORD_HEADER_BYTES as u64
    }

    fn add(&mut self, stored: u32) {
        self.chunks += 1;
        self.stored_bytes += u64::from(stored);
    }

    fn sub(&mut self, stored: u32) {
        self.chunks = self.chunks.saturating_sub(1);
        self.stored_bytes = self.stored_bytes.saturating_sub(u64::from(stored));
    }
}

/// One tree's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TreeSpace {
    /// Chunks no other tree names: freed (at the next GC) if this tree were deleted.
    pub exclusive: Space,
    /// Chunks this tree names that at least one other tree names too.
    pub shared: Space,
}

impl TreeSpace {
    /// Every chunk the tree names.
    pub fn referenced(&self) -> Space {
        Space {
            chunks: self.exclusive.chunks + self.shared.chunks,
            stored_bytes: self.exclusive.stored_bytes + self.shared.stored_bytes,
        }
    }
}

/// The attribution of every live chunk to the trees naming it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Attribution {
    /// Per chunk id: (the one tree naming it, its entry count), or (`NOBODY` / `SEVERAL`, 0).
    owner: Vec<(u32, u32)>,
    /// The chunks several trees name: each tree and its entry count.
    holders: HashMap<u64, Vec<(u32, u32)>>,
    trees: HashMap<u32, TreeSpace>,
    /// Chunks two or more trees name (each counted once).
    shared: Space,
    /// The first contradiction met, if any.
    broken: Option<String>,
}

impl Attribution {
    /// `n` more entries of `tree` name chunk `id` (of `stored` payload bytes).
    pub fn add(&mut self, tree: u32, id: u64, n: u32, stored: u32) {
        if n == 0 {
            return;
        }
        let Ok(i) = usize::try_from(id) else {
            return self.broke(format!("chunk id {id} does not fit in memory"));
        };
        if i >= self.owner.len() {
            self.owner.resize(i + 1, (NOBODY, 0));
        }
        match self.owner[i] {
            (NOBODY, _) => {
                self.owner[i] = (tree, n);
                self.trees.entry(tree).or_default().exclusive.add(stored);
            }
            (t, k) if t == tree => self.owner[i] = (t, k + n),
            (SEVERAL, _) => {
                let h = self.holders.entry(id).or_default();
                match h.iter().position(|&(t, _)| t == tree) {
                    Some(at) => h[at].1 += n,
                    None => {
                        h.push((tree, n));
                        self.trees.entry(tree).or_default().shared.add(stored);
                    }
                }
            }
            (other, k) => {
                // A second tree: the chunk stops being the first one's alone.
                self.owner[i] = (SEVERAL, 0);
                self.holders.insert(id, vec![(other, k), (tree, n)]);
                let o = self.trees.entry(other).or_default();
                o.exclusive.sub(stored);
                o.shared.add(stored);
                self.trees.entry(tree).or_default().shared.add(stored);
                self.shared.add(stored);
            }
        }
    }

    /// `n` entries of `tree` naming chunk `id` are gone.
    pub fn remove(&mut self, tree: u32, id: u64, n: u32, stored: u32) {
        if n == 0 {
            return;
        }
        let state = usize::try_from(id)
            .ok()
            .and_then(|i| self.owner.get(i).map(|&o| (i, o)));
        match state {
            Some((i, (t, k))) if t == tree && k >= n => {
                self.owner[i] = if k == n { (NOBODY, 0) } else { (t, k - n) };
                if k == n {
                    self.trees.entry(tree).or_default().exclusive.sub(stored);
                }
            }
            Some((i, (SEVERAL, _))) => self.remove_shared(tree, i, id, n, stored),
            _ => self.broke(format!(
                "volume id {tree} dropped {n} entries naming chunk {id}, which it did not hold"
            )),
        }
    }

    fn remove_shared(&mut self, tree: u32, i: usize, id: u64, n: u32, stored: u32) {
        let Some(h) = self.holders.get_mut(&id) else {
            return self.broke(format!("shared chunk {id} has no holders"));
        };
        let Some(at) = h.iter().position(|&(t, k)| t == tree && k >= n) else {
            return self.broke(format!(
                "volume id {tree} dropped {n} entries naming chunk {id}, which it did not hold"
            ));
        };
        h[at].1 -= n;
        if h[at].1 > 0 {
            return;
        }
        h.swap_remove(at);
        self.trees.entry(tree).or_default().shared.sub(stored);
        if let [(last, k)] = h[..] {
            // One tree left: the chunk is now that tree's alone.
            self.holders.remove(&id);
            self.owner[i] = (last, k);
            let o = self.trees.entry(last).or_default();
            o.shared.sub(stored);
            o.exclusive.add(stored);
            self.shared.sub(stored);
        }
    }

    /// A tree that names no chunk any more is forgotten.
    pub fn forget_tree(&mut self, tree: u32) {
        if self
            .trees
            .get(&tree)
            .is_some_and(|t| *t != TreeSpace::default())
        {
            self.broke(format!(
                "volume id {tree} deleted while it still names chunks"
            ));
        }
        self.trees.remove(&tree);
    }

    fn broke(&mut self, what: String) {
        if self.broken.is_none() {
            tracing::warn!("space attribution broken ({what}); it will be rebuilt");
            self.broken = Some(what);
        }
    }

    /// The first contradiction met, if any: the figures are wrong and must be rebuilt.
    pub fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// Tree `tree`'s figures (zero for a tree that names no chunk).
    pub fn tree(&self, tree: u32) -> TreeSpace {
        self.trees.get(&tree).copied().unwrap_or_default()
    }

    /// The pool's shared chunks: named by two or more trees, each counted once.
    pub fn shared(&self) -> Space {
        self.shared
    }

    /// Every live chunk, by the sum rule: the trees' exclusive parts plus the shared part.
    pub fn totals(&self) -> Space {
        self.trees.values().fold(self.shared, |s, t| Space {
            chunks: s.chunks + t.exclusive.chunks,
            stored_bytes: s.stored_bytes + t.exclusive.stored_bytes,
        })
    }

    /// RAM held: 8 bytes per chunk id, and the holder lists of shared chunks.
    pub fn ram_bytes(&self) -> u64 {
        let per_shared = std::mem::size_of::<(u64, Vec<(u32, u32)>)>() as u64 + 8;
        let lists: u64 = self.holders.values().map(|h| h.capacity() as u64 * 8).sum();
        (self.owner.capacity() * std::mem::size_of::<(u32, u32)>()) as u64
            + self.holders.capacity() as u64 * per_shared
            + lists
    }
}

/// A count from scratch made in steps, between which the pool goes on changing
/// ([`crate::metadata::Metadata::count_attribution_step`]): first the chunk table's stored
/// lengths, then each tree's leaves in order.
///
/// Invariant: `a` holds exactly the entries of the map parts already walked. A change to an
/// entry the walk has passed ([`Counting::passed`]) is applied to `a` as it happens; a change
/// ahead of the walk is left for the walk to see. A tree added or released while counting
/// (snapshot, clone, rollback, delete) ends the count, which then starts again.
#[derive(Debug, Default)]
pub struct Counting {
    pub(crate) a: Attribution,
    /// Stored length of each chunk live when its chunk-table page was scanned; a chunk made
    /// after that is looked up in the chunk table by the walk.
    pub(crate) stored: HashMap<u64, u32>,
    /// The next chunk-table page to scan; `None` once the scan is done.
    pub(crate) chunk_page: Option<u64>,
    /// Trees not walked yet, in the order they will be; the first is being walked.
    pub(crate) trees: VecDeque<u32>,
    /// The next leaf of the tree being walked.
    pub(crate) next_leaf: u64,
    /// Steps made, the longest one, and when the first began (for the log).
    pub(crate) steps: u64,
    pub(crate) longest: std::time::Duration,
    pub(crate) started: Option<std::time::Instant>,
}

impl Counting {
    /// A count of `trees`, the trees there are when it starts (a tree made later has an
    /// empty map at first: its changes all go to `a`).
    /// Room is made up front for `chunk_ids` ids and `live` live chunks, so no step pays for
    /// growing a table of them.
    pub fn new(trees: impl IntoIterator<Item = u32>, chunk_ids: u64, live: u64) -> Counting {
        let mut a = Attribution::default();
        a.owner
            .reserve_exact(usize::try_from(chunk_ids).unwrap_or(0));
        Counting {
            a,
            stored: HashMap::with_capacity(usize::try_from(live).unwrap_or(0)),
            chunk_page: Some(0),
            trees: trees.into_iter().collect(),
            ..Default::default()
        }
    }

    /// Whether entry `block` of tree `tree` is behind the walk (a change to it goes to `a`).
    pub fn passed(&self, tree: u32, block: u64) -> bool {
        match self.trees.iter().position(|&t| t == tree) {
            None => true,
            Some(0) if self.chunk_page.is_none() => {
                block / (MAP_PAGE_ENTRIES as u64) < self.next_leaf
            }
            Some(_) => false,
        }
    }

    /// Every tree walked.
    pub fn done(&self) -> bool {
        self.chunk_page.is_none() && self.trees.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sums_hold(a: &Attribution, chunks: u64, stored: u64) {
        assert_eq!(
            a.totals(),
            Space {
                chunks,
                stored_bytes: stored
            }
        );
        assert!(a.broken().is_none());
    }

    #[test]
    fn a_chunk_moves_between_exclusive_and_shared() {
        let mut a = Attribution::default();
        a.add(1, 7, 2, 100);
        assert_eq!(a.tree(1).exclusive.chunks, 1);
        sums_hold(&a, 1, 100);
        a.add(2, 7, 1, 100);
        assert_eq!(a.tree(1).exclusive.chunks, 0);
        assert_eq!(a.tree(1).shared.stored_bytes, 100);
        assert_eq!(a.tree(2).shared.stored_bytes, 100);
        assert_eq!(a.shared().chunks, 1);
        sums_hold(&a, 1, 100);
        a.add(3, 7, 1, 100);
        a.remove(1, 7, 1, 100);
        assert_eq!(a.tree(1).shared.chunks, 1, "tree 1 still names it once");
        a.remove(1, 7, 1, 100);
        a.remove(2, 7, 1, 100);
        // Tree 3 alone names it now: it is tree 3's to free.
        assert_eq!(a.tree(3).exclusive.stored_bytes, 100);
        assert_eq!(a.shared().chunks, 0);
        assert_eq!(a.tree(1), TreeSpace::default());
        sums_hold(&a, 1, 100);
        a.remove(3, 7, 1, 100);
        sums_hold(&a, 0, 0);
        a.forget_tree(3);
        assert!(a.broken().is_none());
    }

    #[test]
    fn a_drop_of_what_a_tree_does_not_hold_breaks_it() {
        let mut a = Attribution::default();
        a.add(1, 3, 1, 10);
        a.remove(2, 3, 1, 10);
        assert!(a.broken().is_some());
        let mut b = Attribution::default();
        b.remove(1, 99, 1, 10);
        assert!(b.broken().is_some());
    }

    #[test]
    fn the_walk_passes_trees_in_order_after_the_chunk_table() {
        let mut c = Counting::new([4, 9], 0, 0);
        assert!(
            !c.passed(4, 0),
            "nothing is passed while the chunk table is scanned"
        );
        assert!(
            c.passed(7, 0),
            "a tree made after the count began is passed"
        );
        c.chunk_page = None;
        c.next_leaf = 2;
        let per = MAP_PAGE_ENTRIES as u64;
        assert!(c.passed(4, 2 * per - 1));
        assert!(!c.passed(4, 2 * per));
        assert!(!c.passed(9, 0));
        c.trees.pop_front();
        c.next_leaf = 0;
        assert!(c.passed(4, 5 * per), "a walked tree is passed everywhere");
        assert!(!c.passed(9, 0));
        c.trees.pop_front();
        assert!(c.done());
    }
}
