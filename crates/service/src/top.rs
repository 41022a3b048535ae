//! The data side of `condense top`: the I/O counters a daemon gives, and the rows they make.
//!
//! Owns: the request `top --counters`, answered inside the daemon by [`counters`] with its
//! per-volume totals ([`Sample`]) and asked for by [`sample`] through the control socket;
//! turning two samples into rates, latency percentiles and reduction ratios ([`rows`], one
//! [`Row`] per volume); a row as a line of the table ([`Row::line`]) and as JSON ([`Interval`],
//! keys in docs/TOP.md). The CLI draws them (crates/cli/src/top.rs).
//!
//! Invariants: the daemon only ever sends totals since it opened the pool
//! (`condense_engine::volume_counters`); a rate is the difference of two samples divided by the time
//! between them as the client measured it; a total that went down (a volume deleted and made
//! again) counts from zero. Latency percentiles are interpolated inside log2 buckets of
//! microseconds, so they are good to a factor of two at worst.

use crate::control::Ctx;
use crate::error::{io, Context, Result, ServiceError};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One sample of the daemon's counters (totals since it opened the pool).
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct Sample {
    block_size: u64,
    cache_tier: bool,
    volumes: Vec<VolumeSample>,
    /// Deleted volumes' maps being released in the background (absent from older daemons).
    #[serde(default)]
    releasing: Vec<Releasing>,
}

/// A deleted volume's map still being released (`condense_engine::pool::release`).
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct Releasing {
    name: String,
    data_blocks: u64,
    blocks_left: u64,
}

impl Sample {
    /// A line on what is still being released, if anything is.
    pub fn releasing_note(&self) -> Option<String> {
        let parts: Vec<String> = self
            .releasing
            .iter()
            .map(|r| {
                format!(
                    "{} ({} of {} blocks left)",
                    r.name, r.blocks_left, r.data_blocks
                )
            })
            .collect();
        (!parts.is_empty()).then(|| format!("being released: {}", parts.join(", ")))
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, Default)]
struct VolumeSample {
    name: String,
    read: OpSample,
    write: OpSample,
    zero: OpSample,
    errors: u64,
    zero_blocks: u64,
    dedup_blocks: u64,
    new_blocks: u64,
    new_stored_bytes: u64,
    cache_hits: u64,
    cache_misses: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default)]
struct OpSample {
    ops: u64,
    bytes: u64,
    /// Operations per log2 bucket of microseconds (`condense_engine::volume_counters::Latency`).
    latency: Vec<u64>,
}

impl From<&condense_engine::OpValues> for OpSample {
    fn from(v: &condense_engine::OpValues) -> OpSample {
        OpSample {
            ops: v.ops,
            bytes: v.bytes,
            latency: v.latency.to_vec(),
        }
    }
}

/// `top --counters` inside the daemon: its totals as one JSON line.
pub fn counters(ctx: &mut Ctx) -> Result<i32> {
    if !ctx.in_daemon() {
        return Err(ServiceError::Control(no_server(&ctx.path)));
    }
    // The held pool; no `ctx.done`: a look at counters must not flush it every second.
    let pool = ctx.pool(true)?;
    let sample = Sample {
        block_size: u64::from(pool.block_size()),
        cache_tier: pool.has_cache_tier(),
        volumes: pool
            .volume_io()
            .into_iter()
            .map(|(name, v)| VolumeSample {
                name,
                read: (&v.read).into(),
                write: (&v.write).into(),
                zero: (&v.zero).into(),
                errors: v.errors,
                zero_blocks: v.zero_blocks,
                dedup_blocks: v.dedup_blocks,
                new_blocks: v.new_blocks,
                new_stored_bytes: v.new_stored_bytes,
                cache_hits: v.cache_hits,
                cache_misses: v.cache_misses,
            })
            .collect(),
        releasing: pool
            .pending_releases()
            .into_iter()
            .map(|r| Releasing {
                name: r.name,
                data_blocks: r.data_blocks,
                blocks_left: r.blocks_left,
            })
            .collect(),
    };
    let line = serde_json::to_string(&sample).context("cannot encode the I/O counters")?;
    writeln!(ctx.out, "{line}").map_err(io("cannot write the output"))?;
    Ok(0)
}

