//! The pool: the I/O side of the engine — segments, journal, group commit, checkpoints,
//! open and recovery — and the write and read paths over the metadata stores.
//!
//! Owns: [`State`], which pairs the [`Metadata`] (block maps, chunk table, dedup index,
//! records; changed only by [`Metadata::apply`]) with the segment store and the journal, behind
//! one mutex. Every change is a [`JournalRecord`] applied and appended to the journal in the
//! same critical section, so the journal order is the apply order. `State`'s fields are
//! private to this module and its rooms (the files of `pool/`, one per concept): the modules
//! above (hosts, gc's background thread, repair, verify's and stats' reports, the scrub's
//! schedule) ask the core by meaning — e.g. [`Pool::read_records`], [`Pool::fold_chunks`],
//! [`Pool::salvaged`] — and never take the lock themselves.
//!
//! Locks, always taken in this order: `gc_lock` (one GC at a time), a volume's write lock
//! (held by read-modify-write of partial blocks, zeroing, resize and delete; whole-block
//! writes go without it), then `sync_lock` (one flush or checkpoint at a time), then
//! `release_lock` (one step of a background release at a time, [`release`]), then `state`
//! (only through [`Pool::lock_state`]). CPU-heavy work (hashing, compression, decompression)
//! and data reads run without `state`.
//!
//! The peer rule: in a pool several hosts share, a host reads the other hosts' trees, each an
//! open [`Pool`] of its own (a peer, `pool/peers.rs`), whose `state` is a lock of the same
//! level. A thread holds at most one pool's `state` at a time: a peer's is taken with neither
//! this pool's nor another peer's held, and the `peers` map's lock is let go (the map copied
//! out) before any peer's `state` is taken. Debug builds assert it in [`Pool::lock_state`], as
//! `gc_lock` and `sync_lock` are asserted held where a function needs them.
//!
//! Durability: a flush (1) writes the journal's buffered records as a batch, (2) syncs every
//! segment written since the last flush and the directory if segments were created, then (3)
//! syncs the journal. Replay checks that every chunk a batch introduces is on disk and stops at
//! the first batch whose data is missing, so a batch written before its data was synced can
//! never surface garbage. A checkpoint writes only the dirty metadata pages (out of place) and
//! a small root naming them; see docs/FORMAT.md.
//!
//! Encryption at rest ([`crate::crypto`]): opening an encrypted pool unwraps the data key and
//! checks the superblock's MAC before anything is written (a missing or wrong key, or a
//! superblock changed without the key, changes no file); a writable open then seals under a
//! session of its own (a random salt, a counter in memory), so no file holds nonce state.

use crate::cache_tier::ChunkCache;
use crate::crypto::{Crypto, UserKey};
use crate::error::{Error, Result};
use crate::format::*;
use crate::io::Dir;
use crate::journal::{Journal, ReplayReport};
use crate::locks::lock;
use crate::metadata::Metadata;
use crate::segment::Segments;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

pub(crate) mod cache_tier;
pub(crate) mod claims;
pub mod damage;
pub mod delta;
mod destage;
mod durability;
mod flush;
pub(crate) mod foreign;
pub mod gc;
pub mod handle;
mod importing;
pub mod merge;
pub(crate) mod open;
pub mod peers;
mod read;
mod read_ahead;
mod records;
pub mod release;
pub(crate) mod salvage;
mod saved_index;
mod scrub;
pub mod snapshots;
mod stats;
mod verify;
mod volumes;
mod write;

/// Settings fixed when a pool is created.
#[derive(Clone, Debug)]
pub struct InitOptions {
    pub block_size: u32,
    pub compression: Compression,
    pub write_policy: WritePolicy,
    pub segment_bytes_target: u64,
    /// The metadata page-cache budget stored in the pool (`None`: [`default_metadata_cache_bytes`]).
    pub metadata_cache_bytes: Option<u64>,
    /// Encrypt the pool at rest with a data key wrapped by this key (`None`: not encrypted).
    pub encryption: Option<UserKey>,
}

