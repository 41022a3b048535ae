//! A pool several hosts share (docs/S3.md "Many hosts"): the other hosts' trees read, their
//! chunks folded into this host's chunk table (dedup across hosts), and segments that a GC
//! emptied deleted only once every other host let them go.
//!
//! Rooms, each a concept of its own (none imports a room that imports it back):
//! - [`fold`]: the sync — the fold of each peer, the sweep of condemned segments, the
//!   background sync;
//! - [`moves`]: the hand-overs — move, adopt, take over, clone from a host, and finishing
//!   those that stopped half way;
//! - [`forget`]: a host gone for good, and the check of volume names across parts;
//! - [`overview`]: every host's part as `condense hosts` shows it, and the notes of
//!   unfinished hand-overs.
//!
//! What the rooms need of the pool they ask by meaning, never by reaching into its state:
//! the records and volume names ([`Pool::read_records`], [`Pool::update_records`]), the
//! peers (`pool/peers.rs`), and the chunk and segment operations on other hosts' records
//! (`pool/foreign.rs`). A peer's state is locked only inside its own methods, by the peer
//! rule of the lock order (pool/mod.rs). The commands are methods of [`Pool`] (the room
//! `pool/hosts.rs`), which call these.
//!
//! Owns: the metadata records `hosts/released/NAME`, `hosts/adopted/SS/NAME`,
//! `hosts/pending/NAME` (the hand-overs), `hosts/condemned` (the condemned segments),
//! `hosts/peer/SS` (this host's progress with each peer), `hosts/forgotten/SS`,
//! `hosts/forgot/SS` and `hosts/conflict/NAME` (forgets and name conflicts), all in the
//! checkpoint root, which is how the other hosts read them (their bytes: `format::hosts`).
//!
//! The protocol, for hosts A (owner of segment S) and B:
//! - **Fold.** B reads A's newest root and, for every live chunk A added since B's last fold
//!   (`through`), in a segment of A's own that is not condemned: if B has no chunk with that
//!   fingerprint, B adds one that points at A's record (a chunk with no reference yet, found
//!   by B's dedup index like any other); if B has one stored in its own segment and A's slot
//!   is lower, B moves its chunk to A's record (a `Relocate`: B's copy becomes dead space for
//!   B's GC). So of two hosts that stored one block at once, the lower slot's copy stays.
//! - **Condemn.** A's GC moves A's live chunks out of S as in a pool of one host, then, instead
//!   of deleting S, records it condemned with a sequence number `n` (in A's root).
//! - **Let go.** B, folding, finds S condemned: it moves its own chunks out of S (a referenced
//!   one whose record A only moved is pointed at A's new record, the other referenced ones
//!   copied into B's segments, unreferenced ones dropped) and records `acked` past `n` in its
//!   next root. From then on no chunk of B names S, and B never adds one that does
//!   (A's root no longer names S, and B skips condemned segments).
//! - **Delete.** A deletes S once every other host's newest root acknowledges `n` and none of
//!   its referenced chunks is in S. A host that never folds again keeps S forever: safe,
//!   never a loss, until it is forgotten ([`forget`]: its acknowledgements are then no
//!   longer awaited).
//!
//! Hand-overs (`move`, `adopt`, `clone --from-host`) are resumable: each step leaves a durable
//! state the next run of the same command, or the next sync, continues. A volume being made by
//! an adopt or a clone carries `hosts/pending/NAME` from the commit that creates it to the one
//! that completes it (its writes are refused meanwhile; mapping its blocks again is
//! idempotent); a move run again to the same host publishes the hand-over it recorded.
//!
//! Invariants:
//! - A chunk's record is read from another host's segment only while that segment is not
//!   deleted: every host that may name it has acknowledged its condemnation first.
//! - Folded chunks and merges are journaled like any other change (`NewChunk`, `Relocate`);
//!   replay trusts another host's record without reading it (it was in the bucket, named by
//!   that host's root, before the journal named it).

mod commands;
pub mod fold;
pub mod forget;
pub mod moves;
pub mod overview;

pub use crate::format::hosts::{released_to, Progress};
pub use crate::pool::peers::{
    STEP_CLAIMED, STEP_COMPLETED, STEP_CREATED, STEP_FILLED, STEP_FIRST_BATCH, STEP_RELEASED,
};
pub use commands::SharedPool;
pub use fold::{start_background_sync, HostsReport, PeerReport};
pub use forget::{ForgetReport, NameConflict};
pub use moves::{CloneReport, MoveReport};
pub use overview::HostOverview;

#[cfg(doc)]
use crate::pool::Pool;
