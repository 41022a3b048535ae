//! The `/metrics` endpoint: HTTP/1.1 served by hyper on a small tokio runtime of its own.
//!
//! Owns: the listening socket, its thread and runtime. `GET /metrics` (or `HEAD`) renders the
//! registry; `GET /` says where the metrics are; other paths get 404, other methods 405, and a
//! request that is not HTTP/1.x gets hyper's 400 (or 431 for a head over
//! [`REQUEST_HEAD_BYTES_MAX`]). One request per connection (`Connection: close`).
//!
//! Clients are served concurrently, so none can hold up another's scrape:
//! - a client gets [`HEADER_TIMEOUT`] to send its request head, and [`CONNECTION_TIMEOUT`]
//!   for the whole exchange (a client that reads its answer a byte a second is cut off);
//! - at most [`CONNECTIONS_MAX`] connections are served at once; more are closed on accept;
//! - rendering (which reads the pool's figures) runs on the runtime's blocking threads, at
//!   most [`RENDER_THREADS`] at a time.
//!
//! Dropping the [`MetricsServer`] stops accepting, closes the socket and ends the thread.

use crate::{MetricsError, Registry};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::{oneshot, Semaphore};

/// How long a client may take to send its request head.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one connection may last, answer included.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; more are closed as soon as they are accepted.
pub const CONNECTIONS_MAX: usize = 64;
/// Largest request head read (hyper's buffer); longer ones are refused.
pub const REQUEST_HEAD_BYTES_MAX: usize = 16 * 1024;
/// Scrapes rendered at once.
const RENDER_THREADS: usize = 4;
/// The content type of the text format.
const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A running endpoint. Dropping it stops serving.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Listen on `addr` (HOST:PORT; port 0 picks a free one) and serve `registry`.
    pub fn start(addr: &str, registry: Arc<Registry>) -> Result<MetricsServer, MetricsError> {
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
        let (stop, stopped) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("condense-metrics".to_string())
            .spawn(move || {
                runtime.block_on(serve(listener, registry, stopped));
                // A render stuck in the pool does not hold the process back.
                runtime.shutdown_timeout(Duration::from_secs(1));
            })
            .map_err(MetricsError::Thread)?;
        Ok(MetricsServer {
            addr: local,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
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

/// Accept until told to stop; each connection on a task of its own.
async fn serve(listener: TcpListener, registry: Arc<Registry>, mut stop: oneshot::Receiver<()>) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("metrics endpoint: cannot use the socket: {e}");
            return;
        }
    };
    let slots = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    let mut conns = tokio::task::JoinSet::new();
    loop {
        while conns.try_join_next().is_some() {}
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = &mut stop => break,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!("metrics endpoint: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!(
                "metrics endpoint: {CONNECTIONS_MAX} connections busy; closing one more"
            );
            continue;
        };
        let registry = registry.clone();
        conns.spawn(async move {
            let service = hyper::service::service_fn(move |req| answer(req, registry.clone()));
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .max_buf_size(REQUEST_HEAD_BYTES_MAX)
                .keep_alive(false)
                .title_case_headers(true)
                .serve_connection(TokioIo::new(stream), service);
            match tokio::time::timeout(CONNECTION_TIMEOUT, conn).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!("metrics request failed: {e}"),
                Err(_) => tracing::debug!("metrics client too slow; closed"),
            }
            drop(slot);
        });
    }
    conns.shutdown().await;
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
        assert!(r.ends_with("\r\n\r\n# HELP t_total Test.\n# TYPE t_total counter\nt_total 7\n"));
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
