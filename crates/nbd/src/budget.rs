//! The in-flight budget: how much memory requests and their replies may hold, per connection
//! and in the whole server.
//!
//! Owns: the server-wide pool of in-flight bytes ([`Budget`]) and each connection's share of
//! it ([`ConnBudget`]). Every request takes a [`Permit`] as soon as its header is read —
//! before its payload is read and before it runs, whether it will be answered with data, an
//! error or a refusal — and holds it until its reply has been written to the socket (or dropped
//! with the connection). When a connection cannot get a permit, the server stops reading from
//! it: a client that never reads its replies meets TCP backpressure, and the memory held for
//! it stays bounded however much it sends.
//!
//! Invariants:
//! - A permit's cost covers the memory its request holds until its reply is written: the
//!   payload or data buffer as allocated ([`crate::buffers::BufPool::alloc_bytes`]) and the
//!   reply's headers, in [`UNIT_BYTES`] units, at least one unit for any request (so a
//!   connection has at most `per_connection / UNIT_BYTES` requests in flight, refused ones
//!   included).
//! - One connection holds at most its `per_connection` units (a request larger than that
//!   takes all of them: it runs alone).
//! - Connections draw on the server-wide pool, except that each may always use a reserve of
//!   its own ([`RESERVE_BYTES`]): clients that fill the server-wide pool and never read cannot
//!   starve the others, whose small requests keep running on their reserves.
//!
//! So the server's request and reply buffers stay below `server + connections × RESERVE_BYTES`
//! (64 MiB + 64 × 1 MiB with the defaults and `--max-connections 64`).

use crate::metrics::NbdMetrics;
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Unit of the budget: a request costs whole units.
pub const UNIT_BYTES: usize = 4096;
/// What each connection may hold outside the server-wide pool.
pub const RESERVE_BYTES: usize = 1 << 20;
const RESERVE_UNITS: u32 = (RESERVE_BYTES / UNIT_BYTES) as u32;

fn units(bytes: usize) -> u32 {
    u32::try_from(bytes / UNIT_BYTES)
        .unwrap_or(u32::MAX)
        .clamp(1, Semaphore::MAX_PERMITS as u32)
}

/// Units a request holding `bytes` of buffers costs (at least one).
pub fn cost_units(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(UNIT_BYTES))
        .unwrap_or(u32::MAX)
        .max(1)
}

/// The server-wide pool.
pub struct Budget {
    shared: Arc<Semaphore>,
    shared_units: u32,
    metrics: Arc<NbdMetrics>,
}

/// The budget is gone (the connection is ending).
#[derive(Debug)]
pub struct Closed;

impl Budget {
    pub fn new(server_bytes: usize, metrics: Arc<NbdMetrics>) -> Budget {
        let shared_units = units(server_bytes);
        Budget {
            shared: Arc::new(Semaphore::new(shared_units as usize)),
            shared_units,
            metrics,
        }
    }

    /// A new connection's budget: at most `per_connection_bytes` in flight.
    pub fn connection(&self, per_connection_bytes: usize) -> ConnBudget {
        let own_units = units(per_connection_bytes);
        ConnBudget {
            own: Arc::new(Semaphore::new(own_units as usize)),
            own_units,
            reserve: Arc::new(Semaphore::new(RESERVE_UNITS as usize)),
            shared: self.shared.clone(),
            shared_units: self.shared_units,
            metrics: self.metrics.clone(),
        }
    }
}

/// One connection's budget.
pub struct ConnBudget {
    own: Arc<Semaphore>,
    own_units: u32,
    reserve: Arc<Semaphore>,
    shared: Arc<Semaphore>,
    shared_units: u32,
    metrics: Arc<NbdMetrics>,
}

/// Budget held by one request until its reply is written.
pub struct Permit {
    _own: OwnedSemaphorePermit,
    _memory: OwnedSemaphorePermit,
    bytes: i64,
    metrics: Arc<NbdMetrics>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.metrics.inflight_bytes_sub(self.bytes);
    }
}

impl ConnBudget {
    /// Take a request's share now if it fits without waiting (the common case: no future,
    /// no select). `None`: wait in [`ConnBudget::acquire`].
    pub fn try_acquire(&self, bytes: usize) -> Option<Permit> {
        let cost = cost_units(bytes);
        let own = self
            .own
            .clone()
            .try_acquire_many_owned(cost.min(self.own_units))
            .ok()?;
        let memory = if cost <= RESERVE_UNITS {
            self.reserve
                .clone()
                .try_acquire_many_owned(cost)
                .or_else(|_| self.shared.clone().try_acquire_many_owned(cost))
        } else {
            self.shared
                .clone()
                .try_acquire_many_owned(cost.min(self.shared_units))
        }
        .ok()?;
        Some(self.permit(own, memory, cost))
    }

