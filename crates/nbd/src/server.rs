//! Listeners, connections and shutdown.
//!
//! Owns: the listening sockets, the cap on connections, and each connection from accept to
//! close. A connection beyond [`ServerConfig::max_connections`] is closed as soon as it is
//! accepted, before the greeting (nothing is allocated for it), counted in
//! `condense_nbd_connections_refused_total`, and logged at most once per
//! [`REFUSAL_LOG_INTERVAL`]. A client gets [`HANDSHAKE_TIMEOUT`] from accept to the end of
//! option haggling, so idle sockets cannot keep the slots of the cap forever.

use crate::budget::Budget;
use crate::buffers::BufPool;
use crate::handshake::{self, Outcome, Security, Session};
use crate::metrics::NbdMetrics;
use crate::tls::{Access, TlsConfig};
use crate::transmission::{self, End};
use crate::workers::Workers;
use crate::NbdError;
use condense_api::{Catalog, Volume, VolumeError};
use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{oneshot, watch, OwnedSemaphorePermit, Semaphore};
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

/// Settings of a server.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Refuse every write, whatever the volumes allow.
    pub read_only: bool,
    /// Largest READ/WRITE payload (advertised as the maximum block size). At least 1 MiB.
    pub payload_bytes_max: u32,
    /// Bytes of requests and replies one connection may have in flight before the server
    /// stops reading from it (the in-flight budget, [`crate::budget`]).
    pub inflight_bytes_max: usize,
    /// Bytes of requests and replies all connections together may have in flight, beyond the
    /// 1 MiB each connection always has of its own ([`crate::budget::RESERVE_BYTES`]).
    pub server_inflight_bytes_max: usize,
    /// Connections served at once (handshake or transmission); more are closed on accept.
    pub max_connections: usize,
    /// How long shutdown waits for connections to answer what they have in flight.
    pub drain_timeout: Duration,
    /// Threads that run Volume API calls for all connections.
    pub worker_threads: usize,
    /// NBD over TLS (STARTTLS); `None` serves plaintext only and refuses STARTTLS.
    pub tls: Option<Arc<TlsConfig>>,
    /// Who may connect to the Unix socket endpoints: their owner (0600, the default) or a
    /// group too (0660).
    pub socket_access: crate::unix_socket::Access,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            read_only: false,
            payload_bytes_max: 32 * 1024 * 1024,
            // One largest request, or many small ones: seq 1 MiB reads at queue depth 4 and
            // nbdcopy's 64 requests of 256 KiB need 4 and 16 MiB.
            inflight_bytes_max: 32 * 1024 * 1024,
            // Twice one connection: two clients that never read cannot take more.
            server_inflight_bytes_max: 64 * 1024 * 1024,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            drain_timeout: Duration::from_secs(30),
            worker_threads: 4,
            tls: None,
            socket_access: crate::unix_socket::Access::Owner,
        }
    }
}

/// Connections served at once by default: far more than the VMs and backup jobs of one host
/// open (qemu opens one per disk, nbdcopy four), few enough that their in-flight reserves
/// (1 MiB each) and buffers stay small.
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;

/// How long a client may take from connecting to choosing an export (greeting, options,
/// TLS handshake): clients take milliseconds; an idle socket loses its slot after this.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// Connections refused beyond the cap are logged at most once per this interval.
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// What every connection shares.
pub struct Shared {
    pub catalog: Arc<dyn Catalog>,
    pub config: ServerConfig,
    pub workers: Workers,
    pub buffers: Arc<BufPool>,
    pub metrics: Arc<NbdMetrics>,
    /// The server-wide in-flight budget.
    pub budget: Budget,
    /// One permit per connection being served.
    slots: Arc<Semaphore>,
    /// Refusals not logged yet, and when the last log line was written.
    refusals: Mutex<(u64, Option<Instant>)>,
}

impl Shared {
    fn new(catalog: Arc<dyn Catalog>, config: ServerConfig) -> std::io::Result<Shared> {
        let workers = Workers::new(config.worker_threads)?;
        let metrics = Arc::new(NbdMetrics::default());
        Ok(Shared {
            catalog,
            budget: Budget::new(config.server_inflight_bytes_max, metrics.clone()),
            slots: Arc::new(Semaphore::new(
                config.max_connections.clamp(1, Semaphore::MAX_PERMITS),
            )),
            refusals: Mutex::new((0, None)),
            config,
            workers,
            buffers: Arc::new(BufPool::default()),
            metrics,
        })
    }

    /// A slot for a new connection, or `None` (counted and logged) when all are taken.
    fn admit(&self) -> Option<OwnedSemaphorePermit> {
        if let Ok(slot) = self.slots.clone().try_acquire_owned() {
            return Some(slot);
        }
        self.metrics.connection_refused();
        let mut r = self.refusals.lock().unwrap_or_else(|e| e.into_inner());
        r.0 += 1;
        if r.1.is_none_or(|t| t.elapsed() >= REFUSAL_LOG_INTERVAL) {
            tracing::warn!(
                "refused {} NBD connection(s) since the last report: {} clients are connected, \
                 the maximum (--max-connections)",
                r.0,
                self.config.max_connections
            );
            *r = (0, Some(Instant::now()));
        }
        None
    }
}

