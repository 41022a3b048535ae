//! A host gone for good, forgotten (`condense hosts forget`, docs/S3.md "Forgetting a host"),
//! and the checks of volume names across parts at every sync (docs/S3.md "Volume claims").
//!
//! Owns: the records `hosts/forgotten/SS` (a forget, in the root of the host that ran it) and
//! `hosts/forgot/SS` (a host's acknowledgement of a forget with reclaim), the reclaim of a
//! forgotten part's segments, and `hosts/conflict/NAME` (a name another part holds too, whose
//! claim lost: writes to it refused here).
//!
//! The protocol, for a forgotten host F:
//! - **Forget.** Host X records `hosts/forgotten/F` in its root. Every host honours a forget
//!   found in its own root or in any other host's newest root: F's acknowledgements of
//!   condemned segments are no longer awaited (the sweep leaves F out), F's new chunks are no
//!   longer folded, and F's volumes may be adopted without a hand-over (as F's newest root
//!   has them, claimed one turn above every claim of the name).
//! - **Reclaim** (`--reclaim`, the forget's `reclaim=1`): every host that sees it stops
//!   adopting and cloning from F, drops its chunks with no reference that name F's segments,
//!   and records `hosts/forgot/F` (its acknowledgement: from that root on it adds no chunk
//!   that names F's part). Once every other host's newest root acknowledges, and F's part
//!   lease is not held, X deletes each of F's segments that no chunk of any host names (in
//!   X's chunk table now, or in another host's newest root), once.
//!
//! Invariants:
//! - Nothing another host names is deleted: a chunk naming F's segment S is in a root that
//!   X reads before deleting S (the acknowledging root, or a later one), because a host adds
//!   no such chunk after its acknowledgement, and X's own adopts run under its `gc_lock` as
//!   the reclaim does.
//! - A forgotten host that comes back refuses to sync (its volumes may be written elsewhere);
//!   the forget is refused while its lease is alive unless forced.
//! - Of two parts holding one volume name, the claim rule (highest turn, then lowest slot,
//!   then lowest writer; no claim: the lower slot) names the one that keeps writing; the
//!   other refuses the volume's writes until one copy is deleted or renamed.

use crate::error::{Error, Result};
use crate::format::hosts::{
    forgets_acked, released_slot, with_prefix, Forgotten, Pending, VolumeClaim, ADOPTED_PREFIX,
    CONFLICT_PREFIX, FORGOT_ACK_PREFIX, RELEASED_PREFIX,
};
use crate::format::{segment_name, segment_slot, JournalRecord, CHUNKS_PER_PAGE};
use crate::hosts::HostsReport;
use crate::io::Peer;
use crate::locks::lock;
use crate::pool::Pool;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// Chunk-table pages scanned per hold of the state lock.
const SCAN_PAGES: u64 = 64;

/// What [`Pool::forget_host`] did.
#[derive(Clone, Debug, Default)]
pub struct ForgetReport {
    pub slot: u8,
    pub host: String,
    /// Its part's lease when it was forgotten (`None`: none found).
    pub lease: Option<crate::remote::LeaseBody>,
    /// Its lease was alive, and `--force` forgot it anyway.
    pub forced: bool,
    /// Its part's space is to be reclaimed.
    pub reclaim: bool,
    /// It was forgotten before (this run changed at most `reclaim`).
    pub already: bool,
    /// Its volumes as its newest root has them (adoptable until the reclaim).
    pub volumes: Vec<String>,
}

