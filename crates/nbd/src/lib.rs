//! An NBD (Network Block Device) server over the Condense Volume API.
//!
//! Each volume of a [`Catalog`](condense_api::Catalog) is an export named after it, and each of
//! its snapshots a read-only export named `VOLUME@SNAPSHOT` (names whose volume or snapshot
//! part begins with '.' are internal and hidden; `NBD_OPT_LIST` shows each visible volume
//! followed by its visible snapshots, oldest first). The server speaks the fixed newstyle
//! handshake (`NBD_OPT_GO`, `INFO`, `LIST`, `EXPORT_NAME`, `ABORT`, `STRUCTURED_REPLY`,
//! `LIST_META_CONTEXT`/`SET_META_CONTEXT` with `base:allocation` and
//! `qemu:dirty-bitmap:SNAPSHOT`) and the commands READ (with hole chunks for zero and unmapped
//! ranges), WRITE, FLUSH, TRIM, WRITE_ZEROES (NO_HOLE, FAST_ZERO), BLOCK_STATUS (REQ_ONE),
//! CACHE and DISC, with FUA. Requests are pipelined: each runs on the blocking pool and its
//! reply is sent when it completes, out of order. Extended headers
//! (`NBD_OPT_EXTENDED_HEADERS`) are not offered.
//!
//! Unix sockets are created 0600 (or 0660 for one group, [`ServerConfig::socket_access`])
//! whatever the umask: see [`unix_socket`].
//!
//! NBD over TLS: with [`ServerConfig::tls`] set, clients upgrade with `NBD_OPT_STARTTLS`
//! (forced or optional, client certificates or pre-shared keys, per-client exports): see the
//! [`tls`] and [`psk`] modules.
//!
//! Snapshot exports: [`Volume::is_read_only`] is true for them, so the server advertises
//! `NBD_FLAG_READ_ONLY`, neither TRIM nor WRITE_ZEROES, and refuses WRITE, TRIM and
//! WRITE_ZEROES with `EPERM`. They serve READ and `base:allocation`, and offer no dirty bitmaps.
//!
//! # Dirty bitmaps (incremental backup)
//!
//! The export of a volume offers one metadata context `qemu:dirty-bitmap:SNAP` per snapshot
//! `SNAP` of it ([`Volume::snapshot_names`]), with qemu's meaning of the flags
//! (`docs/interop/nbd.rst`): bit 0 (`NBD_STATE_DIRTY`) set = the block changed since the
//! snapshot, clear = it did not. A backup application selects it, asks BLOCK_STATUS and copies
//! only the dirty ranges (`nbdinfo --map=qemu:dirty-bitmap:SNAP`, qemu's
//! `x-dirty-bitmap=qemu:dirty-bitmap:SNAP`, the oVirt/libvirt incremental-backup pattern).
//!
//! A block is dirty when its content — its block-map entry — differs from the snapshot's
//! ([`Volume::changed_since`]): new data, a trim or zeroing of a block that held data, zeros
//! written where the snapshot had a hole (a hole and allocated zeros are different entries).
//! Rewriting a block with the bytes it already holds is *not* dirty (deduplication maps it to
//! the same chunk; should the advisory dedup index miss it, the block reads as dirty, the safe
//! side). That is stricter than qemu's own bitmaps, which mark every write, and exactly what
//! a backup wants. The answer
//! is computed from the block maps on every request, so it is exact at that instant and needs no
//! bitmap to be kept, persisted or reset. Where the volume's answer has a gap the server reports
//! dirty (a backup then copies too much, never too little).
//!
//! Meta context negotiation: `NBD_OPT_LIST_META_CONTEXT` with no query lists
//! `base:allocation` and every bitmap; the queries `base:`, `qemu:` and `qemu:dirty-bitmap:`
//! list their namespace. `NBD_OPT_SET_META_CONTEXT` selects exact names only (wildcards and
//! unknown snapshots select nothing, which is not an error) and gives each context its own id:
//! `base:allocation` is 1, bitmaps count up from 2 in the order selected. BLOCK_STATUS then
//! sends one `NBD_REPLY_TYPE_BLOCK_STATUS` chunk per selected context in id order, the last one
//! flagged DONE; each chunk's descriptors start at the request's offset and cover at most its
//! length (all of it, up to 1 GiB per request, unless REQ_ONE asks for one descriptor per
//! context). If a context cannot be answered (its snapshot was deleted meanwhile) the reply is
//! an error, never a guess.
//!
//! Mapping to the Volume API:
//! - `base:allocation`: Data → 0, Zero → `NBD_STATE_ZERO`, Unmapped → `HOLE|ZERO`.
//! - `qemu:dirty-bitmap:SNAP`: [`Change`](condense_api::Change) `changed` → 1, else 0.
//! - WRITE_ZEROES with NO_HOLE → `write_zeroes(may_unmap = false)`, else `may_unmap = true`.
//!   FAST_ZERO always succeeds: zeroing changes block maps only, never writes data.
//! - `NBD_FLAG_CAN_MULTI_CONN` is advertised only when [`Volume::flush_is_pool_wide`] is true.
//! - Errors map through [`VolumeError::errno`](condense_api::VolumeError::errno) to the few
//!   NBD error values ([`proto::nbd_error_from_errno`]).
//! - Size constraints: minimum 1 (unaligned requests are fine), preferred = the pool's block
//!   size, maximum payload [`ServerConfig::payload_bytes_max`] (32 MiB).
//!
//! Bounded resources: every request, refused ones included, holds part of an in-flight budget
//! until its reply is written (per connection [`ServerConfig::inflight_bytes_max`], server-wide
//! [`ServerConfig::server_inflight_bytes_max`] plus a small reserve per connection), so a
//! client that never reads its replies stops being read; at most
//! [`ServerConfig::max_connections`] connections are in transmission, a slot taken only once
//! the client has chosen its export (after TLS when it is required). Connections still in the
//! handshake have a deadline and a register of their own, with a per-address limit on TCP,
//! which closes the unauthenticated ones idle longest to make room
//! ([`ServerConfig::max_handshakes`]): a flood of sockets without credentials cannot keep a
//! client with them out. Shutdown gives clients [`ServerConfig::drain_timeout`] to take their
//! last replies.
//!
//! [`Volume::flush_is_pool_wide`]: condense_api::Volume::flush_is_pool_wide
//! [`Volume::is_read_only`]: condense_api::Volume::is_read_only
//! [`Volume::snapshot_names`]: condense_api::Volume::snapshot_names
//! [`Volume::changed_since`]: condense_api::Volume::changed_since
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use condense_nbd::{Endpoint, Server, ServerConfig};
//! let catalog = Arc::new(condense_api::mem::MemCatalog::new(4096));
//! let server = Server::bind(catalog, ServerConfig::default(),
//!     &[Endpoint::Tcp("127.0.0.1:10809".parse().expect("address"))])?;
//! let handle = server.spawn()?;   // serves on its own thread
//! // ... qemu-img convert ... nbd://127.0.0.1:10809/NAME
//! handle.shutdown()?;              // finish in-flight requests, flush the pool
//! # Ok::<(), condense_nbd::NbdError>(())
//! ```

