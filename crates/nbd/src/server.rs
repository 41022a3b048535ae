//! Listeners, connections and shutdown.
//!
//! Owns: the listening sockets, the caps on connections, and each connection from accept to
//! close. A connection first joins the register of handshakes ([`crate::admission`]: at most
//! [`ServerConfig::max_handshakes`], [`ServerConfig::max_handshakes_per_address`] per TCP
//! source address, the one idle longest closed to make room) and has
//! [`ServerConfig::handshake_timeout`] from accept to choosing an export, TLS handshake
//! included. Only then does it take one of the [`ServerConfig::max_connections`] transmission
//! slots: a client without credentials never holds one. A client that chooses an export while
//! every slot is taken is refused with `NBD_REP_ERR_POLICY` (NBD_OPT_GO) or a hang-up
//! (NBD_OPT_EXPORT_NAME), counted in `condense_nbd_connections_refused_total` and logged at
//! most once per [`crate::admission::LOG_INTERVAL`]. At shutdown connections get
//! [`ServerConfig::drain_timeout`] to take the replies of requests in flight, then are closed.
use crate::admission::{Stage, Ticket};
use crate::config::ServerConfig;
use crate::export::Export;
use crate::handshake::{self, Outcome, Security, Session};
use crate::metrics::{Dropped, NbdMetrics};
use crate::state::ServerState;
use crate::tls::{Access, TlsStream};
use crate::transmission::{self, End};
use crate::NbdError;
use condense_api::Catalog;
use std::fmt;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinSet;

/// Where the server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Tcp(a) => write!(f, "nbd://{a}"),
            Endpoint::Unix(p) => write!(f, "nbd+unix:///?socket={}", p.display()),
        }
    }
}

enum Bound {
    Tcp(std::net::TcpListener),
    Unix(std::os::unix::net::UnixListener, PathBuf),
}

/// A server bound to its endpoints, not yet serving.
pub struct Server {
    state: Arc<ServerState>,
    listeners: Vec<Bound>,
    endpoints: Vec<Endpoint>,
}

/// Bind a Unix socket with `access`, replacing a stale socket file nobody listens on.
fn bind_unix(
    path: &Path,
    access: crate::unix_socket::Access,
) -> std::io::Result<std::os::unix::net::UnixListener> {
    use std::os::unix::fs::FileTypeExt;
    use std::os::unix::net::UnixStream;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if meta.file_type().is_socket() && UnixStream::connect(path).is_err() {
            std::fs::remove_file(path)?;
        }
    }
    crate::unix_socket::bind(path, access)
}

impl Server {
    /// Bind every endpoint (TCP port 0 picks a free port; see [`Server::endpoints`]).
    pub fn bind(
        catalog: Arc<dyn Catalog>,
        config: ServerConfig,
        endpoints: &[Endpoint],
    ) -> Result<Server, NbdError> {
        if config.payload_bytes_max < (1 << 20) {
            return Err(NbdError::Config(format!(
                "payload_bytes_max {} is below 1 MiB",
                config.payload_bytes_max
            )));
        }
        if config.max_connections == 0
            || config.max_handshakes == 0
            || config.max_handshakes_per_address == 0
        {
            return Err(NbdError::Config(format!(
                "max_connections {}, max_handshakes {} and max_handshakes_per_address {} must \
                 all be at least 1, or no client could connect",
                config.max_connections, config.max_handshakes, config.max_handshakes_per_address
            )));
        }
        let mut listeners = Vec::new();
        let mut bound = Vec::new();
        for e in endpoints {
            let bind_err = |source| NbdError::Bind {
                endpoint: e.to_string(),
                source,
            };
            match e {
                Endpoint::Tcp(addr) => {
                    let l = std::net::TcpListener::bind(addr).map_err(bind_err)?;
                    l.set_nonblocking(true).map_err(bind_err)?;
                    bound.push(Endpoint::Tcp(l.local_addr().map_err(bind_err)?));
                    listeners.push(Bound::Tcp(l));
                }
                Endpoint::Unix(path) => {
                    let l = bind_unix(path, config.socket_access).map_err(bind_err)?;
                    l.set_nonblocking(true).map_err(bind_err)?;
                    bound.push(Endpoint::Unix(path.clone()));
                    listeners.push(Bound::Unix(l, path.clone()));
                }
            }
        }
        Ok(Server {
            state: Arc::new(ServerState::new(catalog, config).map_err(NbdError::Runtime)?),
            listeners,
            endpoints: bound,
        })
    }

