//! Where the pool's bytes live, and nothing about what they mean: the narrow I/O seam and the
//! layers stacked on it at open (docs/DESIGN.md "Layers", storage).
//!
//! Modules, one per concept:
//! - [`io`]: the seam ([`io::Dir`], [`io::File`]) and a local directory ([`io::RealDir`])
//! - [`sim`] (feature `sim`, and this crate's tests): the crash simulator, a `Dir` in memory
//!   that loses what was not synced at a seeded crash
//! - [`staging`]: the writeback staging layer over any `Dir` (staged segments, moved down)
//! - [`remote`]: a pool on S3-compatible object storage, the bucket as the pool directory
//!   (over crates/object-store), with its lease and claims
//! - [`claim_window`]: the clock a claim's window is timed on (`CLOCK_BOOTTIME`)
//! - [`volume_claims`]: one host per volume name in a shared pool (the claim protocol)
//! - [`copies`]: the superblock and the checkpoint root kept twice, and which copy open uses
//! - [`segment`]: append-only chunk containers
//! - [`cache_tier`]: copies of chunk records and metadata pages on a fast directory (S3-FIFO,
//!   persistent)
//! - [`secret_file`]: reading key, passphrase, credentials and PSK files (owner-only)
//!
//! Below it: condense-format (encodings, errors, crypto). Nothing here imports a crate above
//! (condense-meta, condense-engine).

#![deny(clippy::unwrap_used)]

pub mod cache_tier;
pub mod claim_window;
pub mod copies;
pub mod io;
pub mod priority;
pub mod remote;
pub mod secret_file;
pub mod segment;
#[cfg(any(test, feature = "sim"))]
pub mod sim;
pub mod staging;
#[cfg(test)]
mod volume_claim_races;
pub mod volume_claims;

pub use condense_format::{Error, Result};
