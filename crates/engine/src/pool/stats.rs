//! The pool's figures ([`crate::stats`]): `condense stats`, a volume's exact share, the
//! space attribution's count and check, under the state lock.

use crate::attribution::TreeSpace;
use crate::error::{Error, Result};
use crate::format::CHUNK_ID_LIMIT;
use crate::stats::{percent_saved, PoolStats, VolumeStats};
use std::collections::HashMap;

use super::Pool;

impl Pool {
    /// One volume's exact physical share in bytes (what `du` of it should show): each block
    /// counts its chunk's record bytes divided by the number of blocks sharing that chunk.
    /// Walks the volume's map (through the page cache).
    pub fn volume_physical_bytes(&self, name: &str) -> Result<u64> {
        let vol = self.volume_id(name)?;
        let mut st = self.lock_state();
        let size = st
            .md
            .volumes
            .get(&vol)
            .map(|v| v.size)
            .ok_or_else(|| Error::NotFound(name.to_string()))?;
        let blocks = size / u64::from(self.block_size());
        let md = &mut st.md;
        let mut uses: HashMap<u64, u64> = HashMap::new();
        for (_, e) in crate::block_map::mapped(&mut md.pages, u64::from(vol), 0, blocks)? {
            if e < CHUNK_ID_LIMIT {
                *uses.entry(e).or_insert(0) += 1;
            }
        }
        let mut share = 0f64;
        for (id, n) in uses {
            if let Some(c) = md.chunks.get(&mut md.pages, id)? {
                share += c.loc.record_bytes() as f64 * n as f64 / f64::from(c.refs.max(1));
            }
        }
        md.pages.evict_to_budget()?;
        Ok(share.round() as u64)
    }

    /// One volume's figures with its exact physical share (walks its map; for `volume info`).
    pub fn volume_stats(&self, name: &str) -> Result<VolumeStats> {
        let stats = self.stats()?;
        let mut v = stats
            .volumes
            .into_iter()
            .chain(stats.snapshots)
            .find(|v| v.name == name)
            .ok_or_else(|| Error::NotFound(name.to_string()))?;
        v.physical_bytes = self.volume_physical_bytes(name)?;
        v.saving_percent = percent_saved(v.physical_bytes, v.written_bytes);
        Ok(v)
    }

    /// Count the exact per-volume figures if they are not there yet (the first time after an
    /// open): in steps, the state lock taken for each and let go between them, so reads and
    /// writes go on meanwhile ([`crate::attribution::Counting`]).
    pub fn count_figures(&self) -> Result<()> {
        let mut pace = super::Pacer::default();
        loop {
            pace.step();
            if self.count_figures_step()? {
                break;
            }
        }
        Ok(())
    }

    /// [`Pool::count_figures`] without letting go of the state lock between steps: for a
    /// process that does nothing else with the pool meanwhile (a one-shot `condense stats`),
    /// where the pauses would only make it wait (half of a 10M-chunk pool's count).
    pub fn count_figures_at_once(&self) -> Result<()> {
        self.lock_state().md.attribution().map(drop)
    }

    /// One step of [`Pool::count_figures`]: true once the figures are there.
    pub fn count_figures_step(&self) -> Result<bool> {
        self.lock_state()
            .md
            .count_attribution_step(self.opts.count_step_time)
    }

    /// The space attribution kept as the pool changed, compared with one counted from
    /// scratch, and its sum rule against the chunk table's counters. An error says what
    /// differs (for tests and `verify`-like checks; walks every map).
    pub fn check_attribution(&self) -> Result<()> {
        let mut st = self.lock_state();
        let md = &mut st.md;
        if let Some(why) = md.attribution.as_ref().and_then(|a| a.broken()) {
            return Err(Error::corrupt("space attribution", why.to_string()));
        }
        // Not broken (above), so finishing a count below leaves `released_figures` as it is.
        let trees = md.counted_trees().into_iter();
        let trees: Vec<u64> = trees.chain(md.released_figures.keys().copied()).collect();
        let a = md.attribution()?;
        let (kept_totals, kept_shared) = (a.totals(), a.shared());
        let kept: Vec<(u64, TreeSpace)> = trees.into_iter().map(|t| (t, a.tree(t))).collect();
        let fresh = md.build_attribution()?;
        let live = md.chunks.live();
        // Chunks only maps being released name, once their entries are off the figures, are
        // live and no tree's; so are bases only deltas name (docs/STATS.md "Delta
        // compression").
        let releasing = !md.releasing.is_empty() || md.chunks.deltas.is_some();
        if kept_totals != live
            && !(releasing
                && kept_totals.chunks <= live.chunks
                && kept_totals.stored_bytes <= live.stored_bytes)
        {
            return Err(Error::corrupt(
                "space attribution",
                format!("exclusive + shared = {kept_totals:?}, live chunks {live:?}"),
            ));
        }
        if let Some((v, t)) = kept.iter().find(|&&(v, t)| t != fresh.tree(v)) {
            return Err(Error::corrupt(
                "space attribution",
                format!("tree {v}: kept {t:?}, counted {:?}", fresh.tree(*v)),
            ));
        }
        if kept_shared != fresh.shared() {
            return Err(Error::corrupt(
                "space attribution",
                format!("shared: kept {kept_shared:?}, counted {:?}", fresh.shared()),
            ));
        }
        Ok(())
    }

