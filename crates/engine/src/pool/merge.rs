//! The merge pass: chunks holding the same data that the inline (sparse) dedup index let
//! through are found by sorting every live chunk's fingerprint, and each is made a forward to
//! the oldest chunk of its data (`JournalRecord::Forward`, docs/FORMAT.md "Forwards"); GC then
//! reclaims their records. docs/ARCHITECTURE.md "Merge pass".
//!
//! Owns: the pass's steps. Every hold of the state lock is bounded ([`SCAN_PAGES`] chunk-table
//! pages read, or [`MERGE_BATCH`] forwards checked and journaled) and followed by a pause at
//! least as long ([`Pacer`]), so the VMs' I/O goes on; the sort itself runs without the lock,
//! within its RAM budget (`fingerprint_sort`).
//!
//! Invariants:
//! - A forward is journaled only after a checkpoint whose root allows forwards (version 4:
//!   builds that do not know them refuse the pool), and only after checking, under the hold
//!   that journals it, that both chunks still have records with the same fingerprint.
//! - Crash safety: each batch is one commit, flushed at least every `DURABLE_EVERY`. A
//!   pass killed midway keeps the forwards made durable; the next pass finds the rest (a
//!   forward is no longer a chunk, so it is not sorted again). Blocks never change: a
//!   forward reads the same bytes its own record held.
//! - Shared pools (docs/S3.md "Many hosts"): peers' chunks the fold added are sorted too; the
//!   lowest host slot's copy stays, as at the fold; an unreferenced chunk never becomes a forward.
//! - Deltas (docs/FORMAT.md "Delta records") are neither sorted nor forwarded to: a delta's
//!   record holds references on its bases that only GC's `DropDelta` gives back, and a base,
//!   resolved through a forward, must never land on a delta. A base may become a forward to
//!   another chunk that is not a delta.

use super::{Pacer, Pool};
use crate::chunk_table::{ChunkTable, Slot};
use crate::error::{Error, Result};
use crate::fingerprint_sort::FingerprintSort;
use crate::format::{segment_slot, JournalRecord, CHUNKS_PER_PAGE};
use crate::locks::lock;
use crate::metadata::{Metadata, REFS_MAX};

/// Chunk-table pages read per hold of the state lock.
const SCAN_PAGES: u64 = 16;
/// Forwards checked and journaled per hold of the state lock.
const MERGE_BATCH: usize = 64;
/// How often (monotonic clock) the pass flushes: a kill loses at most this much of it.
const DURABLE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The metadata record of the chunk id the last whole pass sorted up to (8 bytes, LE): the
/// chunks from it on may hold data the inline index missed ([`Pool::merge_backlog`]).
pub const MERGED_THROUGH_KEY: &str = "index/merged-through";

/// [`Pool::merge_backlog`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MergeBacklog {
    /// Chunk ids handed out since the last whole pass began (all, if none or undecodable).
    pub new_chunks: u64,
    /// Live chunks now.
    pub live_chunks: u64,
    /// The pool's dedup index is sparse (set so: a dense index misses no duplicate inline).
    pub sparse: bool,
}

/// What a merge pass did.
#[derive(Clone, Debug, Default)]
pub struct MergeReport {
    /// Chunks sorted: the live ones and the peers' the fold added.
    pub chunks_sorted: u64,
    /// Sorted runs (more than one: the sort went past its RAM budget, to a scratch file).
    pub runs: usize,
    /// Chunks found to hold the data of an older chunk.
    pub duplicates: u64,
    /// Of those, made forwards (not: changed meanwhile, no references, or shared too often).
    pub merged: u64,
    /// Bytes of the merged chunks' records: what GC can reclaim now.
    pub record_bytes_merged: u64,
    /// Stopped before the end ([`Pool::merge_duplicates_until`]).
    pub stopped: bool,
}

impl Pool {
    /// Find every live chunk whose data an older chunk holds and make it a forward to that
    /// one, sorting within `budget` bytes of RAM; `progress(done, total)` as it goes. The
    /// space comes back at the next GC.
    pub fn merge_duplicates(
        &self,
        budget: u64,
        progress: &(dyn Fn(u64, u64) + Sync),
    ) -> Result<MergeReport> {
        self.merge_duplicates_until(budget, &|done, total| {
            progress(done, total);
            false
        })
    }