/// The default metadata page-cache budget: 256 MiB or 5 % of RAM, whichever is smaller.
pub fn default_metadata_cache_bytes() -> u64 {
    let ram = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| {
                    l.split_whitespace()
                        .nth(1)
                        .and_then(|k| k.parse::<u64>().ok())
                })
        })
        .map(|kib| kib * 1024);
    match ram {
        Some(r) => (r / 20).clamp(METADATA_CACHE_MIN, 256 << 20),
        None => 256 << 20,
    }
}

/// The smallest metadata cache accepted (a handful of pages; tests use it to force eviction).
pub const METADATA_CACHE_MIN: u64 = 16 * 4096;

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions {
            block_size: 4096,
            compression: Compression::Lz4,
            write_policy: WritePolicy::Auto,
            segment_bytes_target: 64 << 20,
            metadata_cache_bytes: None,
            encryption: None,
        }
    }
}

/// Settings of one open.
#[derive(Clone, Debug)]
pub struct OpenOptions {
    pub read_only: bool,
    /// Checkpoint when the journal file grows past this.
    pub journal_bytes_max: u64,
    /// Write the journal buffer out when it grows past this (without syncing).
    pub journal_buffer_bytes: usize,
    /// Keep this much of the disk free for metadata; data writes fail with NoSpace below it.
    pub reserve_bytes: u64,
    /// With less than this free beside `reserve_bytes`, writes ask the background GC to run
    /// at once ([`Pool::take_space_low`]).
    pub low_space_bytes: u64,
    /// Metadata page-cache budget for this open (`None`: the pool's stored setting).
    pub metadata_cache_bytes: Option<u64>,
    /// The key of an encrypted pool (ignored by a pool that is not encrypted).
    pub key: Option<UserKey>,
    /// Replay past journal damage instead of failing (read-only opens only; for
    /// [`crate::repair`], which then writes a consistent state).
    pub salvage_journal: bool,
    /// The directory of an attached cache tier, given explicitly (the crash simulator,
    /// tests); `None`: the path stored in the pool's `cache.conf`. Used only when the pool
    /// has a cache attached.
    pub cache_dir: Option<CacheDir>,
    /// Open a pool whose writeback cache directory is lost, without it (`condense cache
    /// detach --force`): segments it staged are missing and a journal it held is replaced by
    /// an empty one.
    pub without_writeback_cache: bool,
    /// With a writeback cache, destage sealed segments in a background thread (the crash
    /// simulator turns this off and calls [`Pool::destage_one`] itself, to stay deterministic).
    pub destage_in_background: bool,
    /// Release deleted volumes' maps in a background thread ([`release`]; tests turn this
    /// off and call [`Pool::release_step`] themselves).
    pub release_in_background: bool,
    /// Leaves one release step takes ([`release::STEP_LEAVES`] by default; tests use fewer,
    /// to make many steps of a small map).
    pub release_step_leaves: usize,
    /// The per-volume figures' pages: (words per page, pages each of their arrays keeps in
    /// RAM before the rest go to a scratch file in the pool directory). `None`: 4 KiB pages,
    /// 32 MiB per array ([`crate::attribution::SpillTo`]). Small values are for tests.
    pub attribution_pages: Option<(usize, usize)>,
    /// How long a step of the figures' count holds the state lock, at least
    /// ([`crate::metadata::COUNT_STEP_TIME`] by default; tests use zero, one unit a step, to
    /// interleave changes with many steps of a small pool).
    pub count_step_time: std::time::Duration,
}

/// The directory of a cache tier (a newtype so that [`OpenOptions`] stays `Debug`).
#[derive(Clone)]
pub struct CacheDir(pub Arc<dyn Dir>);

