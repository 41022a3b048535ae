//! What the server counts for monitoring: requests, bytes, errors and latency per NBD command,
//! connected clients.
//!
//! Owns: [`NbdMetrics`], one per [`Server`](crate::Server) (see
//! [`Server::metrics`](crate::Server::metrics)), recorded by the transmission loop with relaxed
//! atomics (no lock, no allocation per request), written to a scrape by its [`Collect`]
//! implementation.
//! Invariants: a request is counted once, when its reply is ready (so `requests_total` and
//! the latency histogram's `_count` agree); its latency runs from the moment its header was
//! read to the moment its reply was built (queueing on the worker threads included, writing
//! to the socket not); a request refused before it runs (bad range, read-only export) is
//! counted in `condense_nbd_requests_refused_total` only; a client refused its export because
//! the server has `max_connections` in transmission already is counted in
//! `condense_nbd_connections_refused_total` only; a connection closed before choosing an
//! export by the pre-authentication limits ([`crate::admission`], the handshake deadline) is
//! counted once in `condense_nbd_handshakes_dropped_total`, by reason.

use crate::wire::Command;
use condense_metrics::{
    Collect, Counter, Encoder, Gauge, Histogram, Kind, LATENCY_BUCKETS_SECONDS,
};
use std::time::Duration;

/// Why a connection was closed before it chose an export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dropped {
    /// The handshake deadline passed.
    Timeout,
    /// Its source address had the most handshakes allowed (the oldest of them is closed).
    AddressLimit,
    /// The server had the most handshakes allowed.
    HandshakeLimit,
}

/// Label values of [`Dropped`], in its order.
const DROPPED: [&str; 3] = ["timeout", "address_limit", "handshake_limit"];

/// Label values of the commands measured, in index order.
const COMMANDS: [&str; 7] = [
    "read",
    "write",
    "flush",
    "trim",
    "write_zeroes",
    "block_status",
    "cache",
];

#[derive(Debug)]
struct PerCommand {
    requests: Counter,
    bytes: Counter,
    errors: Counter,
    latency: Histogram,
}

/// The server's counters (see the module docs).
#[derive(Debug)]
pub struct NbdMetrics {
    commands: [PerCommand; COMMANDS.len()],
    clients: Gauge,
    connections: Counter,
    refused: Counter,
    connections_refused: Counter,
    inflight_bytes: Gauge,
    handshakes: Gauge,
    handshakes_dropped: [Counter; DROPPED.len()],
}

impl Default for NbdMetrics {
    fn default() -> Self {
        NbdMetrics {
            commands: std::array::from_fn(|_| PerCommand {
                requests: Counter::default(),
                bytes: Counter::default(),
                errors: Counter::default(),
                latency: Histogram::seconds(LATENCY_BUCKETS_SECONDS),
            }),
            clients: Gauge::default(),
            connections: Counter::default(),
            refused: Counter::default(),
            connections_refused: Counter::default(),
            inflight_bytes: Gauge::default(),
            handshakes: Gauge::default(),
            handshakes_dropped: Default::default(),
        }
    }
}

/// Which command a request is, and the bytes it covers (payload or range).
fn classify(c: &Command) -> Option<(usize, u64)> {
    Some(match *c {
        Command::Read { len, .. } => (0, u64::from(len)),
        Command::Write { len, .. } => (1, u64::from(len)),
        Command::Flush => (2, 0),
        Command::Trim { len, .. } => (3, u64::from(len)),
        Command::WriteZeroes { len, .. } => (4, u64::from(len)),
        Command::BlockStatus { len, .. } => (5, u64::from(len)),
        Command::Cache { len, .. } => (6, u64::from(len)),
        Command::Disc => return None,
    })
}

impl NbdMetrics {
    /// A request answered: `failed` when its reply is an error.
    pub(crate) fn request_done(&self, command: &Command, took: Duration, failed: bool) {
        let Some((i, bytes)) = classify(command) else {
            return;
        };
        let m = &self.commands[i];
        m.requests.inc();
        m.bytes.add(bytes);
        if failed {
            m.errors.inc();
        }
        m.latency.observe(took);
    }

    pub(crate) fn request_refused(&self) {
        self.refused.inc();
    }

    /// A client connected; it counts as connected until the guard is dropped.
    pub(crate) fn client(self: &std::sync::Arc<Self>) -> ClientGuard {
        self.clients.inc();
        self.connections.inc();
        ClientGuard(self.clone())
    }

    /// A client refused its export: the server had its maximum of connections.
    pub(crate) fn connection_refused(&self) {
        self.connections_refused.inc();
    }

    /// A connection closed (or refused) before it chose an export.
    pub(crate) fn handshake_dropped(&self, why: Dropped) {
        self.handshakes_dropped[why as usize].inc();
    }

