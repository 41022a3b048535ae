//! Sharing a pool's state lock between a long pass and the VMs' I/O (issue 42).
//!
//! A pass over a whole volume or pool (verify's walk, the figures' count, a map's release, a
//! shrink, GC, the merge, a fold) takes the lock once per bounded step and pauses between
//! steps as long as the step took, so a VM request that arrives finds the lock free at least
//! half the time. std's mutex is not fair: a thread that takes the lock back at once keeps it
//! from the reads and writes waiting for it (one 4 KiB write once waited through a whole
//! 1.3 s shrink of 10M blocks). While a thread waits for a state lock the pause is at least
//! [`STEP_PAUSE_MIN`], long enough for the woken waiter to take the lock. With no one waiting
//! and no VM request begun since the step did, there is no pause: nothing needs the lock (a
//! one-shot command, an idle pool, the crash simulator's passes, which slept 2/3 of their
//! time with a floor).
//!
//! Tried and not kept (bench/README.md, admin-stall.sh, 2026-11-29): pausing 9 times the
//! step after a step that kept a thread waiting made the passes 1.2-2.8x slower and left the
//! VMs' p99 where it was (with 0.2 ms steps a VM at queue depth 1 still met a step in more
//! than 1 % of its requests).
//!
//! **While the VMs are busy, the steps of all passes together are
//! [`REQUESTS_BETWEEN_STEPS`] of their requests apart.** A VM request that meets a step waits
//! for the rest of it, so what sets the VMs' p99 during a pass is how many of their requests
//! meet a step, not how long the step is (up to the 50 ms the worst may take): at queue depth
//! 1 and 14,000-25,000 requests a second, a pass pausing only as long as its 0.2 ms steps took
//! a step every ~0.4 ms and delayed a request at almost every one, far more than 1 % of them
//! (p99 3-8x idle). The pause is therefore stretched until the VMs made
//! that many requests since the last step of any pass ended ([`REQUESTS`], counted by the
//! pools' read and write paths, [`note_request`]; [`LAST_STEP`]), at most [`MAX_STRETCH`]
//! times the plain pause, so a pass keeps at least 1/(1 + `MAX_STRETCH`) of the lock's time
//! however busy the VMs are; the release and verify take steps of ~1-2 ms so that the share
//! is reached before the cap. Passes running at once (a release and the figures' recount after a
//! delete) share the requests: the one that claims [`LAST_STEP`] steps, the other waits for
//! the next share.
//!
//! Owns: the count of threads waiting for a state lock ([`lock_counted`]), the count of VM
//! requests ([`note_request`]), the last step's place among them, and the pause
//! ([`step_pause`], [`pause_with`], [`Pacer`]). The counts are process-wide (every pool of
//! the process): a waiter on, or a request to, another pool only makes a pass more polite.
//! On the ground floor: imports nothing of the engine.

use crate::locks::lock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The least pause after a step while a thread waits for a state lock.
pub const STEP_PAUSE_MIN: Duration = Duration::from_micros(500);

/// Threads waiting in [`lock_counted`] right now.
static WAITERS: AtomicUsize = AtomicUsize::new(0);

/// VM requests (reads and writes of volumes) begun in this process, every pool's.
static REQUESTS: AtomicU64 = AtomicU64::new(0);

/// [`REQUESTS`] when the last step of any pass ended, or the next one was claimed.
static LAST_STEP: AtomicU64 = AtomicU64::new(0);

/// While the VMs are busy, the requests they make between two steps of any passes: about 1
/// in this many of their requests meets a step (see the module docs). 400 until 2026-11-30:
/// each step slowed about two of a queue-depth-1 VM's requests (one met it, one more met no
/// hold), so with the VM's own ~0.4 % of slow requests the passes put its p99 on the edge of
/// 2x idle; at 800 the deletes' windows passed in 5 of 8 runs against 2 of 8, their releases
/// taking ~1.7x as long (bench/README.md "admin-stall.sh", eighth pass).
pub const REQUESTS_BETWEEN_STEPS: u64 = 800;

/// The longest pause after a step, in plain pauses ([`step_pause`]): a pass keeps at least
/// 1/(1 + this) of the lock's time however busy the VMs are. At 16, 2 ms steps and a VM
/// making ~10,000 requests a second, the cap bound before the VM's share was made.
pub const MAX_STRETCH: u32 = 32;

/// Count one VM request (a read or write of a volume), for the pause of passes in steps.
pub fn note_request() {
    REQUESTS.fetch_add(1, Ordering::Relaxed);
}

/// Lock `m` (a pool's state), counted among the waiters while it waits.
pub fn lock_counted<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    WAITERS.fetch_add(1, Ordering::Relaxed);
    let guard = lock(m);
    WAITERS.fetch_sub(1, Ordering::Relaxed);
    guard
}

/// When a step began, and how many VM requests had begun by then.
#[derive(Clone, Copy, Debug)]
pub struct Step {
    at: Instant,
    requests: u64,
}

impl Step {
    /// A step beginning now.
    pub fn begin() -> Step {
        Step {
            at: Instant::now(),
            requests: REQUESTS.load(Ordering::Relaxed),
        }
    }
}

/// How long to pause after `step` before any stretch (see the module docs): as long as the
/// step took, at least [`STEP_PAUSE_MIN`] while a thread waits for a state lock; nothing if
/// no thread waits and no VM request began since the step did (nothing to make room for:
/// a one-shot command, an idle pool).
pub fn step_pause(step: &Step) -> Duration {
    if WAITERS.load(Ordering::Relaxed) > 0 {
        step.at.elapsed().max(STEP_PAUSE_MIN)
    } else if REQUESTS.load(Ordering::Relaxed) != step.requests {
        step.at.elapsed()
    } else {
        Duration::ZERO
    }
}

