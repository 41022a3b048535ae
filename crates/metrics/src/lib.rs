//! Metrics for Prometheus: lock-free instruments, the text exposition format, and the HTTP
//! endpoint that answers `GET /metrics`.
//!
//! Owns:
//! - the instruments: [`Counter`], [`Gauge`] and [`Histogram`], each a handful of `AtomicU64`s
//!   updated with relaxed ordering, so recording on a hot path costs a few uncontended atomic
//!   adds: no lock, no allocation;
//! - [`Registry`]: what a scrape collects. Components register a [`Collect`] (their own struct
//!   of instruments, or a closure that reads figures at scrape time); the registry's lock is
//!   taken only to register and to scrape, never to record;
//! - [`Encoder`]: the Prometheus text format 0.0.4 (`# HELP`, `# TYPE`, samples; escaping of
//!   help text and label values; histograms as cumulative `_bucket{le=…}` with `+Inf`, `_sum`
//!   and `_count`);
//! - [`MetricsServer`]: `GET /metrics` over HTTP/1.1 (hyper, on a small tokio runtime of its
//!   own thread): concurrent clients, header and connection deadlines from each accept, a
//!   connection cap that closes the oldest client still sending its request to make room for
//!   a new one (one request per connection, `Connection: close`).
//!
//! Invariants: every sample of a metric family follows its `# TYPE` line, families are
//! declared once per scrape (the encoder refuses to declare one twice by ignoring the repeat),
//! and a histogram's `_count` equals its `+Inf` bucket (both are summed from the same reads).
//!
//! ```
//! use condense_metrics::{Counter, Encoder, Registry};
//! use std::sync::Arc;
//! let writes = Arc::new(Counter::default());
//! let registry = Registry::default();
//! let w = writes.clone();
//! registry.register(Arc::new(move |e: &mut Encoder| {
//!     e.counter("condense_example_writes_total", "Writes so far.", w.get());
//! }));
//! writes.inc();
//! assert!(registry.render().contains("condense_example_writes_total 1\n"));
//! ```

#![deny(clippy::unwrap_used)]

mod http;
mod text;

pub use http::{
    MetricsServer, CONNECTIONS_MAX, CONNECTION_TIMEOUT, HEADER_TIMEOUT, REQUEST_HEAD_BYTES_MAX,
};
pub use text::{Encoder, Kind};

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What can go wrong starting the endpoint (a failed scrape only ends that connection).
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("cannot listen for metrics on {addr}: {source} (choose a free HOST:PORT)")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("cannot start the metrics thread: {0}")]
    Thread(std::io::Error),
}

/// A value that only goes up (restarts from zero with the process).
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.add(1);
    }
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down (connected clients, say).
#[derive(Debug, Default)]
pub struct Gauge(AtomicI64);

