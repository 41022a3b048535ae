//! A pool several hosts share (docs/S3.md "Many hosts"): the other hosts' trees read, their
//! chunks folded into this host's chunk table (dedup across hosts), and segments that a GC
//! emptied deleted only once every other host let them go.
//!
//! Owns: the peers (the other hosts' trees, open read-only: [`Pool::attach_peers`]), the
//! fold ([`Pool::sync_hosts`]), the hand-overs (move, adopt, clone from a host: the records
//! `hosts/released/NAME`, `hosts/adopted/SS/NAME`, `hosts/pending/NAME`), the condemned
//! segments (`hosts/condemned`) and this host's progress with each peer (`hosts/peer/SS`),
//! all metadata records in the checkpoint root, which is how the other hosts read them.
//!
//! The protocol, for hosts A (owner of segment S) and B:
//! - **Fold.** B reads A's newest root and, for every live chunk A added since B's last fold
//!   (`through`), in a segment of A's own that is not condemned: if B has no chunk with that
//!   fingerprint, B adds one that points at A's record (a chunk with no reference yet, found
//!   by B's dedup index like any other); if B has one stored in its own segment and A's slot
//!   is lower, B moves its chunk to A's record (a `Relocate`: B's copy becomes dead space for
//!   B's GC). So of two hosts that stored one block at once, the lower slot's copy stays.
//! - **Condemn.** A's GC moves A's live chunks out of S as in a pool of one host, then, instead
//!   of deleting S, records it condemned with a sequence number `n` (in A's root).
//! - **Let go.** B, folding, finds S condemned: it moves its own chunks out of S (referenced
//!   ones copied into B's segments, unreferenced ones dropped) and records `acked` past `n`
//!   in its next root. From then on no chunk of B names S, and B never adds one that does
//!   (A's root no longer names S, and B skips condemned segments).
//! - **Delete.** A deletes S once every other host's newest root acknowledges `n` and none of
//!   its referenced chunks is in S. A host that never folds again keeps S forever: safe,
//!   never a loss, until it is forgotten (`crate::hosts_forget`: its acknowledgements are then
//!   no longer awaited).
//!
//! Hand-overs (`move`, `adopt`, `clone --from-host`) are resumable: each step leaves a durable
//! state the next run of the same command, or the next sync, continues. A volume being made by
//! an adopt or a clone carries `hosts/pending/NAME` from the commit that creates it to the one
//! that completes it (its writes are refused meanwhile; mapping its blocks again is
//! idempotent); a move run again to the same host publishes the hand-over it recorded.
//!
//! Invariants:
//! - A chunk's record is read from another host's segment only while that segment is not
//!   deleted: every host that may name it has acknowledged its condemnation first.
//! - Folded chunks and merges are journaled like any other change (`NewChunk`, `Relocate`);
//!   replay trusts another host's record without reading it (it was in the bucket, named by
//!   that host's root, before the journal named it).

use crate::error::{Error, Result};
use crate::format::hosts::{
    released_slot, released_turn, released_value, Condemned, Forgotten, Pending, ADOPTED_PREFIX,
    PEER_KEY_PREFIX, RELEASED_PREFIX,
};
pub use crate::format::hosts::{released_to, Progress};

/// Chunk-table pages of a peer read per hold of the state lock.
const FOLD_PAGES: u64 = 64;
use crate::format::{segment_slot, JournalRecord, CHUNKS_PER_PAGE};
use crate::gc::GcReport;
use crate::io::{File, Peer};
use crate::locks::lock;
use crate::pool::{OpenOptions, Pool};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, MutexGuard};

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
    /// ([`Pool::check_volume_names`]).
    pub name_conflicts: Vec<crate::hosts_forget::NameConflict>,
    /// Forgotten hosts' parts: segments deleted now (and their bytes), and why a reclaim
    /// waits.
    pub reclaimed_segments: u64,
    pub reclaimed_bytes: u64,
    pub reclaim_waiting: Vec<String>,
}

impl Pool {
    /// True if other hosts share this pool (they may name this host's records).
    pub fn is_shared(&self) -> Result<bool> {
        Ok(!self
            .dir
            .peers()
            .map_err(|e| Error::io("listing the hosts of the pool", e))?
            .is_empty())
    }

    /// Open every other host's tree read-only (again: a fresh view of each) and read the
    /// records of their segments from now on. A tree that fails to open is reported, and the
    /// segments already known of it stay readable.
    pub(crate) fn attach_peers(&self) -> Result<Vec<(Peer, Result<Arc<Pool>>)>> {
        let peers = self
            .dir
            .peers()
            .map_err(|e| Error::io("listing the hosts of the pool", e))?;
        let mut out = Vec::new();
        for peer in peers {
            // The previous open of this peer holds its local directory's lock: close it first.
            // Another thread may hold it for a moment more (a name check): wait for it.
            lock(&self.peers).remove(&peer.slot);
            let mut tries = 0;
            let opened = loop {
                match Pool::open_peer(&peer.local, self.opts.key.clone()) {
                    Err(Error::Locked(_)) if tries < 40 => {
                        tries += 1;
                        std::thread::sleep(std::time::Duration::from_millis(50));
                    }
                    r => break r,
                }
            }
            .map_err(|e| Error::Invalid(format!("reading host {} ({}): {e}", peer.host, peer.url)));
            if let Ok(p) = &opened {
                let files = p.uploaded_segments();
                let mut st = lock(&self.state);
                for (id, f) in files {
                    if segment_slot(id) == peer.slot && st.segments.is_foreign(id) {
                        st.segments.add_foreign(id, f);
                    }
                }
                drop(st);
                lock(&self.peers).insert(peer.slot, p.clone());
            }
            out.push((peer, opened));
        }
        Ok(out)
    }

