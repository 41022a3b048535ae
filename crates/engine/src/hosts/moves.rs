//! Hand-overs between the hosts of a shared pool ([`super`] has the protocol): a volume
//! moved to another host (`move`, then `adopt` there), taken over from a dead host, or
//! cloned from another host's part; and, at each sync, the hand-overs that stopped half way
//! finished and the moved-out volumes deleted.
//!
//! Owns: [`MoveReport`], [`CloneReport`] and the records `hosts/released/NAME`,
//! `hosts/adopted/SS/NAME` and `hosts/pending/NAME`. Each step leaves a durable state the
//! next run of the same command, or the next sync, continues; a volume carrying
//! `hosts/pending/NAME` refuses writes until the hand-over that made it is complete.

use crate::error::{Error, Result};
use crate::format::hosts::{
    released_slot, released_to, released_turn, released_value, Condemned, Forgotten, Pending,
    ADOPTED_PREFIX, RELEASED_PREFIX,
};
use crate::format::{segment_slot, JournalRecord, CHUNK_ID_LIMIT, ENTRY_LOST};
use crate::locks::lock;
use crate::pool::claims::highest_turn;
use crate::pool::peers::{
    OpenedPeer, STEP_COMPLETED, STEP_CREATED, STEP_FILLED, STEP_FIRST_BATCH, STEP_RELEASED,
};
use crate::pool::{check_new_volume_name, OpenOptions, Pool};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

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

/// Blocks of a volume cloned from another host per hold of the state lock (each a dedup
/// lookup of its chunk at most: the hold stays short, fold.rs "Bounded steps").
const CLONE_BLOCKS: u64 = 1024;

/// Hand volume `name` over to host `to` ([`Pool::move_out_volume`]).
pub(crate) fn move_out_volume(pool: &Pool, name: &str, to: &str) -> Result<MoveReport> {
    let vol = pool.volume_id(name)?;
    let peer = pool.peer_named(to)?;
    // The destination claims the name one turn above this host's claim.
    let turn = pool.own_claim_turn(name)?.unwrap_or(0) + 1;
    // The volume's write lock: a partial-block write in flight finishes first.
    let vol_lock = pool.volume_lock(vol);
    let _w = lock(&vol_lock);
    pool.update_records(|r| {
        match r.is_snapshot(vol) {
            None => return Err(Error::NotFound(name.into())),
            Some(true) => return Err(Error::SnapshotReadOnly(name.into())),
            Some(false) => {}
        }
        let snaps = r.snapshots_of(vol);
        if !snaps.is_empty() {
            return Err(Error::Invalid(format!(
                "volume {name:?} has snapshots ({}): a move takes the volume as it is now; clone the snapshots on host {to} first if they are wanted there (`condense volume clone --from-host HOST {name}@SNAP NEW`), then delete them here",
                snaps.join(", ")
            )));
        }
        match released_to(r.meta(), name) {
            // Handed to that host already (a move that stopped before its root): the
            // hand-over stands as recorded, and is published below.
            Some(_) if released_slot(r.meta(), name) == Some(peer.slot) => Ok((Vec::new(), ())),
            Some(h) => Err(Error::VolumeMoved {
                volume: name.into(),
                host: h,
            }),
            None => Ok((
                vec![JournalRecord::MetaPut {
                    key: format!("{RELEASED_PREFIX}{name}"),
                    value: Some(released_value(peer.slot, &peer.host, turn)),
                }],
                (),
            )),
        }
    })?;
    pool.handover_point(STEP_RELEASED)?;
    let sync = lock(&pool.sync_lock);
    pool.checkpoint_locked(&sync)?;
    Ok(MoveReport {
        volume: name.into(),
        host: peer.host,
        slot: peer.slot,
        clone: None,
    })
}

/// Take volume `name` over from host `from` ([`Pool::adopt_volume`]).
pub(crate) fn adopt_volume(pool: &Pool, name: &str, from: &str) -> Result<MoveReport> {
    let one_gc = lock(&pool.gc_lock);
    pool.check_writable()?;
    let peers = pool.attach_peers()?;
    let report = adopt_locked(pool, &peers, name, from)?;
    drop(one_gc);
    let sync = lock(&pool.sync_lock);
    pool.checkpoint_locked(&sync)?;
    Ok(report)
}

