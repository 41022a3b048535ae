//! The scrub's passes in the pool ([`crate::scrub`] has the rules): a window of the chunk
//! table at a time under the GC lock, records read without the state lock, damaged records
//! healed from the cache tier's copy; the blocks naming damaged chunks found by walking the
//! maps in bounded steps ([`Pool::blocks_naming`]).

use crate::error::Result;
use crate::format::CHUNKS_PER_PAGE;
use crate::locks::lock;
use crate::scrub_status::{
    now_unix, ranges, ScrubPass, ScrubStatus, DAMAGED_KEPT, LAST_KEY, WINDOW_PAGES,
};
use crate::verify::LEAVES_PER_STEP;
use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::Pool;

impl Pool {
    /// The scrub's progress and results: the pass under way (in this process) and the last
    /// finished one (recorded in the pool).
    pub fn scrub_status(&self) -> ScrubStatus {
        let mut s = lock(&self.scrub.status).clone();
        s.last = self.meta_get(LAST_KEY).map(|b| ScrubPass::decode(&b));
        s
    }

    /// Ask the background scrub to start a pass now (`false`: one is under way already).
    pub fn request_scrub(&self) -> bool {
        if lock(&self.scrub.status).running {
            return false;
        }
        self.scrub.start.store(true, Ordering::Relaxed);
        true
    }

    /// Ask the pass under way to stop after its current window (`false`: none is).
    pub fn stop_scrub(&self) -> bool {
        let running = lock(&self.scrub.status).running;
        if running {
            self.scrub.stop.store(true, Ordering::Relaxed);
        }
        running
    }

    /// One whole pass at `rate` record bytes per second (0: unlimited), reporting progress as
    /// it goes; `keep_going` is asked between windows. The result is recorded in the pool
    /// (unless it is read-only) and returned.
    pub fn scrub_pass(
        &self,
        rate: u64,
        keep_going: &dyn Fn() -> bool,
        progress: &dyn Fn(&ScrubPass),
    ) -> Result<ScrubPass> {
        let (total, next_id) = {
            let st = self.lock_state();
            (st.md.chunks.live_chunks, st.md.chunks.next_id)
        };
        let mut pass = ScrubPass {
            started_unix: now_unix(),
            chunks_total: total,
            ..Default::default()
        };
        self.scrub.stop.store(false, Ordering::Relaxed);
        {
            let mut s = lock(&self.scrub.status);
            s.running = true;
            s.rate_bytes_per_sec = rate;
            s.current = Some(pass.clone());
        }
        let began = Instant::now();
        let per = CHUNKS_PER_PAGE as u64;
        let mut page = 0u64;
        let mut bad_ids = HashSet::new();
        // Stopped because the process stops: not recorded, so the schedule starts the pass
        // again at the next start (an administrator's stop is recorded, as the end of a pass).
        let mut shutting_down = false;
        while page * per < next_id {
            if !keep_going() {
                shutting_down = true;
            }
            if shutting_down || self.scrub.stop.load(Ordering::Relaxed) {
                pass.stopped = true;
                break;
            }
            {
                // No chunk moves and no segment goes while its record is read.
                let _gc = lock(&self.gc_lock);
                let mut problems = Vec::new();
                let work = self.chunk_window(page, WINDOW_PAGES, &mut problems);
                for w in work.iter().filter(|w| w.entry.refs > 0) {
                    let (_, bad) = self.check_chunk(w);
                    pass.chunks_checked += 1;
                    pass.bytes_checked += w.entry.loc.record_bytes();
                    if let Some(b) = bad {
                        if self.heal_from_cache(w) {
                            tracing::warn!(
                                "scrub: chunk {}: {}; written again from the cache tier's valid copy",
                                b.0,
                                b.1
                            );
                            pass.healed_chunks += 1;
                            continue;
                        }
                        tracing::warn!("scrub: chunk {}: {}", b.0, b.1);
                        pass.damaged_chunks += 1;
                        bad_ids.insert(b.0);
                        if pass.damaged.len() < DAMAGED_KEPT {
                            pass.damaged.push(b);
                        }
                    }
                }
                for p in problems {
                    tracing::warn!("scrub: {p}");
                }
            }
            page += WINDOW_PAGES;
            lock(&self.scrub.status).current = Some(pass.clone());
            progress(&pass);
            self.scrub_wait(rate, pass.bytes_checked, began, keep_going);
        }
        if !bad_ids.is_empty() {
            // Blocks naming a forward to a damaged chunk read that chunk's record too.
            let forwards = self.forwards_to(&bad_ids);
            bad_ids.extend(forwards);
            pass.damaged_blocks = self.blocks_naming(&bad_ids)?;
        }
        pass.finished_unix = Some(now_unix());
        if !self.is_read_only() && !shutting_down {
            // A report, not state: a pool that cannot take the record still scrubbed.
            if let Err(e) = self
                .meta_put(LAST_KEY, Some(&pass.encode()))
                .and_then(|()| self.flush())
            {
                tracing::warn!("scrub: cannot record the pass in the pool: {e}");
            }
        }
        {
            let mut s = lock(&self.scrub.status);
            s.running = false;
            s.current = Some(pass.clone());
        }
        progress(&pass);
        Ok(pass)
    }

