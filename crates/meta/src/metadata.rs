//! The metadata stores of a pool and the one function that changes them.
//!
//! Owns: the volume list, every block map and the chunk table (paged, behind one
//! [`PageCache`]), the dedup index, and the named metadata records. Every change is a
//! [`JournalRecord`] applied by [`Metadata::apply`], live and during replay alike; nothing
//! else writes these structures. `condense repair`'s salvage replay goes through the same
//! interpretation ([`Metadata::apply_in`] in [`Mode::Salvage`]), which tolerates and reports
//! what a damaged journal leaves inconsistent instead of failing. The I/O side (segments,
//! journal, group commit) lives in `condense_engine::pool`.
//!
//! Invariants:
//! - Applying a record to pages already in memory does no I/O; callers load what a record
//!   touches first ([`Metadata::prefetch`]) so that a damaged or unreadable page fails the
//!   request cleanly instead of half-applying it.
//! - The counters (per volume: data and zero blocks; chunk table: live chunks and bytes) are
//!   exact after every record, so statistics never walk a map.
//! - Once built, the space attribution ([`crate::attribution`]) changes with every map entry
//!   set and every tree added or released, so it stays exact too; a salvage replay drops it.

use crate::attribution::{Attribution, Counting, SpillTo};
use crate::block_map::{self, MapCounts};
use crate::chunk_table::{page_of, ChunkTable};
use crate::dedup_index::{DedupIndex, IndexOrigin, SavedIndex};
use crate::index::{Index, IndexSetting};
use crate::page_cache::{PageCache, TreeId, CHUNK_TREE};
use crate::sparse_index::ChunkPages;
use condense_format::dedup_index::{IndexStamp, DEDUP_INDEX_NAME};
use condense_format::error::{Error, Result};
use condense_format::*;
use std::collections::{BTreeMap, HashMap};

/// Writes at or above this many references to one chunk store a new copy instead.
pub const REFS_MAX: u32 = u32::MAX / 2;

/// How long a step of the figures' count holds the state lock (at least; one unit more):
/// long enough that the pause after it, at most `MAX_STRETCH` times the step
/// (condense-format's pacing.rs), lets busy VMs make their `REQUESTS_BETWEEN_STEPS` requests.
/// With steps of one 0.1-0.3 ms unit the cap bound: a step every ~20 of the VMs' requests,
/// and 1 % of them slowed (bench/README.md "admin-stall.sh", seventh pass).
pub const COUNT_STEP_TIME: std::time::Duration = std::time::Duration::from_micros(2000);

/// How [`Metadata::apply_in`] applies a record.
pub enum Mode<'a> {
    /// Live changes and replay: reference counts are kept; a change to a volume that does not
    /// exist, or a page that cannot be read, is an error.
    Strict,
    /// `condense repair`'s replay of the batches around a damaged stretch of the journal,
    /// which may name chunks and volumes the damaged batches made: nothing trusts reference
    /// counts or chunk existence. Map entries are set as written (the rebuild resolves their
    /// chunks or reports the blocks lost), chunk locations go to the hook, chunk drops are
    /// ignored (the rebuild drops what nothing names), and a change to a volume that does not
    /// exist or no longer fits it, or to a page that cannot be read, is skipped and told to
    /// the hook.
    Salvage(&'a mut dyn SalvageHook),
}

/// What a salvage replay keeps aside for the rebuild (implemented by `repair`).
pub trait SalvageHook {
    /// A batch put chunk `id` at `loc`: a new chunk with its fingerprint, or a moved one.
    fn chunk_placed(&mut self, id: u64, loc: &Location, fp: Option<&Fingerprint>);
    /// A batch made chunk `id` a forward to chunk `to` (its blocks read `to`'s record).
    fn chunk_forwarded(&mut self, id: u64, to: u64);
    /// Blocks `[start, end)` of volume `vol` were written (mapped, zeroed or trimmed).
    fn blocks_written(&mut self, vol: u32, start: u64, end: u64);
    /// A change that could not be applied, in words.
    fn skip(&mut self, what: String);
}

impl Mode<'_> {
    /// The outcome of a step: strict, an error ends the record; salvage, it is told to the
    /// hook (`what` describes the step) and the step is skipped (`None`).
    fn tolerate<T>(
        &mut self,
        r: Result<T>,
        what: impl FnOnce(&Error) -> String,
    ) -> Result<Option<T>> {
        match (r, self) {
            (Ok(v), _) => Ok(Some(v)),
            (Err(e), Mode::Strict) => Err(e),
            (Err(e), Mode::Salvage(s)) => {
                s.skip(what(&e));
                Ok(None)
            }
        }
    }

    fn blocks_written(&mut self, vol: u32, start: u64, end: u64) {
        if let Mode::Salvage(s) = self {
            s.blocks_written(vol, start, end);
        }
    }
}

pub struct VolumeState {
    pub name: String,
    pub size: u64,
    pub counts: MapCounts,
    /// For a snapshot (named `VOLUME@SNAPSHOT`, read-only): the volume it was taken of.
    pub snapshot_of: Option<u32>,
    /// When it was made (seconds since the Unix epoch; 0 if not known).
    pub created: u64,
}

pub struct Metadata {
    pub block_size: u32,
    pub volumes: BTreeMap<u32, VolumeState>,
    pub names: HashMap<String, u32>,
    pub next_vol: u32,
    pub pages: PageCache,
    pub chunks: ChunkTable,
    /// The dedup index, dense or sparse as the pool's setting says ([`IndexSetting`]).
    pub index: Index,
    /// The index saved at the last clean close, if its root is this state's: the build
    /// loads it instead of walking the chunk table. Dropped once a chunk is added or removed
    /// before the build (the file would then miss it).
    pub saved_index: Option<SavedIndex>,
    /// Where the index in RAM came from; `NotBuilt` until the first write that needs it
    /// builds it (a read-only command or a pool that is only read never pays for it): until
    /// then, new and dropped chunks are left to that build.
    pub index_origin: IndexOrigin,
    pub meta: BTreeMap<String, Vec<u8>>,
    /// Metadata page bytes written before this open (from the root).
    pub meta_bytes_written_before: u64,
    pub checkpoints: u64,
    /// Which volumes and snapshots name each chunk; `None` until the first figure asked for
    /// builds it ([`Metadata::attribution`]): until then the write path pays nothing for it.
    pub attribution: Option<Attribution>,
    /// A count of the attribution from scratch under way in steps (then `attribution` is
    /// `None`): see [`Metadata::count_attribution_step`].
    pub counting: Option<Counting>,
    /// Where the attribution's pages go past their RAM budget (the pool's directory).
    pub spill: SpillTo,
    /// Deleted volumes' maps still being released, by tree (docs/FORMAT.md "Background
    /// release"): each tree in [`PageCache::trees`] at or above [`RELEASE_TREE_FIRST`] has
    /// one, and no volume names it.
    pub releasing: BTreeMap<TreeId, Releasing>,
    /// Maps being released whose entries the figures still count (detached while the
    /// attribution was kept, under their release tree id), each with the next leaf whose
    /// entries go ([`Metadata::release_figures_step`]); a map's pages are released only once
    /// its entries are off. In memory only: an open counts volumes' maps alone.
    pub released_figures: BTreeMap<TreeId, u64>,
    /// Big structures let go while the state lock is held (a dropped attribution of a 10M-
    /// chunk pool), for the lock's holder to free after it lets go of the lock
    /// ([`Metadata::take_to_free`]): freeing them is the holder's time, not every VM's.
    pub to_free: Vec<Box<dyn std::any::Any + Send>>,
    /// A build of the dedup index in steps under way ([`Metadata::index_build_step`], a
    /// served pool's): until it ends, lookups miss instead of building the index at once.
    pub index_build: Option<IndexBuild>,
    /// A load of the saved index without the state lock under way ([`Metadata::begin_index_load`],
    /// a served pool's): until it ends, lookups miss and the chunk table's changes are kept.
    pub index_load: Option<IndexLoad>,
}

