//! `condense top` (alias `iostat`): a live per-volume view of the I/O of a served pool.
//!
//! Owns: asking the daemon that holds the pool (`serve`, `mount`) for its per-volume I/O
//! counters through the control socket, once per interval (the request `top --counters`,
//! answered inside the daemon by [`counters`]); turning two samples into rates, latency
//! percentiles and reduction ratios ([`Row`]); and showing them: a full-screen view on a
//! terminal (busiest volume first; `q`, Ctrl-C, SIGTERM or SIGHUP quits and restores the
//! terminal), one JSON object per interval (`--json`, keys in docs/TOP.md), or one plain line
//! per volume per interval (`--plain`, the default when standard output is not a terminal).
//!
//! Invariants: the daemon only ever sends totals since it opened the pool
//! (`condense_engine::volume_io`); a rate is the difference of two samples divided by the time
//! between them as this process measured it; a total that went down (a volume deleted and
//! made again) counts from zero. Latency percentiles are interpolated inside log2 buckets of
//! microseconds, so they are good to a factor of two at worst.

use crate::control::{self, Ctx};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct TopArgs {
    /// One JSON object per interval, for scripts (keys in docs/TOP.md).
    #[arg(long, conflicts_with = "plain")]
    json: bool,
    /// One plain line per volume per interval, no escape codes (for logs; the default when
    /// standard output is not a terminal).
    #[arg(long)]
    plain: bool,
    /// Seconds between reports (0.1 or more).
    #[arg(long, default_value_t = 1.0, value_parser = parse_interval)]
    interval: f64,
    /// Stop after this many reports (default: until q, Ctrl-C or the end of the output).
    #[arg(long)]
    count: Option<u64>,
    /// Also show internal volumes (names starting with '.', such as FUSE file contents).
    #[arg(long)]
    all: bool,
    /// Print the daemon's totals once, as one JSON line (what `top` asks for every interval).
    #[arg(long, hide = true)]
    counters: bool,
}

impl TopArgs {
    /// The request `top` sends the daemon (answered by [`counters`]).
    pub fn counters(&self) -> bool {
        self.counters
    }
}

fn parse_interval(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.1..=3600.0).contains(&v) => Ok(v),
        _ => Err(format!(
            "invalid interval {s:?}: give seconds between 0.1 and 3600, e.g. 1 or 0.5"
        )),
    }
}

pub const LONG_ABOUT: &str = "Show, every second, what each volume of a served pool is doing: \
read and write operations per second and MiB/s, latency percentiles (p50, p99) of reads and \
writes as the Volume API sees them (under NBD and FUSE alike), how much of what was written \
deduplicated and how well new data compressed, and the cache tier's hit ratio for the volume's \
reads. Busiest volume first.\n\n\
It reads the counters of the `condense serve` or `condense mount` process that holds the pool, \
through its control socket (POOL/control.sock); without one it says so. The counters start when \
that process opened the pool.\n\n\
On a terminal: a full-screen view, q or Ctrl-C quits. Otherwise (or with --plain) one line per \
volume per interval, for logs; --json gives one JSON object per interval (docs/TOP.md).";

// ---------------------------------------------------------------------------------------------
// The daemon's side: totals.

/// One sample of the daemon's counters (totals since it opened the pool).
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
struct Sample {
    block_size: u64,
    cache_tier: bool,
    volumes: Vec<VolumeSample>,
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
    /// Operations per log2 bucket of microseconds (`condense_engine::volume_io::Latency`).
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
        bail!("{}", no_server(&ctx.path));
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
    };
    writeln!(ctx.out, "{}", serde_json::to_string(&sample)?)?;
    Ok(0)
}

fn no_server(pool: &Path) -> String {
    format!(
        "no `condense serve` or `condense mount` holds pool {p} (nothing answers on {p}/{s}); \
         `condense top` shows the I/O of a served pool: start `condense --pool {p} serve` (or \
         `mount`) first",
        p = pool.display(),
        s = control::SOCKET_NAME
    )
}

// ---------------------------------------------------------------------------------------------
// The client's side.

