//! The cache tier: copies of chunk records on a fast directory in front of the segment store.
//!
//! Owns: the cache directory (`cache.dat`, `cache.idx`, see docs/FORMAT.md "Cache tier"), the
//! admission and eviction policy (S3-FIFO, docs/CACHE.md), the background writer that fills
//! slots, and the cache's counters. The pool's `cache.conf` (whether and where a cache is
//! attached) is written by `condense_engine::pool`; its encoding is [`CacheConf`].
//!
//! Invariants:
//! - An entry holds a chunk record exactly as stored in its segment (header and compressed,
//!   in an encrypted pool sealed, payload), so the cache never holds plaintext of an encrypted
//!   pool and a hit is decoded by the same code as a segment read.
//! - An entry is served only if its bytes match the checksum in the index, the record decodes
//!   for the chunk id asked for, and its fingerprint is the one the chunk table names. A chunk
//!   id reused by another chunk, a slot overwritten by a crash or a flipped bit is a miss
//!   (counted in `corrupt` when the bytes fail their checksum), never wrong data.
//! - The cache is writethrough: it holds nothing the pool does not, so losing the whole
//!   directory loses nothing; every error of the cache device is a miss and a warning.
//! - Promotions never wait for the cache device: they go through a bounded queue to one writer
//!   thread and are skipped when the queue is full. An entry is served only after its bytes
//!   are written ([`Entry::ready`]).
//! - Crash order: the writer logs the removal of a slot's old entry (synced) before it
//!   overwrites the slot, and logs the new entry only after the data is synced; so after a
//!   crash or `kill -9` the index names only slots that hold what it says.

use crate::io::{Dir, File};
use condense_format::error::{Error, Result};
use condense_format::{decode_record, Fingerprint, Location, RECORD_HEADER_BYTES};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

pub use condense_format::cache_tier::{
    data_header, index_header, insert_record, parse_index, record, KIND_COUNTERS, KIND_REMOVE,
    N_COUNTERS,
};
use condense_format::cache_tier::{page_fp, page_key};
pub use condense_format::cache_tier::{
    CacheConf, CacheMode, CACHE_CONF_NAME, CACHE_DATA_HEADER_BYTES, CACHE_DATA_MAGIC,
    CACHE_INDEX_HEADER_BYTES, CACHE_INDEX_MAGIC, CACHE_INDEX_RECORD_BYTES, CACHE_VERSION,
};

/// The slots holding cached records.
pub const CACHE_DATA_NAME: &str = "cache.dat";
/// The append-only log of which record is in which slot, and the counters.
pub const CACHE_INDEX_NAME: &str = "cache.idx";
const CACHE_INDEX_TMP: &str = "cache.idx.tmp";

/// Room for the sealing overhead of an encrypted pool in a slot.
const SLOT_SLACK: u64 = 64;
/// The smallest cache: this many slots.
pub const CACHE_SLOTS_MIN: u64 = 16;
/// Promotions waiting for the writer; more are skipped. 16384 records (≤ 64 MiB of 4 KiB
/// blocks) absorb a slow device read at full speed while the writer syncs: at 4096, 1.2 % of
/// a 2.5 GiB first pass was skipped, and the second pass paid for it on the slow device.
const QUEUE_MAX: usize = 16384;
/// Promotions the writer takes per round (two syncs of the cache device per round).
const WRITER_BATCH: usize = 1024;
/// Share of the slots for the small (probationary) FIFO, in percent.
const SMALL_PERCENT: u64 = 10;

/// The cache's counters and figures (`condense cache stats`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Chunks served from the cache, and their bytes (block bytes, as the volume reads them).
    pub hits: u64,
    pub hit_bytes: u64,
    /// Chunks read from the segments while the cache was attached, and their bytes.
    pub misses: u64,
    pub miss_bytes: u64,
    /// Records admitted into the cache / evicted from it.
    pub promotions: u64,
    pub demotions: u64,
    /// Entries whose bytes failed their checks (dropped, read from the segments instead).
    pub corrupt: u64,
    /// Bytes in use (slots, and in writeback mode staged segments), and the configured size.
    pub used_bytes: u64,
    /// Writeback: bytes of segments not yet destaged to the pool directory.
    pub dirty_bytes: u64,
    pub size_bytes: u64,
    /// Writeback: segments destaged since the pool was opened, and their bytes.
    pub destaged_segments: u64,
    pub destaged_bytes: u64,
    /// Metadata page faults (pages not in RAM) served from the cache / read from meta.dat,
    /// since the pool was opened.
    pub meta_hits: u64,
    pub meta_misses: u64,
    pub mode: String,
    pub dir: String,
}

