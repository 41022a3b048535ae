//! `condense verify` in the pool: the chunk pass (every live chunk read and checked, a window
//! of the chunk table at a time, the state lock held only to list [`CHUNK_PAGES_PER_HOLD`]
//! pages of it, never while reading) and the map walk, a bounded step per hold of the state
//! lock, repeated while the pool changes under it; the checks themselves, the rules of the
//! stepped walk and the reports are [`crate::verify`]'s.

use crate::error::Result;
use crate::format::{open_record, CHUNKS_PER_PAGE};
use crate::locks::lock;
use crate::reduction;
use crate::verify::{
    check_shared_pages, ref_count_suspects, report_wrong_ref_counts, trees_to_walk,
    wrong_ref_counts, ChunkCheck, ChunkToCheck, Known, MapFindings, MapWalk, VerifyReport,
};
use rayon::prelude::*;
use std::collections::HashSet;

use super::Pool;

/// Walks of the maps a verify makes at most to compare reference counts on a pool that
/// keeps changing ([`crate::verify`]'s rules).
const WALK_ATTEMPTS: u32 = 3;
/// The pause before a walk is repeated (a burst of writes may be over by then).
const RETRY_PAUSE: std::time::Duration = std::time::Duration::from_millis(200);
/// Stored reference counts read again per step of the comparison.
const COUNTS_PER_STEP: usize = 2048;
/// Chunk-table pages read per hold of the state lock in the chunk pass.
const CHUNK_PAGES_PER_HOLD: u64 = 64;

