//! Pools on S3-compatible object storage (docs/S3.md).
//!
//! Owns: how a pool's files map to objects of a bucket ([`RemoteDir`]), the write-ahead
//! objects of `--durability remote` ([`WalDir`]), the one-writer lease ([`Lease`]), the
//! pool's durability (`condense_engine::pool::Pool::set_durability`) and the pool's *local
//! directory* (`remote.conf`, written by [`init`] and [`connect`]).
//!
//! A pool on S3 is a writeback-cache pool whose pool directory is a bucket. Its local
//! directory is the cache directory: the cache tier's slots, the journal, the open segment and
//! sealed segments not yet uploaded ("staged"), the lock file and the control socket, plus
//! `pool/` (a mirror of `meta.dat` and the local `cache.conf`). The engine sees the bucket
//! through the [`Dir`] seam; the mapping is:
//!
//! | pool file | in the bucket (`PREFIX/...`) |
//! |---|---|
//! | `superblock`, `checkpoint` and their copies `superblock.copy`, `checkpoint.copy` | one object each, replaced whole by a PUT (the engine writes them to a `.tmp` name and renames: the rename is the PUT) |
//! | `seg-N.dat` | one immutable object, uploaded whole by the destager (the rename of `seg-N.dat.partial` is the PUT) |
//! | `meta.dat` | `meta/XXXXXXXX`, fixed extents of [`META_EXTENT_BYTES`]; a sync uploads the extents written since the last one |
//! | `journal-G.wal` | only at `init` (the empty first generation); afterwards the journal lives in the local directory |
//! | `cache.conf` | not in the bucket: each host has its own cache (`pool/cache.conf`) |
//!
//! Invariants:
//! - **A checkpoint root in the bucket names only objects already in the bucket.** The pages
//!   are uploaded (the `meta.dat` sync) before the root (the checkpoint rename), and so is
//!   every segment the root can name: a checkpoint seals the open segment and uploads every
//!   staged one first (`Pool::upload_staged_through`). So the bucket alone is a whole pool
//!   as of its last root, and the write-ahead objects of `remote` durability are needed only
//!   for what came after it.
//! - **Replacing a `meta.dat` extent never changes a page the bucket's root names.** The page
//!   allocator never overwrites a unit the last durable root references
//!   (`condense_meta::page_alloc`), so each extent object, old or new, holds those units intact.
//! - **The local mirror of `meta.dat` is trusted only if it matches the bucket's root**:
//!   `pool/meta.synced` holds a hash of the last root this host uploaded or downloaded; any
//!   other root in the bucket (another host wrote since) makes the open fetch every extent.
//! - **Only the lease holder writes** (best effort on stores without conditional PUT, such as
//!   Garage 2.5.0: see [`Lease`]). Every PUT and DELETE of a [`RemoteDir`] or [`WalDir`] is
//!   refused once the lease is lost, and a read-only open never writes to the bucket.
//! - With `--durability remote`, a sync of the journal or of a staged segment returns only
//!   after a write-ahead object (`wal/SEQ`) holding the bytes written since the previous sync
//!   is in the bucket; an open whose local directory lacks those files rebuilds them from
//!   the `wal/` objects, in sequence order ([`WalDir::recover`]).
//! - **The durability is the pool's**: stored in its superblock (set by [`init`], changed
//!   only by `condense_engine::pool::Pool::set_durability`), read by every open from the bucket and
//!   checked against the superblock the pool then opens (`AfterOpen::finish`); never taken
//!   from the host, except once from an older `remote.conf` for a pool that stores none.
//! - Credentials never come from a command line: an endpoint or pool URL with a user name or
//!   password is refused without showing it ([`check_endpoint`]); a credentials file is read
//!   only if its owner alone can access it ([`crate::secret_file`]).
//!
//! Files, one per concept:
//! - `conf.rs`: `remote.conf` ([`RemoteConf`]), URLs, endpoints, credentials, store errors
//! - `shared.rs`: what the directory, its files, the WAL and the lease share (the store, its
//!   health, the write gates, the read LRU)
//! - `object_dir.rs`: [`RemoteDir`], the bucket as the pool directory, and the `meta.dat`
//!   mirror; `files.rs`: its file types
//! - `wal.rs`: the write-ahead objects ([`WalDir`])
//! - `lease.rs`: the one-writer lease ([`Lease`])
//! - `members.rs`: hosts sharing one pool: the registry, [`join`], the other members
//! - `parallel.rs`: requests to the store a few at a time
//! - `setup.rs`: [`init`], [`connect`], opening the local directory

#[cfg(any(test, feature = "sim"))]
pub mod claim_race;
#[cfg(test)]
mod claim_tests;
mod conf;
mod files;
mod lease;
mod members;
mod names;
mod object_dir;
mod parallel;
mod setup;
mod shared;
mod wal;

pub use condense_format::Durability;
pub use conf::{
    backend, check_endpoint, is_remote_url, parse_s3_url, RemoteConf, REMOTE_CONF_NAME,
};
pub use files::META_EXTENT_BYTES;
pub use lease::{fresh_body, Lease, LeaseBody, LEASE_SECONDS};
pub use members::{
    join, list_members, member_url, split_member_url, ClaimRegistry, FIRST_HOST, PEERS_SUBDIR,
};
pub use object_dir::{RemoteDir, LOCAL_SUBDIR, REMOTE_CHECKPOINT_EVERY};
pub use setup::open_local;
pub use setup::{
    connect, delete_part_files, init, is_local_dir, part_lease, stored_file, stored_files,
};
pub use wal::WalDir;
pub use wal::{decode_wal, encode_wal};
