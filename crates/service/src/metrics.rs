//! `--metrics-listen HOST:PORT` on `serve` and `mount`: a Prometheus endpoint
//! (`http://HOST:PORT/metrics`) for the daemon's pool and frontend.
//!
//! Owns: the daemon's [`Registry`] and its [`MetricsServer`], and the collector that turns
//! the engine's figures into metrics at scrape time: space from [`Pool::stats`] (counters,
//! no map walk; the pool directory's size as `du -sb` measures it), activity from
//! [`Pool::counters`]. The frontends (`condense-nbd`, `condense-fuse`) register their own
//! counters. Every metric is listed in docs/METRICS.md.
//! Invariant: the collector holds the pool weakly, so the endpoint never keeps a closed pool
//! alive; after the pool is gone, a scrape shows the frontend's metrics only.

use crate::error::{Context, Result};
use condense_engine::hosts::SharedPool;
use condense_engine::Pool;
use condense_metrics::{Collect, Encoder, HistogramSnapshot, Kind, MetricsServer, Registry};
use std::sync::{Arc, Weak};

/// A running endpoint.
pub struct Endpoint {
    registry: Arc<Registry>,
    server: MetricsServer,
}

impl Endpoint {
    /// If `addr` is given, listen on it and serve the pool's metrics; `who` names the command
    /// in messages ("serve", "mount").
    pub fn start(addr: Option<&str>, pool: &Arc<Pool>, who: &str) -> Result<Option<Endpoint>> {
        let Some(addr) = addr else {
            return Ok(None);
        };
        raise_open_files_limit();
        let registry = Arc::new(Registry::default());
        registry.register(Arc::new(PoolCollector(Arc::downgrade(pool))));
        let server = MetricsServer::start(addr, registry.clone())
            .with_context(|| format!("--metrics-listen {addr:?}"))?;
        let ep = Endpoint { registry, server };
        eprintln!(
            "condense {who}: Prometheus metrics at http://{}/metrics",
            ep.addr()
        );
        Ok(Some(ep))
    }

    /// Add a frontend's metrics to every scrape from now on.
    pub fn register(&self, c: Arc<dyn Collect>) {
        self.registry.register(c);
    }

    /// The address bound.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.server.local_addr()
    }
}

/// Raise the open-files limit's soft value to the hard one (as far as the system lets an
/// unprivileged process), so that the endpoint's connection cap, a share of it, holds a
/// flood of slow clients (docs/METRICS.md). A failure leaves the limit, and a smaller cap.
fn raise_open_files_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return;
    };
    if soft < hard {
        if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            tracing::warn!("cannot raise the open-files limit from {soft} to {hard}: {e}");
        }
    }
}

/// The engine's figures, read at scrape time.
struct PoolCollector(Weak<Pool>);

impl Collect for PoolCollector {
    fn collect(&self, e: &mut Encoder) {
        if e.family(
            "condense_build_info",
            "Always 1; the version label says which Condense answers.",
            Kind::Gauge,
        ) {
            e.sample(
                "condense_build_info",
                &[("version", env!("CARGO_PKG_VERSION"))],
                1.0,
            );
        }
        let Some(pool) = self.0.upgrade() else {
            return;
        };
        collect_pool(&pool, e);
    }
}

/// The cache tier's figures (only while a cache is attached; counters since it was attached).
fn collect_cache(c: &condense_engine::CacheStats, e: &mut Encoder) {
    let counters: [(&str, &str, u64); 7] = [
        ("condense_cache_hits_total", "Chunk reads served from the cache tier.", c.hits),
        ("condense_cache_misses_total", "Chunk reads served from the segments while a cache tier was attached.", c.misses),
        ("condense_cache_hit_bytes_total", "Block bytes served from the cache tier.", c.hit_bytes),
        ("condense_cache_miss_bytes_total", "Block bytes read from the segments while a cache tier was attached.", c.miss_bytes),
        ("condense_cache_promotions_total", "Chunk records admitted into the cache tier.", c.promotions),
        ("condense_cache_demotions_total", "Chunk records evicted from the cache tier.", c.demotions),
        ("condense_cache_corrupt_entries_total", "Cache entries that failed their checks (dropped; the chunk was read from the segments).", c.corrupt),
    ];
    for (name, help, v) in counters {
        e.counter(name, help, v);
    }
    let gauges: [(&str, &str, u64); 3] = [
        (
            "condense_cache_size_bytes",
            "Configured size of the cache tier.",
            c.size_bytes,
        ),
        (
            "condense_cache_used_bytes",
            "Bytes of cache slots in use.",
            c.used_bytes,
        ),
        (
            "condense_cache_dirty_bytes",
            "Bytes in the cache not yet in the pool (0 in writethrough mode).",
            c.dirty_bytes,
        ),
    ];
    for (name, help, v) in gauges {
        e.gauge(name, help, v as f64);
    }
}

