//! `stats`: the pool's sizes and savings, its volumes and snapshots, its bucket, its scrub,
//! its cache tier and the hosts it is shared with (schema in docs/STATS.md).

use super::cache::{self, CacheReport};
use super::hosts::SharedPool;
use super::scrub::ScrubReport;
use super::volumes::{human_or_dash, ratio, volume_lines, Figures};
use super::{human, round2, FileNames, Report};
use condense_engine::hosts::HostOverview;
use condense_engine::{CacheStats, PoolStats, VolumeStats};
use serde::{Serialize, Serializer};
use std::fmt::Write;

/// `condense stats [NAME]`.
pub struct StatsReport<'a> {
    pub stats: &'a PoolStats,
    /// Only this volume or snapshot (the JSON keeps the pool's figures).
    pub only: Option<&'a str>,
    /// Also segments, block size and read errors, and internal volumes (text only).
    pub verbose: bool,
    /// The cache tier's figures, if one is attached.
    pub cache: Option<&'a CacheStats>,
    /// Every part of a pool several hosts share (empty otherwise).
    pub hosts: &'a [HostOverview],
}

impl<'a> StatsReport<'a> {
    /// The pool's figures alone, as the status file publishes them.
    pub fn pool(stats: &'a PoolStats) -> StatsReport<'a> {
        StatsReport {
            stats,
            only: None,
            verbose: false,
            cache: None,
            hosts: &[],
        }
    }
}

#[derive(Serialize)]
struct Wire<'a> {
    schema: &'static str,
    block_size: u32,
    logical_bytes: u64,
    written_bytes: u64,
    zero_bytes: u64,
    unique_chunks: u64,
    stored_bytes: u64,
    chunk_bytes: u64,
    shared_bytes: Option<u64>,
    shared_chunks: Option<u64>,
    attribution_ram_bytes: u64,
    attribution_scratch_bytes: u64,
    attribution_error: &'a Option<String>,
    data_bytes: u64,
    metadata_bytes: u64,
    physical_bytes: u64,
    dead_bytes: u64,
    segments: u64,
    dedup_saving_percent: f64,
    compression_saving_percent: f64,
    saving_percent: f64,
    index_ram_bytes: u64,
    ram_bytes_per_unique_chunk: f64,
    dedup_index_bytes: u64,
    dedup_index: &'a str,
    dedup_index_mode: &'a str,
    dedup_index_budget_bytes: u64,
    dedup_index_entries: u64,
    dedup_index_lookups: u64,
    dedup_index_cache_hits: u64,
    dedup_index_hook_hits: u64,
    dedup_index_misses: u64,
    dedup_index_hooks_dropped: u64,
    dedup_index_hook_rate: u64,
    dedup_merged_chunks: u64,
    #[serde(flatten)]
    delta: DeltaWire,
    metadata_cache_budget_bytes: u64,
    metadata_cache_used_bytes: u64,
    metadata_cache_hits: u64,
    metadata_cache_misses: u64,
    metadata_page_bytes_written: u64,
    metadata_page_bytes_live: u64,
    checkpoints: u64,
    read_errors: u64,
    volumes: Vec<Figures<'a>>,
    snapshots: Vec<Snapshot<'a>>,
    scrub: ScrubReport<'a>,
    releasing: Vec<Releasing<'a>>,
    releasing_bytes: u64,
    #[serde(flatten)]
    remote: Option<Remote<'a>>,
    #[serde(flatten)]
    cache: Option<cache::Wire<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    shared_pool: Option<SharedPool<'a>>,
}

/// A deleted volume's map still being released in the background.
#[derive(Serialize)]
struct Releasing<'a> {
    name: &'a str,
    data_blocks: u64,
    blocks_left: u64,
}

#[derive(Serialize)]
struct Snapshot<'a> {
    #[serde(flatten)]
    figures: Figures<'a>,
    snapshot_of: &'a Option<String>,
}

/// The bucket side of a pool in an object store.
#[derive(Serialize)]
struct Remote<'a> {
    remote_url: &'a str,
    remote_durability: &'static str,
    remote_health: &'a str,
    remote_objects: u64,
    remote_bytes: u64,
    remote_pending_bytes: u64,
    remote_last_upload_age_seconds: Option<u64>,
    remote_puts: u64,
    remote_put_bytes: u64,
    remote_gets: u64,
    remote_get_bytes: u64,
    remote_heads: u64,
    remote_lists: u64,
    remote_deletes: u64,
    remote_conditional_put: bool,
    remote_claims: &'static str,
}

