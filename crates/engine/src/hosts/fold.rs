//! The sync of a shared pool ([`super`] has the protocol): each peer folded in (its
//! condemned segments let go, its new chunks added or merged), the other rooms' steps run,
//! this host's condemned segments every peer let go deleted, and a checkpoint that publishes
//! this host's progress; and the thread that syncs in the background.
//!
//! Owns: [`HostsReport`] and [`PeerReport`], and this host's progress with each peer
//! (`hosts/peer/SS`). [`sync`] takes `gc_lock`, so one GC, sync, adopt or clone runs at a
//! time.
//!
//! Bounded steps (issue 42): the work of a sync grows with the peers' pools (their chunks),
//! and the VMs this host serves wait for the state lock whenever the sync holds it. So no
//! step holds it for more than a fixed amount of work: a peer's chunk table is read
//! [`FOLD_PAGES`] pages at a time (the peer's lock, which no volume I/O of this host takes),
//! folded in [`FOLD_BATCH`] chunks per hold of this host's lock (one commit each), and this
//! host's progress with the peer (`through`) is committed after each window, so a sync
//! that stopped half way resumes at the window it was in, and checkpointed every
//! [`FOLD_CHECKPOINT_CHUNKS`] chunks folded (a checkpoint prepares the pages changed since
//! the last one under the state lock: one at the end of a big fold was the longest hold of
//! a sync, 0.5 s for 3M chunks, bench/README.md "admin-stall.sh"); condemned segments are deleted
//! [`SWEEP_BATCH`] per hold; the steps of the other rooms (let go, hand-overs, forgets) are
//! stepped by the same rule. Writes of the served volumes run between any two steps, and the
//! fold stays correct:
//! - Each batch is decided and committed in one hold ([`Pool::fold_chunks`]): its adds and
//!   merges are made against the chunk table and dedup index as they are at that commit. A
//!   write between two batches that stores a content a later batch holds is found by that
//!   batch (a merge if the peer's slot is lower, else nothing: the content is here already);
//!   a write that deduplicates against a chunk an earlier batch added takes a reference on a
//!   record of a live, uncondemned segment of the peer, which is what the fold is for; an
//!   overwrite that drops a reference to a merged chunk is an ordinary decref.
//! - What could make an earlier batch's decision wrong cannot run between batches: this
//!   host's segments are deleted and its `hosts/condemned` record written only by its GC,
//!   its sweep and its forgets, which all run under `gc_lock`, held for the whole sync. A
//!   segment the peer condemns during the fold is deleted by the peer only after this host
//!   acknowledged it, which it does at a later sync after letting go of it.
//! - Folding a window again is harmless (a crash after some batches, before `through` moved):
//!   a chunk already added is found by the dedup index and not added twice, and a chunk
//!   already merged names the peer's segment, which a merge skips.

use crate::chunk_table::ChunkEntry;
use crate::error::{Error, Result};
use crate::format::hosts::{Condemned, Forgotten, Progress};
use crate::format::{segment_slot, CHUNKS_PER_PAGE, RECORD_HEADER_BYTES};
use crate::locks::lock;
use crate::pool::foreign::Folded;
use crate::pool::gc::{GcReport, VictimFiles};
use crate::pool::peers::OpenedPeer;
use crate::pool::Pool;
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, MutexGuard};

use super::{forget, moves};

/// Chunk-table pages of a peer read per hold of its state lock.
const FOLD_PAGES: u64 = 64;

/// A peer's chunks folded per hold of this host's state lock (one dedup lookup, and for a
/// content held here one chunk-table read, each; one commit per batch).
const FOLD_BATCH: usize = 256;

/// Condemned segments deleted per hold of the state lock (on an object store, one DELETE
/// each).
const SWEEP_BATCH: usize = 8;

/// Chunks folded (added or merged) between two checkpoints of a fold: a checkpoint prepares
/// every page changed since the last one under the state lock, so a fold of millions of
/// chunks checkpoints as it goes rather than once at the end (3M chunks: one hold of ~0.5 s
/// at the end; 128Ki chunks dirty about 1000 chunk-table pages).
const FOLD_CHECKPOINT_CHUNKS: u64 = 128 << 10;

