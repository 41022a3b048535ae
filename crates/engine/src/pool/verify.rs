//! `condense verify` in the pool: the chunk pass (every live chunk read and checked, a window
//! of the chunk table at a time, without the state lock while reading) and the map walk under
//! the state lock; the checks themselves and the reports are [`crate::verify`]'s.

use crate::error::Result;
use crate::format::{open_record, CHUNKS_PER_PAGE};
use crate::locks::lock;
use crate::reduction;
use crate::verify::{
    check_ref_counts, check_shared_pages, walk_maps, ChunkCheck, ChunkToCheck, Known, VerifyReport,
};
use rayon::prelude::*;
use std::collections::HashSet;

use super::Pool;

impl Pool {
    /// Check everything. `progress(done, total)` is called as chunks are checked.
    pub fn verify(&self, progress: &(dyn Fn(u64, u64) + Sync)) -> Result<VerifyReport> {
        // No GC while verifying: it would move chunks the first pass located. Writes may go
        // on (a live pool): what they change is re-checked under the lock of the map walk.
        let _gc = lock(&self.gc_lock);
        self.flush()?;
        let mut report = VerifyReport::default();
        // Damage open worked around (a copy of the superblock or root, a header): a writable
        // open mended it already; a read-only one leaves it for a writable open or repair.
        if self.read_only {
            report
                .metadata_problems
                .extend(self.replay.notes.iter().cloned());
        }
        report.accepted = crate::pool::damage::damage_history(self);
        let checked = self.chunk_pass(progress)?;
        report.chunks_checked = checked.chunks_checked;
        report.bytes_checked = checked.bytes_checked;
        report.bad_chunks = checked.bad.clone();
        report
            .metadata_problems
            .extend(checked.metadata_problems.iter().cloned());
        let bad: HashSet<u64> = checked.bad.iter().map(|b| b.0).collect();
        let ChunkCheck {
            exists,
            stored_refs,
            next_id,
            ..
        } = checked;
        // The chunk pass keeps one bit and one count per chunk id below `next_id`.
        debug_assert_eq!(exists.len() as u64, next_id.div_ceil(64));
        debug_assert_eq!(stored_refs.len() as u64, next_id);
        let known = Known {
            exists: &exists,
            next_id,
            bad: &bad,
        };
        // Maps: every entry names an existing, good chunk; count references.
        let mut st = self.lock_state();
        let vols: Vec<(u32, String, u64)> = st
            .md
            .volumes
            .iter()
            .map(|(&id, v)| (id, v.name.clone(), v.size / u64::from(self.block_size())))
            .collect();
        let counted = walk_maps(&mut st.md, vols, &known, &mut report);
        if report.metadata_problems.is_empty() {
            check_shared_pages(&mut st.md, &mut report);
        }
        if report.metadata_problems.is_empty() {
            check_ref_counts(&mut st.md, &counted, &stored_refs, &exists, &mut report);
        }
        st.md.pages.evict_to_budget()?;
        Ok(report)
    }

    /// Read every live chunk and check its record as `verify` does (CRC, authentication,
    /// decompression, fingerprint): `condense repair` drops the damaged ones. Takes the GC
    /// lock, as a chunk moved during the pass would be checked at its old place.
    pub fn check_chunks(&self, progress: &(dyn Fn(u64, u64) + Sync)) -> Result<ChunkCheck> {
        let _gc = lock(&self.gc_lock);
        self.flush()?;
        self.chunk_pass(progress)
    }