#![deny(clippy::unwrap_used)]

mod admission;
mod budget;
mod buffers;
mod config;
mod export;
/// Entry points of the fuzz targets; not in release builds (feature `fuzzing`, on in
/// fuzz/Cargo.toml and for this crate's own tests).
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzz;
mod handshake;
mod metrics;
pub mod proto;
pub mod psk;
mod server;
mod state;
pub mod tls;
mod transmission;
pub mod unix_socket;
pub mod wire;
mod workers;

pub use config::{
    ServerConfig, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_HANDSHAKES,
    DEFAULT_MAX_HANDSHAKES_PER_ADDRESS, HANDSHAKE_TIMEOUT,
};
pub use export::is_exportable;
pub use metrics::{Dropped, NbdMetrics};
pub use server::{serve_stream, Endpoint, Server, ServerHandle};
pub use tls::{ExportRules, TlsConfig, TlsError, TlsMode};
pub use transmission::End;

/// What can go wrong starting or stopping a server (per-connection failures only end that
/// connection and are logged).
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    #[error("cannot listen on {endpoint}: {source}")]
    Bind {
        endpoint: String,
        source: std::io::Error,
    },
    #[error("invalid server configuration: {0}")]
    Config(String),
    #[error("cannot start the server runtime: {0}")]
    Runtime(std::io::Error),
    #[error("I/O error: {0}")]
    Io(std::io::Error),
    #[error("flushing the pool at shutdown failed: {0}")]
    Flush(#[from] condense_api::VolumeError),
    #[error("the server thread panicked")]
    Panicked,
}