/// What one sync did with one other host.
#[derive(Clone, Debug, Default)]
pub struct PeerReport {
    pub slot: u8,
    pub host: String,
    pub url: String,
    /// Its chunks this host can now deduplicate against.
    pub chunks_folded: u64,
    /// This host's chunks now read from that host's copy (this host's copy is dead space).
    pub chunks_merged: u64,
    /// This host's chunks moved out of that host's condemned segments (copied or dropped).
    pub chunks_let_go: u64,
    /// This host's progress with it after the sync.
    pub progress: Progress,
    /// Its progress with this host, as its newest root says.
    pub its_progress: Progress,
    /// Why it could not be read (its tree is then left as it was).
    pub error: Option<String>,
    /// It was forgotten (`condense hosts forget`): not folded, its acknowledgements not
    /// awaited.
    pub forgotten: bool,
}

/// What [`Pool::sync_hosts`] did.
#[derive(Clone, Debug, Default)]
pub struct HostsReport {
    /// This host's slot.
    pub slot: u8,
    pub peers: Vec<PeerReport>,
    /// Condemned segments of this host deleted (every other host let them go).
    pub segments_deleted: u64,
    /// Condemned segments of this host still waiting.
    pub segments_condemned: u64,
    /// Volumes this host moved out, deleted here now that their new host holds them.
    pub volumes_moved_out: u64,
    /// Volume claims put for volumes held here without one, and this host's claims deleted
    /// whose volume is not here (crate::volume_claims).
    pub claims_put: u64,
    pub claims_deleted: u64,
    /// Hand-overs of this host that had stopped half way and this sync finished (adopts and
    /// clones from another host made whole), and those still unfinished (why).
    pub handovers_finished: Vec<String>,
    pub handovers_unfinished: Vec<(String, String)>,
    /// Volume names this host's part holds that another host's part holds too
    /// ([`forget::check_volume_names`]).
    pub name_conflicts: Vec<forget::NameConflict>,
    /// Forgotten hosts' parts: segments deleted now (and their bytes), and why a reclaim
    /// waits.
    pub reclaimed_segments: u64,
    pub reclaimed_bytes: u64,
    pub reclaim_waiting: Vec<String>,
}

/// Fold every other host in (see the module docs): their new chunks, merges of pairs
/// stored twice, this host's chunks moved out of their condemned segments; then delete
/// this host's condemned segments every other host let go, and checkpoint, which
/// publishes this host's progress to them ([`Pool::sync_hosts`]).
pub(crate) fn sync(pool: &Pool) -> Result<HostsReport> {
    let _one_gc = lock(&pool.gc_lock);
    pool.check_writable()?;
    let mut report = HostsReport {
        slot: pool.slot,
        ..HostsReport::default()
    };
    let peers = pool.attach_peers()?;
    let forgotten = pool.forgotten_hosts();
    if forgotten.contains_key(&pool.slot) {
        return Err(Error::Invalid(format!(
            "this host (slot {:02x}) was forgotten by another host of the pool (`condense hosts forget`): its volumes may be adopted elsewhere, and its part's space reclaimed; it must not write this part any more. Stop it, and join the pool again as a new host from a new local directory (`condense connect URL --join`)",
            pool.slot
        )));
    }
    let (peer_reports, opened, all_read) = fold_peers(pool, &peers, &forgotten);
    report.peers = peer_reports;
    forget::ack_forgets(pool, &forgotten)?;
    let by_slot: BTreeMap<u8, Arc<Pool>> = pool.peers();
    report.volumes_moved_out = moves::finish_moves(pool, &by_slot)?;
    let (finished, unfinished) = moves::finish_handovers(pool, &peers, &forgotten);
    report.handovers_finished = finished;
    report.handovers_unfinished = unfinished;
    report.name_conflicts = forget::check_volume_names(pool, &by_slot, &forgotten)?;
    let guard = lock(&pool.sync_lock);
    if all_read {
        report.segments_deleted = sweep(pool, &opened, &guard)?;
    }
    let deleted = pool.deleted_names_now();
    pool.checkpoint_locked(&guard)?;
    drop(guard);
    pool.drop_claims_of_deleted(deleted);
    report.segments_condemned = pool.read_records(|r| Condemned::read(r.meta()).segs.len() as u64);
    let reclaimed = forget::reclaim_forgotten(pool, &peers, &forgotten)?;
    report.reclaimed_segments = reclaimed.segments;
    report.reclaimed_bytes = reclaimed.bytes;
    report.reclaim_waiting = reclaimed.waiting;
    let tidy = pool.tidy_volume_claims()?;
    report.claims_put = tidy.claimed;
    report.claims_deleted = tidy.deleted;
    Ok(report)
}