/// The dedup index being built in steps: what the visited chunk-table pages (below
/// `next_page`) hold. Chunks added meanwhile get ids at or past the table's next id, on pages
/// not visited yet; chunks dropped below `next_page` are taken out.
pub struct IndexBuild {
    index: Index,
    next_page: u64,
    started: std::time::Instant,
}

/// The saved index being loaded by a served pool without the state lock
/// ([`Metadata::begin_index_load`]). The file describes the chunk table as it was when the load
/// began (its stamp is the open's root, and no chunk was added or removed since, or
/// [`Metadata::saved_index`] would be gone); every change to the table after that is kept
/// here, in order, and applied to the loaded index before it is installed
/// ([`Metadata::finish_index_load`]), so the index installed is the one a load under the lock
/// followed by the same changes would hold.
pub struct IndexLoad {
    changes: Vec<IndexChange>,
    /// More than [`INDEX_LOAD_CHANGES_MAX`] changes came: they are no longer kept, and the
    /// load is not installed (the index is built from the chunk table instead).
    overflowed: bool,
    started: std::time::Instant,
}

/// A change to the chunk table while the saved index loads: a chunk with this fingerprint
/// on this chunk-table page came (`true`) or went (`false`).
type IndexChange = (Fingerprint, u64, bool);

/// Changes kept while the saved index loads (24 bytes each, 24 MiB at most); past it the
/// load is abandoned for a build in steps, so a load that takes long under heavy writes
/// cannot grow memory without bound.
pub const INDEX_LOAD_CHANGES_MAX: usize = 1 << 20;

impl IndexLoad {
    fn keep(&mut self, fp: &Fingerprint, page: u64, added: bool) {
        if self.changes.len() >= INDEX_LOAD_CHANGES_MAX {
            self.overflowed = true;
            self.changes = Vec::new();
        }
        if !self.overflowed {
            self.changes.push((*fp, page, added));
        }
    }
}

/// A deleted volume's map being released in steps ([`JournalRecord::ReleaseStep`]). Its
/// remaining leaves still hold their chunks' references; the attribution counts none of its
/// entries once [`Metadata::release_figures_step`] took them off.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Releasing {
    /// The volume's name (a rollback's: `NAME (before rollback)`).
    pub name: String,
    /// Leaves the volume's size spanned (for the progress shown; the last step is the one
    /// up to `u64::MAX`).
    pub end: u64,
    /// Leaves below this one are released.
    pub next: u64,
    /// Data blocks the volume held when it was deleted.
    pub data_blocks: u64,
}

impl Releasing {
    /// Data blocks still held, estimated from the leaves left (exact at both ends).
    pub fn blocks_left(&self) -> u64 {
        if self.next >= self.end || self.end == 0 {
            return if self.next >= self.end {
                0
            } else {
                self.data_blocks
            };
        }
        let left = self.end - self.next;
        (u128::from(self.data_blocks) * u128::from(left) / u128::from(self.end)) as u64
    }
}

/// The most written blocks a released tree may have for the figures to take it off at once
/// (a walk of a few milliseconds); past it they are counted again in steps.
pub const RELEASE_WALK_BLOCKS_MAX: u64 = 1 << 16;

impl Metadata {
    /// Volume `vol`, checked to exist and to hold blocks `[first, first + count)`.
    pub fn volume_for(
        &self,
        vol: u32,
        name: &str,
        op: &'static str,
        first: u64,
        count: u64,
    ) -> Result<&VolumeState> {
        let v = self
            .volumes
            .get(&vol)
            .ok_or_else(|| Error::NotFound(name.to_string()))?;
        let bs = u64::from(self.block_size);
        let end = first.checked_add(count).and_then(|e| e.checked_mul(bs));
        if end.is_none_or(|e| e > v.size) {
            return Err(Error::OutOfRange {
                op,
                volume: name.to_string(),
                offset: first.saturating_mul(bs),
                len: count.saturating_mul(bs),
                size: v.size,
            });
        }
        Ok(v)
    }

    /// [`Metadata::volume_for`] for a change: snapshots refuse it.
    pub fn writable_volume_for(
        &self,
        vol: u32,
        name: &str,
        op: &'static str,
        first: u64,
        count: u64,
    ) -> Result<&VolumeState> {
        let v = self.volume_for(vol, name, op, first, count)?;
        if v.snapshot_of.is_some() {
            return Err(Error::SnapshotReadOnly(v.name.clone()));
        }
        if let Some(host) = condense_format::hosts::released_to(&self.meta, &v.name) {
            return Err(Error::VolumeMoved {
                volume: v.name.clone(),
                host,
            });
        }
        if let Some(why) = condense_format::hosts::writes_refused(&self.meta, &v.name) {
            return Err(Error::WritesRefused {
                volume: v.name.clone(),
                why,
            });
        }
        Ok(v)
    }

    /// Warm the dedup index for a coming [`Metadata::find_duplicate`] or insert of `fp`.
    pub fn prefetch_duplicate(&self, fp: &Fingerprint) {
        if self.index_ready() {
            self.index.prefetch(fp);
        }
    }

    /// A live chunk with fingerprint `fp` that may take another reference. Exact: the
    /// index only names pages, and the fingerprint is compared with the chunk table's.
    /// Unreadable pages count as misses (the index is advisory).
    ///
    /// Never a wrong chunk: whatever the index holds (loaded, built, or with changes applied
    /// late), it only names chunk-table pages, and a candidate is returned only if the
    /// table's own slot on that page holds `fp` and is live (`confirm`). A wrong or missing
    /// index entry costs a page read or a lost dedup, never a block of other data.
    pub fn find_duplicate(&mut self, fp: &Fingerprint) -> Option<u64> {
        if !self.ready_to_look_up() {
            return None;
        }
        let dense = match &self.index {
            Index::Dense(d) => d,
            Index::Sparse(_) => return self.find_duplicate_sparse(fp),
        };
        let mut pages = Vec::new();
        dense.candidates(fp, &mut pages);
        pages.into_iter().find_map(|page| self.confirm(page, fp))
    }

    /// Whether lookups can be answered: the index built now if it is neither built nor
    /// being built or loaded (then a miss costs savings only).
    fn ready_to_look_up(&mut self) -> bool {
        if self.index_ready() {
            return true;
        }
        if self.index_build.is_some() || self.index_load.is_some() {
            return false;
        }
        if let Err(e) = self.build_index() {
            tracing::warn!("dedup index built in part ({e}); chunks past the damage are not deduplicated against");
        }
        true
    }

    /// [`Metadata::find_duplicate`] of each block of a write (`None`: an all-zero block),
    /// in order, as the write path's first pass looks them up: the sparse index also finds
    /// the write's earlier blocks of a duplicate run once a hook of it is met
    /// ([`crate::sparse_index::SparseIndex::find_write`]). Exact as `find_duplicate` is.
    pub fn find_duplicates(&mut self, fps: &[Option<Fingerprint>]) -> Vec<Option<u64>> {
        if !self.ready_to_look_up() {
            return vec![None; fps.len()];
        }
        if let Index::Sparse(s) = &mut self.index {
            return s.find_write(
                fps,
                &mut TablePages {
                    pages: &mut self.pages,
                    chunks: &self.chunks,
                },
            );
        }
        (0..fps.len())
            .map(|i| {
                if let Some(Some(ahead)) = fps.get(i + PREFETCH_AHEAD) {
                    self.index.prefetch(ahead);
                }
                fps[i].as_ref().and_then(|fp| self.find_duplicate(fp))
            })
            .collect()
    }

    /// Chunk `id`, found by [`Metadata::find_duplicates`] before the state lock was let go,
    /// if it still holds `fp` and may take another reference (or the chunk its slot
    /// forwards to now, if that one does).
    pub fn confirm_found(&mut self, id: u64, fp: &Fingerprint) -> Option<u64> {
        self.confirm(page_of(id), fp)
    }