/// Run a blocking catalog or volume call off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, VolumeError> + Send + 'static,
) -> Result<T, VolumeError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| VolumeError::Io(format!("catalog task failed: {e}")))?
}

impl Shared {
    /// Volumes clients may see: the catalog's volumes except internal ones (leading '.').
    pub async fn visible_volumes(&self) -> Result<Vec<String>, VolumeError> {
        let catalog = self.catalog.clone();
        let list = blocking(move || catalog.list()).await?;
        Ok(list
            .into_iter()
            .map(|v| v.name)
            .filter(|n| is_exportable(n))
            .collect())
    }

    /// Exports clients may see (NBD_OPT_LIST): each visible volume followed by its visible
    /// snapshots as `VOLUME@SNAPSHOT`, oldest first. A catalog that cannot list its
    /// snapshots still lists its volumes.
    pub async fn visible_exports(&self) -> Result<Vec<String>, VolumeError> {
        let volumes = self.visible_volumes().await?;
        let catalog = self.catalog.clone();
        let snapshots = match blocking(move || catalog.snapshots()).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("cannot list snapshots: {e}");
                Vec::new()
            }
        };
        let mut out = Vec::with_capacity(volumes.len() + snapshots.len());
        for v in &volumes {
            out.push(v.clone());
            out.extend(
                snapshots
                    .iter()
                    .filter(|s| &s.volume == v)
                    .map(|s| s.full_name())
                    .filter(|n| is_exportable(n)),
            );
        }
        Ok(out)
    }

    /// Open the export a client named (a volume, or `VOLUME@SNAPSHOT` read-only); the empty
    /// name is the default export, which exists when the pool has exactly one visible volume.
    pub async fn open_export(&self, name: &str) -> Result<Arc<dyn Volume>, VolumeError> {
        let name = if name.is_empty() {
            let names = self.visible_volumes().await?;
            match names.as_slice() {
                [only] => only.clone(),
                _ => {
                    return Err(VolumeError::NotFound(
                        "(default export: name one, the pool has several or none)".to_string(),
                    ))
                }
            }
        } else {
            name.to_string()
        };
        if !is_exportable(&name) {
            return Err(VolumeError::NotFound(name));
        }
        let catalog = self.catalog.clone();
        blocking(move || catalog.open(&name)).await
    }
}

/// Whether a volume or snapshot name may be served: names (of the volume, or of the snapshot
/// in `VOLUME@SNAPSHOT`) beginning with '.' are internal, and so are empty ones.
pub fn is_exportable(name: &str) -> bool {
    let visible = |part: &str| !part.is_empty() && !part.starts_with('.');
    let parts_visible = match condense_api::split_snapshot_name(name) {
        Some((volume, snapshot)) => visible(volume) && visible(snapshot),
        None => visible(name),
    };
    parts_visible && name.len() <= crate::proto::STRING_BYTES_MAX
}

enum Bound {
    Tcp(std::net::TcpListener),
    Unix(std::os::unix::net::UnixListener, PathBuf),
}

/// A server bound to its endpoints, not yet serving.
pub struct Server {
    shared: Arc<Shared>,
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
        if config.max_connections == 0 {
            return Err(NbdError::Config(
                "max_connections is 0: no client could connect".to_string(),
            ));
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
            shared: Arc::new(Shared::new(catalog, config).map_err(NbdError::Runtime)?),
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
        self.shared.metrics.clone()
    }