/// Fold each peer just opened in ([`fold_peer`]): what each did, the peers whose
/// acknowledgements the sweep awaits (read, not forgotten), and whether every peer not
/// forgotten was read.
fn fold_peers(
    pool: &Pool,
    peers: &[OpenedPeer],
    forgotten: &BTreeMap<u8, Forgotten>,
) -> (Vec<PeerReport>, Vec<Arc<Pool>>, bool) {
    let mut reports = Vec::new();
    let mut all_read = true;
    let mut opened = Vec::new();
    for (peer, part) in peers {
        let gone = forgotten.contains_key(&peer.slot);
        let mut pr = PeerReport {
            slot: peer.slot,
            host: peer.host.clone(),
            url: peer.url.clone(),
            forgotten: gone,
            ..PeerReport::default()
        };
        let folded = match part {
            Ok(p) => fold_peer(pool, p, peer.slot, &mut pr, gone).map(|()| p.clone()),
            Err(e) => Err(Error::Invalid(e.to_string())),
        };
        match folded {
            // A forgotten host's acknowledgements are not awaited: the sweep leaves it out.
            Ok(p) if !gone => opened.push(p),
            Ok(_) => {}
            Err(e) => {
                // A forgotten host that cannot be read holds nothing back.
                all_read &= gone;
                pr.error = Some(e.to_string());
            }
        }
        pr.progress = pool.read_records(|r| Progress::read(r.meta(), peer.slot));
        reports.push(pr);
    }
    (reports, opened, all_read)
}

/// Fold one peer in: let go of its condemned segments, then fold its new chunks.
/// A forgotten host (`forgotten`) is let go of only: its new chunks are not folded.
fn fold_peer(
    pool: &Pool,
    peer: &Pool,
    slot: u8,
    pr: &mut PeerReport,
    forgotten: bool,
) -> Result<()> {
    let mut progress = pool.read_records(|r| Progress::read(r.meta(), slot));
    let (condemned, its_progress) = peer.read_records(|r| {
        (
            Condemned::read(r.meta()),
            Progress::read(r.meta(), pool.slot),
        )
    });
    pr.its_progress = its_progress;
    pr.chunks_let_go = let_go(pool, peer, &condemned, progress.acked, &pr.host)?;
    progress.acked = progress.acked.max(condemned.next);
    // Its chunks added since the last fold (none of a forgotten host: this host adds no
    // chunk that names its part).
    let peer_next = if forgotten {
        progress.through
    } else {
        peer.next_chunk_id()
    };
    let folded = fold_new_chunks(pool, peer, slot, &condemned, &mut progress, peer_next)?;
    pr.chunks_folded = folded.added;
    pr.chunks_merged = folded.merged;
    progress.through = progress.through.max(peer_next);
    pool.commit_records(vec![progress.record(slot)])
}

