//! What the CLI prints: tables for people, JSON for scripts (schema in docs/STATS.md).

use crate::size::human;
use condense_engine::scrub::{ScrubPass, ScrubStatus};
use condense_engine::verify::VerifyReport;
use condense_engine::{Compression, Pool, PoolStats, VolumeStats};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use std::fmt::Write;

pub fn compression_name(c: Compression) -> String {
    c.to_string()
}

/// A progress bar on stderr with bytes/s and ETA (hidden when stderr is not a terminal).
pub fn bar(len: u64, what: &str) -> ProgressBar {
    let b = ProgressBar::new(len);
    let style = ProgressStyle::with_template(
        "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    b.set_style(style);
    b.set_message(what.to_string());
    b
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn importing(pool: &Pool, name: &str) -> bool {
    pool.is_importing(name)
}

/// One volume's figures, as in `stats --json`.
fn volume_fields(v: &VolumeStats) -> Value {
    json!({
        "name": v.name,
        "logical_bytes": v.logical_bytes,
        "written_bytes": v.written_bytes,
        "zero_bytes": v.zero_bytes,
        "physical_bytes": v.physical_bytes,
        "saving_percent": round2(v.saving_percent),
        "exclusive_bytes": v.exclusive_bytes(),
        "exclusive_chunks": v.space.map(|s| s.exclusive.chunks),
        "shared_bytes": v.shared_bytes(),
        "shared_chunks": v.space.map(|s| s.shared.chunks),
        "referenced_bytes": v.space.map(|s| s.referenced().record_bytes()),
        "dedup_ratio": v.dedup_ratio.map(round2),
        "compression_ratio": v.compression_ratio.map(round2),
    })
}

/// One volume for `volume list/info --json`: its figures and whether its import finished.
pub fn volume_json(v: &VolumeStats, pool: &Pool) -> Value {
    let mut j = volume_fields(v);
    j["incomplete_import"] = Value::Bool(importing(pool, &v.name));
    j
}

pub fn stats_json(s: &PoolStats, only: Option<&str>) -> Value {
    let volumes: Vec<Value> = s
        .volumes
        .iter()
        .filter(|v| only.is_none_or(|n| n == v.name))
        .map(volume_fields)
        .collect();
    let snapshots: Vec<Value> = s
        .snapshots
        .iter()
        .filter(|v| only.is_none_or(|n| n == v.name))
        .map(|v| {
            let mut j = volume_fields(v);
            j["snapshot_of"] = json!(v.snapshot_of);
            j
        })
        .collect();
    let mut j = json!({
        "schema": "condense.stats/2",
        "block_size": s.block_size,
        "logical_bytes": s.logical_bytes,
        "written_bytes": s.written_bytes,
        "zero_bytes": s.zero_bytes,
        "unique_chunks": s.unique_chunks,
        "stored_bytes": s.stored_bytes,
        "chunk_bytes": s.chunk_bytes,
        "shared_bytes": s.shared.map(|x| x.record_bytes()),
        "shared_chunks": s.shared.map(|x| x.chunks),
        "attribution_ram_bytes": s.attribution_ram_bytes,
        "attribution_scratch_bytes": s.attribution_scratch_bytes,
        "attribution_error": s.attribution_error,
        "data_bytes": s.data_bytes,
        "metadata_bytes": s.metadata_bytes,
        "physical_bytes": s.physical_bytes,
        "dead_bytes": s.dead_bytes,
        "segments": s.segments,
        "dedup_saving_percent": round2(s.dedup_saving_percent),
        "compression_saving_percent": round2(s.compression_saving_percent),
        "saving_percent": round2(s.saving_percent),
        "index_ram_bytes": s.index_ram_bytes,
        "ram_bytes_per_unique_chunk": round2(s.ram_bytes_per_unique_chunk),
        "dedup_index_bytes": s.dedup_index_bytes,
        "dedup_index": s.dedup_index,
        "metadata_cache_budget_bytes": s.metadata_cache_budget_bytes,
        "metadata_cache_used_bytes": s.metadata_cache_used_bytes,
        "metadata_cache_hits": s.metadata_cache_hits,
        "metadata_cache_misses": s.metadata_cache_misses,
        "metadata_page_bytes_written": s.metadata_page_bytes_written,
        "metadata_page_bytes_live": s.metadata_page_bytes_live,
        "checkpoints": s.checkpoints,
        "read_errors": s.read_errors,
        "volumes": volumes,
        "snapshots": snapshots,
        "scrub": scrub_json(&s.scrub, s.block_size, &FileNames::none()),
    });
    if let Some(r) = &s.remote {
        let fields = json!({
            "remote_url": r.url,
            "remote_durability": r.durability.as_str(),
            "remote_health": r.health,
            "remote_objects": r.objects,
            "remote_bytes": r.bytes,
            "remote_pending_bytes": r.pending_bytes,
            "remote_last_upload_age_seconds": r.last_upload_age_seconds,
            "remote_puts": r.requests.put_requests,
            "remote_put_bytes": r.requests.put_bytes,
            "remote_gets": r.requests.get_requests,
            "remote_get_bytes": r.requests.get_bytes,
            "remote_heads": r.requests.head_requests,
            "remote_lists": r.requests.list_requests,
            "remote_deletes": r.requests.delete_requests,
            "remote_conditional_put": r.conditional_put_honoured,
            "remote_claims": claims_mode(r),
        });
        if let (Some(o), Some(f)) = (j.as_object_mut(), fields.as_object()) {
            o.extend(f.clone());
        }
    }
    j
}

/// One scrub pass, as `stats --json` and `scrub --status --json` print it.
fn scrub_pass_json(p: &ScrubPass, block_size: u32, files: &FileNames) -> Value {
    let bs = u64::from(block_size);
    json!({
        "started_unix": p.started_unix,
        "finished_unix": p.finished_unix,
        "chunks_total": p.chunks_total,
        "chunks_checked": p.chunks_checked,
        "bytes_checked": p.bytes_checked,
        "progress_percent": round2(p.progress() * 100.0),
        "damaged_chunks": p.damaged_chunks,
        "healed_chunks": p.healed_chunks,
        "stopped": p.stopped,
        "damaged": p.damaged.iter().map(|(id, why)| json!({"chunk": id, "problem": why})).collect::<Vec<_>>(),
        "damaged_blocks": p.damaged_blocks.iter().map(|(v, first, n)| json!({
            "volume": v, "file": files.get(v), "first_block": first, "blocks": n, "offset": first * bs, "bytes": n * bs,
        })).collect::<Vec<_>>(),
    })
}

/// The scrub's status, as `stats --json` prints it (docs/STATS.md).
pub fn scrub_json(s: &ScrubStatus, block_size: u32, files: &FileNames) -> Value {
    json!({
        "rate_bytes_per_sec": s.rate_bytes_per_sec,
        "running": s.running,
        "current": s.current.as_ref().map(|p| scrub_pass_json(p, block_size, files)),
        "last": s.last.as_ref().map(|p| scrub_pass_json(p, block_size, files)),
    })
}

/// A scrub status as [`scrub_json`] printed it (the status file of a running daemon).
fn scrub_from_json(v: &Value) -> ScrubStatus {
    let u = |j: &Value, k: &str| j[k].as_u64().unwrap_or(0);
    let pass = |p: &Value| -> Option<ScrubPass> {
        p.is_object().then(|| ScrubPass {
            started_unix: u(p, "started_unix"),
            finished_unix: p.get("finished_unix").and_then(Value::as_u64),
            chunks_total: u(p, "chunks_total"),
            chunks_checked: u(p, "chunks_checked"),
            bytes_checked: u(p, "bytes_checked"),
            damaged_chunks: u(p, "damaged_chunks"),
            healed_chunks: u(p, "healed_chunks"),
            stopped: p.get("stopped").and_then(Value::as_bool).unwrap_or(false),
            damaged: Vec::new(),
            damaged_blocks: p
                .get("damaged_blocks")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .map(|d| {
                            (
                                d.get("volume")
                                    .and_then(Value::as_str)
                                    .unwrap_or("")
                                    .to_string(),
                                u(d, "first_block"),
                                u(d, "blocks"),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default(),
        })
    };
    ScrubStatus {
        rate_bytes_per_sec: u(v, "rate_bytes_per_sec"),
        running: v.get("running").and_then(Value::as_bool).unwrap_or(false),
        current: v.get("current").and_then(pass),
        last: v.get("last").and_then(pass),
    }
}

/// When a Unix time was, in an administrator's terms ("2 h ago").
fn ago(unix: u64) -> String {
    let secs = now_unix().saturating_sub(unix);
    match secs {
        0..=119 => format!("{secs} s ago"),
        120..=7199 => format!("{} min ago", secs / 60),
        7200..=172_799 => format!("{} h ago", secs / 3600),
        _ => format!("{} days ago", secs / 86400),
    }
}

/// One pass in words: "checked 1200 of 1500 chunks (4.7 MiB), no damage".
fn scrub_pass_text(p: &ScrubPass, files: &FileNames) -> String {
    let mut t = format!(
        "checked {} of {} chunks ({}){}, ",
        p.chunks_checked,
        p.chunks_total,
        human(p.bytes_checked),
        if p.stopped {
            ", stopped before the end"
        } else {
            ""
        }
    );
    if p.healed_chunks > 0 {
        let _ = write!(
            t,
            "{} damaged records written again from the cache tier's copy, ",
            p.healed_chunks
        );
    }
    if p.damaged_chunks == 0 {
        t.push_str("no damage");
    } else {
        let _ = write!(t, "{} DAMAGED chunks", p.damaged_chunks);
        let names: Vec<String> = p
            .damaged_blocks
            .iter()
            .take(5)
            .map(|(v, first, n)| match n {
                1 => format!("{} block {first}", files.show(v)),
                _ => format!("{} blocks {first}-{}", files.show(v), first + n - 1),
            })
            .collect();
        if !names.is_empty() {
            let _ = write!(
                t,
                " ({}{})",
                names.join(", "),
                if p.damaged_blocks.len() > 5 {
                    ", ..."
                } else {
                    ""
                }
            );
        }
    }
    t
}

/// The scrub in words, for `stats` and `scrub --status`: the pass under way and the last one.
pub fn scrub_text(s: &ScrubStatus, files: &FileNames) -> String {
    let mut o = String::new();
    let rate = if s.rate_bytes_per_sec == 0 {
        "no limit".to_string()
    } else {
        format!("{}/s", human(s.rate_bytes_per_sec))
    };
    match (&s.current, s.running) {
        (Some(p), true) => {
            let _ = writeln!(
                o,
                "  {:<28} running at {rate}: {:.1} %, {}",
                "scrub",
                p.progress() * 100.0,
                scrub_pass_text(p, files)
            );
        }
        _ => {
            let _ = writeln!(o, "  {:<28} not running", "scrub");
        }
    }
    match &s.last {
        Some(p) => {
            let _ = writeln!(
                o,
                "  {:<28} finished {}: {}",
                "last scrub",
                p.finished_unix.map_or_else(|| "?".into(), ago),
                scrub_pass_text(p, files)
            );
        }
        None => {
            let _ = writeln!(o, "  {:<28} never", "last scrub");
        }
    }
    if s.last.as_ref().is_some_and(|p| p.damaged_chunks > 0)
        || s.current.as_ref().is_some_and(|p| p.damaged_chunks > 0)
    {
        let _ = writeln!(
            o,
            "  damage found: `condense verify` names every block, `condense repair` salvages the pool (docs/REPAIR.md)"
        );
    }
    o
}

/// The bucket side of an S3 pool, for `stats`.
/// How this open's claims are decided: `conditional` (the store's conditional PUT, probed at
/// this open) or `timed` (docs/S3.md "Lease: claims").
fn claims_mode(r: &condense_engine::io::StoreStatus) -> &'static str {
    if r.conditional_put_honoured {
        "conditional"
    } else {
        "timed"
    }
}

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

/// The text of `condense stats`: one volume or snapshot with `only`, else the pool and its
/// volume and snapshot tables.
pub fn stats_table(s: &PoolStats, only: Option<&str>, verbose: bool) -> String {
    let mut o = String::new();
    if let Some(name) = only {
        one_volume_lines(&mut o, s, name);
        return o;
    }
    pool_lines(&mut o, s, verbose);
    volume_tables(&mut o, s, verbose);
    o
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
                    _ => "built by the first write",
                }
            ),
        ),
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
    o.push_str(&scrub_text(&s.scrub, &FileNames::none()));
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
                 everything's `would free` plus that is the pool's {} of live chunks. \
                 dedup and compr: its own written blocks per distinct chunk, and block bytes per \
                 stored byte)",
                human(shared.record_bytes()),
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

/// `n` bytes, or `-` when the figure is missing.
fn human_or_dash(n: Option<u64>) -> String {
    n.map_or_else(|| "-".to_string(), human)
}

/// A ratio as `1.23x`, or `-` when there is none.
fn ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "-".to_string(), |r| format!("{r:.2}x"))
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

