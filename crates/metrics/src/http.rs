//! The `/metrics` endpoint: a std thread that accepts HTTP/1.x connections one at a time and
//! answers each with one response, then closes it.
//!
//! Owns: the listening socket and its thread. `GET /metrics` (or `HEAD`) renders the registry;
//! `GET /` says where the metrics are; other paths get 404, other methods 405, a request that
//! is not HTTP 400. A client gets [`IO_TIMEOUT`] to send its request and read the answer, so a
//! stalled client delays the next scrape by at most that. Dropping the [`MetricsServer`] stops
//! the thread and closes the socket.

use crate::{MetricsError, Registry};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// How long one client may take to send its request or read the answer.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest request head read; longer ones are refused.
const REQUEST_BYTES_MAX: usize = 16 * 1024;
/// The content type of the text format.
const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A running endpoint. Dropping it stops serving.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
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
        let local = listener.local_addr().map_err(bind_err)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("condense-metrics".to_string())
            .spawn(move || accept_loop(listener, registry, flag))
            .map_err(MetricsError::Thread)?;
        Ok(MetricsServer {
            addr: local,
            stop,
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
        self.stop.store(true, Ordering::Relaxed);
        // Wake the blocking accept with a connection of our own.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        if TcpStream::connect_timeout(&wake, Duration::from_secs(1)).is_ok() {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
        // If we could not connect, the thread stays blocked in accept and ends with the process.
    }
}

fn accept_loop(listener: TcpListener, registry: Arc<Registry>, stop: Arc<AtomicBool>) {
    for conn in listener.incoming() {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        match conn {
            Ok(s) => {
                if let Err(e) = answer(s, &registry) {
                    tracing::debug!("metrics request failed: {e}");
                }
            }
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!("metrics endpoint: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Read one request head and write one response.
fn answer(mut s: TcpStream, registry: &Registry) -> std::io::Result<()> {
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        if head.len() > REQUEST_BYTES_MAX {
            return respond(
                &mut s,
                "431 Request Header Fields Too Large",
                "",
                "too long\n",
            );
        }
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&head);
    let mut words = text.lines().next().unwrap_or("").split_whitespace();
    let (method, target, version) = (words.next(), words.next(), words.next());
    let (Some(method), Some(target), Some(version)) = (method, target, version) else {
        return respond(&mut s, "400 Bad Request", "", "not an HTTP request\n");
    };
    if !version.starts_with("HTTP/1.") {
        return respond(
            &mut s,
            "400 Bad Request",
            "",
            "only HTTP/1.x is spoken here\n",
        );
    }
    let path = target.split('?').next().unwrap_or(target);
    let head_only = method == "HEAD";
    if method != "GET" && !head_only {
        return respond(
            &mut s,
            "405 Method Not Allowed",
            "Allow: GET, HEAD\r\n",
            "use GET\n",
        );
    }
    let body = match path {
        "/metrics" => registry.render(),
        "/" => "Condense metrics for Prometheus: GET /metrics\n".to_string(),
        _ => return respond(&mut s, "404 Not Found", "", "no such page: try /metrics\n"),
    };
    let header = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    s.write_all(header.as_bytes())?;
    if !head_only {
        s.write_all(body.as_bytes())?;
    }
    s.flush()
}

fn respond(s: &mut TcpStream, status: &str, extra: &str, body: &str) -> std::io::Result<()> {
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\n{extra}\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(reply.as_bytes())?;
    s.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Counter, Encoder};

    fn get(addr: SocketAddr, request: &str) -> std::io::Result<String> {
        let mut s = TcpStream::connect(addr)?;
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
        assert!(r.ends_with("\r\n\r\n# HELP t_total Test.\n# TYPE t_total counter\nt_total 7\n"));
        let r = get(addr, "HEAD /metrics?x=1 HTTP/1.0\r\n\r\n")?;
        assert!(
            r.starts_with("HTTP/1.1 200 OK\r\n") && r.ends_with("\r\n\r\n"),
            "{r}"
        );
        let r = get(addr, "GET /nope HTTP/1.1\r\n\r\n")?;
        assert!(r.starts_with("HTTP/1.1 404"), "{r}");
        let r = get(addr, "POST /metrics HTTP/1.1\r\n\r\n")?;
        assert!(
            r.starts_with("HTTP/1.1 405") && r.contains("Allow: GET, HEAD"),
            "{r}"
        );
        let r = get(addr, "hello\r\n\r\n")?;
        assert!(r.starts_with("HTTP/1.1 400"), "{r}");
        drop(server);
        assert!(
            TcpStream::connect(addr).is_err(),
            "the socket closes on drop"
        );
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
