//! The dedup index saved at a clean close and found again at open (`dedup.idx`,
//! [`crate::format::dedup_index`]), so a pool of 50M chunks does not walk its chunk table
//! again (~10 s) at the first write after every restart.
//!
//! Invariants: the file is advisory, like the index. An open uses it only if its header
//! names the root the pool opened at, and the build loads it only if no chunk was added or
//! removed before ([`crate::metadata::Metadata::saved_index`]); any other file is ignored and
//! the index built from the chunk table. It lives on the host: in the pool directory, or in
//! the local directory of a pool whose directory is a bucket (never uploaded).
//!
//! A command that holds the pool alone loads the file at the first write that needs the
//! index. A served pool loads it on a thread of its own, without the state lock (a 10M-chunk
//! file held every VM's I/O ~110 ms at the first write), the chunk table's changes meanwhile
//! kept and applied before the index is installed ([`crate::metadata::IndexLoad`]).
//!
//! Without a usable file (after a crash, or a checkpoint since the last clean close) the index
//! is built from the chunk table: at once by the first write of a command that holds the pool
//! alone, and in steps by a background thread in a served pool ([`Pool::start_index_build`]),
//! the state lock let go between steps. Built at once under the lock, a 10M-chunk pool's
//! first write after a crash held every VM's I/O 1.6 s (100M chunks: ~30 s, past a guest's
//! I/O timeout); in steps, writes meanwhile are not deduplicated against the chunks not yet
//! indexed (savings only, docs/DESIGN.md invariant 3). Only a dense index is saved; a sparse one
//! is rebuilt (its hooks only) the same way.

use crate::dedup_index::SavedIndex;
use crate::format::dedup_index::{
    decode_dedup_index_header, encode_dedup_index_header, DEDUP_INDEX_HEADER_BYTES,
    DEDUP_INDEX_NAME,
};
use crate::io::Dir;
use crate::metadata::Metadata;
use std::sync::Arc;

use super::{OpenOptions, Pool};

/// Chunk-table pages (128 chunks each) one step of the background build indexes.
const BUILD_STEP_PAGES: u64 = 16;

/// Where the saved index lives: the pool directory, or the local one of a bucket's pool.
pub(super) fn index_dir(dir: &Arc<dyn Dir>, opts: &OpenOptions) -> Option<Arc<dyn Dir>> {
    if dir.whole_files_only() {
        opts.cache_dir.as_ref().map(|d| d.0.clone())
    } else {
        Some(dir.clone())
    }
}

/// Open step 5b (writable opens): the saved index, if its header names the root `md` was
/// loaded from (`journal_gen`, `next_seq`: the root's).
pub(super) fn find(
    dir: Option<Arc<dyn Dir>>,
    uuid: [u8; 16],
    md: &Metadata,
    journal_gen: u64,
    next_seq: u64,
) -> Option<SavedIndex> {
    let dir = dir?;
    // No file (the first open, or a close that did not save one): nothing to say.
    let file = dir.open(DEDUP_INDEX_NAME, false).ok()?;
    let mut head = vec![0u8; DEDUP_INDEX_HEADER_BYTES];
    let header = file
        .read_at(&mut head, 0)
        .ok()
        .and_then(|_| decode_dedup_index_header(&head).ok());
    let stamp = md.index_stamp(journal_gen, next_seq);
    match header {
        Some(h) if h.uuid == uuid && h.stamp == stamp => Some(SavedIndex { file, uuid, stamp }),
        _ => {
            tracing::info!(
                "{DEDUP_INDEX_NAME} in {} is not of this checkpoint (the last close was not clean?): the dedup index is built again from the chunk table (in the background by a served pool)",
                dir.describe()
            );
            None
        }
    }
}