/// Sleep [`step_pause`], then, while the VMs are busy, on until they made
/// [`REQUESTS_BETWEEN_STEPS`] requests since the last step of any pass ended (at most
/// [`MAX_STRETCH`] plain pauses in all).
pub fn pause_after_step(step: &Step) {
    pause_with(step, &mut std::thread::sleep);
}

/// [`pause_after_step`] with the caller's sleep (a worker parks, so that stopping it wakes it).
///
/// Passes running at once share the requests between steps: the next step is claimed by
/// moving [`LAST_STEP`] to the count it began at, so two passes do not both take a step after
/// the same share of requests.
pub fn pause_with(step: &Step, sleep: &mut dyn FnMut(Duration)) {
    LAST_STEP.fetch_max(REQUESTS.load(Ordering::Relaxed), Ordering::Relaxed);
    let plain = step_pause(step);
    if plain.is_zero() {
        return;
    }
    let cap = plain * MAX_STRETCH;
    let (mut slept, mut chunk) = (Duration::ZERO, plain);
    loop {
        let before = REQUESTS.load(Ordering::Relaxed);
        sleep(chunk);
        slept += chunk;
        let now = REQUESTS.load(Ordering::Relaxed);
        let last = LAST_STEP.load(Ordering::Relaxed);
        let seen = now.wrapping_sub(before);
        match next_sleep(chunk, seen, now.saturating_sub(last), slept, cap) {
            Some(d) => chunk = d,
            None => {
                // Claimed, unless another pass claimed first (then wait for the next share).
                let claimed = LAST_STEP
                    .compare_exchange(last, now.max(last), Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok();
                if claimed || slept >= cap {
                    LAST_STEP.fetch_max(now, Ordering::Relaxed);
                    return;
                }
                chunk = plain.min(cap - slept);
            }
        }
    }
}

/// After sleeping `chunk` (`slept` in all of at most `cap`), in which the VMs made `seen`
/// requests, `since` of them since the last step of any pass: how much longer to sleep, or
/// `None` to step now (the VMs idle, their share made, or the cap reached).
fn next_sleep(
    chunk: Duration,
    seen: u64,
    since: u64,
    slept: Duration,
    cap: Duration,
) -> Option<Duration> {
    if seen == 0 || since >= REQUESTS_BETWEEN_STEPS || slept >= cap {
        return None;
    }
    // At the rate just seen, the rest of the share.
    let nanos = chunk.as_nanos() * u128::from(REQUESTS_BETWEEN_STEPS - since) / u128::from(seen);
    let rest = Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX));
    Some(rest.clamp(STEP_PAUSE_MIN.min(cap - slept), cap - slept))
}

/// Paces a loop of steps: [`Pacer::step`] at the top of each step pauses after the one
/// before it ([`pause_after_step`]), and not after the last.
#[derive(Default)]
pub struct Pacer(Option<Step>);

impl Pacer {
    pub fn step(&mut self) {
        if let Some(step) = &self.0 {
            pause_after_step(step);
        }
        self.0 = Some(Step::begin());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn busy_vms_stretch_the_pause_to_their_share_of_requests() {
        let ms = Duration::from_millis;
        let cap = ms(2) * MAX_STRETCH;
        // Idle VMs, their share made, or the cap reached: step now.
        assert_eq!(next_sleep(ms(2), 0, 0, ms(2), cap), None);
        assert_eq!(
            next_sleep(ms(2), 9, REQUESTS_BETWEEN_STEPS, ms(2), cap),
            None
        );
        assert_eq!(next_sleep(ms(2), 9, 9, cap, cap), None);
        // 50 requests in 2 ms, 50 since the last step: the rest of the share at that rate
        // (800: the other 750 take 30 ms, within the cap).
        let rest = ms(2) * (REQUESTS_BETWEEN_STEPS - 50) as u32 / 50;
        assert!(rest < cap - ms(2));
        assert_eq!(next_sleep(ms(2), 50, 50, ms(2), cap), Some(rest));
        // One request in 2 ms: no further than the cap.
        assert_eq!(next_sleep(ms(2), 1, 1, ms(2), cap), Some(cap - ms(2)));
    }

    #[test]
    fn a_step_is_paused_after_only_while_vms_make_requests_or_wait() {
        // No request began and no one waits: no pause (a one-shot command, an idle pool).
        let step = Step::begin();
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(step_pause(&step), Duration::ZERO);
        // A request began since the step did: as long as the step.
        note_request();
        let pause = step_pause(&step);
        assert!(pause >= Duration::from_millis(2), "{pause:?}");
        // A thread waits: at least the floor, however short the step.
        let m = Arc::new(Mutex::new(0u32));
        let g = lock_counted(&m);
        let other = {
            let m = m.clone();
            std::thread::spawn(move || *lock_counted(&m) += 1)
        };
        while WAITERS.load(Ordering::Relaxed) == 0 {
            std::thread::yield_now();
        }
        assert!(step_pause(&Step::begin()) >= STEP_PAUSE_MIN);
        drop(g);
        assert!(other.join().is_ok());
        assert_eq!(*lock_counted(&m), 1);
        assert_eq!(WAITERS.load(Ordering::Relaxed), 0);
    }
}
