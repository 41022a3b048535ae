//! Every host's part of a shared pool as this host sees it (`condense hosts`, `stats`, the
//! metrics): volumes, bucket bytes, publication, lease, and the notes of this host's
//! hand-overs not finished and names in conflict. A room of [`super`]; reads only.
//!
//! Owns: [`HostOverview`]. Nothing here writes; what it reads of other hosts is their
//! newest root as this host's last fold opened it.

use crate::error::{Error, Result};
use crate::format::hosts::{
    released_slot, with_prefix, Condemned, Meta, Pending, Progress, CONFLICT_PREFIX,
    PEER_KEY_PREFIX, RELEASED_PREFIX,
};
use crate::pool::Pool;
use std::collections::{BTreeMap, BTreeSet};

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
    /// ([`hand_over_notes`]).
    pub notes: Vec<String>,
}

/// Every host's part of this shared pool ([`Pool::hosts_overview`]).
pub(crate) fn hosts_overview(
    pool: &Pool,
    own_local: &std::path::Path,
) -> Result<Vec<HostOverview>> {
    let (_, _, progress) = hosts_state(pool);
    let peers = pool
        .dir
        .peers()
        .map_err(|e| Error::io("listing the hosts of the pool", e))?;
    let opened = pool.peers();
    let mut out = Vec::new();
    let own = HostOverview {
        slot: pool.slot,
        host: if pool.slot == 0 {
            crate::remote::FIRST_HOST.to_string()
        } else {
            pool.host_name_of(pool.slot)
        },
        url: pool.dir.describe(),
        this_host: true,
        notes: hand_over_notes(pool),
        ..HostOverview::default()
    };
    let forgotten = pool.forgotten_hosts();
    let mut parts = vec![(own, Some(pool), own_local.to_path_buf())];
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
    for (mut h, part, local) in parts {
        match crate::remote::part_lease(&local) {
            Ok(l) => h.lease = l,
            Err(e) => h.error = Some(format!("its lease: {e}")),
        }
        let Some(part) = part else {
            h.error
                .get_or_insert_with(|| "its part could not be opened".into());
            out.push(h);
            continue;
        };
        h.chunks_published = part.next_chunk_id();
        match part.stats() {
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

/// This host's slot, its condemned segments and its progress with each peer, as its
/// metadata holds them now (for `condense hosts`).
pub(crate) fn hosts_state(pool: &Pool) -> (u8, u64, BTreeMap<u8, Progress>) {
    pool.read_records(|r| hosts_state_in(pool.slot, r.meta()))
}

fn hosts_state_in(slot: u8, meta: &Meta) -> (u8, u64, BTreeMap<u8, Progress>) {
    let progress = meta
        .range(PEER_KEY_PREFIX.to_string()..)
        .take_while(|(k, _)| k.starts_with(PEER_KEY_PREFIX))
        .filter_map(|(k, _)| {
            let slot = u8::from_str_radix(k.strip_prefix(PEER_KEY_PREFIX)?, 16).ok()?;
            Some((slot, Progress::read(meta, slot)))
        })
        .collect();
    (slot, Condemned::read(meta).segs.len() as u64, progress)
}

/// (hand-overs of this host not finished, volume names this host lost to another host's
/// part) from its metadata alone: no request to the store (metrics read it at every
/// scrape). Unfinished: half-made volumes (`hosts/pending/`) and volumes handed over
/// that are still here (`hosts/released/`).
pub(crate) fn hand_over_counts(pool: &Pool) -> (u64, u64) {
    pool.read_records(|r| {
        let pending = Pending::all(r.meta()).len() as u64;
        let released = with_prefix(r.meta(), RELEASED_PREFIX)
            .filter(|(name, _)| r.has_volume(name))
            .count() as u64;
        let conflicts = with_prefix(r.meta(), CONFLICT_PREFIX).count() as u64;
        (pending + released, conflicts)
    })
}

/// What this host's own records say of its hand-overs: (half-made volumes, volumes handed
/// away still here and to whom, names in conflict and the host given them, every name held).
#[allow(clippy::type_complexity)]
fn own_hand_overs(
    pool: &Pool,
) -> (
    BTreeMap<String, Option<Pending>>,
    Vec<(String, Option<u8>)>,
    Vec<(String, String)>,
    BTreeSet<String>,
) {
    pool.read_records(|r| {
        let meta = r.meta();
        let pending = Pending::all(meta);
        let released: Vec<(String, Option<u8>)> = with_prefix(meta, RELEASED_PREFIX)
            .filter(|(name, _)| r.has_volume(name))
            .map(|(name, _)| (name.to_string(), released_slot(meta, name)))
            .collect();
        let conflicts: Vec<(String, String)> = with_prefix(meta, CONFLICT_PREFIX)
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
        let held: BTreeSet<String> = r.names().cloned().collect();
        (pending, released, conflicts, held)
    })
}

/// The volumes other hosts handed to this host that it does not hold yet, with their slot.
fn handed_here(pool: &Pool, held: &BTreeSet<String>) -> Vec<(String, u8)> {
    let mut out = Vec::new();
    for (slot, p) in pool.peers() {
        p.read_records(|r| {
            for (name, _) in with_prefix(r.meta(), RELEASED_PREFIX) {
                if released_slot(r.meta(), name) == Some(pool.slot)
                    && !held.contains(name)
                    && r.has_volume(name)
                {
                    out.push((name.to_string(), slot));
                }
            }
        });
    }
    out
}

/// Hand-overs of this host not finished, and names in conflict, as its metadata and the
/// other hosts' newest roots it read last have them (for `condense hosts` and `stats`).
pub(crate) fn hand_over_notes(pool: &Pool) -> Vec<String> {
    // Read under the locks; host names (a LIST of the registry) asked after.
    let (pending, released, conflicts, held) = own_hand_overs(pool);
    let handed_here = handed_here(pool, &held);
    let names: BTreeMap<u8, String> = pool
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
