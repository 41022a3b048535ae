//! Bounded resources (issue 23): replies to refused requests used to go on an unbounded queue
//! outside the in-flight budget (60 MiB of out-of-range reads, never read back, took a server
//! from 11 to 504 MiB), and there was no cap on connections. These tests pin that a client
//! that never reads stops being read with no more than its budget held, that other clients
//! are served meanwhile, that clients beyond the cap are refused their export and counted, that idle sockets
//! and handshakes past their deadline cannot keep a client out, and
//! that block status replies are bounded whatever the volume's map looks like.

mod common;

use common::*;
use condense_api::mem::MemCatalog;
use condense_api::Catalog;
use condense_nbd::proto::*;
use condense_nbd::{Endpoint, NbdMetrics, Server, ServerConfig, ServerHandle};
use std::io::{ErrorKind, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn start_with_metrics(
    catalog: Arc<dyn Catalog>,
    config: ServerConfig,
) -> (ServerHandle, Arc<NbdMetrics>) {
    let server = Server::bind(
        catalog,
        config,
        &[Endpoint::Tcp("127.0.0.1:0".parse().expect("addr"))],
    )
    .expect("bind");
    let metrics = server.metrics();
    (server.spawn().expect("spawn"), metrics)
}

fn request(kind: u16, cookie: u64, offset: u64, len: u32) -> Vec<u8> {
    let mut m = Vec::with_capacity(28);
    m.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    m.extend_from_slice(&0u16.to_be_bytes());
    m.extend_from_slice(&kind.to_be_bytes());
    m.extend_from_slice(&cookie.to_be_bytes());
    m.extend_from_slice(&offset.to_be_bytes());
    m.extend_from_slice(&len.to_be_bytes());
    m
}

/// Send `stream` of requests for at most `for_how_long` without reading a byte back; the
/// bytes the server took.
fn flood(s: &mut TcpStream, batch: &[u8], for_how_long: Duration) -> u64 {
    s.set_nonblocking(true).expect("nonblocking");
    let until = Instant::now() + for_how_long;
    let mut sent = 0u64;
    let mut at = 0;
    while Instant::now() < until {
        match s.write(&batch[at..]) {
            Ok(n) => {
                sent += n as u64;
                at = (at + n) % batch.len();
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("flood: {e}"),
        }
    }
    sent
}

#[test]
fn a_client_that_never_reads_is_held_to_its_budget_and_others_are_served() -> TestResult {
    const BUDGET: usize = 4 << 20;
    let config = ServerConfig {
        inflight_bytes_max: BUDGET,
        server_inflight_bytes_max: 2 * BUDGET,
        ..ServerConfig::default()
    };
    let (h, metrics) = start_with_metrics(catalog(), config);
    // Simple replies: every read reply carries its data (no holes).
    let mut greedy = Client::connect(addr(&h))?;
    greedy.go("vm1", &[])?;
    let mut greedy2 = Client::connect(addr(&h))?;
    greedy2.go("vm1", &[])?;
    // Refused (past the end), then large reads, mixed: the 60 MiB attack of the issue.
    let mut batch = Vec::new();
    for i in 0..4096u64 {
        batch.extend(request(CMD_READ, i, 1 << 40, 4096));
    }
    for i in 0..8u64 {
        batch.extend(request(CMD_READ, 1 << 32 | i, 0, 1 << 20));
    }
    let sent = flood(&mut greedy.s, &batch, Duration::from_secs(2));
    let sent2 = flood(&mut greedy2.s, &batch, Duration::from_secs(1));
    // The server stopped reading both: far less than it was sent was taken in.
    let held = metrics.inflight_bytes();
    assert!(held > 0, "the greedy clients hold part of the budget");
    assert!(
        held as usize <= 2 * BUDGET,
        "in flight {held} bytes, budget {} per connection",
        BUDGET
    );
    let refused = condense_nbd_refused(&metrics);
    assert!(
        refused < (sent + sent2) / 28,
        "{refused} refusals answered of {} sent: the server kept reading",
        (sent + sent2) / 28
    );
    // Both greedy clients together fill the server pool; others run on their reserves.
    still_serving(addr(&h))?;
    let mut other = Client::open(addr(&h), "vm1")?;
    let data = pattern(5, 64 * 1024);
    assert_eq!(other.write(0, &data, 0)?, 0);
    assert_eq!(other.read(0, 64 * 1024)?, Ok(data));
    // The greedy client reads at last: every request it sent is answered, in budget.
    drop((greedy, greedy2));
    let until = Instant::now() + Duration::from_secs(10);
    while metrics.inflight_bytes() > 0 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(metrics.inflight_bytes(), 0, "budget back once they left");
    Ok(())
}

fn condense_nbd_refused(m: &NbdMetrics) -> u64 {
    let mut e = condense_metrics::Encoder::default();
    condense_metrics::Collect::collect(m, &mut e);
    let text = e.finish();
    text.lines()
        .find_map(|l| l.strip_prefix("condense_nbd_requests_refused_total "))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[test]
fn clients_beyond_the_cap_are_refused_their_export_and_counted() -> TestResult {
    let config = ServerConfig {
        max_connections: 3,
        ..ServerConfig::default()
    };
    let (h, metrics) = start_with_metrics(catalog(), config);
    let mut held: Vec<Client> = (0..3)
        .map(|_| Client::open(addr(&h), "vm1"))
        .collect::<Result<_, _>>()?;
    for _ in 0..50 {
        // The handshake goes on; choosing an export is refused with a reason, and the client
        // may still abort cleanly.
        let mut c = Client::connect(addr(&h))?;
        let r = c.go("vm1", &[])?;
        assert_eq!(final_kind(&r), Some(REP_ERR_POLICY), "{r:?}");
        let r = c.option(OPT_ABORT, &[])?;
        assert_eq!(final_kind(&r), Some(REP_ACK));
    }
    // NBD_OPT_EXPORT_NAME has no error reply: the server hangs up.
    let mut c = Client::connect(addr(&h))?;
    c.send_option(OPT_EXPORT_NAME, b"vm1")?;
    c.expect_closed();
    assert_eq!(metrics.connections_refused(), 51);
    // Those connected are served all along.
    for (i, c) in held.iter_mut().enumerate() {
        let d = pattern(i as u64, 4096);
        assert_eq!(c.write(i as u64 * 4096, &d, 0)?, 0);
        assert_eq!(c.read(i as u64 * 4096, 4096)?, Ok(d));
    }
    // A slot frees when a client leaves.
    held.pop();
    let until = Instant::now() + Duration::from_secs(10);
    while metrics.clients() > 2 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    still_serving(addr(&h))?;
    Ok(())
}

#[test]
fn idle_sockets_cannot_keep_a_client_out() -> TestResult {
    let config = ServerConfig {
        max_handshakes: 8,
        max_handshakes_per_address: 4,
        ..ServerConfig::default()
    };
    let (h, metrics) = start_with_metrics(catalog(), config);
    // Far more idle sockets than the register holds, all from the client's own address.
    let idle: Vec<TcpStream> = (0..200)
        .map(|_| TcpStream::connect(addr(&h)))
        .collect::<Result<_, _>>()?;
    for _ in 0..20 {
        let mut c = Client::open(addr(&h), "vm1")?;
        let d = pattern(7, 4096);
        assert_eq!(c.write(0, &d, 0)?, 0);
        assert_eq!(c.read(0, 4096)?, Ok(d));
        // A few more idle sockets while it is connected: it is past the handshake.
        let _more: Vec<TcpStream> = (0..10)
            .map(|_| TcpStream::connect(addr(&h)))
            .collect::<Result<_, _>>()?;
        assert_eq!(c.read(0, 4096)?, Ok(pattern(7, 4096)));
    }
    let until = Instant::now() + Duration::from_secs(10);
    while metrics.handshakes() > 4 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(metrics.handshakes() <= 4, "the address limit holds");
    assert!(metrics.handshakes_dropped(condense_nbd::Dropped::AddressLimit) >= 196);
    drop(idle);
    Ok(())
}

#[test]
fn a_handshake_past_its_deadline_is_closed_and_counted() -> TestResult {
    let config = ServerConfig {
        handshake_timeout: Duration::from_millis(300),
        ..ServerConfig::default()
    };
    let (h, metrics) = start_with_metrics(catalog(), config);
    let mut c = Client::connect(addr(&h))?;
    std::thread::sleep(Duration::from_millis(600));
    // The server hung up; an option written now fails or reads EOF.
    let _ = c.send_option(OPT_LIST, &[]);
    c.expect_closed();
    assert_eq!(
        metrics.handshakes_dropped(condense_nbd::Dropped::Timeout),
        1
    );
    assert_eq!(metrics.handshakes(), 0);
    still_serving(addr(&h))?;
    Ok(())
}

#[test]
fn block_status_answers_a_bounded_prefix_of_a_fragmented_map() -> TestResult {
    let cat = Arc::new(MemCatalog::new(4096));
    cat.create("frag", 256 * MIB)?;
    let v = cat.open("frag")?;
    // Every other block of the first 160 MiB holds data: 40960 extents.
    let block = pattern(1, 4096);
    for b in (0..40960u64).step_by(2) {
        v.write(b * 4096, &block, false)?;
    }
    let (h, _) = start_with_metrics(cat, ServerConfig::default());
    let mut c = Client::open(addr(&h), "frag")?;
    let d = c
        .block_status(0, 256 * MIB as u32, 0)?
        .map_err(|e| format!("error {e}"))?;
    assert_eq!(d.len(), 16 * 1024, "at most 16 Ki descriptors per chunk");
    for (i, &(len, flags)) in d.iter().enumerate() {
        assert_eq!(len, 4096);
        let hole = STATE_HOLE | STATE_ZERO;
        assert_eq!(flags, if i % 2 == 0 { 0 } else { hole }, "descriptor {i}");
    }
    // The client continues where the answer stopped.
    let covered: u64 = d.iter().map(|x| u64::from(x.0)).sum();
    let rest = c
        .block_status(covered, 4096 * 4, 0)?
        .map_err(|e| format!("error {e}"))?;
    assert_eq!(rest.first(), Some(&(4096, 0)));
    Ok(())
}