fn volume_lines(o: &mut String, v: &VolumeStats) {
    let _ = writeln!(o, "  {:<24} {}", "logical size", human(v.logical_bytes));
    let _ = writeln!(
        o,
        "  {:<24} {}",
        "written (non-zero)",
        human(v.written_bytes)
    );
    let _ = writeln!(o, "  {:<24} {}", "zero blocks written", human(v.zero_bytes));
    let _ = writeln!(
        o,
        "  {:<24} {}",
        "would free if deleted",
        human_or_dash(v.exclusive_bytes())
    );
    let _ = writeln!(
        o,
        "  {:<24} {}",
        "shared with others",
        human_or_dash(v.shared_bytes())
    );
    let _ = writeln!(
        o,
        "  {:<24} dedup {}, compression {}",
        "own reduction",
        ratio(v.dedup_ratio),
        ratio(v.compression_ratio)
    );
    let _ = writeln!(o, "  {:<24} {}", "physical share", human(v.physical_bytes));
    let _ = writeln!(o, "  {:<24} {:.1} %", "saving", v.saving_percent);
}

pub fn volume_info(v: &VolumeStats, pool: &Pool) -> String {
    let mut o = format!("volume {}\n", v.name);
    volume_lines(&mut o, v);
    if importing(pool, &v.name) {
        o.push_str("  INCOMPLETE: its import was interrupted; delete it and import again\n");
    }
    o
}