/// A volume name this host's part holds that another host's part holds too.
#[derive(Clone, Debug, Default)]
pub struct NameConflict {
    pub volume: String,
    pub other_slot: u8,
    pub other_host: String,
    /// The slot the claim rule gives the name to.
    pub winner_slot: u8,
    /// This host lost: its writes to the volume are refused.
    pub refused_here: bool,
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Pool {
    /// Forget host `host` (its name or slot), gone for good (see the module docs). Refused
    /// while its part's lease is alive unless `force`. With `reclaim`, its part's space is
    /// reclaimed once every other host acknowledged (its volumes not adopted by then are
    /// given up); run again with `reclaim` after adopting what is wanted. Durable on return.
    pub fn forget_host(&self, host: &str, force: bool, reclaim: bool) -> Result<ForgetReport> {
        self.writable(&lock(&self.state))?;
        let peer = self.peer_named(host)?;
        let lease = crate::remote::part_lease(&peer.local).map_err(|e| {
            Error::Invalid(format!(
                "reading the lease of host {} ({}): {e}; nothing was forgotten",
                peer.host, peer.url
            ))
        })?;
        let now = unix_now();
        let alive = lease.clone().filter(|l| l.expires != 0 && l.expires > now);
        if let (Some(l), false) = (&alive, force) {
            return Err(Error::Busy(format!(
                "host {} holds its part's lease ({} pid {}, renewed {} s ago, expires in {} s): it is alive, or died less than {} s ago. Wait for the lease to expire and run this again; `--force` forgets it anyway, and then two hosts may write its volumes if it is still running (it refuses to sync once it sees the forget, but writes until then)",
                peer.host,
                l.host,
                l.pid,
                now.saturating_sub(l.renewed),
                l.expires - now,
                crate::remote::LEASE_SECONDS
            )));
        }
        self.attach_peers()?;
        let mut volumes: Vec<String> = lock(&self.peers)
            .get(&peer.slot)
            .map(|p| {
                lock(&p.state)
                    .md
                    .names
                    .keys()
                    .filter(|n| !n.contains('@'))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        volumes.sort();
        let key = Forgotten::key(peer.slot);
        let before = lock(&self.state)
            .md
            .meta
            .get(&key)
            .map(|v| Forgotten::decode(v));
        let record = Forgotten {
            host: peer.host.clone(),
            at_unix: before.as_ref().map_or(now, |b| b.at_unix),
            reclaim: reclaim || before.as_ref().is_some_and(|b| b.reclaim),
            reclaimed: before.as_ref().is_some_and(|b| b.reclaimed),
        };
        if before.as_ref() != Some(&record) {
            self.meta_put(&key, Some(&record.encode()))?;
        }
        let sync = lock(&self.sync_lock);
        self.checkpoint_locked(&sync)?;
        drop(sync);
        tracing::warn!(
            "host {} (slot {:02x}) forgotten{}{}",
            peer.host,
            peer.slot,
            if alive.is_some() {
                " while its lease was alive (--force)"
            } else {
                ""
            },
            if record.reclaim {
                "; its part's space is reclaimed once every host acknowledged"
            } else {
                ""
            }
        );
        Ok(ForgetReport {
            slot: peer.slot,
            host: peer.host,
            lease,
            forced: alive.is_some(),
            reclaim: record.reclaim,
            already: before.is_some(),
            volumes,
        })
    }

    /// At a sync, for every forget with reclaim not acknowledged here yet: drop this host's
    /// chunks with no reference that name the forgotten part, then record the
    /// acknowledgement (published by the sync's checkpoint). The caller holds `gc_lock`.
    pub(crate) fn ack_forgets(&self, forgotten: &BTreeMap<u8, Forgotten>) -> Result<()> {
        let acked = forgets_acked(&lock(&self.state).md.meta);
        for (&slot, f) in forgotten {
            if !f.reclaim || acked.contains(&slot) || slot == self.slot {
                continue;
            }
            let per = CHUNKS_PER_PAGE as u64;
            let mut page = 0;
            let mut dropped = 0u64;
            loop {
                let mut st = lock(&self.state);
                if page * per >= st.md.chunks.next_id {
                    break;
                }
                let mut records = Vec::new();
                let md = &mut st.md;
                md.chunks
                    .for_each_in(&mut md.pages, page, page + SCAN_PAGES, &mut |id, e| {
                        if e.refs == 0 && segment_slot(e.loc.segment) == slot {
                            records.push(JournalRecord::DropChunk { id });
                        }
                        Ok(())
                    })?;
                dropped += records.len() as u64;
                if !records.is_empty() {
                    self.commit(&mut st, records)?;
                }
                page += SCAN_PAGES;
            }
            let mut st = lock(&self.state);
            self.commit(
                &mut st,
                vec![JournalRecord::MetaPut {
                    key: format!("{FORGOT_ACK_PREFIX}{slot:02x}"),
                    value: Some(format!("dropped={dropped}\n").into_bytes()),
                }],
            )?;
            tracing::info!(
                "hosts: forget of host {} (slot {slot:02x}) acknowledged: {dropped} chunks naming its part dropped",
                f.host
            );
        }
        Ok(())
    }

    /// The segments of slot `slot` that chunks of `pool`'s chunk table name (any chunk, with
    /// references or not).
    fn segments_named(pool: &Pool, slot: u8, out: &mut BTreeSet<u32>) -> Result<()> {
        let per = CHUNKS_PER_PAGE as u64;
        let mut page = 0;
        loop {
            let mut st = lock(&pool.state);
            if page * per >= st.md.chunks.next_id {
                return Ok(());
            }
            let md = &mut st.md;
            md.chunks
                .for_each_in(&mut md.pages, page, page + SCAN_PAGES, &mut |_, e| {
                    if segment_slot(e.loc.segment) == slot {
                        out.insert(e.loc.segment);
                    }
                    Ok(())
                })?;
            page += SCAN_PAGES;
        }
    }

    /// At a sync, after its checkpoint: reclaim the parts of the hosts this host forgot with
    /// reclaim, once every other host acknowledged (see the module docs). The caller holds
    /// `gc_lock`.
    pub(crate) fn reclaim_forgotten(
        &self,
        peers: &[(Peer, Result<Arc<Pool>>)],
        forgotten: &BTreeMap<u8, Forgotten>,
        report: &mut HostsReport,
    ) -> Result<()> {
        let mine = Forgotten::all(&lock(&self.state).md.meta);
        for (slot, f) in mine {
            if !f.reclaim || f.reclaimed {
                continue;
            }
            let Some((peer, Ok(part))) = peers.iter().find(|(p, _)| p.slot == slot) else {
                report
                    .reclaim_waiting
                    .push(format!("host {}: its part cannot be read", f.host));
                continue;
            };
            let mut waiting = None;
            for (p, opened) in peers {
                if forgotten.contains_key(&p.slot) {
                    continue;
                }
                match opened {
                    Ok(o) if forgets_acked(&lock(&o.state).md.meta).contains(&slot) => {}
                    Ok(_) => {
                        waiting = Some(format!(
                            "host {}: host {} has not acknowledged the forget yet (its next `condense hosts sync` does)",
                            f.host, p.host
                        ))
                    }
                    Err(e) => {
                        waiting = Some(format!(
                            "host {}: host {} cannot be read ({e})",
                            f.host, p.host
                        ))
                    }
                }
            }
            let now = unix_now();
            match crate::remote::part_lease(&peer.local) {
                Ok(Some(l)) if l.expires != 0 && l.expires > now => {
                    waiting = Some(format!(
                        "host {}: its part's lease is held ({} pid {}, expires in {} s)",
                        f.host,
                        l.host,
                        l.pid,
                        l.expires - now
                    ))
                }
                Ok(_) => {}
                Err(e) => waiting = Some(format!("host {}: its lease: {e}", f.host)),
            }
            if let Some(w) = waiting {
                report.reclaim_waiting.push(w);
                continue;
            }
            let mut named = BTreeSet::new();
            Pool::segments_named(self, slot, &mut named)?;
            for (p, opened) in peers {
                if let (false, Ok(o)) = (forgotten.contains_key(&p.slot), opened) {
                    Pool::segments_named(o, slot, &mut named)?;
                }
            }
            let doomed: BTreeSet<String> = part
                .uploaded_segments()
                .into_iter()
                .map(|(id, _)| id)
                .filter(|id| segment_slot(*id) == slot && !named.contains(id))
                .map(segment_name)
                .collect();
            let (files, bytes) = crate::remote::delete_part_files(&peer.local, &doomed)?;
            report.reclaimed_segments += files;
            report.reclaimed_bytes += bytes;
            tracing::warn!(
                "hosts: forgotten host {}: {files} segments ({bytes} bytes) of its part deleted, {} kept (other hosts name them)",
                f.host,
                named.len()
            );
            let done = Forgotten {
                reclaimed: true,
                ..f
            };
            self.meta_put(&Forgotten::key(slot), Some(&done.encode()))?;
        }
        Ok(())
    }

    /// At a sync: the volume names this host's part holds that another (not forgotten)
    /// host's part holds too, outside a move between the two. Each is logged; where the
    /// claim rule gives the name to the other host, `hosts/conflict/NAME` refuses the
    /// volume's writes here. Records of conflicts that are gone are removed.
    pub(crate) fn check_volume_names(
        &self,
        peers: &BTreeMap<u8, Arc<Pool>>,
        forgotten: &BTreeMap<u8, Forgotten>,
    ) -> Result<Vec<NameConflict>> {
        let (mine, recorded, adopted) = {
            let st = lock(&self.state);
            let adopted: BTreeSet<String> = with_prefix(&st.md.meta, ADOPTED_PREFIX)
                .map(|(k, _)| k.to_string())
                .collect();
            let mine: Vec<String> = st
                .md
                .names
                .keys()
                .filter(|n| !n.contains('@'))
                .filter(|n| released_slot(&st.md.meta, n).is_none())
                .cloned()
                .collect();
            let recorded: BTreeSet<String> = with_prefix(&st.md.meta, CONFLICT_PREFIX)
                .map(|(n, _)| n.to_string())
                .collect();
            (mine, recorded, adopted)
        };
        let mut found: Vec<NameConflict> = Vec::new();
        for (&slot, p) in peers {
            if forgotten.contains_key(&slot) {
                continue;
            }
            let both: Vec<String> = {
                let st = lock(&p.state);
                mine.iter()
                    .filter(|n| st.md.names.contains_key(*n))
                    // a hand-over to this host, not adopted yet
                    .filter(|n| released_slot(&st.md.meta, n) != Some(self.slot))
                    // this host adopted it from there, and that host deletes its copy
                    .filter(|n| {
                        !adopted.contains(&format!("{slot:02x}/{n}"))
                            || !st.md.meta.contains_key(&format!("{RELEASED_PREFIX}{n}"))
                    })
                    .cloned()
                    .collect()
            };
            for name in both {
                let claims: Vec<VolumeClaim> = match self.dir.volume_claims() {
                    Some(reg) => reg.list(Some(&name)).map_err(|e| {
                        Error::io(format!("listing the claims of volume {name}"), e)
                    })?,
                    None => Vec::new(),
                };
                let of_two: Vec<VolumeClaim> = claims
                    .into_iter()
                    .filter(|c| c.slot == slot || c.slot == self.slot)
                    .collect();
                let winner_slot =
                    VolumeClaim::winner(&of_two).map_or(slot.min(self.slot), |w| w.slot);
                let other_host = self.host_name_of(slot);
                let refused_here = winner_slot != self.slot;
                if refused_here {
                    tracing::error!(
                        "volume {name} is held by host {other_host} (slot {slot:02x}) too: two hosts hold one name. The claim rule gives it to {other_host}; its writes are refused here until one copy is deleted or renamed"
                    );
                } else {
                    tracing::error!(
                        "volume {name} is held by host {other_host} (slot {slot:02x}) too: two hosts hold one name. The claim rule gives it to this host; host {other_host} refuses its writes at its next sync"
                    );
                }
                found.push(NameConflict {
                    volume: name,
                    other_slot: slot,
                    other_host,
                    winner_slot,
                    refused_here,
                });
            }
        }
        let mut records = Vec::new();
        for c in found.iter().filter(|c| c.refused_here) {
            if !recorded.contains(&c.volume) {
                records.push(JournalRecord::MetaPut {
                    key: format!("{CONFLICT_PREFIX}{}", c.volume),
                    value: Some(
                        format!("winner={:02x}\nhost={}\n", c.winner_slot, c.other_host)
                            .into_bytes(),
                    ),
                });
            }
        }
        for name in &recorded {
            if !found.iter().any(|c| c.refused_here && &c.volume == name) {
                records.push(JournalRecord::MetaPut {
                    key: format!("{CONFLICT_PREFIX}{name}"),
                    value: None,
                });
            }
        }
        if !records.is_empty() {
            let mut st = lock(&self.state);
            self.commit(&mut st, records)?;
        }
        Ok(found)
    }

    /// (hand-overs of this host not finished, volume names this host lost to another host's
    /// part) from its metadata alone: no request to the store (metrics read it at every
    /// scrape). Unfinished: half-made volumes (`hosts/pending/`) and volumes handed over
    /// that are still here (`hosts/released/`).
    pub fn hand_over_counts(&self) -> (u64, u64) {
        let st = lock(&self.state);
        let pending = Pending::all(&st.md.meta).len() as u64;
        let released = with_prefix(&st.md.meta, RELEASED_PREFIX)
            .filter(|(name, _)| st.md.names.contains_key(*name))
            .count() as u64;
        let conflicts = with_prefix(&st.md.meta, CONFLICT_PREFIX).count() as u64;
        (pending + released, conflicts)
    }

    /// Hand-overs of this host not finished, and names in conflict, as its metadata and the
    /// other hosts' newest roots it read last have them (for `condense hosts` and `stats`).
    pub fn hand_over_notes(&self) -> Vec<String> {
        // Read under the locks; host names (a LIST of the registry) asked after.
        let (pending, released, conflicts, held) = {
            let st = lock(&self.state);
            let pending = Pending::all(&st.md.meta);
            let released: Vec<(String, Option<u8>)> = with_prefix(&st.md.meta, RELEASED_PREFIX)
                .filter(|(name, _)| st.md.names.contains_key(*name))
                .map(|(name, _)| (name.to_string(), released_slot(&st.md.meta, name)))
                .collect();
            let conflicts: Vec<(String, String)> = with_prefix(&st.md.meta, CONFLICT_PREFIX)
                .map(|(name, v)| {
                    let text = String::from_utf8_lossy(v);
                    let host = text
                        .lines()
                        .find_map(|l| l.strip_prefix("host="))
                        .unwrap_or("another host")
                        .to_string();
                    (name.to_string(), host)
                })
                .collect();
            let held: BTreeSet<String> = st.md.names.keys().cloned().collect();
            (pending, released, conflicts, held)
        };
        let peers: Vec<(u8, Arc<Pool>)> = lock(&self.peers)
            .iter()
            .map(|(s, p)| (*s, p.clone()))
            .collect();
        let mut handed_here: Vec<(String, u8)> = Vec::new();
        for (slot, p) in peers {
            let pst = lock(&p.state);
            for (name, _) in with_prefix(&pst.md.meta, RELEASED_PREFIX) {
                if released_slot(&pst.md.meta, name) == Some(self.slot)
                    && !held.contains(name)
                    && pst.md.names.contains_key(name)
                {
                    handed_here.push((name.to_string(), slot));
                }
            }
        }
        let names: BTreeMap<u8, String> = self
            .dir
            .peers()
            .map(|ps| ps.into_iter().map(|p| (p.slot, p.host)).collect())
            .unwrap_or_default();
        let name_of = |slot: u8| {
            names.get(&slot).cloned().unwrap_or_else(|| {
                if slot == 0 {
                    crate::remote::FIRST_HOST.to_string()
                } else {
                    format!("in slot {slot:02x}")
                }
            })
        };
        let mut notes = Vec::new();
        for (name, p) in pending {
            notes.push(match p {
                Some(p) => format!(
                    "volume {name}: half made ({} of {} from host {}, stopped half way; writes refused): run the command again, or `condense hosts sync`, to finish it",
                    p.op,
                    p.source,
                    name_of(p.from)
                ),
                None => format!("volume {name}: half made by a hand-over whose record does not parse: delete it"),
            });
        }
        for (name, to) in released {
            let to = to.map_or("another host".to_string(), name_of);
            notes.push(format!(
                "volume {name}: handed to host {to}, waiting for its adopt (writes refused here; deleted here at the first sync after it)"
            ));
        }
        for (name, host) in conflicts {
            notes.push(format!(
                "volume {name}: host {host} holds this name too and the claim rule gave it to that host: writes refused here until one copy is deleted or renamed"
            ));
        }
        for (name, slot) in handed_here {
            let from = name_of(slot);
            notes.push(format!(
                "volume {name}: host {from} handed it to this host: `condense volume adopt {name} --from-host {from}` takes it"
            ));
        }
        notes
    }
}
