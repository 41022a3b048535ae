//! Space attribution: for every volume and snapshot, the stored chunks only it references
//! (what deleting it would free) and those it shares with other volumes or snapshots.
//!
//! Owns: per chunk, which tree (a volume's or snapshot's block map, or a deleted one's map
//! being released, each by its [`TreeId`]) names it and how many of that tree's entries do,
//! or, for a chunk several trees name, each of them with its count; and per tree the totals:
//! exclusive chunks and their stored bytes, shared chunks and theirs. A tree is held under a
//! slot of its own, so a map detached for release keeps its entries under its new id at
//! once ([`Attribution::rename_tree`]) and gives them up step by step as it is released.
//! Not stored with the pool: built from the block maps and the chunk table the first time a
//! figure is asked for after an open (see [`crate::metadata::Metadata::attribution`]), then
//! changed by every map change [`crate::metadata::Metadata`] applies, so `stats` never walks a
//! map. A daemon counts in steps ([`Counting`]), letting go of the state lock between them, so
//! I/O goes on while the figures are first counted, and walks a tree a snapshot, clone or
//! rollback adds the same way ([`Counting::resume`]).
//! The per-chunk words live in [`Spill`] arrays: pages past a RAM budget go to a sealed
//! scratch file ([`SpillTo`]), so a pool far beyond RAM has its figures too.
//!
//! Invariants:
//! - A chunk is in exactly one state: named by no tree, by one tree (with that tree's entry
//!   count), or by two or more (each with its count, none zero).
//! - The counts are per tree, not per leaf page: a leaf a volume shares with its snapshot
//!   names its chunks for both trees, whatever the chunk table's reference count says.
//! - Sum rule: the exclusive chunks of all trees plus the pool's shared chunks are the live
//!   chunks, and likewise their stored bytes ([`Attribution::totals`]).
//! - A change that contradicts the state (a tree dropping an entry it does not hold), or a
//!   scratch file failing, marks the attribution broken; broken figures are never shown, they
//!   are rebuilt.
//! - Every node of a holder chain is in one chain or on the free list.
//! - A tree id has at most one slot, and a slot at most one tree id; a slot is never handed
//!   out twice, so a tree made under a renamed tree's old id starts empty.

use crate::page_cache::TreeId;
use crate::spill::{Spill, PAGE_WORDS};
use condense_format::{MAP_PAGE_ENTRIES, RECORD_HEADER_BYTES};
use condense_store::io::Dir;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// The tree field of an owner word whose chunk two or more trees name: its low half is then
/// the first node of the holder chain, plus one.
const SEVERAL: u32 = u32::MAX;
/// Words of a holder-chain node: `NODE_HOLDERS` holder words (0: empty), then the next
/// node plus one (0: the chain ends).
const NODE_WORDS: u64 = 4;
const NODE_HOLDERS: u64 = NODE_WORDS - 1;

/// An owner or holder word: the tree of slot `slot` names the chunk with `n` (at least 1)
/// entries.
fn holder(slot: u32, n: u32) -> u64 {
    (u64::from(slot) << 32) | u64::from(n)
}

fn unpack(w: u64) -> (u32, u32) {
    ((w >> 32) as u32, w as u32)
}

/// Where the attribution's pages go past their RAM budget, and that budget.
#[derive(Clone)]
pub struct SpillTo {
    /// The directory giving scratch files ([`Dir::scratch_file`]); `None`: all in RAM.
    pub dir: Option<Arc<dyn Dir>>,
    /// Words per page.
    pub page_words: usize,
    /// Pages each array (owner words, holder chains, a count's stored lengths) keeps in RAM.
    pub pages: usize,
}

/// Pages each of the attribution's arrays keeps in RAM by default: 32 MiB of 4 KiB pages
/// (the owner words of 4M chunk ids).
pub const SPILL_RAM_PAGES: usize = 8192;

impl Default for SpillTo {
    /// All in RAM (the simulator's default, repair, and the check's oracle).
    fn default() -> SpillTo {
        SpillTo {
            dir: None,
            page_words: PAGE_WORDS,
            pages: SPILL_RAM_PAGES,
        }
    }
}