pub fn volume_list(vols: &[&VolumeStats], pool: &Pool) -> String {
    let mut o = format!(
        "{:<24} {:>12} {:>12} {:>12} {:>8}\n",
        "NAME", "SIZE", "WRITTEN", "PHYSICAL", "SAVING"
    );
    for v in vols {
        let _ = writeln!(
            o,
            "{:<24} {:>12} {:>12} {:>12} {:>7.1}%{}",
            v.name,
            human(v.logical_bytes),
            human(v.written_bytes),
            human(v.physical_bytes),
            v.saving_percent,
            if importing(pool, &v.name) {
                "  (incomplete import)"
            } else {
                ""
            }
        );
    }
    o
}

/// The files under `files/` of a pool's hidden `.file.N` volumes, for reports that name
/// damage by volume (empty when no such volume is named: the tree is not read then).
pub struct FileNames(std::collections::HashMap<String, String>);

impl FileNames {
    pub fn of<'a>(pool: &Pool, named: impl IntoIterator<Item = &'a str>) -> FileNames {
        let wanted = named.into_iter().any(|v| v.starts_with(".file."));
        FileNames(if wanted {
            condense_fuse::tree::file_paths(pool, 10_000_000)
        } else {
            Default::default()
        })
    }

    pub fn none() -> FileNames {
        FileNames(Default::default())
    }

    /// The file of volume `v` (a snapshot's `.file.N@S` names the file too).
    pub fn get(&self, v: &str) -> Option<&str> {
        let base = v.split_once('@').map_or(v, |(b, _)| b);
        self.0.get(base).map(String::as_str)
    }

    /// `v`, or `v (files/path)` for a file's volume.
    pub fn show(&self, v: &str) -> String {
        match self.get(v) {
            Some(f) => format!("{v} ({f})"),
            None => v.to_string(),
        }
    }
}

