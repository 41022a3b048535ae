//! What the sparse index finds inline, without a pool: writes replayed through a
//! [`SparseIndex`] over a model of the chunk table. `condense estimate --index sparse` runs
//! the images' fingerprints through it (docs/ESTIMATE.md "Dedup index").
//!
//! Owns: the model chunk table (the [`key`] of every chunk stored, by id: ids are handed out
//! in write order from 0, as the pool's chunk table does) and the index over it.
//!
//! Invariants, so that the replay stores what an import in sparse mode stores:
//! - A write goes as the write path takes one (engine `pool/write.rs`, `write_blocks`, one
//!   writer): a write of more than [`SMALL_WRITE_BLOCKS`] blocks looks every block up once
//!   first ([`SparseIndex::find_write`]); then each block is a duplicate of a chunk stored
//!   earlier in the same write, or the chunk the first pass found, or is looked up (again,
//!   unless it missed the first time), or is stored. The chunks it stores
//!   join the table and the index after the write, in id order.
//! - [`SparseReplay::reopen`] is an open of the pool by a new process (each `condense
//!   import`): the index is built again from the table, hooks only, in id order.
//! - Lookups are [`SparseIndex::find`], the pool's own, with the same budget.
//! - Where the model differs: a page is confirmed by the 64-bit key, not the whole
//!   fingerprint (two keys collide with odds of 2^-64 a pair), and no chunk reaches the
//!   reference limit. A pool's fingerprints are keyed by the pool's secret, so its hooks are
//!   other fingerprints than the replay's: the same share, chosen elsewhere.

use crate::chunk_table::page_of;
use crate::sparse_index::{key, ChunkPages, SparseCounters, SparseIndex};
use condense_format::{Fingerprint, CHUNKS_PER_PAGE};
use std::collections::HashSet;

/// Writes of at most this many blocks skip the first lookup pass (the write path's
/// `SMALL_WRITE_BLOCKS`, engine `pool/write.rs`).
pub const SMALL_WRITE_BLOCKS: usize = 4;

/// Writes replayed through a sparse index.
pub struct SparseReplay {
    budget: u64,
    index: SparseIndex,
    /// The key of every chunk stored, by id.
    table: Vec<u64>,
}

/// The model table as a lookup sees it during a write: the chunks stored before the write,
/// and the ids handed out so far (the page of the next one bounds a neighbourhood).
struct Pages<'a> {
    table: &'a [u64],
    next_id: u64,
}

impl Pages<'_> {
    fn page(&self, page: u64) -> &[u64] {
        let per = CHUNKS_PER_PAGE as u64;
        let len = self.table.len() as u64;
        let start = page.saturating_mul(per).min(len);
        let end = page.saturating_add(1).saturating_mul(per).min(len);
        &self.table[start as usize..end as usize]
    }
}

impl ChunkPages for Pages<'_> {
    fn confirm(&mut self, page: u64, fp: &Fingerprint) -> Option<u64> {
        let k = key(fp);
        let slot = self.page(page).iter().position(|&s| s == k)?;
        Some(page * CHUNKS_PER_PAGE as u64 + slot as u64)
    }

    fn page_keys(&mut self, page: u64) -> Option<Vec<u64>> {
        Some(self.page(page).to_vec())
    }

    fn last_page(&self) -> u64 {
        page_of(self.next_id.saturating_sub(1))
    }
}

impl SparseReplay {
    /// An empty pool whose sparse index has `budget` bytes.
    pub fn new(budget: u64) -> SparseReplay {
        SparseReplay {
            budget,
            index: SparseIndex::new(budget),
            table: Vec::new(),
        }
    }

    /// The pool opened again by a new process: the index is built from the table (hooks
    /// only, the locality cache empty), as the first write after an open builds it.
    pub fn reopen(&mut self) {
        let mut index = SparseIndex::new(self.budget);
        for (id, &k) in self.table.iter().enumerate() {
            index.add_hook_key(k, page_of(id as u64));
        }
        self.index = index;
    }

    /// One write of blocks (`None`: an all-zero block, never stored); the positions of the
    /// blocks it stores as new chunks, in order.
    pub fn write(&mut self, fps: &[Option<Fingerprint>]) -> Vec<usize> {
        let first_id = self.table.len() as u64;
        // The first pass: the blocks that missed, each fingerprint once.
        let mut missed = vec![false; fps.len()];
        let mut found = vec![None; fps.len()];
        if fps.len() > SMALL_WRITE_BLOCKS {
            let mut pages = Pages {
                table: &self.table,
                next_id: first_id,
            };
            found = self.index.find_write(fps, &mut pages);
            let mut seen = HashSet::new();
            for (i, fp) in fps.iter().enumerate() {
                let Some(fp) = fp else { continue };
                if found[i].is_none() && seen.insert(key(fp)) {
                    missed[i] = true;
                }
            }
        }
        // The second pass: a duplicate within the write, a hit, or a new chunk.
        let mut stored = Vec::new();
        let mut in_write = HashSet::new();
        for (i, fp) in fps.iter().enumerate() {
            let Some(fp) = fp else { continue };
            if in_write.contains(&key(fp)) || found[i].is_some() {
                continue;
            }
            if !missed[i] {
                let mut pages = Pages {
                    table: &self.table,
                    next_id: first_id + stored.len() as u64,
                };
                if self.index.find(fp, &mut pages).is_some() {
                    continue;
                }
            }
            in_write.insert(key(fp));
            stored.push(i);
        }
        // The commit: the new chunks join the table and the index, in id order.
        for &i in &stored {
            if let Some(fp) = &fps[i] {
                let id = self.table.len() as u64;
                self.table.push(key(fp));
                self.index.insert_key(key(fp), page_of(id));
            }
        }
        stored
    }