pub fn no_server(pool: &Path) -> String {
    format!(
        "no `condense serve` or `condense mount` holds pool {p} (nothing answers on {p}/{s}); \
         `condense top` shows the I/O of a served pool: start `condense --pool {p} serve` (or \
         `mount`) first",
        p = pool.display(),
        s = crate::control::SOCKET_NAME
    )
}

// ---------------------------------------------------------------------------------------------
// The client's side.

/// One volume over one interval.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Row {
    pub name: String,
    secs: f64,
    block_size: u64,
    read: OpDelta,
    write: OpDelta,
    zero: OpDelta,
    errors: u64,
    zero_blocks: u64,
    dedup_blocks: u64,
    new_blocks: u64,
    new_stored_bytes: u64,
    /// `None` when the pool has no cache tier.
    cache: Option<(u64, u64)>,
}

#[derive(Clone, Debug, Default, PartialEq)]
struct OpDelta {
    ops: u64,
    bytes: u64,
    p50_us: Option<f64>,
    p99_us: Option<f64>,
}

/// `now - before`, or `now` when the total went down (it restarted from zero).
fn delta(now: u64, before: u64) -> u64 {
    now.checked_sub(before).unwrap_or(now)
}

impl OpDelta {
    fn between(now: &OpSample, before: Option<&OpSample>) -> OpDelta {
        let restarted = before.is_none_or(|b| now.ops < b.ops);
        let buckets: Vec<u64> = if restarted {
            now.latency.clone()
        } else {
            let b = before.map_or(&[][..], |b| &b.latency[..]);
            now.latency
                .iter()
                .enumerate()
                .map(|(i, &n)| delta(n, b.get(i).copied().unwrap_or(0)))
                .collect()
        };
        let (ops, bytes) = match before {
            Some(b) if !restarted => (delta(now.ops, b.ops), delta(now.bytes, b.bytes)),
            _ => (now.ops, now.bytes),
        };
        OpDelta {
            ops,
            bytes,
            p50_us: percentile(&buckets, 0.50),
            p99_us: percentile(&buckets, 0.99),
        }
    }
}

/// The `q` quantile of a log2 histogram of microseconds (bucket `i` holds `[2^(i-1), 2^i)`,
/// bucket 0 `[0, 1)`), interpolated linearly inside its bucket; `None` when it is empty.
fn percentile(buckets: &[u64], q: f64) -> Option<f64> {
    let total: u64 = buckets.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = q * total as f64;
    let mut seen = 0u64;
    for (i, &n) in buckets.iter().enumerate() {
        if n == 0 {
            continue;
        }
        if (seen + n) as f64 >= rank {
            let lo = if i == 0 { 0.0 } else { (i as f64 - 1.0).exp2() };
            let hi = (i as f64).exp2();
            let within = ((rank - seen as f64) / n as f64).clamp(0.0, 1.0);
            return Some(lo + (hi - lo) * within);
        }
        seen += n;
    }
    None
}

