//! Destaging: moving sealed segments from a writeback cache down to the pool directory (a
//! room of the pool).
//!
//! Owns: which held segment to move down next, and the background thread ([`Destager`])
//! that does it continuously while a writeback cache (or an S3 pool's local directory)
//! holds segments.
//!
//! With a writeback cache ([`crate::cache_tier::CacheMode::WriteBack`]) the staging layer
//! ([`crate::staging`]) holds new segments and the journal in the cache directory, so a
//! flush syncs only the fast device and random writes cost it sequential appends. A segment
//! that is sealed (no longer written) and whose batches are all written is moved down whole
//! ([`crate::io::Dir::move_down`]), as one large sequential write to the slow device (an
//! upload, over a bucket); the layer keeps a whole copy at every point of a crash.
//!
//! Invariants: the open segment, and a segment with batches still being written, are never
//! moved ([`crate::segment::Segments::start_destage`]); one move at a time.

use super::Pool;
use crate::error::{Error, Result};
use crate::format::{parse_segment_name, segment_name};
use crate::locks::lock;
use crate::worker::Worker;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// How long a checkpoint of an S3 pool waits for its segments to be uploaded.
const UPLOAD_WAIT: Duration = Duration::from_secs(600);

impl Pool {
    /// Destage the oldest sealed held segment, if there is one (see the module docs).
    /// Returns whether a segment was destaged.
    pub fn destage_one(&self) -> Result<bool> {
        if self.read_only {
            return Ok(false);
        }
        let held = self.held_segments()?;
        let id = {
            let mut st = self.lock_state();
            self.writable(&st)?;
            let Some(id) = st.segments.start_destage(held.iter().map(|&(id, _)| id)) else {
                return Ok(false);
            };
            id
        };
        let name = segment_name(id);
        let moved = self.dir.move_down(&name);
        self.lock_state()
            .segments
            .end_destage(id, matches!(moved, Ok(true)));
        let moved = moved.map_err(|e| Error::io(format!("destaging segment {name}"), e))?;
        if moved {
            let len = held.iter().find(|&&(h, _)| h == id).map_or(0, |&(_, l)| l);
            crate::counters::add(&self.counters.destaged_segments, 1);
            crate::counters::add(&self.counters.destaged_bytes, len);
        }
        Ok(moved)
    }

    /// The segments the staging layer holds (not yet in the pool directory), oldest first,
    /// with their lengths.
    pub(crate) fn held_segments(&self) -> Result<Vec<(u32, u64)>> {
        let held = self
            .dir
            .held()
            .map_err(|e| Error::io("listing the segments held in the cache directory", e))?;
        Ok(held
            .into_iter()
            .filter_map(|(name, len)| Some((parse_segment_name(&name)?, len)))
            .collect())
    }

    /// Destage every sealed staged segment (`condense cache detach`, tests).
    pub fn destage_all(&self) -> Result<u64> {
        let mut n = 0;
        while self.destage_one()? {
            n += 1;
        }
        Ok(n)
    }

    /// Destage every sealed staged segment with an id up to `last` (an S3 pool's checkpoint,
    /// before its root names them), waiting for a destage the background thread is running.
    /// With `retry`, a store that does not answer is retried until the deadline (inside a
    /// checkpoint, where failing poisons the pool); without, its error is returned at once.
    pub(crate) fn upload_staged_through(&self, last: u32, retry: bool) -> Result<()> {
        let deadline = std::time::Instant::now() + UPLOAD_WAIT;
        loop {
            let open = self.lock_state().segments.open_id();
            let waiting = self
                .held_segments()?
                .iter()
                .any(|&(id, _)| id <= last && Some(id) != open);
            if !waiting {
                return Ok(());
            }
            match self.destage_one() {
                Ok(true) => continue,
                Ok(false) => {}
                // The store may come back: retry until the deadline.
                Err(e) if retry && crate::io::is_store_unavailable(&e) => {
                    tracing::warn!("uploading staged segments: {e}; retrying");
                    std::thread::sleep(Duration::from_secs(1));
                }
                Err(e) => return Err(e),
            }
            if std::time::Instant::now() > deadline {
                return Err(Error::Busy(format!(
                    "segments staged in the local directory were not uploaded to {} within {} s; the checkpoint is retried later",
                    self.dir.describe(),
                    UPLOAD_WAIT.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A checkpoint when the store behind the pool directory asks for one
    /// ([`crate::io::Dir::checkpoint_due`]: a bucket, at least every
    /// [`crate::remote::REMOTE_CHECKPOINT_EVERY`], so it is never far behind) and records were
    /// appended since the last. Called by the destage thread.
    fn checkpoint_tick(&self) -> Result<()> {
        if !self.dir.checkpoint_due() {
            return Ok(());
        }
        let changed = {
            let st = self.lock_state();
            st.appended > st.checkpointed
        };
        if changed {
            let guard = lock(&self.sync_lock);
            self.checkpoint_locked(&guard)?;
        }
        Ok(())
    }

    /// Start the background destage thread (idempotent).
    pub(crate) fn start_destager(&self) {
        let mut slot = lock(&self.destager);
        if slot.is_none() {
            if let Some(pool) = self.me.upgrade() {
                *slot = start_destage_thread(&pool);
            }
        }
    }

    /// Stop the background destage thread, waiting for a destage in progress.
    pub(crate) fn stop_destager(&self) {
        let d = lock(&self.destager).take();
        drop(d);
    }
}

/// The background destage thread: destages while there is something sealed to destage,
/// then checks again every 100 ms (5 s after an error). Stops at once when dropped (its
/// [`Worker`] wakes it), or when the pool is gone.
fn start_destage_thread(pool: &Arc<Pool>) -> Option<Worker> {
    let weak = Arc::downgrade(pool);
    let started = Worker::spawn("condense-destage", move |flag| {
        while !flag.load(Ordering::Relaxed) {
            let Some(pool) = weak.upgrade() else { return };
            let mut pause = match pool.destage_one() {
                Ok(true) => Duration::ZERO,
                Ok(false) => Duration::from_millis(100),
                Err(e) => {
                    tracing::warn!("destaging the writeback cache: {e}");
                    Duration::from_secs(5)
                }
            };
            if !pause.is_zero() {
                if let Err(e) = pool.checkpoint_tick() {
                    tracing::warn!("checkpointing to {}: {e}", pool.dir.describe());
                    pause = Duration::from_secs(5);
                }
            }
            drop(pool);
            // Woken early when the worker is dropped (unpark), so stopping never waits.
            if !pause.is_zero() && !flag.load(Ordering::Relaxed) {
                std::thread::park_timeout(pause);
            }
        }
    });
    match started {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(
                "cannot start the destage thread: {e}; staged segments are destaged at detach"
            );
            None
        }
    }
}