pub fn verify_json(r: &VerifyReport, files: &FileNames) -> Value {
    json!({
        "clean": r.is_clean(),
        "chunks_checked": r.chunks_checked,
        "bytes_checked": r.bytes_checked,
        "bad_chunks": r.bad_chunks.iter().map(|(id, why)| json!({"chunk": id, "problem": why})).collect::<Vec<_>>(),
        "bad_blocks": r.bad_blocks.iter().map(|(v, b)| json!({"volume": v, "file": files.get(v), "blocks": b})).collect::<Vec<_>>(),
        "bad_volumes": r.bad_volumes,
        "metadata_problems": r.metadata_problems,
        "accepted_damage": damage_history_json(&r.accepted),
    })
}

/// What earlier repairs lost (the pool's damage history), as `verify --json` and
/// `repair --history --json` print it.
pub fn damage_history_json(h: &[condense_engine::repair::DamageRecord]) -> Value {
    h.iter()
        .map(|d| {
            json!({
                "repaired": d.when,
                "lost": d.lost.iter().map(|l| json!({
                    "volume": l.volume,
                    "first_block": l.first_block,
                    "blocks": l.blocks,
                    "reason": l.reason,
                })).collect::<Vec<_>>(),
            })
        })
        .collect()
}

/// The losses earlier repairs accepted, one line per range (at most 20 in all).
fn accepted_text(r: &VerifyReport, o: &mut String) {
    if r.accepted.is_empty() {
        return;
    }
    let _ = writeln!(
        o,
        "damage accepted by earlier repairs (each line says how those blocks read now; `condense repair --clear-history` forgets them):"
    );
    let mut shown = 0;
    for d in &r.accepted {
        for l in &d.lost {
            if shown < 20 {
                let _ = writeln!(
                    o,
                    "  repair {}: volume {} blocks {}-{}: {}",
                    d.when,
                    l.volume,
                    l.first_block,
                    l.first_block + l.blocks.saturating_sub(1),
                    l.reason
                );
            }
            shown += 1;
        }
    }
    if shown > 20 {
        let _ = writeln!(o, "  ... and {} more ranges", shown - 20);
    }
}

