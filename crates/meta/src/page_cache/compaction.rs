//! Metadata compaction: the free end of `meta.dat` given back at a close.
//!
//! Owns: choosing which stored pages to move and marking them. Every checkpoint writes its
//! changed pages out of place and frees their old copies, which the next checkpoint reuses;
//! so a pool closed right after a checkpoint that rewrote many pages (the chunk-table leaves
//! whose reference counts an import changed) keeps those old copies as free runs, often a
//! third of the file (docs/FORMAT.md "Allocation"). At a close, when the pages stored at the
//! end of the file would fit in 4/5 of the free units below them and moving them would cut at
//! least 1/8 of the file (and 1 MiB), [`PageCache::start_compaction`] sets the allocator's
//! ceiling there and marks those nodes dirty, highest first; the caller's next checkpoint
//! writes them below the ceiling, the old copies are freed when that checkpoint is durable,
//! and its trim cuts the file. The caller then clears the ceiling.
//!
//! Invariants: nothing changes but where pages are stored (a marked node keeps its bytes),
//! so a crash at any point leaves the last durable root as valid as any checkpoint does; a
//! page that is shared, or lies below a shared page, is never marked (moving it would copy
//! it, see "Sharing"); at most a quarter of the cache's page limit is marked, and no more than
//! the cache has room for, so a close never holds more pages than the cache's budget.

use super::{Key, PageCache, Ptr, TreeId, TreeInfo};
use condense_format::error::Result;
use std::cmp::Reverse;

/// Compaction runs only if it would cut at least this many units (1 MiB).
const MIN_GAIN_UNITS: u64 = 16 * 1024;

impl PageCache {
    /// At a close, right after a checkpoint: if the end of `meta.dat` is worth moving (see
    /// the module docs), set the allocator's ceiling and mark the nodes stored at or above
    /// it dirty. Returns how many were marked: when not 0, checkpoint, then clear the ceiling
    /// (`alloc.set_ceiling(None)`) whatever happened.
    pub fn start_compaction(&mut self) -> Result<usize> {
        if self.read_only {
            return Ok(0);
        }
        // Within the cache's budget: a close holds no more pages than the cache may.
        let room = self.page_limit().saturating_sub(self.map.len());
        let max_pages = (self.page_limit() / 4).min(room);
        if max_pages == 0 {
            return Ok(0);
        }
        let end = self.alloc.end();
        let min_gain = (end / 8).max(MIN_GAIN_UNITS);
        let Some(from) = self
            .alloc
            .compaction_target(max_pages as u64 * 64, min_gain)
        else {
            return Ok(0);
        };
        self.alloc.set_ceiling(Some(from));
        let mut found = Vec::new();
        let trees: Vec<(TreeId, TreeInfo)> = self.trees.iter().map(|(&t, &i)| (t, i)).collect();
        for (tree, info) in trees.into_iter().filter(|(_, i)| i.height > 0) {
            let root = Key {
                tree,
                level: info.height - 1,
                index: 0,
            };
            self.movable(root, info.root, from, &mut found)?;
        }
        found.sort_unstable_by_key(|&(page, _)| Reverse(page));
        found.truncate(max_pages);
        for &(_, k) in &found {
            self.find(k.tree, k.level, k.index, true)?;
        }
        Ok(found.len())
    }