/// The pool's figures: activity from its counters, then space from its statistics.
fn collect_pool(pool: &Pool, e: &mut Encoder) {
    let c = pool.counters();
    collect_activity(&c, e);
    collect_gc(&c, e);
    if let Some(cs) = pool.cache_stats() {
        collect_cache(&cs, e);
    }

    let s = match pool.stats() {
        Ok(s) => s,
        Err(err) => {
            tracing::warn!("metrics: cannot read the pool's statistics: {err}");
            return;
        }
    };
    collect_space(&s, e);
    collect_index(&s, e);
    collect_volumes(&s, e);
    collect_volume_io(&pool.volume_io(), e);
    let (unfinished, conflicts) = pool.hand_over_counts();
    e.gauge(
        "condense_hosts_hand_overs_unfinished",
        "Volume hand-overs between hosts of a shared pool not finished here (half made, or handed over and still here).",
        unfinished as f64,
    );
    e.gauge(
        "condense_hosts_name_conflicts",
        "Volume names this host holds that another host's part holds too and the claim rule gave to that host: their writes are refused here.",
        conflicts as f64,
    );
}

/// Upper bounds of the per-volume latency histograms: every other power of two microseconds,
/// 32 µs to ~2.1 s, so each is the end of one of the engine's log2 buckets
/// (`condense_engine::volume_counters::Latency`) and the counts below it are exact.
const VOLUME_LATENCY_LOG2_US: [usize; 9] = [5, 7, 9, 11, 13, 15, 17, 19, 21];

/// One operation kind's histogram in Prometheus' form: the engine's bucket `i` holds
/// `[2^(i-1), 2^i)` µs, so the cumulative count through bucket `i` is `le = 2^i` µs.
fn latency_histogram(v: &condense_engine::OpValues) -> HistogramSnapshot {
    let buckets = VOLUME_LATENCY_LOG2_US
        .iter()
        .map(|&i| {
            let below: u64 = v.latency.iter().take(i + 1).sum();
            ((1u64 << i) as f64 / 1e6, below)
        })
        .collect();
    HistogramSnapshot {
        buckets,
        count: v.ops,
        sum: v.time_us as f64 / 1e6,
    }
}