pub fn verify_text(r: &VerifyReport, files: &FileNames) -> String {
    let mut o = format!(
        "checked {} chunks ({})\n",
        r.chunks_checked,
        human(r.bytes_checked)
    );
    if r.is_clean() {
        o.push_str("no damage found\n");
        accepted_text(r, &mut o);
        return o;
    }
    for p in &r.metadata_problems {
        let _ = writeln!(o, "metadata: {p}");
    }
    for (id, why) in r.bad_chunks.iter().take(20) {
        let _ = writeln!(o, "chunk {id}: {why}");
    }
    if r.bad_chunks.len() > 20 {
        let _ = writeln!(o, "... and {} more damaged chunks", r.bad_chunks.len() - 20);
    }
    for v in &r.bad_volumes {
        let _ = writeln!(o, "volume {v}: block map damaged, every block unreadable");
    }
    for (v, blocks) in &r.bad_blocks {
        let shown: Vec<String> = blocks.iter().take(16).map(|b| b.to_string()).collect();
        let _ = writeln!(
            o,
            "volume {}: {} damaged blocks: {}{}",
            files.show(v),
            blocks.len(),
            shown.join(", "),
            if blocks.len() > 16 { ", ..." } else { "" }
        );
    }
    o.push_str("reads of damaged blocks fail with an I/O error; other blocks read normally. Stop the pool's users and run `condense repair --dry-run`, then `condense repair`: it keeps everything valid and names what is lost (restore that from a backup).\n");
    accepted_text(r, &mut o);
    o
}