    /// Fold every other host in (see the module docs): their new chunks, merges of pairs
    /// stored twice, this host's chunks moved out of their condemned segments; then delete
    /// this host's condemned segments every other host let go, and checkpoint, which
    /// publishes this host's progress to them.
    pub fn sync_hosts(&self) -> Result<HostsReport> {
        let _one_gc = lock(&self.gc_lock);
        self.writable(&lock(&self.state))?;
        let mut report = HostsReport {
            slot: self.slot,
            ..HostsReport::default()
        };
        let peers = self.attach_peers()?;
        let forgotten = self.forgotten_hosts();
        if forgotten.contains_key(&self.slot) {
            return Err(Error::Invalid(format!(
                "this host (slot {:02x}) was forgotten by another host of the pool (`condense hosts forget`): its volumes may be adopted elsewhere, and its part's space reclaimed; it must not write this part any more. Stop it, and join the pool again as a new host from a new local directory (`condense connect URL --join`)",
                self.slot
            )));
        }
        let mut all_read = true;
        let mut opened = Vec::new();
        for (peer, pool) in &peers {
            let gone = forgotten.contains_key(&peer.slot);
            let mut pr = PeerReport {
                slot: peer.slot,
                host: peer.host.clone(),
                url: peer.url.clone(),
                forgotten: gone,
                ..PeerReport::default()
            };
            let folded = match pool {
                Ok(p) => self
                    .fold_peer(p, peer.slot, &mut pr, gone)
                    .map(|()| p.clone()),
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
            pr.progress = Progress::read(&lock(&self.state).md.meta, peer.slot);
            report.peers.push(pr);
        }
        self.ack_forgets(&forgotten)?;
        let by_slot: BTreeMap<u8, Arc<Pool>> = lock(&self.peers).clone();
        report.volumes_moved_out = self.finish_moves(&by_slot)?;
        self.finish_handovers(&peers, &forgotten, &mut report);
        report.name_conflicts = self.check_volume_names(&by_slot, &forgotten)?;
        let guard = lock(&self.sync_lock);
        if all_read {
            report.segments_deleted = self.sweep(&opened, &guard)?;
        }
        let deleted = self.deleted_names_now();
        self.checkpoint_locked(&guard)?;
        drop(guard);
        self.drop_claims_of_deleted(deleted);
        report.segments_condemned = Condemned::read(&lock(&self.state).md.meta).segs.len() as u64;
        self.reclaim_forgotten(&peers, &forgotten, &mut report)?;
        let tidy = self.tidy_volume_claims()?;
        report.claims_put = tidy.claimed;
        report.claims_deleted = tidy.deleted;
        Ok(report)
    }

    /// Fold one peer in: let go of its condemned segments, then fold its new chunks.
    /// A forgotten host (`forgotten`) is let go of only: its new chunks are not folded.
    fn fold_peer(&self, peer: &Pool, slot: u8, pr: &mut PeerReport, forgotten: bool) -> Result<()> {
        let mut progress = Progress::read(&lock(&self.state).md.meta, slot);
        let (condemned, its_progress) = {
            let st = lock(&peer.state);
            (
                Condemned::read(&st.md.meta),
                Progress::read(&st.md.meta, self.slot),
            )
        };
        pr.its_progress = its_progress;
        // 1. Let go of its condemned segments not acknowledged yet.
        let pending: Vec<u32> = condemned
            .segs
            .iter()
            .filter(|(_, seq)| **seq >= progress.acked)
            .map(|(seg, _)| *seg)
            .collect();
        if !pending.is_empty() {
            let (victims, next_id) = {
                let st = lock(&self.state);
                let victims: HashMap<u32, Arc<dyn File>> = pending
                    .iter()
                    .filter_map(|s| st.segments.file(*s).map(|f| (*s, f)))
                    .collect();
                (victims, st.md.chunks.next_id)
            };
            // Never acknowledge a segment whose records could not be moved out.
            if let Some(seg) = pending.iter().find(|s| !victims.contains_key(s)) {
                return Err(Error::Invalid(format!(
                    "segment {seg:08x} that host {} condemned is not readable here; its \
                     condemnation is not acknowledged until it is",
                    pr.host
                )));
            }
            let mut gr = GcReport::default();
            let spared = self.move_out(&victims, next_id, &mut gr)?;
            if let Some(seg) = spared.iter().next() {
                return Err(Error::corrupt(
                    format!("segment {seg:08x} of host {}", pr.host),
                    "a record this host refers to failed its check while moving it out; \
                     `condense verify` names the blocks",
                ));
            }
            pr.chunks_let_go = gr.chunks_moved + gr.chunks_dropped;
        }
        progress.acked = progress.acked.max(condemned.next);
        // 2. Its chunks added since the last fold (none of a forgotten host: this host adds
        // no chunk that names its part).
        let peer_next = if forgotten {
            progress.through
        } else {
            lock(&peer.state).md.chunks.next_id
        };
        let per = CHUNKS_PER_PAGE as u64;
        let mut page = progress.through / per;
        while page * per < peer_next {
            let window = peer.peer_chunks(page, FOLD_PAGES)?;
            page += FOLD_PAGES;
            let mut st = lock(&self.state);
            let mut records = Vec::new();
            for (pid, e) in window {
                if pid < progress.through
                    || e.refs == 0
                    || segment_slot(e.loc.segment) != slot
                    || condemned.segs.contains_key(&e.loc.segment)
                    || st.segments.file(e.loc.segment).is_none()
                {
                    continue;
                }
                match st.md.find_duplicate(&e.fp) {
                    Some(id) => {
                        let md = &mut st.md;
                        let Some(mine) = md.chunks.get(&mut md.pages, id)? else {
                            continue;
                        };
                        if slot < self.slot && !st.segments.is_foreign(mine.loc.segment) {
                            records.push(JournalRecord::Relocate { id, loc: e.loc });
                            pr.chunks_merged += 1;
                        }
                    }
                    None => {
                        let Some(id) = st.md.chunks.allocate_id() else {
                            return Err(Error::Invalid("the chunk table has no id left".into()));
                        };
                        records.push(JournalRecord::NewChunk {
                            id,
                            loc: e.loc,
                            fp: e.fp,
                        });
                        pr.chunks_folded += 1;
                    }
                }
            }
            if !records.is_empty() {
                self.commit(&mut st, records)?;
            }
        }
        progress.through = progress.through.max(peer_next);
        let mut st = lock(&self.state);
        self.commit(&mut st, vec![progress.record(slot)])?;
        Ok(())
    }

    /// Delete this host's condemned segments that every peer let go (each acknowledged the
    /// condemnation and names none of its records); the number deleted.
    fn sweep(&self, peers: &[Arc<Pool>], _sync: &MutexGuard<'_, ()>) -> Result<u64> {
        let mut condemned = Condemned::read(&lock(&self.state).md.meta);
        let free: Vec<u32> = condemned
            .segs
            .iter()
            .filter(|(seg, seq)| {
                peers.iter().all(|p| {
                    let st = lock(&p.state);
                    Progress::read(&st.md.meta, self.slot).acked > **seq
                        && !st.md.chunks.live_bytes.contains_key(seg)
                })
            })
            .map(|(seg, _)| *seg)
            .collect();
        if free.is_empty() {
            return Ok(0);
        }
        let mut st = lock(&self.state);
        for seg in &free {
            st.segments.remove(&*self.dir, *seg)?;
            condemned.segs.remove(seg);
        }
        self.commit(&mut st, vec![condemned.record()])?;
        drop(st);
        self.dir
            .sync_dir()
            .map_err(|e| Error::io("syncing the pool directory", e))?;
        Ok(free.len() as u64)
    }

    /// GC emptied `segs`: in a pool other hosts share, record them condemned (durable in a
    /// new root on return) and keep them; true if so. False in a pool of one host: the caller
    /// deletes them.
    pub(crate) fn condemn(&self, segs: &[u32], sync: &MutexGuard<'_, ()>) -> Result<bool> {
        if segs.is_empty() || !self.is_shared()? {
            return Ok(false);
        }
        let mut st = lock(&self.state);
        let mut c = Condemned::read(&st.md.meta);
        for seg in segs {
            c.segs.insert(*seg, c.next);
        }
        c.next += 1;
        self.commit(&mut st, vec![c.record()])?;
        drop(st);
        self.checkpoint_locked(sync)?;
        Ok(true)
    }

    /// The segments of this (peer's) tree that are in its store: every one but those a
    /// writer still holds in its local directory.
    pub(crate) fn uploaded_segments(&self) -> Vec<(u32, Arc<dyn File>)> {
        let held: BTreeSet<String> = self
            .dir
            .held()
            .map(|h| h.into_iter().map(|(n, _)| n).collect())
            .unwrap_or_default();
        let st = lock(&self.state);
        st.segments
            .ids()
            .filter(|(id, _)| !held.contains(&crate::format::segment_name(*id)))
            .filter_map(|(id, _)| st.segments.file(id).map(|f| (id, f)))
            .collect()
    }

    /// The chunks of chunk-table pages `[page, page + pages)`.
    fn peer_chunks(
        &self,
        page: u64,
        pages: u64,
    ) -> Result<Vec<(u64, crate::chunk_table::ChunkEntry)>> {
        let mut out = Vec::new();
        let mut st = lock(&self.state);
        let md = &mut st.md;
        md.chunks
            .for_each_in(&mut md.pages, page, page + pages, &mut |id, e| {
                out.push((id, *e));
                Ok(())
            })?;
        Ok(out)
    }

    /// This host's slot, its condemned segments and its progress with each peer, as its
    /// metadata holds them now (for `condense hosts`).
    pub fn hosts_state(&self) -> (u8, u64, BTreeMap<u8, Progress>) {
        let st = lock(&self.state);
        let progress = st
            .md
            .meta
            .range(PEER_KEY_PREFIX.to_string()..)
            .take_while(|(k, _)| k.starts_with(PEER_KEY_PREFIX))
            .filter_map(|(k, _)| {
                let slot = u8::from_str_radix(k.strip_prefix(PEER_KEY_PREFIX)?, 16).ok()?;
                Some((slot, Progress::read(&st.md.meta, slot)))
            })
            .collect();
        (
            self.slot,
            Condemned::read(&st.md.meta).segs.len() as u64,
            progress,
        )
    }
}

/// One host's part of a shared pool, for `condense hosts` ([`Pool::hosts_overview`]).
#[derive(Clone, Debug, Default)]
pub struct HostOverview {
    pub slot: u8,
    pub host: String,
    pub url: String,
    /// This host's own part.
    pub this_host: bool,
    /// Volumes (not snapshots) and snapshots of its part, and the bytes written to them.
    pub volumes: u64,
    pub snapshots: u64,
    pub written_bytes: u64,
    /// Objects and bytes of its part in the bucket.
    pub bucket_objects: u64,
    pub bucket_bytes: u64,
    /// Chunk ids it has published (its newest root's next chunk id, as this host read it).
    pub chunks_published: u64,
    /// How far this host folded it in (another host's part only).
    pub folded_through: Option<u64>,
    /// Its lease: the holder now, or the last one (released: expiry 0).
    pub lease: Option<crate::remote::LeaseBody>,
    /// Why something of it could not be read.
    pub error: Option<String>,
    /// It was forgotten (`condense hosts forget`), and whether its part's space was
    /// reclaimed: `forgotten`, `forgotten, reclaim pending` or `forgotten, reclaimed`.
    pub forgotten: Option<String>,
    /// This host's part only: hand-overs not finished and names in conflict
    /// ([`Pool::hand_over_notes`]).
    pub notes: Vec<String>,
}

impl Pool {
    /// Every host's part of this shared pool (this host's first; its local directory is
    /// `own_local`), as this host's last read of each has it: volumes, bucket bytes,
    /// publication, lease. One LIST of each part's claims and of each part's prefix.
    pub fn hosts_overview(&self, own_local: &std::path::Path) -> Result<Vec<HostOverview>> {
        let (_, _, progress) = self.hosts_state();
        let peers = self
            .dir
            .peers()
            .map_err(|e| Error::io("listing the hosts of the pool", e))?;
        let opened = lock(&self.peers).clone();
        let mut out = Vec::new();
        let own = HostOverview {
            slot: self.slot,
            host: if self.slot == 0 {
                crate::remote::FIRST_HOST.to_string()
            } else {
                self.host_name_of(self.slot)
            },
            url: self.dir.describe(),
            this_host: true,
            notes: self.hand_over_notes(),
            ..HostOverview::default()
        };
        let forgotten = self.forgotten_hosts();
        let mut parts = vec![(own, Some(self), own_local.to_path_buf())];
        for p in &peers {
            let h = HostOverview {
                slot: p.slot,
                host: p.host.clone(),
                url: p.url.clone(),
                folded_through: Some(progress.get(&p.slot).map_or(0, |pr| pr.through)),
                forgotten: forgotten.get(&p.slot).map(|f| {
                    match (f.reclaim, f.reclaimed) {
                        (_, true) => "forgotten, reclaimed",
                        (true, false) => "forgotten, reclaim pending",
                        (false, false) => "forgotten",
                    }
                    .to_string()
                }),
                ..HostOverview::default()
            };
            parts.push((h, opened.get(&p.slot).map(|x| &**x), p.local.clone()));
        }
        for (mut h, pool, local) in parts {
            match crate::remote::part_lease(&local) {
                Ok(l) => h.lease = l,
                Err(e) => h.error = Some(format!("its lease: {e}")),
            }
            let Some(pool) = pool else {
                h.error
                    .get_or_insert_with(|| "its part could not be opened".into());
                out.push(h);
                continue;
            };
            {
                let st = lock(&pool.state);
                h.chunks_published = st.md.chunks.next_id;
            }
            match pool.stats() {
                Ok(s) => {
                    h.volumes = s.volumes.len() as u64;
                    h.snapshots = s.snapshots.len() as u64;
                    h.written_bytes = s.volumes.iter().map(|v| v.written_bytes).sum();
                    if let Some(r) = s.remote {
                        h.bucket_objects = r.objects;
                        h.bucket_bytes = r.bytes;
                    }
                }
                Err(e) => h.error = Some(e.to_string()),
            }
            out.push(h);
        }
        Ok(out)
    }
}

/// What [`Pool::move_out_volume`] and [`Pool::adopt_volume`] report.
#[derive(Clone, Debug, Default)]
pub struct MoveReport {
    pub volume: String,
    /// The other host and its slot.
    pub host: String,
    pub slot: u8,
    /// What the adopting clone did (adopt only).
    pub clone: Option<CloneReport>,
}

impl Pool {
    /// Hand volume `name` over to host `to` (the first half of a move; the second is
    /// [`Pool::adopt_volume`] on that host): from now on its writes are refused here
    /// ([`Error::VolumeMoved`]), everything written before is flushed and in a new root,
    /// which `to` reads. The volume is deleted here by the first sync that finds it in
    /// `to`'s root.
    pub fn move_out_volume(&self, name: &str, to: &str) -> Result<MoveReport> {
        let vol = self.volume_id(name)?;
        let peer = self.peer_named(to)?;
        // The destination claims the name one turn above this host's claim.
        let turn = self.own_claim_turn(name)?.unwrap_or(0) + 1;
        // The volume's write lock: a partial-block write in flight finishes first.
        let vol_lock = self.volume_lock(vol);
        let _w = lock(&vol_lock);
        {
            let mut st = lock(&self.state);
            self.writable(&st)?;
            let v = st
                .md
                .volumes
                .get(&vol)
                .ok_or_else(|| Error::NotFound(name.into()))?;
            if v.snapshot_of.is_some() {
                return Err(Error::SnapshotReadOnly(name.into()));
            }
            let snaps = crate::pool::snapshots::snapshot_names_of(&st.md, vol);
            if !snaps.is_empty() {
                return Err(Error::Invalid(format!(
                    "volume {name:?} has snapshots ({}): a move takes the volume as it is now; clone the snapshots on host {to} first if they are wanted there (`condense volume clone --from-host HOST {name}@SNAP NEW`), then delete them here",
                    snaps.join(", ")
                )));
            }
            match released_to(&st.md.meta, name) {
                // Handed to that host already (a move that stopped before its root): the
                // hand-over stands as recorded, and is published below.
                Some(_) if released_slot(&st.md.meta, name) == Some(peer.slot) => {}
                Some(h) => {
                    return Err(Error::VolumeMoved {
                        volume: name.into(),
                        host: h,
                    });
                }
                None => {
                    self.commit(
                        &mut st,
                        vec![JournalRecord::MetaPut {
                            key: format!("{RELEASED_PREFIX}{name}"),
                            value: Some(released_value(peer.slot, &peer.host, turn)),
                        }],
                    )?;
                }
            }
        }
        self.handover_point(STEP_RELEASED)?;
        let sync = lock(&self.sync_lock);
        self.checkpoint_locked(&sync)?;
        Ok(MoveReport {
            volume: name.into(),
            host: peer.host,
            slot: peer.slot,
            clone: None,
        })
    }