/// Per-volume I/O since the pool was opened: what `condense top` shows, as counters for
/// Prometheus' `rate()`. Hidden names (FUSE file contents) are left out, as in
/// [`collect_volumes`]; a snapshot appears once something opened it.
fn collect_volume_io(io: &[(String, condense_engine::VolumeIoValues)], e: &mut Encoder) {
    let io: Vec<_> = io.iter().filter(|(n, _)| !n.starts_with('.')).collect();
    type Op = fn(&condense_engine::VolumeIoValues) -> &condense_engine::OpValues;
    let ops: [(&str, Op); 3] = [
        ("read", |v| &v.read),
        ("write", |v| &v.write),
        ("zero", |v| &v.zero),
    ];
    let name = "condense_volume_io_duration_seconds";
    if e.family(
        name,
        "A volume's reads, writes and zeroing (write-zeroes, trim) by how long each took, \
         as the engine saw them.",
        Kind::Histogram,
    ) {
        for (vol, v) in &io {
            for (op, get) in ops {
                e.histogram(
                    name,
                    &[("volume", vol), ("op", op)],
                    &latency_histogram(get(v)),
                );
            }
        }
    }
    let name = "condense_volume_io_bytes_total";
    if e.family(
        name,
        "Bytes a volume's reads, writes and zeroing covered.",
        Kind::Counter,
    ) {
        for (vol, v) in &io {
            for (op, get) in ops {
                e.sample(name, &[("volume", vol), ("op", op)], get(v).bytes as f64);
            }
        }
    }
    let name = "condense_volume_io_errors_total";
    if e.family(name, "A volume's operations that failed.", Kind::Counter) {
        for (vol, v) in &io {
            e.sample(name, &[("volume", vol)], v.errors as f64);
        }
    }
    type Blocks = fn(&condense_engine::VolumeIoValues) -> u64;
    let kinds: [(&str, Blocks); 3] = [
        ("zero", |v| v.zero_blocks),
        ("dedup", |v| v.dedup_blocks),
        ("new", |v| v.new_blocks),
    ];
    let name = "condense_volume_blocks_written_total";
    if e.family(
        name,
        "Blocks written to a volume, by what the write path did: all zeros (no chunk), \
         deduplicated against a chunk the pool held, or stored as a new chunk.",
        Kind::Counter,
    ) {
        for (vol, v) in &io {
            for (kind, get) in kinds {
                e.sample(name, &[("volume", vol), ("kind", kind)], get(v) as f64);
            }
        }
    }
    let name = "condense_volume_new_stored_bytes_total";
    if e.family(
        name,
        "Bytes of a volume's new chunks as stored (compressed, sealed when encrypted).",
        Kind::Counter,
    ) {
        for (vol, v) in &io {
            e.sample(name, &[("volume", vol)], v.new_stored_bytes as f64);
        }
    }
    let name = "condense_volume_cache_reads_total";
    if e.family(
        name,
        "Chunks of a volume's reads found in (hit) or missing from (miss) the cache tier.",
        Kind::Counter,
    ) {
        for (vol, v) in &io {
            e.sample(
                name,
                &[("volume", vol), ("result", "hit")],
                v.cache_hits as f64,
            );
            e.sample(
                name,
                &[("volume", vol), ("result", "miss")],
                v.cache_misses as f64,
            );
        }
    }
}

/// A duration as Prometheus seconds.
fn seconds(d: std::time::Duration) -> f64 {
    d.as_secs_f64()
}

/// Journal records, and the flushes, journal syncs and checkpoints with their times.
fn collect_activity(c: &condense_engine::CounterValues, e: &mut Encoder) {
    e.counter(
        "condense_journal_records_total",
        "Metadata records appended to the journal.",
        c.journal_records,
    );
    if e.family(
        "condense_flush_duration_seconds",
        "Flushes that made writes durable (segments, directory and journal synced) and their \
         total time.",
        Kind::Summary,
    ) {
        e.summary(
            "condense_flush_duration_seconds",
            &[],
            seconds(c.flush_time),
            c.flushes,
        );
    }
    if e.family(
        "condense_journal_sync_duration_seconds",
        "Journal fsyncs made by flushes and their total time.",
        Kind::Summary,
    ) {
        e.summary(
            "condense_journal_sync_duration_seconds",
            &[],
            seconds(c.journal_sync_time),
            c.journal_syncs,
        );
    }
    if e.family(
        "condense_checkpoint_duration_seconds",
        "Checkpoints written and their total time.",
        Kind::Summary,
    ) {
        e.summary(
            "condense_checkpoint_duration_seconds",
            &[],
            seconds(c.checkpoint_time),
            c.checkpoints,
        );
    }
    e.gauge(
        "condense_checkpoint_last_duration_seconds",
        "How long the last checkpoint took.",
        seconds(c.checkpoint_last_time),
    );
}

/// Garbage collection: its runs and time, whether one runs, its progress and what it freed.
fn collect_gc(c: &condense_engine::CounterValues, e: &mut Encoder) {
    if e.family(
        "condense_gc_duration_seconds",
        "Garbage collections run (_count) and their total time.",
        Kind::Summary,
    ) {
        e.summary(
            "condense_gc_duration_seconds",
            &[],
            seconds(c.gc_time),
            c.gc_runs,
        );
    }
    e.gauge(
        "condense_gc_running",
        "1 while a garbage collection runs, else 0.",
        if c.gc_running { 1.0 } else { 0.0 },
    );
    let progress = if c.gc_chunk_ids > 0 {
        c.gc_scanned_chunk_ids as f64 / c.gc_chunk_ids as f64
    } else if c.gc_running {
        0.0
    } else {
        1.0
    };
    e.gauge(
        "condense_gc_progress_ratio",
        "Share of the chunk table the current (or last) garbage collection has scanned, 0 to 1.",
        progress,
    );
    e.counter(
        "condense_gc_reclaimed_bytes_total",
        "Segment bytes given back to the file system by garbage collection.",
        c.gc_reclaimed_bytes,
    );
    e.counter(
        "condense_gc_chunks_moved_total",
        "Live chunks copied out of compacted segments.",
        c.gc_chunks_moved,
    );
    e.counter(
        "condense_gc_chunks_dropped_total",
        "Unreferenced chunks dropped by garbage collection.",
        c.gc_chunks_dropped,
    );
    e.counter(
        "condense_gc_segments_removed_total",
        "Segments deleted by garbage collection.",
        c.gc_segments_removed,
    );
}