impl std::fmt::Debug for CacheDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CacheDir({})", self.0.describe())
    }
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            read_only: false,
            journal_bytes_max: 64 << 20,
            journal_buffer_bytes: 1 << 20,
            reserve_bytes: 32 << 20,
            low_space_bytes: 1 << 30,
            metadata_cache_bytes: None,
            key: None,
            salvage_journal: false,
            cache_dir: None,
            without_writeback_cache: false,
            destage_in_background: true,
            release_in_background: true,
            release_step_leaves: release::STEP_LEAVES,
            attribution_pages: None,
            count_step_time: crate::metadata::COUNT_STEP_TIME,
        }
    }
}

/// A change to the metadata made inside a checkpoint ([`Pool::checkpoint_with`]).
pub(crate) type MetadataChange<'a> = dyn FnMut(&mut Metadata) -> Result<()> + 'a;

/// How long a checkpoint of an S3 pool waits for a store that stopped answering half-way.
const CHECKPOINT_STORE_WAIT: std::time::Duration = std::time::Duration::from_secs(300);

/// Re-check free disk space after this many bytes written.
const SPACE_CHECK_BYTES: u64 = 16 << 20;

/// The metadata stores and the I/O side, behind the pool's one state mutex. Its fields are
/// the pool module's alone: every other module asks the core by meaning (the rooms of
/// `pool/`), and the lock is taken only through [`Pool::lock_state`].
pub(crate) struct State {
    md: Metadata,
    segments: Segments,
    journal: Journal,
    /// Records appended so far / made durable so far (counts, for group commit).
    appended: u64,
    durable: u64,
    poisoned: Option<String>,
    written_since_space_check: u64,
    /// `appended` when the last checkpoint was prepared (an S3 pool checkpoints on a timer
    /// only if records were appended since).
    checkpointed: u64,
    /// Journal bytes at which a write asks for a flush ([`Pool::journal_full`]).
    journal_flush_at: u64,
    /// The sketch index of a delta pool, made by its first write (pool/delta.rs).
    sketch: Option<condense_meta::sketch_index::SketchIndex>,
}

std::thread_local! {
    /// Debug builds: whether this thread holds some pool's `state` (the lock order).
    static STATE_HELD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A held `state` lock ([`Pool::lock_state`]): the guard, and in debug builds the mark that
/// this thread holds a pool's state, which the lock order checks.
pub(crate) struct StateGuard<'a> {
    /// Dropped by hand in `drop`, before what the holder let go of is freed.
    guard: std::mem::ManuallyDrop<std::sync::MutexGuard<'a, State>>,
    /// When the lock was taken and by whom, for the slow-hold log ([`slow_hold`]).
    taken: Instant,
    by: &'static std::panic::Location<'static>,
}

// Passes in steps share the state lock with the VMs' I/O as condense-format's pacing.rs says.
pub(crate) use condense_format::pacing::{note_request, pause_after_step, pause_with, Pacer, Step};

/// Holds of the pool's `state` at least this long are logged (at `warn`, with the caller
/// that took the lock): every VM's I/O on the pool waited that long. Set in milliseconds by
/// `$CONDENSE_SLOW_HOLD_MS` (read once; fractions allowed; default 200, 0 turns the log
/// off). A developer's tool for finding the holds behind a stall (bench/admin-stall.sh).
fn slow_hold() -> Option<Duration> {
    static LIMIT: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        let ms = std::env::var("CONDENSE_SLOW_HOLD_MS")
            .ok()
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|ms| ms.is_finite() && *ms >= 0.0)
            .unwrap_or(200.0);
        (ms > 0.0).then(|| Duration::from_secs_f64(ms.min(1e9) / 1e3))
    })
}

impl std::ops::Deref for StateGuard<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.guard
    }
}

impl std::ops::DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.guard
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        #[cfg(debug_assertions)]
        STATE_HELD.with(|h| h.set(false));
        let to_free = self.guard.md.take_to_free();
        let held = self.taken.elapsed();
        // SAFETY: the guard is dropped once, here, and not used after.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.guard) };
        // Freed with the lock let go (Metadata::to_free).
        drop(to_free);
        if slow_hold().is_some_and(|limit| held >= limit) {
            tracing::warn!(
                "the pool's state was held {:.1} ms by {}:{} (the I/O of every volume waited)",
                held.as_secs_f64() * 1e3,
                self.by.file(),
                self.by.line()
            );
        }
    }
}