impl SpillTo {
    /// A new array: on a scratch file of `dir` when it gives one, else in RAM. Without the
    /// scratch file `dir` should have given, the array stays in RAM up to its budget and
    /// fails past it, saying why (the figures are then missing, with that message).
    pub fn array(&self) -> Spill {
        let Some(dir) = &self.dir else {
            return Spill::in_ram(self.page_words);
        };
        match dir.scratch_file() {
            Ok(Some(f)) => Spill::on_file(f, self.page_words, self.pages),
            Ok(None) => Spill::in_ram(self.page_words),
            // A read-only directory, say: enough for a pool whose figures fit in RAM.
            Err(e) => Spill::in_ram_up_to(
                self.page_words,
                self.pages,
                format!(
                    "no scratch file could be made in {} ({e}); the figures of a pool this \
                     large need one there (about 8 bytes per chunk): check the directory's \
                     permissions and free space",
                    dir.describe()
                ),
            ),
        }
    }
}

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
#[derive(Debug, Default)]
pub struct Attribution {
    /// Per chunk id one word: 0 (no tree names it), [`holder`] (the one tree naming it and
    /// its entry count), or [`SEVERAL`] with the first node of its holder chain.
    owner: Spill,
    /// The holder chains of chunks several trees name, in nodes of [`NODE_WORDS`]; free
    /// nodes are chained from `free`.
    nodes: Spill,
    /// Nodes ever handed out.
    next_node: u64,
    /// The first free node plus one (0: none).
    free: u64,
    /// Each tree's slot, the tree field of its words.
    slots: HashMap<TreeId, u32>,
    /// Slots ever handed out.
    next_slot: u32,
    /// The last tree looked up and its slot (runs of changes name one tree).
    last: Option<(TreeId, u32)>,
    /// Each slot's figures.
    trees: HashMap<u32, TreeSpace>,
    /// Chunks two or more trees name (each counted once).
    shared: Space,
    /// The first contradiction met, if any.
    broken: Option<String>,
}

impl Attribution {
    /// An empty attribution whose pages go where `to` says past its RAM budget.
    pub fn new(to: &SpillTo) -> Attribution {
        Attribution {
            owner: to.array(),
            nodes: to.array(),
            ..Default::default()
        }
    }

    /// Tree `tree`'s slot, handed out now if it has none.
    fn slot(&mut self, tree: TreeId) -> Option<u32> {
        if let Some((t, s)) = self.last {
            if t == tree {
                return Some(s);
            }
        }
        let slot = match self.slots.get(&tree) {
            Some(&s) => s,
            None if self.next_slot == SEVERAL => {
                self.broke("more than 4G trees".into());
                return None;
            }
            None => {
                self.next_slot += 1;
                self.slots.insert(tree, self.next_slot - 1);
                self.next_slot - 1
            }
        };
        self.last = Some((tree, slot));
        Some(slot)
    }

    /// `n` more entries of `tree` name chunk `id` (of `stored` payload bytes).
    pub fn add(&mut self, tree: TreeId, id: u64, n: u32, stored: u32) {
        if let Some(slot) = self.slot(tree) {
            self.add_slot(slot, id, n, stored);
        }
    }

    fn add_slot(&mut self, tree: u32, id: u64, n: u32, stored: u32) {
        if n == 0 {
            return;
        }
        match unpack(self.owner.get(id)) {
            (_, 0) => {
                self.owner.set(id, holder(tree, n));
                self.trees.entry(tree).or_default().exclusive.add(stored);
            }
            (t, k) if t == tree => match k.checked_add(n) {
                Some(k) => self.owner.set(id, holder(t, k)),
                None => self.broke(format!("tree slot {tree} names chunk {id} 4G times")),
            },
            (SEVERAL, head) => self.add_shared(tree, id, head, n, stored),
            (other, k) => {
                // A second tree: the chunk stops being the first one's alone.
                let Some(head) = self.new_node([holder(other, k), holder(tree, n), 0], 0) else {
                    return;
                };
                self.owner.set(id, holder(SEVERAL, head));
                let o = self.trees.entry(other).or_default();
                o.exclusive.sub(stored);
                o.shared.add(stored);
                self.trees.entry(tree).or_default().shared.add(stored);
                self.shared.add(stored);
            }
        }
    }

