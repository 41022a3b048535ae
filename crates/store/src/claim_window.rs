//! The timing of a claim made on a store without conditional PUT (docs/S3.md "Lease: claims",
//! "Why one wins on a store without conditional PUT").
//!
//! Owns: the **claim window** ([`Window`]), measured from just before the first LIST request
//! of a claim is sent to the end of its PUT, on `CLOCK_BOOTTIME`, and the bound
//! ([`WINDOW_BOUND`]) a claim's window must stay within for the claim to stand. Every claim
//! protocol of a pool in a bucket (the lease, a slot registration, a volume claim) opens a
//! window before it lists and withdraws (deletes) its claim and starts again when the window
//! exceeded the bound.
//!
//! Why `CLOCK_BOOTTIME` and not `std::time::Instant`: `Instant` reads `CLOCK_MONOTONIC`, which
//! stops while the system is suspended; `CLOCK_BOOTTIME` counts that time too. A process that is
//! stopped (SIGSTOP) or a VM that is frozen is measured by either clock when it resumes, but a
//! host suspended (or a VM whose guest clock is suspended with it) would otherwise come back with
//! a window that looks short. If `clock_gettime` fails (it does not on Linux), the window reads
//! as exceeded, so the claim is withdrawn rather than trusted.
//!
//! Invariant: [`Window::within`] is true only if the time between [`Window::open`] and now,
//! as this host's boot clock counts it, is at most the bound.

use std::time::Duration;

/// The longest a claim's window (its first LIST to the end of its PUT) may take: half of
/// [`SETTLE`], so that a racer's relist, [`SETTLE`] after its own PUT, comes after the other's
/// PUT ended (docs/S3.md).
pub const WINDOW_BOUND: Duration = Duration::from_millis(500);

/// How long a claim waits after its PUT before it lists again.
pub const SETTLE: Duration = Duration::from_millis(1000);

/// Now on `CLOCK_BOOTTIME` (time since boot, suspended time included); `None` if unreadable.
pub fn boot_clock() -> Option<Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    if rc != 0 {
        return None;
    }
    let secs = u64::try_from(ts.tv_sec).ok()?;
    let nanos = u32::try_from(ts.tv_nsec).ok()?;
    Some(Duration::new(secs, nanos))
}

/// A claim's window: opened just before its first LIST request.
#[derive(Clone, Copy, Debug)]
pub struct Window {
    opened: Option<Duration>,
}

impl Window {
    /// Open the window now (call it just before the LIST is sent).
    pub fn open() -> Window {
        Window {
            opened: boot_clock(),
        }
    }

    /// Time since [`Window::open`]; `None` if the clock could not be read.
    pub fn elapsed(&self) -> Option<Duration> {
        let now = boot_clock()?;
        Some(now.saturating_sub(self.opened?))
    }

    /// Whether the window is still within `bound` (false if the clock could not be read).
    pub fn within(&self, bound: Duration) -> bool {
        self.elapsed().is_some_and(|e| e <= bound)
    }

    /// The elapsed time for a message.
    pub fn shown(&self) -> String {
        match self.elapsed() {
            Some(e) => format!("{e:?}"),
            None => "an unknown time (CLOCK_BOOTTIME unreadable)".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_counts_time_and_the_bound_holds() {
        let w = Window::open();
        assert!(w.within(WINDOW_BOUND));
        std::thread::sleep(Duration::from_millis(30));
        let e = w.elapsed().unwrap_or_default();
        assert!(e >= Duration::from_millis(30), "{e:?}");
        assert!(!w.within(Duration::from_millis(10)));
        assert!(WINDOW_BOUND * 2 <= SETTLE);
    }
}
