//! `condense stats`: how much the pool saves, per pool and per volume.
//!
//! Definitions (also in docs/STATS.md):
//! - `written_bytes`: blocks holding data (not zero, not unmapped) × block size.
//! - `physical_bytes`: every file of the pool directory (data and metadata), as `du -sb`, plus
//!   the segments and journal a writeback cache holds for the pool.
//! - `saving_percent` = 100 × (1 − physical_bytes / written_bytes).
//! - `dedup_saving_percent` = 100 × (1 − unique_chunks × block size / written_bytes).
//! - `compression_saving_percent` = 100 × (1 − stored payload bytes / (unique_chunks × block size)).
//! - A volume's `physical_bytes` is its share: each block counts its chunk's record bytes
//!   divided by the number of blocks sharing that chunk.
//! - A volume's or snapshot's exact figures come from the space attribution
//!   ([`crate::attribution`]): `exclusive` (chunks only it names: what deleting it frees),
//!   `shared` (chunks others name too), and its own dedup and compression ratios. Sum rule:
//!   the exclusive parts of all volumes and snapshots plus the pool's shared part are the
//!   pool's live chunks (`chunk_bytes`).

use crate::attribution::{Space, TreeSpace};
use crate::error::{Error, Result};
use crate::format::{CHUNK_ID_LIMIT, SEGMENT_HEADER_BYTES};
use crate::locks::lock;
use crate::metadata::Metadata;
use crate::pool::Pool;
use crate::segment::Segments;
use std::collections::HashMap;

#[derive(Clone, Debug, Default)]
pub struct VolumeStats {
    pub name: String,
    pub logical_bytes: u64,
    pub written_bytes: u64,
    pub zero_bytes: u64,
    /// The volume's share of the pool's live chunk bytes, in proportion to its data blocks
    /// (kept from counters; [`Pool::volume_physical_bytes`] gives the exact share).
    pub physical_bytes: u64,
    pub saving_percent: f64,
    /// For a snapshot (`name` is `VOLUME@SNAPSHOT`): the volume it was taken of.
    pub snapshot_of: Option<String>,
    /// Exact: the chunks only it names and those it shares (`None`: the attribution could
    /// not be built, see [`PoolStats::attribution_error`]).
    pub space: Option<TreeSpace>,
    /// Written blocks per distinct chunk it names (`None`: nothing written, or no figures).
    pub dedup_ratio: Option<f64>,
    /// Block bytes of the distinct chunks it names per stored payload byte.
    pub compression_ratio: Option<f64>,
}

impl VolumeStats {
    /// Bytes of chunk records only this volume or snapshot names: what deleting it frees
    /// (once GC runs).
    pub fn exclusive_bytes(&self) -> Option<u64> {
        self.space.map(|s| s.exclusive.record_bytes())
    }

    /// Bytes of chunk records it names that another volume or snapshot names too.
    pub fn shared_bytes(&self) -> Option<u64> {
        self.space.map(|s| s.shared.record_bytes())
    }

    /// Its own ratios from its written blocks and what it names.
    fn set_ratios(&mut self, bs: u64) {
        let Some(r) = self.space.map(|s| s.referenced()) else {
            return;
        };
        let ratio = |a: u64, b: u64| (b > 0).then(|| a as f64 / b as f64);
        self.dedup_ratio = ratio(self.written_bytes, r.chunks * bs);
        self.compression_ratio = ratio(r.chunks * bs, r.stored_bytes);
    }
}