    /// Wait until a request holding `bytes` of buffers fits, and take its share.
    pub async fn acquire(&self, bytes: usize) -> Result<Permit, Closed> {
        let cost = cost_units(bytes);
        let own = self
            .own
            .clone()
            .acquire_many_owned(cost.min(self.own_units))
            .await
            .map_err(|_| Closed)?;
        let memory = if cost <= RESERVE_UNITS {
            // The reserve first (never contended by other connections), else the shared pool,
            // else whichever frees up first.
            tokio::select! {
                biased;
                r = self.reserve.clone().acquire_many_owned(cost) => r,
                s = self.shared.clone().acquire_many_owned(cost) => s,
            }
        } else {
            self.shared
                .clone()
                .acquire_many_owned(cost.min(self.shared_units))
                .await
        }
        .map_err(|_| Closed)?;
        Ok(self.permit(own, memory, cost))
    }

    fn permit(&self, own: OwnedSemaphorePermit, memory: OwnedSemaphorePermit, cost: u32) -> Permit {
        let bytes = i64::from(cost) * UNIT_BYTES as i64;
        self.metrics.inflight_bytes_add(bytes);
        Permit {
            _own: own,
            _memory: memory,
            bytes,
            metrics: self.metrics.clone(),
        }
    }

    /// Wait until every permit of this connection is back: every reply is written or dropped.
    pub async fn drained(&self) {
        let _all = self.own.acquire_many(self.own_units).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn rt() -> tokio::runtime::Runtime {
        match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(r) => r,
            Err(e) => panic!("runtime: {e}"),
        }
    }

    async fn take(c: &ConnBudget, bytes: usize) -> Option<Permit> {
        tokio::time::timeout(Duration::from_millis(50), c.acquire(bytes))
            .await
            .ok()
            .and_then(Result::ok)
    }

    #[test]
    fn a_connection_is_capped_and_a_full_server_still_serves_reserves() {
        rt().block_on(async {
            let m = Arc::new(NbdMetrics::default());
            let server = Budget::new(8 << 20, m.clone());
            let greedy = server.connection(4 << 20);
            let greedy2 = server.connection(4 << 20);
            let polite = server.connection(4 << 20);
            // A connection stops at its own cap...
            let g1 = take(&greedy, 4 << 20).await;
            assert!(g1.is_some());
            assert!(take(&greedy, 4096).await.is_none(), "own cap");
            assert!(
                greedy.try_acquire(4096).is_none(),
                "own cap, without waiting"
            );
            let g2 = take(&greedy2, 4 << 20).await;
            assert!(
                g2.is_some(),
                "the second greedy connection fills the server pool"
            );
            assert_eq!(m.inflight_bytes(), 8 << 20);
            // ...the server pool is full, yet the polite one runs on its reserve.
            let p = take(&polite, 256 << 10).await;
            assert!(p.is_some(), "reserve");
            let p2 = take(&polite, 768 << 10).await;
            assert!(p2.is_some(), "the rest of the reserve");
            assert!(take(&polite, 4096).await.is_none(), "reserve spent");
            assert!(
                polite.try_acquire(4096).is_none(),
                "reserve spent, without waiting"
            );
            drop(p);
            assert!(
                polite.try_acquire(4096).is_some(),
                "reserve back, without waiting"
            );
            assert!(take(&polite, 4096).await.is_some(), "reserve back");
            // A request larger than the reserve waits for the server pool.
            assert!(take(&polite, 2 << 20).await.is_none());
            drop(g1);
            assert!(take(&polite, 2 << 20).await.is_some());
            drop((g2, p2));
        });
    }

    #[test]
    fn every_request_costs_at_least_one_unit_and_drained_waits_for_all() {
        rt().block_on(async {
            let m = Arc::new(NbdMetrics::default());
            let server = Budget::new(1 << 20, m.clone());
            let c = server.connection(64 * UNIT_BYTES);
            let mut held = Vec::new();
            while let Some(p) = take(&c, 0).await {
                held.push(p);
            }
            assert_eq!(held.len(), 64, "64 refusals fill a 64-unit budget");
            let drained = tokio::time::timeout(Duration::from_millis(50), c.drained()).await;
            assert!(drained.is_err(), "not drained while replies are held");
            held.clear();
            assert_eq!(m.inflight_bytes(), 0);
            let drained = tokio::time::timeout(Duration::from_millis(50), c.drained()).await;
            assert!(drained.is_ok());
        });
    }
}
