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
use crate::admission::{Handshakes, RateLimitedLog, Stage, Ticket};
use crate::budget::Budget;
use crate::buffers::BufPool;
use crate::handshake::{self, Outcome, Security, Session};
use crate::metrics::{Dropped, NbdMetrics};
use crate::tls::{Access, TlsConfig, TlsStream};
use crate::transmission::{self, End};
use crate::workers::Workers;
use crate::NbdError;
use condense_api::{Catalog, Volume, VolumeError};
use std::fmt;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
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
    /// Connections in the transmission phase at once; a client choosing an export beyond it
    /// is refused.
    pub max_connections: usize,
    /// Connections in the handshake (accepted, no export chosen) at once; beyond it the
    /// unauthenticated one idle longest is closed ([`crate::admission`]).
    pub max_handshakes: usize,
    /// Connections in the handshake at once from one TCP source address (IPv6: one /64).
    pub max_handshakes_per_address: usize,
    /// How long a client may take from accept to choosing an export (greeting, options, TLS
    /// handshake).
    pub handshake_timeout: Duration,
    /// How long shutdown waits for connections to take the replies of what they have in
    /// flight before closing them.
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
            max_handshakes: DEFAULT_MAX_HANDSHAKES,
            max_handshakes_per_address: DEFAULT_MAX_HANDSHAKES_PER_ADDRESS,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            // Clients that read take their replies in milliseconds; this bounds shutdown for
            // those that do not.
            drain_timeout: Duration::from_secs(3),
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

/// Connections in the handshake at once by default: twice the transmission slots, so clients
/// connecting together are never short of room, yet a flood of idle or unauthenticated
/// sockets holds little (no buffers, no volume).
pub const DEFAULT_MAX_HANDSHAKES: usize = 128;

/// Connections in the handshake at once from one TCP source address by default: more than a
/// host starting many VMs at once opens, a quarter of [`DEFAULT_MAX_HANDSHAKES`].
pub const DEFAULT_MAX_HANDSHAKES_PER_ADDRESS: usize = 32;

/// How long a client may take from connecting to choosing an export (greeting, options,
/// TLS handshake) by default: clients take milliseconds, even over a slow link.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What every connection shares.
pub struct Shared {
    pub catalog: Arc<dyn Catalog>,
    pub config: ServerConfig,
    pub workers: Workers,
    pub buffers: Arc<BufPool>,
    pub metrics: Arc<NbdMetrics>,
    /// The server-wide in-flight budget.
    pub budget: Budget,
    /// One permit per connection in the transmission phase.
    slots: Arc<Semaphore>,
    /// Connections in the handshake.
    handshakes: Arc<Handshakes>,
    /// Refusals for want of a transmission slot.
    refusals: RateLimitedLog,
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
            handshakes: Arc::new(Handshakes::new(
                config.max_handshakes,
                config.max_handshakes_per_address,
                metrics.clone(),
            )),
            refusals: RateLimitedLog::default(),
            config,
            workers,
            buffers: Arc::new(BufPool::default()),
            metrics,
        })
    }

    /// A transmission slot for a client that chose its export, or `None` (counted and
    /// logged) when all are taken.
    pub(crate) fn transmission_slot(&self) -> Option<OwnedSemaphorePermit> {
        if let Ok(slot) = self.slots.clone().try_acquire_owned() {
            return Some(slot);
        }
        self.metrics.connection_refused();
        self.refusals.event(|n| {
            tracing::warn!(
                "refused {n} NBD client(s) their export since the last report: {} clients \
                 are served, the maximum (--max-connections)",
                self.config.max_connections
            );
        });
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
            Ok((stream, source, peer)) => {
                // No room even after closing older handshakes: closed now, before the greeting.
                let Some(ticket) = shared.handshakes.admit(source) else {
                    drop(stream);
                    continue;
                };
                tracing::debug!(peer, "connection");
                let shared = shared.clone();
                let stop = stop.clone();
                conns.spawn(async move {
                    let end = connection(stream, shared, stop, ticket).await;
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

/// A connection whose handshake chose an export, holding its transmission slot.
enum Ready<S> {
    Plain(S, handshake::Export),
    Tls(Box<TlsStream<S>>, handshake::Export),
}

/// Serve one connection from greeting to close: plaintext, or upgraded to TLS by STARTTLS
/// (then everything after it, transmission included, is encrypted). The handshake ends at
/// the deadline, or when the register of handshakes closes the connection to make room.
pub async fn connection<S: Stream>(
    stream: S,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
    ticket: Ticket,
) -> End {
    let _client = shared.metrics.client();
    let Ticket { place, evicted } = ticket;
    let limit = shared.config.handshake_timeout;
    let ready = tokio::select! {
        r = tokio::time::timeout(limit, handshake_phase(stream, &shared, &mut stop, &place)) => r,
        () = evicted.wait() => {
            return End::Io("closed in the handshake to make room for newer connections".into())
        }
    };
    // Out of the register: the export is chosen, or the connection ends.
    drop(place);
    match ready {
        Err(_) => {
            shared.metrics.handshake_dropped(Dropped::Timeout);
            End::Io(format!("no export chosen within {limit:?}"))
        }
        Ok(Err(end)) => end,
        Ok(Ok(Ready::Plain(s, export))) => transmit(s, export, &shared, stop).await,
        Ok(Ok(Ready::Tls(s, export))) => transmit(*s, export, &shared, stop).await,
    }
}

/// The handshake: greeting, options, and if the client asks, TLS and options again.
async fn handshake_phase<S: Stream>(
    mut stream: S,
    shared: &Arc<Shared>,
    stop: &mut watch::Receiver<bool>,
    place: &crate::admission::Place,
) -> Result<Ready<S>, End> {
    let no_zeroes = match handshake::greet(&mut stream, stop).await {
        Ok(Some(no_zeroes)) => no_zeroes,
        Ok(None) => return Err(End::Closed),
        Err(e) => return Err(End::Io(e.to_string())),
    };
    place.advance(Stage::Haggling);
    let tls = shared.config.tls.clone();
    let session = Session {
        security: tls
            .as_ref()
            .map_or(Security::NoTls, |t| Security::Plain(t.mode)),
        access: Access::All,
        no_zeroes,
    };
    match handshake::negotiate(&mut stream, shared, stop, &session).await {
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
    match handshake::negotiate(&mut stream, shared, stop, &session).await {
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
    export: handshake::Export,
    shared: &Arc<Shared>,
    stop: watch::Receiver<bool>,
) -> End {
    tracing::debug!(export = export.volume.name(), "transmission");
    let (r, w) = tokio::io::split(stream);
    let end = transmission::serve(
        r,
        w,
        export,
        &shared.workers,
        &shared.buffers,
        &shared.metrics,
        shared.budget.connection(shared.config.inflight_bytes_max),
        stop,
    )
    .await;
    // The export, and its slot, are dropped: the last client gone, the server's memory goes
    // back to its idle size.
    if shared.slots.available_permits()
        == shared
            .config
            .max_connections
            .clamp(1, Semaphore::MAX_PERMITS)
    {
        let buffers = shared.buffers.clone();
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
    let shared = match Shared::new(catalog, config) {
        Ok(s) => Arc::new(s),
        Err(e) => return End::Io(format!("cannot start worker threads: {e}")),
    };
    let Some(ticket) = shared.handshakes.admit(None) else {
        return End::Io("no room in the register of handshakes".to_string());
    };
    connection(stream, shared, rx, ticket).await
}