    /// [`Metadata::find_duplicate`] with the sparse index: [`crate::sparse_index::SparseIndex::find`] over this
    /// pool's chunk table.
    fn find_duplicate_sparse(&mut self, fp: &Fingerprint) -> Option<u64> {
        let Index::Sparse(s) = &mut self.index else {
            return None;
        };
        s.find(
            fp,
            &mut TablePages {
                pages: &mut self.pages,
                chunks: &self.chunks,
            },
        )
    }

    /// A live chunk on chunk-table page `page` with fingerprint `fp` that may take another
    /// reference (an unreadable page is a miss).
    fn confirm(&mut self, page: u64, fp: &Fingerprint) -> Option<u64> {
        confirm(&mut self.pages, &self.chunks, page, fp)
    }

    /// Load every page the records will touch, so applying them does no I/O.
    pub fn prefetch(&mut self, records: &[JournalRecord]) -> Result<()> {
        for r in records {
            match r {
                JournalRecord::NewChunk { id, .. }
                | JournalRecord::Relocate { id, .. }
                | JournalRecord::DropChunk { id } => self.chunks.prefetch(&mut self.pages, *id)?,
                JournalRecord::Forward { id, to } => {
                    self.chunks.prefetch(&mut self.pages, *id)?;
                    self.chunks.prefetch(&mut self.pages, *to)?;
                }
                JournalRecord::NewDelta { id, bases, .. }
                | JournalRecord::DropDelta { id, bases } => {
                    self.chunks.prefetch(&mut self.pages, *id)?;
                    for b in bases {
                        self.chunks.prefetch(&mut self.pages, *b)?;
                    }
                }
                JournalRecord::MapRun {
                    vol,
                    start,
                    entries,
                } => {
                    let mut old = Vec::with_capacity(entries.len());
                    block_map::get_range(
                        &mut self.pages,
                        u64::from(*vol),
                        *start,
                        entries.len() as u64,
                        &mut old,
                    )?;
                    for e in old.iter().chain(entries.iter()) {
                        if *e < CHUNK_ID_LIMIT {
                            self.chunks.prefetch(&mut self.pages, *e)?;
                        }
                    }
                }
                // Large fills, resizes and deletes load as they go.
                _ => {}
            }
        }
        Ok(())
    }

    /// Apply one record. The only place the metadata changes.
    pub fn apply(&mut self, r: &JournalRecord) -> Result<()> {
        self.apply_in(r, &mut Mode::Strict)
    }

    /// [`Metadata::apply`] in `mode`: the one interpretation of every journal record, for live
    /// changes and replay ([`Mode::Strict`]) and for `condense repair`'s salvage replay
    /// ([`Mode::Salvage`]).
    pub fn apply_in(&mut self, r: &JournalRecord, mode: &mut Mode) -> Result<()> {
        match r {
            JournalRecord::NewChunk { id, loc, fp } => self.new_chunk(*id, loc, fp, mode)?,
            JournalRecord::Relocate { id, loc } => self.relocate_chunk(*id, loc, mode)?,
            JournalRecord::DropChunk { id } => self.drop_chunk(*id, mode)?,
            JournalRecord::Forward { id, to } => self.forward_chunk(*id, *to, mode)?,
            JournalRecord::NewDelta { id, loc, fp, bases } => {
                self.new_chunk(*id, loc, fp, mode)?;
                *self.chunks.deltas.get_or_insert(0) += 1;
                self.delta_bases(bases, true, mode)?
            }
            JournalRecord::DropDelta { id, bases } => {
                self.drop_chunk(*id, mode)?;
                self.delta_bases(bases, false, mode)?
            }
            JournalRecord::MapRun {
                vol,
                start,
                entries,
            } => self.map_run(*vol, *start, entries, mode)?,
            JournalRecord::MapFill {
                vol,
                start,
                count,
                entry,
            } => self.map_fill(*vol, *start, *count, *entry, mode)?,
            JournalRecord::VolumeCreate { vol, size, name } => {
                self.create_volume(*vol, *size, name, mode)
            }
            JournalRecord::VolumeResize { vol, size } => self.resize_volume(*vol, *size, mode)?,
            JournalRecord::VolumeDelete { vol } => self.delete_volume(*vol, mode)?,
            JournalRecord::ReleaseStep { tree, from, to } => {
                self.release_step(*tree, *from, *to, mode)?
            }
            JournalRecord::MetaPut { key, value } => match value {
                Some(v) => {
                    self.meta.insert(key.clone(), v.clone());
                }
                None => {
                    self.meta.remove(key);
                }
            },
        }
        if let Mode::Salvage(_) = mode {
            // The holders a leaf copied from a shared one gained are the rebuild's to count,
            // and so is the attribution of chunks to volumes.
            self.pages.take_unshared_leaves();
            self.drop_attribution();
        }
        Ok(())
    }

    /// A new chunk: into the chunk table (and the dedup index, once built). Salvage: set
    /// aside for the rebuild if its record is on disk.
    fn new_chunk(
        &mut self,
        id: u64,
        loc: &Location,
        fp: &Fingerprint,
        mode: &mut Mode,
    ) -> Result<()> {
        if let Mode::Salvage(s) = mode {
            s.chunk_placed(id, loc, Some(fp));
            return Ok(());
        }
        self.chunks.insert(&mut self.pages, id, *fp, loc)?;
        if self.index_ready() {
            self.index.insert(fp, page_of(id));
        } else {
            if let Some(l) = self.index_load.as_mut() {
                l.keep(fp, page_of(id), true);
            }
            self.saved_index = None;
        }
        Ok(())
    }

    /// A delta's references on its bases, taken (`NewDelta`) or dropped (`DropDelta`): a base
    /// lives while a delta names it. Salvage: ignored (the rebuild takes them again for every
    /// delta it keeps).
    fn delta_bases(&mut self, bases: &[u64], take: bool, mode: &mut Mode) -> Result<()> {
        if let Mode::Salvage(_) = mode {
            return Ok(());
        }
        for &b in bases {
            if take {
                self.chunks.incref(&mut self.pages, b)?;
            } else {
                self.chunks.decref(&mut self.pages, b)?;
            }
        }
        // The attribution counts map entries only: counted again from scratch.
        self.drop_attribution();
        Ok(())
    }

    /// A chunk moved by GC. Salvage: set aside for the rebuild if its record is on disk.
    fn relocate_chunk(&mut self, id: u64, loc: &Location, mode: &mut Mode) -> Result<()> {
        match mode {
            Mode::Strict => {
                let before = self.chunks.relocate(&mut self.pages, id, loc)?;
                if before != loc.stored_len {
                    // GC copies records verbatim; a record that changed length is counted
                    // again from scratch.
                    self.drop_attribution();
                }
                Ok(())
            }
            Mode::Salvage(s) => {
                s.chunk_placed(id, loc, None);
                Ok(())
            }
        }
    }

    /// A chunk nothing names any more. Salvage: ignored (the rebuild drops what nothing names).
    fn drop_chunk(&mut self, id: u64, mode: &mut Mode) -> Result<()> {
        if let Mode::Salvage(_) = mode {
            return Ok(());
        }
        if let Some(e) = self.chunks.get(&mut self.pages, id)? {
            if self.index_ready() {
                self.index.remove(&e.fp, page_of(id));
            } else if let Some(b) = self
                .index_build
                .as_mut()
                .filter(|b| page_of(id) < b.next_page)
            {
                b.index.remove(&e.fp, page_of(id));
            }
            if let Some(l) = self.index_load.as_mut() {
                l.keep(&e.fp, page_of(id), false);
            }
        }
        if !self.index_ready() {
            self.saved_index = None;
        }
        self.chunks.remove(&mut self.pages, id)
    }

