//! An NBD (Network Block Device) server over the Condense Volume API.
//!
//! Each volume of a [`Catalog`](condense_api::Catalog) is an export named after it (names that
//! begin with '.' are internal and hidden). The server speaks the fixed newstyle handshake
//! (`NBD_OPT_GO`, `INFO`, `LIST`, `EXPORT_NAME`, `ABORT`, `STRUCTURED_REPLY`,
//! `LIST_META_CONTEXT`/`SET_META_CONTEXT` with `base:allocation`) and the commands READ (with
//! hole chunks for zero and unmapped ranges), WRITE, FLUSH, TRIM, WRITE_ZEROES (NO_HOLE,
//! FAST_ZERO), BLOCK_STATUS, CACHE and DISC, with FUA. Requests are pipelined: each runs on the
//! blocking pool and its reply is sent when it completes, out of order.
//!
//! Mapping to the Volume API:
//! - `base:allocation`: Data → 0, Zero → `NBD_STATE_ZERO`, Unmapped → `HOLE|ZERO`.
//! - WRITE_ZEROES with NO_HOLE → `write_zeroes(may_unmap = false)`, else `may_unmap = true`.
//!   FAST_ZERO always succeeds: zeroing changes block maps only, never writes data.
//! - `NBD_FLAG_CAN_MULTI_CONN` is advertised only when [`Volume::flush_is_pool_wide`] is true.
//! - Errors map through [`VolumeError::errno`](condense_api::VolumeError::errno) to the few
//!   NBD error values ([`proto::nbd_error_from_errno`]).
//! - Size constraints: minimum 1 (unaligned requests are fine), preferred = the pool's block
//!   size, maximum payload [`ServerConfig::payload_bytes_max`] (32 MiB).
//!
//! [`Volume::flush_is_pool_wide`]: condense_api::Volume::flush_is_pool_wide
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

mod buffers;
#[doc(hidden)]
pub mod fuzz;
mod handshake;
pub mod proto;
mod server;
mod transmission;
pub mod wire;
mod workers;

pub use server::{is_exportable, serve_stream, Endpoint, Server, ServerConfig, ServerHandle};
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