    /// Connections in the handshake now.
    pub(crate) fn handshakes_set(&self, n: usize) {
        self.handshakes.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Connections closed before choosing an export, for `why`.
    pub fn handshakes_dropped(&self, why: Dropped) -> u64 {
        self.handshakes_dropped[why as usize].get()
    }

    /// Connections in the handshake now.
    pub fn handshakes(&self) -> i64 {
        self.handshakes.get()
    }

    pub(crate) fn inflight_bytes_add(&self, n: i64) {
        self.inflight_bytes.add(n);
    }

    pub(crate) fn inflight_bytes_sub(&self, n: i64) {
        self.inflight_bytes.sub(n);
    }

    /// Bytes of the in-flight budget held by requests now.
    pub fn inflight_bytes(&self) -> i64 {
        self.inflight_bytes.get()
    }

    /// Connections refused because the server had its maximum.
    pub fn connections_refused(&self) -> u64 {
        self.connections_refused.get()
    }

    /// Requests of `command` ("read", "write", …) answered so far.
    pub fn requests(&self, command: &str) -> u64 {
        COMMANDS
            .iter()
            .position(|c| *c == command)
            .map_or(0, |i| self.commands[i].requests.get())
    }

    /// Clients connected now.
    pub fn clients(&self) -> i64 {
        self.clients.get()
    }
}

/// Keeps a client counted as connected.
pub(crate) struct ClientGuard(std::sync::Arc<NbdMetrics>);

impl Drop for ClientGuard {
    fn drop(&mut self) {
        self.0.clients.dec();
    }
}

impl Collect for NbdMetrics {
    fn collect(&self, e: &mut Encoder) {
        let per = |e: &mut Encoder, name: &str, help: &str, get: &dyn Fn(&PerCommand) -> u64| {
            if e.family(name, help, Kind::Counter) {
                for (label, m) in COMMANDS.iter().zip(&self.commands) {
                    e.sample(name, &[("command", label)], get(m) as f64);
                }
            }
        };
        per(
            e,
            "condense_nbd_requests_total",
            "NBD requests answered, by command.",
            &|m| m.requests.get(),
        );
        per(
            e,
            "condense_nbd_request_bytes_total",
            "Bytes covered by answered NBD requests, by command (read: bytes read, write: \
             bytes written, trim/write_zeroes/block_status/cache: length of the range).",
            &|m| m.bytes.get(),
        );
        per(
            e,
            "condense_nbd_request_errors_total",
            "NBD requests answered with an error, by command.",
            &|m| m.errors.get(),
        );
        let name = "condense_nbd_request_duration_seconds";
        if e.family(
            name,
            "Time from reading an NBD request to its reply being ready, by command.",
            Kind::Histogram,
        ) {
            for (label, m) in COMMANDS.iter().zip(&self.commands) {
                e.histogram(name, &[("command", label)], &m.latency.snapshot());
            }
        }
        e.counter(
            "condense_nbd_requests_refused_total",
            "NBD requests refused before running (bad range or flags, writes to a read-only \
             export).",
            self.refused.get(),
        );
        e.gauge(
            "condense_nbd_clients_connected",
            "NBD clients connected now (handshake or transmission).",
            self.clients.get() as f64,
        );
        e.counter(
            "condense_nbd_connections_total",
            "NBD connections accepted.",
            self.connections.get(),
        );
        e.counter(
            "condense_nbd_connections_refused_total",
            "NBD clients refused the export they chose (NBD_REP_ERR_POLICY, or closed after \
             NBD_OPT_EXPORT_NAME) because the server served --max-connections connections \
             already.",
            self.connections_refused.get(),
        );
        e.gauge(
            "condense_nbd_handshakes",
            "NBD connections in the handshake now (accepted, no export chosen yet).",
            self.handshakes.get() as f64,
        );
        let name = "condense_nbd_handshakes_dropped_total";
        if e.family(
            name,
            "NBD connections closed before choosing an export, by reason: timeout (the \
             handshake deadline passed), address_limit (their source address had the most \
             handshakes allowed), handshake_limit (the server had the most handshakes \
             allowed).",
            Kind::Counter,
        ) {
            for (label, c) in DROPPED.iter().zip(&self.handshakes_dropped) {
                e.sample(name, &[("reason", label)], c.get() as f64);
            }
        }
        e.gauge(
            "condense_nbd_inflight_bytes",
            "Bytes of the in-flight budget held now by NBD requests whose replies are not \
             written yet (buffers and replies; refused requests count too).",
            self.inflight_bytes.get() as f64,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_by_command_and_renders_every_family() {
        let m = std::sync::Arc::new(NbdMetrics::default());
        let read = Command::Read {
            offset: 0,
            len: 4096,
            df: false,
        };
        m.request_done(&read, Duration::from_micros(40), false);
        m.request_done(&read, Duration::from_millis(3), true);
        m.request_done(&Command::Flush, Duration::from_millis(1), false);
        m.request_done(&Command::Disc, Duration::from_millis(1), false);
        m.request_refused();
        let guard = m.client();
        assert_eq!(m.clients(), 1);
        let mut e = Encoder::default();
        m.collect(&mut e);
        let text = e.finish();
        for line in [
            "condense_nbd_requests_total{command=\"read\"} 2",
            "condense_nbd_requests_total{command=\"flush\"} 1",
            "condense_nbd_requests_total{command=\"write\"} 0",
            "condense_nbd_request_bytes_total{command=\"read\"} 8192",
            "condense_nbd_request_errors_total{command=\"read\"} 1",
            "condense_nbd_request_duration_seconds_bucket{command=\"read\",le=\"0.00005\"} 1",
            "condense_nbd_request_duration_seconds_bucket{command=\"read\",le=\"+Inf\"} 2",
            "condense_nbd_request_duration_seconds_count{command=\"read\"} 2",
            "condense_nbd_requests_refused_total 1",
            "condense_nbd_clients_connected 1",
            "condense_nbd_connections_total 1",
            "condense_nbd_connections_refused_total 0",
            "condense_nbd_inflight_bytes 0",
            "condense_nbd_handshakes 0",
            "condense_nbd_handshakes_dropped_total{reason=\"timeout\"} 0",
            "condense_nbd_handshakes_dropped_total{reason=\"address_limit\"} 0",
            "condense_nbd_handshakes_dropped_total{reason=\"handshake_limit\"} 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        drop(guard);
        assert_eq!(m.clients(), 0);
    }
}
