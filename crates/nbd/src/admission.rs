//! Pre-authentication admission: the connections still in the handshake.
//!
//! Owns: the register of pending handshakes ([`Handshakes`]) — every connection from accept
//! until it has chosen an export — and the choice of which one to close when there are too
//! many. Transmission slots ([`crate::ServerConfig::max_connections`]) are taken only when an
//! export is chosen (after TLS when the server requires it), so clients without credentials
//! never hold one; this register bounds what they can hold instead.
//!
//! Invariants:
//! - At most [`crate::ServerConfig::max_handshakes`] connections are registered, and at most
//!   [`crate::ServerConfig::max_handshakes_per_address`] from one TCP source address (Unix
//!   socket clients have no address: only the total applies to them).
//! - A new connection is never refused while an older one can make room: as sshd's
//!   MaxStartups and nginx's limits keep floods from filling a server, but a flood keeps
//!   closing *its own* connections instead of turning others away. The one closed is from
//!   the address with the most handshakes (the same address when its own limit is reached),
//!   and of those the one that has waited longest without moving on a [`Stage`]. A real
//!   client moves on every few milliseconds, so an idle or stalled flood — even from the
//!   client's own address — must open a whole limit's worth of connections during one step
//!   of its handshake to close it; clients from other addresses are never closed for a
//!   flood that holds more handshakes than they do.
//! - A connection that has authenticated (TLS with a client certificate or pre-shared key) is
//!   never closed to make room; only when every registered connection has is a new one
//!   refused.
//! - A connection leaves the register when it is dropped from it (closed to make room: its
//!   [`Ticket::evicted`] resolves) or when its [`Ticket`] is dropped.

use crate::metrics::{Dropped, NbdMetrics};
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// How far a connection has come in its handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// Greeting sent; the client flags have not come yet (idle sockets stay here).
    Greeted,
    /// Options are being haggled in plaintext.
    Haggling,
    /// STARTTLS was acknowledged; the TLS handshake is running or done without client
    /// authentication.
    Tls,
    /// TLS established with an authenticated client: never closed to make room.
    Authenticated,
}

struct Entry {
    source: Option<IpAddr>,
    stage: Stage,
    /// When the connection last moved on a [`Stage`] (a tick of `Pending::next_id`).
    progress: u64,
    /// Dropped to close the connection ([`Ticket::evicted`] then resolves).
    _evict: oneshot::Sender<()>,
}

#[derive(Default)]
struct Pending {
    next_id: u64,
    /// By arrival: the smallest id is the oldest.
    entries: BTreeMap<u64, Entry>,
    per_source: HashMap<IpAddr, usize>,
}

impl Pending {
    fn count(&self, source: Option<IpAddr>) -> usize {
        source.map_or(0, |ip| self.per_source.get(&ip).copied().unwrap_or(0))
    }

    fn remove(&mut self, id: u64) -> bool {
        let Some(e) = self.entries.remove(&id) else {
            return false;
        };
        if let Some(ip) = e.source {
            if let Some(n) = self.per_source.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    self.per_source.remove(&ip);
                }
            }
        }
        true
    }

    /// The connection to close for room: among those not authenticated (from `only` if
    /// given), the one from the address with the most handshakes that has waited longest
    /// without moving on a stage.
    fn victim(&self, only: Option<IpAddr>) -> Option<u64> {
        self.entries
            .iter()
            .filter(|(_, e)| e.stage < Stage::Authenticated)
            .filter(|(_, e)| only.is_none() || e.source == only)
            .min_by_key(|(_, e)| (std::cmp::Reverse(self.count(e.source)), e.progress))
            .map(|(id, _)| *id)
    }
}

/// A warning written at most once per [`LOG_INTERVAL`], with the number of events since the
/// last one (floods must not flood the log).
#[derive(Default)]
pub struct RateLimitedLog(Mutex<(u64, Option<Instant>)>);

/// See [`RateLimitedLog`].
pub const LOG_INTERVAL: Duration = Duration::from_secs(10);

impl RateLimitedLog {
    /// Count one event; `write` gets the events since the last line when one is due.
    pub fn event(&self, write: impl FnOnce(u64)) {
        let mut r = self.0.lock().unwrap_or_else(|e| e.into_inner());
        r.0 += 1;
        if r.1.is_none_or(|t| t.elapsed() >= LOG_INTERVAL) {
            write(r.0);
            *r = (0, Some(Instant::now()));
        }
    }
}

/// The register of connections in the handshake (see the module docs).
pub struct Handshakes {
    pending: Mutex<Pending>,
    max: usize,
    per_address: usize,
    metrics: Arc<NbdMetrics>,
    log: RateLimitedLog,
}

/// A connection admitted to the register: its place, and the signal that it was closed to
/// make room.
pub struct Ticket {
    pub place: Place,
    pub evicted: Evicted,
}

/// A connection's place in the register; dropping it leaves the register.
pub struct Place {
    register: Arc<Handshakes>,
    id: u64,
}

/// Resolves when the connection was closed to make room for a newer one.
pub struct Evicted(oneshot::Receiver<()>);