/// Step 1 of a peer's fold: move this host's chunks out of the segments the peer condemned
/// that this host has not acknowledged yet (`acked` and up); the chunks moved or dropped.
/// Fails, acknowledging nothing, if a segment cannot be read or a record moved out.
fn let_go(pool: &Pool, peer: &Pool, condemned: &Condemned, acked: u64, host: &str) -> Result<u64> {
    let pending: Vec<u32> = condemned
        .segs
        .iter()
        .filter(|(_, seq)| **seq >= acked)
        .map(|(seg, _)| *seg)
        .collect();
    if pending.is_empty() {
        return Ok(0);
    }
    let victims = pool.segment_files(&pending);
    let next_id = pool.next_chunk_id();
    // Never acknowledge a segment whose records could not be moved out.
    if let Some(seg) = pending.iter().find(|s| !victims.contains_key(s)) {
        return Err(Error::Invalid(format!(
            "segment {seg:08x} that host {host} condemned is not readable here; its \
             condemnation is not acknowledged until it is"
        )));
    }
    let repointed = repoint_moved(pool, peer, &victims, condemned, next_id)?;
    let mut gr = GcReport::default();
    let spared = pool.move_out(&victims, next_id, &mut gr)?;
    if let Some(seg) = spared.iter().next() {
        return Err(Error::corrupt(
            format!("segment {seg:08x} of host {host}"),
            "a record this host refers to failed its check while moving it out; \
             `condense verify` names the blocks",
        ));
    }
    Ok(repointed + gr.chunks_moved + gr.chunks_dropped)
}

/// Step 1a: this host's referenced chunks in `victims` whose record the peer only moved (the
/// peer's chunk the old record names is now in another segment of the peer, not condemned,
/// with the same fingerprint) are pointed at that record rather than copied, so the block
/// stays stored once; the chunks pointed. A header that cannot be read is left to the copy.
fn repoint_moved(
    pool: &Pool,
    peer: &Pool,
    victims: &VictimFiles,
    condemned: &Condemned,
    next_id: u64,
) -> Result<u64> {
    let per = CHUNKS_PER_PAGE as u64;
    let peer_next = peer.next_chunk_id();
    let (mut done, mut page) = (0, 0);
    while page * per < next_id {
        let mut moves = Vec::new();
        // The peer's chunk-table pages this window looked at, each read once.
        let mut theirs_pages: HashMap<u64, HashMap<u64, ChunkEntry>> = HashMap::new();
        for (id, e) in pool.chunks_in_pages(page, FOLD_PAGES)? {
            let Some(file) = victims.get(&e.loc.segment) else {
                continue;
            };
            let mut head = [0u8; RECORD_HEADER_BYTES];
            if e.refs == 0 || file.read_at(&mut head, u64::from(e.loc.offset)).is_err() {
                continue;
            }
            let theirs = crate::format::record_chunk_id(&head);
            if theirs >= peer_next {
                continue; // not a chunk of the peer's: left to the copy
            }
            let entries = match theirs_pages.entry(theirs / per) {
                Entry::Occupied(o) => o.into_mut(),
                Entry::Vacant(v) => {
                    v.insert(peer.chunks_in_pages(theirs / per, 1)?.into_iter().collect())
                }
            };
            let Some(t) = entries.get(&theirs) else {
                continue;
            };
            if t.fp == e.fp
                && t.refs > 0
                && !t.loc.codec.is_delta()
                && !e.loc.codec.is_delta()
                && segment_slot(t.loc.segment) == peer.slot
                && !condemned.segs.contains_key(&t.loc.segment)
            {
                moves.push((id, e.loc, t.loc));
            }
        }
        done += pool.repoint_chunks(&moves)?;
        page += FOLD_PAGES;
    }
    Ok(done)
}

