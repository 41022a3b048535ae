//! Background release: the maps of deleted volumes (and a rollback's old map) given back in
//! bounded steps while the pool serves (a room of the pool).
//!
//! Owns: the stepping of [`Metadata::releasing`] — which tree next, how many leaves a step
//! takes — and the background thread ([`Releaser`]) that steps while anything is pending.
//!
//! A deletion of a map bigger than a few leaves (pool/volumes.rs) or a rollback only
//! detaches it, inside a checkpoint (the root then names it, version 3); each step then
//! releases the next [`STEP_LEAVES`] leaves that exist ([`JournalRecord::ReleaseStep`]) in a
//! commit of its own, so the state lock is held for a bounded time (up to `STEP_LEAVES` × 512
//! chunk references dropped) and the VMs' I/O runs
//! between steps. Invariants:
//! - A step is one journal record applied like any other: replay repeats exactly the steps
//!   that were durable, and the checkpoint root holds the trees and cursors
//!   (docs/FORMAT.md "Background release"), so a crash at any point resumes from the last
//!   durable step, never releasing a leaf twice (its pointer is cleared by the step).
//! - Only leaves the detached tree holds alone drop references; a subtree shared with a
//!   snapshot or clone loses one page reference, never its chunks' (the page cache's sharing
//!   rules), so no block of another volume is ever released.
//! - A map detached while the per-volume figures are kept first has its entries taken off
//!   them, in steps of their own that change nothing on disk
//!   ([`Metadata::release_figures_step`]); only then do its page steps begin, so a shared
//!   subtree a page step drops whole is never still counted in the figures.
//! - Before a step is committed its leaves are read once: a page that cannot be read stops
//!   the release (logged, tried again later) instead of failing the commit, which would
//!   poison the pool.
//! - The thread leaves each step's time again free before the next, longer while the VMs
//!   are busy (at most half of the lock's time goes to releasing; `pool::pause_with`), and
//!   stops with the pool.

use super::Pool;
use crate::error::Result;
use crate::format::JournalRecord;
use crate::locks::lock;
use crate::metadata::Metadata;
use crate::page_cache::TreeId;
pub use crate::stats::PendingRelease;
use crate::worker::Worker;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Leaves (of 512 block-map entries each) one step releases: about 1.5 ms of the state lock
/// on this project's 2-core test machine (4 leaves 0.2 ms). A VM's request that meets a step
/// waits for the rest of it, and the pause after a step lets the busy VMs make
/// `REQUESTS_BETWEEN_STEPS` requests (condense-format's pacing.rs), so fewer, longer steps
/// keep the VMs' p99 (bench/README.md "admin-stall.sh", sixth pass).
pub const STEP_LEAVES: usize = 32;

/// Leaves a unit of a figures step reads ([`Metadata::release_figures_step`], units until
/// 2 ms): with units of 32 a step's hold reached 8-18 ms where the chunk table's pages had to
/// be read (bench/README.md "admin-stall.sh", eighth pass); 8 as the count's units.
const FIGURES_UNIT_LEAVES: usize = 8;

/// The next step of the oldest pending release: (tree, from, to), `to` = `u64::MAX` for the
/// last one. Reads the step's leaves, so a page that cannot be read fails here, before any
/// change.
fn next_step(md: &mut Metadata, leaves: usize) -> Result<Option<(TreeId, u64, u64)>> {
    let Some((&tree, r)) = md.releasing.iter().next() else {
        return Ok(None);
    };
    let from = r.next;
    let step = leaves.max(1);
    let leaves = md.pages.leaf_pages_first(tree, from, u64::MAX, step + 1)?;
    let to = match leaves.get(step) {
        Some(l) => l.index,
        None => u64::MAX,
    };
    md.pages
        .for_each_leaf(tree, from, to, &mut |_, _| Ok(true))?;
    Ok(Some((tree, from, to)))
}

/// The maps `md` still releases, oldest first.
pub(crate) fn pending(md: &Metadata) -> Vec<PendingRelease> {
    md.releasing
        .values()
        .map(|r| PendingRelease {
            name: r.name.clone(),
            data_blocks: r.data_blocks,
            blocks_left: r.blocks_left(),
        })
        .collect()
}