    /// Take volume `name` over from host `from`, which handed it to this host
    /// ([`Pool::move_out_volume`]) or was forgotten ([`Pool::forget_host`]): a clone of it
    /// under the same name as `from`'s newest root has it (everything flushed there before the
    /// hand-over), durable on return. Resumable: an adopt that stopped half way (its claim
    /// put, its volume half made: `hosts/pending/NAME`) is continued by running it again or
    /// by the next [`Pool::sync_hosts`]; one that finished but was not published yet is
    /// published.
    pub fn adopt_volume(&self, name: &str, from: &str) -> Result<MoveReport> {
        let one_gc = lock(&self.gc_lock);
        self.writable(&lock(&self.state))?;
        let peers = self.attach_peers()?;
        let report = self.adopt_locked(&peers, name, from)?;
        drop(one_gc);
        let sync = lock(&self.sync_lock);
        self.checkpoint_locked(&sync)?;
        Ok(report)
    }

    /// [`Pool::adopt_volume`] with the other hosts' parts just opened; the caller holds
    /// `gc_lock` and checkpoints.
    fn adopt_locked(
        &self,
        peers: &[(Peer, Result<Arc<Pool>>)],
        name: &str,
        from: &str,
    ) -> Result<MoveReport> {
        let (p, peer) = peers
            .iter()
            .find(|(p, _)| p.answers_to(from))
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "host {from} in this pool (`condense hosts` lists them)"
                ))
            })?;
        let p = p.clone();
        let peer = peer.as_ref().map_err(|e| Error::Invalid(e.to_string()))?;
        let adopted_key = format!("{ADOPTED_PREFIX}{:02x}/{name}", p.slot);
        let report = |clone| MoveReport {
            volume: name.into(),
            host: p.host.clone(),
            slot: p.slot,
            clone,
        };
        {
            let st = lock(&self.state);
            if st.md.meta.contains_key(&adopted_key)
                && st.md.names.contains_key(name)
                && !st.md.meta.contains_key(&Pending::key(name))
            {
                // Adopted already: only its root may be missing (the caller makes it).
                return Ok(report(None));
            }
        }
        let forgotten = self.forgotten_hosts().remove(&p.slot);
        let turn = match &forgotten {
            Some(f) if f.reclaim => {
                return Err(Error::Invalid(format!(
                    "host {from} was forgotten and its part's space is being reclaimed (`condense hosts forget --reclaim`): its volumes that were not adopted before are given up"
                )))
            }
            // Nobody released it: claimed one turn above every claim of the name.
            Some(_) => self.claim_turns(name)?.map_or(1, |t| t + 1),
            None => {
                let (to_me, turn) = {
                    let st = lock(&peer.state);
                    (
                        released_slot(&st.md.meta, name),
                        released_turn(&st.md.meta, name).unwrap_or(1),
                    )
                };
                if to_me != Some(self.slot) {
                    return Err(Error::Invalid(format!(
                        "host {from} has not handed volume {name:?} to this host (slot {:02x}){}: run `condense volume move {name} --to HOST` on host {from} first (or, if that host is gone for good, `condense hosts forget {from}` here)",
                        self.slot,
                        match to_me {
                            Some(s) => format!(" but to slot {s:02x}"),
                            None => String::new(),
                        }
                    )));
                }
                turn
            }
        };
        let pending = Pending {
            op: "adopt".into(),
            from: p.slot,
            source: name.into(),
            turn,
        };
        let clone = self.clone_or_resume(peers, &p.host, name, &pending)?;
        if forgotten.is_some() {
            // No hand-over named this slot: two hosts may adopt at once. The claim rule
            // decides, as for a new volume (docs/S3.md "Volume claims").
            self.confirm_claim(name)?;
        }
        self.handover_point(STEP_FILLED)?;
        self.complete_pending(
            name,
            vec![JournalRecord::MetaPut {
                key: adopted_key,
                value: Some(crate::format::hosts::adopted_value(turn)),
            }],
        )?;
        self.handover_point(STEP_COMPLETED)?;
        Ok(report(Some(clone)))
    }

    /// Take volumes `names` over from host `from`, which is gone (docs/S3.md "Taking over
    /// a dead host's volumes"): this host takes `from`'s part lease once it expired (waiting
    /// up to `wait` for that), which replays what `from` flushed (with durability `remote`,
    /// every write a client saw flushed), hands the volumes to this host there as `volume
    /// move` would, releases that lease, and adopts them here. `from` deletes its copies when
    /// it comes back (its writes to them refused meanwhile).
    pub fn take_over_volumes(
        &self,
        names: &[String],
        from: &str,
        wait: std::time::Duration,
    ) -> Result<Vec<MoveReport>> {
        self.writable(&lock(&self.state))?;
        let peer = self.peer_named(from)?;
        let me = format!("{:02x}", self.slot);
        let deadline = std::time::Instant::now() + wait;
        let theirs = loop {
            let opts = OpenOptions {
                key: self.opts.key.clone(),
                ..OpenOptions::default()
            };
            match Pool::open_path(&peer.takeover, opts) {
                Ok(p) => break p,
                Err(Error::Busy(m)) if std::time::Instant::now() < deadline => {
                    tracing::info!("waiting for the lease of host {} to expire: {m}", peer.host);
                    std::thread::sleep(std::time::Duration::from_secs(2));
                }
                Err(Error::Busy(m)) => {
                    return Err(Error::Busy(format!(
                        "host {} still holds its part of the pool ({m}); if it is alive, run `condense volume move VOL --to HOST` there instead",
                        peer.host
                    )))
                }
                Err(e) => {
                    return Err(Error::Invalid(format!(
                        "taking the part of host {} ({}): {e}",
                        peer.host, peer.url
                    )))
                }
            }
        };
        let handed: Result<()> = names.iter().try_for_each(|name| {
            match theirs.move_out_volume(name, &me) {
                Ok(_) => Ok(()),
                // Handed here already (an earlier takeover that stopped half way).
                Err(Error::VolumeMoved { .. })
                    if released_slot(&lock(&theirs.state).md.meta, name) == Some(self.slot) =>
                {
                    Ok(())
                }
                Err(e) => Err(e),
            }
        });
        let closed = theirs.close();
        drop(theirs);
        handed?;
        closed?;
        names
            .iter()
            .map(|name| self.adopt_volume(name, &peer.host))
            .collect()
    }

    /// The host whose part holds a volume `name` (as its root this host read last has it),
    /// unless that host handed it to this one: a new volume of that name is refused here.
    /// Best effort: two hosts creating one name within a fold interval both succeed (exact
    /// names across hosts need volume claims, not built).
    pub(crate) fn held_by_another_host(&self, name: &str) -> Option<String> {
        let forgotten = self.forgotten_hosts();
        let peers = lock(&self.peers).clone();
        let slot = peers.iter().find_map(|(slot, p)| {
            if forgotten.contains_key(slot) {
                return None; // a forgotten host's volumes are adopted without a hand-over
            }
            let st = lock(&p.state);
            (st.md.names.contains_key(name) && released_slot(&st.md.meta, name) != Some(self.slot))
                .then_some(*slot)
        })?;
        Some(self.host_name_of(slot))
    }

    /// The other host `host` names (its name or slot), as the registry has it.
    pub(crate) fn peer_named(&self, host: &str) -> Result<Peer> {
        self.dir
            .peers()
            .map_err(|e| Error::io("listing the hosts of the pool", e))?
            .into_iter()
            .find(|p| p.answers_to(host))
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "host {host} in this pool (`condense hosts` lists them)"
                ))
            })
    }

    /// The name of the host in `slot`, as the registry has it.
    pub(crate) fn host_name_of(&self, slot: u8) -> String {
        if slot == 0 {
            return crate::remote::FIRST_HOST.to_string();
        }
        self.dir
            .peers()
            .ok()
            .and_then(|ps| ps.into_iter().find(|p| p.slot == slot).map(|p| p.host))
            .unwrap_or_else(|| format!("in slot {slot:02x}"))
    }

    /// The volumes this host released that their new host's root now holds: deleted here
    /// (the second half of a move, at a sync). The number deleted.
    fn finish_moves(&self, peers: &BTreeMap<u8, Arc<Pool>>) -> Result<u64> {
        let released: Vec<(String, Option<u8>, Option<u32>)> = {
            let st = lock(&self.state);
            st.md
                .meta
                .range(RELEASED_PREFIX.to_string()..)
                .take_while(|(k, _)| k.starts_with(RELEASED_PREFIX))
                .map(|(k, _)| {
                    let name = k[RELEASED_PREFIX.len()..].to_string();
                    let slot = released_slot(&st.md.meta, &name);
                    let turn = released_turn(&st.md.meta, &name);
                    (name, slot, turn)
                })
                .collect()
        };
        let mut done = 0;
        for (name, slot, turn) in released {
            // Adopted: the new host's root records the adoption of this hand-over (its turn),
            // whether or not it still holds the volume (it may have deleted or moved it on
            // since); a record without a turn (an older binary's) counts only while the
            // volume is there, as an adoption of an earlier hand-over of the name may have
            // left it.
            let adopted = slot.and_then(|s| peers.get(&s)).is_some_and(|p| {
                let st = lock(&p.state);
                let key = format!("{ADOPTED_PREFIX}{:02x}/{name}", self.slot);
                match crate::format::hosts::adopted_turn(&st.md.meta, self.slot, &name) {
                    Some(t) => turn == Some(t),
                    None => st.md.meta.contains_key(&key) && st.md.names.contains_key(&name),
                }
            });
            if !adopted {
                continue;
            }
            match self.delete_volume(&name) {
                Ok(()) | Err(Error::NotFound(_)) => {}
                Err(e) => return Err(e),
            }
            self.meta_put(&format!("{RELEASED_PREFIX}{name}"), None)?;
            done += 1;
        }
        Ok(done)
    }
}

