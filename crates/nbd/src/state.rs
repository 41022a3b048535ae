//! The state every connection of one server shares.
//!
//! Owns: [`ServerState`]: the catalog, the configuration, the worker threads, the buffer
//! pool, the counters, the server-wide in-flight budget, the transmission slots (one permit
//! per connection in the transmission phase, at most [`ServerConfig::max_connections`]) and
//! the register of connections in the handshake. A connection takes a slot only through
//! [`ServerState::transmission_slot`], which counts and logs a refusal when none is left.
use crate::admission::{Handshakes, RateLimitedLog};
use crate::budget::Budget;
use crate::buffers::BufPool;
use crate::config::ServerConfig;
use crate::metrics::NbdMetrics;
use crate::workers::Workers;
use condense_api::Catalog;
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// What every connection of one server shares.
pub struct ServerState {
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
    pub handshakes: Arc<Handshakes>,
    /// Refusals for want of a transmission slot.
    refusals: RateLimitedLog,
}

impl ServerState {
    pub(crate) fn new(
        catalog: Arc<dyn Catalog>,
        config: ServerConfig,
    ) -> std::io::Result<ServerState> {
        let workers = Workers::new(config.worker_threads)?;
        let metrics = Arc::new(NbdMetrics::default());
        Ok(ServerState {
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

    /// Whether no connection holds a transmission slot (the last client is gone).
    pub(crate) fn no_transmissions(&self) -> bool {
        self.slots.available_permits()
            == self.config.max_connections.clamp(1, Semaphore::MAX_PERMITS)
    }
}
