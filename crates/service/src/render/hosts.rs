//! The hosts of a pool several hosts share (docs/S3.md "Many hosts"): `hosts` (list), the
//! `shared pool` part of `stats`, `hosts sync` and `hosts forget`.
//!
//! Every view of [`HostOverview`] is printed from here: [`HostsList`] with every figure and
//! the lease of each part, [`SharedPool`] with the space figures `stats` adds.

use super::{human, round2, Report};
use condense_engine::hosts::{ForgetReport, NameConflict};
use condense_engine::hosts::{HostOverview, HostsReport};
use condense_engine::remote::LeaseBody;
use serde::{Serialize, Serializer};
use std::fmt::Write;

/// A part's lease: held (by whom, renewed when), released or expired, as of `now`.
struct Lease<'a> {
    lease: Option<&'a LeaseBody>,
    now: u64,
}

#[derive(Serialize)]
struct LeaseWire<'a> {
    state: &'static str,
    host: &'a str,
    pid: u32,
    renewed_unix: u64,
    expires_unix: u64,
}

impl Serialize for Lease<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.lease
            .map(|l| LeaseWire {
                state: if l.expires == 0 {
                    "released"
                } else if l.expires <= self.now {
                    "expired"
                } else {
                    "held"
                },
                host: &l.host,
                pid: l.pid,
                renewed_unix: l.renewed,
                expires_unix: l.expires,
            })
            .serialize(s)
    }
}

impl Lease<'_> {
    fn text(&self) -> String {
        let now = self.now;
        match self.lease {
            None => "no lease".into(),
            Some(l) if l.expires == 0 => format!("released by {} (pid {})", l.host, l.pid),
            Some(l) if l.expires <= now => format!(
                "expired {} s ago ({} pid {})",
                now - l.expires,
                l.host,
                l.pid
            ),
            Some(l) => format!(
                "held by {} pid {}, renewed {} s ago, expires in {} s",
                l.host,
                l.pid,
                now.saturating_sub(l.renewed),
                l.expires - now
            ),
        }
    }
}

/// Written and bucket bytes of every part together.
fn totals(hosts: &[HostOverview]) -> (u64, u64) {
    (
        hosts.iter().map(|h| h.written_bytes).sum(),
        hosts.iter().map(|h| h.bucket_bytes).sum(),
    )
}

/// `condense hosts`: this host's slot, every part of the pool with its lease, the whole pool.
pub struct HostsList<'a> {
    pub slot: u8,
    pub condemned: u64,
    pub hosts: &'a [HostOverview],
    /// The time leases are judged against (Unix seconds).
    pub now: u64,
}

#[derive(Serialize)]
struct ListWire<'a> {
    slot: u8,
    condemned_segments: u64,
    hosts: Vec<HostRow<'a>>,
    other_hosts: Vec<HostRow<'a>>,
    whole_pool: ListTotals,
}

#[derive(Serialize)]
struct HostRow<'a> {
    slot: u8,
    host: &'a str,
    url: &'a str,
    this_host: bool,
    volumes: u64,
    snapshots: u64,
    written_bytes: u64,
    bucket_objects: u64,
    bucket_bytes: u64,
    chunks_published: u64,
    folded_through_chunk: Option<u64>,
    lease: Lease<'a>,
    forgotten: &'a Option<String>,
    hand_overs: &'a [String],
    error: &'a Option<String>,
}

#[derive(Serialize)]
struct ListTotals {
    hosts: usize,
    written_bytes: u64,
    bucket_bytes: u64,
}

impl<'a> HostsList<'a> {
    fn row(&self, h: &'a HostOverview) -> HostRow<'a> {
        HostRow {
            slot: h.slot,
            host: &h.host,
            url: &h.url,
            this_host: h.this_host,
            volumes: h.volumes,
            snapshots: h.snapshots,
            written_bytes: h.written_bytes,
            bucket_objects: h.bucket_objects,
            bucket_bytes: h.bucket_bytes,
            chunks_published: h.chunks_published,
            folded_through_chunk: h.folded_through,
            lease: Lease {
                lease: h.lease.as_ref(),
                now: self.now,
            },
            forgotten: &h.forgotten,
            hand_overs: &h.notes,
            error: &h.error,
        }
    }

    fn host_line(&self, h: &HostOverview) -> String {
        format!(
            "{:<4} {:<18} {:>7} {:>10} {:>10} {:>12} {:>12}  {}{}{}",
            format!("{:02x}", h.slot),
            if h.this_host {
                format!("{} (this)", h.host)
            } else {
                h.host.clone()
            },
            h.volumes,
            human(h.written_bytes),
            human(h.bucket_bytes),
            h.chunks_published,
            h.folded_through.map_or("-".to_string(), |t| t.to_string()),
            self.row(h).lease.text(),
            h.forgotten
                .as_ref()
                .map_or(String::new(), |f| format!(" [{f}]")),
            h.error
                .as_ref()
                .map_or(String::new(), |e| format!(" (error: {e})")),
        )
    }
}

impl Serialize for HostsList<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (written_bytes, bucket_bytes) = totals(self.hosts);
        ListWire {
            slot: self.slot,
            condemned_segments: self.condemned,
            hosts: self.hosts.iter().map(|h| self.row(h)).collect(),
            other_hosts: self
                .hosts
                .iter()
                .filter(|h| !h.this_host)
                .map(|h| self.row(h))
                .collect(),
            whole_pool: ListTotals {
                hosts: self.hosts.len(),
                written_bytes,
                bucket_bytes,
            },
        }
        .serialize(s)
    }
}