/// What [`Pool::clone_from_host`] did.
#[derive(Clone, Debug, Default)]
pub struct CloneReport {
    /// The host whose volume was cloned, and its slot.
    pub host: String,
    pub slot: u8,
    /// Blocks of the new volume that name a chunk.
    pub data_blocks: u64,
    /// Chunks this host did not know yet (now pointing at their records where they are).
    pub chunks_added: u64,
}

/// Blocks of a volume cloned from another host per hold of the state lock.
const CLONE_BLOCKS: u64 = 8192;

impl Pool {
    /// Make volume `new` in this host's part with the content of `source` (a volume, or a
    /// snapshot `VOL@SNAP`) of host `host`'s part, as that host's newest root has it. No data
    /// moves: every block names the record the source's block names (found by fingerprint
    /// among this host's chunks, or added as a chunk pointing at it), so the clone costs
    /// reads of that host's metadata only. Durable on return. Resumable: a clone that stopped
    /// half way (`hosts/pending/NEW`) is made whole by running it again, or by the next
    /// [`Pool::sync_hosts`].
    pub fn clone_from_host(&self, host: &str, source: &str, new: &str) -> Result<CloneReport> {
        crate::pool::check_new_volume_name(new)?;
        // No fold meanwhile: condemnations seen here are the ones this clone checks.
        let _one_gc = lock(&self.gc_lock);
        self.writable(&lock(&self.state))?;
        let peers = self.attach_peers()?;
        let from = peers
            .iter()
            .find(|(p, _)| p.answers_to(host))
            .map_or(self.slot, |(p, _)| p.slot);
        let pending = Pending {
            op: "clone".into(),
            from,
            source: source.into(),
            turn: 0,
        };
        let report = self.clone_or_resume(&peers, host, new, &pending)?;
        self.handover_point(STEP_FILLED)?;
        self.complete_pending(new, Vec::new())?;
        Ok(report)
    }