    fn add_shared(&mut self, tree: u32, id: u64, head: u32, n: u32, stored: u32) {
        let (found, empty) = self.find(head, tree);
        if let Some((at, k)) = found {
            match k.checked_add(n) {
                Some(k) => self.nodes.set(at, holder(tree, k)),
                None => self.broke(format!("tree slot {tree} names chunk {id} 4G times")),
            }
            return;
        }
        match empty {
            Some(at) => self.nodes.set(at, holder(tree, n)),
            None => {
                let Some(first) = self.new_node([holder(tree, n), 0, 0], u64::from(head)) else {
                    return;
                };
                self.owner.set(id, holder(SEVERAL, first));
            }
        }
        self.trees.entry(tree).or_default().shared.add(stored);
    }

    /// `n` entries of `tree` naming chunk `id` are gone.
    pub fn remove(&mut self, tree: TreeId, id: u64, n: u32, stored: u32) {
        match self.slot(tree) {
            Some(slot) if n > 0 => self.remove_slot(slot, id, n, stored),
            _ => {}
        }
    }

    fn remove_slot(&mut self, tree: u32, id: u64, n: u32, stored: u32) {
        if n == 0 {
            return;
        }
        match unpack(self.owner.get(id)) {
            (t, k) if t == tree && k >= n => {
                self.owner
                    .set(id, if k == n { 0 } else { holder(t, k - n) });
                if k == n {
                    self.trees.entry(tree).or_default().exclusive.sub(stored);
                }
            }
            (SEVERAL, head) if head > 0 => self.remove_shared(tree, id, head, n, stored),
            _ => self.broke(format!(
                "tree slot {tree} dropped {n} entries naming chunk {id}, which it did not hold"
            )),
        }
    }

    fn remove_shared(&mut self, tree: u32, id: u64, head: u32, n: u32, stored: u32) {
        let Some((at, k)) = self.find(head, tree).0.filter(|&(_, k)| k >= n) else {
            return self.broke(format!(
                "tree slot {tree} dropped {n} entries naming chunk {id}, which it did not hold"
            ));
        };
        if k > n {
            return self.nodes.set(at, holder(tree, k - n));
        }
        self.nodes.set(at, 0);
        self.trees.entry(tree).or_default().shared.sub(stored);
        let (left, nodes) = self.chain(head);
        if let [(last, k)] = left[..] {
            // One tree left: the chunk is now that tree's alone.
            self.free_chain(head);
            self.owner.set(id, holder(last, k));
            let o = self.trees.entry(last).or_default();
            o.shared.sub(stored);
            o.exclusive.add(stored);
            self.shared.sub(stored);
        } else if nodes > (left.len() as u64).div_ceil(NODE_HOLDERS) {
            // Holders left fit in fewer nodes: the chain is written again, packed.
            self.free_chain(head);
            let mut next = 0;
            for part in left.rchunks(NODE_HOLDERS as usize) {
                let w = |i: usize| part.get(i).map_or(0, |&(t, k)| holder(t, k));
                match self.new_node([w(0), w(1), w(2)], next) {
                    Some(node) => next = u64::from(node),
                    None => return,
                }
            }
            self.owner.set(id, holder(SEVERAL, next as u32));
        }
    }

    /// Calls `visit` with the nodes and the first word of each node of the chain from `head`,
    /// in order, until it answers false. The next node is read before the visit (which may
    /// rewrite it), and a chain is never walked past the nodes ever handed out, so a damaged
    /// one cannot loop.
    fn walk(&mut self, head: u32, mut visit: impl FnMut(&mut Spill, u64) -> bool) {
        let (mut node, mut steps) = (u64::from(head), 0);
        while node > 0 && steps <= self.next_node {
            let base = (node - 1) * NODE_WORDS;
            let next = self.nodes.get(base + NODE_HOLDERS);
            if !visit(&mut self.nodes, base) {
                return;
            }
            node = next;
            steps += 1;
        }
    }

