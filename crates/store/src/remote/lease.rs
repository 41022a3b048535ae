//! The one-writer lease of a pool in a bucket ([`Lease`]): claims that are never replaced,
//! one winner per round on every store, renewal, the write fence and release (docs/S3.md
//! "Lease: claims").
//!
//! A writer takes the pool by putting a **claim** `claims/E-W-R` ([`claim_object`]): its
//! generation (epoch `E`, one more than any epoch in the bucket, and a random writer id `W`)
//! and a renewal number `R`, holding a [`LeaseBody`] (host, pid, expiry). A claim is *live*
//! while its newest renewal is not past its expiry, not released, and not of a process of
//! this host that is gone.
//!
//! Taking the lease, on any store (conditional PUT or not):
//! 1. list the claims; any live one refuses the open (held by ...);
//! 2. put our claim (renewal 0). The claim's window, from just before step 1's LIST to the end
//!    of this PUT on `CLOCK_BOOTTIME` ([`crate::claim_window`]), must be within
//!    [`WINDOW_BOUND`]; otherwise (a pause, a slow store) the claim is withdrawn and the
//!    protocol starts again (at most 3 times). On a store with conditional PUT the claimer
//!    then creates the epoch lock `claims/epoch-E` ([`epoch_lock_object`]): if it exists, another
//!    writer took this epoch and this one withdraws;
//! 3. wait [`SETTLE`], list the claims again;
//! 4. of the live claims and ours, the lowest (epoch, writer) wins; a loser deletes its claim.
//!
//! Why one winner: two racers both pass step 1 only if each listed before the other's PUT
//! completed; each one's window (list to end of PUT) took under `SETTLE / 2`, so each one's
//! step-3 listing, `SETTLE` after its own PUT, comes after the other's PUT completed (stores list
//! what they acknowledged), both see both claims, and both apply the same rule. The assumptions
//! and what breaking each does are in docs/S3.md "Lease: claims". A taking back of an expired
//! claim ([`retake`]) whose window exceeded the bound is withdrawn and tried again at the next
//! renewal; only a newer generation or another live claim in the bucket loses the lease.
//!
//! Invariants:
//! - No claim object is ever put twice: a renewal is a new object (`R + 1`), the previous
//!   one deleted after it; a release is a last renewal marked released.
//! - **The write fence**: this process writes to the bucket only within [`WRITE_FENCE`] of the
//!   start of its last renewal that succeeded, well inside the [`LEASE_SECONDS`] after which
//!   another host may take the pool, so a writer cut off from the store (or paused) stops
//!   before another can start; [`Shared::may_write`] checks it before every PUT and DELETE.
//! - A claim whose expiry passed is renewed only by taking it again (steps 1, 3 and 4 with
//!   our own generation), and never if a newer generation or claim is in the bucket.
//! - A clean close releases the claim (a last renewal with expiry 0): another host takes the
//!   pool at once.

use super::conf::remote_error;
use super::names::max_epoch;
use super::shared::{Shared, WRITE_FENCE};
use crate::claim_window::{Window, SETTLE, WINDOW_BOUND};
use condense_format::bucket::{
    claim_object, encode_lock, epoch_lock_object, parse_epoch_lock, parse_object, Generation,
    ObjectKind, CLAIM_PREFIX,
};
use condense_format::error::{Error, Result};
pub use condense_format::remote::LeaseBody;
use std::collections::{BTreeMap, HashSet};
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The lease object of pools before generations (an older Condense holding the pool).
pub(super) const LEASE_NAME: &str = "lease";
/// A claim not renewed for this long is free to take.
pub const LEASE_SECONDS: u64 = 30;
/// The holder renews its claim this often.
const RENEW_EVERY: Duration = Duration::from_secs(5);