    /// Make volume `new` as `pending` says (a clone of `pending.source` on host `host`), or,
    /// if an earlier run of the same hand-over stopped half way, make its half-made volume
    /// whole (every block mapped again: idempotent). The caller holds `gc_lock` and removes
    /// the pending record once the hand-over is complete ([`Pool::complete_pending`]).
    fn clone_or_resume(
        &self,
        peers: &[(Peer, Result<Arc<Pool>>)],
        host: &str,
        new: &str,
        pending: &Pending,
    ) -> Result<CloneReport> {
        let (p, peer, condemned) = self.source_host(peers, host)?;
        if let Some(f) = self.forgotten_hosts().get(&p.slot).filter(|f| f.reclaim) {
            return Err(Error::Invalid(format!(
                "host {host} ({}) was forgotten and its part's space is being reclaimed: nothing of it can be cloned any more",
                f.host
            )));
        }
        let source = pending.source.as_str();
        let src = peer.volume_id(source).map_err(|_| {
            Error::NotFound(format!(
                "{source} on host {host} (as its newest root has it: a volume written there since its last checkpoint is not visible yet; `condense hosts sync` on that host publishes it)"
            ))
        })?;
        let size = peer.volume_size(src, source)?;
        let mut report = CloneReport {
            host: p.host.clone(),
            slot: p.slot,
            ..CloneReport::default()
        };
        let half_made = lock(&self.state).md.meta.get(&Pending::key(new)).cloned();
        if let Some(v) = half_made {
            let Some(was) = Pending::decode(&v).filter(|w| {
                w.op == pending.op && w.from == pending.from && w.source == pending.source
            }) else {
                return Err(Error::Invalid(format!(
                    "volume {new:?} is half made by another hand-over ({}): finish that one (`condense hosts` names it), or delete the volume",
                    String::from_utf8_lossy(&v).replace('\n', " ").trim()
                )));
            };
            let mine = self.volume_id(new)?;
            if self.volume_size(mine, new)? != size {
                return Err(Error::Invalid(format!(
                    "volume {new:?} is half made from {source} on host {host}, whose size changed since: delete it (`condense volume delete {new}`) and run the {} again",
                    was.op
                )));
            }
            self.fill_clone(&peer, src, (source, host), new, &condemned, &mut report)?;
            return Ok(report);
        }
        let mark = JournalRecord::MetaPut {
            key: Pending::key(new),
            value: Some(pending.encode()),
        };
        self.create_volume_with(new, size, pending.turn, vec![mark])?;
        self.handover_point(STEP_CREATED)?;
        let cloned = self.fill_clone(&peer, src, (source, host), new, &condemned, &mut report);
        if let Err(e) = cloned {
            if self.handover_stopped() {
                return Err(e); // a simulated kill leaves everything as it is
            }
            // Half a clone is no clone: it goes (its chunks return to GC).
            if let Err(d) = self.delete_volume(new) {
                tracing::warn!("clone {new} failed ({e}) and could not be removed: {d}");
            }
            return Err(e);
        }
        Ok(report)
    }