    /// Tree `tree`'s holder word in the chain from `head` (its word's index and count), and
    /// the first empty holder word met.
    fn find(&mut self, head: u32, tree: u32) -> (Option<(u64, u32)>, Option<u64>) {
        let (mut found, mut empty) = (None, None);
        self.walk(head, |nodes, base| {
            for at in base..base + NODE_HOLDERS {
                match unpack(nodes.get(at)) {
                    (_, 0) => {
                        empty.get_or_insert(at);
                    }
                    (t, k) if t == tree => {
                        found = Some((at, k));
                        return false;
                    }
                    _ => {}
                }
            }
            true
        });
        (found, empty)
    }

    /// The holders of the chain from `head`, and its number of nodes.
    fn chain(&mut self, head: u32) -> (Vec<(u32, u32)>, u64) {
        let (mut held, mut nodes) = (Vec::new(), 0);
        self.walk(head, |words, base| {
            nodes += 1;
            for at in base..base + NODE_HOLDERS {
                let (t, k) = unpack(words.get(at));
                if k > 0 {
                    held.push((t, k));
                }
            }
            true
        });
        (held, nodes)
    }

    /// A node holding `holders` (0: an empty word) followed by node `next` (plus one); its
    /// number plus one.
    fn new_node(&mut self, holders: [u64; NODE_HOLDERS as usize], next: u64) -> Option<u32> {
        let node = match self.free {
            0 => {
                self.next_node += 1;
                self.next_node
            }
            f => {
                self.free = self.nodes.get((f - 1) * NODE_WORDS + NODE_HOLDERS);
                f
            }
        };
        let Ok(number) = u32::try_from(node) else {
            self.broke("more than 4G chunks shared between volumes".into());
            return None;
        };
        let base = (node - 1) * NODE_WORDS;
        for (i, w) in holders.into_iter().chain([next]).enumerate() {
            self.nodes.set(base + i as u64, w);
        }
        Some(number)
    }

    /// Every node of the chain from `head` to the free list.
    fn free_chain(&mut self, head: u32) {
        let mut free = self.free;
        self.walk(head, |nodes, base| {
            for at in base..base + NODE_HOLDERS {
                nodes.set(at, 0);
            }
            nodes.set(base + NODE_HOLDERS, free);
            free = base / NODE_WORDS + 1;
            true
        });
        self.free = free;
    }

    /// Chunk `from` became a forward to chunk `to` (the merge pass): every tree's entries
    /// naming `from` now count for `to` (`stored_from`, `stored_to`: their stored lengths).
    pub fn merge(&mut self, from: u64, to: u64, stored_from: u32, stored_to: u32) {
        let held = match unpack(self.owner.get(from)) {
            (_, 0) => return,
            (SEVERAL, head) => self.chain(head).0,
            (t, k) => vec![(t, k)],
        };
        for (slot, n) in held {
            self.remove_slot(slot, from, n, stored_from);
            self.add_slot(slot, to, n, stored_to);
        }
    }

    /// Tree `from`'s entries are tree `to`'s from now on (a map detached for release takes
    /// a new tree id), without a walk: `to` takes `from`'s slot, and a tree made later under
    /// `from` starts empty. `to` must name nothing yet.
    pub fn rename_tree(&mut self, from: TreeId, to: TreeId) {
        self.last = None;
        if self.slots.contains_key(&to) {
            return self.broke(format!(
                "tree {to} already names chunks; tree {from} cannot become it"
            ));
        }
        if let Some(slot) = self.slots.remove(&from) {
            self.slots.insert(to, slot);
        }
    }

    /// A tree that names no chunk any more is forgotten.
    pub fn forget_tree(&mut self, tree: TreeId) {
        self.last = None;
        let Some(slot) = self.slots.remove(&tree) else {
            return;
        };
        if self
            .trees
            .remove(&slot)
            .is_some_and(|t| t != TreeSpace::default())
        {
            self.broke(format!("tree {tree} forgotten while it still names chunks"));
        }
    }

