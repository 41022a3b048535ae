//! A pool several hosts share (docs/S3.md "Many hosts"): the other hosts' trees read, their
//! chunks folded into this host's chunk table (dedup across hosts), and segments that a GC
//! emptied deleted only once every other host let them go.
//!
//! Owns: the peers (the other hosts' trees, open read-only: [`Pool::attach_peers`]), the
//! fold ([`Pool::sync_hosts`]), the condemned segments (`hosts/condemned`) and this host's
//! progress with each peer (`hosts/peer/SS`), both metadata records in the checkpoint root,
//! which is how the other hosts read them.
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
//!   never a loss.
//!
//! Invariants:
//! - A chunk's record is read from another host's segment only while that segment is not
//!   deleted: every host that may name it has acknowledged its condemnation first.
//! - Folded chunks and merges are journaled like any other change (`NewChunk`, `Relocate`);
//!   replay trusts another host's record without reading it (it was in the bucket, named by
//!   that host's root, before the journal named it).

use crate::error::{Error, Result};
use crate::format::{segment_slot, JournalRecord, CHUNKS_PER_PAGE};
use crate::gc::GcReport;
use crate::io::{File, Peer};
use crate::locks::lock;
use crate::metadata::Metadata;
use crate::page_cache::CHUNK_TREE;
use crate::pool::Pool;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, MutexGuard};

/// The metadata record of this host's condemned segments.
const CONDEMNED_KEY: &str = "hosts/condemned";
/// The metadata record of this host's progress with the peer in slot `SS`: `hosts/peer/SS`.
const PEER_KEY_PREFIX: &str = "hosts/peer/";
/// Chunk-table pages of a peer read per hold of the state lock.
const FOLD_PAGES: u64 = 64;

/// This host's segments condemned by its GC, each with its sequence number, and the next one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Condemned {
    next: u64,
    segs: BTreeMap<u32, u64>,
}

impl Condemned {
    fn read(md: &Metadata) -> Condemned {
        md.meta
            .get(CONDEMNED_KEY)
            .map(|v| Condemned::decode(v))
            .unwrap_or_default()
    }

    /// Text: `next=N`, then a `SEG SEQ` line (decimal) per segment. Lines not understood are
    /// skipped (a damaged record condemns less, which only delays a deletion).
    fn decode(v: &[u8]) -> Condemned {
        let mut c = Condemned::default();
        for line in String::from_utf8_lossy(v).lines() {
            if let Some(n) = line.strip_prefix("next=") {
                c.next = n.parse().unwrap_or(0);
            } else if let Some((seg, seq)) = line.split_once(' ') {
                if let (Ok(seg), Ok(seq)) = (seg.parse(), seq.parse()) {
                    c.segs.insert(seg, seq);
                }
            }
        }
        c.next = c
            .next
            .max(c.segs.values().map(|s| s + 1).max().unwrap_or(0));
        c
    }

    fn encode(&self) -> Vec<u8> {
        let mut s = format!("next={}\n", self.next);
        for (seg, seq) in &self.segs {
            s += &format!("{seg} {seq}\n");
        }
        s.into_bytes()
    }
}

/// The segments this host condemned (not victims of its GC again; not dead space).
pub(crate) fn condemned_in(md: &Metadata) -> BTreeSet<u32> {
    Condemned::read(md).segs.into_keys().collect()
}

/// How far this host has folded a peer in: its chunk ids below `through` are folded, and its
/// condemned segments with a sequence number below `acked` are let go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub through: u64,
    pub acked: u64,
}

impl Progress {
    fn key(slot: u8) -> String {
        format!("{PEER_KEY_PREFIX}{slot:02x}")
    }

    fn read(md: &Metadata, slot: u8) -> Progress {
        let mut p = Progress::default();
        let Some(v) = md.meta.get(&Progress::key(slot)) else {
            return p;
        };
        for line in String::from_utf8_lossy(v).lines() {
            match line.split_once('=') {
                Some(("through", n)) => p.through = n.parse().unwrap_or(0),
                Some(("acked", n)) => p.acked = n.parse().unwrap_or(0),
                _ => {}
            }
        }
        p
    }

