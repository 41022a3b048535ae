//! The ground of the engine: every on-disk encoding of the pool, and the few things every
//! layer above shares (errors, the block's reduction, encryption, lock-order checks).
//!
//! Every on-disk encoding is in one place: one file per structure, and here what
//! they share (the bounds-checked [`Reader`], the little-endian writers, the CRC-32C and
//! magic/version checks, the constants every layer names, chunk locations). `docs/FORMAT.md`
//! mirrors this crate and names the file of each structure.
//!
//! All integers are little-endian. Every structure starts with a magic and a format version
//! (or lives inside one that does) and carries a CRC-32C. Decoders never panic on bad bytes:
//! they return [`Error::Corrupt`] or [`Error::Checksum`] (or `None` where the caller only
//! needs to know "not one"). Every structure has an encode → decode round-trip test and a
//! test that damaged or truncated bytes are an error.
//!
//! Files of the encodings:
//! - `common.rs`: what every structure shares
//! - `superblock.rs`: the superblock, its key section and MAC; [`Compression`],
//!   [`WritePolicy`], [`Durability`]
//! - `segment.rs`: segment names and headers, chunk records
//! - `journal.rs`: journal names and headers, batches, [`JournalRecord`]
//! - `root.rs`: the checkpoint root
//! - `hosts.rs`: the root's records of a pool several hosts share
//! - `cache_tier.rs`: `cache.conf`, the `cache.dat` and `cache.idx` headers, `cache.idx`
//!   records
//! - `chunk_slot.rs`: the 32-byte records of chunk-table leaves
//! - `dedup_index.rs`: `dedup.idx`, the dedup index saved at a clean close
//! - `map_entry.rs`: the 8-byte entries of block-map leaves
//! - `remote.rs`: `remote.conf`, the lease claims' body and the write-ahead objects of a pool
//!   in an object store
//! - `bucket.rs`: the names of a pool's objects in a bucket (generations, claims) and the
//!   manifest of a checkpoint root
//! - `damage.rs`: the records of the pool's history of accepted losses (`damage/`)
//! - `scrub_status.rs`: the scrub's state and the record of its last pass (`scrub/last`)
//! - `sketch.rs`: a block's similarity sketch (delta compression's super-features)
//! - `page.rs`: the `meta.dat` header, page pointers ([`page::Ptr`]) and the stored form of
//!   a metadata page
//!
//! And what every layer shares:
//! - `error.rs`: the engine's [`Error`] and [`Result`]
//! - `crypto.rs`: encryption at rest (keys, the AEAD, the nonce scheme)
//! - `reduction.rs`: zero detection, fingerprints, compression, delta payloads
//! - `counters.rs`, `volume_counters.rs`: an open pool's activity and per-volume I/O counters
//! - `locks.rs`: the lock-order checks
//! - `pacing.rs`: how a pass in steps shares the pool's state lock with the VMs' I/O
//! - `worker.rs`: background worker threads
//! - `volume_name.rs`: which volume and snapshot names are valid
//!
//! No module here imports a crate above it (condense-store, condense-meta, condense-engine).

#![deny(clippy::unwrap_used)]

pub mod bucket;
pub mod cache_tier;
pub mod chunk_slot;
mod common;
pub mod counters;
pub mod crypto;
pub mod damage;
pub mod dedup_index;
pub mod error;
pub mod hosts;
pub mod journal;
pub mod locks;
pub mod map_entry;
pub mod pacing;
pub mod page;
pub mod reduction;
pub mod remote;
pub mod root;
pub mod scrub_status;
pub mod segment;
pub mod sketch;
pub mod superblock;
pub mod volume_counters;
pub mod volume_name;
pub mod worker;

pub use common::*;
pub use error::{Error, Result};
pub use journal::*;
pub use page::{decode_meta_header, encode_meta_header};
pub use root::*;
pub use segment::*;
pub use superblock::*;