impl<'a> Remote<'a> {
    fn of(r: &'a condense_engine::io::StoreStatus) -> Remote<'a> {
        let q = &r.requests;
        Remote {
            remote_url: &r.url,
            remote_durability: r.durability.as_str(),
            remote_health: &r.health,
            remote_objects: r.objects,
            remote_bytes: r.bytes,
            remote_pending_bytes: r.pending_bytes,
            remote_last_upload_age_seconds: r.last_upload_age_seconds,
            remote_puts: q.put_requests,
            remote_put_bytes: q.put_bytes,
            remote_gets: q.get_requests,
            remote_get_bytes: q.get_bytes,
            remote_heads: q.head_requests,
            remote_lists: q.list_requests,
            remote_deletes: q.delete_requests,
            remote_conditional_put: r.conditional_put_honoured,
            remote_claims: claims_mode(r),
        }
    }
}

impl Serialize for StatsReport<'_> {
    fn serialize<S: Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        let s = self.stats;
        // `stats` names damaged volumes only, not their files.
        let no_files = FileNames::none();
        let shown = |v: &&VolumeStats| self.only.is_none_or(|n| n == v.name);
        let snapshots = s.snapshots.iter().filter(shown).map(|v| Snapshot {
            figures: Figures::of(v),
            snapshot_of: &v.snapshot_of,
        });
        Wire {
            schema: "condense.stats/2",
            block_size: s.block_size,
            logical_bytes: s.logical_bytes,
            written_bytes: s.written_bytes,
            zero_bytes: s.zero_bytes,
            unique_chunks: s.unique_chunks,
            stored_bytes: s.stored_bytes,
            chunk_bytes: s.chunk_bytes,
            shared_bytes: s.shared.map(|x| x.record_bytes()),
            shared_chunks: s.shared.map(|x| x.chunks),
            attribution_ram_bytes: s.attribution_ram_bytes,
            attribution_scratch_bytes: s.attribution_scratch_bytes,
            attribution_error: &s.attribution_error,
            data_bytes: s.data_bytes,
            metadata_bytes: s.metadata_bytes,
            physical_bytes: s.physical_bytes,
            dead_bytes: s.dead_bytes,
            segments: s.segments,
            dedup_saving_percent: round2(s.dedup_saving_percent),
            compression_saving_percent: round2(s.compression_saving_percent),
            saving_percent: round2(s.saving_percent),
            index_ram_bytes: s.index_ram_bytes,
            ram_bytes_per_unique_chunk: round2(s.ram_bytes_per_unique_chunk),
            dedup_index_bytes: s.dedup_index_bytes,
            dedup_index: &s.dedup_index,
            dedup_index_mode: &s.dedup_index_mode,
            dedup_index_budget_bytes: s.dedup_index_budget_bytes,
            dedup_index_entries: s.dedup_index_entries,
            dedup_index_lookups: s.dedup_index_lookups,
            dedup_index_cache_hits: s.dedup_index_cache_hits,
            dedup_index_hook_hits: s.dedup_index_hook_hits,
            dedup_index_misses: s.dedup_index_misses,
            dedup_index_hooks_dropped: s.dedup_index_hooks_dropped,
            dedup_index_hook_rate: s.dedup_index_hook_rate,
            dedup_merged_chunks: s.dedup_merged_chunks,
            delta: DeltaWire::of(s),
            metadata_cache_budget_bytes: s.metadata_cache_budget_bytes,
            metadata_cache_used_bytes: s.metadata_cache_used_bytes,
            metadata_cache_hits: s.metadata_cache_hits,
            metadata_cache_misses: s.metadata_cache_misses,
            metadata_page_bytes_written: s.metadata_page_bytes_written,
            metadata_page_bytes_live: s.metadata_page_bytes_live,
            checkpoints: s.checkpoints,
            read_errors: s.read_errors,
            volumes: s.volumes.iter().filter(shown).map(Figures::of).collect(),
            snapshots: snapshots.collect(),
            scrub: ScrubReport {
                status: &s.scrub,
                block_size: s.block_size,
                files: &no_files,
            },
            releasing: s
                .releasing
                .iter()
                .map(|r| Releasing {
                    name: &r.name,
                    data_blocks: r.data_blocks,
                    blocks_left: r.blocks_left,
                })
                .collect(),
            releasing_bytes: s.releasing_bytes,
            remote: s.remote.as_ref().map(Remote::of),
            cache: self.cache.map(cache::Wire::of),
            shared_pool: (!self.hosts.is_empty()).then_some(SharedPool(self.hosts)),
        }
        .serialize(ser)
    }
}

