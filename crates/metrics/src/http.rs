//! The `/metrics` endpoint: HTTP/1.1 served by hyper on a small tokio runtime of its own.
//!
//! Owns: the listening socket, its thread and runtime, and the table of open connections.
//! `GET /metrics` (or `HEAD`) renders the registry; `GET /` says where the metrics are; other
//! paths get 404, other methods 405, and a request that is not HTTP/1.x gets hyper's 400 (or
//! 431 for a head over [`REQUEST_HEAD_BYTES_MAX`]). One request per connection
//! (`Connection: close`).
//!
//! Clients are served concurrently, and a flood of slow ones cannot hold up a scrape:
//! - a client has [`HEADER_TIMEOUT`] from its accept to send its whole request head (a byte a
//!   second does not extend it), and [`CONNECTION_TIMEOUT`] from its accept for the whole
//!   exchange (a client that never reads its answer is cut off then);
//! - a silent client costs its socket and a small task: no buffer is allocated until it sends;
//! - at most [`MetricsServer::connections_max`] connections are open at once
//!   ([`CONNECTIONS_MAX`], less when the open-files limit is low). When one more arrives, the
//!   oldest connection that has not sent its whole request head yet is closed to make room
//!   (the oldest one of all if every one has), so a new scrape is always served;
//! - rendering (which reads the pool's figures) runs on the runtime's blocking threads, at
//!   most [`RENDER_THREADS`] at a time.
//!
//! The endpoint counts its own connections in the registry it serves
//! (`condense_metrics_connections*`, docs/METRICS.md).
//!
//! Invariant: the table holds exactly the connections whose tasks have not been reaped or
//! evicted, so its length is what counts against the cap.
//!
//! Dropping the [`MetricsServer`] stops accepting, closes the socket and ends the thread.

use crate::{Collect, Counter, Encoder, Gauge, Kind, MetricsError, Registry};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::Instant;

/// How long a client may take, from its accept, to send its whole request head.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one connection may last from its accept, answer included.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections open at once, at most; [`MetricsServer::connections_max`] is the figure in
/// force (lower when the open-files limit is low).
pub const CONNECTIONS_MAX: usize = 2048;
/// The share of the process's open-files limit (soft) connections may take: one in four.
const OPEN_FILES_SHARE: u64 = 4;
/// Fewest connections allowed, however low the open-files limit.
const CONNECTIONS_MIN: usize = 16;
/// Largest request head read (hyper's buffer, which cannot be smaller); longer ones are
/// refused with 431.
pub const REQUEST_HEAD_BYTES_MAX: usize = 8 * 1024;
/// Scrapes rendered at once.
const RENDER_THREADS: usize = 4;
/// The content type of the text format.
const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A running endpoint. Dropping it stops serving.
pub struct MetricsServer {
    addr: SocketAddr,
    connections_max: usize,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Listen on `addr` (HOST:PORT; port 0 picks a free one) and serve `registry`, to which
    /// the endpoint adds its own connection metrics.
    pub fn start(addr: &str, registry: Arc<Registry>) -> Result<MetricsServer, MetricsError> {
        Self::start_capped(addr, registry, connections_max())
    }

