//! Scrub: every live chunk read back and checked while the pool serves, at a rate the
//! administrator sets (like `zpool scrub`), so that a rotting disk is found before a guest
//! reads the damage.
//!
//! Owns: the schedule and the background thread of `serve` and `mount` ([`BackgroundScrub`]).
//! A pass itself is a room of the pool ([`Pool::scrub_pass`], `pool/scrub.rs`); its progress,
//! results and the record of the last finished pass (`scrub/last`, [`LAST_KEY`]) are
//! [`crate::scrub_status`]'s, below the pool.
//!
//! A pass walks the chunk table in windows of [`WINDOW_PAGES`] pages (1,024 chunk ids) and
//! checks each live chunk as `verify` does (record checksum, authentication, decompression,
//! fingerprint). Invariants:
//! - A window is checked under the GC lock, so no chunk moves or segment goes while its
//!   record is read; GC waits at most one window (a few milliseconds), and the scrub never
//!   holds the pool's state lock while it reads a record.
//! - The rate bounds the record bytes read per second over the pass (a sleep after each
//!   window); 0 is as fast as one thread checks.
//! - A scrub changes nothing but this: a chunk whose record is damaged in its segment while
//!   the cache tier holds a valid copy (checked against the chunk's fingerprint) is written
//!   again from that copy into the open segment and journaled as moved, as GC moves chunks
//!   (counted as healed, not damaged). Other damage is reported (damaged chunks, then the
//!   volumes and blocks naming them); `condense repair` is what acts on it.
//! - Chunks written after a pass started, past the ids it began with, wait for the next pass.

use crate::locks::lock;
use crate::pool::Pool;
use crate::worker::Worker;

use crate::scrub_status::now_unix;
pub use crate::scrub_status::{ScrubPass, ScrubStatus, LAST_KEY, WINDOW_PAGES};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// How the background scrub of `serve` and `mount` runs.
#[derive(Clone, Copy, Debug)]
pub struct ScrubSchedule {
    /// Record bytes per second (0: the background scrub is off).
    pub rate_bytes_per_sec: u64,
    /// Time from the end of one pass to the start of the next (zero: back to back). The end
    /// of the last pass is read from the pool, so the schedule holds across restarts; a pass
    /// an administrator stopped counts as ended, one cut short by the process stopping does
    /// not (it runs again at the next start).
    pub every: Duration,
}

/// The background scrub: a thread that runs a pass when one is due (or asked for) and stops
/// with the handle.
pub struct BackgroundScrub {
    _worker: Option<Worker>,
}

impl BackgroundScrub {
    pub fn start(pool: &Arc<Pool>, schedule: ScrubSchedule) -> BackgroundScrub {
        let weak = Arc::downgrade(pool);
        lock(&pool.scrub.status).rate_bytes_per_sec = schedule.rate_bytes_per_sec;
        // When the next pass is due (Unix seconds; 0: now, never scrubbed): from the end of
        // the last recorded pass, read again only after a pass.
        let next_due = move |pool: &Pool| -> u64 {
            pool.meta_get(LAST_KEY)
                .and_then(|b| ScrubPass::decode(&b).finished_unix)
                .map_or(0, |t| t.saturating_add(schedule.every.as_secs()))
        };
        let mut due_at = next_due(pool);
        let worker = Worker::spawn("condense-scrub", move |flag| {
            let tick = Duration::from_millis(200);
            while !flag.load(Ordering::Relaxed) {
                std::thread::sleep(tick);
                let Some(pool) = weak.upgrade() else { return };
                let asked = pool.scrub.start.swap(false, Ordering::Relaxed);
                let due = schedule.rate_bytes_per_sec > 0 && now_unix() >= due_at;
                if !(asked || due) {
                    continue;
                }
                let keep_going = || !flag.load(Ordering::Relaxed);
                match pool.scrub_pass(schedule.rate_bytes_per_sec, &keep_going, &|_| {}) {
                    Ok(p) if p.damaged_chunks > 0 => tracing::error!(
                        "scrub: {} damaged chunks in {} checked; `condense verify` names them, `condense repair` salvages the pool",
                        p.damaged_chunks,
                        p.chunks_checked
                    ),
                    Ok(p) => tracing::info!(
                        "scrub: {} chunks ({} bytes) checked{}",
                        p.chunks_checked,
                        p.bytes_checked,
                        if p.stopped { ", stopped before the end" } else { ", no damage" }
                    ),
                    Err(e) => tracing::warn!("scrub failed: {e}"),
                }
                due_at = next_due(&pool);
            }
        });
        let worker = worker
            .map_err(|e| tracing::warn!("cannot start the scrub thread: {e}; no background scrub"))
            .ok();
        BackgroundScrub { _worker: worker }
    }
}
