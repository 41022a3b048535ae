//! Garbage collection: reclaim the space of chunks no block refers to any more (a room of the
//! pool; [`crate::gc`] runs it in the background).
//!
//! Owns: choosing victim segments and moving their live chunks out.
//! Crash safety (docs/DESIGN.md invariant 4): live records are copied verbatim into the open
//! segment and journaled as `Relocate` (chunk ids never change, so block maps are untouched);
//! dead chunks are journaled as `DropChunk`. A checkpoint then makes the new locations durable
//! and empties the journal, and only after that are the victim files deleted. A crash before
//! the checkpoint leaves the old locations valid; after it, the new ones.
//!
//! I/O goes on during a GC: every hold of the state lock is bounded, whatever the size of the
//! pool, and followed by a pause while the VMs are busy (`pool::Pacer`), except while writes
//! keep finding the disk low on space: then reclaiming comes first. The chunk table is
//! scanned [`SCAN_PAGES`] pages per hold, victim records are read and checked without the
//! state lock (sealed segments never change), and the state lock is taken only to append a
//! batch of at most [`COPY_BATCH`] copies (and [`DROP_BATCH`] chunks in all) and journal it,
//! re-checking that each chunk is still where it was read (and, for a drop, still
//! unreferenced: a write may have deduplicated against it meanwhile; a chunk referenced again
//! is copied instead).
//! Every [`CHECKPOINT_PAGES`] chunk-table pages dirtied, the GC checkpoints (a checkpoint
//! writes the dirty pages under the state lock: so it stays a bounded hold, and the last one,
//! before the victims go, too); the victims are then deleted one per hold, the directory
//! synced without the state lock. Flushes are not blocked (only one GC runs at a time).

use super::Pool;
use crate::chunk_table::ChunkEntry;
use crate::counters::{add, nanos};
use crate::error::{Error, Result};
use crate::format::{open_record, JournalRecord, Location, CHUNKS_PER_PAGE, SEGMENT_HEADER_BYTES};
use crate::io::File;
use crate::locks::lock;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// Chunk-table pages scanned per hold of the state lock (each hold followed by a pause while
/// the VMs are busy).
const SCAN_PAGES: u64 = 64;
/// A chunk to move: id, its entry when scanned, its segment file, its record if it was live.
type Copy = (u64, ChunkEntry, Arc<dyn File>, Option<Vec<u8>>);

/// Chunks copied or dropped per hold of the state lock (their records appended and a full
/// segment batch written under it: 64 held it 1-3 ms on the 2-core test machine, a VM's
/// request meeting it waiting that long; bench/README.md "admin-stall.sh").
const COPY_BATCH: usize = 16;

/// Chunks per hold of the state lock at most, dead ones included: a drop reads and appends
/// nothing (a journal record and its chunk-table entry), so drops are batched by the
/// thousand (8192 held the lock up to 61 ms, and GC took no less time: bench/README.md
/// "admin-stall.sh", sixth pass).
const DROP_BATCH: usize = 1024;

/// Chunk-table pages a GC dirties (moving or dropping their chunks) before it checkpoints:
/// a checkpoint writes the dirty pages under the state lock, so this bounds that hold
/// (512 pages, 2 MiB) however many chunks move.
const CHECKPOINT_PAGES: usize = 512;

#[derive(Clone, Debug, Default)]
pub struct GcReport {
    pub segments_removed: u64,
    /// Emptied segments kept until every other host sharing the pool let them go.
    pub segments_condemned: u64,
    pub chunks_moved: u64,
    pub chunks_dropped: u64,
    pub bytes_before: u64,
    pub bytes_after: u64,
}

/// The victim segments' files, by segment id.
pub(crate) type VictimFiles = HashMap<u32, Arc<dyn File>>;

impl Pool {
    /// Dead bytes as a share of all segment bytes (0..1), and the dead bytes.
    pub fn dead_space(&self) -> (f64, u64) {
        let st = self.lock_state();
        let (mut total, mut dead) = (0u64, 0u64);
        let condemned = crate::format::hosts::condemned_in(&st.md.meta);
        for (id, len) in st.segments.ids().filter(|(id, _)| !condemned.contains(id)) {
            total += len;
            dead += len
                .saturating_sub(SEGMENT_HEADER_BYTES as u64 + st.md.chunks.segment_live_bytes(id));
        }
        if total == 0 {
            (0.0, 0)
        } else {
            (dead as f64 / total as f64, dead)
        }
    }