    /// The shape of a volume's block-map tree and where its root page is (diagnostics).
    pub fn map_root(&self, name: &str) -> Result<crate::page_cache::TreeInfo> {
        let vol = self.volume_id(name)?;
        let st = self.lock_state();
        st.md
            .pages
            .tree(u64::from(vol))
            .ok_or_else(|| Error::NotFound(name.to_string()))
    }

    /// The bytes the pool takes where it is stored (`physical_bytes` of [`Pool::stats`]), alone:
    /// no per-volume figures are counted, so the write path goes on paying nothing for them
    /// (an import measures its pool's growth with this).
    pub fn physical_bytes(&self) -> Result<u64> {
        Ok(self.physical_and_remote()?.0)
    }

    /// The pool's physical bytes, and on S3 what the bucket holds.
    fn physical_and_remote(&self) -> Result<(u64, Option<crate::io::StoreStatus>)> {
        // An S3 pool: one LIST gives the objects and the bytes the bucket holds; the files
        // the local directory holds on their way to it count too (a local pool directory's
        // total includes a writeback cache's held files).
        let mut remote = self.dir().store_status();
        let physical = match remote.as_mut() {
            Some(r) => {
                let held = self
                    .dir()
                    .held()
                    .map_err(|e| Error::io("measuring the files held in the cache", e))?;
                let (segments, journal) = held.iter().fold((0, 0), |(s, j), (name, len)| {
                    match crate::format::parse_segment_name(name) {
                        Some(_) => (s + len, j),
                        None => (s, j + len),
                    }
                });
                // Not yet in the bucket: the held segments, and the journal unless every
                // flush uploads its records (`remote` durability).
                r.pending_bytes = segments
                    + if r.durability == crate::format::Durability::Local {
                        journal
                    } else {
                        0
                    };
                r.bytes + segments + journal
            }
            None => self
                .dir()
                .total_bytes()
                .map_err(|e| Error::io("measuring the pool directory", e))?,
        };
        Ok((physical, remote))
    }

    /// The dedup index's and the RAM's figures only ([`PoolStats::add_ram`]; the rest are
    /// left at zero): no per-volume figures are counted, so `condense index show` answers at
    /// once on a pool of any size (counting them took 10 s of a 10M-chunk pool's 13 s).
    pub fn index_stats(&self) -> PoolStats {
        let st = self.lock_state();
        let mut s = PoolStats {
            block_size: self.block_size(),
            unique_chunks: st.md.chunks.live_chunks,
            ..Default::default()
        };
        s.add_ram(&st.md);
        s
    }

    /// The pool's activity counters since it was opened (cheap: a few atomic loads).
    pub fn counters(&self) -> crate::CounterValues {
        self.counters.values()
    }

    /// Pool and per-volume figures, from counters (no map is walked).
    pub fn stats(&self) -> Result<PoolStats> {
        let (physical, remote) = self.physical_and_remote()?;
        // The figures' first count, in steps that each take the state lock for a few
        // milliseconds, so I/O goes on meanwhile; an error is reported below.
        let _ = self.count_figures();
        let mut st = self.lock_state();
        // Built without filling the page cache (its walks read pages past it).
        let built = st.md.attribution().map(drop);
        let md = &st.md;
        let bs = u64::from(self.block_size());
        let mut s = PoolStats {
            block_size: self.block_size(),
            attribution_error: built.err().map(|e| e.to_string()),
            ..Default::default()
        };
        s.add_volumes(md, bs);
        s.add_space(md, &st.segments, bs, physical);
        s.add_ram(md);
        Self::add_delta_figures(&st, &mut s);
        let md = &st.md;
        s.releasing = super::release::pending(md);
        if let (Some(a), false) = (&md.attribution, s.releasing.is_empty()) {
            // Live chunks no tree of the figures names (only maps being released whose
            // entries are off the figures), and those a map whose entries are not off yet
            // names alone.
            let live = md.chunks.live().record_bytes();
            let unnamed = live.saturating_sub(a.totals().record_bytes());
            let alone: u64 = md
                .released_figures
                .keys()
                .map(|&t| a.tree(t).exclusive.record_bytes())
                .sum();
            s.releasing_bytes = unnamed + alone;
        }
        s.checkpoints = md.checkpoints;
        s.read_errors = self.read_errors.load(std::sync::atomic::Ordering::Relaxed);
        s.remote = remote;
        drop(st);
        s.scrub = self.scrub_status();
        Ok(s)
    }
}