/// The dedup index: its mode, budget, RAM, entries and (sparse) what its lookups found.
fn collect_index(s: &condense_engine::PoolStats, e: &mut Encoder) {
    let gauges: [(&str, &str, f64); 5] = [
        (
            "condense_pool_dedup_index_sparse",
            "1 if the dedup index is sparse (a RAM budget), 0 if dense.",
            f64::from(u8::from(s.dedup_index_mode == "sparse")),
        ),
        (
            "condense_pool_dedup_index_budget_bytes",
            "The sparse dedup index's RAM budget (--index-memory; 0 for dense).",
            s.dedup_index_budget_bytes as f64,
        ),
        (
            "condense_pool_dedup_index_bytes",
            "RAM held by the dedup index alone.",
            s.dedup_index_bytes as f64,
        ),
        (
            "condense_pool_dedup_index_entries",
            "Entries of the dedup index: chunks (dense) or hooks (sparse); 0 until built.",
            s.dedup_index_entries as f64,
        ),
        (
            "condense_pool_sketch_index_bytes",
            "RAM of the sketch index of delta compression (a fixed table; 0 when off).",
            s.delta.sketch_index_bytes as f64,
        ),
    ];
    for (name, help, v) in gauges {
        e.gauge(name, help, v);
    }
    let counters: [(&str, &str, u64); 8] = [
        ("condense_pool_dedup_index_lookups_total", "Sparse index lookups since open (0 for dense).", s.dedup_index_lookups),
        ("condense_pool_dedup_index_cache_hits_total", "Sparse lookups its locality cache answered.", s.dedup_index_cache_hits),
        ("condense_pool_dedup_index_hook_hits_total", "Sparse lookups a hook answered (its neighbourhood then loaded).", s.dedup_index_hook_hits),
        ("condense_pool_dedup_index_misses_total", "Sparse lookups that found nothing: new data, or a duplicate out of its sight (which, is unknown inline).", s.dedup_index_misses),
        ("condense_pool_dedup_index_hooks_dropped_total", "Hooks the sparse index dropped (the oldest) to stay within its budget.", s.dedup_index_hooks_dropped),
        ("condense_pool_dedup_merged_chunks_total", "Chunks the merge pass merged into an older copy of their data, over the pool's life.", s.dedup_merged_chunks),
        ("condense_pool_delta_chunks_total", "Delta records written (blocks stored against similar stored blocks), over the pool's life.", s.delta.chunks_written),
        ("condense_pool_delta_saved_bytes_total", "Payload bytes delta records saved against the blocks stored alone, since open.", s.delta.saved_bytes_since_open),
    ];
    for (name, help, v) in counters {
        e.counter(name, help, v);
    }
}

