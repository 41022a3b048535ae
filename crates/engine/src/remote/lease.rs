//! The one-writer lease of a pool in a bucket ([`Lease`]): the `lease` object, taking it
//! over, renewing it and releasing it.
//!
//! Invariants:
//! - Only the lease holder writes (best effort on stores without conditional PUT, see
//!   [`Lease`]); a renewal that finds another holder's nonce marks the lease lost, and every
//!   later write of this open is refused (`Shared::may_write`).
//! - A clean close deletes the lease only if it is still this open's.

use super::conf::remote_error;
use super::shared::Shared;
use crate::error::{Error, Result};
pub(crate) use crate::format::remote::LeaseBody;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub(super) const LEASE_NAME: &str = "lease";
/// A lease not renewed for this long is free to take.
pub const LEASE_SECONDS: u64 = 30;
/// The holder renews its lease this often.
const LEASE_RENEW: Duration = Duration::from_secs(10);
/// After writing the lease, wait this long and read it back (stores without conditional PUT).
const LEASE_SETTLE: Duration = Duration::from_millis(500);

/// One writer per pool: the `lease` object names the host and process that writes the pool
/// and until when; the holder renews it every 10 s and deletes it at a clean close.
///
/// On a store that honours conditional PUT the first writer of an absent lease wins
/// exactly. Garage 2.5.0 does not (tests/s3/README.md): there the taker writes the lease,
/// waits [`LEASE_SETTLE`], reads it back and holds it only if its nonce is there. That
/// refuses every writer that comes after the lease is visible; two opens within one round
/// trip could both win, and the renewal then finds a foreign nonce: that host stops
/// writing (`health: lease lost`). A lease whose process is gone from this host (kill -9,
/// a crash) is taken over at once; one of another host after it expires (30 s).
pub struct Lease {
    shared: Arc<Shared>,
    nonce: String,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LeaseBody {
    pub(crate) fn fresh(nonce: &str) -> LeaseBody {
        let now = unix_now();
        LeaseBody {
            host: hostname(),
            pid: std::process::id(),
            nonce: nonce.to_string(),
            expires: now + LEASE_SECONDS,
            renewed: now,
        }
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown-host".into())
}

fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: kill with signal 0 only checks that the process exists; no memory involved.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// A holder on this host killed a moment ago (kill -9, then a restart) may take a few
/// seconds to exit; wait for it that long.
fn pid_alive_after_grace(pid: u32) -> bool {
    if pid == std::process::id() {
        return true;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while pid_alive(pid) {
        if Instant::now() > deadline {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

fn held_error(url: &str, l: &LeaseBody) -> Error {
    let now = unix_now();
    Error::Busy(format!(
        "pool {url} is held by {} (pid {}), lease renewed {} s ago, expires in {} s: stop it \
         there, or connect this host with `condense connect --read-only`; if {} is gone, the \
         lease expires in {} s and this host can then take the pool",
        l.host,
        l.pid,
        now.saturating_sub(l.renewed),
        l.expires.saturating_sub(now),
        l.host,
        l.expires.saturating_sub(now),
    ))
}

impl Lease {
    pub(super) fn acquire(shared: &Arc<Shared>) -> Result<Lease> {
        let url = &shared.url;
        let store = &shared.store;
        let current = match store.get(LEASE_NAME) {
            Ok(b) => LeaseBody::decode(&b),
            Err(e) if e.is_not_found() => None,
            Err(e) => return Err(remote_error(url, e)),
        };
        if let Some(l) = &current {
            let mine_and_dead = l.host == hostname() && !pid_alive_after_grace(l.pid);
            if l.expires > unix_now() && !mine_and_dead {
                return Err(held_error(url, l));
            }
            tracing::warn!(
                "taking over the lease of {url} from {} (pid {}): {}",
                l.host,
                l.pid,
                if mine_and_dead {
                    "that process is gone"
                } else {
                    "it expired"
                }
            );
        }
        let nonce = blake3::hash(
            format!(
                "{}{}{:?}",
                hostname(),
                std::process::id(),
                SystemTime::now()
            )
            .as_bytes(),
        )
        .to_hex()[..32]
            .to_string();
        let body = LeaseBody::fresh(&nonce).encode();
        if current.is_none() && store.conditional_put_honoured() {
            if !store
                .put_if_absent(LEASE_NAME, &body)
                .map_err(|e| remote_error(url, e))?
            {
                return Err(Lease::held_now(shared));
            }
        } else {
            store
                .put(LEASE_NAME, &body)
                .map_err(|e| remote_error(url, e))?;
            std::thread::sleep(LEASE_SETTLE);
            let back = store.get(LEASE_NAME).map_err(|e| remote_error(url, e))?;
            match LeaseBody::decode(&back) {
                Some(l) if l.nonce == nonce => {}
                Some(l) => return Err(held_error(url, &l)),
                None => return Err(Error::corrupt(format!("{url} lease"), "unreadable")),
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (stop, shared, nonce) = (stop.clone(), shared.clone(), nonce.clone());
            std::thread::Builder::new()
                .name("condense-lease".into())
                .spawn(move || Lease::renew_loop(&shared, &nonce, &stop))
                .map_err(|e| Error::io("starting the lease thread", e))?
        };
        Ok(Lease {
            shared: shared.clone(),
            nonce,
            stop,
            thread: Some(thread),
        })
    }

    fn held_now(shared: &Shared) -> Error {
        match shared
            .store
            .get(LEASE_NAME)
            .ok()
            .and_then(|b| LeaseBody::decode(&b))
        {
            Some(l) => held_error(&shared.url, &l),
            None => Error::Busy(format!("pool {} is held by another host", shared.url)),
        }
    }

    fn renew_loop(shared: &Shared, nonce: &str, stop: &AtomicBool) {
        loop {
            std::thread::park_timeout(LEASE_RENEW);
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let current = shared.note(shared.store.get(LEASE_NAME));
            match current.map(|b| LeaseBody::decode(&b)) {
                Ok(Some(l)) if l.nonce != nonce => {
                    shared.lease_lost.store(true, Ordering::Relaxed);
                    tracing::error!(
                        "the lease of {} was taken by {} (pid {}): this host stops writing the pool",
                        shared.url,
                        l.host,
                        l.pid
                    );
                    return;
                }
                Err(e) if e.kind() != io::ErrorKind::NotFound => continue,
                _ => {}
            }
            let _ = shared.note(
                shared
                    .store
                    .put(LEASE_NAME, &LeaseBody::fresh(nonce).encode()),
            );
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
        if self.shared.lease_lost.load(Ordering::Relaxed) {
            return;
        }
        let ours = self
            .shared
            .store
            .get(LEASE_NAME)
            .ok()
            .and_then(|b| LeaseBody::decode(&b))
            .is_some_and(|l| l.nonce == self.nonce);
        if ours {
            if let Err(e) = self.shared.store.delete(LEASE_NAME) {
                tracing::warn!("releasing the lease of {}: {e}", self.shared.url);
            }
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