    /// The nodes at or below `key` (stored at `ptr` unless cached) whose page starts at unit
    /// `from` or above, skipping shared pages and everything below them. Reads (and caches)
    /// the interior nodes, never a leaf.
    fn movable(
        &mut self,
        key: Key,
        ptr: Ptr,
        from: u64,
        found: &mut Vec<(u64, Key)>,
    ) -> Result<()> {
        let cached = self.map.get(&key).copied();
        let page = cached.map_or(ptr.page, |s| self.node(s).page);
        if (page == 0 && cached.is_none()) || self.is_shared(page) {
            return Ok(());
        }
        if page >= from {
            found.push((page, key));
        }
        if key.level == 0 {
            return Ok(());
        }
        let Some(slot) = self.find(key.tree, key.level, key.index, false)? else {
            return Ok(());
        };
        let data = self.node(slot).data.clone();
        for (index, p) in self.children(key.tree, key.level, key.index, &data) {
            let child = Key {
                tree: key.tree,
                level: key.level - 1,
                index,
            };
            self.movable(child, p, from, found)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::sim_cache;
    use super::super::*;
    use std::collections::HashMap;

    /// Bytes that do not compress, so every leaf takes a whole page of units.
    fn leaf_bytes(leaf: u64, generation: u64) -> Vec<u8> {
        let mut rng = condense_store::sim::SimRng::new((leaf << 8) ^ generation);
        (0..PAGE_BYTES).map(|_| rng.next_u64() as u8).collect()
    }

    fn write_leaves(cache: &mut PageCache, tree: TreeId, generation: u64) -> Result<()> {
        // Tree 5 is three times as big as the others.
        let leaves = if tree == 5 { 600 } else { 200 };
        for leaf in 0..leaves {
            cache
                .leaf_mut(tree, leaf)?
                .copy_from_slice(&leaf_bytes(leaf, generation));
        }
        Ok(())
    }

    /// A checkpoint as the engine takes one, made durable at once.
    fn checkpoint(cache: &mut PageCache) -> Result<()> {
        let (mut pages, freed) = cache.prepare_checkpoint()?;
        cache.write_pages(&mut pages)?;
        cache.alloc.release(freed);
        cache.trim_file()
    }

    fn file_len(cache: &PageCache) -> Result<u64> {
        cache
            .file()
            .len()
            .map_err(|e| Error::io("measuring meta.dat", e))
    }

    /// A cache with only what the last checkpoint's roots name, as an open has.
    fn reopened(cache: &PageCache) -> PageCache {
        let mut c = PageCache::new(
            cache.file().clone(),
            PageAlloc::from_bitmap(cache.alloc.bitmap().to_vec()),
            cache.trees().clone(),
            64 << 20,
        );
        c.set_shared_pages(cache.shared_pages().clone());
        c
    }

    fn check_leaves(cache: &mut PageCache, tree: TreeId, generation: u64) -> Result<()> {
        for leaf in 0..200 {
            let got = cache.leaf(tree, leaf)?.map(|d| d.to_vec());
            assert_eq!(
                got,
                Some(leaf_bytes(leaf, generation)),
                "tree {tree} leaf {leaf}"
            );
        }
        Ok(())
    }

    /// Leaves rewritten once leave their old copies free below the new ones: the compaction
    /// moves the new ones down and cuts the file, and every page reads back from the new root.
    #[test]
    fn the_free_end_is_cut_and_every_page_reads_back() -> Result<()> {
        let mut cache = sim_cache()?;
        cache.create_tree(1, 4096);
        write_leaves(&mut cache, 1, 1)?;
        checkpoint(&mut cache)?;
        write_leaves(&mut cache, 1, 2)?;
        checkpoint(&mut cache)?;
        let before = file_len(&cache)?;
        assert_eq!(
            cache.start_compaction()?,
            0,
            "under 1 MiB to gain: left alone"
        );
        // 200 more leaves of 4 KiB past the 1 MiB floor.
        cache.create_tree(2, 4096);
        write_leaves(&mut cache, 2, 1)?;
        checkpoint(&mut cache)?;
        write_leaves(&mut cache, 2, 2)?;
        write_leaves(&mut cache, 1, 3)?;
        checkpoint(&mut cache)?;
        let before_big = file_len(&cache)?;
        assert!(before_big > before);
        // A crash after the moved pages are written, before the new root: the last root
        // (its trees and bitmap, as an open finds them) still reads every leaf.
        let last_root = reopened(&cache);
        let marked = cache.start_compaction()?;
        assert!(marked >= 200, "the pages at the end are marked: {marked}");
        let (mut pages, freed) = cache.prepare_checkpoint()?;
        cache.write_pages(&mut pages)?;
        let mut crashed = last_root;
        check_leaves(&mut crashed, 1, 3)?;
        check_leaves(&mut crashed, 2, 2)?;
        cache.alloc.release(freed);
        cache.trim_file()?;
        cache.alloc.set_ceiling(None);
        let after = file_len(&cache)?;
        assert!(
            after * 10 < before_big * 7,
            "meta.dat {before_big} -> {after} bytes"
        );
        assert_eq!(cache.dirty_pages(), 0);
        let mut again = reopened(&cache);
        check_leaves(&mut again, 1, 3)?;
        check_leaves(&mut again, 2, 2)?;
        Ok(())
    }

    /// Shared pages (clones) are never moved, even when they are all that lies at the end:
    /// their parents' counts stay as they were, and every tree reads back.
    #[test]
    fn shared_pages_stay_where_they_are() -> Result<()> {
        let mut cache = sim_cache()?;
        cache.create_tree(5, 4096);
        for tree in [5, 1, 2] {
            if tree != 5 {
                cache.create_tree(tree, 4096);
            }
            write_leaves(&mut cache, tree, 2)?;
            checkpoint(&mut cache)?;
        }
        cache.clone_tree(1, 3)?;
        cache.clone_tree(2, 4)?;
        checkpoint(&mut cache)?;
        // Tree 5, first in the file, goes: its 2.4 MB are free, under the shared 1.6 MB.
        cache.release_tree(5, &mut |_| Ok(()))?;
        checkpoint(&mut cache)?;
        let end = cache.alloc.end();
        assert!(
            cache.alloc.compaction_target(u64::MAX, 16 * 1024).is_some(),
            "the end would be worth moving"
        );
        assert!(end * 64 > 3 << 20);
        let shared = cache.shared_pages().clone();
        assert!(!shared.is_empty());
        let marked = cache.start_compaction()?;
        checkpoint(&mut cache)?;
        cache.alloc.set_ceiling(None);
        assert_eq!(marked, 0, "every page at the end is shared");
        assert_eq!(cache.shared_pages(), &shared);
        let parents: HashMap<u64, u32> = cache.count_parents()?;
        for (page, n) in &shared {
            assert_eq!(parents.get(page), Some(n), "page {page}");
        }
        let mut again = reopened(&cache);
        for tree in 1..=4 {
            check_leaves(&mut again, tree, 2)?;
        }
        Ok(())
    }
}
