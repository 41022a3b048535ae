//! The pool's metadata: what the bytes in the segments mean (docs/DESIGN.md "Layers", chunks).
//!
//! Modules, one per concept:
//! - [`page_cache`], [`page_alloc`]: paged copy-on-write trees of metadata pages behind one
//!   bounded cache, and where their pages go in `meta.dat`
//! - [`chunk_table`], [`dedup_index`], [`block_map`]: the metadata stores
//! - [`index`]: the dedup index a pool holds, dense ([`dedup_index`]) or sparse
//!   ([`sparse_index`]: hooks and a locality cache within a RAM budget), and its setting;
//!   [`sparse_replay`]: what the sparse index finds inline in a stream of writes, without a
//!   pool (`condense estimate --index sparse`)
//! - [`sketch_index`], [`delta_search`]: delta compression's index of similar chunks and the
//!   write path's choice of deltas; [`delta_replay`]: what it stores for a stream of writes,
//!   without a pool (`condense estimate --delta`)
//! - [`fingerprint_sort`]: the merge pass's sort of every chunk's fingerprint within a RAM
//!   budget, which finds the duplicates the sparse index let through
//! - [`metadata`]: the metadata stores together and the one `apply` that changes them
//! - [`attribution`]: which volumes and snapshots name each chunk: per volume, the bytes only
//!   it references (what deleting it frees) and those it shares
//! - [`spill`]: arrays of words paged to a sealed scratch file past a RAM budget (the
//!   attribution's, so it covers a pool far beyond RAM)
//! - [`verify`]: what `condense verify` reports, and its walk of the maps against the chunk
//!   pass (the passes themselves run in the engine, under the pool's locks)
//! - [`journal`]: making metadata changes durable between checkpoints
//! - [`projection`]: what the metadata of a pool of a given size costs (RAM, `meta.dat`)
//!
//! Below it: condense-store (the I/O seam, segments, the cache tier) and condense-format.
//! Nothing here imports condense-engine (the pool, volumes, maintenance).

#![deny(clippy::unwrap_used)]

pub mod attribution;
pub mod block_map;
pub mod chunk_table;
pub mod dedup_index;
pub mod delta_replay;
pub mod delta_search;
pub mod fingerprint_sort;
pub mod index;
pub mod journal;
pub mod metadata;
pub mod page_alloc;
pub mod page_cache;
pub mod projection;
pub mod sketch_index;
pub mod sparse_index;
pub mod sparse_replay;
pub mod spill;
pub mod stats;
pub mod verify;

pub use condense_format::{Error, Result};