    /// The endpoints actually bound.
    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }

    /// The server's counters (requests, bytes, latency, clients), to register with a
    /// metrics endpoint.
    pub fn metrics(&self) -> Arc<NbdMetrics> {
        self.state.metrics.clone()
    }

    /// Serve until `shutdown` completes; then stop accepting, answer every request in flight,
    /// close the connections and flush the pool. Must run inside a tokio runtime.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), NbdError> {
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut acceptors = JoinSet::new();
        let mut socket_files = Vec::new();
        for l in self.listeners {
            let state = self.state.clone();
            let stop = stop_rx.clone();
            match l {
                Bound::Tcp(l) => {
                    let l = tokio::net::TcpListener::from_std(l).map_err(NbdError::Io)?;
                    acceptors.spawn(accept_loop(state, stop, l));
                }
                Bound::Unix(l, path) => {
                    let l = tokio::net::UnixListener::from_std(l).map_err(NbdError::Io)?;
                    socket_files.push(path);
                    acceptors.spawn(accept_loop(state, stop, l));
                }
            }
        }
        shutdown.await;
        tracing::info!("NBD server shutting down");
        // Receivers outlive every task that reads them; a send error means none is left.
        let _ = stop_tx.send(true);
        while acceptors.join_next().await.is_some() {}
        for p in socket_files {
            let _ = std::fs::remove_file(p);
        }
        let catalog = self.state.catalog.clone();
        tokio::task::spawn_blocking(move || catalog.flush())
            .await
            .map_err(|_| NbdError::Panicked)??;
        tracing::info!("NBD server stopped; pool flushed");
        Ok(())
    }

    /// Run the server on a thread of its own (with its own runtime) until the handle is told
    /// to shut down or dropped.
    pub fn spawn(self) -> Result<ServerHandle, NbdError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("condense-nbd")
            .enable_all()
            .build()
            .map_err(NbdError::Runtime)?;
        let endpoints = self.endpoints.clone();
        let (tx, rx) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("condense-nbd-main".to_string())
            .spawn(move || {
                runtime.block_on(self.run(async move {
                    // A dropped sender means the handle is gone: shut down too.
                    let _ = rx.await;
                }))
            })
            .map_err(NbdError::Runtime)?;
        Ok(ServerHandle {
            stop: Some(tx),
            thread: Some(thread),
            endpoints,
        })
    }
}

/// A server running on its own thread. Dropping it shuts the server down and waits.
pub struct ServerHandle {
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), NbdError>>>,
    endpoints: Vec<Endpoint>,
}

impl ServerHandle {
    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }

    /// Stop accepting, finish what is in flight, flush the pool, and wait for all of it.
    pub fn shutdown(mut self) -> Result<(), NbdError> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<(), NbdError> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| NbdError::Panicked)?,
            None => Ok(()),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if let Err(e) = self.stop_and_join() {
            tracing::error!("NBD server shutdown: {e}");
        }
    }
}

/// A connected socket of either kind.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Stream for T {}

/// A connection just accepted: the socket, its source for the per-address limit (none for
/// Unix sockets), and the peer for the log.
type Accepted<C> = (C, Option<IpAddr>, String);

/// A listener of either kind.
trait Acceptor: Send + 'static {
    type Conn: Stream;
    fn accept_one(&self) -> impl Future<Output = std::io::Result<Accepted<Self::Conn>>> + Send;
}

