//! The Condense storage engine: a pool of thin-provisioned volumes whose blocks are
//! deduplicated and compressed inline, with a journal, checkpoints, garbage collection and
//! crash recovery. See docs/DESIGN.md for the vocabulary and docs/FORMAT.md for the bytes on disk.
//!
//! This crate is the top of the engine: the pool and what stands on it. The layers below are
//! crates of their own, so the compiler keeps the walls (docs/DESIGN.md "Layers"):
//! condense-format (every on-disk encoding, errors, crypto, the block's reduction),
//! condense-store (the I/O seam and the storage layers: local directory, S3, staging,
//! segments, the cache tier), condense-meta (the metadata: page cache, block maps, chunk table,
//! dedup index, attribution, journal). They are re-exported here under the names the engine's
//! modules use (`crate::format`, `crate::io`, `crate::page_cache`, ...).
//!
//! Modules of this crate, one per concept:
//! - [`pool`]: the core (state, lock order, group commit) and its rooms: open/recovery,
//!   checkpoints, the write and read paths, flush, the volume table, volume handles
//!   ([`VolumeHandle`], the Volume API), snapshots, GC, verify and scrub passes, the merge
//!   pass of duplicates the sparse index let through, destage
//! - [`hosts`]: a pool several hosts share: the fold, moves and adoption, forget, the overview
//! - [`volume_claims`] (from condense-store): one host per volume name (the claim protocol)
//! - [`gc`], [`verify`], [`stats`], [`scrub`] (the background thread; [`scrub_status`] what a
//!   pass records), [`repair`]: maintenance and reporting
//! - [`counters`]: activity counters for monitoring (journal, flushes, checkpoints, GC)
//! - [`volume_counters`]: per-volume I/O counters for the live view (`condense top`)
//!
//! The fuzz targets' entry points are crates/engine-fuzz, outside the release binary.

#![deny(clippy::unwrap_used)]

// The layers below, under the names this crate's modules use (docs/DESIGN.md "Layers"):
// condense-format (encodings, errors, crypto, the block's reduction), condense-store (the I/O
// seam and the storage layers), condense-meta (the metadata). None of them imports this crate.
pub use condense_format as format;
pub use condense_format::{crypto, error, reduction};
use condense_format::{locks, worker};
pub use condense_meta::{
    attribution, block_map, chunk_table, dedup_index, delta_replay, delta_search, fingerprint_sort,
    index, journal, metadata, page_alloc, page_cache, projection, sparse_index, sparse_replay,
    spill, verify,
};
#[cfg(any(test, feature = "sim"))]
pub use condense_store::sim;
pub use condense_store::{
    cache_tier, claim_window, copies, io, priority, remote, secret_file, segment, staging,
    volume_claims,
};

pub mod gc;
pub mod hosts;
pub mod pool;
pub mod repair;
pub mod scrub;
pub use condense_format::{counters, scrub_status, volume_counters};
pub use condense_meta::stats;

pub use cache_tier::{CacheConf, CacheMode, CacheStats};
pub use counters::CounterValues;
pub use crypto::UserKey;
pub use error::{Error, Result};
pub use format::{Compression, WritePolicy};
pub use pool::handle::VolumeHandle;
/// Snapshots, clones, rollback and changed-block queries (a room of the pool).
pub use pool::snapshots as snapshot;
pub use pool::{
    default_metadata_cache_bytes, CacheDir, InitOptions, OpenOptions, Pool, METADATA_CACHE_MIN,
};
pub use stats::{PoolStats, VolumeStats};
pub use volume_counters::{OpValues, VolumeIoValues, LATENCY_BUCKETS};