impl Pool {
    /// Take one step of the oldest pending release; false when nothing is pending (or the
    /// pool is read-only).
    pub fn release_step(&self) -> Result<bool> {
        if self.read_only {
            return Ok(false);
        }
        let _one = lock(&self.release_lock);
        let mut st = self.lock_state();
        self.writable(&st)?;
        // A map's entries leave the kept figures first, in steps of their own (no change
        // to the pool: nothing is journaled), then its pages go.
        let leaves = self.opts.release_step_leaves.min(FIGURES_UNIT_LEAVES);
        if st
            .md
            .release_figures_step(leaves, self.opts.count_step_time)?
        {
            return Ok(true);
        }
        let Some((tree, from, to)) = next_step(&mut st.md, self.opts.release_step_leaves)? else {
            return Ok(false);
        };
        self.commit(&mut st, vec![JournalRecord::ReleaseStep { tree, from, to }])?;
        Ok(true)
    }

    /// Release everything pending now, step by step (the lock let go between steps), then
    /// make it durable; `progress(blocks left, blocks in all)` after each step. For commands
    /// that hold the pool alone (an offline `volume delete`, `gc`): nothing waits on them.
    pub fn finish_releases(&self, progress: &dyn Fn(u64, u64)) -> Result<()> {
        let pending = self.pending_releases();
        if pending.is_empty() {
            return Ok(());
        }
        let total = pending.iter().map(|p| p.blocks_left).sum::<u64>();
        while self.release_step()? {
            let left = self
                .pending_releases()
                .iter()
                .map(|p| p.blocks_left)
                .sum::<u64>();
            progress(left, total);
        }
        self.flush()
    }

    /// The maps still being released, oldest first.
    pub fn pending_releases(&self) -> Vec<PendingRelease> {
        pending(&self.lock_state().md)
    }

    /// Start the background release thread if a release is pending (not for read-only
    /// pools). It ends once nothing is pending, so a pool without pending releases has no
    /// thread holding it (a pool dropped is closed at once, and may be opened again).
    pub(crate) fn start_releaser(&self) {
        if self.read_only
            || !self.opts.release_in_background
            || self.lock_state().md.releasing.is_empty()
        {
            return;
        }
        let mut slot = lock(&self.releaser);
        // A thread that ended (nothing was pending) is joined; one still running is woken.
        if let Some(r) = slot.as_ref() {
            if !r.1.load(Ordering::SeqCst) {
                r.0.unpark();
                return;
            }
        }
        slot.take();
        let ended = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let ended_here = ended.clone();
        let weak = self.me.clone();
        let started = Worker::spawn("condense-release", move |flag| {
            while !flag.load(Ordering::Relaxed) {
                let Some(pool) = weak.upgrade() else { return };
                let started = super::Step::begin();
                let pause = match pool.release_step() {
                    // As long again as the step took, stretched while the VMs are busy
                    // (pool::pause_with, below).
                    Ok(true) => None,
                    Ok(false) => {
                        // Ended, unless a map was detached since the step looked (then the
                        // waker saw this thread running and only woke it).
                        ended_here.store(true, Ordering::SeqCst);
                        if pool.pending_releases().is_empty() {
                            return;
                        }
                        ended_here.store(false, Ordering::SeqCst);
                        Some(Duration::ZERO)
                    }
                    Err(e) => {
                        tracing::warn!(
                            "releasing the map of a deleted volume: {e}; trying again in 30 s \
                             (`condense verify` checks the pool's metadata)"
                        );
                        Some(Duration::from_secs(30))
                    }
                };
                drop(pool);
                let mut park = |d: Duration| {
                    if !flag.load(Ordering::Relaxed) {
                        std::thread::park_timeout(d);
                    }
                };
                match pause {
                    None => super::pause_with(&started, &mut park),
                    Some(d) => park(d),
                }
            }
        });
        match started {
            Ok(w) => *slot = Some(Releaser(w, ended)),
            Err(e) => tracing::warn!(
                "cannot start the release thread: {e}; deleted volumes' space comes back at `condense gc`"
            ),
        }
    }

    /// Wake the release thread, or start it (a deletion or rollback just detached a map).
    pub(crate) fn wake_releaser(&self) {
        self.start_releaser();
    }

    /// Stop the background release thread, waiting for a step in progress.
    pub(crate) fn stop_releaser(&self) {
        let r = lock(&self.releaser).take();
        drop(r);
    }
}

/// The background release thread of a writable pool, and whether it ended by itself.
pub(crate) struct Releaser(Worker, std::sync::Arc<std::sync::atomic::AtomicBool>);
