//! Other hosts' chunks and segments in this pool's tables (docs/S3.md "Many hosts"; the
//! protocol is [`crate::hosts`]'): the chunk-table and segment operations the fold, the
//! condemnation of segments, the forgets and the clones from another host ask of the core.
//!
//! Invariants kept here: a chunk is added for another host's record only if that record's
//! segment is readable here; of two hosts holding one content, this host's chunk moves to
//! the other's record only when the other's slot is lower and the chunk is in a segment of
//! this host's own; every change is journaled like any other (`NewChunk`, `Relocate`,
//! `DropChunk`, `MapRun`).

use crate::chunk_table::{ChunkEntry, Slot};
use crate::error::{Error, Result};
use crate::format::hosts::Condemned;
use crate::format::{segment_slot, JournalRecord, Location, CHUNKS_PER_PAGE};
use crate::io::File;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, MutexGuard};

use super::Pool;

/// Chunk-table pages scanned per hold of the state lock.
const SCAN_PAGES: u64 = 64;

/// What [`Pool::fold_chunks`] did: chunks added that name another host's records, and
/// chunks of this host moved to the other host's copy.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Folded {
    pub added: u64,
    pub merged: u64,
}

impl Pool {
    /// The chunk table's next id (every chunk id in use is below it).
    pub(crate) fn next_chunk_id(&self) -> u64 {
        self.lock_state().md.chunks.next_id
    }

    /// The chunks of chunk-table pages `[page, page + pages)`.
    pub(crate) fn chunks_in_pages(&self, page: u64, pages: u64) -> Result<Vec<(u64, ChunkEntry)>> {
        let mut out = Vec::new();
        let mut st = self.lock_state();
        let md = &mut st.md;
        md.chunks
            .for_each_in(&mut md.pages, page, page + pages, &mut |id, e| {
                out.push((id, *e));
                Ok(())
            })?;
        Ok(out)
    }

    /// The files of those of `ids` this pool can read.
    pub(crate) fn segment_files(&self, ids: &[u32]) -> HashMap<u32, Arc<dyn File>> {
        let st = self.lock_state();
        ids.iter()
            .filter_map(|s| st.segments.file(*s).map(|f| (*s, f)))
            .collect()
    }

    /// Whether a referenced chunk of this pool has its record in segment `seg`.
    pub(crate) fn has_live_chunks_in(&self, seg: u32) -> bool {
        self.lock_state().md.chunks.live_bytes.contains_key(&seg)
    }

    /// Fold another host's chunks in (`window`, that host's ids and entries, in slot `slot`;
    /// the caller kept only referenced ones in that host's own segments, not condemned): one
    /// whose content this pool has no chunk for is added, naming that host's record; one this
    /// pool stores in a segment of its own is moved to that record if `slot` is lower than
    /// this host's. Records in a segment this pool cannot read are skipped.
    pub(crate) fn fold_chunks(&self, window: &[(u64, ChunkEntry)], slot: u8) -> Result<Folded> {
        let mut done = Folded::default();
        let mut st = self.lock_state();
        let mut records = Vec::new();
        for (_, e) in window {
            if st.segments.file(e.loc.segment).is_none() {
                continue;
            }
            match st.md.find_duplicate(&e.fp) {
                Some(id) => {
                    let md = &mut st.md;
                    let Some(mine) = md.chunks.get(&mut md.pages, id)? else {
                        continue;
                    };
                    if slot < self.slot && !st.segments.is_foreign(mine.loc.segment) {
                        records.push(JournalRecord::Relocate { id, loc: e.loc });
                        done.merged += 1;
                    }
                }
                None => {
                    let Some(id) = st.md.chunks.allocate_id() else {
                        return Err(Error::Invalid("the chunk table has no id left".into()));
                    };
                    records.push(JournalRecord::NewChunk {
                        id,
                        loc: e.loc,
                        fp: e.fp,
                    });
                    done.added += 1;
                }
            }
        }
        if !records.is_empty() {
            self.commit(&mut st, records)?;
        }
        Ok(done)
    }

    /// Point chunks of this pool at another host's records (`moves`: id, the record it names
    /// now, the new one), each only if it is still a referenced chunk naming that record and
    /// the new record's segment is readable here; the chunks pointed.
    pub(crate) fn repoint_chunks(&self, moves: &[(u64, Location, Location)]) -> Result<u64> {
        let mut st = self.lock_state();
        let mut records = Vec::new();
        for &(id, old, new) in moves {
            let md = &mut st.md;
            let now = md.chunks.slot(&mut md.pages, id)?;
            if matches!(now, Some(Slot::Chunk(e)) if e.refs > 0 && e.loc == old)
                && st.segments.file(new.segment).is_some()
            {
                records.push(JournalRecord::Relocate { id, loc: new });
            }
        }
        let n = records.len() as u64;
        if n > 0 {
            self.commit(&mut st, records)?;
        }
        Ok(n)
    }

    /// GC emptied `segs`: in a pool other hosts share, record them condemned (durable in a
    /// new root on return) and keep them; true if so. False in a pool of one host: the caller
    /// deletes them.
    pub(crate) fn condemn(&self, segs: &[u32], sync: &MutexGuard<'_, ()>) -> Result<bool> {
        if segs.is_empty() || !self.is_shared()? {
            return Ok(false);
        }
        let mut st = self.lock_state();
        let mut c = Condemned::read(&st.md.meta);
        for seg in segs {
            c.segs.insert(*seg, c.next);
        }
        c.next += 1;
        self.commit(&mut st, vec![c.record()])?;
        drop(st);
        self.checkpoint_locked(sync)?;
        Ok(true)
    }