/// Space: the pool's sizes, savings, segments, read errors, scrub and metadata cache.
fn collect_space(s: &condense_engine::PoolStats, e: &mut Encoder) {
    let gauges: [(&str, &str, f64); 16] = [
        ("condense_pool_block_size_bytes", "The pool's block size.", f64::from(s.block_size)),
        ("condense_pool_logical_bytes", "Sum of the volumes' sizes (what clients see).", s.logical_bytes as f64),
        ("condense_pool_written_bytes", "Bytes of volume blocks that hold data (not zero, not unmapped).", s.written_bytes as f64),
        ("condense_pool_zero_bytes", "Bytes of volume blocks written as zeros (stored as nothing).", s.zero_bytes as f64),
        ("condense_pool_physical_bytes", "Bytes the pool directory takes on disk (data and metadata, as du -sb).", s.physical_bytes as f64),
        ("condense_pool_saved_bytes", "written_bytes minus physical_bytes (0 if negative).", s.written_bytes.saturating_sub(s.physical_bytes) as f64),
        ("condense_pool_savings_ratio", "1 - physical_bytes / written_bytes (0 when nothing is written; negative while metadata outweighs savings).", s.saving_percent / 100.0),
        ("condense_pool_dedup_savings_ratio", "1 - unique chunk bytes / written_bytes.", s.dedup_saving_percent / 100.0),
        ("condense_pool_compression_savings_ratio", "1 - stored payload bytes / unique chunk bytes.", s.compression_saving_percent / 100.0),
        ("condense_pool_data_bytes", "Bytes of segment files (chunk records, live and dead).", s.data_bytes as f64),
        ("condense_pool_metadata_bytes", "Bytes of everything else in the pool directory (metadata pages, journal, checkpoint).", s.metadata_bytes as f64),
        ("condense_pool_dead_bytes", "Segment bytes no block refers to any more (what garbage collection can reclaim).", s.dead_bytes as f64),
        ("condense_pool_unique_chunks", "Chunks stored once each (after deduplication).", s.unique_chunks as f64),
        ("condense_pool_index_ram_bytes", "RAM held by the dedup index and the metadata page cache.", s.index_ram_bytes as f64),
        ("condense_pool_figures_ram_bytes", "RAM held by the exact per-volume figures (0 until first counted).", s.attribution_ram_bytes as f64),
        ("condense_pool_figures_scratch_bytes", "Disk held by the per-volume figures' pages past their RAM budget (a nameless scratch file: df counts it, du does not).", s.attribution_scratch_bytes as f64),
    ];
    for (name, help, v) in gauges {
        e.gauge(name, help, v);
    }
    e.gauge(
        "condense_pool_segments",
        "Segment files.",
        s.segments as f64,
    );
    e.gauge(
        "condense_pool_releasing_blocks",
        "Data blocks deleted volumes' maps still hold while they are released in the background.",
        s.releasing.iter().map(|r| r.blocks_left).sum::<u64>() as f64,
    );
    e.gauge(
        "condense_pool_releasing_bytes",
        "Record bytes of chunks only maps being released still hold (0 without the per-volume figures).",
        s.releasing_bytes as f64,
    );
    e.counter(
        "condense_pool_read_errors_total",
        "Reads that failed a checksum or could not read their bytes (the client got an I/O error).",
        s.read_errors,
    );
    scrub_metrics(e, &s.scrub);
    e.counter(
        "condense_metadata_cache_hits_total",
        "Metadata page lookups answered from the page cache.",
        s.metadata_cache_hits,
    );
    e.counter(
        "condense_metadata_cache_misses_total",
        "Metadata page lookups that read meta.dat.",
        s.metadata_cache_misses,
    );
}

/// One sample per visible volume for each per-volume figure.
fn collect_volumes(s: &condense_engine::PoolStats, e: &mut Encoder) {
    // One sample per volume the clients see: hidden volumes (file contents under the FUSE
    // files/ tree) and snapshots are left out, so the label set stays as small as the
    // administrator's list of volumes.
    let volumes: Vec<_> = s
        .volumes
        .iter()
        .filter(|v| !v.name.starts_with('.'))
        .collect();
    type Field = fn(&condense_engine::VolumeStats) -> Option<f64>;
    let per_volume: [(&str, &str, Field); 9] = [
        ("condense_volume_logical_bytes", "A volume's size.", |v| {
            Some(v.logical_bytes as f64)
        }),
        (
            "condense_volume_written_bytes",
            "Bytes of a volume's blocks that hold data.",
            |v| Some(v.written_bytes as f64),
        ),
        (
            "condense_volume_physical_bytes",
            "A volume's share of the stored chunk bytes, in proportion to its data blocks.",
            |v| Some(v.physical_bytes as f64),
        ),
        (
            "condense_volume_exclusive_bytes",
            "Chunk record bytes only this volume references: what deleting it frees after gc.",
            |v| v.exclusive_bytes().map(|b| b as f64),
        ),
        (
            "condense_volume_shared_bytes",
            "Chunk record bytes this volume references that other volumes or snapshots reference too.",
            |v| v.shared_bytes().map(|b| b as f64),
        ),
        (
            "condense_volume_exclusive_chunks",
            "Chunks only this volume references.",
            |v| v.space.map(|s| s.exclusive.chunks as f64),
        ),
        (
            "condense_volume_shared_chunks",
            "Chunks this volume references that other volumes or snapshots reference too.",
            |v| v.space.map(|s| s.shared.chunks as f64),
        ),
        (
            "condense_volume_dedup_ratio",
            "A volume's written blocks per distinct chunk it references.",
            |v| v.dedup_ratio,
        ),
        (
            "condense_volume_compression_ratio",
            "Block bytes of the distinct chunks a volume references per stored payload byte.",
            |v| v.compression_ratio,
        ),
    ];
    for (name, help, get) in per_volume {
        if e.family(name, help, Kind::Gauge) {
            // A figure the pool could not count (see `condense stats`) has no sample.
            for v in &volumes {
                if let Some(x) = get(v) {
                    e.sample(name, &[("volume", &v.name)], x);
                }
            }
        }
    }
}

