//! What the mount counts for monitoring: reads and writes of file data (volumes, snapshots
//! and files alike), their bytes, errors and latency.
//!
//! Owns: [`FuseMetrics`], one per mount (see [`Mounted::metrics`](crate::Mounted::metrics)),
//! recorded by the `read` and `write` handlers with relaxed atomics (no lock, no allocation),
//! written to a scrape by its [`Collect`] implementation.
//! Invariants: an operation is counted once, when it is answered; bytes are those actually
//! read or written (a read at the end of a file counts what it returned).

use condense_metrics::{Collect, Counter, Encoder, Histogram, Kind, LATENCY_BUCKETS_SECONDS};
use std::time::Duration;

const OPS: [&str; 2] = ["read", "write"];

/// The operations measured.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Op {
    Read = 0,
    Write = 1,
}

#[derive(Debug)]
struct PerOp {
    requests: Counter,
    bytes: Counter,
    errors: Counter,
    latency: Histogram,
}

/// The mount's counters (see the module docs).
#[derive(Debug)]
pub struct FuseMetrics {
    ops: [PerOp; OPS.len()],
}

impl Default for FuseMetrics {
    fn default() -> Self {
        FuseMetrics {
            ops: std::array::from_fn(|_| PerOp {
                requests: Counter::default(),
                bytes: Counter::default(),
                errors: Counter::default(),
                latency: Histogram::seconds(LATENCY_BUCKETS_SECONDS),
            }),
        }
    }
}

impl FuseMetrics {
    /// An operation answered: `Some(bytes)` on success, `None` for an error.
    pub(crate) fn done(&self, op: Op, bytes: Option<u64>, took: Duration) {
        let m = &self.ops[op as usize];
        m.requests.inc();
        match bytes {
            Some(n) => m.bytes.add(n),
            None => m.errors.inc(),
        }
        m.latency.observe(took);
    }

    /// Bytes read (`"read"`) or written (`"write"`) so far.
    pub fn bytes(&self, op: &str) -> u64 {
        OPS.iter()
            .position(|o| *o == op)
            .map_or(0, |i| self.ops[i].bytes.get())
    }
}

impl Collect for FuseMetrics {
    fn collect(&self, e: &mut Encoder) {
        let per = |e: &mut Encoder, name: &str, help: &str, get: &dyn Fn(&PerOp) -> u64| {
            if e.family(name, help, Kind::Counter) {
                for (label, m) in OPS.iter().zip(&self.ops) {
                    e.sample(name, &[("op", label)], get(m) as f64);
                }
            }
        };
        per(
            e,
            "condense_fuse_requests_total",
            "FUSE reads and writes of file data answered, by operation.",
            &|m| m.requests.get(),
        );
        per(
            e,
            "condense_fuse_bytes_total",
            "Bytes read or written through the FUSE mount, by operation.",
            &|m| m.bytes.get(),
        );
        per(
            e,
            "condense_fuse_request_errors_total",
            "FUSE reads and writes answered with an error, by operation.",
            &|m| m.errors.get(),
        );
        let name = "condense_fuse_request_duration_seconds";
        if e.family(
            name,
            "Time to answer a FUSE read or write, by operation.",
            Kind::Histogram,
        ) {
            for (label, m) in OPS.iter().zip(&self.ops) {
                e.histogram(name, &[("op", label)], &m.latency.snapshot());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_bytes_and_errors_per_operation() {
        let m = FuseMetrics::default();
        m.done(Op::Write, Some(4096), Duration::from_micros(100));
        m.done(Op::Write, None, Duration::from_micros(100));
        m.done(Op::Read, Some(100), Duration::from_micros(5));
        assert_eq!(m.bytes("write"), 4096);
        assert_eq!(m.bytes("read"), 100);
        let mut e = Encoder::default();
        m.collect(&mut e);
        let text = e.finish();
        for line in [
            "condense_fuse_requests_total{op=\"write\"} 2",
            "condense_fuse_bytes_total{op=\"write\"} 4096",
            "condense_fuse_request_errors_total{op=\"write\"} 1",
            "condense_fuse_request_errors_total{op=\"read\"} 0",
            "condense_fuse_request_duration_seconds_count{op=\"read\"} 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }
}
