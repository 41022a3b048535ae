//! The Condense storage engine: a pool of thin-provisioned volumes whose blocks are
//! deduplicated and compressed inline, with a journal, checkpoints, garbage collection and
//! crash recovery. See docs/DESIGN.md for the vocabulary and docs/FORMAT.md for the bytes on disk.
//!
//! Modules, one per concept:
//! - [`io`]: the narrow I/O seam (real directory, and [`sim`], the crash simulator)
//! - [`format`]: every on-disk encoding
//! - [`copies`]: the superblock and the checkpoint root kept twice, and which copy open uses
//! - [`crypto`]: encryption at rest (keys, the AEAD, the nonce scheme)
//! - [`reduction`]: zero detection, fingerprints, compression
//! - [`segment`]: append-only chunk containers
//! - [`page_cache`], [`page_alloc`]: paged copy-on-write trees of metadata pages behind one
//!   bounded cache, and where their pages go in `meta.dat`
//! - [`chunk_table`], [`dedup_index`], [`block_map`]: the metadata
//! - [`metadata`]: the metadata stores together and the one `apply` that changes them
//! - [`attribution`]: which volumes and snapshots name each chunk: per volume, the bytes only
//!   it references (what deleting it frees) and those it shares
//! - [`spill`]: arrays of words paged to a sealed scratch file past a RAM budget (the
//!   attribution's, so it covers a pool far beyond RAM)
//! - [`journal`]: making metadata changes durable between checkpoints
//! - [`pool`]: open/recovery, checkpoints, the write and read paths, flush, volume handles,
//!   snapshots
//! - [`VolumeHandle`]: the Volume API over a pool
//! - [`gc`], [`verify`], [`stats`]: maintenance and reporting
//! - [`cache_tier`]: the cache tier (chunk records on a fast directory, S3-FIFO, persistent)
//! - [`counters`]: activity counters for monitoring (journal, flushes, checkpoints, GC)
//! - [`volume_counters`]: per-volume I/O counters for the live view (`condense top`)
//! - [`remote`]: pools on S3-compatible object storage (the bucket as the pool directory)
//! - [`secret_file`]: reading key, passphrase, credentials and PSK files (owner-only)
//! - [`fuzz`]: entry points of the fuzz targets (fuzz/), one per decoder of bytes from disk
//!   or a bucket, and their seed corpus

#![deny(clippy::unwrap_used)]

pub mod attribution;
pub mod block_map;
pub mod cache_tier;
pub mod chunk_table;
pub mod claim_window;
pub mod copies;
pub mod counters;
pub mod crypto;
pub mod dedup_index;
pub mod error;
pub mod format;
pub mod fuzz;
pub mod gc;
pub mod hosts;
pub mod io;
pub mod journal;
mod locks;
pub mod metadata;
pub mod page_alloc;
pub mod page_cache;
pub mod pool;
pub mod projection;
pub mod reduction;
pub mod remote;
pub mod repair;
pub mod scrub;
pub mod secret_file;
pub mod segment;
pub mod sim;
pub mod spill;
pub mod staging;
pub mod stats;
pub mod verify;
pub mod volume_claims;
pub mod volume_counters;
pub mod worker;

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