    /// A chunk found to duplicate chunk `to` by the merge pass: its slot becomes a forward,
    /// the index finds the fingerprint at `to` only, and the attribution counts its entries
    /// for `to`. Salvage: told to the hook.
    fn forward_chunk(&mut self, id: u64, to: u64, mode: &mut Mode) -> Result<()> {
        if let Mode::Salvage(s) = mode {
            s.chunk_forwarded(id, to);
            return Ok(());
        }
        let fp = match self.chunks.slot(&mut self.pages, id)? {
            Some(crate::chunk_table::Slot::Chunk(e)) => e.fp,
            _ => [0; 16],
        };
        let f = self.chunks.forward(&mut self.pages, id, to)?;
        if self.index_ready() {
            self.index.remove(&fp, page_of(id));
        } else {
            if let Some(b) = self
                .index_build
                .as_mut()
                .filter(|b| page_of(id) < b.next_page)
            {
                b.index.remove(&fp, page_of(id));
            }
            if let Some(l) = self.index_load.as_mut() {
                l.keep(&fp, page_of(id), false);
            }
            self.saved_index = None;
        }
        if let Some(a) = self.attribution.as_mut() {
            a.merge(id, to, f.stored_from, f.stored_to);
        }
        if let Some(c) = self.counting.as_mut() {
            c.a.merge(id, to, f.stored_from, f.stored_to);
            // Entries naming it walked from now on look it up (and find `to`).
            c.stored.set(id, 0);
        }
        Ok(())
    }

    /// Blocks `start..` of `vol` set to `entries`.
    fn map_run(&mut self, vol: u32, start: u64, entries: &[u64], mode: &mut Mode) -> Result<()> {
        let end = start + entries.len() as u64;
        if let Mode::Salvage(s) = mode {
            if !self.fits(vol, start, end, &mut **s) {
                return Ok(());
            }
        }
        for (i, &e) in entries.iter().enumerate() {
            self.set_block(vol, start + i as u64, e, mode)?;
        }
        mode.blocks_written(vol, start, end);
        Ok(())
    }

    /// Blocks `start..start + count` of `vol` all set to `entry`; unmapping visits only the
    /// blocks that are mapped.
    fn map_fill(
        &mut self,
        vol: u32,
        start: u64,
        count: u64,
        entry: u64,
        mode: &mut Mode,
    ) -> Result<()> {
        let end = start.saturating_add(count);
        match mode {
            Mode::Strict => {
                self.vol(vol)?;
            }
            Mode::Salvage(s) => {
                if !self.fits(vol, start, end, &mut **s) {
                    return Ok(());
                }
            }
        }
        if entry == ENTRY_UNMAPPED {
            let mapped = block_map::mapped(&mut self.pages, u64::from(vol), start, end);
            let mapped = mode.tolerate(mapped, |e| {
                format!("trimming blocks {start}..{end} of volume id {vol}: {e}")
            })?;
            for (b, _) in mapped.unwrap_or_default() {
                self.set_block(vol, b, ENTRY_UNMAPPED, mode)?;
            }
        } else {
            for b in start..end {
                self.set_block(vol, b, entry, mode)?;
            }
        }
        mode.blocks_written(vol, start, end);
        Ok(())
    }

    /// A new, empty volume. Salvage: skipped if its id or name is taken.
    fn create_volume(&mut self, vol: u32, size: u64, name: &str, mode: &mut Mode) {
        if let Mode::Salvage(s) = mode {
            if self.volumes.contains_key(&vol) || self.names.contains_key(name) {
                s.skip(format!(
                    "creation of volume {name:?} (id {vol}): the id or name is taken"
                ));
                return;
            }
        }
        self.volumes.insert(
            vol,
            VolumeState {
                name: name.to_string(),
                size,
                counts: MapCounts::default(),
                snapshot_of: None,
                created: 0,
            },
        );
        self.pages.create_tree(
            u64::from(vol),
            block_map::leaves_for(size / u64::from(self.block_size)),
        );
        self.names.insert(name.to_string(), vol);
        self.next_vol = self.next_vol.max(vol + 1);
    }

    /// A volume's new size: shrinking unmaps the blocks past the end, growing grows the map.
    fn resize_volume(&mut self, vol: u32, size: u64, mode: &mut Mode) -> Result<()> {
        let bs = u64::from(self.block_size);
        let old = match (self.volumes.get(&vol), &mut *mode) {
            (Some(v), _) => v.size,
            (None, Mode::Strict) => return self.vol(vol).map(|_| ()),
            (None, Mode::Salvage(s)) => {
                s.skip(format!("resize of volume id {vol}, which does not exist"));
                return Ok(());
            }
        };
        if size < old {
            let cut = block_map::mapped(&mut self.pages, u64::from(vol), size / bs, old / bs);
            // Salvage: an unreadable page past the new end stays as it is (the rebuild reads
            // no block past a volume's end).
            let cut = match mode {
                Mode::Strict => Some(cut?),
                Mode::Salvage(_) => cut.ok(),
            };
            for (b, _) in cut.unwrap_or_default() {
                self.set_block(vol, b, ENTRY_UNMAPPED, mode)?;
            }
        } else {
            let grown = self
                .pages
                .grow_tree(u64::from(vol), block_map::leaves_for(size / bs));
            let grown = mode.tolerate(grown, |e| {
                format!("growing volume id {vol} to {size} bytes: {e}")
            })?;
            if grown.is_none() {
                return Ok(());
            }
        }
        if let Some(v) = self.volumes.get_mut(&vol) {
            v.size = size;
        }
        Ok(())
    }

    /// A volume and its block map gone. Salvage: its pages are released without reading them
    /// (the rebuild neither counts references nor reuses pages, so a damaged one does not
    /// matter), and a volume that does not exist is no change.
    fn delete_volume(&mut self, vol: u32, mode: &mut Mode) -> Result<()> {
        match mode {
            Mode::Strict => {
                self.vol(vol)?;
                self.release_volume_tree(vol)?;
            }
            Mode::Salvage(_) => {
                if !self.volumes.contains_key(&vol) {
                    return Ok(());
                }
                let _ = self.pages.release_tree(u64::from(vol), &mut |_| Ok(()));
            }
        }
        if let Some(v) = self.volumes.remove(&vol) {
            self.names.remove(&v.name);
        }
        Ok(())
    }

    /// The first free tree id for a map to release ([`RELEASE_TREE_FIRST`] and up).
    pub fn next_release_tree(&self) -> TreeId {
        self.pages
            .trees()
            .range(RELEASE_TREE_FIRST..CHUNK_TREE)
            .next_back()
            .map_or(RELEASE_TREE_FIRST, |(&t, _)| t + 1)
    }

    /// Volume `vol`'s map becomes tree `tree`, to be released in steps under `name`; the
    /// volume itself stays (a deletion removes it, a rollback gives it a new map). The
    /// attribution keeps the map's entries under `tree` (no walk), and takes them off in
    /// steps before its pages go ([`Metadata::release_figures_step`]).
    pub fn detach_tree(&mut self, vol: u32, tree: TreeId, name: String) -> Result<()> {
        if !(RELEASE_TREE_FIRST..CHUNK_TREE).contains(&tree) || self.pages.tree(tree).is_some() {
            return Err(Error::corrupt(
                "journal",
                format!("volume {vol}'s map cannot be released as tree {tree}: not a free tree id for a release"),
            ));
        }
        let v = self.vol(vol)?;
        let end = block_map::leaves_for(v.size / u64::from(self.block_size));
        let data_blocks = v.counts.data_blocks;
        self.pages.rename_tree(u64::from(vol), tree)?;
        self.figures_detached(u64::from(vol), tree);
        self.releasing.insert(
            tree,
            Releasing {
                name,
                end,
                next: 0,
                data_blocks,
            },
        );
        Ok(())
    }