const C_HITS: usize = 0;
const C_HIT_BYTES: usize = 1;
const C_MISSES: usize = 2;
const C_MISS_BYTES: usize = 3;
const C_PROMOTIONS: usize = 4;
const C_DEMOTIONS: usize = 5;
const C_CORRUPT: usize = 6;

struct Entry {
    slot: u32,
    fp: Fingerprint,
    len: u32,
    crc: u32,
    /// Hits since admission or the last pass of the main FIFO (0..=3).
    freq: u8,
    main: bool,
    /// The bytes are in the slot (false while the promotion waits for the writer).
    ready: bool,
    gen: u64,
}

#[derive(Default)]
struct Policy {
    map: HashMap<u64, Entry>,
    /// (id, gen), oldest first; entries no longer in `map` with that gen are skipped.
    small: VecDeque<(u64, u64)>,
    main: VecDeque<(u64, u64)>,
    small_len: usize,
    main_len: usize,
    ghost: VecDeque<u64>,
    ghost_set: HashSet<u64>,
    free: Vec<u32>,
    next_gen: u64,
}

impl Policy {
    /// Forget an entry; its slot becomes free (its place in a FIFO is skipped later).
    fn remove(&mut self, id: u64) {
        if let Some(e) = self.map.remove(&id) {
            if e.main {
                self.main_len -= 1;
            } else {
                self.small_len -= 1;
            }
            self.free.push(e.slot);
        }
    }
}

enum Job {
    Write {
        slot: u32,
        gen: u64,
        id: u64,
        fp: Fingerprint,
        crc: u32,
        bytes: Vec<u8>,
    },
    Remove {
        slot: u32,
    },
}

/// What the cache's handles and its background writer share: the files, the index, the
/// admission policy and the counters.
struct CacheCore {
    dir: Arc<dyn Dir>,
    data: Arc<dyn File>,
    index: Mutex<IndexFile>,
    slot_bytes: u64,
    slots: u32,
    size_bytes: u64,
    mode: CacheMode,
    policy: Mutex<Policy>,
    counters: [AtomicU64; N_COUNTERS],
    queued: AtomicUsize,
    uuid: [u8; 16],
    /// Metadata page faults served from the cache / from meta.dat (since open).
    page_hits: AtomicU64,
    page_misses: AtomicU64,
}

struct IndexFile {
    file: Arc<dyn File>,
    len: u64,
    records: u64,
}

/// An open cache tier.
pub struct ChunkCache {
    shared: Arc<CacheCore>,
    tx: Mutex<Option<SyncSender<Job>>>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
}

fn plock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn crc(b: &[u8]) -> u32 {
    crc32c::crc32c(b)
}

/// How a writeback cache of `size_bytes` is shared: (bytes for chunk slots, most bytes of
/// staged segments). A quarter is for staged writes, the rest caches reads.
pub fn writeback_split(size_bytes: u64) -> (u64, u64) {
    let staging = size_bytes / 4;
    (size_bytes - staging, staging)
}

/// The bytes of chunk slots a cache of this configuration has.
pub fn slot_budget(conf: &CacheConf) -> u64 {
    match conf.mode {
        CacheMode::WriteThrough => conf.size_bytes,
        CacheMode::WriteBack => writeback_split(conf.size_bytes).0,
    }
}

/// Bytes of one slot: the largest record of a block (raw payload, sealing overhead).
pub fn slot_bytes_for(block_size: u32) -> u64 {
    (RECORD_HEADER_BYTES as u64 + u64::from(block_size) + SLOT_SLACK).div_ceil(64) * 64
}