/// The file where a running `serve` or `mount` publishes the pool's statistics, so that
/// `condense stats` works while the pool is locked by it.
pub const STATUS_FILE: &str = "status.json";
const STATUS_PERIOD_SECS: u64 = 10;

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Publishes `stats --json` of a pool every few seconds until dropped (then removes it).
pub struct StatusWriter {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    path: std::path::PathBuf,
}

impl StatusWriter {
    pub fn start(pool: &std::sync::Arc<Pool>, dir: &std::path::Path) -> StatusWriter {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        // An encrypted pool keeps its volume names off the disk: no status file (`stats`
        // still answers through the control socket).
        if pool.superblock().is_encrypted() {
            flag.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let weak = std::sync::Arc::downgrade(pool);
        let path = dir.join(STATUS_FILE);
        let out = path.clone();
        let thread = std::thread::spawn(move || {
            let mut ticks = STATUS_PERIOD_SECS * 5;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                if ticks >= STATUS_PERIOD_SECS * 5 {
                    ticks = 0;
                    let Some(pool) = weak.upgrade() else { return };
                    if let Ok(stats) = pool.stats() {
                        let mut j = stats_json(&stats, None);
                        j["published_unix"] = json!(now_unix());
                        j["pid"] = json!(std::process::id());
                        let tmp = out.with_extension("json.tmp");
                        if condense_engine::io::write_private(&tmp, j.to_string().as_bytes())
                            .is_ok()
                        {
                            let _ = std::fs::rename(&tmp, &out);
                        }
                    }
                }
                ticks += 1;
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
        });
        StatusWriter {
            stop,
            thread: Some(thread),
            path,
        }
    }
}

impl Drop for StatusWriter {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Statistics published by the process holding the pool: (stats, age in seconds, pid).
pub fn read_status(dir: &std::path::Path) -> Result<(PoolStats, u64, u64), String> {
    let text = std::fs::read_to_string(dir.join(STATUS_FILE))
        .map_err(|_| "and it publishes no statistics (is it an older condense?)".to_string())?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| format!("its published statistics are unreadable: {e}"))?;
    let age = now_unix().saturating_sub(v["published_unix"].as_u64().unwrap_or(0));
    if age > 10 * STATUS_PERIOD_SECS {
        return Err(format!(
            "its published statistics are {age} s old: the process may be hung"
        ));
    }
    let u = |j: &Value, k: &str| j[k].as_u64().unwrap_or(0);
    let f = |j: &Value, k: &str| j[k].as_f64().unwrap_or(0.0);
    let volumes = v["volumes"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|j| VolumeStats {
                    name: j["name"].as_str().unwrap_or_default().to_string(),
                    logical_bytes: u(j, "logical_bytes"),
                    written_bytes: u(j, "written_bytes"),
                    zero_bytes: u(j, "zero_bytes"),
                    physical_bytes: u(j, "physical_bytes"),
                    saving_percent: f(j, "saving_percent"),
                    snapshot_of: None,
                    ..Default::default()
                })
                .collect()
        })
        .unwrap_or_default();
    let stats = PoolStats {
        snapshots: Vec::new(),
        block_size: u(&v, "block_size") as u32,
        logical_bytes: u(&v, "logical_bytes"),
        written_bytes: u(&v, "written_bytes"),
        zero_bytes: u(&v, "zero_bytes"),
        unique_chunks: u(&v, "unique_chunks"),
        stored_bytes: u(&v, "stored_bytes"),
        data_bytes: u(&v, "data_bytes"),
        metadata_bytes: u(&v, "metadata_bytes"),
        physical_bytes: u(&v, "physical_bytes"),
        dead_bytes: u(&v, "dead_bytes"),
        segments: u(&v, "segments"),
        dedup_saving_percent: f(&v, "dedup_saving_percent"),
        compression_saving_percent: f(&v, "compression_saving_percent"),
        saving_percent: f(&v, "saving_percent"),
        index_ram_bytes: u(&v, "index_ram_bytes"),
        ram_bytes_per_unique_chunk: f(&v, "ram_bytes_per_unique_chunk"),
        dedup_index_bytes: u(&v, "dedup_index_bytes"),
        dedup_index: v["dedup_index"].as_str().unwrap_or_default().to_string(),
        metadata_cache_budget_bytes: u(&v, "metadata_cache_budget_bytes"),
        metadata_cache_used_bytes: u(&v, "metadata_cache_used_bytes"),
        metadata_cache_hits: u(&v, "metadata_cache_hits"),
        metadata_cache_misses: u(&v, "metadata_cache_misses"),
        metadata_page_bytes_written: u(&v, "metadata_page_bytes_written"),
        metadata_page_bytes_live: u(&v, "metadata_page_bytes_live"),
        checkpoints: u(&v, "checkpoints"),
        read_errors: u(&v, "read_errors"),
        volumes,
        remote: None,
        scrub: v.get("scrub").map(scrub_from_json).unwrap_or_default(),
        ..Default::default()
    };
    Ok((stats, age, u(&v, "pid")))
}