impl Report for StatsReport<'_> {
    /// One volume or snapshot with `only`, else the pool and its volume and snapshot tables;
    /// then the cache tier and the hosts.
    fn text(&self) -> String {
        let (s, verbose) = (self.stats, self.verbose);
        let mut o = String::new();
        if let Some(name) = self.only {
            one_volume_lines(&mut o, s, name);
        } else {
            pool_lines(&mut o, s, verbose);
            volume_tables(&mut o, s, verbose);
        }
        if let (Some(c), None) = (self.cache, self.only) {
            let _ = write!(o, "\n{}", CacheReport(c).text());
        }
        if !self.hosts.is_empty() {
            let _ = write!(o, "\n{}", SharedPool(self.hosts).text());
        }
        o
    }
}

/// How this open's claims are decided: `conditional` (the store's conditional PUT, probed at
/// this open) or `timed` (docs/S3.md "Lease: claims").
pub(crate) fn claims_mode(r: &condense_engine::io::StoreStatus) -> &'static str {
    if r.conditional_put_honoured {
        "conditional"
    } else {
        "timed"
    }
}

/// The bucket side of a pool in an object store, for `stats`.
fn remote_lines(o: &mut String, r: &condense_engine::io::StoreStatus) {
    use condense_engine::remote::Durability;
    let rows: Vec<(&str, String)> = vec![
        ("object store", r.url.clone()),
        ("health", r.health.clone()),
        (
            "durability",
            match r.durability {
                Durability::Remote => "remote: a flush returns once the object store has it (the pool's setting: condense durability set)",
                Durability::Local => "local: a flush returns once the local journal has it; uploaded in the background (the pool's setting: condense durability set)",
            }
            .to_string(),
        ),
        (
            "claims",
            match claims_mode(r) {
                "conditional" => "conditional: the store honours If-None-Match: * (probed at this open); it decides every race for a lease epoch, a slot or a volume name".to_string(),
                _ => "timed: the store does not honour conditional PUT (or this open did not probe it); races are decided by the timed protocol (docs/S3.md \"Lease: claims\")".to_string(),
            },
        ),
        ("objects", format!("{} ({})", r.objects, human(r.bytes))),
        ("not yet uploaded", human(r.pending_bytes)),
        (
            "last checkpoint upload",
            r.last_upload_age_seconds
                .map_or_else(|| "none since open".to_string(), |s| format!("{s} s ago")),
        ),
        (
            "requests since open",
            format!(
                "{} PUT ({}), {} GET ({}), {} HEAD, {} LIST, {} DELETE",
                r.requests.put_requests,
                human(r.requests.put_bytes),
                r.requests.get_requests,
                human(r.requests.get_bytes),
                r.requests.head_requests,
                r.requests.list_requests,
                r.requests.delete_requests
            ),
        ),
    ];
    for (k, v) in rows {
        let _ = writeln!(o, "  {k:<28} {v}");
    }
}

/// `stats NAME`: the volume or snapshot so named (nothing if there is none).
fn one_volume_lines(o: &mut String, s: &PoolStats, name: &str) {
    if let Some(v) = s
        .volumes
        .iter()
        .chain(&s.snapshots)
        .find(|v| v.name == name)
    {
        let what = if v.snapshot_of.is_some() {
            "snapshot"
        } else {
            "volume"
        };
        let _ = writeln!(o, "{what} {name}");
        volume_lines(o, v);
    }
}