/// The scrub: the pass under way (or this process's last) and the last one recorded.
fn scrub_metrics(e: &mut Encoder, s: &condense_engine::scrub::ScrubStatus) {
    let cur = s.current.clone().unwrap_or_default();
    let last = s.last.clone().unwrap_or_default();
    let gauges: [(&str, &str, f64); 7] = [
        (
            "condense_scrub_running",
            "1 while a scrub pass runs.",
            f64::from(u8::from(s.running)),
        ),
        (
            "condense_scrub_rate_bytes_per_second",
            "The background scrub's rate (0: off or no limit).",
            s.rate_bytes_per_sec as f64,
        ),
        (
            "condense_scrub_progress_ratio",
            "Share of the pass under way (or this process's last) checked, 0 to 1.",
            if s.current.is_some() {
                cur.progress()
            } else {
                0.0
            },
        ),
        (
            "condense_scrub_checked_bytes",
            "Chunk record bytes the pass under way (or this process's last) has checked.",
            cur.bytes_checked as f64,
        ),
        (
            "condense_scrub_damaged_chunks",
            "Damaged chunks the pass under way (or this process's last) found.",
            cur.damaged_chunks as f64,
        ),
        (
            "condense_scrub_last_finished_timestamp_seconds",
            "When the last recorded pass ended (Unix time; 0: never).",
            last.finished_unix.unwrap_or(0) as f64,
        ),
        (
            "condense_scrub_last_damaged_chunks",
            "Damaged chunks the last recorded pass found (alert on > 0).",
            last.damaged_chunks as f64,
        ),
    ];
    for (name, help, v) in gauges {
        e.gauge(name, help, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::{Context, Result};
    use std::io::{Read, Write};

    fn scrape(addr: std::net::SocketAddr) -> Result<String> {
        let mut s = std::net::TcpStream::connect(addr)?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    }

    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn pool_figures_follow_writes_and_flushes() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("pool");
        Pool::init_path(&path, &Default::default())?;
        let pool = Pool::open_path(&path, Default::default())?;
        pool.create_volume("vm", 8 << 20)?;
        pool.create_volume(".hidden", 1 << 20)?;
        let ep =
            Endpoint::start(Some("127.0.0.1:0"), &pool, "test")?.context("an address was given")?;
        let before = scrape(ep.addr())?;
        assert_eq!(value(&before, "condense_pool_written_bytes"), Some(0.0));
        let data: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
        pool.volume("vm")?.write_at(0, &data, false)?;
        pool.flush()?;
        let after = scrape(ep.addr())?;
        assert_eq!(
            value(&after, "condense_pool_written_bytes"),
            Some(1048576.0)
        );
        assert_eq!(
            value(&after, "condense_volume_written_bytes{volume=\"vm\"}"),
            Some(1048576.0)
        );
        assert!(!after.contains(".hidden"), "hidden volumes stay out");
        let flushes = |t: &str| value(t, "condense_flush_duration_seconds_count");
        assert_eq!(flushes(&after), flushes(&before).map(|f| f + 1.0));
        let saved = value(&after, "condense_pool_savings_ratio").context("ratio")?;
        assert!(saved > 0.5, "a repetitive MiB compresses: {saved}");
        drop(pool);
        // The pool gone, the endpoint still answers without its figures.
        let gone = scrape(ep.addr())?;
        assert!(gone.contains("condense_build_info"), "{gone}");
        assert!(!gone.contains("condense_pool_"), "{gone}");
        Ok(())
    }
}