    /// Write chunk `w` again from the cache tier's copy of its record, if the tier holds a
    /// valid one and the chunk has not moved since it was read; true if it was. The caller
    /// holds the GC lock.
    fn heal_from_cache(&self, w: &crate::verify::ChunkToCheck) -> bool {
        let Some(good) = self
            .tier()
            .and_then(|c| c.lookup(w.id, &w.entry.fp, &w.entry.loc))
        else {
            return false;
        };
        // The copy must be the whole chunk: decompress it and check its fingerprint.
        let copy = crate::verify::ChunkToCheck {
            id: w.id,
            entry: w.entry,
            file: None,
            in_memory: Some(good),
        };
        if self.check_chunk(&copy).1.is_some() {
            return false;
        }
        let good = copy.in_memory.unwrap_or_default();
        match self.rewrite_chunk(w.id, &w.entry.loc, &good) {
            Ok(done) => done,
            Err(e) => {
                tracing::warn!("scrub: writing chunk {} again failed: {e}", w.id);
                false
            }
        }
    }

    /// Sleep until `bytes` read since `began` are within `rate` (in steps, asking
    /// `keep_going`).
    fn scrub_wait(&self, rate: u64, bytes: u64, began: Instant, keep_going: &dyn Fn() -> bool) {
        if rate == 0 {
            return;
        }
        let due = Duration::from_secs_f64(bytes as f64 / rate as f64);
        while began.elapsed() < due {
            if !keep_going() || self.scrub.stop.load(Ordering::Relaxed) {
                return;
            }
            std::thread::sleep((due - began.elapsed()).min(Duration::from_millis(100)));
        }
    }

    /// Every block of every volume and snapshot naming one of `ids`, as (name, first block,
    /// blocks) ranges. Each map is walked [`LEAVES_PER_STEP`] leaves per hold of the state
    /// lock: a block is listed if it named one of `ids` when its leaf was read.
    pub fn blocks_naming(&self, ids: &HashSet<u64>) -> Result<Vec<(String, u64, u64)>> {
        let per = crate::format::MAP_PAGE_ENTRIES as u64;
        let vols: Vec<(u32, String, u64)> = {
            let st = self.lock_state();
            st.md
                .volumes
                .iter()
                .map(|(&id, v)| (id, v.name.clone(), v.size / u64::from(self.block_size())))
                .collect()
        };
        let mut found: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        for (vol, name, blocks) in vols {
            let hit = self.blocks_naming_in(vol, blocks.div_ceil(per), ids)?;
            if !hit.is_empty() {
                found.insert(name, hit);
            }
        }
        Ok(found
            .into_iter()
            .flat_map(|(v, b)| {
                ranges(&b)
                    .into_iter()
                    .map(move |(first, n)| (v.clone(), first, n))
            })
            .collect())
    }
}

impl Pool {
    /// The blocks of volume `vol`'s leaves `[0, leaves)` naming one of `ids`, sorted, in
    /// steps of [`LEAVES_PER_STEP`] leaves per hold of the state lock. A volume deleted
    /// meanwhile has no tree: its walk ends there; a damaged map page ends it too (verify
    /// reports it).
    fn blocks_naming_in(&self, vol: u32, leaves: u64, ids: &HashSet<u64>) -> Result<Vec<u64>> {
        let per = crate::format::MAP_PAGE_ENTRIES as u64;
        let mut hit = Vec::new();
        let mut next = 0;
        // Lets a waiting read or write take the lock between steps (as the verify walk does).
        let mut pacer = super::Pacer::default();
        loop {
            pacer.step();
            let mut st = self.lock_state();
            let (mut visited, mut last) = (0u64, None);
            let walked =
                st.md
                    .pages
                    .for_each_leaf_page(u64::from(vol), next, leaves, &mut |li, _, leaf| {
                        crate::block_map::leaf_entries(leaf, |i, id| {
                            if ids.contains(&id) {
                                hit.push(li * per + i as u64);
                            }
                        });
                        visited += 1;
                        last = Some(li);
                        Ok(visited < LEAVES_PER_STEP)
                    });
            st.md.pages.evict_to_budget()?;
            drop(st);
            match (walked, last) {
                (Ok(()), Some(li)) if visited == LEAVES_PER_STEP => next = li + 1,
                _ => {
                    hit.sort_unstable();
                    return Ok(hit);
                }
            }
        }
    }
}