    /// Compact every sealed segment whose dead share is at least `min_dead_percent`.
    pub fn gc(&self, min_dead_percent: u8) -> Result<GcReport> {
        let _one_gc = lock(&self.gc_lock);
        let c = &self.counters;
        let started = std::time::Instant::now();
        c.gc_scanned_chunk_ids.store(0, Relaxed);
        c.gc_chunk_ids.store(0, Relaxed);
        c.gc_running.store(1, Relaxed);
        let r = self.gc_locked(min_dead_percent);
        c.gc_running.store(0, Relaxed);
        add(&c.gc_runs, 1);
        add(&c.gc_nanos, nanos(started.elapsed()));
        if let Ok(report) = &r {
            add(&c.gc_chunks_moved, report.chunks_moved);
            add(&c.gc_chunks_dropped, report.chunks_dropped);
            add(&c.gc_segments_removed, report.segments_removed);
            add(
                &c.gc_reclaimed_bytes,
                report.bytes_before.saturating_sub(report.bytes_after),
            );
        }
        r
    }

    /// [`Pool::gc`], the caller holding `gc_lock`.
    fn gc_locked(&self, min_dead_percent: u8) -> Result<GcReport> {
        debug_assert!(self.gc_lock.try_lock().is_err(), "the caller holds gc_lock");
        self.flush()?;
        let mut report = GcReport::default();
        let (victims, next_id) = self.pick_victims(min_dead_percent, &mut report)?;
        if victims.is_empty() {
            report.bytes_after = report.bytes_before;
            return Ok(report);
        }
        let spared = self.move_out(&victims, next_id, &mut report)?;
        // 4. Make the new locations durable, then delete the victims.
        self.remove_victims(&victims, &spared, &mut report)?;
        Ok(report)
    }

    /// Move every chunk of `victims` out of them: live ones copied into the open segment
    /// (`Relocate`), dead ones dropped (`DropChunk`), scanning chunk ids below `next_id`.
    /// Returns the victims holding a live record that failed its check: kept (with the
    /// damaged record where it is, for verify, the scrub and repair), their other chunks
    /// still moved. The caller holds `gc_lock`.
    pub(crate) fn move_out(
        &self,
        victims: &VictimFiles,
        next_id: u64,
        report: &mut GcReport,
    ) -> Result<HashSet<u32>> {
        let per = CHUNKS_PER_PAGE as u64;
        let mut spared: HashSet<u32> = HashSet::new();
        self.counters.gc_chunk_ids.store(next_id, Relaxed);
        let mut page = 0u64;
        // Chunk-table pages dirtied since the last checkpoint.
        let mut dirtied: HashSet<u64> = HashSet::new();
        let mut pacer = super::Pacer::default();
        while page * per < next_id {
            // 1. Chunks of victim segments in a window of the chunk table.
            self.pace_gc(&mut pacer);
            let found = self.victim_chunks(victims, page)?;
            page += SCAN_PAGES;
            self.counters
                .gc_scanned_chunk_ids
                .store((page * per).min(next_id), Relaxed);
            // 2. Read and check the live ones without the state lock; 3. commit in batches.
            for batch in hold_batches(&found) {
                let copies = self.read_batch(batch, victims, &mut spared)?;
                self.pace_gc(&mut pacer);
                self.commit_copies(copies, report)?;
                dirtied.extend(batch.iter().map(|(id, _)| id / per));
                if dirtied.len() >= CHECKPOINT_PAGES {
                    // Keeps the last checkpoint's hold of the state lock short.
                    self.checkpoint_locked(&lock(&self.sync_lock))?;
                    dirtied.clear();
                }
            }
        }
        Ok(spared)
    }

    /// The pause before GC's next hold of the state lock (`pool::Pacer`: none on an idle pool,
    /// longer while the VMs are busy), skipped while writes keep finding the disk low on space
    /// (they mark it again every 16 MiB written; [`Pool::take_space_low`]).
    fn pace_gc(&self, pacer: &mut super::Pacer) {
        if self.space_low.load(Relaxed) {
            *pacer = super::Pacer::default();
        } else {
            pacer.step();
        }
    }

    /// The sealed segments with at least `min_dead_percent` dead bytes, with their files, and
    /// the chunk table's next id; sets `report.bytes_before`.
    fn pick_victims(
        &self,
        min_dead_percent: u8,
        report: &mut GcReport,
    ) -> Result<(VictimFiles, u64)> {
        let mut st = self.lock_state();
        self.writable(&st)?;
        st.segments.reap();
        report.bytes_before = st.segments.total_bytes();
        let open = st.segments.open_id();
        // Condemned segments wait for the other hosts sharing the pool (crate::hosts).
        let condemned = crate::format::hosts::condemned_in(&st.md.meta);
        // Victims with their files: sealed, so they can be read without the lock.
        let victims: HashMap<u32, Arc<dyn File>> = st
            .segments
            .ids()
            .filter(|&(id, len)| {
                let dead = len.saturating_sub(
                    SEGMENT_HEADER_BYTES as u64 + st.md.chunks.segment_live_bytes(id),
                );
                // A sealed segment whose last batches are still being written: its
                // records are not all in the file yet (victims are read from the file).
                Some(id) != open
                    && !condemned.contains(&id)
                    && !st.segments.is_writing(id)
                    && dead > 0
                    && dead * 100 >= len * u64::from(min_dead_percent)
            })
            .filter_map(|(id, _)| st.segments.file(id).map(|f| (id, f)))
            .collect();
        Ok((victims, st.md.chunks.next_id))
    }