    /// Leaves `[from, to)` of a map being released go ([`JournalRecord::ReleaseStep`]); the
    /// last step (`to` = `u64::MAX`) releases the rest of the tree and ends the release. Salvage: no change (the rebuild
    /// keeps no map being released).
    fn release_step(&mut self, tree: TreeId, from: u64, to: u64, mode: &mut Mode) -> Result<()> {
        if let Mode::Salvage(_) = mode {
            return Ok(());
        }
        let r = self.releasing.get(&tree).ok_or_else(|| {
            Error::corrupt(
                "journal",
                format!("release step of tree {tree}, which is not being released"),
            )
        })?;
        if r.next != from || to <= from {
            return Err(Error::corrupt(
                "journal",
                format!(
                    "release step of tree {tree} over leaves {from}..{to}; its release is at leaf {}",
                    r.next
                ),
            ));
        }
        let last = to == u64::MAX;
        if self.released_figures.contains_key(&tree) {
            // Its entries are not all off the figures yet (a step the pool's release never
            // takes): they cannot follow, so they are counted again.
            self.drop_attribution();
        }
        let mut ids = Vec::new();
        let mut collect = |leaf: &[u8]| {
            block_map::leaf_chunks(leaf, |id| ids.push(id));
            Ok(())
        };
        if last {
            self.pages.release_tree(tree, &mut collect)?;
            self.releasing.remove(&tree);
        } else {
            self.pages.release_span(tree, from, to, &mut collect)?;
            if let Some(r) = self.releasing.get_mut(&tree) {
                r.next = to;
            }
        }
        self.chunks.decref_many(&mut self.pages, &ids)
    }

    /// Volume tree `vol`, the attribution holding its entries, becomes tree `tree` (a map
    /// detached for release): renamed in the figures (no walk), its entries to be taken off
    /// in steps. A count under way that has not reached it forgets it; one that walked part
    /// of it cannot tell what of it it holds and is dropped.
    fn figures_detached(&mut self, vol: TreeId, tree: TreeId) {
        if let Some(a) = self.attribution.as_mut() {
            a.rename_tree(vol, tree);
            self.released_figures.insert(tree, 0);
            return;
        }
        let Some(c) = self.counting.as_mut() else {
            return;
        };
        match c.trees.iter().position(|&t| t == vol) {
            // Walked whole, or made after the count began: its entries are all in it.
            None => {
                c.a.rename_tree(vol, tree);
                self.released_figures.insert(tree, 0);
            }
            Some(at) if at > 0 || c.chunk_page.is_some() || c.next_leaf == 0 => {
                c.trees.remove(at);
            }
            Some(_) => self.drop_attribution(),
        }
    }

    /// One step of taking the entries of maps being released off the figures: units of
    /// [`Metadata::release_figures_unit`] until `at_least` has passed (zero: one unit), as
    /// the count's steps go ([`COUNT_STEP_TIME`] in a served pool). False when none is left.
    pub fn release_figures_step(
        &mut self,
        leaves: usize,
        at_least: std::time::Duration,
    ) -> Result<bool> {
        let began = std::time::Instant::now();
        if !self.release_figures_unit(leaves)? {
            return Ok(false);
        }
        while began.elapsed() < at_least && self.release_figures_unit(leaves)? {}
        Ok(true)
    }

    /// One unit of [`Metadata::release_figures_step`]: the next `leaves` leaves that exist of
    /// the oldest map whose entries are still in the figures ([`Metadata::released_figures`]),
    /// read and never changed (a map shared with a snapshot is walked here even where its
    /// release drops a whole shared subtree at once). False when none is left.
    fn release_figures_unit(&mut self, leaves: usize) -> Result<bool> {
        let Some((&tree, &from)) = self.released_figures.iter().next() else {
            return Ok(false);
        };
        let leaves = leaves.max(1);
        let (mut ids, mut visited, mut last) = (Vec::new(), 0, None);
        self.pages
            .for_each_leaf(tree, from, u64::MAX, &mut |i, leaf| {
                block_map::leaf_chunks(leaf, |id| ids.push(id));
                visited += 1;
                last = Some(i);
                Ok(visited < leaves)
            })?;
        let gone = self.chunks.resolve_lens(&mut self.pages, &ids)?;
        let done = visited < leaves;
        let held = match (&mut self.attribution, &mut self.counting) {
            (Some(a), _) => Some(a),
            (None, Some(c)) => Some(&mut c.a),
            (None, None) => None,
        };
        if let Some(a) = held {
            for (id, stored) in gone {
                a.remove(tree, id, 1, stored);
            }
            if done {
                a.forget_tree(tree);
            }
        }
        match last {
            Some(l) if !done => self.released_figures.insert(tree, l + 1),
            _ => self.released_figures.remove(&tree),
        };
        Ok(true)
    }

    /// Salvage: whether volume `vol` exists and holds blocks `[start, end)`; if not, the
    /// change is noted as skipped.
    fn fits(&self, vol: u32, start: u64, end: u64, s: &mut dyn SalvageHook) -> bool {
        let bs = u64::from(self.block_size);
        match self.volumes.get(&vol) {
            Some(v) if end.saturating_mul(bs) <= v.size => true,
            Some(v) => {
                s.skip(format!(
                    "write to blocks {start}..{end} of volume {:?}: past its end",
                    v.name
                ));
                false
            }
            None => {
                s.skip(format!(
                    "write to blocks {start}..{end} of volume id {vol}, which does not exist (made in a damaged part of the journal?)"
                ));
                false
            }
        }
    }

    /// Block `block` of `vol` set to `e`. Strict: with reference counting ([`Metadata::set_entry`]).
    /// Salvage: the entry alone (the rebuild recounts), an unreadable page noted as skipped.
    fn set_block(&mut self, vol: u32, block: u64, e: u64, mode: &mut Mode) -> Result<()> {
        let Mode::Salvage(s) = mode else {
            return self.set_entry(vol, block, e);
        };
        let Some(v) = self.volumes.get_mut(&vol) else {
            return Ok(());
        };
        if let Err(err) = block_map::set(&mut self.pages, u64::from(vol), &mut v.counts, block, e) {
            s.skip(format!("block {block} of volume {:?}: {err}", v.name));
        }
        Ok(())
    }

    fn vol(&self, vol: u32) -> Result<&VolumeState> {
        self.volumes
            .get(&vol)
            .ok_or_else(|| Error::corrupt("journal", format!("change to unknown volume {vol}")))
    }

    fn set_entry(&mut self, vol: u32, block: u64, e: u64) -> Result<()> {
        if e < CHUNK_ID_LIMIT {
            let (id, stored) = self.chunks.incref(&mut self.pages, e)?;
            if let Some(a) = self.attribution_for(u64::from(vol), block) {
                a.add(u64::from(vol), id, 1, stored);
            }
        }
        let v = self
            .volumes
            .get_mut(&vol)
            .ok_or_else(|| Error::corrupt("journal", format!("change to unknown volume {vol}")))?;
        let old = block_map::set(&mut self.pages, u64::from(vol), &mut v.counts, block, e)?;
        // A leaf copied away from a snapshot or clone: its chunks gained a holder (before the
        // old entry's reference goes, which the copy also held).
        for leaf in self.pages.take_unshared_leaves() {
            let mut ids = Vec::new();
            block_map::leaf_chunks(&leaf, |id| ids.push(id));
            for id in ids {
                self.chunks.incref(&mut self.pages, id)?;
            }
        }
        if old < CHUNK_ID_LIMIT {
            let (id, stored) = self.chunks.decref(&mut self.pages, old)?;
            if let Some(a) = self.attribution_for(u64::from(vol), block) {
                a.remove(u64::from(vol), id, 1, stored);
            }
        }
        Ok(())
    }

    /// Release volume `vol`'s block map: pages it alone holds are freed and the chunks
    /// their entries name lose a reference; pages shared with snapshots or clones stay.
    pub fn release_volume_tree(&mut self, vol: u32) -> Result<()> {
        self.tree_released(vol)?;
        let mut ids = Vec::new();
        self.pages.release_tree(u64::from(vol), &mut |leaf| {
            block_map::leaf_chunks(leaf, |id| ids.push(id));
            Ok(())
        })?;
        for id in ids {
            self.chunks.decref(&mut self.pages, id)?;
        }
        Ok(())
    }

    /// Each chunk volume `vol`'s map names, with how many of its entries name it.
    fn tree_chunks(&mut self, vol: u32) -> Result<HashMap<u64, u32>> {
        let mut held: HashMap<u64, u32> = HashMap::new();
        self.pages
            .for_each_leaf(u64::from(vol), 0, u64::MAX, &mut |_, leaf| {
                block_map::leaf_chunks(leaf, |id| *held.entry(id).or_default() += 1);
                Ok(true)
            })?;
        Ok(held)
    }

