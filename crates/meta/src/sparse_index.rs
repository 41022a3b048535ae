//! The sparse dedup index: RAM set by the administrator (`--index-memory`), not by the pool's
//! size. Advisory like the dense one (docs/DESIGN.md invariant 3): a miss costs savings only,
//! and every answer is a chunk-table page the caller reads to compare full fingerprints.
//!
//! Owns: the hooks (sampled fingerprints → the chunk-table page holding them) and the
//! locality cache (every fingerprint of a few recently used or written pages → its page),
//! both within one budget in bytes, and the counters of what lookups found.
//!
//! Design (why, in docs/ARCHITECTURE.md "Sparse index"): chunk ids are handed out in write
//! order, so a chunk-table page (128 chunks) holds chunks written together, and data written
//! again is written again in about the same order. RAM keeps 1 fingerprint in
//! [`HOOK_RATE`] (chosen by fingerprint bits, so the same data always picks the same
//! hooks); a hook table that fills up halves its rate (1 in 128, 256, ...: every other hook
//! goes, and the hooks kept still cover every page, at half the density), so the whole pool
//! stays in the index's sight, up to [`HOOK_RATE_MAX`]. When a lookup meets a hook, the
//! caller confirms it on its page and loads that page, the [`LOOKBEHIND`] before it and the
//! [`LOOKAHEAD`] − 1 following ones into the locality cache, which then answers for the rest
//! of the duplicate run; a write's lookups ([`SparseIndex::find_write`]) then look back at
//! the write's misses since the run began, so the run is found from its start. New chunks
//! go into the locality cache too (duplicates within one stream) and, if they are hooks,
//! into the hook table. A hook or cache slot is 12 bytes ([`KEY_BITS`] of the fingerprint,
//! 48 of the page).
//!
//! Invariants:
//! - [`SparseIndex::ram_bytes`] never exceeds the budget given at creation (both tables are
//!   allocated once, at their full size, and never grow).
//! - The hook table, 7/8 full, first halves its rate (the hooks whose key is not a multiple of
//!   the new rate go); at [`HOOK_RATE_MAX`] it drops its hooks of the lowest (oldest) pages
//!   instead: the dedup window is then the newest hooks that fit, as VDO's sparse index keeps.
//! - The rate is a function of the hooks seen so far, never stored: the build at open reaches
//!   the same rate from the chunk table.
//! - Page numbers are kept whole (48 bits in a slot, for 41-bit pages of 48-bit chunk ids):
//!   no chunk id is too large to index.
//! - A fingerprint seen twice maps to its newest page (the nearest to what is being written).

use condense_format::Fingerprint;
use std::collections::{BTreeMap, VecDeque};

/// One fingerprint in this many is a hook, at first (the rate halves as the table fills).
/// Measured on the ten-image corpus (bench/README.md "Issue 43"): 1 in 64 keeps a hook in
/// every page of 128 chunks on average (two), so a run of duplicates is met within about 64
/// chunks of its start (and found from its start by the look-back). Starting at 1 in 16 or
/// 32 (the table halving to 64 as it fills) found no more there ("Look-back").
pub const HOOK_RATE: u64 = 64;

/// The sparsest hook rate: past it, the oldest hooks are dropped instead. 1 in 16,384
/// (2^14) still leaves a hook every 128 pages of chunks on average, a run of duplicates found
/// within ~64 MiB of data.
pub const HOOK_RATE_MAX: u64 = HOOK_RATE << 8;

/// Pages loaded into the locality cache on a hook hit from the hook's page on: it and the
/// 7 after it (16 measured worse on the corpus, 4 no better: bench/README.md "Issue 43",
/// "Look-back").
pub const LOOKAHEAD: u64 = 8;

/// Pages loaded before the hook's page on a hook hit: a run's first hook may be past the end
/// of the page its run starts on, and [`SparseIndex::find_write`] looks back for that start.
pub const LOOKBEHIND: u64 = 1;

