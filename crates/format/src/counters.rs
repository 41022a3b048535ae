//! Activity counters of an open pool, for monitoring: journal appends and syncs, flushes,
//! checkpoints, garbage collection.
//!
//! Owns: [`Counters`], a set of `AtomicU64`s inside the engine's `Pool`, bumped with
//! relaxed ordering where the work happens (most under locks the code holds anyway), and
//! [`CounterValues`], the plain copy `Pool::counters` returns. Plain atomics and their copy, so
//! they live with the other counters (`volume_counters`) in condense-format.
//! Invariants: the counters start at zero when the pool is opened and only go up, except the
//! GC progress pair and `gc_running`, which describe the current (or last) collection.
//! Figures about space (savings, dead bytes) are not here: they come from
//! `Pool::stats`, computed from the metadata's own counters.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The live counters (see the module docs).
#[derive(Debug, Default)]
pub struct Counters {
    pub journal_records: AtomicU64,
    pub flushes: AtomicU64,
    pub flush_nanos: AtomicU64,
    pub journal_syncs: AtomicU64,
    pub journal_sync_nanos: AtomicU64,
    pub checkpoints: AtomicU64,
    pub checkpoint_nanos: AtomicU64,
    pub checkpoint_last_nanos: AtomicU64,
    pub gc_runs: AtomicU64,
    pub gc_nanos: AtomicU64,
    pub gc_running: AtomicU64,
    pub gc_scanned_chunk_ids: AtomicU64,
    pub gc_chunk_ids: AtomicU64,
    pub gc_chunks_moved: AtomicU64,
    pub gc_chunks_dropped: AtomicU64,
    pub gc_segments_removed: AtomicU64,
    pub gc_reclaimed_bytes: AtomicU64,
    /// Segments copied from a writeback cache to the pool directory, and their bytes.
    pub destaged_segments: AtomicU64,
    pub destaged_bytes: AtomicU64,
}

pub fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

pub fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// A copy of the counters at one instant. Durations are totals since the pool was opened.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CounterValues {
    /// Metadata records appended to the journal.
    pub journal_records: u64,
    /// Flushes that had something to make durable (segments, directory, journal synced).
    pub flushes: u64,
    pub flush_time: Duration,
    /// Journal fsyncs made by flushes, and the time they took (a part of `flush_time`).
    pub journal_syncs: u64,
    pub journal_sync_time: Duration,
    /// Checkpoints written, their total time and the last one's.
    pub checkpoints: u64,
    pub checkpoint_time: Duration,
    pub checkpoint_last_time: Duration,
    /// Garbage collections finished or failed (not counting ones that found nothing to do
    /// as any different), and their total time.
    pub gc_runs: u64,
    pub gc_time: Duration,
    /// Whether a garbage collection is running now.
    pub gc_running: bool,
    /// Progress of the current or last GC: chunk ids scanned of those to scan.
    pub gc_scanned_chunk_ids: u64,
    pub gc_chunk_ids: u64,
    pub gc_chunks_moved: u64,
    pub gc_chunks_dropped: u64,
    pub gc_segments_removed: u64,
    /// Segment bytes given back by GC (bytes before minus bytes after each run).
    pub gc_reclaimed_bytes: u64,
}

impl Counters {
    pub fn values(&self) -> CounterValues {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let time = |c: &AtomicU64| Duration::from_nanos(get(c));
        CounterValues {
            journal_records: get(&self.journal_records),
            flushes: get(&self.flushes),
            flush_time: time(&self.flush_nanos),
            journal_syncs: get(&self.journal_syncs),
            journal_sync_time: time(&self.journal_sync_nanos),
            checkpoints: get(&self.checkpoints),
            checkpoint_time: time(&self.checkpoint_nanos),
            checkpoint_last_time: time(&self.checkpoint_last_nanos),
            gc_runs: get(&self.gc_runs),
            gc_time: time(&self.gc_nanos),
            gc_running: get(&self.gc_running) > 0,
            gc_scanned_chunk_ids: get(&self.gc_scanned_chunk_ids),
            gc_chunk_ids: get(&self.gc_chunk_ids),
            gc_chunks_moved: get(&self.gc_chunks_moved),
            gc_chunks_dropped: get(&self.gc_chunks_dropped),
            gc_segments_removed: get(&self.gc_segments_removed),
            gc_reclaimed_bytes: get(&self.gc_reclaimed_bytes),
        }
    }
}
