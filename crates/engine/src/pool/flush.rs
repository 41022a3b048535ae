//! Flushes (group commit made durable) and checkpoints.

use crate::error::{Error, Result};
use crate::format::*;
use crate::journal::Journal;
use crate::locks::lock;
use crate::metadata::Metadata;
use std::sync::{Arc, MutexGuard};

use super::{MetadataChange, Pool, CHECKPOINT_STORE_WAIT};

impl Pool {
    /// Make durable every record appended up to `target` (group commit: one flush covers all
    /// writers waiting for it).
    pub(crate) fn flush_through(&self, target: u64) -> Result<()> {
        if self.lock_state().durable >= target {
            return Ok(());
        }
        self.flush()
    }

    /// Make every completed write durable.
    pub fn flush(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        let guard = lock(&self.sync_lock);
        // Batches already queued for the segment writer are waited for without the state
        // lock: take_dirty under it waited for megabytes of them on a busy disk (~300 ms).
        let queued = self.lock_state().segments.queued_wait();
        if let Some(w) = queued {
            w.wait();
        }
        let (dirty, journal, target) = {
            let mut st = self.lock_state();
            self.writable(&st)?;
            if st.durable == st.appended {
                return Ok(());
            }
            // The journal records name chunks in the staged records: those are written
            // first (and synced before the journal, below).
            let dirty = match st.segments.take_dirty() {
                Ok(d) => d,
                Err(e) => {
                    st.poisoned = Some(e.to_string());
                    return Err(e);
                }
            };
            st.journal.seal_flush()?;
            (dirty, st.journal.file.clone(), st.appended)
        };
        let started = std::time::Instant::now();
        let synced = (|| {
            sync_segments(&dirty.files)?;
            if dirty.names_changed {
                self.dir
                    .sync_dir()
                    .map_err(|e| Error::io("syncing the pool directory", e))?;
            }
            let journal_started = std::time::Instant::now();
            journal
                .sync()
                .map_err(|e| Error::io("syncing the journal", e))?;
            let c = &self.counters;
            crate::counters::add(&c.journal_syncs, 1);
            crate::counters::add(
                &c.journal_sync_nanos,
                crate::counters::nanos(journal_started.elapsed()),
            );
            Ok(())
        })();
        crate::counters::add(&self.counters.flushes, 1);
        crate::counters::add(
            &self.counters.flush_nanos,
            crate::counters::nanos(started.elapsed()),
        );
        // An S3 pool with `remote` durability: every file was synced locally, only the upload
        // of its write-ahead object failed. The flush fails (nothing is acknowledged) and
        // the next one uploads what this one could not; the pool stays usable.
        if let Err(e) = &synced {
            if crate::io::is_store_unavailable(e) {
                return synced;
            }
        }
        let st = self.settle_sync(synced, target)?;
        let big = st.journal.file_bytes() > self.opts.journal_bytes_max;
        drop(st);
        if big {
            match self.dir.check_reachable() {
                // An S3 pool's journal grows on the local disk while the store is away.
                Err(_) => {
                    tracing::warn!(
                        "journal past {} bytes: checkpointing once {} answers",
                        self.opts.journal_bytes_max,
                        self.dir.describe()
                    );
                }
                Ok(()) => self.checkpoint_locked(&guard)?,
            }
        }
        Ok(())
    }

    /// Write a checkpoint of the whole state and start a new journal generation. The caller
    /// holds `sync_lock`.
    pub(crate) fn checkpoint_locked(&self, sync: &MutexGuard<'_, ()>) -> Result<()> {
        debug_assert!(
            self.sync_lock.try_lock().is_err(),
            "the caller holds sync_lock"
        );
        self.checkpoint_with(sync, &|_| Ok(()), None)
    }