    /// Delete condemned segments `segs` (every other host let them go) and journal what is
    /// still condemned (`still`) in the same hold; the directory is synced after.
    pub(crate) fn delete_condemned(&self, segs: &[u32], still: Condemned) -> Result<()> {
        let mut st = self.lock_state();
        for seg in segs {
            st.segments.remove(&*self.dir, *seg)?;
        }
        self.commit(&mut st, vec![still.record()])?;
        drop(st);
        self.dir
            .sync_dir()
            .map_err(|e| Error::io("syncing the pool directory", e))
    }

    /// Drop this pool's chunks with no reference whose records are in slot `slot`'s
    /// segments (a forgotten host's part); the number dropped.
    pub(crate) fn drop_unreferenced_chunks_of(&self, slot: u8) -> Result<u64> {
        let per = CHUNKS_PER_PAGE as u64;
        let mut page = 0;
        let mut dropped = 0u64;
        loop {
            let mut st = self.lock_state();
            if page * per >= st.md.chunks.next_id {
                return Ok(dropped);
            }
            let mut records = Vec::new();
            let md = &mut st.md;
            md.chunks
                .for_each_in(&mut md.pages, page, page + SCAN_PAGES, &mut |id, e| {
                    if e.refs == 0 && segment_slot(e.loc.segment) == slot {
                        records.push(JournalRecord::DropChunk { id });
                    }
                    Ok(())
                })?;
            dropped += records.len() as u64;
            if !records.is_empty() {
                self.commit(&mut st, records)?;
            }
            page += SCAN_PAGES;
        }
    }

    /// Add to `out` the segments of slot `slot` that chunks of this pool's chunk table name
    /// (any chunk, with references or not).
    pub(crate) fn segments_named(&self, slot: u8, out: &mut BTreeSet<u32>) -> Result<()> {
        let per = CHUNKS_PER_PAGE as u64;
        let mut page = 0;
        loop {
            let mut st = self.lock_state();
            if page * per >= st.md.chunks.next_id {
                return Ok(());
            }
            let md = &mut st.md;
            md.chunks
                .for_each_in(&mut md.pages, page, page + SCAN_PAGES, &mut |_, e| {
                    if segment_slot(e.loc.segment) == slot {
                        out.insert(e.loc.segment);
                    }
                    Ok(())
                })?;
            page += SCAN_PAGES;
        }
    }

    /// The block-map entries of blocks `[first, first + n)` of volume `vol`.
    pub(crate) fn map_run(&self, vol: u32, first: u64, n: u64) -> Result<Vec<u64>> {
        let mut entries = Vec::with_capacity(n as usize);
        let mut st = self.lock_state();
        let md = &mut st.md;
        crate::block_map::get_range(&mut md.pages, u64::from(vol), first, n, &mut entries)?;
        Ok(entries)
    }

    /// The chunk-table entries of `ids` (`None`: no such chunk).
    pub(crate) fn chunk_entries(
        &self,
        ids: &BTreeSet<u64>,
    ) -> Result<Vec<(u64, Option<ChunkEntry>)>> {
        let mut st = self.lock_state();
        let md = &mut st.md;
        ids.iter()
            .map(|&id| Ok((id, md.chunks.get(&mut md.pages, id)?)))
            .collect()
    }

    /// Map blocks `[first, first + entries.len())` of volume `vol` as another host's volume
    /// maps them: each of its chunks (`theirs`: its id → entry) becomes this pool's chunk of
    /// that content, or a new chunk naming its record if `usable(loc)` and the record's
    /// segment is readable here (else `unusable(loc)` is the error, and nothing changed).
    /// Other entries (zero, unmapped) are mapped as they are. Returns the chunks added.
    pub(crate) fn map_foreign_run(
        &self,
        vol: u32,
        first: u64,
        entries: &[u64],
        theirs: &HashMap<u64, ChunkEntry>,
        usable: &dyn Fn(&Location) -> bool,
        unusable: &dyn Fn(&Location) -> Error,
    ) -> Result<u64> {
        let mut st = self.lock_state();
        let mut records = Vec::new();
        let mut ids: HashMap<u64, u64> = HashMap::new();
        let mut added = 0;
        for (&their_id, c) in theirs {
            let id = match st.md.find_duplicate(&c.fp) {
                Some(id) => id,
                None => {
                    if !usable(&c.loc) || st.segments.file(c.loc.segment).is_none() {
                        return Err(unusable(&c.loc));
                    }
                    let id =
                        st.md.chunks.allocate_id().ok_or_else(|| {
                            Error::Invalid("the chunk table has no id left".into())
                        })?;
                    records.push(JournalRecord::NewChunk {
                        id,
                        loc: c.loc,
                        fp: c.fp,
                    });
                    added += 1;
                    id
                }
            };
            ids.insert(their_id, id);
        }
        let mapped: Vec<u64> = entries
            .iter()
            .map(|e| ids.get(e).copied().unwrap_or(*e))
            .collect();
        records.push(JournalRecord::MapRun {
            vol,
            start: first,
            entries: mapped,
        });
        self.commit(&mut st, records)?;
        Ok(added)
    }
}