/// Step 2 of a peer's fold: its chunks with ids in `[progress.through, peer_next)` that are
/// live, in a segment of its own (`slot`) and not condemned, folded a window of pages at a
/// time, [`FOLD_BATCH`] chunks per hold of this host's state lock; `progress` (`through`
/// moved past the window) is committed after each window, and a checkpoint written every
/// [`FOLD_CHECKPOINT_CHUNKS`] chunks folded.
fn fold_new_chunks(
    pool: &Pool,
    peer: &Pool,
    slot: u8,
    condemned: &Condemned,
    progress: &mut Progress,
    peer_next: u64,
) -> Result<Folded> {
    let mut done = Folded::default();
    let per = CHUNKS_PER_PAGE as u64;
    let through = progress.through;
    let mut page = through / per;
    let mut checkpointed = 0;
    while page * per < peer_next {
        let mut window = peer.chunks_in_pages(page, FOLD_PAGES)?;
        page += FOLD_PAGES;
        window.retain(|(pid, e)| {
            *pid >= through
                && *pid < peer_next
                && e.refs > 0
                && segment_slot(e.loc.segment) == slot
                && !condemned.segs.contains_key(&e.loc.segment)
        });
        let mut pace = crate::pool::Pacer::default();
        for batch in window.chunks(FOLD_BATCH) {
            pace.step();
            let f = pool.fold_chunks(batch, slot)?;
            done.added += f.added;
            done.merged += f.merged;
        }
        progress.through = progress.through.max((page * per).min(peer_next));
        pool.commit_records(vec![progress.record(slot)])?;
        if done.added + done.merged - checkpointed >= FOLD_CHECKPOINT_CHUNKS {
            pool.checkpoint_locked(&lock(&pool.sync_lock))?;
            checkpointed = done.added + done.merged;
        }
    }
    Ok(done)
}

/// Delete this host's condemned segments that every peer let go (each acknowledged the
/// condemnation and names none of its records); the number deleted.
fn sweep(pool: &Pool, peers: &[Arc<Pool>], _sync: &MutexGuard<'_, ()>) -> Result<u64> {
    let mut condemned = pool.read_records(|r| Condemned::read(r.meta()));
    let free: Vec<u32> = condemned
        .segs
        .iter()
        .filter(|(seg, seq)| {
            peers.iter().all(|p| {
                p.read_records(|r| Progress::read(r.meta(), pool.slot).acked > **seq)
                    && !p.has_live_chunks_in(**seg)
            })
        })
        .map(|(seg, _)| *seg)
        .collect();
    // A batch at a time, each journaling what is still condemned after it: nothing else
    // writes `hosts/condemned` meanwhile (its writers run under `gc_lock`, held here).
    for batch in free.chunks(SWEEP_BATCH) {
        for seg in batch {
            condemned.segs.remove(seg);
        }
        pool.delete_condemned(batch, condemned.clone())?;
    }
    Ok(free.len() as u64)
}

/// Fold the other hosts in every `interval` while the pool is open writable (`serve`,
/// `mount`, `import`), in the background; stops when dropped. A pool nobody joined costs one
/// LIST of the registry per interval.
pub fn start_background_sync(
    pool: &Arc<Pool>,
    interval: std::time::Duration,
) -> Option<crate::worker::Worker> {
    if pool.read_only {
        return None;
    }
    let weak = Arc::downgrade(pool);
    let spawned = crate::worker::Worker::spawn("condense-hosts", move |stop| {
        let tick = std::time::Duration::from_millis(200);
        let mut waited = std::time::Duration::ZERO;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            std::thread::park_timeout(tick);
            waited += tick;
            if waited < interval {
                continue;
            }
            waited = std::time::Duration::ZERO;
            let Some(pool) = weak.upgrade() else { return };
            if !matches!(pool.is_shared(), Ok(true)) {
                continue;
            }
            match sync(&pool) {
                Ok(r) => tracing::info!(
                    "hosts: folded {} chunks, merged {}, let go {}, deleted {} condemned segments",
                    r.peers.iter().map(|p| p.chunks_folded).sum::<u64>(),
                    r.peers.iter().map(|p| p.chunks_merged).sum::<u64>(),
                    r.peers.iter().map(|p| p.chunks_let_go).sum::<u64>(),
                    r.segments_deleted
                ),
                Err(e) => tracing::warn!("hosts: sync failed: {e}"),
            }
        }
    });
    match spawned {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!("hosts: no background sync thread: {e}");
            None
        }
    }
}