/// One row per volume of `now` over the `secs` since `before`, busiest first.
pub fn rows(before: &Sample, now: &Sample, secs: f64, all: bool) -> Vec<Row> {
    let mut rows: Vec<Row> = now
        .volumes
        .iter()
        .filter(|v| all || !v.name.starts_with('.'))
        .map(|v| {
            let b = before.volumes.iter().find(|b| b.name == v.name);
            let d = |f: fn(&VolumeSample) -> u64| delta(f(v), b.map_or(0, f));
            Row {
                name: v.name.clone(),
                secs,
                block_size: now.block_size,
                read: OpDelta::between(&v.read, b.map(|b| &b.read)),
                write: OpDelta::between(&v.write, b.map(|b| &b.write)),
                zero: OpDelta::between(&v.zero, b.map(|b| &b.zero)),
                errors: d(|v| v.errors),
                zero_blocks: d(|v| v.zero_blocks),
                dedup_blocks: d(|v| v.dedup_blocks),
                new_blocks: d(|v| v.new_blocks),
                new_stored_bytes: d(|v| v.new_stored_bytes),
                cache: now
                    .cache_tier
                    .then(|| (d(|v| v.cache_hits), d(|v| v.cache_misses))),
            }
        })
        .collect();
    rows.sort_by(|a, b| {
        b.ops()
            .cmp(&a.ops())
            .then(b.bytes().cmp(&a.bytes()))
            .then(a.name.cmp(&b.name))
    });
    rows
}

impl Row {
    fn ops(&self) -> u64 {
        self.read.ops + self.write.ops + self.zero.ops
    }
    fn bytes(&self) -> u64 {
        self.read.bytes + self.write.bytes
    }
    fn per_sec(&self, n: u64) -> f64 {
        n as f64 / self.secs
    }
    fn mib_per_sec(&self, bytes: u64) -> f64 {
        self.per_sec(bytes) / (1u64 << 20) as f64
    }
    /// Of the blocks written that held data, the share the pool had already.
    fn dedup_ratio(&self) -> Option<f64> {
        let data = self.dedup_blocks + self.new_blocks;
        (data > 0).then(|| self.dedup_blocks as f64 / data as f64)
    }
    /// Bytes of the new blocks over the bytes stored for them.
    fn compression_ratio(&self) -> Option<f64> {
        (self.new_stored_bytes > 0)
            .then(|| (self.new_blocks * self.block_size) as f64 / self.new_stored_bytes as f64)
    }
    fn cache_hit_ratio(&self) -> Option<f64> {
        let (hits, misses) = self.cache?;
        (hits + misses > 0).then(|| hits as f64 / (hits + misses) as f64)
    }
}

/// One volume over one interval as `top --json` gives it (docs/TOP.md).
#[derive(Serialize)]
struct RowJson<'a> {
    name: &'a str,
    read_ops: u64,
    write_ops: u64,
    zero_ops: u64,
    read_bytes: u64,
    write_bytes: u64,
    zero_bytes: u64,
    read_iops: f64,
    write_iops: f64,
    read_mib_s: f64,
    write_mib_s: f64,
    read_p50_us: Option<f64>,
    read_p99_us: Option<f64>,
    write_p50_us: Option<f64>,
    write_p99_us: Option<f64>,
    zero_blocks: u64,
    dedup_blocks: u64,
    new_blocks: u64,
    new_stored_bytes: u64,
    dedup_hit_ratio: Option<f64>,
    compression_ratio: Option<f64>,
    cache_hits: Option<u64>,
    cache_misses: Option<u64>,
    cache_hit_ratio: Option<f64>,
    errors: u64,
}

/// `x` to a thousandth, as `top --json` gives rates and times.
fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

impl Serialize for Row {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let opt = |v: Option<f64>| v.map(round3);
        RowJson {
            name: &self.name,
            read_ops: self.read.ops,
            write_ops: self.write.ops,
            zero_ops: self.zero.ops,
            read_bytes: self.read.bytes,
            write_bytes: self.write.bytes,
            zero_bytes: self.zero.bytes,
            read_iops: round3(self.per_sec(self.read.ops)),
            write_iops: round3(self.per_sec(self.write.ops)),
            read_mib_s: round3(self.mib_per_sec(self.read.bytes)),
            write_mib_s: round3(self.mib_per_sec(self.write.bytes)),
            read_p50_us: opt(self.read.p50_us),
            read_p99_us: opt(self.read.p99_us),
            write_p50_us: opt(self.write.p50_us),
            write_p99_us: opt(self.write.p99_us),
            zero_blocks: self.zero_blocks,
            dedup_blocks: self.dedup_blocks,
            new_blocks: self.new_blocks,
            new_stored_bytes: self.new_stored_bytes,
            dedup_hit_ratio: opt(self.dedup_ratio()),
            compression_ratio: opt(self.compression_ratio()),
            cache_hits: self.cache.map(|c| c.0),
            cache_misses: self.cache.map(|c| c.1),
            cache_hit_ratio: opt(self.cache_hit_ratio()),
            errors: self.errors,
        }
        .serialize(s)
    }
}