/// The figures of a cache that is not open (a read-only open of its pool): read from its
/// index without changing anything. Zero counts when the directory or index is unreadable.
pub fn peek_stats(dir: Option<&dyn Dir>, conf: &CacheConf, block_size: u32) -> CacheStats {
    let slot_bytes = slot_bytes_for(block_size);
    let slots = (slot_budget(conf).saturating_sub(CACHE_DATA_HEADER_BYTES) / slot_bytes) as u32;
    let parsed = dir.and_then(|d| {
        let f = d.open(CACHE_INDEX_NAME, false).ok()?;
        let len = f.len().ok()?;
        let mut buf = vec![0u8; len as usize];
        f.read_at(&mut buf, 0).ok()?;
        (buf.get(..8) == Some(&CACHE_INDEX_MAGIC[..])).then(|| parse_index(&buf, slots))
    });
    let (c, used) = parsed.map_or(([0; N_COUNTERS], 0), |p| (p.counters, p.slots.len() as u64));
    CacheStats {
        hits: c[C_HITS],
        hit_bytes: c[C_HIT_BYTES],
        misses: c[C_MISSES],
        miss_bytes: c[C_MISS_BYTES],
        promotions: c[C_PROMOTIONS],
        demotions: c[C_DEMOTIONS],
        corrupt: c[C_CORRUPT],
        used_bytes: used * slot_bytes,
        dirty_bytes: 0,
        size_bytes: conf.size_bytes,
        destaged_segments: 0,
        destaged_bytes: 0,
        meta_hits: 0,
        meta_misses: 0,
        mode: conf.mode.as_str().to_string(),
        dir: conf.path.clone(),
    }
}

/// What a cache's index held at open: the entries (as the policy's main queue), the
/// counters, and the whole records' extent.
struct Loaded {
    policy: Policy,
    counters: [u64; N_COUNTERS],
    good_len: u64,
    records: u64,
}

impl Loaded {
    fn empty() -> Loaded {
        Loaded {
            policy: Policy::default(),
            counters: [0; N_COUNTERS],
            good_len: CACHE_INDEX_HEADER_BYTES as u64,
            records: 0,
        }
    }
}

type IoError<'a> = &'a dyn Fn(&str, std::io::Error) -> Error;

/// Read the index log of a cache whose headers match, keep its entries that fit their
/// slots, and cut off its torn tail.
fn load_index(index: &dyn File, slots: u32, slot_bytes: u64, io: IoError<'_>) -> Result<Loaded> {
    let len = index.len().map_err(|e| io("reading cache.idx", e))?;
    let mut buf = vec![0u8; len as usize];
    index
        .read_at(&mut buf, 0)
        .map_err(|e| io("reading cache.idx", e))?;
    let parsed = parse_index(&buf, slots);
    let mut policy = Policy::default();
    let mut slots_sorted: Vec<_> = parsed.slots.into_iter().collect();
    slots_sorted.sort_by_key(|(s, _)| *s);
    for (slot, (id, fp, len, c)) in slots_sorted {
        if u64::from(len) > slot_bytes {
            // Longer than its slot: not an entry this cache wrote (the slot is free).
            continue;
        }
        let gen = policy.next_gen;
        policy.next_gen += 1;
        // A second entry for the same id (should not happen) replaces the first.
        policy.remove(id);
        policy.map.insert(
            id,
            Entry {
                slot,
                fp,
                len,
                crc: c,
                freq: 0,
                main: true,
                ready: true,
                gen,
            },
        );
        policy.main.push_back((id, gen));
        policy.main_len += 1;
    }
    index
        .set_len(parsed.good_len)
        .map_err(|e| io("truncating cache.idx", e))?;
    Ok(Loaded {
        policy,
        counters: parsed.counters,
        good_len: parsed.good_len,
        records: parsed.records,
    })
}

/// A new cache, or another pool's or size's: start empty (header last: until it is
/// written, the old contents are never trusted).
fn reset_files(
    dir: &dyn Dir,
    data: &dyn File,
    index: &dyn File,
    dh: &[u8],
    ih: &[u8],
    io: IoError<'_>,
) -> Result<()> {
    index
        .set_len(0)
        .and_then(|_| index.write_at(ih, 0))
        .and_then(|_| index.sync())
        .map_err(|e| io("writing cache.idx", e))?;
    data.set_len(0)
        .and_then(|_| data.set_len(CACHE_DATA_HEADER_BYTES))
        .and_then(|_| data.write_at(dh, 0))
        .and_then(|_| data.sync())
        .map_err(|e| io("writing cache.dat", e))?;
    dir.sync_dir()
        .map_err(|e| io("syncing the cache directory", e))
}