    /// A checkpoint that also makes a change no journal record describes (snapshots,
    /// clones, rollback: they share pages, which needs every page of the source written).
    /// `check` may refuse (nothing changes); most dirty pages are then written without the
    /// state lock ([`Pool::write_dirty_pages`]); under it, `check` runs again, the rest are
    /// written, `change` runs, and what it dirtied is written too, so the new root holds
    /// it. The change is durable, and visible after a crash, once this returns. The caller
    /// holds `sync_lock`, so no flush can acknowledge a later write before that.
    pub(crate) fn checkpoint_with(
        &self,
        _sync: &MutexGuard<'_, ()>,
        check: &dyn Fn(&Metadata) -> Result<()>,
        change: Option<&mut MetadataChange<'_>>,
    ) -> Result<()> {
        let started = std::time::Instant::now();
        // Before anything changes: a checkpoint of an S3 pool that fails half-way poisons it.
        self.dir.check_reachable()?;
        if self.dir.whole_files_only() {
            let last_sealed = {
                let st = self.lock_state();
                st.segments
                    .last_id()
                    .filter(|&id| Some(id) != st.segments.open_id())
            };
            if let Some(last) = last_sealed {
                self.upload_staged_through(last, false)?;
            }
        }
        check(&self.lock_state().md)?;
        self.write_dirty_pages()?;
        let prepared = self.prepare_checkpoint(check, change)?;
        let done = self.write_checkpoint(&prepared);
        let mut st = self.settle_sync(done, prepared.target)?;
        // The new root no longer names the pages freed before it: they may be reused, and a
        // free tail of meta.dat is given back to the file system.
        st.md.pages.alloc.release(prepared.freed);
        st.md.pages.trim_file()?;
        let took = crate::counters::nanos(started.elapsed());
        let c = &self.counters;
        crate::counters::add(&c.checkpoints, 1);
        crate::counters::add(&c.checkpoint_nanos, took);
        c.checkpoint_last_nanos
            .store(took, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Checkpoint step 0, mostly without the state lock: the dirty metadata pages written
    /// in bounded batches, level by level, leaves first ("Writing outside the lock" in
    /// `condense_meta::page_cache`). The lock is held only to copy, place and install each
    /// batch; encoding and writing go on without it, so reads and writes of every volume go
    /// on too. Step 1 then writes only what changed meanwhile and the interior pages above.
    /// A failed write frees its batch's runs (nothing names them) and fails the checkpoint.
    fn write_dirty_pages(&self) -> Result<()> {
        // Pages dirtied while a sweep runs are swept again, while there are many.
        for _ in 0..CHECKPOINT_SWEEPS {
            let (levels, dirty) = {
                let st = self.lock_state();
                self.writable(&st)?;
                let trees = st.md.pages.trees().values();
                (
                    trees.map(|t| t.height).max().unwrap_or(0),
                    st.md.pages.dirty_pages(),
                )
            };
            if dirty <= CHECKPOINT_LOCKED_PAGES {
                break;
            }
            for level in 0..levels {
                self.write_dirty_level(level, dirty)?;
            }
        }
        Ok(())
    }

    /// Write the dirty pages of `level` in batches: at most the rounds `dirty` pages need, so
    /// writers dirtying pages as fast as they are written cannot keep it going.
    fn write_dirty_level(&self, level: u8, dirty: usize) -> Result<()> {
        for _ in 0..=dirty / CHECKPOINT_BATCH_PAGES {
            let mut batch = {
                let st = self.lock_state();
                self.writable(&st)?;
                st.md.pages.take_dirty(level, CHECKPOINT_BATCH_PAGES)
            };
            if batch.is_empty() {
                break;
            }
            let full = batch.len() == CHECKPOINT_BATCH_PAGES;
            batch.encode();
            self.lock_state().md.pages.allocate_batch(&mut batch);
            let written = batch.write();
            let mut st = self.lock_state();
            let installed = match written {
                Ok(()) => st.md.pages.install_batch(batch),
                Err(e) => {
                    st.md.pages.abandon_batch(batch);
                    return Err(e);
                }
            };
            // Only damage of the cache's own bookkeeping fails an install.
            if let Err(e) = installed {
                st.poisoned = Some(e.to_string());
                return Err(e);
            }
            drop(st);
            if !full {
                break;
            }
        }
        Ok(())
    }

    /// Checkpoint step 1, under the state lock: the journal sealed, dirty pages written to
    /// their new places (written, not yet synced; pages written after this belong to the
    /// next epoch), `change` made, the root encoded, a new journal generation created and
    /// the segments to sync taken. A failure after pages were written poisons the pool.
    fn prepare_checkpoint(
        &self,
        check: &dyn Fn(&Metadata) -> Result<()>,
        change: Option<&mut MetadataChange<'_>>,
    ) -> Result<PreparedCheckpoint> {
        // The next journal's file, made before the lock is taken (a file's creation can wait
        // for the file system's journal). The generation moves only in a checkpoint, and the
        // caller holds sync_lock: it is still the next one below.
        // The records appended so far are handed to the segment writer and waited for here
        // too: under the lock, take_dirty then waits only for what is appended meanwhile
        // (megabytes of queued writes on a busy disk held every VM up to ~200 ms).
        let (new_gen, handed) = {
            let mut st = self.lock_state();
            let handed = st.segments.hand_off_pending();
            if let Err(e) = &handed {
                st.poisoned = Some(e.to_string());
            }
            (st.journal.gen + 1, handed?)
        };
        let new_file = Journal::create_file(&*self.dir, new_gen, &self.sb.uuid)?;
        if let Some(w) = handed {
            w.wait();
        }
        let mut st = self.lock_state();
        self.writable(&st)?;
        check(&st.md)?;
        debug_assert_eq!(
            st.journal.gen + 1,
            new_gen,
            "only a checkpoint moves the generation"
        );
        st.journal.seal()?;
        let next_seq = st.journal.next_seq();
        let prepared = (|| {
            let (mut pages, mut freed) = st.md.pages.prepare_checkpoint()?;
            st.md.pages.write_pages(&mut pages)?;
            if let Some(change) = change {
                change(&mut st.md)?;
                let (mut more, freed_more) = st.md.pages.prepare_checkpoint()?;
                st.md.pages.write_pages(&mut more)?;
                freed.extend(freed_more);
            }
            Ok::<_, Error>(freed)
        })();
        let freed = match prepared {
            Ok(f) => f,
            Err(e) => {
                st.poisoned = Some(e.to_string());
                return Err(e);
            }
        };
        st.md.checkpoints += 1;
        st.checkpointed = st.appended;
        // An S3 pool: the root goes to the bucket only after every segment it can name
        // (the open one is sealed here), so the bucket alone is whole without the
        // write-ahead objects of `remote` durability (they are then deleted).
        let upload_through = if self.dir.whole_files_only() {
            if st.segments.open_id().is_some() {
                st.segments.seal_open()?;
            }
            st.segments.last_id()
        } else {
            None
        };
        // Encoded (compressed, sealed) after the lock is let go, in write_checkpoint.
        let root = st.md.root(new_gen, next_seq);
        // With a writeback cache the staging layer holds the journal there (fast fsyncs).
        let journal = Journal::with_file(new_gen, new_file, next_seq, self.crypto.clone());
        let new_journal_file = journal.file.clone();
        let old = std::mem::replace(&mut st.journal, journal);
        let dirty = match st.segments.take_dirty() {
            Ok(d) => d,
            Err(e) => {
                st.poisoned = Some(e.to_string());
                return Err(e);
            }
        };
        Ok(PreparedCheckpoint {
            root,
            upload_through,
            old_gen: old.gen,
            new_journal_file,
            meta_file: st.md.pages.file().clone(),
            files: dirty.files,
            target: st.appended,
            freed,
        })
    }

    /// Checkpoint step 2, without the state lock: segments, `meta.dat` and the new journal
    /// synced, then (an S3 pool) every segment the root names uploaded, then the root
    /// written (both copies); the old journal generation is removed last.
    fn write_checkpoint(&self, p: &PreparedCheckpoint) -> Result<()> {
        self.store_retry(|| sync_segments(&p.files))?;
        self.store_retry(|| {
            p.meta_file
                .sync()
                .map_err(|e| Error::io(format!("syncing {META_NAME}"), e))
        })?;
        self.store_retry(|| {
            p.new_journal_file
                .sync()
                .map_err(|e| Error::io("syncing the new journal", e))
        })?;
        self.dir
            .sync_dir()
            .map_err(|e| Error::io(format!("syncing {}", self.dir.describe()), e))?;
        if let Some(last) = p.upload_through {
            self.upload_staged_through(last, true)?;
        }
        let body = encode_root(&p.root, &self.sb.uuid, self.crypto.as_deref())?;
        self.store_retry(|| crate::copies::write_both(&*self.dir, CHECKPOINT_NAME, &body))?;
        self.dir
            .remove(&journal_name(p.old_gen))
            .map_err(|e| Error::io("removing the old journal", e))
    }

    /// Run a step of a checkpoint. In an S3 pool, a store that stops answering half-way is
    /// waited for (backing off, up to [`CHECKPOINT_STORE_WAIT`]) instead of poisoning the
    /// pool at once: every step can be repeated (a PUT replaces, an extent stays dirty until
    /// uploaded). Flushes wait meanwhile; writes go on.
    fn store_retry<T>(&self, mut step: impl FnMut() -> Result<T>) -> Result<T> {
        let deadline = std::time::Instant::now() + CHECKPOINT_STORE_WAIT;
        let mut pause = std::time::Duration::from_millis(500);
        loop {
            match step() {
                Err(e)
                    if crate::io::is_store_unavailable(&e)
                        && std::time::Instant::now() < deadline =>
                {
                    tracing::warn!("checkpoint: {e}; retrying in {} ms", pause.as_millis());
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(std::time::Duration::from_secs(10));
                }
                r => return r,
            }
        }
    }

    /// After syncing: on success everything appended up to `target` is durable; on failure
    /// the kernel may have dropped dirty pages, so the pool refuses writes until reopened.
    fn settle_sync(&self, synced: Result<()>, target: u64) -> Result<super::StateGuard<'_>> {
        let mut st = self.lock_state();
        if let Err(e) = synced {
            st.poisoned = Some(e.to_string());
            return Err(e);
        }
        // A sync covers what was appended when it started, never more than was appended.
        debug_assert!(
            target <= st.appended,
            "a flush target is a count already appended"
        );
        st.durable = st.durable.max(target);
        Ok(st)
    }
}

/// Dirty pages a checkpoint copies and writes at a time outside the state lock (4 MiB of
/// copies: copying them holds the lock a millisecond or two).
const CHECKPOINT_BATCH_PAGES: usize = 1024;
/// A checkpoint writes at most this many dirty pages under the state lock, unless pages are
/// dirtied faster than [`CHECKPOINT_SWEEPS`] sweeps outside it write them.
const CHECKPOINT_LOCKED_PAGES: usize = 64;
const CHECKPOINT_SWEEPS: usize = 4;

fn sync_segments(files: &[Arc<dyn crate::io::File>]) -> Result<()> {
    for f in files {
        f.sync().map_err(|e| Error::io("syncing a segment", e))?;
    }
    Ok(())
}

/// What a checkpoint prepared under the state lock, for the steps after it.
struct PreparedCheckpoint {
    /// The root, encoded without the state lock.
    root: Root,
    /// An S3 pool: the last segment the root can name, uploaded before the root.
    upload_through: Option<u32>,
    old_gen: u64,
    new_journal_file: Arc<dyn crate::io::File>,
    meta_file: Arc<dyn crate::io::File>,
    /// Segments written since the last sync.
    files: Vec<Arc<dyn crate::io::File>>,
    /// Records appended when the checkpoint was prepared: durable once it is written.
    target: u64,
    /// Pages the new root no longer names.
    freed: Vec<(u64, u16)>,
}