/// The parts of a pool several hosts share and the whole pool, for `stats` (key
/// `shared_pool`, docs/STATS.md).
pub fn hosts_json(hosts: &[condense_engine::hosts::HostOverview]) -> Value {
    let rows: Vec<Value> = hosts
        .iter()
        .map(|h| {
            json!({
                "slot": h.slot, "host": h.host, "this_host": h.this_host,
                "volumes": h.volumes, "snapshots": h.snapshots,
                "written_bytes": h.written_bytes, "bucket_bytes": h.bucket_bytes,
                "forgotten": h.forgotten, "hand_overs": h.notes,
            })
        })
        .collect();
    let written: u64 = hosts.iter().map(|h| h.written_bytes).sum();
    let bucket: u64 = hosts.iter().map(|h| h.bucket_bytes).sum();
    json!({
        "hosts": rows,
        "whole_pool": {
            "hosts": hosts.len(),
            "volumes": hosts.iter().map(|h| h.volumes).sum::<u64>(),
            "written_bytes": written,
            "bucket_bytes": bucket,
            "saving_percent": round2(100.0 * (1.0 - bucket as f64 / written.max(1) as f64)),
        },
    })
}

/// [`hosts_json`] as text.
pub fn hosts_text(hosts: &[condense_engine::hosts::HostOverview]) -> String {
    let mut o = String::new();
    let written: u64 = hosts.iter().map(|h| h.written_bytes).sum();
    let bucket: u64 = hosts.iter().map(|h| h.bucket_bytes).sum();
    let _ = writeln!(
        o,
        "shared pool: {} hosts (`condense hosts` for leases and publication)",
        hosts.len()
    );
    for h in hosts {
        let _ = writeln!(
            o,
            "  {:<24} {:>4} volumes  {:>10} written  {:>10} in the bucket",
            if h.this_host {
                format!("{} (this host)", h.host)
            } else {
                h.host.clone()
            },
            h.volumes,
            human(h.written_bytes),
            human(h.bucket_bytes)
        );
    }
    let _ = writeln!(
        o,
        "  {:<24} {:>4} volumes  {:>10} written  {:>10} in the bucket ({:.1} % saved across hosts)",
        "whole pool",
        hosts.iter().map(|h| h.volumes).sum::<u64>(),
        human(written),
        human(bucket),
        100.0 * (1.0 - bucket as f64 / written.max(1) as f64)
    );
    for h in hosts {
        if let Some(f) = &h.forgotten {
            let _ = writeln!(o, "  host {}: {f}", h.host);
        }
        for n in &h.notes {
            let _ = writeln!(o, "  unfinished: {n}");
        }
    }
    o
}