impl Report for HostsList<'_> {
    fn text(&self) -> String {
        let slot = self.slot;
        if self.hosts.len() <= 1 {
            return format!("this host (slot {slot}) is the pool's only host; another joins with `condense connect URL --join --cache DIR --cache-size SIZE`\n");
        }
        let mut o = format!(
            "this host: slot {slot}; {} condemned segments waiting for the other hosts to let go\n",
            self.condemned
        );
        let _ = writeln!(
            o,
            "{:<4} {:<18} {:>7} {:>10} {:>10} {:>12} {:>12}  lease",
            "slot", "host", "volumes", "written", "in bucket", "published", "folded here"
        );
        for h in self.hosts {
            let _ = writeln!(o, "{}", self.host_line(h));
        }
        for h in self.hosts.iter().filter(|h| h.this_host) {
            for n in &h.notes {
                let _ = writeln!(o, "unfinished: {n}");
            }
        }
        let (written, bucket) = totals(self.hosts);
        let _ = writeln!(
            o,
            "whole pool: {} hosts, {} written, {} in the bucket ({:.2}x); published = chunk ids in a host's newest root, folded here = how far this host folded it in",
            self.hosts.len(),
            human(written),
            human(bucket),
            written as f64 / bucket.max(1) as f64
        );
        o
    }
}

/// The parts of a pool several hosts share and the whole pool, for `stats` (key
/// `shared_pool`, docs/STATS.md).
pub struct SharedPool<'a>(pub &'a [HostOverview]);

#[derive(Serialize)]
struct SharedWire<'a> {
    hosts: Vec<SharedRow<'a>>,
    whole_pool: SharedTotals,
}

#[derive(Serialize)]
struct SharedRow<'a> {
    slot: u8,
    host: &'a str,
    this_host: bool,
    volumes: u64,
    snapshots: u64,
    written_bytes: u64,
    bucket_bytes: u64,
    forgotten: &'a Option<String>,
    hand_overs: &'a [String],
}

#[derive(Serialize)]
struct SharedTotals {
    hosts: usize,
    volumes: u64,
    written_bytes: u64,
    bucket_bytes: u64,
    saving_percent: f64,
}

impl Serialize for SharedPool<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let hosts = self.0;
        let (written_bytes, bucket_bytes) = totals(hosts);
        let rows = hosts.iter().map(|h| SharedRow {
            slot: h.slot,
            host: &h.host,
            this_host: h.this_host,
            volumes: h.volumes,
            snapshots: h.snapshots,
            written_bytes: h.written_bytes,
            bucket_bytes: h.bucket_bytes,
            forgotten: &h.forgotten,
            hand_overs: &h.notes,
        });
        SharedWire {
            hosts: rows.collect(),
            whole_pool: SharedTotals {
                hosts: hosts.len(),
                volumes: hosts.iter().map(|h| h.volumes).sum(),
                written_bytes,
                bucket_bytes,
                saving_percent: round2(
                    100.0 * (1.0 - bucket_bytes as f64 / written_bytes.max(1) as f64),
                ),
            },
        }
        .serialize(s)
    }
}

impl Report for SharedPool<'_> {
    fn text(&self) -> String {
        let hosts = self.0;
        let (written, bucket) = totals(hosts);
        let mut o = format!(
            "shared pool: {} hosts (`condense hosts` for leases and publication)\n",
            hosts.len()
        );
        let line = |o: &mut String, who: &str, volumes: u64, written: u64, bucket: u64| {
            let _ = write!(
                o,
                "  {who:<24} {volumes:>4} volumes  {:>10} written  {:>10} in the bucket",
                human(written),
                human(bucket)
            );
        };
        for h in hosts {
            let who = if h.this_host {
                format!("{} (this host)", h.host)
            } else {
                h.host.clone()
            };
            line(&mut o, &who, h.volumes, h.written_bytes, h.bucket_bytes);
            o.push('\n');
        }
        let volumes = hosts.iter().map(|h| h.volumes).sum::<u64>();
        line(&mut o, "whole pool", volumes, written, bucket);
        let saved = 100.0 * (1.0 - bucket as f64 / written.max(1) as f64);
        let _ = writeln!(o, " ({saved:.1} % saved across hosts)");
        for h in hosts {
            if let Some(f) = &h.forgotten {
                let _ = writeln!(o, "  host {}: {f}", h.host);
            }
            for n in &h.notes {
                let _ = writeln!(o, "  unfinished: {n}");
            }
        }
        o
    }
}