/// How far back (blocks of one write) [`SparseIndex::find_write`] checks earlier misses
/// again when a lookup loads pages: the span of a neighbourhood's pages (4096 found no more
/// on the corpus).
pub const LOOK_BACK: usize = 1024;

/// The smallest budget accepted: room for a few hundred hooks and eight pages of cache.
pub const MIN_BUDGET: u64 = 256 << 10;

/// Bytes of a hook slot, or of one in the locality cache's map: the key ([`KEY_BITS`]) and
/// the page (48 bits), [`Slot`].
const SLOT_BYTES: u64 = 12;

/// Bits of a fingerprint's [`key`].
pub const KEY_BITS: u32 = 48;

/// The [`KEY_BITS`] fingerprint bits a hook or cache entry is known by (of bytes 8..16: the
/// dense index uses bytes 0..8, so the two spread independently). Never 0 (0 marks an empty
/// slot). Two fingerprints of a pool share a key with odds of 2^-48 a pair: the later one's
/// page then stands for both, a lost dedup at worst (a page is confirmed by the whole
/// fingerprint).
pub fn key(fp: &Fingerprint) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&fp[8..16]);
    (u64::from_le_bytes(b) & ((1 << KEY_BITS) - 1)).max(1)
}

/// Whether `fp` is a hook at the first rate: its key is a multiple of [`HOOK_RATE`] (the
/// index's own rate may be sparser, [`SparseIndex::is_hook`]).
pub fn is_hook(fp: &Fingerprint) -> bool {
    key(fp).is_multiple_of(HOOK_RATE)
}

/// Where a sparse lookup reads chunk-table pages: the pool's chunk table, or the model of one
/// that `condense estimate` replays writes into ([`crate::sparse_replay`]).
pub trait ChunkPages {
    /// The id of a live chunk on `page` with fingerprint `fp` that may take another
    /// reference; `None` if there is none or the page cannot be read (a miss).
    fn confirm(&mut self, page: u64, fp: &Fingerprint) -> Option<u64>;
    /// The keys ([`key`]) of the chunks on `page`; `None` if it cannot be read.
    fn page_keys(&mut self, page: u64) -> Option<Vec<u64>>;
    /// The page of the last chunk id handed out: a neighbourhood loads no page after it.
    fn last_page(&self) -> u64;
}

/// What the lookups found (since open).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SparseCounters {
    /// Lookups ([`crate::metadata::Metadata::find_duplicate`] calls).
    pub lookups: u64,
    /// Lookups answered by the locality cache (a duplicate confirmed on its page).
    pub cache_hits: u64,
    /// Lookups answered through a hook (confirmed; its neighbourhood then loaded).
    pub hook_hits: u64,
    /// Lookups that found nothing: new data, or a duplicate outside the cache that is not a
    /// hook (a dense index would have found it; which of the two is unknown inline).
    pub misses: u64,
    /// Hooks dropped to stay within the budget: the oldest pages' at the sparsest rate, or
    /// every other one when the rate halved.
    pub hooks_dropped: u64,
    /// Pages loaded into the locality cache on hook hits.
    pub pages_loaded: u64,
}

/// One slot of a [`Table`]: a key ([`KEY_BITS`] bits) and a page (48 bits: a chunk id has
/// at most 48, so a page 41), packed in 12 bytes instead of two u64s' 16, for a third more
/// hooks and cache entries in a budget. All zero: empty (a key is never 0).
#[derive(Clone, Copy, PartialEq, Eq)]
struct Slot([u32; 3]);

impl Slot {
    const EMPTY: Slot = Slot([0; 3]);

    fn new(k: u64, page: u64) -> Slot {
        debug_assert!(k < 1 << KEY_BITS && page < 1 << 48);
        Slot([
            k as u32,
            ((k >> 32) as u32 & 0xffff) | ((page as u32) << 16),
            (page >> 16) as u32,
        ])
    }

    fn key(self) -> u64 {
        u64::from(self.0[0]) | (u64::from(self.0[1] & 0xffff) << 32)
    }

    fn page(self) -> u64 {
        u64::from(self.0[1] >> 16) | (u64::from(self.0[2]) << 16)
    }
}