    fn record(&self, slot: u8) -> JournalRecord {
        JournalRecord::MetaPut {
            key: Progress::key(slot),
            value: Some(format!("through={}\nacked={}\n", self.through, self.acked).into_bytes()),
        }
    }
}

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
            lock(&self.peers).remove(&peer.slot);
            let opened = Pool::open_peer(&peer.local, self.opts.key.clone()).map_err(|e| {
                Error::Invalid(format!("reading host {} ({}): {e}", peer.host, peer.url))
            });
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
        let mut all_read = true;
        let mut opened = Vec::new();
        for (peer, pool) in peers {
            let mut pr = PeerReport {
                slot: peer.slot,
                host: peer.host.clone(),
                url: peer.url.clone(),
                ..PeerReport::default()
            };
            match pool.and_then(|p| self.fold_peer(&p, peer.slot, &mut pr).map(|()| p)) {
                Ok(p) => opened.push(p),
                Err(e) => {
                    all_read = false;
                    pr.error = Some(e.to_string());
                }
            }
            pr.progress = Progress::read(&lock(&self.state).md, peer.slot);
            report.peers.push(pr);
        }
        let guard = lock(&self.sync_lock);
        if all_read {
            report.segments_deleted = self.sweep(&opened, &guard)?;
        }
        self.checkpoint_locked(&guard)?;
        report.segments_condemned = Condemned::read(&lock(&self.state).md).segs.len() as u64;
        Ok(report)
    }

    /// Fold one peer in: let go of its condemned segments, then fold its new chunks.
    fn fold_peer(&self, peer: &Pool, slot: u8, pr: &mut PeerReport) -> Result<()> {
        let mut progress = Progress::read(&lock(&self.state).md, slot);
        let (condemned, its_progress) = {
            let st = lock(&peer.state);
            (Condemned::read(&st.md), Progress::read(&st.md, self.slot))
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
        // 2. Its chunks added since the last fold.
        let peer_next = lock(&peer.state).md.chunks.next_id;
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
        let mut condemned = Condemned::read(&lock(&self.state).md);
        let free: Vec<u32> = condemned
            .segs
            .iter()
            .filter(|(seg, seq)| {
                peers.iter().all(|p| {
                    let st = lock(&p.state);
                    Progress::read(&st.md, self.slot).acked > **seq
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
        self.commit(
            &mut st,
            vec![JournalRecord::MetaPut {
                key: CONDEMNED_KEY.into(),
                value: Some(condemned.encode()),
            }],
        )?;
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
        let mut c = Condemned::read(&st.md);
        for seg in segs {
            c.segs.insert(*seg, c.next);
        }
        c.next += 1;
        self.commit(
            &mut st,
            vec![JournalRecord::MetaPut {
                key: CONDEMNED_KEY.into(),
                value: Some(c.encode()),
            }],
        )?;
        drop(st);
        self.checkpoint_locked(sync)?;
        Ok(true)
    }

    /// The segments of this (peer's) tree that are in its store: every one but those a
    /// writer still holds in its local directory.
    fn uploaded_segments(&self) -> Vec<(u32, Arc<dyn File>)> {
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
        let per = CHUNKS_PER_PAGE as u64;
        let mut out = Vec::new();
        let mut st = lock(&self.state);
        st.md
            .pages
            .for_each_leaf(CHUNK_TREE, page, page + pages, &mut |pi, data| {
                for i in 0..CHUNKS_PER_PAGE {
                    if let Some(e) = crate::chunk_table::decode_slot(data, i) {
                        out.push((pi * per + i as u64, e));
                    }
                }
                Ok(true)
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
                Some((slot, Progress::read(&st.md, slot)))
            })
            .collect();
        (
            self.slot,
            Condemned::read(&st.md).segs.len() as u64,
            progress,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn condemned_records_round_trip_and_damage_condemns_less() {
        let mut c = Condemned::default();
        c.segs.insert(0x0100_0003, 0);
        c.segs.insert(0x0100_0007, 1);
        c.next = 2;
        assert_eq!(Condemned::decode(&c.encode()), c);
        let mut damaged = c.encode();
        damaged.extend_from_slice(b"garbage\n12 x\n");
        assert_eq!(Condemned::decode(&damaged), c);
        // A lost `next=` line never hands out a sequence number twice.
        assert_eq!(Condemned::decode(b"5 3\n").next, 4);
    }
}