    /// The host `host` names among `peers` (just opened), its part, and every part's
    /// condemned segments.
    #[allow(clippy::type_complexity)]
    fn source_host(
        &self,
        peers: &[(Peer, Result<Arc<Pool>>)],
        host: &str,
    ) -> Result<(Peer, Arc<Pool>, HashMap<u8, BTreeSet<u32>>)> {
        let known: Vec<String> = peers.iter().map(|(p, _)| p.host.clone()).collect();
        let mut condemned: HashMap<u8, BTreeSet<u32>> = HashMap::new();
        let mut found = None;
        for (p, opened) in peers {
            let Ok(pool) = opened else { continue };
            condemned.insert(
                p.slot,
                Condemned::read(&lock(&pool.state).md.meta)
                    .segs
                    .into_keys()
                    .collect(),
            );
            if p.answers_to(host) {
                found = Some((p.clone(), pool.clone()));
            }
        }
        let Some((p, peer)) = found else {
            if let Some((_, Err(e))) = peers.iter().find(|(p, _)| p.answers_to(host)) {
                return Err(Error::Invalid(format!("host {host}: {e}")));
            }
            return Err(Error::NotFound(format!(
                "host {host} (the other hosts of this pool: {})",
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            )));
        };
        Ok((p, peer, condemned))
    }