/// Open-addressed key → page (the hooks, and the locality cache's map), linear probing,
/// allocated once and never grown: the caller keeps it below 7/8 full.
struct Table {
    slots: Vec<Slot>,
    len: usize,
}

impl Table {
    fn with_slots(n: usize) -> Table {
        Table {
            slots: vec![Slot::EMPTY; n.max(8)],
            len: 0,
        }
    }

    fn home(&self, k: u64) -> usize {
        // The low bits are the hook-choice bits (all zero for a hook): use the high ones.
        ((u128::from(k >> 8) * self.slots.len() as u128) >> (KEY_BITS - 8)) as usize
    }

    fn get(&self, k: u64) -> Option<u64> {
        let mut i = self.home(k);
        loop {
            let s = self.slots[i];
            if s == Slot::EMPTY {
                return None;
            }
            if s.key() == k {
                return Some(s.page());
            }
            i = (i + 1) % self.slots.len();
        }
    }

    /// Insert or move `k` to `page`. The caller keeps the table below 7/8 full.
    fn put(&mut self, k: u64, page: u64) {
        let mut i = self.home(k);
        loop {
            let s = self.slots[i];
            if s == Slot::EMPTY {
                self.slots[i] = Slot::new(k, page);
                self.len += 1;
                return;
            }
            if s.key() == k {
                self.slots[i] = Slot::new(k, s.page().max(page));
                return;
            }
            i = (i + 1) % self.slots.len();
        }
    }

    /// Remove `k` if it names `page` (backward-shift deletion: the entries after it that
    /// would lose their way to their home move into the gap, so no tombstones).
    fn remove_if(&mut self, k: u64, page: u64) {
        let n = self.slots.len();
        let mut i = self.home(k);
        loop {
            let s = self.slots[i];
            if s == Slot::EMPTY {
                return;
            }
            if s.key() == k {
                if s.page() != page {
                    return;
                }
                break;
            }
            i = (i + 1) % n;
        }
        let mut j = i;
        loop {
            j = (j + 1) % n;
            let s = self.slots[j];
            if s == Slot::EMPTY {
                break;
            }
            let h = self.home(s.key());
            // The entry at j may stay if its home lies cyclically in (i, j].
            let stays = if i <= j {
                i < h && h <= j
            } else {
                i < h || h <= j
            };
            if !stays {
                self.slots[i] = s;
                i = j;
            }
        }
        self.slots[i] = Slot::EMPTY;
        self.len -= 1;
    }

    fn full(&self) -> bool {
        (self.len + 1) * 8 > self.slots.len() * 7
    }

    /// Keep only the hooks whose key is a multiple of `rate`; returns how many went.
    fn thin(&mut self, rate: u64) -> u64 {
        let before = self.len;
        for s in &mut self.slots {
            if *s != Slot::EMPTY && !s.key().is_multiple_of(rate) {
                *s = Slot::EMPTY;
                self.len -= 1;
            }
        }
        self.reseat();
        (before - self.len) as u64
    }

    /// Drop the hooks of the oldest pages until at most 5/8 of the slots are used; returns
    /// how many were dropped. In place: no second table, so the budget holds meanwhile.
    fn drop_oldest(&mut self) -> u64 {
        let target = self.slots.len() * 5 / 8;
        let before = self.len;
        while self.len > target {
            let (lo, hi) = self
                .slots
                .iter()
                .filter(|s| **s != Slot::EMPTY)
                .fold((u64::MAX, 0), |(lo, hi), s| {
                    (lo.min(s.page()), hi.max(s.page()))
                });
            // Pages fill in write order, so hooks spread evenly over [lo, hi]: dropping the
            // lowest quarter of that span drops about a quarter of them (repeat if not).
            let below = lo.saturating_add(((hi - lo) / 4).max(1));
            for s in &mut self.slots {
                if *s != Slot::EMPTY && s.page() < below {
                    *s = Slot::EMPTY;
                    self.len -= 1;
                }
            }
            self.reseat();
        }
        (before - self.len) as u64
    }