    /// Tell the attribution that volume `vol`'s whole map was added (a snapshot, clone or
    /// rollback, after its tree was made). Its entries are counted in steps, as the first
    /// count walks a map ([`Metadata::count_attribution_step`]): a snapshot of a big volume
    /// never holds the state lock for a walk of its map. The figures are whole again once
    /// that walk is done (`stats` finishes it first).
    pub fn tree_added(&mut self, vol: u32) {
        if let Some(c) = &mut self.counting {
            // Walked after the trees already queued; until then its changes are the walk's.
            c.trees.push_back(u64::from(vol));
        } else if let Some(a) = self.attribution.take() {
            self.counting = Some(Counting::resume(a, u64::from(vol)));
        }
    }

    /// Tell the attribution that volume `vol`'s whole map is about to be released at once (a
    /// small map's delete; a bigger one is detached instead, [`Metadata::detach_tree`]). A
    /// tree of at most [`RELEASE_WALK_BLOCKS_MAX`] written blocks is taken
    /// off at once, by a walk of a few milliseconds; a larger one drops the figures, which are
    /// counted again in steps, so no delete holds the state lock for a walk of a big map.
    pub fn tree_released(&mut self, vol: u32) -> Result<()> {
        if let Some(c) = &mut self.counting {
            match c.trees.iter().position(|&t| t == u64::from(vol)) {
                // Not walked yet: the count never saw it.
                Some(at) if at > 0 || c.chunk_page.is_some() => {
                    c.trees.remove(at);
                }
                // Walked in part or whole: the count cannot tell what of it it holds.
                _ => self.counting = None,
            }
            return Ok(());
        }
        if self.attribution.is_none() {
            return Ok(());
        }
        let blocks = self.volumes.get(&vol).map_or(0, |v| v.counts.data_blocks);
        if blocks > RELEASE_WALK_BLOCKS_MAX {
            self.drop_attribution();
            return Ok(());
        }
        let held = self.tree_chunks(vol)?;
        let mut stored = Vec::with_capacity(held.len());
        for (&id, &n) in &held {
            // An entry naming a forward is counted for the chunk it forwards to.
            let (id, len) = match self.chunks.resolve(&mut self.pages, id)? {
                Some((rid, c)) => (rid, c.loc.stored_len),
                None => (id, 0),
            };
            stored.push((id, n, len));
        }
        if let Some(a) = self.attribution.as_mut() {
            for (id, n, len) in stored {
                a.remove(u64::from(vol), id, n, len);
            }
            a.forget_tree(u64::from(vol));
        }
        Ok(())
    }

    /// The attribution that entry `block` of tree `tree` changes in: the kept one, or the
    /// count under way if its walk has passed that entry (else the walk will see the change).
    fn attribution_for(&mut self, tree: TreeId, block: u64) -> Option<&mut Attribution> {
        match (&mut self.attribution, &mut self.counting) {
            (Some(a), _) => Some(a),
            (None, Some(c)) if c.passed(tree, block) => Some(&mut c.a),
            _ => None,
        }
    }

    /// Forget the attribution and any count of it under way (counted again when next asked).
    fn drop_attribution(&mut self) {
        // A count from scratch walks the volumes' maps only.
        self.released_figures.clear();
        if let Some(a) = self.attribution.take() {
            self.to_free.push(Box::new(a));
        }
        if let Some(c) = self.counting.take() {
            self.to_free.push(Box::new(c));
        }
    }

    /// What was let go under the lock, to be dropped once it is released.
    pub fn take_to_free(&mut self) -> Vec<Box<dyn std::any::Any + Send>> {
        std::mem::take(&mut self.to_free)
    }

    /// The attribution of chunks to volumes and snapshots: built from every map and the
    /// chunk table the first time it is asked for after an open (or after it broke), then
    /// kept by every change. A count under way in steps is finished here, at once.
    pub fn attribution(&mut self) -> Result<&Attribution> {
        if self
            .attribution
            .as_ref()
            .is_some_and(|a| a.broken().is_some())
        {
            self.drop_attribution();
        }
        if self.attribution.is_none() {
            while !self.count_attribution_step(COUNT_STEP_TIME)? {}
        }
        self.attribution
            .as_ref()
            .ok_or_else(|| Error::corrupt("metadata", "the space attribution vanished"))
    }

    /// One bounded step of counting the attribution from scratch, for a caller that lets go
    /// of the state lock between steps so I/O goes on ([`crate::attribution::Counting`] keeps
    /// what changes meanwhile): units of work (the chunk table's lengths 32 pages at a time,
    /// then the maps 8 leaves at a time, 0.1-4 ms each) until `at_least` has passed
    /// ([`COUNT_STEP_TIME`] in a served pool; zero: one unit). True once the attribution is
    /// there; a count that fails is dropped.
    pub fn count_attribution_step(&mut self, at_least: std::time::Duration) -> Result<bool> {
        let began = std::time::Instant::now();
        let mut first = true;
        loop {
            if self.count_attribution_unit(began, first)? {
                return Ok(true);
            }
            if began.elapsed() >= at_least {
                return Ok(false);
            }
            first = false;
        }
    }

    /// One unit of [`Metadata::count_attribution_step`] (`first`: the step's first, counted
    /// as a step), true once the attribution is there.
    fn count_attribution_unit(
        &mut self,
        step_began: std::time::Instant,
        first: bool,
    ) -> Result<bool> {
        const CHUNK_PAGES_PER_UNIT: u64 = 32;
        const LEAVES_PER_UNIT: u64 = 8;
        if let Some(a) = &self.attribution {
            if a.broken().is_none() {
                return Ok(true);
            }
            self.drop_attribution();
        }
        let mut c = match self.counting.take() {
            Some(c) => c,
            None => Counting::new(self.counted_trees(), &self.spill),
        };
        c.started.get_or_insert(step_began);
        if first {
            c.steps += 1;
        }
        if let Some(page) = c.chunk_page {
            let end = page + CHUNK_PAGES_PER_UNIT;
            let stored = &mut c.stored;
            self.chunks
                .for_each_in(&mut self.pages, page, end, &mut |id, e| {
                    if e.refs > 0 {
                        stored.set(id, u64::from(e.loc.stored_len) + 1);
                    }
                    Ok(())
                })?;
            let pages = self.chunks.next_id.div_ceil(CHUNKS_PER_PAGE as u64);
            c.chunk_page = (end < pages).then_some(end);
        } else if let Some(&tree) = c.trees.front() {
            // The next LEAVES_PER_UNIT leaves that exist (a sparse map's empty ranges cost
            // nothing: an exabyte volume has as few leaves as it has data).
            let mut later = Vec::new();
            let (mut visited, mut last) = (0, None);
            let (a, stored) = (&mut c.a, &mut c.stored);
            self.pages
                .for_each_leaf(tree, c.next_leaf, u64::MAX, &mut |i, leaf| {
                    block_map::leaf_chunks(leaf, |id| match stored.get(id) {
                        0 => later.push(id),
                        w => a.add(tree, id, 1, (w - 1) as u32),
                    });
                    visited += 1;
                    last = Some(i);
                    Ok(visited < LEAVES_PER_UNIT)
                })?;
            // Chunks made after their chunk-table page was scanned.
            for id in later {
                match self.chunks.resolve(&mut self.pages, id)? {
                    Some((id, e)) if e.refs > 0 => c.a.add(tree, id, 1, e.loc.stored_len),
                    _ => {
                        return Err(Error::corrupt(
                            "block map",
                            format!(
                                "{} names chunk {id}, which is not live; run condense verify",
                                self.tree_name(tree)
                            ),
                        ))
                    }
                }
            }
            match last {
                Some(i) if visited == LEAVES_PER_UNIT => c.next_leaf = i + 1,
                _ => {
                    c.trees.pop_front();
                    c.next_leaf = 0;
                }
            }
        }
        c.longest = c.longest.max(step_began.elapsed());
        if let Some(e) = c.error() {
            return Err(Error::Invalid(format!(
                "the per-volume figures could not be counted: {e}"
            )));
        }
        if !c.done() {
            self.counting = Some(c);
            return Ok(false);
        }
        tracing::info!(
            "space attribution counted: {} chunks in {:.2} s, {} steps, the longest {:.1} ms",
            self.chunks.live_chunks,
            c.started.map_or(0.0, |t| t.elapsed().as_secs_f64()),
            c.steps,
            c.longest.as_secs_f64() * 1000.0
        );
        // The count's own array of stored lengths (one word per chunk id: ~800 MB for 100M
        // chunks, in RAM and its scratch file) is freed with the lock let go: dropped here it
        // held the state lock 200 ms at the end of a 90M-chunk count (bench/README.md
        // "delete-scale.sh", seventh pass).
        let Counting { a, stored, .. } = c;
        self.to_free.push(Box::new(stored));
        self.attribution = Some(a);
        Ok(true)
    }

