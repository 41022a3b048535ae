//! A host gone for good, forgotten (`condense hosts forget`, docs/S3.md "Forgetting a host"),
//! and the checks of volume names across parts at every sync (docs/S3.md "Volume claims"):
//! a room of [`super`].
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
    forgets_acked, released_slot, with_prefix, Forgotten, VolumeClaim, ADOPTED_PREFIX,
    CONFLICT_PREFIX, FORGOT_ACK_PREFIX, RELEASED_PREFIX,
};
use crate::format::{segment_name, segment_slot, JournalRecord};
use crate::locks::lock;
use crate::pool::peers::OpenedPeer;
use crate::pool::Pool;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

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

/// What [`reclaim_forgotten`] did: segments of forgotten parts deleted (and their bytes),
/// and why a reclaim waits.
#[derive(Clone, Debug, Default)]
pub(crate) struct Reclaimed {
    pub segments: u64,
    pub bytes: u64,
    pub waiting: Vec<String>,
}

/// Forget host `host` ([`Pool::forget_host`]; see the module docs).
pub(crate) fn forget_host(
    pool: &Pool,
    host: &str,
    force: bool,
    reclaim: bool,
) -> Result<ForgetReport> {
    pool.check_writable()?;
    let peer = pool.peer_named(host)?;
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
    pool.attach_peers()?;
    let mut volumes: Vec<String> = pool
        .peers()
        .get(&peer.slot)
        .map(|p| p.read_records(|r| r.names().filter(|n| !n.contains('@')).cloned().collect()))
        .unwrap_or_default();
    volumes.sort();
    let key = Forgotten::key(peer.slot);
    let before = pool.read_records(|r| r.meta().get(&key).map(|v| Forgotten::decode(v)));
    let record = Forgotten {
        host: peer.host.clone(),
        at_unix: before.as_ref().map_or(now, |b| b.at_unix),
        reclaim: reclaim || before.as_ref().is_some_and(|b| b.reclaim),
        reclaimed: before.as_ref().is_some_and(|b| b.reclaimed),
    };
    if before.as_ref() != Some(&record) {
        pool.meta_put(&key, Some(&record.encode()))?;
    }
    let sync = lock(&pool.sync_lock);
    pool.checkpoint_locked(&sync)?;
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
pub(crate) fn ack_forgets(pool: &Pool, forgotten: &BTreeMap<u8, Forgotten>) -> Result<()> {
    let acked = pool.read_records(|r| forgets_acked(r.meta()));
    for (&slot, f) in forgotten {
        if !f.reclaim || acked.contains(&slot) || slot == pool.slot {
            continue;
        }
        let dropped = pool.drop_unreferenced_chunks_of(slot)?;
        pool.commit_records(vec![JournalRecord::MetaPut {
            key: format!("{FORGOT_ACK_PREFIX}{slot:02x}"),
            value: Some(format!("dropped={dropped}\n").into_bytes()),
        }])?;
        tracing::info!(
            "hosts: forget of host {} (slot {slot:02x}) acknowledged: {dropped} chunks naming its part dropped",
            f.host
        );
    }
    Ok(())
}

/// At a sync, after its checkpoint: reclaim the parts of the hosts this host forgot with
/// reclaim, once every other host acknowledged (see the module docs). The caller holds
/// `gc_lock`.
pub(crate) fn reclaim_forgotten(
    pool: &Pool,
    peers: &[OpenedPeer],
    forgotten: &BTreeMap<u8, Forgotten>,
) -> Result<Reclaimed> {
    let mut done = Reclaimed::default();
    let mine = pool.read_records(|r| Forgotten::all(r.meta()));
    for (slot, f) in mine {
        if !f.reclaim || f.reclaimed {
            continue;
        }
        let Some((peer, Ok(part))) = peers.iter().find(|(p, _)| p.slot == slot) else {
            done.waiting
                .push(format!("host {}: its part cannot be read", f.host));
            continue;
        };
        if let Some(w) = reclaim_waits_for(peers, forgotten, slot, &f.host, &peer.local) {
            done.waiting.push(w);
            continue;
        }
        let mut named = BTreeSet::new();
        pool.segments_named(slot, &mut named)?;
        for (p, opened) in peers {
            if let (false, Ok(o)) = (forgotten.contains_key(&p.slot), opened) {
                o.segments_named(slot, &mut named)?;
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
        done.segments += files;
        done.bytes += bytes;
        tracing::warn!(
            "hosts: forgotten host {}: {files} segments ({bytes} bytes) of its part deleted, {} kept (other hosts name them)",
            f.host,
            named.len()
        );
        let reclaimed = Forgotten {
            reclaimed: true,
            ..f
        };
        pool.meta_put(&Forgotten::key(slot), Some(&reclaimed.encode()))?;
    }
    Ok(done)
}

/// Why the reclaim of forgotten host `host`'s part (in `slot`, its local directory `local`)
/// waits, if it does: a host not forgotten that has not acknowledged the forget or cannot be
/// read, or the part's lease held.
fn reclaim_waits_for(
    peers: &[OpenedPeer],
    forgotten: &BTreeMap<u8, Forgotten>,
    slot: u8,
    host: &str,
    local: &std::path::Path,
) -> Option<String> {
    let mut waiting = None;
    for (p, opened) in peers {
        if forgotten.contains_key(&p.slot) {
            continue;
        }
        match opened {
            Ok(o) if o.read_records(|r| forgets_acked(r.meta()).contains(&slot)) => {}
            Ok(_) => {
                waiting = Some(format!(
                    "host {host}: host {} has not acknowledged the forget yet (its next `condense hosts sync` does)",
                    p.host
                ))
            }
            Err(e) => {
                waiting = Some(format!(
                    "host {host}: host {} cannot be read ({e})",
                    p.host
                ))
            }
        }
    }
    let now = unix_now();
    match crate::remote::part_lease(local) {
        Ok(Some(l)) if l.expires != 0 && l.expires > now => {
            waiting = Some(format!(
                "host {host}: its part's lease is held ({} pid {}, expires in {} s)",
                l.host,
                l.pid,
                l.expires - now
            ))
        }
        Ok(_) => {}
        Err(e) => waiting = Some(format!("host {host}: its lease: {e}")),
    }
    waiting
}

/// This host's volume names as a name check compares them: (its volumes not handed away,
/// the conflicts it recorded, the `SS/NAME` of its adoptions).
fn own_names(pool: &Pool) -> (Vec<String>, BTreeSet<String>, BTreeSet<String>) {
    pool.read_records(|r| {
        let meta = r.meta();
        let adopted: BTreeSet<String> = with_prefix(meta, ADOPTED_PREFIX)
            .map(|(k, _)| k.to_string())
            .collect();
        let mine: Vec<String> = r
            .names()
            .filter(|n| !n.contains('@'))
            .filter(|n| released_slot(meta, n).is_none())
            .cloned()
            .collect();
        let recorded: BTreeSet<String> = with_prefix(meta, CONFLICT_PREFIX)
            .map(|(n, _)| n.to_string())
            .collect();
        (mine, recorded, adopted)
    })
}

/// Of `mine`, the names peer `p` (in `slot`) holds too, outside a move between the two.
fn held_by_both(
    pool: &Pool,
    p: &Pool,
    slot: u8,
    mine: &[String],
    adopted: &BTreeSet<String>,
) -> Vec<String> {
    p.read_records(|r| {
        mine.iter()
            .filter(|n| r.has_volume(n))
            // a hand-over to this host, not adopted yet
            .filter(|n| released_slot(r.meta(), n) != Some(pool.slot))
            // this host adopted it from there, and that host deletes its copy
            .filter(|n| {
                !adopted.contains(&format!("{slot:02x}/{n}"))
                    || !r.meta().contains_key(&format!("{RELEASED_PREFIX}{n}"))
            })
            .cloned()
            .collect()
    })
}

/// The conflict of volume `name`, held by this host and the host in `slot`: who the claim
/// rule gives it to (logged).
fn name_conflict(pool: &Pool, name: String, slot: u8) -> Result<NameConflict> {
    let claims: Vec<VolumeClaim> = match pool.dir.volume_claims() {
        Some(reg) => reg
            .list(Some(&name))
            .map_err(|e| Error::io(format!("listing the claims of volume {name}"), e))?,
        None => Vec::new(),
    };
    let of_two: Vec<VolumeClaim> = claims
        .into_iter()
        .filter(|c| c.slot == slot || c.slot == pool.slot)
        .collect();
    let winner_slot = VolumeClaim::winner(&of_two).map_or(slot.min(pool.slot), |w| w.slot);
    let other_host = pool.host_name_of(slot);
    let refused_here = winner_slot != pool.slot;
    if refused_here {
        tracing::error!(
            "volume {name} is held by host {other_host} (slot {slot:02x}) too: two hosts hold one name. The claim rule gives it to {other_host}; its writes are refused here until one copy is deleted or renamed"
        );
    } else {
        tracing::error!(
            "volume {name} is held by host {other_host} (slot {slot:02x}) too: two hosts hold one name. The claim rule gives it to this host; host {other_host} refuses its writes at its next sync"
        );
    }
    Ok(NameConflict {
        volume: name,
        other_slot: slot,
        other_host,
        winner_slot,
        refused_here,
    })
}

/// The records that make `hosts/conflict/` say `found`: one put for each conflict this host
/// lost that was not `recorded`, one removal for each recorded one that is gone.
fn conflict_records(found: &[NameConflict], recorded: &BTreeSet<String>) -> Vec<JournalRecord> {
    let mut records = Vec::new();
    for c in found.iter().filter(|c| c.refused_here) {
        if !recorded.contains(&c.volume) {
            records.push(JournalRecord::MetaPut {
                key: format!("{CONFLICT_PREFIX}{}", c.volume),
                value: Some(
                    format!("winner={:02x}\nhost={}\n", c.winner_slot, c.other_host).into_bytes(),
                ),
            });
        }
    }
    for name in recorded {
        if !found.iter().any(|c| c.refused_here && &c.volume == name) {
            records.push(JournalRecord::MetaPut {
                key: format!("{CONFLICT_PREFIX}{name}"),
                value: None,
            });
        }
    }
    records
}

/// At a sync: the volume names this host's part holds that another (not forgotten)
/// host's part holds too, outside a move between the two. Each is logged; where the
/// claim rule gives the name to the other host, `hosts/conflict/NAME` refuses the
/// volume's writes here. Records of conflicts that are gone are removed.
pub(crate) fn check_volume_names(
    pool: &Pool,
    peers: &BTreeMap<u8, Arc<Pool>>,
    forgotten: &BTreeMap<u8, Forgotten>,
) -> Result<Vec<NameConflict>> {
    let (mine, recorded, adopted) = own_names(pool);
    let mut found: Vec<NameConflict> = Vec::new();
    for (&slot, p) in peers {
        if forgotten.contains_key(&slot) {
            continue;
        }
        for name in held_by_both(pool, p, slot, &mine, &adopted) {
            found.push(name_conflict(pool, name, slot)?);
        }
    }
    let records = conflict_records(&found, &recorded);
    if !records.is_empty() {
        pool.commit_records(records)?;
    }
    Ok(found)
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