impl Acceptor for tokio::net::TcpListener {
    type Conn = tokio::net::TcpStream;
    async fn accept_one(&self) -> std::io::Result<Accepted<Self::Conn>> {
        let (s, peer) = self.accept().await?;
        // Replies are written whole; delaying small ones only adds latency.
        s.set_nodelay(true)?;
        Ok((s, Some(source_address(peer.ip())), peer.to_string()))
    }
}

impl Acceptor for tokio::net::UnixListener {
    type Conn = tokio::net::UnixStream;
    async fn accept_one(&self) -> std::io::Result<Accepted<Self::Conn>> {
        let (s, _) = self.accept().await?;
        Ok((s, None, "unix".to_string()))
    }
}

/// The source a TCP peer counts under for the per-address limit: its IPv4 address (also when
/// mapped into IPv6), or its IPv6 /64 (one host usually has a whole /64 to pick from).
fn source_address(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let mut o = v6.octets();
            o[8..].fill(0);
            IpAddr::from(o)
        }
        v4 => v4,
    }
}

async fn accept_loop<A: Acceptor>(
    state: Arc<ServerState>,
    mut stop: watch::Receiver<bool>,
    listener: A,
) {
    let mut conns = JoinSet::new();
    loop {
        while conns.try_join_next().is_some() {}
        let accepted = tokio::select! {
            r = listener.accept_one() => r,
            _ = stop.changed() => break,
        };
        match accepted {
            Ok((stream, source, peer)) => {
                // No room even after closing older handshakes: closed now, before the greeting.
                let Some(ticket) = state.handshakes.admit(source) else {
                    drop(stream);
                    continue;
                };
                tracing::debug!(peer, "connection");
                let state = state.clone();
                let stop = stop.clone();
                conns.spawn(async move {
                    let end = connection(stream, state, stop, ticket).await;
                    tracing::debug!(peer, ?end, "connection closed");
                });
            }
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    drop(listener);
    let drain = state.config.drain_timeout;
    let all_done = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(drain, all_done).await.is_err() {
        tracing::warn!("connections still busy after {drain:?}; closing them");
        conns.shutdown().await;
    }
}

/// A connection whose handshake chose an export, holding its transmission slot.
enum Ready<S> {
    Plain(S, Export),
    Tls(Box<TlsStream<S>>, Export),
}

/// Serve one connection from greeting to close: plaintext, or upgraded to TLS by STARTTLS
/// (then everything after it, transmission included, is encrypted). The handshake ends at
/// the deadline, or when the register of handshakes closes the connection to make room.
pub async fn connection<S: Stream>(
    stream: S,
    state: Arc<ServerState>,
    mut stop: watch::Receiver<bool>,
    ticket: Ticket,
) -> End {
    let _client = state.metrics.client();
    let Ticket { place, evicted } = ticket;
    let limit = state.config.handshake_timeout;
    let ready = tokio::select! {
        r = tokio::time::timeout(limit, handshake_phase(stream, &state, &mut stop, &place)) => r,
        () = evicted.wait() => {
            return End::Io("closed in the handshake to make room for newer connections".into())
        }
    };
    // Out of the register: the export is chosen, or the connection ends.
    drop(place);
    match ready {
        Err(_) => {
            state.metrics.handshake_dropped(Dropped::Timeout);
            End::Io(format!("no export chosen within {limit:?}"))
        }
        Ok(Err(end)) => end,
        Ok(Ok(Ready::Plain(s, export))) => transmit(s, export, &state, stop).await,
        Ok(Ok(Ready::Tls(s, export))) => transmit(*s, export, &state, stop).await,
    }
}

/// The handshake: greeting, options, and if the client asks, TLS and options again.
async fn handshake_phase<S: Stream>(
    mut stream: S,
    state: &Arc<ServerState>,
    stop: &mut watch::Receiver<bool>,
    place: &crate::admission::Place,
) -> Result<Ready<S>, End> {
    let no_zeroes = match handshake::greet(&mut stream, stop).await {
        Ok(Some(no_zeroes)) => no_zeroes,
        Ok(None) => return Err(End::Closed),
        Err(e) => return Err(End::Io(e.to_string())),
    };
    place.advance(Stage::Haggling);
    let tls = state.config.tls.clone();
    let session = Session {
        security: tls
            .as_ref()
            .map_or(Security::NoTls, |t| Security::Plain(t.mode)),
        access: Access::All,
        no_zeroes,
    };
    match handshake::negotiate(&mut stream, state, stop, &session).await {
        Ok(Outcome::Transmission(export)) => return Ok(Ready::Plain(stream, export)),
        Ok(Outcome::Close(why)) => {
            tracing::debug!(why, "handshake ended");
            return Err(End::Closed);
        }
        Err(e) => return Err(End::Io(e.to_string())),
        Ok(Outcome::StartTls) => {}
    }
    let Some(tls) = tls else {
        return Err(End::ProtocolViolation(
            "STARTTLS without TLS settings".to_string(),
        ));
    };
    place.advance(Stage::Tls);
    let accepted = tokio::select! {
        r = tls.accept(stream) => r,
        _ = stop.changed() => return Err(End::Shutdown),
    };
    let (mut stream, names, access) = match accepted {
        Ok(accepted) => accepted,
        Err(e) => {
            tracing::info!("TLS handshake failed: {e}");
            return Err(End::Io(format!("TLS handshake: {e}")));
        }
    };
    tracing::debug!(?names, ?access, "TLS established");
    if tls.authenticates_clients() {
        place.advance(Stage::Authenticated);
    }
    let session = Session {
        security: Security::Tls,
        access,
        no_zeroes,
    };
    match handshake::negotiate(&mut stream, state, stop, &session).await {
        Ok(Outcome::Transmission(export)) => Ok(Ready::Tls(Box::new(stream), export)),
        Ok(Outcome::StartTls) => Err(End::ProtocolViolation("STARTTLS twice".to_string())),
        Ok(Outcome::Close(why)) => {
            tracing::debug!(why, "handshake over TLS ended");
            Err(End::Closed)
        }
        Err(e) => Err(End::Io(e.to_string())),
    }
}

/// Run the transmission phase on a negotiated connection, plaintext or TLS.
async fn transmit<S: Stream>(
    stream: S,
    export: Export,
    state: &Arc<ServerState>,
    stop: watch::Receiver<bool>,
) -> End {
    tracing::debug!(export = export.volume.name(), "transmission");
    let (r, w) = tokio::io::split(stream);
    let end = transmission::serve(
        r,
        w,
        export,
        &state.workers,
        &state.buffers,
        &state.metrics,
        state.budget.connection(state.config.inflight_bytes_max),
        stop,
    )
    .await;
    // The export, and its slot, are dropped: the last client gone, the server's memory goes
    // back to its idle size.
    if state.no_transmissions() {
        let buffers = state.buffers.clone();
        // Off the async threads: trimming the heap walks it.
        drop(tokio::task::spawn_blocking(move || buffers.release_idle()));
    }
    end
}

/// Serve one already-connected stream (a socketpair, an in-memory duplex) until it closes.
/// For tests and fuzzing; servers use [`Server::run`].
pub async fn serve_stream<S: Stream>(
    stream: S,
    catalog: Arc<dyn Catalog>,
    config: ServerConfig,
) -> End {
    let (_tx, rx) = watch::channel(false);
    let state = match ServerState::new(catalog, config) {
        Ok(s) => Arc::new(s),
        Err(e) => return End::Io(format!("cannot start worker threads: {e}")),
    };
    let Some(ticket) = state.handshakes.admit(None) else {
        return End::Io("no room in the register of handshakes".to_string());
    };
    connection(stream, state, rx, ticket).await
}