    /// The hand-over that made volume `name` is complete: its pending record goes, with
    /// `extra` records in the same commit; durable on return.
    fn complete_pending(&self, name: &str, mut extra: Vec<JournalRecord>) -> Result<()> {
        extra.push(JournalRecord::MetaPut {
            key: Pending::key(name),
            value: None,
        });
        {
            let mut st = lock(&self.state);
            self.writable(&st)?;
            self.commit(&mut st, extra)?;
        }
        self.flush()
    }

    /// [`Pool::clone_from_host`] after the new volume was made: its blocks, in batches.
    fn fill_clone(
        &self,
        peer: &Pool,
        src: u32,
        (source, host): (&str, &str),
        new: &str,
        condemned: &HashMap<u8, BTreeSet<u32>>,
        report: &mut CloneReport,
    ) -> Result<()> {
        let vol = self.volume_id(new)?;
        let size = self.volume_size(vol, new)?;
        let blocks = size.div_ceil(u64::from(self.sb.block_size));
        let mut first = 0;
        while first < blocks {
            let n = CLONE_BLOCKS.min(blocks - first);
            // The source's entries and, for each chunk, its fingerprint and record.
            let mut entries = Vec::with_capacity(n as usize);
            let mut chunks = HashMap::new();
            {
                let mut st = lock(&peer.state);
                let md = &mut st.md;
                crate::block_map::get_range(&mut md.pages, u64::from(src), first, n, &mut entries)?;
                for &e in &entries {
                    if e == crate::format::ENTRY_LOST {
                        return Err(Error::Invalid(format!(
                            "{source} on host {host} has lost blocks (`condense repair` gave them up): clone it on that host, or write those blocks first"
                        )));
                    }
                    if e < crate::format::CHUNK_ID_LIMIT && !chunks.contains_key(&e) {
                        let c = md.chunks.get(&mut md.pages, e)?.ok_or_else(|| {
                            Error::corrupt(
                                format!("{source} on host {host}"),
                                format!("chunk {e} does not exist (damaged metadata)"),
                            )
                        })?;
                        chunks.insert(e, c);
                    }
                }
            }
            let mut st = lock(&self.state);
            let mut records = Vec::new();
            let mut ids: HashMap<u64, u64> = HashMap::new();
            for (&theirs, c) in &chunks {
                let owner = segment_slot(c.loc.segment);
                let id = match st.md.find_duplicate(&c.fp) {
                    Some(id) => id,
                    None => {
                        let readable = owner != self.slot
                            && st.segments.file(c.loc.segment).is_some()
                            && !condemned
                                .get(&owner)
                                .is_some_and(|s| s.contains(&c.loc.segment));
                        if !readable {
                            return Err(Error::Invalid(format!(
                                "{source} on host {host}: segment {:08x} of a block is being collected; run `condense hosts sync` on host {host}, then clone again (if host {host} was forgotten, a segment of another host it named may be deleted for good: its volume cannot be made whole here)",
                                c.loc.segment
                            )));
                        }
                        let id = st.md.chunks.allocate_id().ok_or_else(|| {
                            Error::Invalid("the chunk table has no id left".into())
                        })?;
                        records.push(JournalRecord::NewChunk {
                            id,
                            loc: c.loc,
                            fp: c.fp,
                        });
                        report.chunks_added += 1;
                        id
                    }
                };
                ids.insert(theirs, id);
            }
            let mapped: Vec<u64> = entries
                .iter()
                .map(|e| ids.get(e).copied().unwrap_or(*e))
                .collect();
            report.data_blocks += entries
                .iter()
                .filter(|e| **e < crate::format::CHUNK_ID_LIMIT)
                .count() as u64;
            records.push(JournalRecord::MapRun {
                vol,
                start: first,
                entries: mapped,
            });
            self.commit(&mut st, records)?;
            drop(st);
            first += n;
            self.handover_point(STEP_FIRST_BATCH)?;
        }
        self.flush()
    }
}