    /// After slots were emptied: take out and put back every entry, going once around the
    /// table from an empty slot. An entry only moves towards its home, and every entry
    /// before it in its run has been put back already, so each is found again.
    fn reseat(&mut self) {
        let n = self.slots.len();
        let Some(start) = self.slots.iter().position(|s| *s == Slot::EMPTY) else {
            return;
        };
        for j in 1..=n {
            let i = (start + j) % n;
            let s = self.slots[i];
            if s != Slot::EMPTY {
                self.slots[i] = Slot::EMPTY;
                self.len -= 1;
                self.put(s.key(), s.page());
            }
        }
    }
}

/// The locality cache: every fingerprint of a bounded number of pages, dropped whole pages at a
/// time in the order they came in.
struct Locality {
    map: Table,
    pages: BTreeMap<u64, Vec<u64>>,
    order: VecDeque<u64>,
    max_entries: usize,
    entries: usize,
    /// Bytes of the pages' key lists (their capacities) and of their places in `pages` and
    /// `order`; kept within `max_entries` × 8.
    list_bytes: u64,
}

/// What one cached page costs beside its keys: its list's header, its B-tree entry and its
/// place in the order (rounded up).
const PAGE_OVERHEAD_BYTES: u64 = 64;

impl Locality {
    fn with_entries(max_entries: usize) -> Locality {
        Locality {
            map: Table::with_slots(cache_slots(max_entries)),
            pages: BTreeMap::new(),
            order: VecDeque::new(),
            max_entries,
            entries: 0,
            list_bytes: 0,
        }
    }

    fn list_budget(&self) -> u64 {
        self.max_entries as u64 * 8
    }

    fn add(&mut self, page: u64, k: u64) {
        let growth = match self.pages.get(&page) {
            None => PAGE_OVERHEAD_BYTES + 32,
            Some(l) if l.len() == l.capacity() => l.capacity().max(4) as u64 * 8,
            Some(_) => 0,
        };
        while self.entries >= self.max_entries || self.list_bytes + growth > self.list_budget() {
            if !self.evict_one() {
                return;
            }
        }
        if !self.pages.contains_key(&page) {
            self.order.push_back(page);
            self.list_bytes += PAGE_OVERHEAD_BYTES;
        }
        let list = self.pages.entry(page).or_default();
        let cap = list.capacity();
        list.push(k);
        self.list_bytes += (list.capacity() - cap) as u64 * 8;
        self.map.put(k, page);
        self.entries += 1;
    }

    /// Drop the page that came in first (its keys, unless a newer page took them over).
    fn evict_one(&mut self) -> bool {
        let Some(page) = self.order.pop_front() else {
            return false;
        };
        if let Some(keys) = self.pages.remove(&page) {
            self.entries -= keys.len();
            self.list_bytes -= PAGE_OVERHEAD_BYTES + keys.capacity() as u64 * 8;
            for k in keys {
                self.map.remove_if(k, page);
            }
        }
        true
    }
}

pub struct SparseIndex {
    budget: u64,
    /// One fingerprint in `rate` is a hook (a power of two, [`HOOK_RATE`] to
    /// [`HOOK_RATE_MAX`]).
    rate: u64,
    hooks: Table,
    cache: Locality,
    pub counters: SparseCounters,
}

