//! Sharing a pool's state lock between a long pass and the VMs' I/O (issue 42).
//!
//! A pass over a whole volume or pool (verify's walk, the figures' count, a map's release, a
//! shrink, the merge, a fold) takes the lock once per bounded step and pauses between steps.
//! std's mutex is not fair: a thread that takes the lock back at once keeps it from the reads
//! and writes waiting for it (one 4 KiB write once waited through a whole 1.3 s shrink of 10M
//! blocks). So:
//!
//! - after a step whose hold kept another thread waiting ([`note_release`] saw a waiter as the
//!   hold ended), the pass pauses [`step_yield`] times as long as the step (at least
//!   [`STEP_PAUSE_MIN`]): while the VMs are busy, a pass takes at most 1 / (1 + yield) of the
//!   lock's time, and a VM at queue depth 1 meets a held lock about once per that many steps'
//!   time rather than at every other request;
//! - after a step that kept no one waiting, it pauses as long as the step took, so a VM that
//!   arrives finds the lock free at least half the time.
//!
//! Owns: the count of threads waiting for a state lock ([`lock_counted`]), each thread's note
//! that its last hold kept one waiting, and the pause ([`step_pause`], [`Pacer`]). The count
//! is process-wide (every pool of the process): a waiter on another pool's lock only makes a
//! pass more polite. On the ground floor: imports nothing of the engine.

use crate::locks::lock;
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The least pause after a step that kept another thread waiting.
pub const STEP_PAUSE_MIN: Duration = Duration::from_micros(500);
/// How many times a step's length a pass pauses after a step that kept a thread waiting,
/// unless `$CONDENSE_STEP_YIELD` says otherwise (read once; a whole number from 1 to 100;
/// 1 is the pause of the first passes, as long as the step).
pub const STEP_YIELD_DEFAULT: u32 = 9;

/// Threads waiting in [`lock_counted`] right now.
static WAITERS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's last hold ended while a thread waited for a state lock.
    static KEPT_WAITING: Cell<bool> = const { Cell::new(false) };
}

/// Lock `m` (a pool's state), counted among the waiters while it waits.
pub fn lock_counted<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    WAITERS.fetch_add(1, Ordering::Relaxed);
    let guard = lock(m);
    WAITERS.fetch_sub(1, Ordering::Relaxed);
    guard
}

/// Called by a holder of a lock taken with [`lock_counted`] just before it lets go: notes
/// whether the hold kept a thread waiting.
pub fn note_release() {
    if WAITERS.load(Ordering::Relaxed) > 0 {
        KEPT_WAITING.with(|k| k.set(true));
    }
}

/// The pause factor in force ([`STEP_YIELD_DEFAULT`] or `$CONDENSE_STEP_YIELD`).
pub fn step_yield() -> u32 {
    static FACTOR: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *FACTOR.get_or_init(|| {
        std::env::var("CONDENSE_STEP_YIELD")
            .ok()
            .and_then(|v| v.trim().parse::<u32>().ok())
            .filter(|f| (1..=100).contains(f))
            .unwrap_or(STEP_YIELD_DEFAULT)
    })
}

/// How long to pause after a step that began at `started` (see the module docs). Clears this
/// thread's note.
pub fn step_pause(started: Instant) -> Duration {
    let step = started.elapsed();
    if KEPT_WAITING.with(|k| k.replace(false)) {
        (step * step_yield()).max(STEP_PAUSE_MIN)
    } else {
        step
    }
}

/// Sleep [`step_pause`].
pub fn pause_after_step(started: Instant) {
    std::thread::sleep(step_pause(started));
}

/// Paces a loop of steps: [`Pacer::step`] at the top of each step pauses after the one
/// before it ([`pause_after_step`]), and not after the last.
#[derive(Default)]
pub struct Pacer(Option<Instant>);

impl Pacer {
    pub fn step(&mut self) {
        match self.0 {
            Some(started) => pause_after_step(started),
            // A note left by an earlier hold of this thread is not this pass's.
            None => KEPT_WAITING.with(|k| k.set(false)),
        }
        self.0 = Some(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_step_that_kept_a_thread_waiting_pauses_longer() {
        let m = Arc::new(Mutex::new(0u32));
        // Kept no one waiting: as long as the step.
        let started = Instant::now();
        {
            let _g = lock_counted(&m);
            std::thread::sleep(Duration::from_millis(2));
            note_release();
        }
        let alone = step_pause(started);
        assert!(alone >= Duration::from_millis(2) && alone < Duration::from_millis(2) * 3);

        // Another thread waits through the hold: the pause is the yield factor's.
        let started = Instant::now();
        let g = lock_counted(&m);
        let other = {
            let m = m.clone();
            std::thread::spawn(move || *lock_counted(&m) += 1)
        };
        while WAITERS.load(Ordering::Relaxed) == 0 {
            std::thread::yield_now();
        }
        std::thread::sleep(Duration::from_millis(2));
        note_release();
        drop(g);
        assert!(other.join().is_ok());
        let pause = step_pause(started);
        assert!(
            pause >= Duration::from_millis(2) * step_yield(),
            "{pause:?}"
        );
        // The note is cleared by the pause that used it.
        assert!(step_pause(Instant::now()) < STEP_PAUSE_MIN);
    }
}