impl Pool {
    /// Save the dedup index for the next open, after the closing checkpoint. With the index
    /// in RAM: written whole (a temporary name, then renamed; not synced: a torn file fails
    /// its checksums and is rebuilt). Without it, a saved index still exact (no chunk added
    /// or removed since open) is stamped with the new root. Failures are warnings.
    pub(super) fn save_dedup_index(&self) {
        let Some(dir) = index_dir(&self.dir, &self.opts) else {
            return;
        };
        let st = self.lock_state();
        if st.appended != st.checkpointed {
            return;
        }
        let stamp = st.md.index_stamp(st.journal.gen, st.journal.next_seq());
        let tmp = format!("{DEDUP_INDEX_NAME}.tmp");
        let saved = if st.md.index_ready() {
            // A sparse index is not saved: the next open rebuilds its hooks from the chunk
            // table (docs/FORMAT.md "Dedup index mode").
            let crate::index::Index::Dense(dense) = &st.md.index else {
                return;
            };
            let started = std::time::Instant::now();
            (|| {
                let f = dir
                    .open(&tmp, true)
                    .map_err(|e| crate::Error::io(format!("creating {tmp}"), e))?;
                dense.save(&*f, self.sb.uuid, stamp)?;
                dir.rename(&tmp, DEDUP_INDEX_NAME)
                    .map_err(|e| crate::Error::io(format!("renaming {tmp}"), e))?;
                tracing::info!(
                    "dedup index saved in {DEDUP_INDEX_NAME}: {} chunks in {:.2} s",
                    st.md.index.len(),
                    started.elapsed().as_secs_f64()
                );
                Ok(())
            })()
        } else if let Some(s) = &st.md.saved_index {
            (|| {
                let mut head = vec![0u8; DEDUP_INDEX_HEADER_BYTES];
                let io = |e| crate::Error::io(format!("restamping {DEDUP_INDEX_NAME}"), e);
                s.file.read_at(&mut head, 0).map_err(io)?;
                let mut h = decode_dedup_index_header(&head)?;
                h.stamp = stamp;
                s.file
                    .write_at(&encode_dedup_index_header(&h), 0)
                    .map_err(io)
            })()
        } else {
            return;
        };
        if let Err(e) = saved {
            tracing::warn!(
                "saving the dedup index in {}: {e}; the next open builds it from the chunk table",
                dir.describe()
            );
            let _ = dir.remove(&tmp);
        }
    }
}

impl Pool {
    /// Have the dedup index ready without the VMs waiting for it, on a thread of its own: for
    /// a served pool, whose first write must not hold every VM's I/O for a load of the saved
    /// file (~110 ms for 10M chunks) or a walk of the whole chunk table. A saved index is
    /// loaded with the state lock let go ([`Metadata::begin_index_load`]), the changes made
    /// meanwhile applied when it is installed; without one (or if it cannot be used) the index
    /// is built from the chunk table in steps. Until then lookups miss (savings only).
    /// Writable pools only; a no-op otherwise, or if the index is there or on its way.
    pub fn start_index_build(&self) {
        if self.read_only {
            return;
        }
        let load = {
            let mut st = self.lock_state();
            let load = st.md.begin_index_load();
            if load.is_none() && !st.md.index_to_build() {
                return;
            }
            load
        };
        if load.is_none() && !self.begin_build() {
            return;
        }
        let weak = self.me.clone();
        let spawned = crate::worker::Worker::spawn("condense-index", move |stop| {
            if let Some(saved) = load {
                // Read (and checked) without the lock: the state is only taken to install.
                let loaded =
                    crate::dedup_index::DedupIndex::load(&*saved.file, saved.uuid, saved.stamp);
                let Some(pool) = weak.upgrade() else { return };
                let installed = pool.lock_state().md.finish_index_load(loaded);
                if installed {
                    return;
                }
                // Unusable: built from the chunk table instead, in steps.
                if !pool.begin_build() {
                    return;
                }
            }
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let Some(pool) = weak.upgrade() else { return };
                let started = super::Step::begin();
                let step = pool.lock_state().md.index_build_step(BUILD_STEP_PAGES);
                match step {
                    Ok(false) => super::pause_after_step(&started),
                    Ok(true) => {
                        crate::dedup_index::return_free_memory();
                        return;
                    }
                    Err(e) => {
                        tracing::warn!("dedup index built in part ({e}); chunks past the damage are not deduplicated against");
                        crate::dedup_index::return_free_memory();
                        return;
                    }
                }
            }
        });
        match spawned {
            Ok(w) => *crate::locks::lock(&self.index_builder) = Some(w),
            Err(e) => {
                // No thread: the first write loads or builds it at once, as an offline
                // command does.
                tracing::warn!(
                    "cannot start the dedup index thread ({e}); the first write loads or builds it"
                );
                let mut st = self.lock_state();
                st.md.index_build = None;
                st.md.index_load = None;
            }
        }
    }

    /// Begin a build in steps into an empty index of the pool's setting sized for its live
    /// chunks, allocated without the lock (tens of MB). True if a build is under way.
    fn begin_build(&self) -> bool {
        let (setting, chunks) = {
            let st = self.lock_state();
            (
                crate::index::IndexSetting::of(&st.md.meta),
                st.md.chunks.live_chunks,
            )
        };
        let empty = crate::index::Index::empty(setting, chunks);
        self.lock_state().md.begin_index_build(empty)
    }

    /// Wait for the index thread to end (a load in progress is installed first), so a close
    /// saves the index it leads to.
    pub(super) fn stop_index_builder(&self) {
        let w = crate::locks::lock(&self.index_builder).take();
        drop(w);
    }
}
