//! Destaging: moving sealed segments from a writeback cache to the pool directory.
//!
//! Owns: the copy of one staged segment to the pool directory, and the background thread
//! ([`Destager`]) that does it continuously while a writeback cache is attached.
//!
//! With a writeback cache ([`crate::cache_tier::CacheMode::WriteBack`]) new segments and the
//! journal live in the cache directory, so a flush syncs only the fast device and random
//! writes cost it sequential appends. A segment that is sealed (no longer written) is
//! destaged whole, as one large sequential write to the slow device:
//!
//! 1. copy it to `seg-N.dat.partial` in the pool directory and fsync that file;
//! 2. rename it to `seg-N.dat` and fsync the pool directory;
//! 3. under the state lock, point the segment at the pool's copy (same id, same bytes, so
//!    every chunk location stays valid);
//! 4. remove the staged copy from the cache directory and fsync that directory.
//!
//! Invariants: the pool's copy is complete and durable before its final name exists, and the
//! staged copy is removed only after that, so a crash at any point leaves at least one whole
//! copy; an open that finds both uses the pool's and removes the other, and removes a
//! `.partial` file ([`crate::pool`]). The open segment is never destaged. A segment that GC
//! removed while it was being copied has its copy removed again.

use crate::error::{Error, Result};
use crate::format::{segment_name, PARTIAL_SUFFIX};
use crate::io::{Dir, File};
use crate::locks::lock;
use crate::pool::Pool;
use crate::worker::Worker;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Bytes per read and write while copying.
const COPY_BYTES: usize = 8 << 20;

/// How long a checkpoint of an S3 pool waits for its segments to be uploaded.
const UPLOAD_WAIT: Duration = Duration::from_secs(600);

impl Pool {
    /// Destage the oldest sealed staged segment, if there is one (see the module docs).
    /// Returns whether a segment was destaged.
    pub fn destage_one(&self) -> Result<bool> {
        if self.read_only {
            return Ok(false);
        }
        let (id, staged, len, staging) = {
            let mut st = lock(&self.state);
            self.writable(&st)?;
            let Some(staging) = st.segments.staging().cloned() else {
                return Ok(false);
            };
            let Some((id, file, len)) = st.segments.start_destage() else {
                return Ok(false);
            };
            (id, file, len, staging)
        };
        let name = segment_name(id);
        let copied = self.copy_to_pool(&name, &*staged, len);
        let mut st = lock(&self.state);
        let file = match copied {
            Ok(f) => f,
            Err(e) => {
                st.segments.end_destage(id, None);
                drop(st);
                // Best effort: an open removes a partial copy too.
                let _ = self.dir.remove(&format!("{name}{PARTIAL_SUFFIX}"));
                return Err(e);
            }
        };
        let kept = st.segments.end_destage(id, Some(file));
        drop(st);
        let (dir, what): (&dyn Dir, _) = if kept {
            (&*staging, "the staged copy of")
        } else {
            (&*self.dir, "the destaged copy of removed")
        };
        dir.remove(&name)
            .and_then(|_| dir.sync_dir())
            .map_err(|e| Error::io(format!("removing {what} segment {name}"), e))?;
        if kept {
            crate::counters::add(&self.counters.destaged_segments, 1);
            crate::counters::add(&self.counters.destaged_bytes, len);
        }
        Ok(true)
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
            if lock(&self.state).segments.sealed_staged_through(last) == 0 {
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
            let st = lock(&self.state);
            st.appended > st.checkpointed
        };
        if changed {
            let guard = lock(&self.sync_lock);
            self.checkpoint_locked(&guard)?;
        }
        Ok(())
    }

    /// Steps 1 and 2: a durable copy of `len` bytes of `from` under `name` in the pool dir.
    fn copy_to_pool(&self, name: &str, from: &dyn File, len: u64) -> Result<Arc<dyn File>> {
        let partial = format!("{name}{PARTIAL_SUFFIX}");
        let io = |what: &str, e| Error::io(format!("{what} while destaging segment {name}"), e);
        let to = self
            .dir
            .open(&partial, true)
            .map_err(|e| io("creating the copy", e))?;
        to.set_len(0).map_err(|e| io("truncating the copy", e))?;
        let mut buf = vec![0u8; COPY_BYTES.min(len as usize)];
        let mut at = 0u64;
        while at < len {
            let n = (len - at).min(buf.len() as u64) as usize;
            from.read_at(&mut buf[..n], at)
                .map_err(|e| io("reading the staged copy", e))?;
            to.write_at(&buf[..n], at)
                .map_err(|e| io("writing the copy", e))?;
            at += n as u64;
        }
        to.sync().map_err(|e| io("syncing the copy", e))?;
        self.dir
            .rename(&partial, name)
            .and_then(|_| self.dir.sync_dir())
            .map_err(|e| io("renaming the copy", e))?;
        Ok(to)
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