impl SparseIndex {
    /// An index within `budget` bytes (at least [`MIN_BUDGET`]): half for hooks, half for
    /// the locality cache.
    pub fn new(budget: u64) -> SparseIndex {
        let budget = budget.max(MIN_BUDGET);
        let (hook_slots, entries) = sizes(budget);
        SparseIndex {
            budget,
            rate: HOOK_RATE,
            hooks: Table::with_slots(hook_slots),
            cache: Locality::with_entries(entries),
            counters: SparseCounters::default(),
        }
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// One fingerprint in this many is a hook now.
    pub fn hook_rate(&self) -> u64 {
        self.rate
    }

    /// Whether `fp` is a hook at the index's rate now.
    pub fn is_hook(&self, fp: &Fingerprint) -> bool {
        key(fp).is_multiple_of(self.rate)
    }

    /// Hooks held.
    pub fn hooks(&self) -> u64 {
        self.hooks.len as u64
    }

    /// Fingerprints in the locality cache.
    pub fn cached(&self) -> u64 {
        self.cache.entries as u64
    }

    /// Bytes of memory the index holds (within the budget; all of it from creation on).
    pub fn ram_bytes(&self) -> u64 {
        (self.hooks.slots.len() + self.cache.map.slots.len()) as u64 * SLOT_BYTES
            + self.cache.list_budget()
    }

    /// The page the locality cache holds `fp` on, if any.
    pub fn cache_page(&self, fp: &Fingerprint) -> Option<u64> {
        self.cache.map.get(key(fp))
    }

    /// The page of hook `fp`, if `fp` is a hook held.
    pub fn hook_page(&self, fp: &Fingerprint) -> Option<u64> {
        if !self.is_hook(fp) {
            return None;
        }
        self.hooks.get(key(fp))
    }

    /// Whether the locality cache holds page `page`.
    pub fn has_page(&self, page: u64) -> bool {
        self.cache.pages.contains_key(&page)
    }

    /// Load a page's fingerprints into the locality cache (on a hook hit).
    pub fn load_page<'a>(&mut self, page: u64, fps: impl Iterator<Item = &'a Fingerprint>) {
        self.load_keys(page, fps.map(key));
    }

    fn load_keys(&mut self, page: u64, keys: impl Iterator<Item = u64>) {
        for k in keys {
            self.cache.add(page, k);
        }
        self.counters.pages_loaded += 1;
    }

    /// A duplicate of `fp` on `pages`, as the pool looks one up: the locality cache first,
    /// then the hooks; a hook confirmed on its page loads that page, the [`LOOKBEHIND`]
    /// before it and the [`LOOKAHEAD`] − 1 after it into the cache, and so does a hook met
    /// in the cache (the run goes on past the pages loaded so far). Counts the lookup.
    pub fn find(&mut self, fp: &Fingerprint, pages: &mut impl ChunkPages) -> Option<u64> {
        self.counters.lookups += 1;
        let hooked = self.hook_page(fp);
        let cached = self.cache_page(fp);
        if let Some((page, id)) = cached.and_then(|page| Some((page, pages.confirm(page, fp)?))) {
            self.counters.cache_hits += 1;
            if self.is_hook(fp) {
                self.load_neighbourhood(page, pages);
            }
            return Some(id);
        }
        if let Some(page) = hooked {
            if let Some(id) = pages.confirm(page, fp) {
                self.counters.hook_hits += 1;
                self.load_neighbourhood(page, pages);
                return Some(id);
            }
        }
        self.counters.misses += 1;
        None
    }

    /// A write's blocks ([`None`]: all zero) looked up in order with [`SparseIndex::find`],
    /// as the write path's first pass does: each block's duplicate, if found. Look-back: a
    /// lookup that loads pages into the locality cache (a hook met) checks the write's
    /// misses of the last [`LOOK_BACK`] blocks against the cache again, so a duplicate run
    /// is found from its start, not from its first hook (~[`HOOK_RATE`] blocks in). A miss
    /// found so counts as a cache hit, not a miss.
    ///
    /// The caller keeps what this found (the write path confirms the ids again under its
    /// lock): a second lookup of a block found by looking back may miss, its page gone from
    /// the cache or its hook not met again before it.
    pub fn find_write(
        &mut self,
        fps: &[Option<Fingerprint>],
        pages: &mut impl ChunkPages,
    ) -> Vec<Option<u64>> {
        let mut found = vec![None; fps.len()];
        let mut pending: VecDeque<usize> = VecDeque::new();
        for (i, fp) in fps.iter().enumerate() {
            let Some(fp) = fp else { continue };
            let loaded = self.counters.pages_loaded;
            found[i] = self.find(fp, pages);
            if found[i].is_none() {
                pending.push_back(i);
                while pending.front().is_some_and(|&j| j + LOOK_BACK < i) {
                    pending.pop_front();
                }
                continue;
            }
            if self.counters.pages_loaded == loaded {
                continue;
            }
            pending.retain(|&j| {
                let Some(fp) = &fps[j] else { return false };
                let Some(id) = self.cache_page(fp).and_then(|p| pages.confirm(p, fp)) else {
                    return true;
                };
                found[j] = Some(id);
                self.counters.misses -= 1;
                self.counters.cache_hits += 1;
                false
            });
        }
        found
    }

