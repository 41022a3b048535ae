//! `condense stats`: how much the pool saves, per pool and per volume.
//!
//! Owns: the figures ([`PoolStats`], [`VolumeStats`]) and how they are added up from the
//! metadata; the engine's `Pool::stats` and its kin (crates/engine/src/pool/stats.rs) take the
//! pool's state lock and call them (re-exported as `condense_engine::stats`).
//!
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
use crate::metadata::Metadata;
use condense_format::SEGMENT_HEADER_BYTES;
use condense_store::segment::Segments;

#[derive(Clone, Debug, Default)]
pub struct VolumeStats {
    pub name: String,
    pub logical_bytes: u64,
    pub written_bytes: u64,
    pub zero_bytes: u64,
    /// The volume's share of the pool's live chunk bytes, in proportion to its data blocks
    /// (kept from counters; the engine's `Pool::volume_physical_bytes` gives the exact share).
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

/// One map still being released, for `stats`, `top` and metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingRelease {
    /// The deleted volume's name.
    pub name: String,
    /// Data blocks it held when deleted.
    pub data_blocks: u64,
    /// Data blocks still held (estimated from the leaves left).
    pub blocks_left: u64,
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
    /// it), "loaded" (saved at the last clean close), "built" (from the chunk table),
    /// "building" (in steps, by a served pool).
    pub dedup_index: String,
    /// The dedup index's mode: "dense" or "sparse" (the index in RAM's once built, else the
    /// pool's setting, which the build follows).
    pub dedup_index_mode: String,
    /// The sparse index's budget in bytes (`--index-memory`; 0 for dense, which has none).
    pub dedup_index_budget_bytes: u64,
    /// Entries the index holds: chunks (dense) or hooks (sparse); 0 until built.
    pub dedup_index_entries: u64,
    /// The sparse index's lookups since open, those its locality cache or a hook answered,
    /// and those that found nothing (new data, or a duplicate it could not see); all 0 for
    /// dense.
    pub dedup_index_lookups: u64,
    pub dedup_index_cache_hits: u64,
    pub dedup_index_hook_hits: u64,
    pub dedup_index_misses: u64,
    /// Hooks the sparse index dropped to stay within its budget (halving its rate, or at
    /// the sparsest rate the oldest pages').
    pub dedup_index_hooks_dropped: u64,
    /// The sparse index's hook rate now: one fingerprint in this many (0 for dense).
    pub dedup_index_hook_rate: u64,
    /// Chunks the merge pass (`condense index merge`) found holding an older chunk's data and
    /// merged into it, over the pool's life.
    pub dedup_merged_chunks: u64,
    /// Delta compression's figures (docs/STATS.md).
    pub delta: crate::sketch_index::DeltaFigures,
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
    pub remote: Option<condense_store::io::StoreStatus>,
    /// The scrub: the pass under way in this process, the last finished one in the pool.
    pub scrub: condense_format::scrub_status::ScrubStatus,
    /// Deleted volumes' maps still being released in the background, oldest first.
    pub releasing: Vec<PendingRelease>,
    /// Record bytes of live chunks only maps being released still name (with the
    /// per-volume figures; 0 without them): they go as the release goes, then GC reclaims them.
    pub releasing_bytes: u64,
}

pub fn percent_saved(used: u64, of: u64) -> f64 {
    if of == 0 {
        0.0
    } else {
        100.0 * (1.0 - used as f64 / of as f64)
    }
}

impl PoolStats {
    /// Each volume's and snapshot's figures, and the volumes' totals.
    pub fn add_volumes(&mut self, md: &Metadata, bs: u64) {
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
                space: md.attribution.as_ref().map(|a| a.tree(u64::from(*id))),
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
    pub fn add_space(&mut self, md: &Metadata, segments: &Segments, bs: u64, physical: u64) {
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
    pub fn add_ram(&mut self, md: &Metadata) {
        // The index is built by the first write that needs it; until then, show what it will
        // take, so a read-only look at a pool still answers "how much RAM to serve this".
        self.dedup_index_bytes = if md.index_ready() {
            md.index.ram_bytes()
        } else {
            crate::dedup_index::projected_ram_bytes(md.chunks.live_chunks)
        };
        self.dedup_index = if md.index_build.is_some() {
            "building".to_string()
        } else if md.index_load.is_some() {
            "loading".to_string()
        } else {
            md.index_origin.as_str().to_string()
        };
        let setting = if md.index_ready() {
            md.index.setting()
        } else {
            crate::index::IndexSetting::of(&md.meta)
        };
        self.dedup_index_mode = setting.mode().to_string();
        self.dedup_index_budget_bytes = setting.budget();
        if !md.index_ready() {
            if let crate::index::IndexSetting::Sparse { budget } = setting {
                self.dedup_index_bytes = crate::sparse_index::projected_ram_bytes(budget);
            }
        }
        self.dedup_index_entries = if md.index_ready() { md.index.len() } else { 0 };
        self.dedup_merged_chunks = md.chunks.forwards.unwrap_or(0);
        if let Some(sp) = md.index.sparse() {
            self.dedup_index_lookups = sp.counters.lookups;
            self.dedup_index_cache_hits = sp.counters.cache_hits;
            self.dedup_index_hook_hits = sp.counters.hook_hits;
            self.dedup_index_misses = sp.counters.misses;
            self.dedup_index_hooks_dropped = sp.counters.hooks_dropped;
            self.dedup_index_hook_rate = sp.hook_rate();
        }
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