/// An open pool. Always held in an `Arc` (volumes keep a reference to it).
pub struct Pool {
    pub(crate) dir: Arc<dyn Dir>,
    pub(crate) sb: Superblock,
    /// Seals and opens everything stored, in an encrypted pool.
    pub(crate) crypto: Option<Arc<Crypto>>,
    pub(crate) sync_writes: bool,
    pub(crate) read_only: bool,
    pub(crate) opts: OpenOptions,
    state: Mutex<State>,
    pub(crate) sync_lock: Mutex<()>,
    /// One garbage collection at a time.
    pub(crate) gc_lock: Mutex<()>,
    vol_locks: Mutex<HashMap<u32, Arc<Mutex<()>>>>,
    /// Open writable handles per volume (rollback refuses while any is open).
    pub(crate) writers: Mutex<HashMap<u32, usize>>,
    /// Per-volume I/O counters, by name ([`crate::volume_counters`]).
    pub(crate) volume_io: crate::volume_counters::VolumeIoMap,
    pub(crate) me: Weak<Pool>,
    pub(crate) read_errors: AtomicU64,
    /// Blocks repair declared lost ([`ENTRY_LOST`]) read as zeros instead of failing
    /// ([`Pool::set_lost_reads_zeros`]).
    lost_reads_zeros: std::sync::atomic::AtomicBool,
    /// Lost blocks read as zeros through this handle.
    lost_read_as_zeros: AtomicU64,
    /// The scrub's progress and requests ([`crate::scrub`]).
    pub(crate) scrub: crate::scrub_status::ScrubState,
    /// Writes between their hashing and their commit (see [`Pool::write_blocks`]).
    writes_in_flight: AtomicUsize,
    /// Reads between their start and their end (see [`Pool::read_blocks`]).
    reads_in_flight: AtomicUsize,
    /// Set by a write that found less than `low_space_bytes` free; taken by the
    /// background GC ([`Pool::take_space_low`]).
    space_low: std::sync::atomic::AtomicBool,
    /// Whether a write alone in flight hashes and compresses on every core
    /// ([`Pool::set_spread_writes`]).
    spread_writes: std::sync::atomic::AtomicBool,
    /// Set when the journal passed `journal_bytes_max` with no flush to checkpoint it; the
    /// next write that does not flush anyway flushes (and so checkpoints) then. Without it a
    /// writer that never flushes (an import, a guest with cache=unsafe) grew the journal
    /// without bound: 300 MB in 150 s of an import, ~6 s of replay at the next open.
    journal_full: std::sync::atomic::AtomicBool,
    /// Delta compression is on (the mode record, pool/delta.rs): small writes look their
    /// misses up before the lock too, so they find deltas.
    deltas_on: std::sync::atomic::AtomicBool,
    /// Activity counters for monitoring ([`Pool::counters`]).
    pub(crate) counters: crate::counters::Counters,
    pub(crate) replay: ReplayReport,
    /// The attached cache tier, if any ([`crate::cache_tier`]).
    pub(crate) tier: RwLock<Option<Arc<ChunkCache>>>,
    /// The background destage thread of a writeback cache ([`destage`]).
    pub(crate) destager: Mutex<Option<crate::worker::Worker>>,
    /// One release step at a time ([`release`]); taken before `state`.
    pub(crate) release_lock: Mutex<()>,
    /// The background release thread ([`release`]).
    pub(crate) releaser: Mutex<Option<release::Releaser>>,
    /// The thread building the dedup index in steps, while it runs ([`saved_index`]).
    pub(crate) index_builder: Mutex<Option<crate::worker::Worker>>,
    /// This host's member slot in a pool several hosts share (0 otherwise).
    pub(crate) slot: u8,
    /// The other hosts' trees, open read-only ([`crate::hosts`]), by slot.
    pub(crate) peers: Mutex<std::collections::BTreeMap<u8, Arc<Pool>>>,
    /// Volumes deleted since the last checkpoint whose claims wait for a root that holds the
    /// deletion ([`crate::volume_claims`]).
    pub(crate) deleted_names: Mutex<std::collections::BTreeSet<String>>,
    /// Tests only: the hand-over step at which this open stops as a kill would
    /// (`Pool::stop_handovers_at`, tests); 0: none.
    pub(crate) handover_stop: std::sync::atomic::AtomicU32,
    /// Sequential readers of each volume, read ahead through the block map on a store whose
    /// reads cost requests ([`read_ahead`]).
    read_ahead: read_ahead::ReadAhead,
    /// Buffers of finished reads, reused by the next ones ([`read::ReadBuffers`]).
    read_buffers: read::ReadBuffers,
    _lock_file: Option<std::fs::File>,
}

