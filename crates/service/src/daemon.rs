//! A long-lived frontend on a pool (`serve`, `mount`) and what runs beside it while it holds
//! the pool: background GC once a quarter of the segment bytes are dead, the background scrub,
//! the background merge pass of a sparse-indexed pool,
//! the sync with the other hosts of a shared pool, the status publisher ([`crate::status`])
//! and the control socket ([`crate::control`]).
//!
//! Invariants: the control socket stops answering (waiting for the commands in flight) before
//! anything else stops; the pool is closed last, once every helper has stopped.

use crate::background_merge::{BackgroundMerge, MergeSchedule};
use crate::control::{ControlServer, Handler};
use crate::error::{Result, ServiceError};
use crate::status::StatusWriter;
use crate::tier::CacheTier;
use condense_engine::scrub::{BackgroundScrub, ScrubSchedule};
use condense_engine::Pool;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The default rate of the background scrub: 32 MiB/s of chunk records, about 10 % of one
/// core (bench/README.md, "The scrub's cost": fio-bench with and without it).
pub const DEFAULT_SCRUB_RATE: u64 = 32 << 20;

/// The background merge pass of a pool with a sparse dedup index ([`crate::background_merge`]):
/// looked at every 10 minutes, run once the chunks written since the last pass are 5 % of the
/// live ones (at least 65,536: 256 MiB of 4 KiB blocks), sorting within the RAM `condense index
/// merge` takes by default, then GC of the segments a quarter dead or more.
const MERGE_SCHEDULE: MergeSchedule = MergeSchedule {
    every: Duration::from_secs(600),
    new_percent: 5,
    new_min: 1 << 16,
    memory: crate::index::MERGE_MEMORY,
    gc_dead_percent: 25,
};

/// How the daemon opens the pool and what runs beside the frontend.
#[derive(Debug, Clone)]
pub struct DaemonOptions {
    pub read_only: bool,
    /// The metadata page-cache budget for this open (`None`: the pool's setting).
    pub metadata_cache: Option<u64>,
    pub cache_tier: Option<CacheTier>,
    /// Bytes per second of the background scrub (`None`: the default for the pool; 0: off).
    pub scrub_rate: Option<u64>,
    /// Time from the end of one scrub pass to the start of the next.
    pub scrub_every: Duration,
}

/// Open the pool at `path`, run `frontend` on it with the helpers beside it, and close the
/// pool cleanly when it returns. Commands on the control socket run through `handler`.
pub fn run(
    path: &Path,
    opts: &DaemonOptions,
    handler: Arc<Handler>,
    frontend: impl FnOnce(Arc<Pool>) -> Result<()>,
) -> Result<()> {
    let read_only = opts.read_only;
    let pool = crate::open::open_pool_with(path, read_only, opts.metadata_cache)?;
    if !read_only && pool.is_read_only() {
        return Err(ServiceError::Invalid(format!(
            "{} was connected read-only (`condense connect --read-only`): add --read-only",
            path.display()
        )));
    }
    if let (false, false, Some(tier)) = (read_only, pool.dir().whole_files_only(), &opts.cache_tier)
    {
        crate::tier::attach_given(&pool, path, tier)?;
    }
    // The VMs must not wait for a walk of the whole chunk table at the first write (after a
    // crash the saved index is stale): build the dedup index in steps now.
    pool.start_index_build();
    let gc = (!read_only).then(|| {
        condense_engine::gc::BackgroundGc::start(&pool, Duration::from_secs(30), 25, 256 << 20)
    });
    let scrubber = scrub(&pool, opts);
    // Not on a pool in an object store yet: the merge pass is tested on local pools only.
    let merger = (!read_only && !pool.dir().whole_files_only())
        .then(|| BackgroundMerge::start(&pool, MERGE_SCHEDULE));
    // A pool other hosts share: fold them in every 30 s (dedup across hosts, docs/S3.md).
    let hosts = condense_engine::hosts::start_background_sync(&pool, Duration::from_secs(30));
    let status = StatusWriter::start(&pool, path);
    let control = match ControlServer::start(path, pool.clone(), handler) {
        Ok(c) => Some(c),
        // Serving matters more than the socket (a pool path longer than a socket path may be).
        Err(e) => {
            eprintln!(
                "condense: warning: no control socket ({}); while this process runs, commands other than `stats` cannot use the pool",
                crate::error::chain(&e)
            );
            None
        }
    };
    let ran = frontend(pool.clone());
    // Stop answering commands (waiting for those in flight) before the pool closes.
    drop(control);
    ran?;
    drop(status);
    drop(hosts);
    drop(scrubber);
    drop(merger);
    drop(gc);
    pool.close()?;
    Ok(())
}

/// Start the background scrub of the daemon's pool (`None`: off, or the pool is read-only,
/// where a pass could not be recorded). Off by default for a pool whose reads cost requests
/// (an object store: each pass would GET every segment).
fn scrub(pool: &Arc<Pool>, opts: &DaemonOptions) -> Option<BackgroundScrub> {
    let rate = match opts.scrub_rate {
        Some(r) => r,
        None if pool.dir().reads_cost_requests() => 0,
        None => DEFAULT_SCRUB_RATE,
    };
    if rate == 0 || pool.is_read_only() {
        return None;
    }
    Some(BackgroundScrub::start(
        pool,
        ScrubSchedule {
            rate_bytes_per_sec: rate,
            every: opts.scrub_every,
        },
    ))
}
