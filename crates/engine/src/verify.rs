//! `condense verify`: read and check every chunk, every metadata page and every map; report
//! damage by volume and block.
//!
//! Each live chunk is read, its record CRC checked, decompressed, and its fingerprint
//! recomputed and compared. Every metadata page is read and checked against the CRC its parent
//! holds. Every block-map entry must name an existing chunk, and each chunk's stored reference
//! count must equal the number of entries naming it. Chunks are checked a window at a time, so
//! verify's memory stays bounded apart from one bit and one counter per chunk id.

use crate::error::Result;
use crate::format::{open_record, CHUNKS_PER_PAGE, MAP_PAGE_ENTRIES};
use crate::locks::lock;
use crate::metadata::Metadata;
use crate::pool::Pool;
use crate::reduction;
use rayon::prelude::*;
use std::collections::{BTreeMap, HashSet};

#[derive(Clone, Debug, Default)]
pub struct VerifyReport {
    pub chunks_checked: u64,
    pub bytes_checked: u64,
    /// (chunk id, what is wrong)
    pub bad_chunks: Vec<(u64, String)>,
    /// volume name → damaged block numbers
    pub bad_blocks: BTreeMap<String, Vec<u64>>,
    /// Volumes whose block map is damaged (every block unreadable).
    pub bad_volumes: Vec<String>,
    pub metadata_problems: Vec<String>,
    /// Losses earlier repairs accepted (the pool's history, [`crate::repair::DAMAGE_PREFIX`]):
    /// those blocks fail to read until written (or read as zeros, as the repair was asked).
    /// Not damage now: a pool with only these is clean.
    pub accepted: Vec<crate::repair::DamageRecord>,
}

impl VerifyReport {
    pub fn is_clean(&self) -> bool {
        self.bad_chunks.is_empty()
            && self.bad_blocks.is_empty()
            && self.bad_volumes.is_empty()
            && self.metadata_problems.is_empty()
    }
}

/// What reading every live chunk found ([`Pool::check_chunks`]).
#[derive(Clone, Debug, Default)]
pub struct ChunkCheck {
    pub chunks_checked: u64,
    pub bytes_checked: u64,
    /// (chunk id, what is wrong), in chunk id order.
    pub bad: Vec<(u64, String)>,
    /// Problems reading the chunk table itself.
    pub metadata_problems: Vec<String>,
    /// Bit `id` set: the chunk table holds chunk `id`.
    exists: Vec<u64>,
    /// Each chunk's stored reference count.
    stored_refs: Vec<u32>,
    next_id: u64,
}

/// One chunk-table slot in use, as [`Pool::chunk_window`] found it.
pub(crate) struct ChunkToCheck {
    pub id: u64,
    pub entry: crate::chunk_table::ChunkEntry,
    /// The segment file of its record (`None`: the segment is missing).
    pub file: Option<std::sync::Arc<dyn crate::io::File>>,
    /// The record's bytes, if still in memory (written since the last flush).
    pub in_memory: Option<Vec<u8>>,
}

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
        report.accepted = crate::repair::damage_history(self);
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
        let mut st = lock(&self.state);
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
            let st = lock(&self.state);
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
        let mut st = lock(&self.state);
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

/// What the chunk pass found, as the map walk checks entries against it.
struct Known<'a> {
    /// Bit `id` set: the chunk table held chunk `id`.
    exists: &'a [u64],
    next_id: u64,
    /// Chunks whose record failed its check.
    bad: &'a HashSet<u64>,
}