impl Handshakes {
    pub fn new(max: usize, per_address: usize, metrics: Arc<NbdMetrics>) -> Handshakes {
        Handshakes {
            pending: Mutex::new(Pending::default()),
            max: max.max(1),
            per_address: per_address.max(1),
            metrics,
            log: RateLimitedLog::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Register a new connection from `source` (`None`: a Unix socket), closing an older one
    /// if there is no room; `None` (counted) when every registered one is authenticated.
    pub fn admit(self: &Arc<Self>, source: Option<IpAddr>) -> Option<Ticket> {
        let mut p = self.lock();
        if source.is_some() && p.count(source) >= self.per_address {
            match p.victim(source) {
                Some(id) => self.evict(&mut p, id, Dropped::AddressLimit),
                None => {
                    self.dropped(Dropped::AddressLimit);
                    return None;
                }
            }
        }
        if p.entries.len() >= self.max {
            match p.victim(None) {
                Some(id) => self.evict(&mut p, id, Dropped::HandshakeLimit),
                None => {
                    self.dropped(Dropped::HandshakeLimit);
                    return None;
                }
            }
        }
        let id = p.next_id;
        p.next_id += 1;
        let (tx, rx) = oneshot::channel();
        p.entries.insert(
            id,
            Entry {
                source,
                stage: Stage::Greeted,
                progress: id,
                _evict: tx,
            },
        );
        if let Some(ip) = source {
            *p.per_source.entry(ip).or_default() += 1;
        }
        self.metrics.handshakes_set(p.entries.len());
        Some(Ticket {
            place: Place {
                register: self.clone(),
                id,
            },
            evicted: Evicted(rx),
        })
    }

    fn evict(&self, p: &mut Pending, id: u64, why: Dropped) {
        if p.remove(id) {
            self.dropped(why);
        }
    }

    fn dropped(&self, why: Dropped) {
        self.metrics.handshake_dropped(why);
        self.log.event(|n| {
            tracing::warn!(
                "closed {n} NBD connection(s) still in the handshake since the last report to \
                 make room for new ones ({} at most, {} per address): a client opens \
                 connections without finishing them \
                 (condense_nbd_handshakes_dropped_total)",
                self.max,
                self.per_address
            );
        });
    }

    /// Connections registered now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().entries.len()
    }
}

impl Place {
    /// Record how far the handshake has come.
    pub fn advance(&self, stage: Stage) {
        let mut p = self.register.lock();
        let tick = p.next_id;
        p.next_id += 1;
        if let Some(e) = p.entries.get_mut(&self.id) {
            e.stage = e.stage.max(stage);
            e.progress = tick;
        }
    }
}

impl Evicted {
    /// Wait until the connection is closed to make room.
    pub async fn wait(self) {
        // The sender is only ever dropped, never used: either way the entry is gone.
        let _ = self.0.await;
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut p = self.register.lock();
        p.remove(self.id);
        self.register.metrics.handshakes_set(p.entries.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> Option<IpAddr> {
        Some(IpAddr::from([10, 0, 0, last]))
    }

    fn register(max: usize, per_address: usize) -> Arc<Handshakes> {
        Arc::new(Handshakes::new(
            max,
            per_address,
            Arc::new(NbdMetrics::default()),
        ))
    }

    fn is_evicted(t: &mut Ticket) -> bool {
        matches!(
            t.evicted.0.try_recv(),
            Err(oneshot::error::TryRecvError::Closed)
        )
    }

    #[test]
    fn a_flood_closes_its_own_connections_not_those_of_other_addresses() {
        let r = register(8, 4);
        let mut legit = r.admit(ip(1)).expect("room");
        let mut flood: Vec<Ticket> = (0..1000).filter_map(|_| r.admit(ip(2))).collect();
        assert_eq!(r.len(), 5, "the flood holds its address limit only");
        assert!(!is_evicted(&mut legit));
        let open = flood
            .iter_mut()
            .filter_map(|t| (!is_evicted(t)).then_some(()))
            .count();
        assert_eq!(open, 4, "the newest four of the flood are left");
        // A second flooding address fills the rest; the busiest address loses first.
        let _more: Vec<Ticket> = (0..1000).filter_map(|_| r.admit(ip(3))).collect();
        assert_eq!(r.len(), 8);
        assert!(!is_evicted(&mut legit));
    }

    #[test]
    fn the_connection_idle_longest_goes_first() {
        let r = register(4, 4);
        let mut advanced = r.admit(None).expect("room");
        let mut idle: Vec<Ticket> = (0..3).filter_map(|_| r.admit(None)).collect();
        advanced.place.advance(Stage::Tls);
        let _new = r.admit(None).expect("room made");
        assert!(
            !is_evicted(&mut advanced),
            "it moved on after the idle ones came"
        );
        assert!(is_evicted(&mut idle[0]), "the oldest idle one went");
        assert!(!is_evicted(&mut idle[1]));
    }

    #[test]
    fn authenticated_connections_stay_and_new_ones_are_refused_when_all_are() {
        let r = register(2, 2);
        let a: Vec<Ticket> = (0..2).filter_map(|_| r.admit(ip(1))).collect();
        for t in &a {
            t.place.advance(Stage::Authenticated);
        }
        assert!(r.admit(ip(1)).is_none());
        assert!(r.admit(ip(2)).is_none());
        drop(a);
        assert_eq!(r.len(), 0, "tickets leave the register when dropped");
        assert!(r.admit(ip(2)).is_some());
    }
}