/// One writer per pool: this process's claim, renewed in the background until dropped.
pub struct Lease {
    shared: Arc<Shared>,
    gen: Generation,
    state: Arc<Mutex<Renewals>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The claim objects of this process not yet deleted, oldest first, and the last renewal.
struct Renewals {
    objects: Vec<String>,
    next: u32,
    /// When the last renewal that succeeded started.
    renewed_at: Instant,
}

/// A claim body for this process, expiring [`LEASE_SECONDS`] from now.
pub fn fresh_body(nonce: &str) -> LeaseBody {
    let now = unix_now();
    LeaseBody {
        host: hostname(),
        pid: std::process::id(),
        nonce: nonce.to_string(),
        expires: now + LEASE_SECONDS,
        renewed: now,
    }
}

/// One claim: the body of its newest renewal, and every renewal object listed.
struct Claim {
    gen: Generation,
    body: Option<LeaseBody>,
    objects: Vec<String>,
}

/// The epoch locks listed (conditional PUT, `claims/epoch-E`): (epoch, object).
type EpochLocks = Vec<(u64, String)>;

/// The claims in the bucket, newest renewal of each (with its body), the lease object of an
/// older Condense, if any, and the epoch locks.
fn list_claims(shared: &Shared) -> Result<(Vec<Claim>, Option<LeaseBody>, EpochLocks)> {
    let url = &shared.url;
    let listed = shared
        .store
        .list(CLAIM_PREFIX.trim_end_matches('/'))
        .map_err(|e| remote_error(url, e))?;
    // Renewal objects of each claim, oldest first (the names sort by renewal).
    let mut by_gen: BTreeMap<Generation, Vec<(u32, String)>> = BTreeMap::new();
    let mut locks = Vec::new();
    for (obj, _) in listed {
        if let Some(epoch) = parse_epoch_lock(&obj) {
            locks.push((epoch, obj));
        } else if let Some(ObjectKind::Claim { gen, renewal }) = parse_object(&obj) {
            by_gen.entry(gen).or_default().push((renewal, obj));
        }
    }
    let mut claims = Vec::new();
    for (gen, mut renewals) in by_gen {
        renewals.sort();
        let Some((_, newest)) = renewals.last() else {
            continue;
        };
        let body = match shared.store.get(newest) {
            Ok(b) => LeaseBody::decode(&b),
            Err(e) if e.is_not_found() => continue, // renewed or released meanwhile
            Err(e) => return Err(remote_error(url, e)),
        };
        if body.is_none() {
            tracing::warn!("{url}: claim {newest} is not readable: ignored");
        }
        let objects = renewals.into_iter().map(|(_, o)| o).collect();
        claims.push(Claim { gen, body, objects });
    }
    let legacy = match shared.store.get(LEASE_NAME) {
        Ok(b) => LeaseBody::decode(&b),
        Err(e) if e.is_not_found() => None,
        Err(e) => return Err(remote_error(url, e)),
    };
    Ok((claims, legacy, locks))
}

/// Not expired, not released, and not of a process of this host that is gone.
fn body_live(b: &LeaseBody) -> bool {
    !b.released()
        && b.expires > unix_now()
        && (b.host != hostname() || pid_alive_after_grace(b.pid))
}

fn is_live(c: &Claim, dead: &HashSet<Generation>) -> bool {
    !dead.contains(&c.gen)
        && c.body
            .as_ref()
            .is_some_and(|b| !b.released() && b.expires > unix_now())
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

/// Who holds the pool's lease now: the body of the winning live claim; else of the newest
/// claim (released or expired); `None` if no claim is readable.
pub(super) fn holder(shared: &Shared) -> Result<Option<LeaseBody>> {
    let (claims, legacy, _) = list_claims(shared)?;
    let none = HashSet::new();
    let live = claims
        .iter()
        .filter(|c| is_live(c, &none))
        .min_by_key(|c| (c.gen.epoch, c.gen.writer));
    let newest = claims.iter().max_by_key(|c| (c.gen.epoch, c.gen.writer));
    Ok(live.or(newest).and_then(|c| c.body.clone()).or(legacy))
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

/// A random writer id for a new generation (from this host, process and time).
fn new_writer_id() -> u64 {
    let seed = format!(
        "{}{}{:?}",
        hostname(),
        std::process::id(),
        SystemTime::now()
    );
    let hash = blake3::hash(seed.as_bytes());
    u64::from_le_bytes(hash.as_bytes()[..8].try_into().unwrap_or([1; 8]))
}

/// Refuse the open if a live claim (or an older Condense's live lease object) holds the
/// pool; otherwise the claims whose holder is a process of this host that is gone.
fn refuse_if_held(
    url: &str,
    claims: &[Claim],
    legacy: Option<LeaseBody>,
) -> Result<HashSet<Generation>> {
    if let Some(l) = legacy.filter(body_live) {
        return Err(held_error(url, &l));
    }
    let mut dead = HashSet::new();
    for c in claims {
        if let Some(b) = &c.body {
            if !b.released() && b.expires > unix_now() && !body_live(b) {
                tracing::warn!(
                    "taking over the lease of {url} from {} (pid {}): that process is gone",
                    b.host,
                    b.pid
                );
                dead.insert(c.gen);
            }
        }
    }
    if let Some(b) = claims
        .iter()
        .find(|c| is_live(c, &dead))
        .and_then(|c| c.body.as_ref())
    {
        return Err(held_error(url, b));
    }
    Ok(dead)
}

/// One above every epoch claimed or locked and `known_epoch`: a lock whose claim is gone (its
/// PUT failed and landed later) is never raced for again.
fn next_epoch(claims: &[Claim], locks: &EpochLocks, known_epoch: u64) -> u64 {
    claims
        .iter()
        .map(|c| c.gen.epoch)
        .chain(locks.iter().map(|(e, _)| *e))
        .chain([known_epoch])
        .max()
        .unwrap_or(0)
        + 1
}

/// On a store with conditional PUT, the store picks one writer per epoch (docs/S3.md "Lease:
/// claims"): create the epoch lock, or withdraw claim `obj` and refuse.
fn lock_epoch(shared: &Shared, gen: Generation, obj: &str) -> Result<()> {
    let url = &shared.url;
    let lock = epoch_lock_object(gen.epoch);
    let taken = shared
        .store
        .put_if_absent(&lock, &encode_lock(gen.writer, 0, &hostname()))
        .map_err(|e| remote_error(url, e));
    if matches!(taken, Ok(true)) {
        return Ok(());
    }
    let _ = shared.store.delete(obj);
    taken?;
    Err(Error::Busy(format!(
        "pool {url} is held by another host (both hosts claimed the pool at once; the store's \
         conditional PUT chose, as docs/S3.md says)"
    )))
}

/// Of the live claims listed after the settle and ours, the lowest (epoch, writer) wins: if
/// it is not ours, withdraw ours (and its epoch lock) and refuse.
fn refuse_if_lower(
    shared: &Shared,
    gen: Generation,
    obj: &str,
    after: &[Claim],
    dead: &HashSet<Generation>,
) -> Result<()> {
    let url = &shared.url;
    let winner = after
        .iter()
        .filter(|c| c.gen == gen || is_live(c, dead))
        .min_by_key(|c| (c.gen.epoch, c.gen.writer));
    let Some(w) = winner.filter(|w| w.gen != gen) else {
        return Ok(());
    };
    let _ = shared.store.delete(obj);
    if shared.store.conditional_put_honoured() {
        let _ = shared.store.delete(&epoch_lock_object(gen.epoch));
    }
    let held = match &w.body {
        Some(b) => held_error(url, b),
        None => Error::Busy(format!("pool {url} is held by another host")),
    };
    Err(match held {
        Error::Busy(m) => Error::Busy(format!(
            "{m} (both hosts claimed the pool at once; the lower claim won, as docs/S3.md says)"
        )),
        e => e,
    })
}

/// Won: the claims of writers that are gone are of no use to anyone, nor are the epoch locks
/// of older epochs.
fn clear_the_gone(shared: &Shared, gen: Generation, after: &[Claim], locks: &EpochLocks) {
    for c in after
        .iter()
        .filter(|c| c.gen != gen && !is_live(c, &HashSet::new()))
    {
        for o in &c.objects {
            let _ = shared.store.delete(o);
        }
    }
    for (_, old) in locks.iter().filter(|(e, _)| *e < gen.epoch) {
        let _ = shared.store.delete(old);
    }
}

impl Lease {
    /// Take the pool's lease (see the module docs). `known_epoch`: the highest epoch of the
    /// generations the caller saw in the bucket.
    pub(super) fn acquire(shared: &Arc<Shared>, known_epoch: u64) -> Result<Lease> {
        let url = &shared.url;
        let writer = new_writer_id();
        let mut slow = String::new();
        // Claims this open put and withdrew: a listing may still show one (its DELETE not
        // seen yet, or failed), and it must not refuse the retry as another holder's would.
        let mut withdrawn: Vec<Generation> = Vec::new();
        for _ in 0..3 {
            // Step 1: list; any live claim refuses the open.
            let window = Window::open();
            let (mut claims, legacy, locks) = list_claims(shared)?;
            claims.retain(|c| !withdrawn.contains(&c.gen));
            let dead = refuse_if_held(url, &claims, legacy)?;
            // Step 2: put our claim, within the window.
            let gen = Generation {
                epoch: next_epoch(&claims, &locks, known_epoch),
                writer,
            };
            let obj = claim_object(gen, 0);
            let started = Instant::now();
            let body = fresh_body(&format!("{writer:016x}")).encode();
            if let Err(e) = shared.store.put(&obj, &body) {
                // The PUT may still land after its error: withdraw it (docs/S3.md, assumption 3).
                let _ = shared.store.delete(&obj);
                return Err(remote_error(url, e));
            }
            if !window.within(WINDOW_BOUND) {
                slow = window.shown();
                tracing::warn!(
                    "{url}: listing the lease claims and putting ours took {slow} (more than \
                     {WINDOW_BOUND:?}: paused, or a slow store): withdrawn, trying again"
                );
                let _ = shared.store.delete(&obj);
                withdrawn.push(gen);
                continue;
            }
            if shared.store.conditional_put_honoured() {
                lock_epoch(shared, gen, &obj)?;
            }
            // Steps 3 and 4: settle, list again, the lowest claim wins.
            std::thread::sleep(SETTLE);
            let (after, _, after_locks) = list_claims(shared)?;
            refuse_if_lower(shared, gen, &obj, &after, &dead)?;
            clear_the_gone(shared, gen, &after, &after_locks);
            return Lease::start(shared, gen, obj, started);
        }
        Err(Error::Busy(format!(
            "{url}: listing the lease claims and storing ours took more than {WINDOW_BOUND:?} \
             three times (the last {slow}): the process was paused or the store is too slow to \
             take the lease safely; try again"
        )))
    }

    /// Hold the lease won with claim `obj` (its PUT started at `started`): the write fence
    /// set, the renewal thread started.
    fn start(
        shared: &Arc<Shared>,
        gen: Generation,
        obj: String,
        started: Instant,
    ) -> Result<Lease> {
        shared.set_fence(Some(started + WRITE_FENCE));
        let state = Arc::new(Mutex::new(Renewals {
            objects: vec![obj],
            next: 1,
            renewed_at: started,
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (stop, shared, state) = (stop.clone(), shared.clone(), state.clone());
            std::thread::Builder::new()
                .name("condense-lease".into())
                .spawn(move || renew_loop(&shared, gen, &state, &stop))
                .map_err(|e| Error::io("starting the lease thread", e))?
        };
        Ok(Lease {
            shared: shared.clone(),
            gen,
            state,
            stop,
            thread: Some(thread),
        })
    }

    /// The generation this lease writes as.
    pub(super) fn generation(&self) -> Generation {
        self.gen
    }

    /// Take this lease's claim back now, as the renewal thread does after an outage.
    #[cfg(test)]
    pub(super) fn retake_now(&self) -> std::result::Result<(), String> {
        retake(&self.shared, self.gen, &self.state)
    }
}

/// Put the next renewal of our claim (`released`: the last one); on success the fence moves
/// and the older renewals are deleted.
fn put_renewal(
    shared: &Shared,
    gen: Generation,
    state: &Mutex<Renewals>,
    released: bool,
) -> io::Result<Instant> {
    let (obj, started) = put_next(shared, gen, state, released)?;
    adopt_renewal(shared, state, obj, started);
    Ok(started)
}

/// Put the next renewal object of our claim, without counting it yet: (object, when its PUT
/// started).
fn put_next(
    shared: &Shared,
    gen: Generation,
    state: &Mutex<Renewals>,
    released: bool,
) -> io::Result<(String, Instant)> {
    let (obj, started) = {
        let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
        s.next += 1;
        (claim_object(gen, s.next - 1), Instant::now())
    };
    let mut body = fresh_body(&format!("{:016x}", gen.writer));
    if released {
        body.expires = 0;
    }
    shared.note(shared.store.put(&obj, &body.encode()))?;
    Ok((obj, started))
}

/// Count a renewal put by [`put_next`]: it is the claim's newest, the older ones go.
fn adopt_renewal(shared: &Shared, state: &Mutex<Renewals>, obj: String, started: Instant) {
    let old = {
        let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
        s.renewed_at = started;
        std::mem::replace(&mut s.objects, vec![obj])
    };
    for o in old {
        let _ = shared.store.delete(&o);
    }
}

/// Take our own expired claim again, unless a newer generation or another live claim is in
/// the bucket (then the lease is lost for good).
fn retake(
    shared: &Shared,
    gen: Generation,
    state: &Mutex<Renewals>,
) -> std::result::Result<(), String> {
    let window = Window::open();
    let newer = max_epoch(&*shared.store, &shared.url).map_err(|e| e.to_string())?;
    let (claims, _, _) = list_claims(shared).map_err(|e| e.to_string())?;
    let none = HashSet::new();
    if newer > gen.epoch
        || claims
            .iter()
            .any(|c| c.gen != gen && (c.gen.epoch > gen.epoch || is_live(c, &none)))
    {
        shared.lease_lost.store(true, Ordering::Relaxed);
        return Err("another host took the pool".into());
    }
    let (obj, started) = put_next(shared, gen, state, false).map_err(|e| e.to_string())?;
    if !window.within(WINDOW_BOUND) {
        // Another host may have listed, claimed and settled meanwhile without seeing this
        // renewal: withdraw it and take the claim again at the next renewal, as `acquire`
        // retries (the lease still counts as expired, so the next try starts from the
        // listing; a host that took the pool meanwhile is seen there).
        let _ = shared.store.delete(&obj);
        return Err(format!(
            "taking the expired lease back took {} (more than {WINDOW_BOUND:?}: paused, or a \
             slow store): withdrawn, trying again",
            window.shown()
        ));
    }
    adopt_renewal(shared, state, obj, started);
    std::thread::sleep(SETTLE);
    let (after, _, _) = list_claims(shared).map_err(|e| e.to_string())?;
    if after.iter().any(|c| {
        c.gen != gen && is_live(c, &none) && (c.gen.epoch, c.gen.writer) < (gen.epoch, gen.writer)
    }) {
        shared.lease_lost.store(true, Ordering::Relaxed);
        return Err("another host took the pool".into());
    }
    Ok(())
}

fn renew_loop(shared: &Shared, gen: Generation, state: &Mutex<Renewals>, stop: &AtomicBool) {
    loop {
        std::thread::park_timeout(RENEW_EVERY);
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let last = state.lock().unwrap_or_else(|e| e.into_inner()).renewed_at;
        let renewed = if last.elapsed() < Duration::from_secs(LEASE_SECONDS) {
            put_renewal(shared, gen, state, false)
                .map(|_| ())
                .map_err(|e| e.to_string())
        } else {
            retake(shared, gen, state)
        };
        match renewed {
            Ok(()) => {
                let at = state.lock().unwrap_or_else(|e| e.into_inner()).renewed_at;
                shared.set_fence(Some(at + WRITE_FENCE));
            }
            Err(e) if shared.lease_lost.load(Ordering::Relaxed) => {
                tracing::error!(
                    "the lease of {} was lost ({e}): this host stops writing the pool",
                    shared.url
                );
                return;
            }
            Err(e) => tracing::warn!("renewing the lease of {}: {e}", shared.url),
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
        if let Err(e) = put_renewal(&self.shared, self.gen, &self.state, true) {
            tracing::warn!("releasing the lease of {}: {e}", self.shared.url);
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