    fn broke(&mut self, what: String) {
        if self.broken.is_none() {
            tracing::warn!("space attribution broken ({what}); it will be rebuilt");
            self.broken = Some(what);
        }
    }

    /// The first contradiction or scratch-file failure met, if any: the figures are wrong
    /// and must be rebuilt.
    pub fn broken(&self) -> Option<&str> {
        self.broken
            .as_deref()
            .or(self.owner.error())
            .or(self.nodes.error())
    }

    /// Tree `tree`'s figures (zero for a tree that names no chunk).
    pub fn tree(&self, tree: TreeId) -> TreeSpace {
        self.slots
            .get(&tree)
            .and_then(|s| self.trees.get(s))
            .copied()
            .unwrap_or_default()
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

    /// RAM held: the pages in RAM and the trees' figures.
    pub fn ram_bytes(&self) -> u64 {
        self.owner.ram_bytes()
            + self.nodes.ram_bytes()
            + self.trees.capacity() as u64 * std::mem::size_of::<(u32, TreeSpace)>() as u64
            + self.slots.capacity() as u64 * std::mem::size_of::<(TreeId, u32)>() as u64
    }

    /// Bytes of pages spilled to scratch files past the RAM budget.
    pub fn scratch_bytes(&self) -> u64 {
        self.owner.file_bytes() + self.nodes.file_bytes()
    }
}

/// A count from scratch made in steps, between which the pool goes on changing
/// ([`crate::metadata::Metadata::count_attribution_step`]): first the chunk table's stored
/// lengths, then each tree's leaves in order.
///
/// Invariant: `a` holds exactly the entries of the map parts already walked. A change to an
/// entry the walk has passed ([`Counting::passed`]) is applied to `a` as it happens; a change
/// ahead of the walk is left for the walk to see. A tree added while counting (snapshot,
/// clone, rollback) is walked after the others; one released or detached for release ends
/// the count if the walk has reached it and not passed it (a detached tree the walk passed
/// is renamed in `a`, [`Attribution::rename_tree`]).
#[derive(Debug, Default)]
pub struct Counting {
    pub a: Attribution,
    /// Per chunk id, its stored length plus one if it was live when its chunk-table page was
    /// scanned (0: not then; a chunk made after that is looked up in the chunk table by the
    /// walk). Spilled like the attribution's own pages.
    pub stored: Spill,
    /// The next chunk-table page to scan; `None` once the scan is done.
    pub chunk_page: Option<u64>,
    /// Trees not walked yet, in the order they will be; the first is being walked.
    pub trees: VecDeque<TreeId>,
    /// The next leaf of the tree being walked.
    pub next_leaf: u64,
    /// Steps made, the longest one, and when the first began (for the log).
    pub steps: u64,
    pub longest: std::time::Duration,
    pub started: Option<std::time::Instant>,
}

impl Counting {
    /// A count of `trees`, the trees there are when it starts (a tree made later has an
    /// empty map at first: its changes all go to `a`), its pages going where `to` says.
    pub fn new(trees: impl IntoIterator<Item = TreeId>, to: &SpillTo) -> Counting {
        Counting {
            a: Attribution::new(to),
            stored: to.array(),
            chunk_page: Some(0),
            trees: trees.into_iter().collect(),
            ..Default::default()
        }
    }

    /// A count that met an error (a scratch file failing) must be dropped.
    pub fn error(&self) -> Option<&str> {
        self.a.broken().or(self.stored.error())
    }

    /// The walk of one tree added to the kept attribution `a` (a snapshot, clone or
    /// rollback): `a` holds every other tree whole, so their changes all go to it.
    pub fn resume(a: Attribution, tree: TreeId) -> Counting {
        Counting {
            a,
            chunk_page: None,
            trees: VecDeque::from([tree]),
            ..Default::default()
        }
    }