    /// The chunks of victim segments in chunk-table pages `[page, page + SCAN_PAGES)`.
    fn victim_chunks(
        &self,
        victims: &HashMap<u32, Arc<dyn File>>,
        page: u64,
    ) -> Result<Vec<(u64, ChunkEntry)>> {
        let mut found: Vec<(u64, ChunkEntry)> = Vec::new();
        let mut st = self.lock_state();
        let md = &mut st.md;
        md.chunks
            .for_each_in(&mut md.pages, page, page + SCAN_PAGES, &mut |id, e| {
                if victims.contains_key(&e.loc.segment) {
                    found.push((id, *e));
                }
                Ok(())
            })?;
        Ok(found)
    }

    /// Read and check the live records of `batch` without the state lock: the copies to
    /// commit. A victim with a damaged live record goes into `spared`.
    fn read_batch(
        &self,
        batch: &[(u64, ChunkEntry)],
        victims: &HashMap<u32, Arc<dyn File>>,
        spared: &mut HashSet<u32>,
    ) -> Result<Vec<Copy>> {
        let mut copies = Vec::with_capacity(batch.len());
        for (id, e) in batch {
            debug_assert!(victims.contains_key(&e.loc.segment));
            let Some(file) = victims.get(&e.loc.segment).cloned() else {
                continue; // found only chunks of victims
            };
            // A dead delta is read too: its record names the bases whose references it holds.
            let buf = if e.refs > 0 || e.loc.codec.is_delta() {
                match read_record(&*file, *id, e, self.crypto.as_deref(), self.slot) {
                    Ok(b) => Some(b),
                    Err(err) if err.is_damage() => {
                        tracing::warn!(
                            "gc: {err}; segment {} is kept (`condense verify` names the blocks, `condense repair` salvages them)",
                            e.loc.segment
                        );
                        spared.insert(e.loc.segment);
                        continue;
                    }
                    Err(err) => return Err(err),
                }
            } else {
                None
            };
            copies.push((*id, *e, file, buf));
        }
        Ok(copies)
    }

    /// Checkpoint, so the moved chunks' new locations are durable, then delete the victims
    /// not spared and sync the directories; sets `report.bytes_after`.
    fn remove_victims(
        &self,
        victims: &HashMap<u32, Arc<dyn File>>,
        spared: &HashSet<u32>,
        report: &mut GcReport,
    ) -> Result<()> {
        let guard = lock(&self.sync_lock);
        self.checkpoint_locked(&guard)?;
        let gone: Vec<u32> = victims
            .keys()
            .filter(|id| !spared.contains(id))
            .copied()
            .collect();
        // In a pool other hosts share, their chunks may name these records: condemned, and
        // deleted once every host let them go (crate::hosts).
        if self.condemn(&gone, &guard)? {
            drop(guard);
            report.segments_condemned += gone.len() as u64;
            report.bytes_after = self.lock_state().segments.total_bytes();
            return Ok(());
        }
        // One file per hold of the state lock; the directory synced without it.
        for id in gone {
            self.lock_state().segments.remove(&*self.dir, id)?;
            report.segments_removed += 1;
        }
        self.dir
            .sync_dir()
            .map_err(|e| Error::io("syncing the pool directory", e))?;
        drop(guard);
        report.bytes_after = self.lock_state().segments.total_bytes();
        Ok(())
    }

    /// Write chunk `id`'s record again from `record` (a valid copy, e.g. the cache tier's, of
    /// a record damaged at `was`), journaled as a move; false if the chunk moved or went since.
    /// The caller holds the GC lock.
    pub(crate) fn rewrite_chunk(&self, id: u64, was: &Location, record: &[u8]) -> Result<bool> {
        let mut st = self.lock_state();
        self.writable(&st)?;
        let md = &mut st.md;
        match md.chunks.get(&mut md.pages, id)? {
            Some(now) if now.loc == *was && now.refs > 0 => {}
            _ => return Ok(false),
        }
        let new = st.segments.append_raw(&*self.dir, record, was)?;
        self.commit(&mut st, vec![JournalRecord::Relocate { id, loc: new }])?;
        st.segments.write_full_batch()?;
        Ok(true)
    }