#[derive(Clone, Debug, Default)]
pub struct PoolStats {
    pub block_size: u32,
    pub logical_bytes: u64,
    pub written_bytes: u64,
    pub zero_bytes: u64,
    pub unique_chunks: u64,
    /// Payload bytes of live chunks after compression.
    pub stored_bytes: u64,
    /// Record bytes of live chunks (payload and record headers): what segments hold live.
    pub chunk_bytes: u64,
    /// Chunks two or more volumes or snapshots name (`None`: no figures).
    pub shared: Option<Space>,
    /// RAM the space attribution holds.
    pub attribution_ram_bytes: u64,
    /// Bytes of the figures' pages spilled to scratch files past their RAM budget.
    pub attribution_scratch_bytes: u64,
    /// Why the per-volume figures are missing, if they are.
    pub attribution_error: Option<String>,
    pub data_bytes: u64,
    pub metadata_bytes: u64,
    pub physical_bytes: u64,
    pub dead_bytes: u64,
    pub segments: u64,
    pub dedup_saving_percent: f64,
    pub compression_saving_percent: f64,
    pub saving_percent: f64,
    /// RAM held by the metadata: the dedup index, the page cache and the page bitmap.
    pub index_ram_bytes: u64,
    pub ram_bytes_per_unique_chunk: f64,
    /// The dedup index alone, and per unique chunk.
    pub dedup_index_bytes: u64,
    /// Where the dedup index in RAM came from: "not built" (until the first write that needs
    /// it), "loaded" (saved at the last clean close), "built" (from the chunk table).
    pub dedup_index: String,
    pub metadata_cache_budget_bytes: u64,
    pub metadata_cache_used_bytes: u64,
    pub metadata_cache_hits: u64,
    pub metadata_cache_misses: u64,
    /// Metadata page bytes written over the pool's life (checkpoints and eviction).
    pub metadata_page_bytes_written: u64,
    /// Bytes of `meta.dat` the current state uses (the rest is free space inside the file).
    pub metadata_page_bytes_live: u64,
    pub checkpoints: u64,
    pub read_errors: u64,
    /// Volumes (not snapshots), by name. The pool's logical and written totals count these.
    pub volumes: Vec<VolumeStats>,
    /// Snapshots, by name. Their physical shares and the volumes' add up to the pool's live
    /// chunk bytes.
    pub snapshots: Vec<VolumeStats>,
    /// The bucket side of a pool in an object store (`None`: a local pool).
    pub remote: Option<crate::io::StoreStatus>,
    /// The scrub: the pass under way in this process, the last finished one in the pool.
    pub scrub: crate::scrub::ScrubStatus,
}

pub(crate) fn percent_saved(used: u64, of: u64) -> f64 {
    if of == 0 {
        0.0
    } else {
        100.0 * (1.0 - used as f64 / of as f64)
    }
}

impl PoolStats {
    /// Each volume's and snapshot's figures, and the volumes' totals.
    fn add_volumes(&mut self, md: &Metadata, bs: u64) {
        let total_data_blocks: u64 = md.volumes.values().map(|v| v.counts.data_blocks).sum();
        let live_record_bytes = md.chunks.live().record_bytes();
        for (id, v) in &md.volumes {
            let written = v.counts.data_blocks * bs;
            let share = if total_data_blocks == 0 {
                0
            } else {
                (live_record_bytes as u128 * u128::from(v.counts.data_blocks)
                    / u128::from(total_data_blocks)) as u64
            };
            let snapshot_of = v.snapshot_of.map(|of| {
                md.volumes
                    .get(&of)
                    .map_or_else(String::new, |o| o.name.clone())
            });
            let mut vs = VolumeStats {
                name: v.name.clone(),
                logical_bytes: v.size,
                written_bytes: written,
                zero_bytes: v.counts.zero_blocks * bs,
                physical_bytes: share,
                saving_percent: percent_saved(share, written),
                snapshot_of,
                space: md.attribution.as_ref().map(|a| a.tree(*id)),
                ..Default::default()
            };
            vs.set_ratios(bs);
            if vs.snapshot_of.is_some() {
                self.snapshots.push(vs);
                continue;
            }
            self.volumes.push(vs);
            self.logical_bytes += v.size;
            self.written_bytes += written;
            self.zero_bytes += v.counts.zero_blocks * bs;
        }
        self.volumes.sort_by(|a, b| a.name.cmp(&b.name));
        self.snapshots.sort_by(|a, b| a.name.cmp(&b.name));
        // Shares are rounded down: together they never exceed the live chunk bytes.
        debug_assert!(
            self.volumes
                .iter()
                .chain(&self.snapshots)
                .map(|v| v.physical_bytes)
                .sum::<u64>()
                <= live_record_bytes
        );
    }

    /// Chunks, segments, the pool's physical bytes and the savings.
    fn add_space(&mut self, md: &Metadata, segments: &Segments, bs: u64, physical: u64) {
        self.unique_chunks = md.chunks.live_chunks;
        self.stored_bytes = md.chunks.live_stored_bytes;
        self.chunk_bytes = md.chunks.live().record_bytes();
        self.shared = md.attribution.as_ref().map(|a| a.shared());
        self.attribution_ram_bytes = md.attribution.as_ref().map_or(0, |a| a.ram_bytes());
        self.attribution_scratch_bytes = md.attribution.as_ref().map_or(0, |a| a.scratch_bytes());
        self.data_bytes = segments.total_bytes();
        self.segments = segments.ids().count() as u64;
        self.dead_bytes = segments
            .ids()
            .map(|(id, len)| {
                len.saturating_sub(SEGMENT_HEADER_BYTES as u64 + md.chunks.segment_live_bytes(id))
            })
            .sum();
        self.physical_bytes = physical;
        self.metadata_bytes = physical.saturating_sub(self.data_bytes);
        self.dedup_saving_percent = percent_saved(self.unique_chunks * bs, self.written_bytes);
        self.compression_saving_percent = percent_saved(self.stored_bytes, self.unique_chunks * bs);
        self.saving_percent = percent_saved(self.physical_bytes, self.written_bytes);
    }

