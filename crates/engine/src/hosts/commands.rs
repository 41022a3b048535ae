//! The commands of a pool several hosts share (what `condense hosts`, `volume move`, `volume
//! adopt`, `volume clone --from-host` and the metrics call), as the trait [`SharedPool`] of
//! the pool: bring it into scope (`use condense_engine::hosts::SharedPool`) to call them on a
//! [`Pool`]. A trait here rather than methods in `pool/`, so that the pool core does not
//! import the protocols that stand on it; it reaches nothing of the pool's state, only the
//! core's named operations, as every room of `hosts/` does.

use super::fold::{self, HostsReport};
use super::forget::{self, ForgetReport};
use super::moves::{self, CloneReport, MoveReport};
use super::overview::{self, HostOverview};
use crate::error::Result;
use crate::format::hosts::Progress;
use crate::pool::Pool;
use std::collections::BTreeMap;

/// The shared-pool commands of a [`Pool`].
pub trait SharedPool {
    /// Fold every other host in ([`crate::hosts`]): their new chunks, merges of pairs stored
    /// twice, this host's chunks moved out of their condemned segments; then delete this
    /// host's condemned segments every other host let go, and checkpoint, which publishes
    /// this host's progress to them.
    fn sync_hosts(&self) -> Result<HostsReport>;

    /// This host's slot, its condemned segments and its progress with each peer, as its
    /// metadata holds them now (for `condense hosts`).
    fn hosts_state(&self) -> (u8, u64, BTreeMap<u8, Progress>);

    /// Every host's part of this shared pool (this host's first; its local directory is
    /// `own_local`), as this host's last read of each has it: volumes, bucket bytes,
    /// publication, lease. One LIST of each part's claims and of each part's prefix.
    fn hosts_overview(&self, own_local: &std::path::Path) -> Result<Vec<HostOverview>>;

    /// Hand volume `name` over to host `to` (the first half of a move; the second is
    /// [`SharedPool::adopt_volume`] on that host): from now on its writes are refused here
    /// ([`crate::Error::VolumeMoved`]), everything written before is flushed and in a new
    /// root, which `to` reads. The volume is deleted here by the first sync that finds it in
    /// `to`'s root.
    fn move_out_volume(&self, name: &str, to: &str) -> Result<MoveReport>;

    /// Take volume `name` over from host `from`, which handed it to this host
    /// ([`SharedPool::move_out_volume`]) or was forgotten ([`SharedPool::forget_host`]): a clone of it
    /// under the same name as `from`'s newest root has it (everything flushed there before the
    /// hand-over), durable on return. Resumable: an adopt that stopped half way (its claim
    /// put, its volume half made: `hosts/pending/NAME`) is continued by running it again or
    /// by the next [`SharedPool::sync_hosts`]; one that finished but was not published yet is
    /// published.
    fn adopt_volume(&self, name: &str, from: &str) -> Result<MoveReport>;

    /// Take volumes `names` over from host `from`, which is gone (docs/S3.md "Taking over
    /// a dead host's volumes"): this host takes `from`'s part lease once it expired (waiting
    /// up to `wait` for that), which replays what `from` flushed (with durability `remote`,
    /// every write a client saw flushed), hands the volumes to this host there as `volume
    /// move` would, releases that lease, and adopts them here. `from` deletes its copies when
    /// it comes back (its writes to them refused meanwhile).
    fn take_over_volumes(
        &self,
        names: &[String],
        from: &str,
        wait: std::time::Duration,
    ) -> Result<Vec<MoveReport>>;

    /// Make volume `new` in this host's part with the content of `source` (a volume, or a
    /// snapshot `VOL@SNAP`) of host `host`'s part, as that host's newest root has it. No data
    /// moves: every block names the record the source's block names (found by fingerprint
    /// among this host's chunks, or added as a chunk pointing at it), so the clone costs
    /// reads of that host's metadata only. Durable on return. Resumable: a clone that stopped
    /// half way (`hosts/pending/NEW`) is made whole by running it again, or by the next
    /// [`SharedPool::sync_hosts`].
    fn clone_from_host(&self, host: &str, source: &str, new: &str) -> Result<CloneReport>;

    /// Forget host `host` (its name or slot), gone for good ([`crate::hosts::forget`]).
    /// Refused while its part's lease is alive unless `force`. With `reclaim`, its part's
    /// space is reclaimed once every other host acknowledged (its volumes not adopted by then
    /// are given up); run again with `reclaim` after adopting what is wanted. Durable on
    /// return.
    fn forget_host(&self, host: &str, force: bool, reclaim: bool) -> Result<ForgetReport>;

    /// (hand-overs of this host not finished, volume names this host lost to another host's
    /// part) from its metadata alone: no request to the store (metrics read it at every
    /// scrape). Unfinished: half-made volumes (`hosts/pending/`) and volumes handed over
    /// that are still here (`hosts/released/`).
    fn hand_over_counts(&self) -> (u64, u64);

    /// Hand-overs of this host not finished, and names in conflict, as its metadata and the
    /// other hosts' newest roots it read last have them (for `condense hosts` and `stats`).
    fn hand_over_notes(&self) -> Vec<String>;
}

impl SharedPool for Pool {
    fn sync_hosts(&self) -> Result<HostsReport> {
        fold::sync(self)
    }

    fn hosts_state(&self) -> (u8, u64, BTreeMap<u8, Progress>) {
        overview::hosts_state(self)
    }

    fn hosts_overview(&self, own_local: &std::path::Path) -> Result<Vec<HostOverview>> {
        overview::hosts_overview(self, own_local)
    }

    fn move_out_volume(&self, name: &str, to: &str) -> Result<MoveReport> {
        moves::move_out_volume(self, name, to)
    }

    fn adopt_volume(&self, name: &str, from: &str) -> Result<MoveReport> {
        moves::adopt_volume(self, name, from)
    }

    fn take_over_volumes(
        &self,
        names: &[String],
        from: &str,
        wait: std::time::Duration,
    ) -> Result<Vec<MoveReport>> {
        moves::take_over_volumes(self, names, from, wait)
    }

    fn clone_from_host(&self, host: &str, source: &str, new: &str) -> Result<CloneReport> {
        moves::clone_from_host(self, host, source, new)
    }

    fn forget_host(&self, host: &str, force: bool, reclaim: bool) -> Result<ForgetReport> {
        forget::forget_host(self, host, force, reclaim)
    }

    fn hand_over_counts(&self) -> (u64, u64) {
        overview::hand_over_counts(self)
    }

    fn hand_over_notes(&self) -> Vec<String> {
        overview::hand_over_notes(self)
    }
}