    /// Load pages `page - LOOKBEHIND..page + LOOKAHEAD` not cached yet (none past the last
    /// page; unreadable pages are skipped).
    fn load_neighbourhood(&mut self, page: u64, pages: &mut impl ChunkPages) {
        let end = page
            .saturating_add(LOOKAHEAD)
            .min(pages.last_page().saturating_add(1));
        for p in page.saturating_sub(LOOKBEHIND)..end {
            if self.has_page(p) {
                continue;
            }
            if let Some(keys) = pages.page_keys(p) {
                self.load_keys(p, keys.into_iter());
            }
        }
    }

    /// A new chunk with fingerprint `fp` on page `page`: into the locality cache, and a hook
    /// if it is one.
    pub fn insert(&mut self, fp: &Fingerprint, page: u64) {
        self.insert_key(key(fp), page);
    }

    /// [`SparseIndex::insert`] of the fingerprint whose key is `k`.
    pub(crate) fn insert_key(&mut self, k: u64, page: u64) {
        self.cache.add(page, k);
        self.add_hook_key(k, page);
    }

    /// Index `fp` on `page` if it is a hook (the build at open keeps only hooks).
    pub fn add_hook(&mut self, fp: &Fingerprint, page: u64) {
        self.add_hook_key(key(fp), page);
    }

    /// [`SparseIndex::add_hook`] of the fingerprint whose key is `k`.
    pub(crate) fn add_hook_key(&mut self, k: u64, page: u64) {
        if !k.is_multiple_of(self.rate) {
            return;
        }
        if self.hooks.full() {
            if self.rate < HOOK_RATE_MAX {
                self.rate *= 2;
                self.counters.hooks_dropped += self.hooks.thin(self.rate);
                if !k.is_multiple_of(self.rate) {
                    return;
                }
            } else {
                self.counters.hooks_dropped += self.hooks.drop_oldest();
            }
        }
        self.hooks.put(k, page);
    }

    /// A chunk dropped: forget it in the locality cache (a hook naming it stays until it ages
    /// out; the caller's check on the page turns it into a miss).
    pub fn remove(&mut self, fp: &Fingerprint, page: u64) {
        self.cache.map.remove_if(key(fp), page);
    }
}

/// Hook slots and locality-cache entries for `budget` bytes: half for hooks, half for the
/// cache. Measured (bench/README.md "Issue 43", "The budget's split"): on the ten-image corpus
/// at 256 KiB, ¾ for hooks stored 1.27× dense (the cache held ~19 pages), 94.4 % of a second
/// day found inline; ½: 1.06×, 97.5 %; ¼: 1.06×, 98.6 %; ⅛: 1.29×, 85.4 %. At 100M chunks and
/// 32 MiB a second pass found 99.94 % inline with ½ (hooks 1 in 128) and 97.7 % with ¼ (1 in
/// 256): the hook table halves its rate as it fills, so its share sets how thin the hooks of a
/// big pool get. (Those were with 16-byte slots and before the look-back; with both, ½ at 256
/// KiB stores 1.01× dense on the corpus and finds 99.6 % of a second day, "Look-back".)
fn sizes(budget: u64) -> (usize, usize) {
    let hook_slots = budget / 2 / SLOT_BYTES;
    let cache_bytes = budget - hook_slots * SLOT_BYTES;
    // An entry: 8/7 of a slot (the map stays below 7/8 full) and its key in its page's list
    // (8 bytes): 152/7 bytes; 16 spare slots of rounding.
    let entries = cache_bytes.saturating_sub(16 * SLOT_BYTES) * 7 / (8 * SLOT_BYTES + 56);
    (hook_slots as usize, entries as usize)
}