    /// The index's budget in bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Chunks stored so far.
    pub fn chunks(&self) -> u64 {
        self.table.len() as u64
    }

    /// Bytes of RAM the index holds (within its budget).
    pub fn ram_bytes(&self) -> u64 {
        self.index.ram_bytes()
    }

    /// What the lookups found since the last [`SparseReplay::reopen`].
    pub fn counters(&self) -> SparseCounters {
        self.index.counters
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dedup_index::tests::fp;
    use crate::sparse_index::{is_hook, HOOK_RATE, LOOKBEHIND, MIN_BUDGET};

    /// `fps` written in writes of `per` blocks; the chunks stored.
    fn write_all(r: &mut SparseReplay, fps: &[Option<Fingerprint>], per: usize) -> u64 {
        let before = r.chunks();
        for w in fps.chunks(per) {
            r.write(w);
        }
        r.chunks() - before
    }

    fn stream(ids: impl Iterator<Item = u64>) -> Vec<Option<Fingerprint>> {
        ids.map(|i| Some(fp(i))).collect()
    }

    #[test]
    fn new_data_is_stored_once_and_zeros_never() {
        let mut r = SparseReplay::new(MIN_BUDGET);
        let mut fps = stream(0..1000);
        fps.push(None);
        // A duplicate within one write is always found.
        fps.push(Some(fp(999)));
        assert_eq!(r.write(&fps).len(), 1000);
        assert_eq!(r.chunks(), 1000);
        assert!(r.ram_bytes() <= MIN_BUDGET);
    }

    /// Blocks of a run (of chunks ids `0..`, written in order) that start at `start` and
    /// whose first hook is at `first_hook` that the look-back cannot find: those before the
    /// page ahead of the hook's.
    fn before_neighbourhood(start: u64, first_hook: u64) -> u64 {
        let from = page_of(first_hook).saturating_sub(LOOKBEHIND) * CHUNKS_PER_PAGE as u64;
        from.saturating_sub(start)
    }

    #[test]
    fn a_long_run_written_again_is_found_from_its_start() {
        // A cache of ~300 pages: what a write's first pass loads is still there for its
        // second (at the smallest budget, ~43 pages, it is not: the engine's test
        // `the_replay_stores_what_the_pool_stores` holds the replay to the pool there).
        let mut r = SparseReplay::new(4 << 20);
        let n = 20_000;
        write_all(&mut r, &stream(0..n), 2048);
        r.reopen();
        // The run again, in a later import: missed until its first hook in the write's first
        // pass, then found, and the blocks before the hook found by looking back.
        let run = 5_000..10_000;
        let first_hook = run.clone().find(|&i| is_hook(&fp(i))).unwrap_or(run.end);
        assert!(
            first_hook > run.start && first_hook - run.start < 4 * HOOK_RATE,
            "{first_hook}: the test needs a run that does not start with a hook"
        );
        let stored = write_all(&mut r, &stream(run.clone()), 2048);
        assert_eq!(stored, before_neighbourhood(run.start, first_hook));
        assert!(
            stored < first_hook - run.start,
            "{stored}: not found by looking back"
        );
        assert!(r.counters().hook_hits > 0);
        assert!(r.counters().cache_hits > 4_000);
    }

    #[test]
    fn scattered_duplicates_are_missed_unless_hooks() {
        let mut r = SparseReplay::new(MIN_BUDGET);
        write_all(&mut r, &stream(0..20_000), 2048);
        r.reopen();
        // Old blocks far apart (steps of 7919 chunks, 62 pages), between new ones: few
        // are in a neighbourhood a hook loaded (the 400 fall on 157 pages, and a hook loads
        // 9; with the look-back, those of the write before the hook count too: 265 of 400
        // missed, 322 without it).
        let old = |i: u64| i * 7919 % 20_000;
        let mixed: Vec<u64> = (0..400).flat_map(|i| [old(i), 1_000_000 + i]).collect();
        let stored = write_all(&mut r, &stream(mixed.into_iter()), 2048);
        let hooks = (0..400).filter(|&i| is_hook(&fp(old(i)))).count() as u64;
        assert!(hooks > 0);
        assert!(stored > 400 + 200, "{stored}");
        assert!(stored <= 800 - hooks, "{stored}: the hooks were found");
    }

    #[test]
    fn reopen_empties_the_cache_and_keeps_the_hooks() {
        let mut r = SparseReplay::new(MIN_BUDGET);
        write_all(&mut r, &stream(0..300), 2048);
        // Without a reopen the cache finds it all again.
        assert_eq!(write_all(&mut r, &stream(0..300), 2048), 0);
        r.reopen();
        assert_eq!(r.counters(), SparseCounters::default());
        // Only the hooks are left: found from the first one on, and back to the page before
        // its page.
        let first_hook = (0..300).find(|&i| is_hook(&fp(i))).unwrap_or(300);
        assert!(first_hook < 300);
        assert_eq!(
            write_all(&mut r, &stream(0..300), 2048),
            before_neighbourhood(0, first_hook)
        );
    }
}