    /// The trees a count from scratch walks: every volume's and snapshot's map.
    pub fn counted_trees(&self) -> Vec<TreeId> {
        self.volumes.keys().map(|&v| u64::from(v)).collect()
    }

    /// Tree `tree` for a message: the volume or the released map it is.
    fn tree_name(&self, tree: TreeId) -> String {
        let name = u32::try_from(tree)
            .ok()
            .and_then(|v| self.volumes.get(&v))
            .map(|v| &v.name)
            .or_else(|| self.releasing.get(&tree).map(|r| &r.name));
        match name {
            Some(n) => format!("the map of {n:?} (tree {tree})"),
            None => format!("tree {tree}"),
        }
    }

    /// An attribution counted from scratch in one go: every tree of
    /// [`Metadata::counted_trees`] walked, and the entries of maps being released that the
    /// kept figures still count ([`Metadata::released_figures`]), each chunk's length from
    /// the chunk table. Refuses a map naming a chunk that is not live. The oracle of
    /// `condense_engine::Pool::check_attribution`, written apart from the stepwise count on
    /// purpose, so the check also catches a fault in the steps.
    pub fn build_attribution(&mut self) -> Result<Attribution> {
        let started = std::time::Instant::now();
        let mut stored: HashMap<u64, u32> =
            HashMap::with_capacity(usize::try_from(self.chunks.live_chunks).unwrap_or(0));
        self.chunks.for_each(&mut self.pages, &mut |id, e| {
            if e.refs > 0 {
                stored.insert(id, e.loc.stored_len);
            }
            Ok(())
        })?;
        // Entries naming a forward count for the chunk it forwards to.
        let mut forwards: HashMap<u64, u64> = HashMap::new();
        self.chunks
            .for_each_forward(&mut self.pages, &mut |id, to| {
                forwards.insert(id, to);
                Ok(())
            })?;
        let mut a = Attribution::default();
        let vols = self.counted_trees().into_iter().map(|t| (t, 0));
        let trees: Vec<(TreeId, u64)> = vols.chain(self.released_figures.clone()).collect();
        for (tree, from) in trees {
            let mut missing = None;
            self.pages
                .for_each_leaf(tree, from, u64::MAX, &mut |_, leaf| {
                    block_map::leaf_chunks(leaf, |id| {
                        let id = forwards.get(&id).copied().unwrap_or(id);
                        match stored.get(&id) {
                            Some(&len) => a.add(tree, id, 1, len),
                            None => missing = Some(id),
                        }
                    });
                    Ok(true)
                })?;
            if let Some(id) = missing {
                return Err(Error::corrupt(
                    "block map",
                    format!(
                        "{} names chunk {id}, which is not live; run condense verify",
                        self.tree_name(tree)
                    ),
                ));
            }
        }
        tracing::info!(
            "space attribution built: {} chunks in {:.2} s",
            self.chunks.live_chunks,
            started.elapsed().as_secs_f64()
        );
        Ok(a)
    }

    /// What identifies this state's checkpoint root to a saved index (every field changes
    /// when the chunk table does): at open, the root's; after a checkpoint, the new one's.
    pub fn index_stamp(&self, journal_gen: u64, next_seq: u64) -> IndexStamp {
        let tree = self.pages.trees().get(&CHUNK_TREE);
        IndexStamp {
            journal_gen,
            next_seq,
            checkpoints: self.checkpoints,
            next_chunk: self.chunks.next_id,
            live_chunks: self.chunks.live_chunks,
            chunk_tree_page: tree.map_or(0, |t| t.root.page),
            chunk_tree_crc: tree.map_or(0, |t| t.root.crc),
        }
    }

    /// Build the index: from the saved one if it is this state's, else from every chunk of
    /// the chunk table. On an error the index keeps what was read (it is advisory) and is
    /// marked built anyway.
    pub fn build_index(&mut self) -> Result<()> {
        let saved = self.saved_index.take();
        // A saved file is a dense index's (a sparse one is rebuilt: it keeps hooks only).
        if let Some(saved) = saved.filter(|_| IndexSetting::of(&self.meta) == IndexSetting::Dense) {
            let started = std::time::Instant::now();
            match DedupIndex::load(&*saved.file, saved.uuid, saved.stamp) {
                Ok(index) => {
                    self.install_index(Index::Dense(index), IndexOrigin::Loaded, started);
                    return Ok(());
                }
                Err(e) => tracing::warn!(
                    "the saved dedup index was not used ({e}); building it from the chunk table"
                ),
            }
        }
        // At once: the build in steps, in one step.
        self.index_build = Some(IndexBuild {
            index: Index::empty(IndexSetting::of(&self.meta), self.chunks.live_chunks),
            next_page: 0,
            started: std::time::Instant::now(),
        });
        let r = self.index_build_step(u64::MAX);
        crate::dedup_index::return_free_memory();
        r.map(drop)
    }

    /// Whether the index should be built in steps: neither built, nor to be loaded from a
    /// saved file (which the first write loads at once), nor being built.
    pub fn index_to_build(&self) -> bool {
        let saved =
            self.saved_index.is_some() && IndexSetting::of(&self.meta) == IndexSetting::Dense;
        !self.index_ready() && !saved && self.index_build.is_none() && self.index_load.is_none()
    }

    /// Start loading the saved index without the state lock (a served pool's first write must
    /// not wait ~100 ms for a 10M-chunk file), if there is a dense one to load and the index
    /// is neither there nor being built or loaded. The caller reads the returned file with
    /// [`DedupIndex::load`] with the lock let go, then hands the result to
    /// [`Metadata::finish_index_load`]. Until then lookups miss, and every chunk added,
    /// dropped or forwarded is kept to be applied to what the file holds.
    pub fn begin_index_load(&mut self) -> Option<SavedIndex> {
        if self.index_ready()
            || self.index_build.is_some()
            || self.index_load.is_some()
            || IndexSetting::of(&self.meta) != IndexSetting::Dense
        {
            return None;
        }
        let s = self.saved_index.as_ref()?;
        let file = SavedIndex {
            file: s.file.clone(),
            uuid: s.uuid,
            stamp: s.stamp,
        };
        self.index_load = Some(IndexLoad {
            changes: Vec::new(),
            overflowed: false,
            started: std::time::Instant::now(),
        });
        Some(file)
    }

    /// End the load begun by [`Metadata::begin_index_load`] with what it read. True if the
    /// index is there: the loaded one with every change since the load began applied, in
    /// order ([`IndexLoad`]). False if the file could not be used, too many changes came
    /// meanwhile, or the pool's index setting is no longer dense: nothing is installed, the
    /// saved file is forgotten, and [`Metadata::index_to_build`] holds for the caller to
    /// build the index from the chunk table in steps. Call with the state lock held (the
    /// same hold as no change may come between the changes applied and the install).
    pub fn finish_index_load(&mut self, loaded: Result<DedupIndex>) -> bool {
        let Some(load) = self.index_load.take() else {
            return self.index_ready();
        };
        if self.index_ready() {
            return true;
        }
        let why = match loaded {
            Ok(_) if load.overflowed => format!(
                "more than {INDEX_LOAD_CHANGES_MAX} chunks were added or removed while it loaded"
            ),
            Ok(_) if IndexSetting::of(&self.meta) != IndexSetting::Dense => {
                "the pool's index setting changed while it loaded".to_string()
            }
            Ok(mut index) => {
                for (fp, page, added) in &load.changes {
                    if *added {
                        index.insert(fp, *page);
                    } else {
                        index.remove(fp, *page);
                    }
                }
                self.install_index(Index::Dense(index), IndexOrigin::Loaded, load.started);
                return true;
            }
            Err(e) => e.to_string(),
        };
        tracing::warn!(
            "the saved dedup index was not used ({why}); building it from the chunk table"
        );
        self.saved_index = None;
        false
    }