impl Pool {
    /// Check everything. `progress(done, total)` is called as chunks are checked.
    pub fn verify(&self, progress: &(dyn Fn(u64, u64) + Sync)) -> Result<VerifyReport> {
        // No GC while verifying: it would move chunks the first pass located. Writes may go
        // on (a live pool): the map walk's rules for them are `crate::verify`'s.
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
            forwards,
            delta_bases,
            ..
        } = checked;
        // The chunk pass keeps one bit and one count per chunk id below `next_id`.
        debug_assert_eq!(exists.len() as u64, next_id.div_ceil(64));
        debug_assert_eq!(stored_refs.len() as u64, next_id);
        let known = Known {
            exists: &exists,
            next_id,
            bad: &bad,
            forwards: &forwards,
            delta_bases: &delta_bases,
        };
        // Maps: every entry names an existing, good chunk; count references.
        let wrong = self.walk_and_count(&known, &stored_refs, &mut report)?;
        if report.metadata_problems.is_empty() {
            let mut st = self.lock_state();
            check_shared_pages(&mut st.md, &mut report);
            st.md.pages.evict_to_budget()?;
        }
        match wrong {
            Some(wrong) => report_wrong_ref_counts(&wrong, &mut report),
            None if report.metadata_problems.is_empty() => report.not_checked.push(format!(
                "reference counts not compared: the pool kept changing while its maps were walked ({WALK_ATTEMPTS} tries); run verify when the pool is idle, or offline"
            )),
            None => {} // the counts of damaged metadata are not compared
        }
        Ok(report)
    }

    /// Walk every map in steps ([`MapWalk`]) and compare the references counted with the
    /// stored counts, repeating the walk (up to [`WALK_ATTEMPTS`] in all) while changes
    /// committed meanwhile make the count untrustworthy (the rules: [`crate::verify`]). The
    /// findings reported are the first walk's, or those of the walk whose counts were
    /// compared. The chunks whose count is wrong, (id, counted, stored); `None` if the
    /// counts were not compared.
    fn walk_and_count(
        &self,
        known: &Known<'_>,
        stored_refs: &[u32],
        report: &mut VerifyReport,
    ) -> Result<Option<Vec<(u64, u32, u32)>>> {
        // A chunk table the chunk pass could not read whole: its counts are not compared.
        let comparable = report.metadata_problems.is_empty();
        let mut kept: Option<MapFindings> = None;
        let mut compared = None;
        for attempt in 0..WALK_ATTEMPTS {
            if attempt > 0 {
                std::thread::sleep(RETRY_PAUSE);
            }
            // After the first walk, only a walk the pool holds still for is worth finishing.
            let Some((found, quiet_since)) = self.walk_maps(known, kept.is_some())? else {
                continue;
            };
            if !found.problems.is_empty() || !comparable {
                kept = Some(found); // the counts of a damaged map are not compared
                break;
            }
            let mut found = found;
            for &b in known.delta_bases {
                // A delta's reference on its base counts as an entry naming it would.
                for id in std::iter::once(b).chain(known.forwards.get(&b).copied()) {
                    if let Some(c) = found.counted.get_mut(id as usize) {
                        *c += 1;
                    }
                }
            }
            if let Some(since) = quiet_since {
                let suspects = ref_count_suspects(&found.counted, stored_refs, known.exists);
                compared = self.compare_ref_counts(&suspects, &found.counted, since)?;
                if compared.is_some() {
                    kept = Some(found);
                    break;
                }
            }
            kept.get_or_insert(found);
        }
        if let Some(found) = kept {
            report.bad_blocks = found.bad_blocks;
            report.bad_volumes = found.bad_volumes;
            report.metadata_problems.extend(found.problems);
        }
        Ok(compared)
    }

    /// One walk of every map, a step per hold of the state lock, with the pool's count of
    /// appended records when it began if no change was committed during it (`None`: the
    /// maps changed meanwhile). With `give_up`, a walk that sees a change stops there
    /// (`Ok(None)`).
    fn walk_maps(
        &self,
        known: &Known<'_>,
        give_up: bool,
    ) -> Result<Option<(MapFindings, Option<u64>)>> {
        let (mut walk, since) = {
            let st = self.lock_state();
            (
                MapWalk::new(trees_to_walk(&st.md), known.next_id),
                st.appended,
            )
        };
        let mut quiet = true;
        // The lock is not fair: without a pause after each step this thread would take it
        // back before a waiting read or write is scheduled.
        let mut pacer = super::Pacer::default();
        loop {
            pacer.step();
            let mut st = self.lock_state();
            quiet &= st.appended == since;
            if !quiet && give_up {
                return Ok(None);
            }
            let done = walk.step(&mut st.md, known);
            st.md.pages.evict_to_budget()?;
            drop(st);
            if done {
                return Ok(Some((walk.found, quiet.then_some(since))));
            }
        }
    }

    /// The chunks of `suspects` whose stored reference count is not the count `counted`,
    /// read in steps, each checking that nothing was committed since `since` (the appended
    /// count when the walk that counted began); `None` if something was.
    fn compare_ref_counts(
        &self,
        suspects: &[u64],
        counted: &[u32],
        since: u64,
    ) -> Result<Option<Vec<(u64, u32, u32)>>> {
        let mut wrong = Vec::new();
        let mut steps = suspects.chunks(COUNTS_PER_STEP);
        let mut pacer = super::Pacer::default();
        loop {
            pacer.step();
            let mut st = self.lock_state();
            if st.appended != since {
                return Ok(None);
            }
            let Some(part) = steps.next() else {
                return Ok(Some(wrong));
            };
            wrong.extend(wrong_ref_counts(&mut st.md, part, counted));
            st.md.pages.evict_to_budget()?;
        }
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
            // On the background threads: the VMs' reads and writes keep the cores first.
            // A dead delta still holds references on its bases (until GC drops it): only
            // its bases are taken.
            let check_all = || -> Vec<(bool, Checked, Vec<u64>)> {
                work.par_iter()
                    .filter(|w| w.entry.refs > 0 || w.entry.loc.codec.is_delta())
                    .map(|w| {
                        let (checked, bases) = self.check_chunk_and_bases(w);
                        (w.entry.refs > 0, checked, bases)
                    })
                    .collect()
            };
            let results = match crate::priority::background_threads() {
                Some(threads) => threads.install(check_all),
                None => check_all(),
            };
            for (live, (bytes, b), bases) in results {
                if live {
                    check.chunks_checked += 1;
                    check.bytes_checked += bytes;
                    check.bad.extend(b);
                }
                check.delta_bases.extend(bases);
            }
            done += work.iter().filter(|w| w.entry.refs > 0).count() as u64;
            progress(done.min(total), total);
            for (id, to, refs) in
                self.forward_slots(page, WINDOW_PAGES, &mut check.metadata_problems)
            {
                if let Some(x) = exists.get_mut((id / 64) as usize) {
                    *x |= 1 << (id % 64);
                }
                if let Some(r) = stored_refs.get_mut(id as usize) {
                    *r = refs;
                }
                check.forwards.insert(id, to);
            }
            page += WINDOW_PAGES;
        }
        progress(total, total);
        check_forwards(&mut check, &exists);
        check.exists = exists;
        check.stored_refs = stored_refs;
        check.next_id = next_id;
        Ok(check)
    }

    /// The forwards to one of `ids` (chunks found damaged), read in steps over the whole
    /// chunk table (pages it could not read are skipped: verify reports them).
    pub(crate) fn forwards_to(&self, ids: &HashSet<u64>) -> Vec<u64> {
        let pages = self
            .lock_state()
            .md
            .chunks
            .next_id
            .div_ceil(CHUNKS_PER_PAGE as u64);
        let mut found = Vec::new();
        let (mut problems, mut pacer) = (Vec::new(), crate::pool::Pacer::default());
        for page in (0..pages).step_by(CHUNK_PAGES_PER_HOLD as usize) {
            pacer.step();
            let slots = self.forward_slots(page, CHUNK_PAGES_PER_HOLD, &mut problems);
            found.extend(slots.iter().filter(|f| ids.contains(&f.1)).map(|f| f.0));
        }
        found
    }

    /// The forwards in chunk-table pages `[page, page + pages)`: (id, the chunk it forwards
    /// to, its count), the state lock held for [`CHUNK_PAGES_PER_HOLD`] pages at a time.
    fn forward_slots(
        &self,
        page: u64,
        pages: u64,
        problems: &mut Vec<String>,
    ) -> Vec<(u64, u64, u32)> {
        use crate::chunk_table::Slot;
        let mut found = Vec::new();
        let (end, per) = (page + pages, CHUNKS_PER_PAGE as u64);
        let mut from = page;
        while from < end {
            let to = (from + CHUNK_PAGES_PER_HOLD).min(end);
            let mut st = self.lock_state();
            let walked = st.md.pages.for_each_leaf(
                crate::page_cache::CHUNK_TREE,
                from,
                to,
                &mut |pi, data| {
                    for i in 0..CHUNKS_PER_PAGE {
                        if let Some(Slot::Forward { to, refs, .. }) =
                            crate::chunk_table::decode_any(data, i)
                        {
                            found.push((pi * per + i as u64, to, refs));
                        }
                    }
                    Ok(true)
                },
            );
            if let Err(e) = walked {
                problems.push(format!("chunk table pages {from}..{to}: {e}"));
            }
            drop(st);
            from = to;
        }
        found
    }

    /// Every chunk-table slot in use in pages `[page, page + pages)`, with where its record
    /// is, the state lock held for [`CHUNK_PAGES_PER_HOLD`] pages at a time. Problems reading
    /// the table are appended to `problems`.
    pub(crate) fn chunk_window(
        &self,
        page: u64,
        pages: u64,
        problems: &mut Vec<String>,
    ) -> Vec<ChunkToCheck> {
        let mut work = Vec::new();
        let end = page + pages;
        let mut from = page;
        while from < end {
            let to = (from + CHUNK_PAGES_PER_HOLD).min(end);
            if let Err(e) = self.chunk_slots(from, to, &mut work) {
                problems.push(format!("chunk table pages {from}..{to}: {e}"));
            }
            from = to;
        }
        work
    }

    /// [`Pool::chunk_window`]'s pages `[from, to)`, under one hold of the state lock.
    fn chunk_slots(&self, from: u64, to: u64, work: &mut Vec<ChunkToCheck>) -> Result<()> {
        let mut st = self.lock_state();
        let st = &mut *st;
        let segments = &st.segments;
        let md = &mut st.md;
        let per = CHUNKS_PER_PAGE as u64;
        md.pages
            .for_each_leaf(crate::page_cache::CHUNK_TREE, from, to, &mut |pi, data| {
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
            })
    }

    /// Read one chunk and check its record, its decompression and its fingerprint: (record
    /// bytes checked, the problem if any).
    pub(crate) fn check_chunk(&self, w: &ChunkToCheck) -> Checked {
        self.check_chunk_and_bases(w).0
    }

    /// [`Pool::check_chunk`], and the bases a delta's record names (none for another chunk,
    /// or a record that does not open), from the one read of its record.
    fn check_chunk_and_bases(&self, w: &ChunkToCheck) -> (Checked, Vec<u64>) {
        let (id, e) = (w.id, &w.entry);
        let loc = e.loc;
        let buf = match stored_record(w) {
            Ok(b) => b,
            Err(why) => return ((0, Some((id, why))), Vec::new()),
        };
        let what = || {
            format!(
                "chunk {id} in segment {} at offset {}",
                loc.segment, loc.offset
            )
        };
        let rid = crate::format::record_id(id, &loc, self.slot);
        let payload = match open_record(&buf, rid, &loc, self.crypto.as_deref(), Some(&e.fp), what)
        {
            Ok(p) => p,
            Err(err) => return ((0, Some((id, err.to_string()))), Vec::new()),
        };
        let mut out = vec![0u8; self.block_size() as usize];
        let (decoded, bases) = if loc.codec.is_delta() {
            let bases =
                reduction::DeltaPayload::parse(&payload, what).map_or(Vec::new(), |p| p.bases);
            let decoded = self.decode_delta(&payload, &mut out, None, || format!("chunk {id}"));
            (decoded, bases)
        } else {
            let decoded =
                reduction::decompress(loc.codec, &payload, &mut out, || format!("chunk {id}"));
            (decoded, Vec::new())
        };
        if let Err(err) = decoded {
            return ((0, Some((id, err.to_string()))), bases);
        }
        if reduction::fingerprint(&self.sb.key, &out) != e.fp {
            return (
                (
                    0,
                    Some((id, "content does not match its fingerprint".into())),
                ),
                bases,
            );
        }
        ((buf.len() as u64, None), bases)
    }
}