/// The pool's sizes and savings (more with `verbose`), its bucket and its scrub.
fn pool_lines(o: &mut String, s: &PoolStats, verbose: bool) {
    let _ = writeln!(o, "pool");
    let rows: Vec<(&str, String)> = vec![
        ("logical size (all volumes)", human(s.logical_bytes)),
        ("written (non-zero blocks)", human(s.written_bytes)),
        ("zero blocks written", human(s.zero_bytes)),
        (
            "unique chunks",
            format!(
                "{} ({})",
                s.unique_chunks,
                human(s.unique_chunks * u64::from(s.block_size))
            ),
        ),
        ("stored after compression", human(s.stored_bytes)),
        (
            "physical used",
            format!(
                "{} (data {}, metadata {})",
                human(s.physical_bytes),
                human(s.data_bytes),
                human(s.metadata_bytes)
            ),
        ),
        ("dead, awaiting gc", human(s.dead_bytes)),
        ("dedup saving", format!("{:.1} %", s.dedup_saving_percent)),
        (
            "compression saving",
            format!("{:.1} %", s.compression_saving_percent),
        ),
        ("total saving", format!("{:.1} %", s.saving_percent)),
        (
            "RAM for index and maps",
            format!(
                "{} ({:.1} bytes per unique chunk; dedup index {})",
                human(s.index_ram_bytes),
                s.ram_bytes_per_unique_chunk,
                match s.dedup_index.as_str() {
                    "loaded" => "loaded at open",
                    "built" => "built from the chunk table",
                    "building" => "being built in the background",
                    _ => "built by the first write",
                }
            ),
        ),
        ("dedup index", index_row(s)),
        ("delta compression", delta_row(s)),
        (
            "per-volume figures",
            match (&s.attribution_error, s.attribution_scratch_bytes) {
                (Some(_), _) => "not available (why: below)".to_string(),
                (None, 0) => format!("{} of RAM", human(s.attribution_ram_bytes)),
                (None, n) => format!(
                    "{} of RAM, {} in a scratch file (df counts it, du does not)",
                    human(s.attribution_ram_bytes),
                    human(n)
                ),
            },
        ),
    ];
    for (k, v) in rows {
        let _ = writeln!(o, "  {k:<28} {v}");
    }
    for r in &s.releasing {
        let _ = writeln!(
            o,
            "  {:<28} {} ({} of {} blocks left; deleted, released in the background)",
            "being released", r.name, r.blocks_left, r.data_blocks
        );
    }
    if verbose {
        let _ = writeln!(o, "  {:<28} {}", "segments", s.segments);
        let _ = writeln!(
            o,
            "  {:<28} {}",
            "block size",
            human(u64::from(s.block_size))
        );
        let _ = writeln!(o, "  {:<28} {}", "read errors (checksum)", s.read_errors);
    }
    if let Some(r) = &s.remote {
        remote_lines(o, r);
    }
    o.push_str(
        &ScrubReport {
            status: &s.scrub,
            block_size: s.block_size,
            files: &FileNames::none(),
        }
        .text(),
    );
}

/// The header of the volume or snapshot table of `stats`.
fn table_header(o: &mut String, what: &str) {
    let _ = writeln!(
        o,
        "{:<24} {:>10} {:>10} {:>10} {:>10} {:>7} {:>7}",
        what, "logical", "written", "would free", "shared", "dedup", "compr"
    );
}

/// The volume table, the snapshot table (if any) and their footnotes.
fn volume_tables(o: &mut String, s: &PoolStats, verbose: bool) {
    let _ = writeln!(o);
    table_header(o, "volume");
    for v in &s.volumes {
        if v.name.starts_with('.') && !verbose {
            continue;
        }
        share_row(o, v);
    }
    let snaps: Vec<&VolumeStats> = s
        .snapshots
        .iter()
        .filter(|v| verbose || !v.name.starts_with('.'))
        .collect();
    if !snaps.is_empty() {
        let _ = writeln!(o);
        table_header(o, "snapshot");
        for v in snaps {
            share_row(o, v);
        }
    }
    match (&s.attribution_error, s.shared) {
        (Some(e), _) => {
            let _ = writeln!(o, "(per-volume figures unavailable: {e})");
        }
        (None, Some(shared)) => {
            let _ = writeln!(
                o,
                "(would free: stored chunks only it references, freed by deleting it and `condense gc`; \
                 shared: stored chunks other volumes or snapshots reference too, {} in the pool; \
                 everything's `would free` plus that{} is the pool's {} of live chunks. \
                 dedup and compr: its own written blocks per distinct chunk, and block bytes per \
                 stored byte)",
                human(shared.record_bytes()),
                if s.releasing.is_empty() {
                    String::new()
                } else {
                    format!(
                        " plus {} only maps being released still hold",
                        human(s.releasing_bytes)
                    )
                },
                human(s.chunk_bytes)
            );
        }
        (None, None) => {}
    }
    let hidden = s.volumes.iter().filter(|v| v.name.starts_with('.')).count();
    if hidden > 0 && !verbose {
        let _ = writeln!(o, "({hidden} internal volumes, such as FUSE file contents, not shown; --verbose lists them)");
    }
}