/// One volume over one interval.
#[derive(Clone, Debug, Default, PartialEq)]
struct Row {
    name: String,
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
fn rows(before: &Sample, now: &Sample, secs: f64, all: bool) -> Vec<Row> {
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

    fn json(&self) -> serde_json::Value {
        let round = |v: f64| (v * 1000.0).round() / 1000.0;
        let opt = |v: Option<f64>| v.map(round);
        json!({
            "name": self.name,
            "read_ops": self.read.ops,
            "write_ops": self.write.ops,
            "zero_ops": self.zero.ops,
            "read_bytes": self.read.bytes,
            "write_bytes": self.write.bytes,
            "zero_bytes": self.zero.bytes,
            "read_iops": round(self.per_sec(self.read.ops)),
            "write_iops": round(self.per_sec(self.write.ops)),
            "read_mib_s": round(self.mib_per_sec(self.read.bytes)),
            "write_mib_s": round(self.mib_per_sec(self.write.bytes)),
            "read_p50_us": opt(self.read.p50_us),
            "read_p99_us": opt(self.read.p99_us),
            "write_p50_us": opt(self.write.p50_us),
            "write_p99_us": opt(self.write.p99_us),
            "zero_blocks": self.zero_blocks,
            "dedup_blocks": self.dedup_blocks,
            "new_blocks": self.new_blocks,
            "new_stored_bytes": self.new_stored_bytes,
            "dedup_hit_ratio": opt(self.dedup_ratio()),
            "compression_ratio": opt(self.compression_ratio()),
            "cache_hits": self.cache.map(|c| c.0),
            "cache_misses": self.cache.map(|c| c.1),
            "cache_hit_ratio": opt(self.cache_hit_ratio()),
            "errors": self.errors,
        })
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

fn header(name_width: usize) -> String {
    let mut s = format!("{:<name_width$}", "VOLUME");
    for (h, w) in COLUMNS {
        s += &format!(" {h:>w$}");
    }
    s
}

impl Row {
    fn line(&self, name_width: usize) -> String {
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

fn name_width(rows: &[Row]) -> usize {
    rows.iter()
        .map(|r| r.name.chars().count())
        .max()
        .unwrap_or(0)
        .max(12)
}

/// Seconds since the Unix epoch now, and the time of day (UTC) as `HH:MM:SS`.
fn now_utc() -> (f64, String) {
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
fn sample(pool: &Path, argv: &[String]) -> Result<Sample> {
    let reply = control::ask(pool, argv)?.with_context(|| no_server(pool))?;
    if reply.code != 0 {
        bail!(
            "the process holding pool {} did not give its I/O counters (an older condense?): {}",
            pool.display(),
            reply.stderr.trim()
        );
    }
    serde_json::from_str(&reply.stdout).with_context(|| {
        format!(
            "unreadable I/O counters from the process holding pool {}",
            pool.display()
        )
    })
}

enum Mode {
    Screen,
    Plain,
    Json,
}

/// `condense top`.
pub fn run(pool: &Path, a: &TopArgs) -> Result<i32> {
    let abs = std::path::absolute(pool)
        .with_context(|| format!("cannot resolve the pool path {}", pool.display()))?;
    let abs_text = abs.to_str().with_context(|| {
        format!(
            "the pool path {} is not valid UTF-8; it cannot be sent to the process holding the pool",
            abs.display()
        )
    })?;
    let argv: Vec<String> = ["--pool", abs_text, "top", "--counters"]
        .map(String::from)
        .to_vec();
    if a.counters {
        let s = sample(&abs, &argv)?;
        println!("{}", serde_json::to_string(&s)?);
        return Ok(0);
    }
    let mode = if a.json {
        Mode::Json
    } else if a.plain || !std::io::stdout().is_terminal() {
        Mode::Plain
    } else {
        Mode::Screen
    };
    let interval = Duration::from_secs_f64(a.interval);
    let mut before = sample(&abs, &argv)?;
    let mut at = Instant::now();
    let screen = match mode {
        Mode::Screen => Some(Screen::enter(&abs, interval)?),
        _ => None,
    };
    let mut out = std::io::stdout().lock();
    let mut reports = 0u64;
    let mut header_shown = false;
    while a.count.is_none_or(|c| reports < c) {
        match &screen {
            Some(s) => {
                if s.quit_within(interval)? {
                    break;
                }
            }
            None => std::thread::sleep(interval),
        }
        let now = sample(&abs, &argv)?;
        let now_at = Instant::now();
        let rows = rows(
            &before,
            &now,
            now_at.duration_since(at).as_secs_f64(),
            a.all,
        );
        let (unix, clock) = now_utc();
        let width = name_width(&rows);
        let shown = match (&mode, &screen) {
            (Mode::Json, _) => {
                let v = json!({
                    "unix_time": (unix * 1000.0).round() / 1000.0,
                    "interval_s": (now_at.duration_since(at).as_secs_f64() * 1000.0).round() / 1000.0,
                    "pool": abs.display().to_string(),
                    "volumes": rows.iter().map(Row::json).collect::<Vec<_>>(),
                });
                writeln!(out, "{v}")
            }
            (_, Some(s)) => s.draw(&mut out, &clock, &rows, width),
            _ => {
                let mut text = String::new();
                if !header_shown {
                    text = format!("{:<8} {}\n", "TIME", header(width));
                    header_shown = true;
                }
                for r in &rows {
                    text += &format!("{clock:<8} {}\n", r.line(width));
                }
                write!(out, "{text}")
            }
        };
        // A reader that went away (`| head`) ends the command quietly.
        if shown.and_then(|()| out.flush()).is_err() {
            break;
        }
        before = now;
        at = now_at;
        reports += 1;
    }
    Ok(0)
}

/// Set by SIGTERM, SIGHUP or SIGINT while the full-screen view is up: the loop ends and the
/// terminal is restored, where the default action would kill the process with the terminal
/// still in raw mode on the alternate screen.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// Catch SIGTERM, SIGHUP and SIGINT into [`STOP`], without `SA_RESTART`, so a `poll` waiting
/// for a key returns at once.
fn catch_stop_signals() {
    for sig in [libc::SIGTERM, libc::SIGHUP, libc::SIGINT] {
        // SAFETY: a zeroed sigaction with a valid handler and an empty mask; the handler only
        // stores to an atomic, which is async-signal-safe.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_stop_signal as *const () as libc::sighandler_t;
            libc::sigemptyset(&mut act.sa_mask);
            libc::sigaction(sig, &act, std::ptr::null_mut());
        }
    }
}

/// The full-screen view: the terminal in its alternate screen, keys read one at a time
/// without echo (Ctrl-C is read as a key too, so quitting always restores the terminal; so
/// do SIGTERM and SIGHUP, see [`STOP`]).
struct Screen {
    title: String,
    /// The terminal's settings before, when standard input is one.
    saved: Option<libc::termios>,
}

impl Screen {
    fn enter(pool: &Path, interval: Duration) -> Result<Screen> {
        catch_stop_signals();
        let mut saved = None;
        if std::io::stdin().is_terminal() {
            // SAFETY: a zeroed termios is a valid out-parameter; fd 0 is a terminal.
            let mut t: libc::termios = unsafe { std::mem::zeroed() };
            if unsafe { libc::tcgetattr(0, &mut t) } == 0 {
                let mut raw = t;
                raw.c_lflag &= !(libc::ICANON | libc::ECHO | libc::ISIG);
                raw.c_cc[libc::VMIN] = 1;
                raw.c_cc[libc::VTIME] = 0;
                // SAFETY: `raw` is a valid termios for fd 0.
                if unsafe { libc::tcsetattr(0, libc::TCSANOW, &raw) } == 0 {
                    saved = Some(t);
                }
            }
        }
        let quit = if saved.is_some() {
            "q quits"
        } else {
            "Ctrl-C quits"
        };
        let screen = Screen {
            title: format!(
                "condense top: pool {}, every {:.1} s, {quit}",
                pool.display(),
                interval.as_secs_f64()
            ),
            saved,
        };
        let mut out = std::io::stdout().lock();
        write!(
            out,
            "\x1b[?1049h\x1b[?25l\x1b[H\x1b[2J{}\r\nwaiting for the first interval...\r\n",
            screen.title
        )?;
        out.flush()?;
        Ok(screen)
    }

    /// Wait `d`; true if q, Q or Ctrl-C was pressed meanwhile, or a stop signal came.
    fn quit_within(&self, d: Duration) -> Result<bool> {
        let until = Instant::now() + d;
        loop {
            if STOP.load(Ordering::Relaxed) {
                return Ok(true);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            if self.saved.is_none() {
                // No terminal to poll: short sleeps, so a signal is seen within 50 ms.
                std::thread::sleep(left.min(Duration::from_millis(50)));
                continue;
            }
            let mut p = libc::pollfd {
                fd: 0,
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX);
            // SAFETY: one valid pollfd.
            let n = unsafe { libc::poll(&mut p, 1, ms) };
            if n <= 0 {
                continue; // the time is up, or a signal (the loop checks both)
            }
            let mut key = [0u8; 16];
            // SAFETY: `key` is valid for writes of its length.
            let got = unsafe { libc::read(0, key.as_mut_ptr().cast(), key.len()) };
            if got == 0 {
                return Ok(true); // the terminal went away
            }
            let got = usize::try_from(got).unwrap_or(0);
            if key[..got].iter().any(|&k| k == b'q' || k == b'Q' || k == 3) {
                return Ok(true);
            }
        }
    }

    fn draw(
        &self,
        out: &mut dyn Write,
        clock: &str,
        rows: &[Row],
        width: usize,
    ) -> std::io::Result<()> {
        let mut text = format!(
            "\x1b[H\x1b[2J{}  {clock} UTC\r\n\r\n\x1b[7m{}\x1b[0m\r\n",
            self.title,
            header(width)
        );
        for r in rows {
            text += &r.line(width);
            text += "\r\n";
        }
        out.write_all(text.as_bytes())
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        let mut out = std::io::stdout().lock();
        let _ = write!(out, "\x1b[?25h\x1b[?1049l");
        let _ = out.flush();
        if let Some(t) = &self.saved {
            // SAFETY: `t` is the terminal's own earlier state.
            unsafe { libc::tcsetattr(0, libc::TCSANOW, t) };
        }
    }
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