    /// RAM held by the dedup index and the metadata page cache, and the page cache's figures.
    fn add_ram(&mut self, md: &Metadata) {
        // The index is built by the first write that needs it; until then, show what it will
        // take, so a read-only look at a pool still answers "how much RAM to serve this".
        self.dedup_index_bytes = if md.index_ready() {
            md.index.ram_bytes()
        } else {
            crate::dedup_index::projected_ram_bytes(md.chunks.live_chunks)
        };
        self.dedup_index = md.index_origin.as_str().to_string();
        self.index_ram_bytes = self.dedup_index_bytes + md.pages.ram_bytes();
        self.ram_bytes_per_unique_chunk = if self.unique_chunks == 0 {
            0.0
        } else {
            self.index_ram_bytes as f64 / self.unique_chunks as f64
        };
        self.metadata_cache_budget_bytes = md.pages.budget_bytes();
        self.metadata_cache_used_bytes =
            md.pages.cached_pages() as u64 * crate::page_cache::PAGE_BYTES as u64;
        self.metadata_cache_hits = md.pages.counters.hits;
        self.metadata_cache_misses = md.pages.counters.misses;
        self.metadata_page_bytes_written = md.meta_bytes_written();
        self.metadata_page_bytes_live =
            md.pages.alloc.used_units() * crate::page_cache::UNIT as u64;
    }
}

impl Pool {
    /// One volume's exact physical share in bytes (what `du` of it should show): each block
    /// counts its chunk's record bytes divided by the number of blocks sharing that chunk.
    /// Walks the volume's map (through the page cache).
    pub fn volume_physical_bytes(&self, name: &str) -> Result<u64> {
        let vol = self.volume_id(name)?;
        let mut st = lock(&self.state);
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
        while !self.count_figures_step()? {
            // The lock is not fair: without a pause this thread would take it back before a
            // waiting read or write is scheduled (a yield is not enough on 2 cores).
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Ok(())
    }

    /// [`Pool::count_figures`] without letting go of the state lock between steps: for a
    /// process that does nothing else with the pool meanwhile (a one-shot `condense stats`),
    /// where the pauses would only make it wait (half of a 10M-chunk pool's count).
    pub fn count_figures_at_once(&self) -> Result<()> {
        lock(&self.state).md.attribution().map(drop)
    }

    /// One step of [`Pool::count_figures`]: true once the figures are there.
    pub fn count_figures_step(&self) -> Result<bool> {
        lock(&self.state).md.count_attribution_step()
    }

    /// The space attribution kept as the pool changed, compared with one counted from
    /// scratch, and its sum rule against the chunk table's counters. An error says what
    /// differs (for tests and `verify`-like checks; walks every map).
    pub fn check_attribution(&self) -> Result<()> {
        let mut st = lock(&self.state);
        let md = &mut st.md;
        if let Some(why) = md.attribution.as_ref().and_then(|a| a.broken()) {
            return Err(Error::corrupt("space attribution", why.to_string()));
        }
        let vols: Vec<u32> = md.volumes.keys().copied().collect();
        let a = md.attribution()?;
        let (kept_totals, kept_shared) = (a.totals(), a.shared());
        let kept: Vec<(u32, TreeSpace)> = vols.into_iter().map(|v| (v, a.tree(v))).collect();
        let fresh = md.build_attribution()?;
        let live = md.chunks.live();
        if kept_totals != live {
            return Err(Error::corrupt(
                "space attribution",
                format!("exclusive + shared = {kept_totals:?}, live chunks {live:?}"),
            ));
        }
        if let Some((v, t)) = kept.iter().find(|&&(v, t)| t != fresh.tree(v)) {
            return Err(Error::corrupt(
                "space attribution",
                format!("volume id {v}: kept {t:?}, counted {:?}", fresh.tree(*v)),
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
        let st = lock(&self.state);
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

    /// Pool and per-volume figures, from counters (no map is walked).
    pub fn stats(&self) -> Result<PoolStats> {
        let (physical, remote) = self.physical_and_remote()?;
        // The figures' first count, in steps that each take the state lock for a few
        // milliseconds, so I/O goes on meanwhile; an error is reported below.
        let _ = self.count_figures();
        let mut st = lock(&self.state);
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
        s.checkpoints = md.checkpoints;
        s.read_errors = self.read_errors.load(std::sync::atomic::Ordering::Relaxed);
        s.remote = remote;
        drop(st);
        s.scrub = self.scrub_status();
        Ok(s)
    }
}