/// One read or write counted in [`Pool::reads_in_flight`] or [`Pool::writes_in_flight`]
/// while it lives, and among the VMs' requests that pace the passes in steps
/// ([`note_request`]).
struct InFlight<'a> {
    count: &'a AtomicUsize,
    before: usize,
}

impl<'a> InFlight<'a> {
    fn enter(count: &'a AtomicUsize) -> InFlight<'a> {
        let before = count.fetch_add(1, Ordering::Relaxed);
        note_request();
        InFlight { count, before }
    }

    /// No other one was in flight when this one started.
    fn alone(&self) -> bool {
        self.before == 0
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::Relaxed);
    }
}

pub use condense_format::volume_name::{check_new_volume_name, check_volume_name};

fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b)
        .map_err(|e| Error::io("reading random bytes", std::io::Error::other(e.to_string())))?;
    Ok(b)
}

impl Pool {
    /// Take this pool's `state`, last in the lock order (see the module docs). Debug builds
    /// check the peer rule: the thread holds no pool's `state` already, this pool's or
    /// another host's (a peer's, [`crate::hosts`]).
    #[track_caller]
    pub(crate) fn lock_state(&self) -> StateGuard<'_> {
        #[cfg(debug_assertions)]
        STATE_HELD.with(|h| {
            debug_assert!(
                !h.get(),
                "lock order: a pool's state is taken while this thread holds one already (its own, or a peer's)"
            );
            h.set(true);
        });
        let by = std::panic::Location::caller();
        let guard = condense_format::pacing::lock_counted(&self.state);
        StateGuard {
            guard: std::mem::ManuallyDrop::new(guard),
            taken: Instant::now(),
            by,
        }
    }

    /// What recovery found in the journal at open.
    pub fn replay_report(&self) -> &ReplayReport {
        &self.replay
    }

    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }

    pub fn block_size(&self) -> u32 {
        self.sb.block_size
    }

    /// True when every write is made durable before it returns.
    pub fn sync_writes(&self) -> bool {
        self.sync_writes
    }

    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    pub fn dir(&self) -> &dyn Dir {
        &*self.dir
    }

    /// True if records were appended since the last checkpoint (or the open): a
    /// [`Pool::close`] would write something. A command that failed before changing anything
    /// leaves the pool's files as they were by not closing it.
    pub fn has_unsaved_changes(&self) -> bool {
        let st = self.lock_state();
        st.appended > st.checkpointed
    }

    /// Make everything durable and write a checkpoint, so the next open replays nothing.
    pub fn close(&self) -> Result<()> {
        if self.read_only {
            // (Only an S3 pool opens its cache tier read-only: keep what it promoted.)
            if let Some(c) = self.tier() {
                if let Err(e) = c.close() {
                    tracing::warn!("closing the cache tier: {e}");
                }
            }
            return Ok(());
        }
        self.stop_destager();
        self.stop_releaser();
        self.stop_index_builder();
        self.flush()?;
        let deleted = self.deleted_names_now();
        let guard = lock(&self.sync_lock);
        self.checkpoint_locked(&guard)?;
        // The free end of meta.dat given back (condense_meta::page_cache::compaction).
        let marked = self.lock_state().md.pages.start_compaction();
        match marked {
            Ok(0) => {}
            Ok(_) => self.checkpoint_locked(&guard)?,
            Err(e) => tracing::warn!("compacting meta.dat at close: {e}"),
        }
        self.lock_state().md.pages.alloc.set_ceiling(None);
        drop(guard);
        self.drop_claims_of_deleted(deleted);
        self.save_dedup_index();
        if let Some(c) = self.tier() {
            if let Err(e) = c.close() {
                tracing::warn!("closing the cache tier: {e}");
            }
        }
        Ok(())
    }

    // -----------------------------------------------------------------------------------------
    // Volumes.

    pub(crate) fn writable(&self, st: &State) -> Result<()> {
        if self.read_only {
            return Err(Error::ReadOnly);
        }
        if let Some(p) = st.poisoned.as_deref().or(st.segments.write_failure()) {
            return Err(Error::Poisoned(p.to_string()));
        }
        Ok(())
    }

    pub(crate) fn volume_lock(&self, vol: u32) -> Arc<Mutex<()>> {
        lock(&self.vol_locks).entry(vol).or_default().clone()
    }

    /// Read a named metadata record.
    pub fn meta_get(&self, key: &str) -> Option<Vec<u8>> {
        self.lock_state().md.meta.get(key).cloned()
    }

    /// Set or remove a named metadata record.
    pub fn meta_put(&self, key: &str, value: Option<&[u8]>) -> Result<()> {
        if key.is_empty() || key.len() > 1024 || value.is_some_and(|v| v.len() > 16 << 20) {
            return Err(Error::Invalid(
                "metadata key must be 1 to 1024 bytes, value up to 16 MiB".into(),
            ));
        }
        let mut st = self.lock_state();
        self.writable(&st)?;
        self.commit(
            &mut st,
            vec![JournalRecord::MetaPut {
                key: key.to_string(),
                value: value.map(|v| v.to_vec()),
            }],
        )?;
        drop(st);
        if self.sync_writes {
            self.flush()?;
        }
        Ok(())
    }

    pub fn meta_keys(&self, prefix: &str) -> Vec<String> {
        let st = self.lock_state();
        st.md
            .meta
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Volume creation, deletion and resize are durable when they return.
    fn after_metadata_change(&self) -> Result<()> {
        self.flush()
    }

    /// Apply records to the state and append them to the journal: the one way state changes.
    /// Writes a full journal buffer out first, so a failure there changes nothing.
    /// Pages the records touch are loaded first, so a damaged page fails the request before
    /// anything changes; pages over the cache budget are written out after.
    pub(crate) fn commit(&self, st: &mut State, records: Vec<JournalRecord>) -> Result<u64> {
        if st.journal.pending_bytes() >= self.opts.journal_buffer_bytes {
            st.journal.seal()?;
        }
        st.md.prefetch(&records)?;
        for r in &records {
            if let Err(e) = st.md.apply(r) {
                // The state may be half-changed: stop accepting writes until reopened.
                st.poisoned = Some(e.to_string());
                return Err(e);
            }
            st.journal.append(r);
        }
        st.appended += records.len() as u64;
        let len = st.journal.file_bytes() + st.journal.pending_bytes() as u64;
        let max = self.opts.journal_bytes_max;
        if len.saturating_add(max) < st.journal_flush_at {
            st.journal_flush_at = max; // a new journal since the last request
        }
        if len > st.journal_flush_at {
            st.journal_flush_at = len.saturating_add(max);
            self.journal_full.store(true, Ordering::Relaxed);
        }
        // Group commit: what is durable is a prefix of what was appended (flush_through).
        debug_assert!(
            st.durable <= st.appended,
            "durable records were appended first"
        );
        crate::counters::add(&self.counters.journal_records, records.len() as u64);
        let appended = st.appended;
        let index_bytes = st.md.index.ram_bytes();
        st.md.pages.set_reserved_bytes(index_bytes);
        if let Err(e) = st.md.pages.evict_to_budget() {
            st.poisoned = Some(e.to_string());
            return Err(e);
        }
        Ok(appended)
    }

    /// Take the journal's request for a flush (set by a commit that found it past
    /// `journal_bytes_max`; once per `journal_bytes_max` appended).
    pub(crate) fn take_journal_full(&self) -> bool {
        self.journal_full.swap(false, Ordering::Relaxed)
    }

    /// Whether a write that is the only one in flight spreads its hashing and compression
    /// over every core (on by default). Worth it for one stream of writes in this process
    /// (`condense import`: 10.3–11.4 s against 12.0–13.2 s for the ten corpus images). The
    /// NBD server turns it off: its writes arrive while the connection copies the next
    /// request from the socket and the client runs on the same cores, and the spread took
    /// their CPU (rayon's idle workers spin between writes). Over NBD, 1 MiB writes went
    /// from ~960 to ~1040 MiB/s at queue depth 4 and from 611 to 713 at depth 1 without it.
    pub fn set_spread_writes(&self, on: bool) {
        self.spread_writes.store(on, Ordering::Relaxed);
    }

    /// Whether blocks `condense repair` declared lost read as zeros through this handle
    /// (`condense export --lost-as-zeros`, to copy what is left of a damaged volume) instead
    /// of failing with [`Error::Lost`] (the default, so that no client takes zeros for data).
    pub fn set_lost_reads_zeros(&self, on: bool) {
        self.lost_reads_zeros.store(on, Ordering::Relaxed);
    }

    /// Lost blocks read as zeros so far ([`Pool::set_lost_reads_zeros`]).
    pub fn lost_blocks_read_as_zeros(&self) -> u64 {
        self.lost_read_as_zeros.load(Ordering::Relaxed)
    }

    /// Whether a write found the disk low on space since the last call (and clear it):
    /// less than [`OpenOptions::low_space_bytes`] free beside the reserve. Overwrites at disk
    /// speed make dead space far faster than a periodic GC check notices.
    pub fn take_space_low(&self) -> bool {
        self.space_low
            .swap(false, std::sync::atomic::Ordering::Relaxed)
    }
}