    /// [`Pool::merge_duplicates`], stopped at the next step once `stop(done, total)` says so
    /// (the report then has `stopped`; the forwards made so far stay, and the pass is not
    /// recorded as whole).
    pub fn merge_duplicates_until(
        &self,
        budget: u64,
        stop: &(dyn Fn(u64, u64) -> bool + Sync),
    ) -> Result<MergeReport> {
        if self.read_only {
            return Err(Error::ReadOnly);
        }
        self.allow_section(|c| &mut c.forwards)?;
        let (mut sort, pages, through) = {
            let st = self.lock_state();
            let through = st.md.chunks.next_id;
            let pages = through.div_ceil(CHUNKS_PER_PAGE as u64);
            (FingerprintSort::new(budget, &st.md.spill), pages, through)
        };
        let mut pacer = Pacer::default();
        let mut page = 0;
        while page < pages {
            pacer.step();
            let mut st = self.lock_state();
            let md = &mut st.md;
            let end = (page + SCAN_PAGES).min(pages);
            md.chunks
                .for_each_in(&mut md.pages, page, end, &mut |id, e| {
                    // Deltas are left alone (docs/FORMAT.md "Delta records"): never made a
                    // forward, never forwarded to. A peer's chunk the fold added may have none.
                    let live = e.refs > 0 || segment_slot(e.loc.segment) != self.slot;
                    if live && !e.loc.codec.is_delta() {
                        sort.push(&e.fp, id);
                    }
                    Ok(())
                })?;
            md.pages.evict_to_budget()?;
            drop(st);
            page = end;
            if stop(page, 2 * pages) {
                return Ok(MergeReport {
                    stopped: true,
                    ..Default::default()
                });
            }
        }
        let mut report = MergeReport {
            chunks_sorted: sort.len(),
            runs: sort.runs().max(1),
            ..Default::default()
        };
        let mut pairs = sort.finish()?;
        let mut flushed = std::time::Instant::now();
        loop {
            let batch: Vec<(u64, u64)> = pairs.by_ref().take(MERGE_BATCH).collect();
            if batch.is_empty() {
                break;
            }
            pairs.check()?;
            pacer.step();
            self.forward_batch(&batch, &mut report)?;
            if flushed.elapsed() >= DURABLE_EVERY {
                self.flush()?;
                flushed = std::time::Instant::now();
            }
            let done = pages + pages * pairs.met() / report.chunks_sorted.max(1);
            if stop(done, 2 * pages) {
                report.stopped = true;
                return Ok(report);
            }
        }
        pairs.check()?;
        self.meta_put(MERGED_THROUGH_KEY, Some(&through.to_le_bytes()))?;
        stop(2 * pages, 2 * pages);
        Ok(report)
    }

    /// What a merge pass would look through for duplicates the inline index missed.
    pub fn merge_backlog(&self) -> MergeBacklog {
        let st = self.lock_state();
        let through = st
            .md
            .meta
            .get(MERGED_THROUGH_KEY)
            .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
            .map_or(0, u64::from_le_bytes);
        MergeBacklog {
            new_chunks: st.md.chunks.next_id.saturating_sub(through),
            live_chunks: st.md.chunks.live_chunks,
            sparse: matches!(
                crate::index::IndexSetting::of(&st.md.meta),
                crate::index::IndexSetting::Sparse { .. }
            ),
        }
    }

    /// Journal the forwards of `batch` ((chunk, the older chunk of its data)) whose chunks
    /// are still as sorted, under one hold of the state lock.
    fn forward_batch(&self, batch: &[(u64, u64)], report: &mut MergeReport) -> Result<()> {
        let mut st = self.lock_state();
        self.writable(&st)?;
        let md = &mut st.md;
        let mut records = Vec::new();
        for &(mut id, mut to) in batch {
            report.duplicates += 1;
            let (Some(Slot::Chunk(mut d)), Some(Slot::Chunk(mut k))) = (
                md.chunks.slot(&mut md.pages, id)?,
                md.chunks.slot(&mut md.pages, to)?,
            ) else {
                continue;
            };
            // The lower host slot's copy stays (module docs): the older is then the forward.
            if segment_slot(d.loc.segment) < segment_slot(k.loc.segment) {
                (id, to, d, k) = (to, id, k, d);
            }
            if d.fp == k.fp
                && d.refs > 0
                && k.refs.saturating_add(d.refs) < REFS_MAX
                && !d.loc.codec.is_delta()
                && !k.loc.codec.is_delta()
            {
                records.push(JournalRecord::Forward { id, to });
                report.merged += 1;
                report.record_bytes_merged += d.loc.record_bytes();
            }
        }
        if !records.is_empty() {
            self.commit(&mut st, records)?;
        }
        st.md.pages.evict_to_budget()
    }

    /// Make sure the root on disk has the section of forwards or deltas (`section`: its
    /// counter in the chunk table) before the first is journaled: a checkpoint whose root
    /// says so (docs/FORMAT.md "Forwards", "Delta records"), once in the pool's life.
    pub(crate) fn allow_section(
        &self,
        section: fn(&mut ChunkTable) -> &mut Option<u64>,
    ) -> Result<()> {
        if section(&mut self.lock_state().md.chunks).is_some() {
            return Ok(());
        }
        let sync = lock(&self.sync_lock);
        let mut allow = |md: &mut Metadata| {
            section(&mut md.chunks).get_or_insert(0);
            Ok(())
        };
        self.checkpoint_with(&sync, &|_| Ok(()), Some(&mut allow))
    }
}