    /// Start building the index in steps ([`Metadata::index_build_step`]) into `empty` (made
    /// by the caller with [`Index::empty`] for the pool's setting and live chunks, without
    /// the lock: its allocation is tens of MB), if [`Metadata::index_to_build`] still holds
    /// and `empty` is of the pool's setting. True if a build is under way.
    pub fn begin_index_build(&mut self, empty: Index) -> bool {
        if self.index_to_build() && empty.setting() == IndexSetting::of(&self.meta) {
            self.index_build = Some(IndexBuild {
                index: empty,
                next_page: 0,
                started: std::time::Instant::now(),
            });
        }
        self.index_build.is_some()
    }

    /// One step of the build begun by [`Metadata::begin_index_build`]: the next `pages`
    /// chunk-table pages put in the index. The last step (the page the next chunk ids go to,
    /// and any after it) installs the index in the same hold of the caller's lock, so no
    /// chunk added meanwhile is missed. True once the index is there (an unreadable page
    /// ends the build as [`Metadata::build_index`] does: what was read is kept); the caller
    /// then calls [`crate::dedup_index::return_free_memory`] with the lock let go.
    pub fn index_build_step(&mut self, pages: u64) -> Result<bool> {
        let Some(mut b) = self.index_build.take() else {
            return Ok(self.index_ready());
        };
        if self.index_ready() {
            return Ok(true);
        }
        let open_page = page_of(self.chunks.next_id);
        let last = b.next_page.saturating_add(pages) >= open_page;
        let end = if last { u64::MAX } else { b.next_page + pages };
        let index = &mut b.index;
        let r = self
            .chunks
            .for_each_in(&mut self.pages, b.next_page, end, &mut |id, e| {
                index.insert_built(&e.fp, page_of(id));
                Ok(())
            });
        if last || r.is_err() {
            self.install_index(b.index, IndexOrigin::Built, b.started);
            return r.map(|_| true);
        }
        b.next_page = end;
        self.index_build = Some(b);
        Ok(false)
    }

    /// The index holds every chunk of the table (it was built, or loaded).
    pub fn index_ready(&self) -> bool {
        self.index_origin != IndexOrigin::NotBuilt
    }

    /// Make `index`, loaded or built since `started`, the pool's index.
    fn install_index(&mut self, index: Index, origin: IndexOrigin, started: std::time::Instant) {
        let how = match origin {
            IndexOrigin::Loaded => format!("loaded from {DEDUP_INDEX_NAME}"),
            _ => "built".to_string(),
        };
        tracing::info!(
            "{} dedup index {how}: {} {} in {:.2} s",
            index.setting().mode(),
            index.len(),
            if index.sparse().is_some() {
                "hooks"
            } else {
                "chunks"
            },
            started.elapsed().as_secs_f64()
        );
        self.index = index;
        self.index_origin = origin;
        self.pages.set_reserved_bytes(self.index.ram_bytes());
    }

    /// The checkpoint root describing this state (trees as last prepared).
    pub fn root(&self, journal_gen: u64, next_seq: u64) -> Root {
        let mut segment_live: Vec<(u32, u64)> = self
            .chunks
            .live_bytes
            .iter()
            .map(|(&s, &b)| (s, b))
            .collect();
        segment_live.sort_unstable();
        Root {
            journal_gen,
            next_seq,
            next_vol: self.next_vol,
            volumes: self
                .volumes
                .iter()
                .map(|(&id, v)| RootVolume {
                    id,
                    size: v.size,
                    data_blocks: v.counts.data_blocks,
                    zero_blocks: v.counts.zero_blocks,
                    name: v.name.clone(),
                    snapshot_of: v.snapshot_of,
                    created: v.created,
                })
                .collect(),
            trees: self
                .pages
                .trees()
                .iter()
                .map(|(&id, t)| RootTree {
                    id,
                    height: t.height,
                    page: t.root.page,
                    crc: t.root.crc,
                    units: t.root.units,
                    codec: t.root.codec,
                })
                .collect(),
            next_chunk: self.chunks.next_id,
            live_chunks: self.chunks.live_chunks,
            live_stored_bytes: self.chunks.live_stored_bytes,
            forwards: self.chunks.forwards,
            deltas: self.chunks.deltas,
            segment_live,
            meta_bytes_written: self.meta_bytes_written(),
            checkpoints: self.checkpoints,
            bitmap: self.pages.alloc.bitmap().to_vec(),
            meta: self
                .meta
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            shared_pages: self
                .pages
                .shared_pages()
                .iter()
                .map(|(&p, &r)| (p, r))
                .collect(),
            releasing: self
                .releasing
                .iter()
                .map(|(&tree, r)| RootRelease {
                    tree,
                    name: r.name.clone(),
                    end: r.end,
                    next: r.next,
                    data_blocks: r.data_blocks,
                })
                .collect(),
        }
    }

    /// Metadata page bytes written over the pool's life.
    pub fn meta_bytes_written(&self) -> u64 {
        self.meta_bytes_written_before + self.pages.counters.bytes_written
    }
}

/// How many blocks ahead [`Metadata::find_duplicates`] warms the dense index.
const PREFETCH_AHEAD: usize = 8;

/// The pool's chunk table as the sparse index reads it ([`crate::sparse_index::SparseIndex::find`]).
struct TablePages<'a> {
    pages: &'a mut PageCache,
    chunks: &'a ChunkTable,
}

impl ChunkPages for TablePages<'_> {
    fn confirm(&mut self, page: u64, fp: &Fingerprint) -> Option<u64> {
        confirm(self.pages, self.chunks, page, fp)
    }

    /// Forwards too: a duplicate run met again finds its blocks through them.
    fn page_keys(&mut self, page: u64) -> Option<Vec<u64>> {
        let leaf = self.pages.leaf(CHUNK_TREE, page).ok()??;
        Some(
            (0..CHUNKS_PER_PAGE)
                .filter_map(|i| crate::chunk_table::decode_any(leaf, i))
                .map(|s| crate::sparse_index::key(s.fp()))
                .collect(),
        )
    }

    fn last_page(&self) -> u64 {
        page_of(self.chunks.next_id.saturating_sub(1))
    }
}

/// A live chunk on chunk-table page `page` with fingerprint `fp` that may take another
/// reference: a chunk of the page, or the one a forward of the page names (an unreadable
/// page is a miss).
fn confirm(pages: &mut PageCache, chunks: &ChunkTable, page: u64, fp: &Fingerprint) -> Option<u64> {
    use crate::chunk_table::Slot;
    let Ok(Some(p)) = pages.leaf(CHUNK_TREE, page) else {
        return None;
    };
    let mut forward = None;
    for i in 0..CHUNKS_PER_PAGE {
        if p.get(i * 32..i * 32 + 16) != Some(&fp[..]) {
            continue;
        }
        match crate::chunk_table::decode_any(p, i) {
            Some(Slot::Chunk(e)) if e.refs < REFS_MAX => {
                return Some(page * CHUNKS_PER_PAGE as u64 + i as u64)
            }
            Some(Slot::Forward { to, .. }) => forward = forward.or(Some(to)),
            _ => {}
        }
    }
    let to = forward?;
    match chunks.slot(pages, to) {
        Ok(Some(Slot::Chunk(e))) if e.refs < REFS_MAX && e.fp == *fp => Some(to),
        _ => None,
    }
}