    /// Whether entry `block` of tree `tree` is behind the walk (a change to it goes to `a`).
    pub fn passed(&self, tree: TreeId, block: u64) -> bool {
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

    /// Figures counted from scratch from every (tree, chunk) entry count.
    fn from_scratch(held: &HashMap<(u64, u64), u32>, len: impl Fn(u64) -> u32) -> Attribution {
        let mut a = Attribution::default();
        let mut keys: Vec<_> = held.iter().filter(|(_, &n)| n > 0).collect();
        keys.sort();
        for (&(t, id), &n) in keys {
            a.add(t, id, n, len(id));
        }
        a
    }

    #[test]
    fn figures_spilled_to_a_scratch_file_match_a_count_from_scratch() {
        use rand::{Rng, SeedableRng};
        // 8-word pages, 2 in RAM per array: almost every step reads a page back from the file.
        let to = SpillTo {
            dir: Some(Arc::new(condense_store::sim::SimHandle(
                condense_store::sim::SimDir::new(),
            ))),
            page_words: 8,
            pages: 2,
        };
        let mut a = Attribution::new(&to);
        let len = |id: u64| (id * 37 % 4000) as u32 + 1;
        let mut held: HashMap<(u64, u64), u32> = HashMap::new();
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for step in 0..30_000 {
            let (tree, id) = (rng.random_range(1..8u64), rng.random_range(0..300u64));
            let n = rng.random_range(1..3u32);
            let k = held.entry((tree, id)).or_default();
            if rng.random_bool(0.55) || *k < n {
                *k += n;
                a.add(tree, id, n, len(id));
            } else {
                *k -= n;
                a.remove(tree, id, n, len(id));
            }
            if step % 1000 == 999 {
                let b = from_scratch(&held, len);
                assert!(a.broken().is_none(), "{:?}", a.broken());
                for t in 1..8 {
                    assert_eq!(a.tree(t), b.tree(t), "tree {t} at step {step}");
                }
                assert_eq!(a.shared(), b.shared(), "shared at step {step}");
                assert_eq!(a.totals(), b.totals());
            }
        }
        assert!(a.scratch_bytes() > 0, "pages went to the scratch file");
        assert!(a.ram_bytes() < 4 * 8 * 8 + 1024, "RAM kept to the budget");
        // Every entry dropped: nothing is left, and every chain node went back to the free list.
        for (&(t, id), &n) in &held {
            a.remove(t, id, n, len(id));
        }
        assert_eq!(a.totals(), Space::default());
        assert_eq!(a.shared(), Space::default());
        assert!(a.broken().is_none(), "{:?}", a.broken());
        let (mut free, mut node) = (0, a.free);
        while node > 0 {
            free += 1;
            node = a.nodes.get((node - 1) * NODE_WORDS + NODE_HOLDERS);
        }
        assert_eq!(free, a.next_node, "every node is free again");
    }

    #[test]
    fn a_renamed_tree_keeps_its_entries_and_its_old_id_starts_empty() {
        let released = 1u64 << 32;
        let mut a = Attribution::default();
        a.add(1, 7, 1, 10);
        a.add(1, 8, 2, 20);
        a.add(2, 8, 1, 20);
        let before = a.tree(1);
        a.rename_tree(1, released);
        assert_eq!(a.tree(released), before);
        assert_eq!(a.tree(1), TreeSpace::default());
        // A new map under the old id (a rollback's) is a tree of its own.
        a.add(1, 7, 1, 10);
        assert_eq!(a.tree(1).shared.chunks, 1);
        assert_eq!(a.tree(released).shared.chunks, 2);
        sums_hold(&a, 2, 30);
        // The detached map's entries go as its release reaches them.
        a.remove(released, 7, 1, 10);
        a.remove(released, 8, 2, 20);
        assert_eq!(a.tree(1).exclusive.chunks, 1);
        assert_eq!(a.tree(2).exclusive.stored_bytes, 20);
        a.forget_tree(released);
        sums_hold(&a, 2, 30);
        // Renaming onto a tree that names chunks is a contradiction.
        a.rename_tree(2, 1);
        assert!(a.broken().is_some());
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
        let mut c = Counting::new([4, 9], &SpillTo::default());
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
