//! The settings of a server and their defaults.
//!
//! Owns: [`ServerConfig`] and the default limits it starts from. Invariant: a configuration
//! in use has a payload maximum of at least 1 MiB and connection and handshake limits of at
//! least 1 ([`Server::bind`](crate::Server::bind) refuses others); the modules below the
//! server read it as given.
use crate::tls::TlsConfig;
use std::sync::Arc;
use std::time::Duration;

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