/// The record of `w` as stored: in memory, or read from its segment.
fn stored_record(w: &ChunkToCheck) -> std::result::Result<std::borrow::Cow<'_, [u8]>, String> {
    let loc = w.entry.loc;
    match (w.in_memory.as_deref(), w.file.as_deref()) {
        (Some(m), _) => Ok(std::borrow::Cow::Borrowed(m)),
        (None, None) => Err(format!("segment {} is missing", loc.segment)),
        (None, Some(file)) => {
            let mut b = vec![0u8; loc.record_bytes() as usize];
            file.read_at(&mut b, u64::from(loc.offset)).map_err(|err| {
                format!(
                    "cannot read segment {} at {}: {err}",
                    loc.segment, loc.offset
                )
            })?;
            Ok(std::borrow::Cow::Owned(b))
        }
    }
}

/// Each forward names a chunk with a record (not a forward, not missing); one whose chunk is
/// damaged is damaged too (its blocks read that record).
fn check_forwards(check: &mut ChunkCheck, exists: &[u64]) {
    let bad: HashSet<u64> = check.bad.iter().map(|b| b.0).collect();
    let mut forwards: Vec<(u64, u64)> = check.forwards.iter().map(|(&d, &k)| (d, k)).collect();
    forwards.sort_unstable();
    for (id, to) in forwards {
        let present = exists
            .get((to / 64) as usize)
            .is_some_and(|x| x & (1 << (to % 64)) != 0);
        if !present || check.forwards.contains_key(&to) {
            check.metadata_problems.push(format!(
                "chunk {id} forwards to chunk {to}, which is not a chunk with a record; run condense repair"
            ));
        } else if bad.contains(&to) {
            check.bad.push((
                id,
                format!("forwards to chunk {to}, whose record is damaged"),
            ));
        }
    }
}