    /// Append the copies read outside the lock and journal them, re-checking each chunk.
    /// The segment writer's queue is waited for first, without the lock: with a cache tier
    /// on a busy disk, appending to a full queue under the lock held every VM ~100-200 ms.
    fn commit_copies(&self, copies: Vec<Copy>, report: &mut GcReport) -> Result<()> {
        let queued = self.lock_state().segments.queued_wait();
        if let Some(w) = queued {
            w.wait();
        }
        let mut st = self.lock_state();
        self.writable(&st)?;
        let mut records = Vec::new();
        for (id, was, file, buf) in copies {
            let md = &mut st.md;
            let Some(now) = md.chunks.get(&mut md.pages, id)? else {
                continue;
            };
            if now.loc != was.loc {
                continue;
            }
            if now.refs == 0 && now.loc.codec.is_delta() {
                let buf = match buf {
                    Some(b) => b,
                    None => read_record(&*file, id, &now, self.crypto.as_deref(), self.slot)?,
                };
                let bases = self.delta_bases_of(id, (&now.loc, &now.fp), &buf)?;
                records.push(JournalRecord::DropDelta { id, bases });
                report.chunks_dropped += 1;
                continue;
            }
            if now.refs == 0 {
                records.push(JournalRecord::DropChunk { id });
                report.chunks_dropped += 1;
                continue;
            }
            // Referenced again since the scan (deduplicated against): read it now.
            let buf = match buf {
                Some(b) => b,
                None => read_record(&*file, id, &now, self.crypto.as_deref(), self.slot)?,
            };
            let mut buf = buf;
            if st.segments.is_foreign(now.loc.segment) {
                // Another host's record, copied into this host's segment: it carries our id.
                crate::format::reown_record(&mut buf, id);
            }
            let new = st.segments.append_raw(&*self.dir, &buf, &now.loc)?;
            records.push(JournalRecord::Relocate { id, loc: new });
            report.chunks_moved += 1;
        }
        if records.is_empty() {
            return Ok(());
        }
        self.commit(&mut st, records)?;
        st.segments.write_full_batch()
    }
}

/// Read chunk `id`'s record from its (sealed) segment and check it.
fn read_record(
    file: &dyn File,
    id: u64,
    e: &ChunkEntry,
    crypto: Option<&crate::crypto::Crypto>,
    slot: u8,
) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; e.loc.record_bytes() as usize];
    file.read_at(&mut buf, u64::from(e.loc.offset))
        .map_err(|err| {
            Error::io(
                format!("reading chunk {id} from segment {} for GC", e.loc.segment),
                err,
            )
        })?;
    let rid = crate::format::record_id(id, &e.loc, slot);
    open_record(&buf, rid, &e.loc, crypto, Some(&e.fp), || {
        format!(
            "chunk {id} in segment {} at offset {}",
            e.loc.segment, e.loc.offset
        )
    })?;
    Ok(buf)
}

/// `found` cut into the batches of one hold each: at most [`COPY_BATCH`] chunks whose record
/// is read and copied (live ones, and dead deltas, whose record names their bases), at most
/// [`DROP_BATCH`] chunks in all.
fn hold_batches(found: &[(u64, ChunkEntry)]) -> Vec<&[(u64, ChunkEntry)]> {
    let (mut batches, mut start, mut copies) = (Vec::new(), 0, 0);
    for (i, (_, e)) in found.iter().enumerate() {
        let copy = e.refs > 0 || e.loc.codec.is_delta();
        if i - start == DROP_BATCH || (copy && copies == COPY_BATCH) {
            batches.push(&found[start..i]);
            (start, copies) = (i, 0);
        }
        copies += usize::from(copy);
    }
    if start < found.len() {
        batches.push(&found[start..]);
    }
    batches
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::ChunkCodec;

    #[test]
    fn a_hold_takes_at_most_copy_batch_copies_and_drop_batch_chunks() {
        let entry = |refs| ChunkEntry {
            fp: [0; 16],
            loc: Location {
                segment: 1,
                offset: 0,
                stored_len: 1,
                codec: ChunkCodec::Lz4,
            },
            refs,
        };
        // 2.5 DROP_BATCH dead chunks, then 40 live ones, then 10 dead ones.
        let dead = (DROP_BATCH * 5 / 2) as u64;
        let found: Vec<(u64, ChunkEntry)> = (0..dead + 50)
            .map(|id| (id, entry(u32::from((dead..dead + 40).contains(&id)))))
            .collect();
        let batches = hold_batches(&found);
        let lens: Vec<usize> = batches.iter().map(|b| b.len()).collect();
        // Whole batches of drops until a 17th copy would join: the half batch of drops and 16
        // copies, 16 copies, then the last 8 copies with the 10 drops after them.
        let half = DROP_BATCH / 2;
        assert_eq!(lens, [DROP_BATCH, DROP_BATCH, half + 16, 16, 18]);
        assert_eq!(batches.concat(), found);
    }
}
