//! Garbage collection: reclaim the space of chunks no block refers to any more.
//!
//! Owns: choosing victim segments and moving their live chunks out.
//! Crash safety (DESIGN.md invariant 4): live records are copied verbatim into the open
//! segment and journaled as `Relocate` (chunk ids never change, so block maps are untouched);
//! dead chunks are journaled as `DropChunk`. A checkpoint then makes the new locations durable
//! and empties the journal, and only after that are the victim files deleted. A crash before
//! the checkpoint leaves the old locations valid; after it, the new ones.

use crate::chunk_table::ChunkEntry;
use crate::error::{Error, Result};
use crate::format::{decode_record, JournalRecord, SEGMENT_HEADER_BYTES};
use crate::pool::{lock, Pool};
use std::collections::BTreeMap;

#[derive(Clone, Debug, Default)]
pub struct GcReport {
    pub segments_removed: u64,
    pub chunks_moved: u64,
    pub chunks_dropped: u64,
    pub bytes_before: u64,
    pub bytes_after: u64,
}

impl Pool {
    /// Dead bytes as a share of all segment bytes (0..1), and the dead bytes.
    pub fn dead_space(&self) -> (f64, u64) {
        let st = lock(&self.state);
        let (mut total, mut dead) = (0u64, 0u64);
        for (id, len) in st.segments.ids() {
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
        self.flush()?;
        let guard = lock(&self.sync_lock);
        let mut report = GcReport::default();
        let victims: Vec<u32> = {
            let mut st = lock(&self.state);
            self.writable(&st)?;
            report.bytes_before = st.segments.total_bytes();
            let open = st.segments.open_id();
            let victims: Vec<u32> = st
                .segments
                .ids()
                .filter(|&(id, len)| {
                    let dead = len.saturating_sub(
                        SEGMENT_HEADER_BYTES as u64 + st.md.chunks.segment_live_bytes(id),
                    );
                    Some(id) != open && dead > 0 && dead * 100 >= len * u64::from(min_dead_percent)
                })
                .map(|(id, _)| id)
                .collect();
            if victims.is_empty() {
                report.bytes_after = report.bytes_before;
                return Ok(report);
            }
            // Chunks in victim segments, by segment: (id, entry). A damaged chunk-table page
            // stops GC before anything changes, so no chunk a damaged page may name is dropped.
            let mut by_segment: BTreeMap<u32, Vec<(u64, ChunkEntry)>> = BTreeMap::new();
            let md = &mut st.md;
            md.chunks.for_each(&mut md.cache, &mut |id, e| {
                if victims.contains(&e.loc.segment) {
                    by_segment.entry(e.loc.segment).or_default().push((id, *e));
                }
                Ok(())
            })?;
            let mut records = Vec::new();
            for (seg, chunks) in by_segment {
                let file = st.segments.file(seg).ok_or_else(|| {
                    Error::corrupt("segment store", format!("segment {seg} vanished"))
                })?;
                for (id, e) in chunks {
                    let loc = e.loc;
                    if e.refs == 0 {
                        records.push(JournalRecord::DropChunk { id });
                        report.chunks_dropped += 1;
                        continue;
                    }
                    let mut buf = vec![0u8; loc.record_bytes() as usize];
                    file.read_at(&mut buf, u64::from(loc.offset))
                        .map_err(|err| {
                            Error::io(format!("reading chunk {id} from segment {seg} for GC"), err)
                        })?;
                    decode_record(&buf, id, &loc)?;
                    let new = st.segments.append_raw(&*self.dir, &buf, &loc)?;
                    records.push(JournalRecord::Relocate { id, loc: new });
                    report.chunks_moved += 1;
                }
            }
            st.segments.write_pending()?;
            self.commit(&mut st, records)?;
            victims
        };
        self.checkpoint_locked(&guard)?;
        let mut st = lock(&self.state);
        for id in &victims {
            self.dir
                .remove(&crate::format::segment_name(*id))
                .map_err(|e| Error::io(format!("removing segment {id}"), e))?;
            st.segments.forget(*id);
            report.segments_removed += 1;
        }
        self.dir
            .sync_dir()
            .map_err(|e| Error::io("syncing the pool directory", e))?;
        report.bytes_after = st.segments.total_bytes();
        Ok(report)
    }
}

/// A background thread that runs GC when dead space passes a threshold; stops when dropped.
pub struct BackgroundGc {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BackgroundGc {
    /// Every `interval`, compact segments at least half dead if dead bytes are more than
    /// `dead_percent` of all segment bytes and more than `dead_bytes_min`.
    pub fn start(
        pool: &std::sync::Arc<Pool>,
        interval: std::time::Duration,
        dead_percent: u8,
        dead_bytes_min: u64,
    ) -> BackgroundGc {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let weak = std::sync::Arc::downgrade(pool);
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let tick = std::time::Duration::from_millis(200);
            let mut waited = std::time::Duration::ZERO;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(tick);
                waited += tick;
                if waited < interval {
                    continue;
                }
                waited = std::time::Duration::ZERO;
                let Some(pool) = weak.upgrade() else { return };
                let (ratio, dead) = pool.dead_space();
                if ratio * 100.0 >= f64::from(dead_percent) && dead >= dead_bytes_min {
                    match pool.gc(50) {
                        Ok(r) => tracing::info!(
                            "background gc: removed {} segments, moved {} chunks",
                            r.segments_removed,
                            r.chunks_moved
                        ),
                        Err(e) => tracing::warn!("background gc failed: {e}"),
                    }
                }
            }
        });
        BackgroundGc {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for BackgroundGc {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