/// What `check_chunk` found of one chunk: bytes checked, and what is wrong with it if
/// anything (chunk id, why).
type Checked = (u64, Option<(u64, String)>);

#[cfg(test)]
mod tests {
    use crate::locks::lock;
    use crate::sim::{SimDir, SimHandle};
    use crate::{InitOptions, OpenOptions, Pool};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    const BS: u64 = 4096;
    const PER: u64 = crate::format::MAP_PAGE_ENTRIES as u64;
    /// Leaves of the test volumes: several steps of the map walk.
    const LEAVES: u64 = 4 * crate::verify::LEAVES_PER_STEP + 3;

    fn pool() -> Arc<Pool> {
        let disk = SimDir::new();
        Pool::init(&SimHandle(disk.clone()), &InitOptions::default()).expect("init");
        Pool::open(Arc::new(SimHandle(disk)), OpenOptions::default()).expect("open")
    }

    /// Volume `name` with one block in each of its leaves, leaf `i`'s filled with byte
    /// `fill(i)` (a few values: chunks named by many blocks).
    fn volume(pool: &Pool, name: &str, fill: impl Fn(u64) -> u8) {
        pool.create_volume(name, LEAVES * PER * BS).expect("create");
        let v = pool.volume(name).expect("volume");
        for leaf in 0..LEAVES {
            let block = vec![fill(leaf); BS as usize];
            v.write_at(leaf * PER * BS, &block, false).expect("write");
        }
    }