/// The steps of a hand-over at which a test can stop it as a kill would
/// ([`Pool::stop_handovers_at`]): a move's release recorded but not published; an adopt's or
/// clone's claim put, its volume made, its first batch of blocks mapped, every block mapped,
/// and the adopt recorded but not published.
pub const STEP_RELEASED: u32 = 1;
pub const STEP_CLAIMED: u32 = 2;
pub const STEP_CREATED: u32 = 3;
pub const STEP_FIRST_BATCH: u32 = 4;
pub const STEP_FILLED: u32 = 5;
pub const STEP_COMPLETED: u32 = 6;
/// `handover_stop` once a stop was hit: every later step stops too.
const STOPPED: u32 = u32::MAX;

impl Pool {
    /// Tests only: stop this open's next hand-over at `step` (one of the `STEP_` constants)
    /// as a kill would: the command fails there, and nothing after that step runs (no
    /// clean-up either). The test then closes the pool and runs the command again.
    #[doc(hidden)]
    pub fn stop_handovers_at(&self, step: u32) {
        self.handover_stop
            .store(step, std::sync::atomic::Ordering::Relaxed);
    }

    /// A step of a hand-over: fails if a test stops it here (or stopped it before).
    pub(crate) fn handover_point(&self, step: u32) -> Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        let at = self.handover_stop.load(Relaxed);
        if at != 0 && (at == step || at == STOPPED) {
            self.handover_stop.store(STOPPED, Relaxed);
            return Err(Error::Invalid(format!(
                "hand-over stopped at step {step} (a test's simulated kill)"
            )));
        }
        Ok(())
    }

    fn handover_stopped(&self) -> bool {
        self.handover_stop
            .load(std::sync::atomic::Ordering::Relaxed)
            == STOPPED
    }

    /// The hosts forgotten (`condense hosts forget`), as this host's root and the newest
    /// roots of the other hosts it read last record it: a forget recorded by any host is
    /// honoured by every host.
    pub fn forgotten_hosts(&self) -> BTreeMap<u8, Forgotten> {
        let mut all = Forgotten::all(&lock(&self.state).md.meta);
        let peers: Vec<Arc<Pool>> = lock(&self.peers).values().cloned().collect();
        for p in peers {
            for (slot, f) in Forgotten::all(&lock(&p.state).md.meta) {
                let e = all.entry(slot).or_insert_with(|| f.clone());
                e.reclaim |= f.reclaim;
                e.reclaimed |= f.reclaimed;
            }
        }
        all
    }

    /// The highest turn of the other hosts' claims of `name` (`None`: none, or a pool of one
    /// host): a re-run of an adopt reuses this host's own claim above them.
    fn claim_turns(&self, name: &str) -> Result<Option<u32>> {
        let Some(reg) = self.dir.volume_claims() else {
            return Ok(None);
        };
        let claims = reg
            .list(Some(name))
            .map_err(|e| Error::io(format!("listing the claims of volume {name}"), e))?;
        Ok(claims
            .iter()
            .filter(|c| c.slot != self.slot)
            .map(|c| c.turn)
            .max())
    }

    /// After claiming `name` without a hand-over naming this slot (an adopt from a forgotten
    /// host): wait for a racing claim to show and check that this host's claim wins; if not,
    /// the half-made volume goes and the name is refused.
    fn confirm_claim(&self, name: &str) -> Result<()> {
        let Some(reg) = self.dir.volume_claims() else {
            return Ok(());
        };
        std::thread::sleep(std::time::Duration::from_secs(1));
        let claims = reg
            .list(Some(name))
            .map_err(|e| Error::io(format!("listing the claims of volume {name}"), e))?;
        let Some(w) = crate::format::hosts::VolumeClaim::winner(&claims) else {
            return Ok(());
        };
        if w.slot == self.slot {
            return Ok(());
        }
        let host = self.host_name_of(w.slot);
        if let Err(e) = self.delete_volume(name) {
            tracing::warn!("volume {name}: its copy here lost the claim to host {host} and could not be removed: {e}");
        }
        Err(Error::HeldByHost {
            volume: name.into(),
            host,
            detail: " (both hosts adopted it at once; the claim rule chose)".into(),
        })
    }

    /// At a sync: finish this host's hand-overs that stopped half way (each `hosts/pending/`
    /// record): an adopt or a clone made whole from its source; a clone whose source is gone
    /// is removed. The caller holds `gc_lock`.
    fn finish_handovers(
        &self,
        peers: &[(Peer, Result<Arc<Pool>>)],
        forgotten: &BTreeMap<u8, Forgotten>,
        report: &mut HostsReport,
    ) {
        let pending = Pending::all(&lock(&self.state).md.meta);
        for (name, p) in pending {
            let Some(p) = p else {
                report.handovers_unfinished.push((
                    name,
                    "its hosts/pending record does not parse: delete the volume".into(),
                ));
                continue;
            };
            let from = format!("{:02x}", p.from);
            let done = if p.op == "adopt" {
                self.adopt_locked(peers, &name, &from).map(|_| ())
            } else {
                match self.clone_or_resume(peers, &from, &name, &p) {
                    Ok(_) => self.complete_pending(&name, Vec::new()),
                    Err(Error::NotFound(why)) if !forgotten.contains_key(&p.from) => {
                        tracing::warn!(
                            "clone {name} stopped half way and its source is gone ({why}): removed"
                        );
                        self.delete_volume(&name)
                    }
                    Err(e) => Err(e),
                }
            };
            match done {
                Ok(()) => {
                    tracing::info!(
                        "hosts: the {} of volume {name} that had stopped half way is finished",
                        p.op
                    );
                    report.handovers_finished.push(name);
                }
                Err(e) => {
                    tracing::warn!("hosts: the {} of volume {name} stopped half way and cannot be finished now: {e}", p.op);
                    report.handovers_unfinished.push((name, e.to_string()));
                }
            }
        }
    }
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
            match pool.sync_hosts() {
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