/// Walk every volume's block map (the caller holds the state lock): damaged maps and blocks
/// naming a bad or missing chunk go into `report`; returns the references counted per chunk.
fn walk_maps(
    md: &mut Metadata,
    vols: Vec<(u32, String, u64)>,
    known: &Known<'_>,
    report: &mut VerifyReport,
) -> Vec<u32> {
    let Known {
        exists,
        next_id,
        bad,
    } = *known;
    let mut counted: Vec<u32> = vec![0; next_id as usize];
    // A leaf shared by snapshots or clones holds one reference per chunk entry, however
    // many trees reach it: count each stored leaf once.
    let mut counted_leaves: HashSet<u64> = HashSet::new();
    for (vol, name, blocks) in vols {
        let mut bad_blocks = Vec::new();
        // Chunks the chunk-table pass did not see: written since (on a live pool), or
        // missing. Decided below, under the same lock as this walk.
        let mut unknown: Vec<(u64, u64)> = Vec::new();
        let leaves = blocks.div_ceil(MAP_PAGE_ENTRIES as u64);
        let walked =
            md.pages
                .for_each_leaf_page(u64::from(vol), 0, leaves, &mut |li, page, leaf| {
                    let first_visit = page == 0 || counted_leaves.insert(page);
                    crate::block_map::leaf_entries(leaf, |i, id| {
                        let b = li * MAP_PAGE_ENTRIES as u64 + i as u64;
                        let known =
                            id < next_id && exists[(id / 64) as usize] & (1 << (id % 64)) != 0;
                        if !known {
                            unknown.push((b, id));
                        } else if bad.contains(&id) {
                            bad_blocks.push(b);
                        }
                        if let Some(c) = counted.get_mut(id as usize).filter(|_| first_visit) {
                            *c = c.saturating_add(1);
                        }
                    });
                    Ok(true)
                });
        for (b, id) in unknown {
            if !matches!(md.chunks.get(&mut md.pages, id), Ok(Some(e)) if e.refs > 0) {
                bad_blocks.push(b);
            }
        }
        bad_blocks.sort_unstable();
        if let Err(e) = walked {
            report.bad_volumes.push(name.clone());
            report
                .metadata_problems
                .push(format!("block map of volume {name:?}: {e}"));
        }
        if !bad_blocks.is_empty() {
            report.bad_blocks.insert(name, bad_blocks);
        }
    }
    counted
}

/// Every metadata page shared by snapshots or clones must have as many parents as its count
/// says, and every counted page a parent.
fn check_shared_pages(md: &mut Metadata, report: &mut VerifyReport) {
    match md.pages.count_parents() {
        Ok(parents) => {
            let stored = md.pages.shared_pages();
            let mut wrong: Vec<String> = parents
                .iter()
                .filter(|(p, &n)| n != stored.get(p).copied().unwrap_or(1))
                .map(|(p, &n)| {
                    format!(
                        "page at unit {p} has {n} parents, its count says {}",
                        stored.get(p).copied().unwrap_or(1)
                    )
                })
                .collect();
            wrong.extend(
                stored
                    .keys()
                    .filter(|p| !parents.contains_key(p))
                    .map(|p| format!("page at unit {p} is counted as shared but nothing names it")),
            );
            if !wrong.is_empty() {
                wrong.sort();
                report.metadata_problems.push(format!(
                    "{} shared metadata pages have a wrong count (first: {})",
                    wrong.len(),
                    wrong[0]
                ));
            }
        }
        Err(e) => report
            .metadata_problems
            .push(format!("walking the block maps: {e}")),
    }
}

/// Each chunk's stored reference count must equal the map entries naming it (re-read under
/// the state lock where the chunk pass saw another count).
fn check_ref_counts(
    md: &mut Metadata,
    counted: &[u32],
    stored_refs: &[u32],
    exists: &[u64],
    report: &mut VerifyReport,
) {
    // Both are indexed by chunk id, up to the chunk pass's next id.
    debug_assert_eq!(counted.len(), stored_refs.len());
    let mut wrong = 0u64;
    let mut first = None;
    for (id, (&c, &s)) in counted.iter().zip(stored_refs.iter()).enumerate() {
        let known = exists[id / 64] & (1 << (id % 64)) != 0;
        if known && c != s {
            // The count read in the first pass may be older than the maps walked
            // now (a live pool): compare with the count as it is under this lock.
            let now = md
                .chunks
                .get(&mut md.pages, id as u64)
                .ok()
                .flatten()
                .map_or(0, |e| e.refs);
            if now != c {
                wrong += 1;
                first.get_or_insert((id, c, now));
            }
        }
    }
    if let Some((id, c, s)) = first {
        report.metadata_problems.push(format!(
            "{wrong} chunks have a wrong reference count (first: chunk {id} is named by {c} blocks, its count says {s})"
        ));
    }
}