    fn start_capped(
        addr: &str,
        registry: Arc<Registry>,
        cap: usize,
    ) -> Result<MetricsServer, MetricsError> {
        let bind_err = |source| MetricsError::Bind {
            addr: addr.to_string(),
            source,
        };
        let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(bind_err)?.collect();
        let listener = TcpListener::bind(&addrs[..]).map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        let local = listener.local_addr().map_err(bind_err)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .max_blocking_threads(RENDER_THREADS)
            .thread_name("condense-metrics")
            .build()
            .map_err(MetricsError::Thread)?;
        let stats = Arc::new(Stats::default());
        stats.cap.set(i64::try_from(cap).unwrap_or(i64::MAX));
        registry.register(stats.clone());
        let (stop, stopped) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("condense-metrics".to_string())
            .spawn(move || {
                runtime.block_on(serve(listener, registry, stats, cap, stopped));
                // A render stuck in the pool does not hold the process back.
                runtime.shutdown_timeout(Duration::from_secs(1));
            })
            .map_err(MetricsError::Thread)?;
        Ok(MetricsServer {
            addr: local,
            connections_max: cap,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections open at once, at most.
    pub fn connections_max(&self) -> usize {
        self.connections_max
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// [`CONNECTIONS_MAX`], or a quarter of the open-files limit if that is lower (the rest is the
/// pool's and the other frontends').
fn connections_max() -> usize {
    let soft = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map(|(soft, _)| soft)
        .unwrap_or(1024);
    let share = usize::try_from(soft / OPEN_FILES_SHARE).unwrap_or(usize::MAX);
    share.clamp(CONNECTIONS_MIN, CONNECTIONS_MAX)
}

/// The endpoint's own figures, in every scrape.
#[derive(Default)]
struct Stats {
    open: Gauge,
    cap: Gauge,
    accepted: Counter,
    head_timeouts: Counter,
    timeouts: Counter,
    evicted: Counter,
}

impl Collect for Stats {
    fn collect(&self, e: &mut Encoder) {
        e.gauge(
            "condense_metrics_connections",
            "Connections to the metrics endpoint open now.",
            self.open.get() as f64,
        );
        e.gauge(
            "condense_metrics_connections_max",
            "Connections the metrics endpoint keeps open at most.",
            self.cap.get() as f64,
        );
        e.counter(
            "condense_metrics_connections_total",
            "Connections the metrics endpoint accepted.",
            self.accepted.get(),
        );
        let name = "condense_metrics_connections_dropped_total";
        if e.family(
            name,
            "Connections the metrics endpoint closed before answering, by reason.",
            Kind::Counter,
        ) {
            for (reason, c) in [
                ("head_timeout", &self.head_timeouts),
                ("timeout", &self.timeouts),
                ("evicted", &self.evicted),
            ] {
                e.sample(name, &[("reason", reason)], c.get() as f64);
            }
        }
    }
}

/// One open connection.
struct Open {
    task: AbortHandle,
    /// Set once its request head has been read.
    head_read: Arc<AtomicBool>,
}

/// The open connections, oldest first.
#[derive(Default)]
struct Table {
    by_age: BTreeMap<u64, Open>,
    age_of: HashMap<tokio::task::Id, u64>,
    next: u64,
}

impl Table {
    fn len(&self) -> usize {
        self.by_age.len()
    }

    fn insert(&mut self, task: AbortHandle, head_read: Arc<AtomicBool>) {
        self.age_of.insert(task.id(), self.next);
        self.by_age.insert(self.next, Open { task, head_read });
        self.next += 1;
    }

    /// A task ended (or was evicted and now reaped).
    fn remove(&mut self, id: tokio::task::Id) {
        if let Some(age) = self.age_of.remove(&id) {
            self.by_age.remove(&age);
        }
    }

    /// Close the oldest connection still sending its request head, or with `any`, the oldest
    /// of all if none is. True if one was closed.
    fn evict(&mut self, any: bool) -> bool {
        let waiting = self
            .by_age
            .iter()
            .find(|(_, o)| !o.head_read.load(Ordering::Relaxed))
            .map(|(&age, _)| age);
        let oldest = self.by_age.keys().next().copied().filter(|_| any);
        let Some(age) = waiting.or(oldest) else {
            return false;
        };
        if let Some(o) = self.by_age.remove(&age) {
            self.age_of.remove(&o.task.id());
            // Aborting drops the task's future, and with it the socket.
            o.task.abort();
        }
        true
    }
}

/// Accept until told to stop; each connection on a task of its own.
async fn serve(
    listener: TcpListener,
    registry: Arc<Registry>,
    stats: Arc<Stats>,
    cap: usize,
    mut stop: oneshot::Receiver<()>,
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("metrics endpoint: cannot use the socket: {e}");
            return;
        }
    };
    let mut conns = JoinSet::new();
    let mut table = Table::default();
    loop {
        stats
            .open
            .set(i64::try_from(table.len()).unwrap_or(i64::MAX));
        let accepted = tokio::select! {
            r = listener.accept() => r,
            Some(ended) = conns.join_next_with_id() => {
                match ended {
                    Ok((id, ())) => table.remove(id),
                    Err(e) => table.remove(e.id()),
                }
                continue;
            }
            _ = &mut stop => break,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of file descriptors and the like: give back one taken by a client that
                // has not sent its request, else back off instead of spinning.
                tracing::warn!("metrics endpoint: accept failed: {e}");
                if table.evict(false) {
                    stats.evicted.inc();
                    tokio::task::yield_now().await;
                } else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                continue;
            }
        };
        stats.accepted.inc();
        if table.len() >= cap && table.evict(true) {
            stats.evicted.inc();
            tracing::debug!("metrics endpoint: {cap} connections open; closed the oldest");
            // The abort only schedules the evicted task's drop, and with it its socket's
            // close. On this one-thread runtime a flood keeps `accept` ready, so without a
            // yield up to a coop budget of accepts (128) would come first, each an open file
            // past the cap (CI saw 32).
            tokio::task::yield_now().await;
        }
        let head_read = Arc::new(AtomicBool::new(false));
        let task = conns.spawn(connection(
            stream,
            registry.clone(),
            stats.clone(),
            head_read.clone(),
        ));
        table.insert(task, head_read);
    }
    conns.shutdown().await;
}

/// Serve one connection within its deadlines.
async fn connection(
    stream: tokio::net::TcpStream,
    registry: Arc<Registry>,
    stats: Arc<Stats>,
    head_read: Arc<AtomicBool>,
) {
    let accepted = Instant::now();
    let head_deadline = accepted + HEADER_TIMEOUT;
    // A silent client costs its socket and this task: hyper's buffer comes once it sends.
    if tokio::time::timeout_at(head_deadline, stream.readable())
        .await
        .is_err()
    {
        stats.head_timeouts.inc();
        return;
    }
    let service = hyper::service::service_fn(move |req| {
        head_read.store(true, Ordering::Relaxed);
        answer(req, registry.clone())
    });
    let head_left = head_deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(head_left)
        .max_buf_size(REQUEST_HEAD_BYTES_MAX)
        .keep_alive(false)
        .title_case_headers(true)
        .serve_connection(TokioIo::new(stream), service);
    match tokio::time::timeout_at(accepted + CONNECTION_TIMEOUT, conn).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) if e.is_timeout() => stats.head_timeouts.inc(),
        Ok(Err(e)) => tracing::debug!("metrics request failed: {e}"),
        Err(_) => {
            stats.timeouts.inc();
            tracing::debug!("metrics client too slow; closed");
        }
    }
}