    fn verify(pool: &Pool) -> crate::verify::VerifyReport {
        pool.verify(&|_, _| {}).expect("verify")
    }

    #[test]
    fn a_wrong_reference_count_is_found_by_the_stepped_walk() {
        let pool = pool();
        volume(&pool, "a", |leaf| (leaf % 5) as u8 + 1);
        let r = verify(&pool);
        assert!(r.is_clean() && r.not_checked.is_empty(), "{r:?}");
        // One chunk's count raised behind the journal's back (no commit: the walk is quiet).
        {
            let mut st = pool.lock_state();
            let md = &mut st.md;
            let mut first = None;
            md.chunks
                .for_each(&mut md.pages, &mut |id, e| {
                    if e.refs > 0 && first.is_none() {
                        first = Some(id);
                    }
                    Ok(())
                })
                .expect("chunk table");
            let id = first.expect("a live chunk");
            md.chunks.incref(&mut md.pages, id).expect("incref");
        }
        let r = verify(&pool);
        assert!(
            r.metadata_problems
                .iter()
                .any(|p| p.starts_with("1 chunks have a wrong reference count")),
            "{r:?}"
        );
    }

    #[test]
    fn a_deleted_volume_being_released_is_walked_and_its_references_counted() {
        let pool = pool();
        volume(&pool, "a", |leaf| (leaf % 7) as u8 + 1);
        volume(&pool, "b", |leaf| (leaf % 3) as u8 + 100);
        // What a background delete leaves: the map as a tree with no volume, its leaves
        // still holding their chunks' references (here: a's tree shared with such a tree,
        // then a deleted, which leaves every page to the other).
        let released = (1u64 << 40) + 7;
        {
            let guard = lock(&pool.sync_lock);
            pool.checkpoint_locked(&guard).expect("checkpoint");
            let vol = *pool.lock_state().md.names.get("a").expect("a");
            let mut st = pool.lock_state();
            st.md
                .pages
                .clone_tree(u64::from(vol), released)
                .expect("clone");
        }
        pool.delete_volume("a").expect("delete");
        let trees = crate::verify::trees_to_walk(&pool.lock_state().md);
        let labels: Vec<_> = trees.iter().map(|t| (t.tree, t.volume.clone())).collect();
        assert!(labels.contains(&(released, None)), "{labels:?}");
        // Counted with it, every chunk's count is right; without it, a's chunks would be
        // named by no block while their counts say otherwise.
        let r = verify(&pool);
        assert!(r.is_clean() && r.not_checked.is_empty(), "{r:?}");
    }

    #[test]
    fn verify_while_writing_never_takes_a_count_that_moved_for_a_wrong_one() {
        let pool = pool();
        volume(&pool, "a", |leaf| (leaf % 5) as u8 + 1);
        volume(&pool, "b", |leaf| (leaf % 5) as u8 + 1);
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let writer = s.spawn(|| {
                let v = pool.volume("a").expect("volume");
                let mut i = 0u64;
                // Blocks all over the map move between the same few chunks (shared with b):
                // counts move ahead of and behind the walk.
                while !stop.load(Ordering::Relaxed) {
                    let leaf = (i * 7) % LEAVES;
                    let block = vec![(i % 5) as u8 + 1; BS as usize];
                    v.write_at(leaf * PER * BS, &block, false).expect("write");
                    i += 1;
                }
                i
            });
            for _ in 0..3 {
                let r = verify(&pool);
                assert!(r.is_clean(), "{r:?}");
            }
            stop.store(true, Ordering::Relaxed);
            assert!(writer.join().expect("writer") > 0);
        });
        // Idle again: the counts are compared.
        let r = verify(&pool);
        assert!(r.is_clean() && r.not_checked.is_empty(), "{r:?}");
    }
}