/// What [`SparseIndex::ram_bytes`] is for an index of `budget` bytes (without making one).
pub fn projected_ram_bytes(budget: u64) -> u64 {
    let (hook_slots, entries) = sizes(budget.max(MIN_BUDGET));
    (hook_slots.max(8) + cache_slots(entries)) as u64 * SLOT_BYTES + entries as u64 * 8
}

/// Slots of the locality cache's map for `entries` entries (below 7/8 full).
fn cache_slots(entries: usize) -> usize {
    entries / 7 * 8 + 8
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dedup_index::tests::fp;
    use condense_format::CHUNKS_PER_PAGE;

    /// Twice the hooks that fit: the rate halves, and every hook at the new rate, old or
    /// new, is still held (the whole pool stays in sight); RAM never grows.
    #[test]
    fn a_full_hook_table_halves_its_rate_and_keeps_the_whole_pool_in_sight() {
        for budget in [MIN_BUDGET, 1 << 20] {
            let mut ix = SparseIndex::new(budget);
            let ram = ix.ram_bytes();
            assert!(ram <= budget, "{ram} bytes for a budget of {budget}");
            assert_eq!(projected_ram_bytes(budget), ram);
            let n = budget / 16 * HOOK_RATE * 2;
            for i in 0..n {
                ix.insert(&fp(i), i / 128);
            }
            assert_eq!(ix.ram_bytes(), ram, "the tables never grew");
            assert!(ix.hook_rate() > HOOK_RATE, "rate {}", ix.hook_rate());
            assert!(ix.counters.hooks_dropped > 0);
            let kept = (0..n).filter(|&i| ix.is_hook(&fp(i)));
            let mut held = 0;
            for i in kept {
                assert_eq!(ix.hook_page(&fp(i)), Some(i / 128), "hook {i}");
                held += 1;
            }
            assert_eq!(held, ix.hooks());
            assert!(
                held * 4 >= n / ix.hook_rate() * 3,
                "{held} hooks of {n} chunks"
            );
        }
    }

    /// At the sparsest rate the oldest hooks go: the newest are held.
    #[test]
    fn at_the_sparsest_rate_the_oldest_hooks_go() {
        let mut ix = SparseIndex::new(MIN_BUDGET);
        ix.rate = HOOK_RATE_MAX;
        // Keys that are hooks at the sparsest rate: far more than the table holds.
        let n = MIN_BUDGET / 16 * 3;
        let hook = |i: u64| {
            let mut f = [0u8; 16];
            let k = ((i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) & !(HOOK_RATE_MAX - 1))
                .max(HOOK_RATE_MAX);
            f[8..16].copy_from_slice(&k.to_le_bytes());
            f
        };
        for i in 0..n {
            ix.insert(&hook(i), i);
        }
        assert_eq!(ix.hook_rate(), HOOK_RATE_MAX);
        assert!(ix.counters.hooks_dropped > 0);
        assert_eq!(
            ix.hook_page(&hook(n - 1)),
            Some(n - 1),
            "the newest is held"
        );
        assert_eq!(ix.hook_page(&hook(0)), None, "the oldest went");
    }

    /// A slot is 12 bytes: at the smallest budget, 9,000 hooks at the first rate fit without
    /// halving it (two u64s a slot held 7,168), and the largest page is kept whole.
    #[test]
    fn a_slot_is_twelve_bytes_and_keeps_any_page() {
        let mut ix = SparseIndex::new(MIN_BUDGET);
        let hooks: Vec<u64> = (0..).filter(|&i| is_hook(&fp(i))).take(9_000).collect();
        let last_page = (1u64 << 48) / CHUNKS_PER_PAGE as u64 - 1;
        for (n, &i) in hooks.iter().enumerate() {
            ix.insert(&fp(i), last_page - n as u64);
        }
        assert_eq!(ix.hook_rate(), HOOK_RATE, "the rate did not halve");
        assert_eq!(ix.hooks(), 9_000);
        assert_eq!(ix.hook_page(&fp(hooks[0])), Some(last_page));
        assert_eq!(ix.hook_page(&fp(hooks[8_999])), Some(last_page - 8_999));
        assert!(ix.ram_bytes() <= MIN_BUDGET);
    }

    /// A write's blocks before its first hook are found once the hook loads their page (the
    /// look-back), as far back as [`LOOK_BACK`] blocks.
    #[test]
    fn a_hook_finds_the_misses_of_the_write_before_it() {
        struct Model(u64);
        impl ChunkPages for Model {
            fn confirm(&mut self, page: u64, fp: &Fingerprint) -> Option<u64> {
                (page * 128..(page + 1) * 128)
                    .find(|&i| i < self.0 && crate::dedup_index::tests::fp(i) == *fp)
            }
            fn page_keys(&mut self, page: u64) -> Option<Vec<u64>> {
                Some(
                    (page * 128..(page + 1) * 128)
                        .filter(|&i| i < self.0)
                        .map(|i| key(&fp(i)))
                        .collect(),
                )
            }
            fn last_page(&self) -> u64 {
                (self.0 - 1) / 128
            }
        }
        let n = 128 * 64;
        let mut ix = SparseIndex::new(MIN_BUDGET);
        for i in 0..n {
            ix.add_hook(&fp(i), i / 128);
        }
        // A stretch of a page's length with a hook at its end, written again.
        let hook = (1_000..n).find(|&i| is_hook(&fp(i)) && !(i - 127..i).any(|j| is_hook(&fp(j))));
        let hook = hook.expect("a hook with 127 others before it");
        let write: Vec<Option<Fingerprint>> =
            (hook - 127..=hook + 10).map(|i| Some(fp(i))).collect();
        let found = ix.find_write(&write, &mut Model(n));
        let ids: Vec<Option<u64>> = (hook - 127..=hook + 10).map(Some).collect();
        assert_eq!(found, ids);
        assert_eq!(ix.counters.misses, 0, "the misses became hits");
        // One at a time (the look-back's window is the write), the blocks before the hook miss.
        let mut ix = SparseIndex::new(MIN_BUDGET);
        for i in 0..n {
            ix.add_hook(&fp(i), i / 128);
        }
        let mut m = Model(n);
        let one_by_one: Vec<Option<u64>> = (hook - 127..=hook + 10)
            .map(|i| ix.find(&fp(i), &mut m))
            .collect();
        assert_eq!(one_by_one.iter().filter(|f| f.is_none()).count(), 127);
    }

    #[test]
    fn pages_past_2_to_the_28_are_indexed() {
        let mut ix = SparseIndex::new(MIN_BUDGET);
        let base = (1u64 << 35) / 128 + (1 << 30);
        let mut hooks = 0;
        for i in 0..10_000u64 {
            let page = base + i / 128;
            ix.insert(&fp(i), page);
            if ix.is_hook(&fp(i)) {
                hooks += 1;
                assert_eq!(ix.hook_page(&fp(i)), Some(page));
            }
        }
        assert!(hooks > 50);
        assert_eq!(ix.cache_page(&fp(9_999)), Some(base + 9_999 / 128));
    }

    #[test]
    fn the_locality_cache_drops_whole_pages_first_in_first_out() {
        let mut ix = SparseIndex::new(MIN_BUDGET);
        let max = ix.cache.max_entries as u64;
        for i in 0..max * 3 {
            ix.insert(&fp(i), i / 128);
        }
        assert!(ix.cached() <= max);
        assert_eq!(ix.cache_page(&fp(0)), None);
        assert_eq!(ix.cache_page(&fp(max * 3 - 1)), Some((max * 3 - 1) / 128));
        ix.remove(&fp(max * 3 - 1), (max * 3 - 1) / 128);
        assert_eq!(ix.cache_page(&fp(max * 3 - 1)), None);
    }
}