impl ChunkCache {
    /// Open (or create, or reset when it belongs to another pool or another size) the cache in
    /// `dir` for a pool with `uuid` and `block_size`.
    pub fn open(
        dir: Arc<dyn Dir>,
        size_bytes: u64,
        mode: CacheMode,
        uuid: [u8; 16],
        block_size: u32,
    ) -> Result<ChunkCache> {
        let slot_bytes = slot_bytes_for(block_size);
        let slots = size_bytes.saturating_sub(CACHE_DATA_HEADER_BYTES) / slot_bytes;
        if slots < CACHE_SLOTS_MIN {
            return Err(Error::Invalid(format!(
                "cache size {size_bytes} bytes is too small: give at least {} bytes",
                CACHE_DATA_HEADER_BYTES + CACHE_SLOTS_MIN * slot_bytes
            )));
        }
        let slots = u32::try_from(slots)
            .map_err(|_| Error::Invalid(format!("cache size {size_bytes} bytes is too large")))?;
        let where_ = dir.describe();
        let io = |what: &str, e| Error::io(format!("{what} in cache directory {where_}"), e);
        let data = dir
            .open(CACHE_DATA_NAME, true)
            .map_err(|e| io("opening cache.dat", e))?;
        let index = dir
            .open(CACHE_INDEX_NAME, true)
            .map_err(|e| io("opening cache.idx", e))?;
        let dh = data_header(&uuid, slot_bytes, slots);
        let ih = index_header(&uuid, slot_bytes, slots);
        let mut found = vec![0u8; 64];
        let data_ok = data.read_at(&mut found, 0).is_ok() && found == dh;
        let mut found_i = vec![0u8; 64];
        let index_ok = index.read_at(&mut found_i, 0).is_ok() && found_i == ih;
        let loaded = if data_ok && index_ok {
            load_index(&*index, slots, slot_bytes, &io)?
        } else {
            reset_files(&*dir, &*data, &*index, &dh, &ih, &io)?;
            Loaded::empty()
        };
        let Loaded {
            mut policy,
            counters,
            good_len,
            records,
        } = loaded;
        let used: HashSet<u32> = policy.map.values().map(|e| e.slot).collect();
        policy.free = (0..slots).rev().filter(|s| !used.contains(s)).collect();
        let shared = Arc::new(CacheCore {
            dir,
            data,
            index: Mutex::new(IndexFile {
                file: index,
                len: good_len,
                records,
            }),
            slot_bytes,
            slots,
            size_bytes,
            mode,
            policy: Mutex::new(policy),
            counters: counters.map(AtomicU64::new),
            queued: AtomicUsize::new(0),
            uuid,
            page_hits: AtomicU64::new(0),
            page_misses: AtomicU64::new(0),
        });
        let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE_MAX);
        let w = shared.clone();
        let writer = std::thread::Builder::new()
            .name("condense-cache".into())
            .spawn(move || w.writer(rx))
            .map_err(|e| Error::io("starting the cache writer thread", e))?;
        Ok(ChunkCache {
            shared,
            tx: Mutex::new(Some(tx)),
            writer: Mutex::new(Some(writer)),
        })
    }

    /// The record of chunk `id` if the cache holds it, checked (see the module invariants).
    pub fn lookup(&self, id: u64, fp: &Fingerprint, loc: &Location) -> Option<Vec<u8>> {
        self.lookup_with(id, fp, loc.record_bytes(), |buf| {
            decode_record(buf, id, loc).is_ok_and(|(f, _)| f == *fp)
        })
    }

    /// Whether the cache holds chunk `id` with fingerprint `fp` (its slot unread: a lookup
    /// may still find it damaged).
    pub fn holds(&self, id: u64, fp: &Fingerprint) -> bool {
        plock(&self.shared.policy)
            .map
            .get(&id)
            .is_some_and(|e| e.ready && e.fp == *fp)
    }

    /// The stored bytes of the metadata page at 64-byte unit `page` of meta.dat, if the cache
    /// holds them for a page with this CRC and length (pages are copy-on-write: a unit reused
    /// for another page has another CRC, so a stale entry is never served).
    pub fn lookup_page(&self, page: u64, crc32: u32, units: u16) -> Option<Vec<u8>> {
        let bytes = u64::from(units) * 64;
        let got = self.lookup_with(page_key(page), &page_fp(crc32, units), bytes, |buf| {
            crc(buf) == crc32
        });
        let c = if got.is_some() {
            &self.shared.page_hits
        } else {
            &self.shared.page_misses
        };
        c.fetch_add(1, Ordering::Relaxed);
        got
    }

    /// Offer a metadata page's stored bytes, just read from meta.dat and checked.
    pub fn offer_page(&self, page: u64, crc32: u32, stored: &[u8]) {
        let units = (stored.len() / 64) as u16;
        self.offer(page_key(page), &page_fp(crc32, units), stored);
    }

    fn lookup_with(
        &self,
        id: u64,
        fp: &Fingerprint,
        want_len: u64,
        check: impl FnOnce(&[u8]) -> bool,
    ) -> Option<Vec<u8>> {
        let s = &self.shared;
        let (slot, gen, len, want_crc) = {
            let mut p = plock(&s.policy);
            let e = p.map.get_mut(&id)?;
            if !e.ready {
                return None;
            }
            if e.fp != *fp || u64::from(e.len) != want_len {
                // The id now names another chunk: the entry is stale.
                let slot = e.slot;
                p.remove(id);
                drop(p);
                self.send(Job::Remove { slot });
                return None;
            }
            e.freq = (e.freq + 1).min(3);
            (e.slot, e.gen, e.len, e.crc)
        };
        let mut buf = vec![0u8; len as usize];
        let read = s.data.read_at(&mut buf, s.slot_offset(slot));
        let good = read.is_ok() && crc(&buf) == want_crc && check(&buf);
        if good {
            return Some(buf);
        }
        let mut p = plock(&s.policy);
        if p.map.get(&id).is_some_and(|e| e.gen == gen) {
            // Not a race with a reuse of the slot: the bytes are bad.
            p.remove(id);
            drop(p);
            s.counters[C_CORRUPT].fetch_add(1, Ordering::Relaxed);
            match read {
                Err(e) => tracing::warn!(
                    "cache: reading slot {slot} of {}: {e}; reading chunk {id} from the pool",
                    s.dir.describe()
                ),
                Ok(()) => tracing::warn!(
                    "cache: slot {slot} of {} failed its checks (chunk {id}); dropped, reading from the pool",
                    s.dir.describe()
                ),
            }
            self.send(Job::Remove { slot });
        }
        None
    }

    /// Offer a record just read from a segment for admission (S3-FIFO; never blocks on the
    /// cache device: skipped when the writer's queue is full).
    pub fn offer(&self, id: u64, fp: &Fingerprint, record: &[u8]) {
        let s = &self.shared;
        if record.len() as u64 > s.slot_bytes || s.queued.load(Ordering::Relaxed) >= QUEUE_MAX {
            return;
        }
        let job = {
            let mut p = plock(&s.policy);
            if let Some(e) = p.map.get(&id) {
                if e.fp == *fp {
                    return; // cached, or on its way
                }
                p.remove(id);
            }
            let Some(slot) = s.take_slot(&mut p) else {
                return;
            };
            let ghost = p.ghost_set.remove(&id);
            let gen = p.next_gen;
            p.next_gen += 1;
            p.map.insert(
                id,
                Entry {
                    slot,
                    fp: *fp,
                    len: record.len() as u32,
                    crc: crc(record),
                    freq: 0,
                    main: ghost,
                    ready: false,
                    gen,
                },
            );
            if ghost {
                p.main.push_back((id, gen));
                p.main_len += 1;
            } else {
                p.small.push_back((id, gen));
                p.small_len += 1;
            }
            Job::Write {
                slot,
                gen,
                id,
                fp: *fp,
                crc: crc(record),
                bytes: record.to_vec(),
            }
        };
        s.counters[C_PROMOTIONS].fetch_add(1, Ordering::Relaxed);
        self.send(job);
    }

    /// Count chunk reads served from the cache and from the segments.
    pub fn count(&self, hits: u64, misses: u64, block_bytes: u64) {
        let c = &self.shared.counters;
        c[C_HITS].fetch_add(hits, Ordering::Relaxed);
        c[C_HIT_BYTES].fetch_add(hits * block_bytes, Ordering::Relaxed);
        c[C_MISSES].fetch_add(misses, Ordering::Relaxed);
        c[C_MISS_BYTES].fetch_add(misses * block_bytes, Ordering::Relaxed);
    }

    fn send(&self, job: Job) {
        let s = &self.shared;
        if let Some(tx) = plock(&self.tx).as_ref() {
            s.queued.fetch_add(1, Ordering::Relaxed);
            if tx.try_send(job).is_err() {
                s.queued.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    pub fn stats(&self) -> CacheStats {
        let s = &self.shared;
        let c = |i: usize| s.counters[i].load(Ordering::Relaxed);
        let used = plock(&s.policy).map.len() as u64 * s.slot_bytes;
        CacheStats {
            hits: c(C_HITS),
            hit_bytes: c(C_HIT_BYTES),
            misses: c(C_MISSES),
            miss_bytes: c(C_MISS_BYTES),
            promotions: c(C_PROMOTIONS),
            demotions: c(C_DEMOTIONS),
            corrupt: c(C_CORRUPT),
            used_bytes: used,
            dirty_bytes: 0,
            size_bytes: s.size_bytes,
            destaged_segments: 0,
            destaged_bytes: 0,
            meta_hits: s.page_hits.load(Ordering::Relaxed),
            meta_misses: s.page_misses.load(Ordering::Relaxed),
            mode: s.mode.as_str().to_string(),
            dir: s.dir.describe(),
        }
    }

    /// Number of slots (entries the cache can hold).
    pub fn slots(&self) -> u32 {
        self.shared.slots
    }

    /// Wait until every queued promotion is written (tests, and before stats in scripts).
    pub fn drain(&self) {
        for _ in 0..2000 {
            if self.shared.queued.load(Ordering::Relaxed) == 0 {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Stop the writer after it has written what is queued, and write a compact index with
    /// the counters (synced). Later promotions are dropped.
    pub fn close(&self) -> Result<()> {
        drop(plock(&self.tx).take());
        if let Some(w) = plock(&self.writer).take() {
            let _ = w.join();
        }
        self.shared.compact()
    }
}

impl Drop for ChunkCache {
    fn drop(&mut self) {
        drop(plock(&self.tx).take());
        if let Some(w) = plock(&self.writer).take() {
            let _ = w.join();
        }
    }
}

impl CacheCore {
    fn slot_offset(&self, slot: u32) -> u64 {
        CACHE_DATA_HEADER_BYTES + u64::from(slot) * self.slot_bytes
    }

    /// A free slot, evicting (S3-FIFO) when there is none.
    fn take_slot(&self, p: &mut Policy) -> Option<u32> {
        if let Some(s) = p.free.pop() {
            return Some(s);
        }
        let small_target = (u64::from(self.slots) * SMALL_PERCENT / 100).max(1) as usize;
        let ghost_max = self.slots as usize;
        // Each pass of the main FIFO lowers a frequency, so this ends.
        for _ in 0..(8 * self.slots as usize + 16) {
            if p.small_len >= small_target || p.main_len == 0 {
                let (id, gen) = p.small.pop_front()?;
                let Some(e) = p.map.get_mut(&id).filter(|e| e.gen == gen && !e.main) else {
                    continue;
                };
                p.small_len -= 1;
                if e.freq > 0 {
                    // Read again while probationary: into the main FIFO.
                    e.freq = 0;
                    e.main = true;
                    p.main.push_back((id, gen));
                    p.main_len += 1;
                    continue;
                }
                let slot = e.slot;
                p.map.remove(&id);
                if p.ghost_set.insert(id) {
                    p.ghost.push_back(id);
                }
                while p.ghost.len() > ghost_max {
                    if let Some(g) = p.ghost.pop_front() {
                        p.ghost_set.remove(&g);
                    }
                }
                self.counters[C_DEMOTIONS].fetch_add(1, Ordering::Relaxed);
                return Some(slot);
            }
            let (id, gen) = p.main.pop_front()?;
            let Some(e) = p.map.get_mut(&id).filter(|e| e.gen == gen && e.main) else {
                continue;
            };
            if e.freq > 0 {
                e.freq -= 1;
                p.main.push_back((id, gen));
                continue;
            }
            let slot = e.slot;
            p.map.remove(&id);
            p.main_len -= 1;
            self.counters[C_DEMOTIONS].fetch_add(1, Ordering::Relaxed);
            return Some(slot);
        }
        None
    }

    fn append_index(
        &self,
        recs: &[[u8; CACHE_INDEX_RECORD_BYTES]],
        sync: bool,
    ) -> std::io::Result<()> {
        let mut ix = plock(&self.index);
        if !recs.is_empty() {
            let bytes = recs.concat();
            ix.file.write_at(&bytes, ix.len)?;
            ix.len += bytes.len() as u64;
            ix.records += recs.len() as u64;
        }
        if sync {
            ix.file.sync()?;
        }
        Ok(())
    }

    fn counters_record(&self) -> [u8; CACHE_INDEX_RECORD_BYTES] {
        let mut b = Vec::with_capacity(N_COUNTERS * 8);
        for c in &self.counters {
            b.extend_from_slice(&c.load(Ordering::Relaxed).to_le_bytes());
        }
        record(KIND_COUNTERS, &b)
    }

    fn counters_now(&self) -> [u64; N_COUNTERS] {
        let mut v = [0u64; N_COUNTERS];
        for (i, c) in self.counters.iter().enumerate() {
            v[i] = c.load(Ordering::Relaxed);
        }
        v
    }

    fn writer(&self, rx: Receiver<Job>) {
        let mut saved = self.counters_now();
        loop {
            let first = match rx.recv_timeout(Duration::from_secs(1)) {
                Ok(j) => j,
                Err(RecvTimeoutError::Timeout) => {
                    let now = self.counters_now();
                    if now != saved {
                        saved = now;
                        if let Err(e) = self.append_index(&[self.counters_record()], false) {
                            tracing::warn!(
                                "cache: writing cache.idx in {}: {e}",
                                self.dir.describe()
                            );
                        }
                        self.maybe_compact();
                    }
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    if self.counters_now() != saved {
                        let _ = self.append_index(&[self.counters_record()], false);
                    }
                    return;
                }
            };
            let mut batch = vec![first];
            while batch.len() < WRITER_BATCH {
                match rx.try_recv() {
                    Ok(j) => batch.push(j),
                    Err(_) => break,
                }
            }
            let n = batch.len();
            if let Err(e) = self.write_batch(batch) {
                tracing::warn!(
                    "cache: writing to {} failed: {e}; those chunks stay uncached",
                    self.dir.describe()
                );
            }
            self.queued.fetch_sub(n, Ordering::Relaxed);
            self.maybe_compact();
        }
    }

    fn write_batch(&self, batch: Vec<Job>) -> std::io::Result<()> {
        let mut removes = Vec::new();
        let mut writes = Vec::new();
        {
            let p = plock(&self.policy);
            for j in batch {
                match j {
                    Job::Remove { slot } => removes.push(record(KIND_REMOVE, &slot.to_le_bytes())),
                    Job::Write { gen, id, .. } if p.map.get(&id).is_some_and(|e| e.gen == gen) => {
                        writes.push(j)
                    }
                    Job::Write { .. } => {}
                }
            }
        }
        // 1. The slots' old entries leave the index (durably) before the slots change.
        for j in &writes {
            if let Job::Write { slot, .. } = j {
                removes.push(record(KIND_REMOVE, &slot.to_le_bytes()));
            }
        }
        if writes.is_empty() {
            return self.append_index(&removes, false);
        }
        self.append_index(&removes, true)?;
        // 2. The data, synced.
        for j in &writes {
            if let Job::Write { slot, bytes, .. } = j {
                self.data.write_at(bytes, self.slot_offset(*slot))?;
            }
        }
        self.data.sync()?;
        // 3. The new entries (made durable by the next sync; a loss only costs warmth).
        let inserts: Vec<_> = writes
            .iter()
            .filter_map(|j| match j {
                Job::Write {
                    slot,
                    id,
                    fp,
                    crc,
                    bytes,
                    ..
                } => Some(insert_record(*slot, *id, fp, bytes.len() as u32, *crc)),
                Job::Remove { .. } => None,
            })
            .collect();
        self.append_index(&inserts, false)?;
        let mut p = plock(&self.policy);
        for j in &writes {
            if let Job::Write { id, gen, .. } = j {
                if let Some(e) = p.map.get_mut(id).filter(|e| e.gen == *gen) {
                    e.ready = true;
                }
            }
        }
        Ok(())
    }

    fn maybe_compact(&self) {
        let records = plock(&self.index).records;
        if records > 4 * u64::from(self.slots) + 4096 {
            if let Err(e) = self.compact() {
                tracing::warn!("cache: rewriting cache.idx in {}: {e}", self.dir.describe());
            }
        }
    }

    /// Rewrite the index as one entry per ready slot plus the counters (temp file, sync,
    /// rename, sync the directory).
    fn compact(&self) -> Result<()> {
        let where_ = self.dir.describe();
        let io = |what: &str, e| Error::io(format!("{what} in cache directory {where_}"), e);
        let mut ix = plock(&self.index);
        let mut body = index_header(&self.uuid, self.slot_bytes, self.slots);
        {
            let p = plock(&self.policy);
            let mut entries: Vec<_> = p.map.iter().filter(|(_, e)| e.ready).collect();
            entries.sort_by_key(|(_, e)| e.slot);
            for (id, e) in entries {
                body.extend_from_slice(&insert_record(e.slot, *id, &e.fp, e.len, e.crc));
            }
        }
        body.extend_from_slice(&self.counters_record());
        let f = self
            .dir
            .open(CACHE_INDEX_TMP, true)
            .map_err(|e| io("creating cache.idx.tmp", e))?;
        f.set_len(0)
            .and_then(|_| f.write_at(&body, 0))
            .and_then(|_| f.sync())
            .map_err(|e| io("writing cache.idx.tmp", e))?;
        self.dir
            .rename(CACHE_INDEX_TMP, CACHE_INDEX_NAME)
            .map_err(|e| io("renaming cache.idx.tmp", e))?;
        self.dir
            .sync_dir()
            .map_err(|e| io("syncing the cache directory", e))?;
        ix.file = f;
        ix.len = body.len() as u64;
        ix.records = ((body.len() - CACHE_INDEX_HEADER_BYTES) / CACHE_INDEX_RECORD_BYTES) as u64;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by fuzzing (cache_index target, an out-of-memory report): an index entry's record
    /// length was trusted at open, and a lookup read that many bytes (2.7 GiB for the fuzzer's
    /// entry) from a slot of a few KiB. An entry longer than its slot is now dropped at open.
    #[test]
    fn an_index_entry_longer_than_its_slot_is_dropped() -> Result<()> {
        use crate::sim::{SimDir, SimHandle};
        let uuid = [4; 16];
        let slot_bytes = slot_bytes_for(4096);
        let slots = 16u32;
        let dir = SimHandle(SimDir::new());
        let mut index = index_header(&uuid, slot_bytes, slots);
        index.extend_from_slice(&insert_record(0, 1, &[1; 16], 4128, 7));
        index.extend_from_slice(&insert_record(1, 2, &[2; 16], 0xa226_3f6d, 7));
        for (name, bytes) in [
            (CACHE_INDEX_NAME, index),
            (CACHE_DATA_NAME, data_header(&uuid, slot_bytes, slots)),
        ] {
            dir.open(name, true)
                .and_then(|f| f.write_at(&bytes, 0))
                .map_err(|e| Error::io(name, e))?;
        }
        let size = CACHE_DATA_HEADER_BYTES + u64::from(slots) * slot_bytes;
        let c = ChunkCache::open(Arc::new(dir), size, CacheMode::WriteThrough, uuid, 4096)?;
        assert_eq!(c.stats().used_bytes, slot_bytes, "only the entry that fits");
        c.close()
    }
}