impl Gauge {
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    pub fn dec(&self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
    pub fn add(&self, n: i64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn sub(&self, n: i64) {
        self.0.fetch_sub(n, Ordering::Relaxed);
    }
    pub fn set(&self, v: i64) {
        self.0.store(v, Ordering::Relaxed);
    }
    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Latency buckets in seconds, from 10 µs to 10 s: a cached 4 KiB read takes microseconds, a
/// synced write or a flush milliseconds, a stalled disk seconds.
pub const LATENCY_BUCKETS_SECONDS: &[f64] = &[
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A distribution of observations in fixed buckets. Observations are integers in a raw unit
/// (nanoseconds for [`Histogram::seconds`]); `raw_per_unit` of them make one exposed unit.
/// Each bucket counts only its own observations; the encoder makes them cumulative.
#[derive(Debug)]
pub struct Histogram {
    /// Upper bounds (inclusive) in raw units, ascending.
    bounds: Box<[u64]>,
    /// The same bounds in the exposed unit, as given (no rounding error in `le`).
    exposed: Box<[f64]>,
    /// One count per bound, and a last one for everything above the largest bound.
    counts: Box<[AtomicU64]>,
    sum: AtomicU64,
    raw_per_unit: f64,
}

/// What one read of a histogram saw, in the exposed unit.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// (upper bound, cumulative count) for each finite bound, ascending.
    pub buckets: Vec<(f64, u64)>,
    /// Every observation (the `+Inf` bucket).
    pub count: u64,
    pub sum: f64,
}

impl Histogram {
    /// A histogram of durations with these upper bounds in seconds (ascending).
    pub fn seconds(bounds: &[f64]) -> Histogram {
        Self::new(bounds, 1e9)
    }

    /// A histogram of integer observations, `raw_per_unit` of which make one exposed unit;
    /// `bounds` are in exposed units (ascending).
    pub fn new(bounds: &[f64], raw_per_unit: f64) -> Histogram {
        let raw: Box<[u64]> = bounds
            .iter()
            .map(|b| (b * raw_per_unit).round() as u64)
            .collect();
        let counts = (0..=raw.len()).map(|_| AtomicU64::new(0)).collect();
        Histogram {
            bounds: raw,
            exposed: bounds.into(),
            counts,
            sum: AtomicU64::new(0),
            raw_per_unit,
        }
    }

    /// Record one observation in raw units.
    pub fn observe_raw(&self, v: u64) {
        let i = self.bounds.partition_point(|&b| b < v);
        if let Some(c) = self.counts.get(i) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        self.sum.fetch_add(v, Ordering::Relaxed);
    }

    /// Record a duration (for histograms made by [`Histogram::seconds`]).
    pub fn observe(&self, d: Duration) {
        self.observe_raw(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }

    /// The cumulative buckets, count and sum as they are now.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut buckets = Vec::with_capacity(self.bounds.len());
        let mut total = 0u64;
        for (i, c) in self.counts.iter().enumerate() {
            total += c.load(Ordering::Relaxed);
            if let Some(&b) = self.exposed.get(i) {
                buckets.push((b, total));
            }
        }
        HistogramSnapshot {
            buckets,
            count: total,
            sum: self.sum.load(Ordering::Relaxed) as f64 / self.raw_per_unit,
        }
    }
}

/// Something that writes samples into a scrape.
pub trait Collect: Send + Sync {
    fn collect(&self, out: &mut Encoder);
}

impl<F: Fn(&mut Encoder) + Send + Sync> Collect for F {
    fn collect(&self, out: &mut Encoder) {
        self(out)
    }
}

/// Everything a scrape shows, in registration order.
#[derive(Default)]
pub struct Registry {
    collectors: Mutex<Vec<Arc<dyn Collect>>>,
}

impl Registry {
    pub fn register(&self, c: Arc<dyn Collect>) {
        self.lock().push(c);
    }

    /// One scrape in the Prometheus text format.
    pub fn render(&self) -> String {
        let collectors = self.lock().clone();
        let mut e = Encoder::default();
        for c in collectors {
            c.collect(&mut e);
        }
        e.finish()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<dyn Collect>>> {
        self.collectors.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_hold_values_up_to_their_bound() {
        let h = Histogram::new(&[1.0, 2.0, 5.0], 1.0);
        for v in [0, 1, 2, 3, 5, 6, 100] {
            h.observe_raw(v);
        }
        let s = h.snapshot();
        // le=1: 0,1; le=2: +2; le=5: +3,5; +Inf: +6,100.
        assert_eq!(s.buckets, vec![(1.0, 2), (2.0, 3), (5.0, 5)]);
        assert_eq!(s.count, 7);
        assert_eq!(s.sum, 117.0);
    }

    #[test]
    fn seconds_histogram_records_durations() {
        let h = Histogram::seconds(LATENCY_BUCKETS_SECONDS);
        h.observe(Duration::from_micros(30));
        h.observe(Duration::from_secs(20));
        let s = h.snapshot();
        assert_eq!(s.buckets.len(), LATENCY_BUCKETS_SECONDS.len());
        // 30 µs falls in le=0.00005 and every bucket after it; 20 s only in +Inf.
        assert_eq!(s.buckets[1], (0.000_025, 0));
        assert_eq!(s.buckets[2].1, 1);
        assert_eq!(s.buckets.last().map(|b| b.1), Some(1));
        assert_eq!(s.count, 2);
        assert!((s.sum - 20.000_03).abs() < 1e-9);
    }

    #[test]
    fn counter_and_gauge() {
        let c = Counter::default();
        c.inc();
        c.add(41);
        assert_eq!(c.get(), 42);
        let g = Gauge::default();
        g.inc();
        g.inc();
        g.dec();
        assert_eq!(g.get(), 1);
        g.set(-3);
        assert_eq!(g.get(), -3);
    }
}