/// [`adopt_volume`] with the other hosts' parts just opened; the caller holds `gc_lock` and
/// checkpoints.
fn adopt_locked(pool: &Pool, peers: &[OpenedPeer], name: &str, from: &str) -> Result<MoveReport> {
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
    // The volume comes back to a host that handed it away before: that hand-over is
    // finished first (its copy here deleted), or a sync would later take the old one's
    // completion for this one's and delete the volume adopted now.
    if finish_move(pool, &pool.peers(), name)? == Some(false) {
        return Err(Error::Invalid(format!(
            "volume {name:?} was handed from this host to another ({}), which has not adopted it yet: that hand-over finishes first (`condense hosts` shows it)",
            pool.read_records(|r| released_to(r.meta(), name)).unwrap_or_default()
        )));
    }
    let handed_turn = peer.read_records(|r| {
        (released_slot(r.meta(), name) == Some(pool.slot))
            .then(|| released_turn(r.meta(), name))
            .flatten()
    });
    let adopted = pool.read_records(|r| {
        let mine = crate::format::hosts::adopted_turn(r.meta(), p.slot, name);
        r.meta().contains_key(&adopted_key)
            && r.has_volume(name)
            && !r.meta().contains_key(&Pending::key(name))
            && (handed_turn.is_none() || mine.is_none() || mine == handed_turn)
    });
    if adopted {
        // Adopted already: only its root may be missing (the caller makes it).
        return Ok(report(None));
    }
    let forgotten = pool.forgotten_hosts().remove(&p.slot);
    let turn = adopt_turn(pool, peer, forgotten.as_ref(), name, from)?;
    let pending = Pending {
        op: "adopt".into(),
        from: p.slot,
        source: name.into(),
        turn,
    };
    let clone = clone_or_resume(pool, peers, &p.host, name, &pending)?;
    if forgotten.is_some() {
        // No hand-over named this slot: two hosts may adopt at once. The claim rule
        // decides, as for a new volume (docs/S3.md "Volume claims").
        confirm_claim(pool, name)?;
    }
    pool.handover_point(STEP_FILLED)?;
    complete_pending(
        pool,
        name,
        vec![JournalRecord::MetaPut {
            key: adopted_key,
            value: Some(crate::format::hosts::adopted_value(turn)),
        }],
    )?;
    pool.handover_point(STEP_COMPLETED)?;
    Ok(report(Some(clone)))
}

/// The turn an adopt of `name` from `from` (its part `peer`) claims the name at: the one its
/// hand-over names, or, from a forgotten host, one above every claim of the name. Refused if
/// the host neither handed the volume here nor was forgotten, or its space is reclaimed.
fn adopt_turn(
    pool: &Pool,
    peer: &Pool,
    forgotten: Option<&Forgotten>,
    name: &str,
    from: &str,
) -> Result<u32> {
    match forgotten {
        Some(f) if f.reclaim => Err(Error::Invalid(format!(
            "host {from} was forgotten and its part's space is being reclaimed (`condense hosts forget --reclaim`): its volumes that were not adopted before are given up"
        ))),
        // Nobody released it: claimed one turn above every claim of the name.
        Some(_) => Ok(claim_turns(pool, name)?.map_or(1, |t| t + 1)),
        None => {
            let (to_me, turn) = peer.read_records(|r| {
                (
                    released_slot(r.meta(), name),
                    released_turn(r.meta(), name).unwrap_or(1),
                )
            });
            if to_me != Some(pool.slot) {
                return Err(Error::Invalid(format!(
                    "host {from} has not handed volume {name:?} to this host (slot {:02x}){}: run `condense volume move {name} --to HOST` on host {from} first (or, if that host is gone for good, `condense hosts forget {from}` here)",
                    pool.slot,
                    match to_me {
                        Some(s) => format!(" but to slot {s:02x}"),
                        None => String::new(),
                    }
                )));
            }
            Ok(turn)
        }
    }
}