/// One line of the volume or snapshot table of `stats`.
fn share_row(o: &mut String, v: &VolumeStats) {
    let _ = writeln!(
        o,
        "{:<24} {:>10} {:>10} {:>10} {:>10} {:>7} {:>7}",
        v.name,
        human(v.logical_bytes),
        human(v.written_bytes),
        human_or_dash(v.exclusive_bytes()),
        human_or_dash(v.shared_bytes()),
        ratio(v.dedup_ratio),
        ratio(v.compression_ratio),
    );
}

/// The delta figures of the JSON (docs/STATS.md "Delta compression").
#[derive(Serialize)]
struct DeltaWire {
    delta_mode: bool,
    delta_chunks_written: u64,
    delta_chunks_since_open: u64,
    delta_saved_bytes_since_open: u64,
    delta_sketch_lookups: u64,
    delta_sketch_hits: u64,
    sketch_index_bytes: u64,
    sketch_index_chunks: u64,
    sketch_index_bytes_per_chunk: f64,
}

impl DeltaWire {
    fn of(s: &PoolStats) -> DeltaWire {
        let d = &s.delta;
        DeltaWire {
            delta_mode: d.mode,
            delta_chunks_written: d.chunks_written,
            delta_chunks_since_open: d.chunks_since_open,
            delta_saved_bytes_since_open: d.saved_bytes_since_open,
            delta_sketch_lookups: d.sketch_lookups,
            delta_sketch_hits: d.sketch_hits,
            sketch_index_bytes: d.sketch_index_bytes,
            sketch_index_chunks: d.sketch_index_chunks,
            sketch_index_bytes_per_chunk: round2(d.sketch_index_bytes_per_chunk),
        }
    }
}

/// Delta compression: off, or the deltas written, what this process's saved, and the
/// sketch index's RAM.
fn delta_row(s: &PoolStats) -> String {
    let d = &s.delta;
    if !d.mode {
        return match d.chunks_written {
            0 => "off".to_string(),
            n => format!("off for new writes ({n} deltas written)"),
        };
    }
    format!(
        "on, {} deltas written; since open {} saving {}; sketch index {} ({} recent chunks, {:.1} bytes per unique chunk)",
        d.chunks_written,
        d.chunks_since_open,
        human(d.saved_bytes_since_open),
        human(d.sketch_index_bytes),
        d.sketch_index_chunks,
        d.sketch_index_bytes_per_chunk
    )
}

/// The dedup index's mode, what it holds and (sparse) what its lookups found.
fn index_row(s: &PoolStats) -> String {
    let built = s.dedup_index != "not built";
    match (s.dedup_index_mode == "sparse", built) {
        (false, true) => return format!("dense, {} chunks", s.dedup_index_entries),
        (false, false) => return "dense".to_string(),
        (true, false) => {
            return format!(
                "sparse, {} budget (its counters are those of the process that writes, e.g. `condense serve`)",
                human(s.dedup_index_budget_bytes)
            )
        }
        (true, true) => {}
    }
    format!(
        "sparse, {} budget, {} hooks; {} lookups: {} by locality, {} by hook, {} found nothing",
        human(s.dedup_index_budget_bytes),
        s.dedup_index_entries,
        s.dedup_index_lookups,
        s.dedup_index_cache_hits,
        s.dedup_index_hook_hits,
        s.dedup_index_misses
    )
}