/// One interval of `top --json`: when, over how long, which pool, every volume's row.
#[derive(Serialize)]
pub struct Interval<'a> {
    unix_time: f64,
    interval_s: f64,
    pool: String,
    volumes: &'a [Row],
    releasing: &'a [Releasing],
}

impl<'a> Interval<'a> {
    pub fn new(
        unix_time: f64,
        secs: f64,
        pool: &Path,
        volumes: &'a [Row],
        now: &'a Sample,
    ) -> Interval<'a> {
        Interval {
            unix_time: round3(unix_time),
            interval_s: round3(secs),
            pool: pool.display().to_string(),
            volumes,
            releasing: &now.releasing,
        }
    }
}

/// The table's columns: header and width.
const COLUMNS: [(&str, usize); 12] = [
    ("r/s", 8),
    ("w/s", 8),
    ("rMiB/s", 8),
    ("wMiB/s", 8),
    ("r_p50", 7),
    ("r_p99", 7),
    ("w_p50", 7),
    ("w_p99", 7),
    ("dedup", 6),
    ("comp", 6),
    ("cache", 6),
    ("err", 5),
];

/// A latency in microseconds, short: `850us`, `1.2ms`, `3.4s`; `-` for none.
fn latency(us: Option<f64>) -> String {
    match us {
        None => "-".into(),
        Some(us) if us < 1000.0 => format!("{us:.0}us"),
        Some(us) if us < 1e6 => format!("{:.1}ms", us / 1e3),
        Some(us) => format!("{:.1}s", us / 1e6),
    }
}

fn percent(r: Option<f64>) -> String {
    r.map_or("-".into(), |r| format!("{:.0}%", r * 100.0))
}

pub fn header(name_width: usize) -> String {
    let mut s = format!("{:<name_width$}", "VOLUME");
    for (h, w) in COLUMNS {
        s += &format!(" {h:>w$}");
    }
    s
}

impl Row {
    pub fn line(&self, name_width: usize) -> String {
        let cells = [
            format!("{:.0}", self.per_sec(self.read.ops)),
            format!("{:.0}", self.per_sec(self.write.ops)),
            format!("{:.1}", self.mib_per_sec(self.read.bytes)),
            format!("{:.1}", self.mib_per_sec(self.write.bytes)),
            latency(self.read.p50_us),
            latency(self.read.p99_us),
            latency(self.write.p50_us),
            latency(self.write.p99_us),
            percent(self.dedup_ratio()),
            self.compression_ratio()
                .map_or("-".into(), |c| format!("{c:.2}x")),
            percent(self.cache_hit_ratio()),
            self.errors.to_string(),
        ];
        let mut s = format!("{:<name_width$}", self.name);
        for (cell, (_, w)) in cells.iter().zip(COLUMNS) {
            s += &format!(" {cell:>w$}");
        }
        s
    }
}

pub fn name_width(rows: &[Row]) -> usize {
    rows.iter()
        .map(|r| r.name.chars().count())
        .max()
        .unwrap_or(0)
        .max(12)
}

/// Seconds since the Unix epoch now, and the time of day (UTC) as `HH:MM:SS`.
pub fn now_utc() -> (f64, String) {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let s = t.as_secs() % 86_400;
    (
        t.as_secs_f64(),
        format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60),
    )
}