fn text(status: StatusCode, body: impl Into<Bytes>, content_type: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    if let Ok(v) = hyper::header::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

async fn answer(
    req: Request<Incoming>,
    registry: Arc<Registry>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    const PLAIN: &str = "text/plain; charset=utf-8";
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n", PLAIN);
        r.headers_mut().insert(
            hyper::header::ALLOW,
            hyper::header::HeaderValue::from_static("GET, HEAD"),
        );
        return Ok(r);
    }
    Ok(match req.uri().path() {
        "/metrics" => match tokio::task::spawn_blocking(move || registry.render()).await {
            // (hyper sends no body for HEAD, and the length of the GET body.)
            Ok(body) => text(StatusCode::OK, body, CONTENT_TYPE),
            Err(e) => text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("rendering failed: {e}\n"),
                PLAIN,
            ),
        },
        "/" => text(
            StatusCode::OK,
            "Condense metrics for Prometheus: GET /metrics\n",
            CONTENT_TYPE,
        ),
        _ => text(StatusCode::NOT_FOUND, "no such page: try /metrics\n", PLAIN),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Counter, Encoder};
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::time::Instant;

    fn get(addr: SocketAddr, request: &str) -> std::io::Result<String> {
        let mut s = TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(20)))?;
        s.write_all(request.as_bytes())?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    }

    #[test]
    fn serves_metrics_and_refuses_the_rest() -> Result<(), Box<dyn std::error::Error>> {
        let registry = Arc::new(Registry::default());
        let c = Arc::new(Counter::default());
        let seen = c.clone();
        registry.register(Arc::new(move |e: &mut Encoder| {
            e.counter("t_total", "Test.", seen.get())
        }));
        let server = MetricsServer::start("127.0.0.1:0", registry)?;
        let addr = server.local_addr();
        c.add(7);
        let r = get(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")?;
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(r.contains("Content-Type: text/plain; version=0.0.4"), "{r}");
        assert!(r.contains("Connection: close\r\n"), "{r}");
        assert!(r.contains("\r\n\r\n# HELP t_total Test.\n# TYPE t_total counter\nt_total 7\n"));
        assert!(
            r.contains("\ncondense_metrics_connections_total 1\n"),
            "{r}"
        );
        let r = get(addr, "HEAD /metrics?x=1 HTTP/1.0\r\n\r\n")?;
        assert!(r.contains(" 200 OK\r\n") && r.ends_with("\r\n\r\n"), "{r}");
        let r = get(addr, "GET /nope HTTP/1.1\r\n\r\n")?;
        assert!(r.starts_with("HTTP/1.1 404"), "{r}");
        let r = get(addr, "POST /metrics HTTP/1.1\r\n\r\n")?;
        assert!(
            r.starts_with("HTTP/1.1 405") && r.contains("Allow: GET, HEAD"),
            "{r}"
        );
        let r = get(addr, "hello\r\n\r\n")?;
        assert!(r.starts_with("HTTP/1.1 400"), "{r}");
        let long = format!(
            "GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n",
            "a".repeat(64 * 1024)
        );
        let r = get(addr, &long).unwrap_or_default();
        assert!(!r.contains(" 200 "), "an over-long head is refused: {r}");
        drop(server);
        assert!(
            TcpStream::connect(addr).is_err(),
            "the socket closes on drop"
        );
        Ok(())
    }

    #[test]
    fn slow_clients_do_not_hold_up_a_scrape() -> Result<(), Box<dyn std::error::Error>> {
        let registry = Arc::new(Registry::default());
        registry.register(Arc::new(|e: &mut Encoder| e.counter("t_total", "Test.", 1)));
        let server = MetricsServer::start("127.0.0.1:0", registry)?;
        let addr = server.local_addr();
        // Silent clients, and one that sent half a head.
        let mut idle: Vec<TcpStream> = (0..8)
            .map(|_| TcpStream::connect(addr))
            .collect::<Result<_, _>>()?;
        idle[0].write_all(b"GET /metr")?;
        let started = Instant::now();
        let r = get(addr, "GET /metrics HTTP/1.1\r\n\r\n")?;
        assert!(r.contains("t_total 1"), "{r}");
        assert!(
            started.elapsed() < HEADER_TIMEOUT,
            "a scrape waited {:?} behind idle clients",
            started.elapsed()
        );
        // The silent ones are cut off after the header timeout.
        let mut b = [0u8; 64];
        idle[1].set_read_timeout(Some(HEADER_TIMEOUT * 3))?;
        let n = idle[1].read(&mut b).unwrap_or(0);
        let answered = String::from_utf8_lossy(&b[..n]).to_string();
        assert!(n == 0 || answered.starts_with("HTTP/1.1 408"), "{answered}");
        Ok(())
    }

    /// The sample `name` (with its labels) in a scrape, as an integer.
    fn sample(scrape: &str, name: &str) -> Option<u64> {
        let line = scrape.lines().find(|l| l.split(' ').next() == Some(name))?;
        line.rsplit(' ').next()?.parse().ok()
    }

    #[test]
    fn a_full_table_makes_room_for_a_new_scrape() -> Result<(), Box<dyn std::error::Error>> {
        let registry = Arc::new(Registry::default());
        registry.register(Arc::new(|e: &mut Encoder| e.counter("t_total", "Test.", 1)));
        let server = MetricsServer::start_capped("127.0.0.1:0", registry, 4)?;
        assert_eq!(server.connections_max(), 4);
        let addr = server.local_addr();
        // Three times the cap in clients that stall: silent, or half a head sent.
        let mut stalled: Vec<TcpStream> = (0..12)
            .map(|_| TcpStream::connect(addr))
            .collect::<Result<_, _>>()?;
        for s in stalled.iter_mut().step_by(2) {
            s.write_all(b"GET /metrics HTTP/1.1\r\nX-")?;
        }
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        for _ in 0..3 {
            let r = get(addr, "GET /metrics HTTP/1.1\r\n\r\n")?;
            assert!(r.contains("t_total 1"), "{r}");
            assert!(
                started.elapsed() < HEADER_TIMEOUT,
                "{:?}",
                started.elapsed()
            );
            let open = sample(&r, "condense_metrics_connections");
            assert!(open.is_some_and(|n| n <= 4), "{r}");
            let evicted = sample(
                &r,
                "condense_metrics_connections_dropped_total{reason=\"evicted\"}",
            );
            assert!(evicted.is_some_and(|n| n >= 9), "{r}");
        }
        // The first ones were closed to make room (the oldest go first).
        let mut b = [0u8; 16];
        stalled[0].set_read_timeout(Some(Duration::from_secs(1)))?;
        assert!(matches!(stalled[0].read(&mut b), Ok(0) | Err(_)));
        Ok(())
    }

    #[test]
    fn a_head_sent_a_byte_at_a_time_is_cut_off_from_its_accept(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let server = MetricsServer::start("127.0.0.1:0", Arc::new(Registry::default()))?;
        let addr = server.local_addr();
        let mut s = TcpStream::connect(addr)?;
        let started = Instant::now();
        let mut cut = None;
        for b in b"GET /metrics HTTP/1.1\r\n".iter().cycle() {
            if s.write_all(&[*b]).is_err() {
                cut = Some(started.elapsed());
                break;
            }
            if started.elapsed() > HEADER_TIMEOUT * 3 {
                break;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        let cut = cut.ok_or("a trickled head was never cut off")?;
        assert!(
            cut < HEADER_TIMEOUT + Duration::from_secs(2),
            "cut off after {cut:?}"
        );
        let r = get(addr, "GET /metrics HTTP/1.1\r\n\r\n")?;
        let timeouts = sample(
            &r,
            "condense_metrics_connections_dropped_total{reason=\"head_timeout\"}",
        );
        assert_eq!(timeouts, Some(1), "{r}");
        Ok(())
    }

    #[test]
    fn a_taken_address_is_a_clear_error() -> Result<(), Box<dyn std::error::Error>> {
        let first = MetricsServer::start("127.0.0.1:0", Arc::new(Registry::default()))?;
        let addr = first.local_addr().to_string();
        let Err(e) = MetricsServer::start(&addr, Arc::new(Registry::default())) else {
            panic!("a second bind on {addr} succeeded");
        };
        assert!(e.to_string().contains(&addr), "{e}");
        Ok(())
    }
}