/// Take volumes `names` over from host `from`, which is gone ([`Pool::take_over_volumes`]).
pub(crate) fn take_over_volumes(
    pool: &Pool,
    names: &[String],
    from: &str,
    wait: std::time::Duration,
) -> Result<Vec<MoveReport>> {
    pool.check_writable()?;
    let peer = pool.peer_named(from)?;
    let me = format!("{:02x}", pool.slot);
    let deadline = std::time::Instant::now() + wait;
    let theirs = loop {
        let opts = OpenOptions {
            key: pool.opts.key.clone(),
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
        match move_out_volume(&theirs, name, &me) {
            Ok(_) => Ok(()),
            // Handed here already (an earlier takeover that stopped half way).
            Err(Error::VolumeMoved { .. })
                if theirs.read_records(|r| released_slot(r.meta(), name)) == Some(pool.slot) =>
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
        .map(|name| adopt_volume(pool, name, &peer.host))
        .collect()
}

/// The volumes this host released that their new host's root now holds: deleted here
/// (the second half of a move, at a sync). The number deleted.
pub(crate) fn finish_moves(pool: &Pool, peers: &BTreeMap<u8, Arc<Pool>>) -> Result<u64> {
    let released: Vec<String> = pool.read_records(|r| {
        r.meta()
            .range(RELEASED_PREFIX.to_string()..)
            .take_while(|(k, _)| k.starts_with(RELEASED_PREFIX))
            .map(|(k, _)| k[RELEASED_PREFIX.len()..].to_string())
            .collect()
    });
    let mut done = 0;
    for name in released {
        if finish_move(pool, peers, &name)? == Some(true) {
            done += 1;
        }
    }
    Ok(done)
}

/// This host's hand-over of `name`, if it has one (`hosts/released/NAME`), finished if its
/// new host adopted it: the copy here deleted, then the record. `None`: no hand-over;
/// `Some(false)`: not adopted yet. Idempotent: a kill between the two steps is finished by
/// the next call.
fn finish_move(pool: &Pool, peers: &BTreeMap<u8, Arc<Pool>>, name: &str) -> Result<Option<bool>> {
    let Some((slot, turn)) = pool.read_records(|r| {
        let turn = released_turn(r.meta(), name)?;
        Some((released_slot(r.meta(), name), turn))
    }) else {
        return Ok(None);
    };
    // Adopted: the new host's root records the adoption of this hand-over (its turn),
    // whether or not it still holds the volume (it may have deleted or moved it on since);
    // a record without a turn (an older binary's) counts only while the volume is there,
    // as an adoption of an earlier hand-over of the name may have left it.
    let adopted = slot.and_then(|s| peers.get(&s)).is_some_and(|p| {
        p.read_records(|r| {
            let key = format!("{ADOPTED_PREFIX}{:02x}/{name}", pool.slot);
            match crate::format::hosts::adopted_turn(r.meta(), pool.slot, name) {
                Some(t) => turn == t,
                None => r.meta().contains_key(&key) && r.has_volume(name),
            }
        })
    });
    if !adopted {
        return Ok(Some(false));
    }
    match pool.delete_volume(name) {
        Ok(()) | Err(Error::NotFound(_)) => {}
        Err(e) => return Err(e),
    }
    pool.meta_put(&format!("{RELEASED_PREFIX}{name}"), None)?;
    Ok(Some(true))
}

/// Make volume `new` in this host's part with the content of `source` of host `host`'s
/// part ([`Pool::clone_from_host`]).
pub(crate) fn clone_from_host(
    pool: &Pool,
    host: &str,
    source: &str,
    new: &str,
) -> Result<CloneReport> {
    check_new_volume_name(new)?;
    // No fold meanwhile: condemnations seen here are the ones this clone checks.
    let _one_gc = lock(&pool.gc_lock);
    pool.check_writable()?;
    let peers = pool.attach_peers()?;
    let from = peers
        .iter()
        .find(|(p, _)| p.answers_to(host))
        .map_or(pool.slot, |(p, _)| p.slot);
    let pending = Pending {
        op: "clone".into(),
        from,
        source: source.into(),
        turn: 0,
    };
    let report = clone_or_resume(pool, &peers, host, new, &pending)?;
    pool.handover_point(STEP_FILLED)?;
    complete_pending(pool, new, Vec::new())?;
    Ok(report)
}

/// Make volume `new` as `pending` says (a clone of `pending.source` on host `host`), or,
/// if an earlier run of the same hand-over stopped half way, make its half-made volume
/// whole (every block mapped again: idempotent). The caller holds `gc_lock` and removes
/// the pending record once the hand-over is complete ([`complete_pending`]).
fn clone_or_resume(
    pool: &Pool,
    peers: &[OpenedPeer],
    host: &str,
    new: &str,
    pending: &Pending,
) -> Result<CloneReport> {
    let (p, peer, condemned) = source_host(peers, host)?;
    if let Some(f) = pool.forgotten_hosts().get(&p.slot).filter(|f| f.reclaim) {
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
    let from = Source {
        peer: &peer,
        vol: src,
        name: source,
        host,
        condemned: &condemned,
    };
    let half_made = pool.read_records(|r| r.meta().get(&Pending::key(new)).cloned());
    if let Some(v) = half_made {
        let Some(was) = Pending::decode(&v)
            .filter(|w| w.op == pending.op && w.from == pending.from && w.source == pending.source)
        else {
            return Err(Error::Invalid(format!(
                "volume {new:?} is half made by another hand-over ({}): finish that one (`condense hosts` names it), or delete the volume",
                String::from_utf8_lossy(&v).replace('\n', " ").trim()
            )));
        };
        let mine = pool.volume_id(new)?;
        if pool.volume_size(mine, new)? != size {
            return Err(Error::Invalid(format!(
                "volume {new:?} is half made from {source} on host {host}, whose size changed since: delete it (`condense volume delete {new}`) and run the {} again",
                was.op
            )));
        }
        fill_clone(pool, &from, new, &mut report)?;
        return Ok(report);
    }
    let mark = JournalRecord::MetaPut {
        key: Pending::key(new),
        value: Some(pending.encode()),
    };
    pool.create_volume_with(new, size, pending.turn, vec![mark])?;
    pool.handover_point(STEP_CREATED)?;
    let cloned = fill_clone(pool, &from, new, &mut report);
    if let Err(e) = cloned {
        if pool.handover_stopped() {
            return Err(e); // a simulated kill leaves everything as it is
        }
        // Half a clone is no clone: it goes (its chunks return to GC).
        if let Err(d) = pool.delete_volume(new) {
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
    peers: &[OpenedPeer],
    host: &str,
) -> Result<(crate::io::Peer, Arc<Pool>, HashMap<u8, BTreeSet<u32>>)> {
    let known: Vec<String> = peers.iter().map(|(p, _)| p.host.clone()).collect();
    let mut condemned: HashMap<u8, BTreeSet<u32>> = HashMap::new();
    let mut found = None;
    for (p, opened) in peers {
        let Ok(part) = opened else { continue };
        condemned.insert(
            p.slot,
            part.read_records(|r| Condemned::read(r.meta()).segs.into_keys().collect()),
        );
        if p.answers_to(host) {
            found = Some((p.clone(), part.clone()));
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
fn complete_pending(pool: &Pool, name: &str, mut extra: Vec<JournalRecord>) -> Result<()> {
    extra.push(JournalRecord::MetaPut {
        key: Pending::key(name),
        value: None,
    });
    pool.update_records(|_| Ok((extra, ())))?;
    pool.flush()
}

/// The source of a clone from another host: its part, the volume, and every part's
/// condemned segments (a record in one is not named by a new chunk).
struct Source<'a> {
    peer: &'a Pool,
    vol: u32,
    name: &'a str,
    host: &'a str,
    condemned: &'a HashMap<u8, BTreeSet<u32>>,
}

/// [`clone_from_host`] after the new volume was made: its blocks, in batches.
fn fill_clone(pool: &Pool, from: &Source<'_>, new: &str, report: &mut CloneReport) -> Result<()> {
    let (source, host) = (from.name, from.host);
    let vol = pool.volume_id(new)?;
    let size = pool.volume_size(vol, new)?;
    let blocks = size.div_ceil(u64::from(pool.block_size()));
    let usable = |loc: &crate::format::Location| {
        let owner = segment_slot(loc.segment);
        owner != pool.slot
            && !from
                .condemned
                .get(&owner)
                .is_some_and(|s| s.contains(&loc.segment))
    };
    let unusable = |loc: &crate::format::Location| {
        Error::Invalid(format!(
            "{source} on host {host}: segment {:08x} of a block is being collected; run `condense hosts sync` on host {host}, then clone again (if host {host} was forgotten, a segment of another host it named may be deleted for good: its volume cannot be made whole here)",
            loc.segment
        ))
    };
    let mut first = 0;
    while first < blocks {
        let n = CLONE_BLOCKS.min(blocks - first);
        // The source's entries and, for each chunk, its fingerprint and record.
        let entries = from.peer.map_run(from.vol, first, n)?;
        if entries.contains(&ENTRY_LOST) {
            return Err(Error::Invalid(format!(
                "{source} on host {host} has lost blocks (`condense repair` gave them up): clone it on that host, or write those blocks first"
            )));
        }
        let ids: BTreeSet<u64> = entries
            .iter()
            .copied()
            .filter(|e| *e < CHUNK_ID_LIMIT)
            .collect();
        let mut chunks = HashMap::new();
        for (id, c) in from.peer.chunk_entries(&ids)? {
            let c = c.ok_or_else(|| {
                Error::corrupt(
                    format!("{source} on host {host}"),
                    format!("chunk {id} does not exist (damaged metadata)"),
                )
            })?;
            chunks.insert(id, c);
        }
        report.chunks_added +=
            pool.map_foreign_run(vol, first, &entries, &chunks, &usable, &unusable)?;
        report.data_blocks += entries.iter().filter(|e| **e < CHUNK_ID_LIMIT).count() as u64;
        first += n;
        pool.handover_point(STEP_FIRST_BATCH)?;
    }
    pool.flush()
}

/// The highest turn of the other hosts' claims of `name` (`None`: none, or a pool of one
/// host): a re-run of an adopt reuses this host's own claim above them.
fn claim_turns(pool: &Pool, name: &str) -> Result<Option<u32>> {
    let Some(reg) = pool.dir.volume_claims() else {
        return Ok(None);
    };
    highest_turn(&*reg, name, |slot| slot != pool.slot)
}

/// After claiming `name` without a hand-over naming this slot (an adopt from a forgotten
/// host): wait for a racing claim to show and check that this host's claim wins; if not,
/// the half-made volume goes and the name is refused.
fn confirm_claim(pool: &Pool, name: &str) -> Result<()> {
    let Some(reg) = pool.dir.volume_claims() else {
        return Ok(());
    };
    std::thread::sleep(std::time::Duration::from_secs(1));
    let claims = reg
        .list(Some(name))
        .map_err(|e| Error::io(format!("listing the claims of volume {name}"), e))?;
    let Some(w) = crate::format::hosts::VolumeClaim::winner(&claims) else {
        return Ok(());
    };
    if w.slot == pool.slot {
        return Ok(());
    }
    let host = pool.host_name_of(w.slot);
    if let Err(e) = pool.delete_volume(name) {
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
/// is removed. The caller holds `gc_lock`. Returns the volumes finished, and those still
/// unfinished with why.
pub(crate) fn finish_handovers(
    pool: &Pool,
    peers: &[OpenedPeer],
    forgotten: &BTreeMap<u8, Forgotten>,
) -> (Vec<String>, Vec<(String, String)>) {
    let (mut finished, mut unfinished) = (Vec::new(), Vec::new());
    let pending = pool.read_records(|r| Pending::all(r.meta()));
    for (name, p) in pending {
        let Some(p) = p else {
            unfinished.push((
                name,
                "its hosts/pending record does not parse: delete the volume".into(),
            ));
            continue;
        };
        let from = format!("{:02x}", p.from);
        let done = if p.op == "adopt" {
            adopt_locked(pool, peers, &name, &from).map(|_| ())
        } else {
            match clone_or_resume(pool, peers, &from, &name, &p) {
                Ok(_) => complete_pending(pool, &name, Vec::new()),
                Err(Error::NotFound(why)) if !forgotten.contains_key(&p.from) => {
                    tracing::warn!(
                        "clone {name} stopped half way and its source is gone ({why}): removed"
                    );
                    pool.delete_volume(&name)
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
                finished.push(name);
            }
            Err(e) => {
                tracing::warn!("hosts: the {} of volume {name} stopped half way and cannot be finished now: {e}", p.op);
                unfinished.push((name, e.to_string()));
            }
        }
    }
    (finished, unfinished)
}