/// `condense hosts sync`: what folding the other hosts in did.
pub struct SyncReport<'a>(pub &'a HostsReport);

#[derive(Serialize)]
struct SyncWire<'a> {
    slot: u8,
    segments_deleted: u64,
    segments_condemned: u64,
    volumes_moved_out: u64,
    volume_claims_put: u64,
    volume_claims_deleted: u64,
    hand_overs_finished: &'a [String],
    hand_overs_unfinished: Vec<Unfinished<'a>>,
    name_conflicts: Vec<Conflict<'a>>,
    reclaimed_segments: u64,
    reclaimed_bytes: u64,
    reclaim_waiting: &'a [String],
    other_hosts: Vec<Peer<'a>>,
}

#[derive(Serialize)]
struct Unfinished<'a> {
    volume: &'a str,
    why: &'a str,
}

#[derive(Serialize)]
struct Conflict<'a> {
    volume: &'a str,
    other_slot: u8,
    other_host: &'a str,
    winner_slot: u8,
    writes_refused_here: bool,
}

impl<'a> Conflict<'a> {
    fn of(c: &'a NameConflict) -> Conflict<'a> {
        Conflict {
            volume: &c.volume,
            other_slot: c.other_slot,
            other_host: &c.other_host,
            winner_slot: c.winner_slot,
            writes_refused_here: c.refused_here,
        }
    }
}

#[derive(Serialize)]
struct Peer<'a> {
    slot: u8,
    host: &'a str,
    url: &'a str,
    chunks_folded: u64,
    chunks_merged: u64,
    chunks_let_go: u64,
    folded_through_chunk: u64,
    its_folded_through_chunk: u64,
    forgotten: bool,
    error: &'a Option<String>,
}

impl Serialize for SyncReport<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let r = self.0;
        let peers = r.peers.iter().map(|p| Peer {
            slot: p.slot,
            host: &p.host,
            url: &p.url,
            chunks_folded: p.chunks_folded,
            chunks_merged: p.chunks_merged,
            chunks_let_go: p.chunks_let_go,
            folded_through_chunk: p.progress.through,
            its_folded_through_chunk: p.its_progress.through,
            forgotten: p.forgotten,
            error: &p.error,
        });
        let unfinished = r
            .handovers_unfinished
            .iter()
            .map(|(volume, why)| Unfinished { volume, why });
        SyncWire {
            slot: r.slot,
            segments_deleted: r.segments_deleted,
            segments_condemned: r.segments_condemned,
            volumes_moved_out: r.volumes_moved_out,
            volume_claims_put: r.claims_put,
            volume_claims_deleted: r.claims_deleted,
            hand_overs_finished: &r.handovers_finished,
            hand_overs_unfinished: unfinished.collect(),
            name_conflicts: r.name_conflicts.iter().map(Conflict::of).collect(),
            reclaimed_segments: r.reclaimed_segments,
            reclaimed_bytes: r.reclaimed_bytes,
            reclaim_waiting: &r.reclaim_waiting,
            other_hosts: peers.collect(),
        }
        .serialize(s)
    }
}

impl Report for SyncReport<'_> {
    fn text(&self) -> String {
        let r = self.0;
        let mut o = String::new();
        for p in &r.peers {
            let _ = match &p.error {
                Some(e) => writeln!(o, "host {} (slot {}): not read: {e}", p.host, p.slot),
                None => writeln!(
                    o,
                    "host {} (slot {}): {} new chunks to deduplicate against, {} blocks stored twice merged into its copy, {} chunks moved out of its condemned segments",
                    p.host, p.slot, p.chunks_folded, p.chunks_merged, p.chunks_let_go
                ),
            };
        }
        segments_line(&mut o, r);
        if r.volumes_moved_out > 0 {
            let _ = writeln!(
                o,
                "{} volumes moved to other hosts deleted here (their new host holds them)",
                r.volumes_moved_out
            );
        }
        sync_extras(&mut o, r);
        if r.claims_put + r.claims_deleted > 0 {
            let _ = writeln!(
                o,
                "volume claims: {} put for volumes of this host without one, {} stale ones deleted",
                r.claims_put, r.claims_deleted
            );
        }
        o
    }
}