    /// The chunk pass of [`Pool::verify`] and [`Pool::check_chunks`] (the caller holds the GC
    /// lock and has flushed).
    fn chunk_pass(&self, progress: &(dyn Fn(u64, u64) + Sync)) -> Result<ChunkCheck> {
        debug_assert!(self.gc_lock.try_lock().is_err(), "the caller holds gc_lock");
        let mut check = ChunkCheck::default();
        let (total, next_id) = {
            let st = self.lock_state();
            (st.md.chunks.live_chunks, st.md.chunks.next_id)
        };
        // Chunks, a window of chunk-table pages at a time.
        const WINDOW_PAGES: u64 = 512;
        let mut exists = vec![0u64; next_id.div_ceil(64) as usize];
        let mut stored_refs: Vec<u32> = vec![0; next_id as usize];
        let mut done = 0u64;
        let mut page = 0u64;
        let per = CHUNKS_PER_PAGE as u64;
        while page * per < next_id {
            let work = self.chunk_window(page, WINDOW_PAGES, &mut check.metadata_problems);
            for w in &work {
                if let Some(x) = exists.get_mut((w.id / 64) as usize) {
                    *x |= 1 << (w.id % 64);
                }
                if let Some(r) = stored_refs.get_mut(w.id as usize) {
                    *r = w.entry.refs;
                }
            }
            let results: Vec<(u64, Option<(u64, String)>)> = work
                .par_iter()
                .filter(|w| w.entry.refs > 0)
                .map(|w| self.check_chunk(w))
                .collect();
            for (bytes, b) in results {
                check.chunks_checked += 1;
                check.bytes_checked += bytes;
                check.bad.extend(b);
            }
            done += work.iter().filter(|w| w.entry.refs > 0).count() as u64;
            progress(done.min(total), total);
            page += WINDOW_PAGES;
        }
        progress(total, total);
        check.exists = exists;
        check.stored_refs = stored_refs;
        check.next_id = next_id;
        Ok(check)
    }

    /// Every chunk-table slot in use in pages `[page, page + pages)`, with where its record
    /// is. Problems reading the table are appended to `problems`.
    pub(crate) fn chunk_window(
        &self,
        page: u64,
        pages: u64,
        problems: &mut Vec<String>,
    ) -> Vec<ChunkToCheck> {
        let mut work = Vec::new();
        let mut st = self.lock_state();
        let st = &mut *st;
        let segments = &st.segments;
        let md = &mut st.md;
        let per = CHUNKS_PER_PAGE as u64;
        let walked = md.pages.for_each_leaf(
            crate::page_cache::CHUNK_TREE,
            page,
            page + pages,
            &mut |pi, data| {
                for i in 0..CHUNKS_PER_PAGE {
                    if let Some(entry) = crate::chunk_table::decode_slot(data, i) {
                        work.push(ChunkToCheck {
                            id: pi * per + i as u64,
                            // Written since the last flush: maybe still in memory.
                            in_memory: segments.in_memory(&entry.loc),
                            file: segments.file(entry.loc.segment),
                            entry,
                        });
                    }
                }
                Ok(true)
            },
        );
        if let Err(e) = walked {
            problems.push(format!("chunk table pages {page}..{}: {e}", page + pages));
        }
        work
    }

    /// Read one chunk and check its record, its decompression and its fingerprint: (record
    /// bytes checked, the problem if any).
    pub(crate) fn check_chunk(&self, w: &ChunkToCheck) -> (u64, Option<(u64, String)>) {
        let (id, e, file, in_memory) = (w.id, &w.entry, w.file.as_deref(), w.in_memory.as_deref());
        let loc = e.loc;
        let mut read = vec![];
        let buf: &[u8] = match (in_memory, file) {
            (Some(m), _) => m,
            (None, None) => return (0, Some((id, format!("segment {} is missing", loc.segment)))),
            (None, Some(file)) => {
                read.resize(loc.record_bytes() as usize, 0);
                if let Err(err) = file.read_at(&mut read, u64::from(loc.offset)) {
                    return (
                        0,
                        Some((
                            id,
                            format!(
                                "cannot read segment {} at {}: {err}",
                                loc.segment, loc.offset
                            ),
                        )),
                    );
                }
                &read
            }
        };
        let what = || {
            format!(
                "chunk {id} in segment {} at offset {}",
                loc.segment, loc.offset
            )
        };
        let rid = crate::format::record_id(id, &loc, self.slot);
        let payload = match open_record(buf, rid, &loc, self.crypto.as_deref(), Some(&e.fp), what) {
            Ok(p) => p,
            Err(err) => return (0, Some((id, err.to_string()))),
        };
        let mut out = vec![0u8; self.block_size() as usize];
        if let Err(err) =
            reduction::decompress(loc.codec, &payload, &mut out, || format!("chunk {id}"))
        {
            return (0, Some((id, err.to_string())));
        }
        if reduction::fingerprint(&self.sb.key, &out) != e.fp {
            return (
                0,
                Some((id, "content does not match its fingerprint".into())),
            );
        }
        (buf.len() as u64, None)
    }
}
