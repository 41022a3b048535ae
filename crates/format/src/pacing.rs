//! Sharing a pool's state lock between a long pass and the VMs' I/O (issue 42).
//!
//! A pass over a whole volume or pool (verify's walk, the figures' count, a map's release, a
//! shrink, the merge, a fold) takes the lock once per bounded step and pauses between steps
//! as long as the step took, so a VM request that arrives finds the lock free at least half
//! the time. std's mutex is not fair: a thread that takes the lock back at once keeps it from
//! the reads and writes waiting for it (one 4 KiB write once waited through a whole 1.3 s
//! shrink of 10M blocks). While a thread waits for a state lock the pause is at least
//! [`STEP_PAUSE_MIN`], long enough for the woken waiter to take the lock; with no one
//! waiting there is no floor, which only slowed passes of many tiny steps (small pools,
//! tests: the crash simulator's passes slept 2/3 of its time).
//!
//! Tried and not kept (bench/README.md, admin-stall.sh, 2026-11-29): pausing 9 times the
//! step after a step that kept a thread waiting made the passes 1.2-2.8x slower and left the
//! VMs' p99 where it was (a VM at queue depth 1 still meets a step in more than 1 % of its
//! requests).
//!
//! Owns: the count of threads waiting for a state lock ([`lock_counted`]) and the pause
//! ([`step_pause`], [`Pacer`]). The count is process-wide (every pool of the process): a
//! waiter on another pool's lock only makes a pass more polite. On the ground floor: imports
//! nothing of the engine.

use crate::locks::lock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The least pause after a step while a thread waits for a state lock.
pub const STEP_PAUSE_MIN: Duration = Duration::from_micros(500);

/// Threads waiting in [`lock_counted`] right now.
static WAITERS: AtomicUsize = AtomicUsize::new(0);

/// Lock `m` (a pool's state), counted among the waiters while it waits.
pub fn lock_counted<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    WAITERS.fetch_add(1, Ordering::Relaxed);
    let guard = lock(m);
    WAITERS.fetch_sub(1, Ordering::Relaxed);
    guard
}

/// How long to pause after a step that began at `started` (see the module docs).
pub fn step_pause(started: Instant) -> Duration {
    let floor = if WAITERS.load(Ordering::Relaxed) > 0 {
        STEP_PAUSE_MIN
    } else {
        Duration::ZERO
    };
    started.elapsed().max(floor)
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
        if let Some(started) = self.0 {
            pause_after_step(started);
        }
        self.0 = Some(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn the_floor_holds_only_while_a_thread_waits() {
        // No one waits: as long as the step, however short.
        assert!(step_pause(Instant::now()) < STEP_PAUSE_MIN);
        let m = Arc::new(Mutex::new(0u32));
        let g = lock_counted(&m);
        let other = {
            let m = m.clone();
            std::thread::spawn(move || *lock_counted(&m) += 1)
        };
        while WAITERS.load(Ordering::Relaxed) == 0 {
            std::thread::yield_now();
        }
        assert!(step_pause(Instant::now()) >= STEP_PAUSE_MIN);
        drop(g);
        assert!(other.join().is_ok());
        assert_eq!(*lock_counted(&m), 1);
        assert_eq!(WAITERS.load(Ordering::Relaxed), 0);
    }
}