fn segments_line(o: &mut String, r: &HostsReport) {
    let _ = writeln!(
        o,
        "{} condemned segments of this host deleted, {} waiting for the other hosts",
        r.segments_deleted, r.segments_condemned
    );
}

/// The parts of a sync's report beyond the fold, as text: hand-overs finished or not, names
/// held by two hosts, forgotten parts reclaimed.
fn sync_extras(o: &mut String, r: &HostsReport) {
    for v in &r.handovers_finished {
        let _ = writeln!(
            o,
            "volume {v}: its hand-over had stopped half way; finished now"
        );
    }
    for (v, why) in &r.handovers_unfinished {
        let _ = writeln!(
            o,
            "volume {v}: its hand-over stopped half way and cannot be finished now: {why}"
        );
    }
    for c in &r.name_conflicts {
        let _ = writeln!(
            o,
            "CONFLICT: volume {} is held by host {} (slot {:02x}) too; the claim rule gives it to {}{}",
            c.volume,
            c.other_host,
            c.other_slot,
            if c.refused_here { c.other_host.as_str() } else { "this host" },
            if c.refused_here {
                ": its writes are refused here until one copy is deleted or renamed"
            } else {
                ": that host refuses its writes at its next sync"
            }
        );
    }
    if r.reclaimed_segments > 0 {
        let _ = writeln!(
            o,
            "forgotten hosts: {} segments of their parts deleted ({})",
            r.reclaimed_segments,
            human(r.reclaimed_bytes)
        );
    }
    for w in &r.reclaim_waiting {
        let _ = writeln!(o, "reclaim waits: {w}");
    }
}

/// `condense hosts forget HOST`: the forget, then the sync after it (or why it failed).
pub struct Forgotten<'a> {
    pub forget: &'a ForgetReport,
    pub synced: Result<&'a HostsReport, String>,
    pub now: u64,
}

#[derive(Serialize)]
struct ForgetWire<'a> {
    slot: u8,
    host: &'a str,
    lease: Lease<'a>,
    forced: bool,
    reclaim: bool,
    already_forgotten: bool,
    volumes: &'a [String],
    sync: ForgetSync<'a>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum ForgetSync<'a> {
    Done {
        segments_deleted: u64,
        segments_condemned: u64,
        reclaimed_segments: u64,
        reclaimed_bytes: u64,
        reclaim_waiting: &'a [String],
    },
    Failed {
        error: &'a str,
    },
}

impl Serialize for Forgotten<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let f = self.forget;
        let sync = match &self.synced {
            Ok(r) => ForgetSync::Done {
                segments_deleted: r.segments_deleted,
                segments_condemned: r.segments_condemned,
                reclaimed_segments: r.reclaimed_segments,
                reclaimed_bytes: r.reclaimed_bytes,
                reclaim_waiting: &r.reclaim_waiting,
            },
            Err(e) => ForgetSync::Failed { error: e },
        };
        ForgetWire {
            slot: f.slot,
            host: &f.host,
            lease: Lease {
                lease: f.lease.as_ref(),
                now: self.now,
            },
            forced: f.forced,
            reclaim: f.reclaim,
            already_forgotten: f.already,
            volumes: &f.volumes,
            sync,
        }
        .serialize(s)
    }
}

impl Report for Forgotten<'_> {
    fn text(&self) -> String {
        let f = self.forget;
        let mut o = String::new();
        if f.forced {
            let lease = Lease {
                lease: f.lease.as_ref(),
                now: self.now,
            };
            let _ = writeln!(
                o,
                "WARNING: host {} held its lease ({}); forgotten anyway (--force). If it is running, stop it now: it writes its volumes until its next sync refuses",
                f.host,
                lease.text()
            );
        }
        let _ = writeln!(
            o,
            "host {} (slot {:02x}) {}forgotten: its acknowledgements are no longer awaited{}",
            f.host,
            f.slot,
            if f.already { "was already " } else { "" },
            if f.reclaim {
                "; its part's space is reclaimed once every other host acknowledged (at its next sync)"
            } else {
                ""
            }
        );
        if !f.volumes.is_empty() && !f.reclaim {
            let _ = writeln!(
                o,
                "its volumes, as its newest root has them: {} (adopt one with `condense volume adopt VOL --from-host {}`; then `condense hosts forget {} --reclaim` gives up the rest and frees its part)",
                f.volumes.join(", "),
                f.host,
                f.host
            );
        }
        match &self.synced {
            Ok(r) => {
                segments_line(&mut o, r);
                sync_extras(&mut o, r);
            }
            Err(e) => {
                let _ = writeln!(o, "the sync after it failed: {e}");
            }
        }
        o
    }
}