    /// Serve until `shutdown` completes; then stop accepting, answer every request in flight,
    /// close the connections and flush the pool. Must run inside a tokio runtime.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), NbdError> {
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut acceptors = JoinSet::new();
        let mut socket_files = Vec::new();
        for l in self.listeners {
            let shared = self.shared.clone();
            let stop = stop_rx.clone();
            match l {
                Bound::Tcp(l) => {
                    let l = tokio::net::TcpListener::from_std(l).map_err(NbdError::Io)?;
                    acceptors.spawn(accept_loop(shared, stop, l));
                }
                Bound::Unix(l, path) => {
                    let l = tokio::net::UnixListener::from_std(l).map_err(NbdError::Io)?;
                    socket_files.push(path);
                    acceptors.spawn(accept_loop(shared, stop, l));
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
        let catalog = self.shared.catalog.clone();
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

/// A listener of either kind.
trait Acceptor: Send + 'static {
    type Conn: Stream;
    fn accept_one(&self) -> impl Future<Output = std::io::Result<(Self::Conn, String)>> + Send;
}

impl Acceptor for tokio::net::TcpListener {
    type Conn = tokio::net::TcpStream;
    async fn accept_one(&self) -> std::io::Result<(Self::Conn, String)> {
        let (s, peer) = self.accept().await?;
        // Replies are written whole; delaying small ones only adds latency.
        s.set_nodelay(true)?;
        Ok((s, peer.to_string()))
    }
}

impl Acceptor for tokio::net::UnixListener {
    type Conn = tokio::net::UnixStream;
    async fn accept_one(&self) -> std::io::Result<(Self::Conn, String)> {
        let (s, _) = self.accept().await?;
        Ok((s, "unix".to_string()))
    }
}

async fn accept_loop<A: Acceptor>(
    shared: Arc<Shared>,
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
            Ok((stream, peer)) => {
                // Beyond the cap: closed now, before the greeting allocates anything.
                let Some(slot) = shared.admit() else {
                    drop(stream);
                    continue;
                };
                tracing::debug!(peer, "connection");
                let shared = shared.clone();
                let stop = stop.clone();
                conns.spawn(async move {
                    let end = connection(stream, shared, stop).await;
                    drop(slot);
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
    let drain = shared.config.drain_timeout;
    let all_done = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(drain, all_done).await.is_err() {
        tracing::warn!("connections still busy after {drain:?}; closing them");
        conns.shutdown().await;
    }
}

/// How long a client may take over its TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// Serve one connection from greeting to close: plaintext, or upgraded to TLS by STARTTLS
/// (then everything after it, transmission included, is encrypted).
pub async fn connection<S: Stream>(
    mut stream: S,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
) -> End {
    let _client = shared.metrics.client();
    let deadline = tokio::time::Instant::now() + HANDSHAKE_TIMEOUT;
    let late = || End::Io(format!("no export chosen within {HANDSHAKE_TIMEOUT:?}"));
    let no_zeroes =
        match tokio::time::timeout_at(deadline, handshake::greet(&mut stream, &mut stop)).await {
            Err(_) => return late(),
            Ok(Ok(Some(no_zeroes))) => no_zeroes,
            Ok(Ok(None)) => return End::Closed,
            Ok(Err(e)) => return End::Io(e.to_string()),
        };
    let tls = shared.config.tls.clone();
    let session = Session {
        security: tls
            .as_ref()
            .map_or(Security::NoTls, |t| Security::Plain(t.mode)),
        access: Access::All,
        no_zeroes,
    };
    let negotiated = tokio::time::timeout_at(
        deadline,
        handshake::negotiate(&mut stream, &shared, &mut stop, &session),
    )
    .await;
    let Ok(negotiated) = negotiated else {
        return late();
    };
    match negotiated {
        Ok(Outcome::Transmission(export)) => transmit(stream, export, &shared, stop).await,
        Ok(Outcome::Close(why)) => {
            tracing::debug!(why, "handshake ended");
            End::Closed
        }
        Err(e) => End::Io(e.to_string()),
        Ok(Outcome::StartTls) => {
            let Some(tls) = tls else {
                return End::ProtocolViolation("STARTTLS without TLS settings".to_string());
            };
            let accepted = tokio::select! {
                r = tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, tls.accept(stream)) => r,
                _ = stop.changed() => return End::Shutdown,
            };
            let (mut stream, names, access) = match accepted {
                Ok(Ok(accepted)) => accepted,
                Ok(Err(e)) => {
                    tracing::info!("TLS handshake failed: {e}");
                    return End::Io(format!("TLS handshake: {e}"));
                }
                Err(_) => return End::Io("TLS handshake timed out".to_string()),
            };
            tracing::debug!(?names, ?access, "TLS established");
            let session = Session {
                security: Security::Tls,
                access,
                no_zeroes,
            };
            let negotiated = tokio::time::timeout_at(
                deadline,
                handshake::negotiate(&mut stream, &shared, &mut stop, &session),
            )
            .await;
            let Ok(negotiated) = negotiated else {
                return late();
            };
            match negotiated {
                Ok(Outcome::Transmission(export)) => transmit(stream, export, &shared, stop).await,
                Ok(Outcome::StartTls) => End::ProtocolViolation("STARTTLS twice".to_string()),
                Ok(Outcome::Close(why)) => {
                    tracing::debug!(why, "handshake over TLS ended");
                    End::Closed
                }
                Err(e) => End::Io(e.to_string()),
            }
        }
    }
}

/// Run the transmission phase on a negotiated connection, plaintext or TLS.
async fn transmit<S: Stream>(
    stream: S,
    export: handshake::Export,
    shared: &Arc<Shared>,
    stop: watch::Receiver<bool>,
) -> End {
    tracing::debug!(export = export.volume.name(), "transmission");
    let (r, w) = tokio::io::split(stream);
    transmission::serve(
        r,
        w,
        export,
        &shared.workers,
        &shared.buffers,
        &shared.metrics,
        shared.budget.connection(shared.config.inflight_bytes_max),
        stop,
    )
    .await
}

/// Serve one already-connected stream (a socketpair, an in-memory duplex) until it closes.
/// For tests and fuzzing; servers use [`Server::run`].
pub async fn serve_stream<S: Stream>(
    stream: S,
    catalog: Arc<dyn Catalog>,
    config: ServerConfig,
) -> End {
    let (_tx, rx) = watch::channel(false);
    let shared = match Shared::new(catalog, config) {
        Ok(s) => Arc::new(s),
        Err(e) => return End::Io(format!("cannot start worker threads: {e}")),
    };
    connection(stream, shared, rx).await
}