/// Name the volume and blocks a metadata error was met in, keeping what it says.
pub(crate) fn in_volume(e: Error, name: &str, blocks: &str) -> Error {
    match e {
        Error::Checksum {
            what,
            expected,
            found,
        } => Error::Checksum {
            what: format!("volume {name:?} {blocks}: {what}"),
            expected,
            found,
        },
        Error::Corrupt { what, detail } => Error::Corrupt {
            what: format!("volume {name:?} {blocks}: {what}"),
            detail,
        },
        Error::Auth { what, detail } => Error::Auth {
            what: format!("volume {name:?} {blocks}: {what}"),
            detail,
        },
        e => e,
    }
}

fn with_context(e: Error, what: &str) -> Error {
    match e {
        Error::Checksum {
            expected, found, ..
        } => Error::Checksum {
            what: what.to_string(),
            expected,
            found,
        },
        Error::Corrupt { detail, .. } => Error::Corrupt {
            what: what.to_string(),
            detail,
        },
        Error::Auth { detail, .. } => Error::Auth {
            what: what.to_string(),
            detail,
        },
        e => e,
    }
}

pub(crate) fn read_whole(dir: &dyn Dir, name: &str) -> Result<Vec<u8>> {
    let f = dir
        .open(name, false)
        .map_err(|e| Error::io(format!("opening {name}"), e))?;
    let len = f
        .len()
        .map_err(|e| Error::io(format!("reading {name}"), e))?;
    let mut buf = vec![0u8; len as usize];
    f.read_at(&mut buf, 0)
        .map_err(|e| Error::io(format!("reading {name}"), e))?;
    Ok(buf)
}
