//! `POOL/status.json`: what a running `serve` or `mount` publishes about its pool, so that
//! `condense stats` from an older condense (or any reader) sees figures while the daemon holds
//! the pool's lock. Advisory: every figure is also answered live through the control socket,
//! and nothing reads this file to decide anything (docs/FORMAT.md "status.json").
//!
//! Owns: [`StatusWriter`] (the daemon's publisher) and [`read_status`] (the reader `stats`
//! falls back on). Invariants: the file is replaced whole (written to `status.json.tmp`, mode
//! 0600, then renamed), never published for an encrypted pool (it would name its volumes on
//! disk), and removed when the daemon stops.

use crate::render::now_unix;
use crate::render::stats::StatsReport;
use condense_engine::scrub::{ScrubPass, ScrubStatus};
use condense_engine::{Pool, PoolStats, VolumeStats};
use serde::Serialize;
use serde_json::Value;

/// The file where a running `serve` or `mount` publishes the pool's statistics, so that
/// `condense stats` works while the pool is locked by it.
pub const STATUS_FILE: &str = "status.json";
const STATUS_PERIOD_SECS: u64 = 10;

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
                        publish(&stats, &out);
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

/// The file's content: `stats --json` of the pool, when and by whom it was published.
#[derive(Serialize)]
struct StatusFile<'a> {
    #[serde(flatten)]
    stats: StatsReport<'a>,
    published_unix: u64,
    pid: u32,
}

/// Replace the status file `out` with `stats`, now, by this process.
fn publish(stats: &PoolStats, out: &std::path::Path) {
    let file = StatusFile {
        stats: StatsReport::pool(stats),
        published_unix: now_unix(),
        pid: std::process::id(),
    };
    let Ok(text) = crate::render::json_line(&file) else {
        return;
    };
    let tmp = out.with_extension("json.tmp");
    if condense_engine::io::write_private(&tmp, text.as_bytes()).is_ok() {
        let _ = std::fs::rename(&tmp, out);
    }
}

/// A scrub status as [`ScrubReport`](crate::render::scrub::ScrubReport) printed it (the status file of a running daemon).
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