/// Ask the daemon holding `pool` for its totals.
pub fn sample(pool: &Path, argv: &[String]) -> Result<Sample> {
    let reply =
        crate::control::ask(pool, argv)?.ok_or_else(|| ServiceError::Control(no_server(pool)))?;
    if reply.code != 0 {
        return Err(ServiceError::Control(format!(
            "the process holding pool {} did not give its I/O counters (an older condense?): {}",
            pool.display(),
            reply.stderr.trim()
        )));
    }
    serde_json::from_str(&reply.stdout).with_context(|| {
        format!(
            "unreadable I/O counters from the process holding pool {}",
            pool.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(ops: u64, bytes: u64, bucket: usize) -> OpSample {
        let mut latency = vec![0; condense_engine::LATENCY_BUCKETS];
        latency[bucket] = ops;
        OpSample {
            ops,
            bytes,
            latency,
        }
    }

    fn vol(name: &str, write: OpSample) -> VolumeSample {
        VolumeSample {
            name: name.into(),
            write,
            ..Default::default()
        }
    }

    #[test]
    fn percentiles_interpolate_inside_log2_buckets() {
        let mut b = vec![0u64; 32];
        assert_eq!(percentile(&b, 0.5), None);
        b[7] = 100; // [64, 128) us
        assert_eq!(percentile(&b, 0.5), Some(96.0));
        b[20] = 2; // two slow ones: [2^19, 2^20) us
        let p99 = percentile(&b, 0.99).unwrap_or_default();
        assert!((524_288.0..=1_048_576.0).contains(&p99), "{p99}");
        assert!(percentile(&b, 0.5).unwrap_or_default() < 128.0);
    }

    #[test]
    fn rows_are_differences_busiest_first_and_restarts_count_from_zero() {
        let before = Sample {
            block_size: 4096,
            cache_tier: false,
            volumes: vec![vol("idle", op(5, 20480, 3)), vol("busy", op(10, 40960, 5))],
            releasing: Vec::new(),
        };
        let now = Sample {
            block_size: 4096,
            cache_tier: false,
            volumes: vec![
                vol("idle", op(5, 20480, 3)),
                vol("busy", op(110, 450560, 5)),
                // First seen now: counted from zero.
                vol("new", op(3, 12288, 2)),
                vol(".internal", op(1, 4096, 2)),
            ],
            releasing: Vec::new(),
        };
        let r = rows(&before, &now, 2.0, false);
        let names: Vec<&str> = r.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["busy", "new", "idle"]);
        assert_eq!((r[0].write.ops, r[0].write.bytes), (100, 409600));
        assert_eq!(r[0].per_sec(r[0].write.ops), 50.0);
        assert_eq!(r[2].write.ops, 0);
        assert_eq!(r[2].write.p50_us, None);
        assert_eq!(r[1].write.ops, 3);
        assert_eq!(r[0].cache_hit_ratio(), None);
        // A volume deleted and made again: its totals went down.
        let r = rows(&now, &before, 1.0, true);
        let busy = r.iter().find(|r| r.name == "busy").map(|r| r.write.ops);
        assert_eq!(busy, Some(10));
        assert_eq!(r.len(), 2);
    }

    #[test]
    fn reduction_ratios() {
        let row = Row {
            secs: 1.0,
            block_size: 4096,
            dedup_blocks: 3,
            new_blocks: 1,
            new_stored_bytes: 2048,
            cache: Some((9, 1)),
            ..Default::default()
        };
        assert_eq!(row.dedup_ratio(), Some(0.75));
        assert_eq!(row.compression_ratio(), Some(2.0));
        assert_eq!(row.cache_hit_ratio(), Some(0.9));
        let line = row.line(12);
        assert!(
            line.contains("75%") && line.contains("2.00x") && line.contains("90%"),
            "{line}"
        );
        assert!(!line.contains('\x1b'));
    }
}
