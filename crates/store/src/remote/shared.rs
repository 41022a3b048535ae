//! What the bucket's directory, its files, the write-ahead objects and the lease share: the
//! store, its health (the last failed request), the read-only and lease-lost gates of every
//! write, and the LRU of blocks read from objects ([`Shared`]).
//!
//! Invariants:
//! - Every PUT and DELETE goes through [`Shared::put`] or [`Shared::delete`], which refuse
//!   on a read-only open, once the lease is lost, and past the lease's write fence
//!   ([`super::lease`]).
//! - A PUT or DELETE of an object forgets the blocks read of it, so a read never returns
//!   bytes of an object's older version that this process replaced.
//! - Read-ahead is bounded: at most [`AHEAD_BLOCKS`] blocks ahead of a sequential reader, and
//!   at most [`PREFETCHES_IN_FLIGHT`] GETs in flight for the whole process. A reader that
//!   needs a block being prefetched waits for that GET instead of asking again; if the
//!   prefetch failed it asks itself, so an error reaches the reader that needs the bytes.
//! - Hints ([`Shared::will_need`], the pool's read-ahead through a volume's block map) share
//!   those GET slots and hold at most [`HINTED_BLOCKS_MAX`] blocks queued or in flight; a
//!   hint never fails and never makes its caller wait.

use super::conf::to_io;
use super::names::{Bucket, Names};
use crate::io::StoreUnavailable;
use condense_format::Durability;
use condense_object_store::ObjectBackend;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Reads of an object fetch aligned blocks of this many bytes, kept in a small LRU: one block
/// (one GET) for a read out of order, [`READ_AHEAD_BLOCKS`] in one GET for a read that
/// continues the previous one (a request costs ~45-90 ms on Garage whatever its size).
const READ_BLOCK_BYTES: u64 = 256 << 10;
const READ_AHEAD_BLOCKS: u64 = 16;
/// Blocks kept by the read LRU (64 MiB).
const READ_BLOCKS_KEPT: usize = 256;
/// Blocks of one background read-ahead GET (4 MiB).
const PREFETCH_BLOCKS: u64 = 16;
/// How far a sequential reader is read ahead, in blocks (16 MiB: four GETs of
/// [`PREFETCH_BLOCKS`], fetched in the background while the reader consumes the blocks
/// before them). One GET at a time gave a cold sequential read ~80 MB/s on Garage: a
/// request's latency, not the bandwidth, set the pace.
const AHEAD_BLOCKS: u64 = 4 * PREFETCH_BLOCKS;
/// Background read-ahead GETs in flight at once, for all objects.
const PREFETCHES_IN_FLIGHT: usize = 8;
/// Blocks that hints may hold queued or in flight (32 MiB: half the LRU, so what they fetch
/// is not evicted before it is read).
const HINTED_BLOCKS_MAX: u64 = READ_BLOCKS_KEPT as u64 / 2;

/// Writes stop this long after the start of the last lease renewal that succeeded (the lease's
/// write fence, lease.rs): the rest of the lease's 30 s covers clocks that disagree by a few
/// seconds and a request in flight.
pub(super) const WRITE_FENCE: Duration = Duration::from_secs(15);

pub(super) struct Shared {
    pub(super) store: Arc<dyn ObjectBackend>,
    pub(super) url: String,
    pub(super) read_only: bool,
    /// The pool's durability is `remote`: journal and segment files opened from now on log
    /// their syncs as write-ahead objects ([`WalDir`]). Changed only with the stored value
    /// (`condense_engine::pool::Pool::set_durability`).
    pub(super) remote_durability: AtomicBool,
    pub(super) lease_lost: AtomicBool,
    /// Writes stop at this instant unless the lease is renewed first (`None`: no lease yet).
    pub(super) fence: Mutex<Option<Instant>>,
    /// Which object each pool file is.
    pub(super) names: Names,
    /// The last failed request, and when; cleared by the next success.
    pub(super) last_error: Mutex<Option<(Instant, String)>>,
    pub(super) last_upload: Mutex<Option<Instant>>,
    pub(super) blocks: Mutex<ReadBlocks>,
    /// Signalled whenever a read-ahead GET ends (its blocks are in `blocks`, or it failed).
    pub(super) prefetched: Condvar,
}

impl Shared {
    pub(super) fn durability(&self) -> Durability {
        if self.remote_durability.load(Ordering::Relaxed) {
            Durability::Remote
        } else {
            Durability::Local
        }
    }

    /// Use `d` for the files opened from now on (the caller has stored it in the pool).
    pub(super) fn use_durability(&self, d: Durability) {
        self.remote_durability
            .store(d == Durability::Remote, Ordering::Relaxed);
    }

    pub(super) fn note<T>(&self, r: condense_object_store::Result<T>) -> io::Result<T> {
        match r {
            Ok(v) => {
                let mut e = self.last_error.lock().unwrap_or_else(|e| e.into_inner());
                if e.is_some() {
                    tracing::info!("object store {} answers again", self.url);
                    *e = None;
                }
                Ok(v)
            }
            Err(err) if err.is_not_found() => Err(to_io(err)),
            Err(err) => {
                let msg = err.to_string();
                tracing::warn!("object store {}: {msg}", self.url);
                let mut e = self.last_error.lock().unwrap_or_else(|e| e.into_inner());
                if e.is_none() {
                    *e = Some((Instant::now(), msg));
                } else if let Some((_, m)) = e.as_mut() {
                    *m = msg;
                }
                Err(to_io(err))
            }
        }
    }

    /// Whether this open may write the bucket now: not read-only, the lease not lost, and
    /// within the write fence. Past the fence the refusal is a [`StoreUnavailable`]: nothing
    /// changed and the write can be retried once the lease is renewed (a checkpoint waits for
    /// it instead of poisoning the pool).
    pub(super) fn may_write(&self, what: &str) -> io::Result<()> {
        self.may_write_local(what)?;
        let fence = *self.fence.lock().unwrap_or_else(|e| e.into_inner());
        if fence.is_some_and(|t| Instant::now() > t) {
            return Err(io::Error::other(StoreUnavailable(format!(
                "{what}: the lease of {} was not renewed for {} s (is the store reachable?); \
                 writes resume once it is",
                self.url,
                WRITE_FENCE.as_secs()
            ))));
        }
        Ok(())
    }

    /// Whether this open may write its local copy of a pool file (the `meta.dat` mirror):
    /// not read-only, the lease not lost. The fence is the upload's to check.
    pub(super) fn may_write_local(&self, what: &str) -> io::Result<()> {
        if self.read_only {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{what}: this host opened {} read-only", self.url),
            ));
        }
        if self.lease_lost.load(Ordering::Relaxed) {
            return Err(io::Error::other(format!(
                "{what}: the lease of {} was taken by another host; this host no longer writes the pool",
                self.url
            )));
        }
        Ok(())
    }

    pub(super) fn set_fence(&self, until: Option<Instant>) {
        *self.fence.lock().unwrap_or_else(|e| e.into_inner()) = until;
    }

    pub(super) fn put(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        self.may_write(&format!("uploading {name}"))?;
        self.blocks_forget(name);
        self.note(self.store.put(name, bytes))
    }

    pub(super) fn delete(&self, name: &str) -> io::Result<()> {
        self.may_write(&format!("deleting {name}"))?;
        self.blocks_forget(name);
        self.note(self.store.delete(name))
    }

    pub(super) fn blocks_forget(&self, name: &str) {
        self.blocks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .forget(name);
    }

    /// `len` bytes at `offset` of object `name` (of `size` bytes), through the block LRU; a
    /// sequential reader is read ahead in the background ([`AHEAD_BLOCKS`]).
    pub(super) fn read(
        self: &Arc<Self>,
        name: &str,
        size: u64,
        buf: &mut [u8],
        offset: u64,
    ) -> io::Result<()> {
        if offset + buf.len() as u64 > size {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("read past the end of {name} in {}", self.url),
            ));
        }
        let mut at = 0usize;
        while at < buf.len() {
            let pos = offset + at as u64;
            let b = pos / READ_BLOCK_BYTES;
            let start = b * READ_BLOCK_BYTES;
            let (cached, sequential, want) = {
                let mut blocks = self.lock_blocks();
                let sequential = blocks.follows(name, b);
                let mut cached = blocks.get(name, b);
                // Being read ahead: wait for that GET rather than asking for the same bytes.
                while cached.is_none() && blocks.in_flight(name, b) {
                    blocks = self
                        .prefetched
                        .wait_timeout(blocks, Duration::from_millis(200))
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                    cached = blocks.get(name, b);
                }
                // A sequential reader fetches the blocks after this one too, up to the first
                // one held or being fetched (not twice).
                let mut want = 1;
                while sequential
                    && want < READ_AHEAD_BLOCKS
                    && !blocks.held_or_coming(name, b + want)
                {
                    want += 1;
                }
                (cached, sequential, want)
            };
            let block = match cached {
                Some(x) => x,
                None => {
                    let len = (want * READ_BLOCK_BYTES).min(size - start);
                    let got = self.note(self.store.get_range(name, start, len))?;
                    let mut blocks = self.lock_blocks();
                    if sequential {
                        blocks.fetched_to(name, b + want);
                    }
                    blocks.put_range(name, b, &got).ok_or_else(|| {
                        io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            format!("empty range of {name} in {}", self.url),
                        )
                    })?
                }
            };
            if sequential {
                self.read_ahead(name, size, b);
            }
            let from = (pos - start) as usize;
            let n = (block.len() - from).min(buf.len() - at);
            buf[at..at + n].copy_from_slice(&block[from..from + n]);
            at += n;
        }
        Ok(())
    }

    fn lock_blocks(&self) -> std::sync::MutexGuard<'_, ReadBlocks> {
        self.blocks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Start the next read-ahead GET of `name` (of `size` bytes) for a sequential reader at
    /// block `b`, if it is less than [`AHEAD_BLOCKS`] ahead and a GET slot is free. Blocks
    /// already held or being fetched (a hint's GET, [`Shared::will_need`]) are skipped.
    fn read_ahead(self: &Arc<Self>, name: &str, size: u64, b: u64) {
        let last_block = size.div_ceil(READ_BLOCK_BYTES);
        let (from, to) = {
            let mut blocks = self.lock_blocks();
            let mut from = blocks.ahead_of(name).max(b + 1);
            while from < last_block && blocks.held_or_coming(name, from) {
                from += 1;
            }
            if from >= last_block
                || from >= b + AHEAD_BLOCKS
                || blocks.in_flight.len() >= PREFETCHES_IN_FLIGHT
            {
                return;
            }
            let to = (from + PREFETCH_BLOCKS).min(last_block);
            blocks.fetched_to(name, to);
            blocks.in_flight.push((name.to_string(), from, to));
            (from, to)
        };
        self.fetch_in_background(name.to_string(), size, from, to);
    }

    /// A hint that `len` bytes at `offset` of object `name` (of `size` bytes) will be read
    /// soon (the pool reads ahead through a volume's block map: records that are not in
    /// order in their segments, such as blocks deduplicated against older data). The blocks
    /// not held or being fetched are queued for background GETs of up to [`PREFETCH_BLOCKS`]
    /// each; a hint that would hold more than [`HINTED_BLOCKS_MAX`] blocks queued or in
    /// flight is dropped (the reader then fetches them itself).
    pub(super) fn will_need(self: &Arc<Self>, name: &str, size: u64, offset: u64, len: u64) {
        let last_block = size.div_ceil(READ_BLOCK_BYTES);
        let end = offset
            .saturating_add(len)
            .div_ceil(READ_BLOCK_BYTES)
            .min(last_block);
        {
            let mut blocks = self.lock_blocks();
            let mut b = offset / READ_BLOCK_BYTES;
            while b < end {
                if blocks.held_or_coming(name, b) {
                    b += 1;
                    continue;
                }
                let mut to = b + 1;
                while to < end && to - b < PREFETCH_BLOCKS && !blocks.held_or_coming(name, to) {
                    to += 1;
                }
                if blocks.hinted_blocks() + (to - b) > HINTED_BLOCKS_MAX {
                    break;
                }
                blocks.hinted.push_back(Hint {
                    name: name.to_string(),
                    size,
                    from: b,
                    to,
                });
                b = to;
            }
        }
        self.start_hinted();
    }

    /// Start queued hints' GETs while GET slots are free.
    fn start_hinted(self: &Arc<Self>) {
        loop {
            let hint = {
                let mut blocks = self.lock_blocks();
                if blocks.in_flight.len() >= PREFETCHES_IN_FLIGHT {
                    return;
                }
                let Some(mut h) = blocks.hinted.pop_front() else {
                    return;
                };
                // Blocks a reader fetched meanwhile are not fetched again.
                while h.from < h.to && blocks.held_or_coming(&h.name, h.from) {
                    h.from += 1;
                }
                while h.to > h.from && blocks.held_or_coming(&h.name, h.to - 1) {
                    h.to -= 1;
                }
                if h.from == h.to {
                    continue;
                }
                blocks.in_flight.push((h.name.clone(), h.from, h.to));
                h
            };
            self.fetch_in_background(hint.name, hint.size, hint.from, hint.to);
        }
    }

    /// GET blocks `from..to` of `name` (of `size` bytes) on a thread of its own, which puts
    /// them in the LRU and then starts queued hints; the caller has listed the GET in
    /// `in_flight`.
    fn fetch_in_background(self: &Arc<Self>, name: String, size: u64, from: u64, to: u64) {
        let shared = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("s3-read-ahead".into())
            .spawn({
                let name = name.clone();
                move || {
                    let start = from * READ_BLOCK_BYTES;
                    let len = (to * READ_BLOCK_BYTES).min(size) - start;
                    let got = shared.note(shared.store.get_range(&name, start, len));
                    {
                        let mut blocks = shared.lock_blocks();
                        // Not if the object was put or deleted meanwhile (`forget`).
                        let wanted = blocks
                            .in_flight
                            .iter()
                            .any(|(n, f, _)| *n == name && *f == from);
                        if let (true, Ok(bytes)) = (wanted, got) {
                            blocks.put_range(&name, from, &bytes);
                        }
                        blocks.landed(&name, from);
                    }
                    shared.prefetched.notify_all();
                    shared.start_hinted();
                }
            });
        if spawned.is_err() {
            // No thread: the reader fetches these blocks itself when it gets there.
            self.lock_blocks().landed(&name, from);
            self.prefetched.notify_all();
        }
    }
}

/// Blocks of an object a hint asked for, waiting for a GET slot.
pub(super) struct Hint {
    name: String,
    size: u64,
    from: u64,
    to: u64,
}

/// The most recently used blocks of objects read.
#[derive(Default)]
pub(super) struct ReadBlocks {
    pub(super) map: HashMap<(String, u64), Arc<Vec<u8>>>,
    pub(super) order: VecDeque<(String, u64)>,
    /// The block read last.
    pub(super) last: Option<(String, u64)>,
    /// Read-ahead GETs in flight: (object, first block, end block).
    pub(super) in_flight: Vec<(String, u64, u64)>,
    /// The sequential reader's object and the block its reads were fetched up to.
    pub(super) ahead: Option<(String, u64)>,
    /// Hints waiting for a GET slot, oldest first.
    pub(super) hinted: VecDeque<Hint>,
}

impl ReadBlocks {
    /// Whether block `b` of `name` continues the last block read; remembers it as the last.
    fn follows(&mut self, name: &str, b: u64) -> bool {
        let seq = self
            .last
            .as_ref()
            .is_some_and(|(n, l)| n == name && (*l == b || *l + 1 == b));
        self.last = Some((name.to_string(), b));
        seq
    }

    /// Whether block `b` of `name` is being read ahead.
    fn in_flight(&self, name: &str, b: u64) -> bool {
        self.in_flight
            .iter()
            .any(|(n, from, to)| n == name && (*from..*to).contains(&b))
    }

    /// Whether block `b` of `name` is in the LRU or being fetched.
    fn held_or_coming(&self, name: &str, b: u64) -> bool {
        self.map.contains_key(&(name.to_string(), b)) || self.in_flight(name, b)
    }

    /// Blocks queued by hints or being fetched.
    fn hinted_blocks(&self) -> u64 {
        let queued: u64 = self.hinted.iter().map(|h| h.to - h.from).sum();
        let fetching: u64 = self.in_flight.iter().map(|(_, f, t)| t - f).sum();
        queued + fetching
    }

    /// The read-ahead GET of `name` starting at `from` ended.
    fn landed(&mut self, name: &str, from: u64) {
        self.in_flight
            .retain(|(n, f, _)| !(n == name && *f == from));
    }

    /// The block `name`'s sequential reads were fetched up to (0 for another object).
    fn ahead_of(&self, name: &str) -> u64 {
        match &self.ahead {
            Some((n, to)) if n == name => *to,
            _ => 0,
        }
    }

    /// Blocks of `name` up to `to` are fetched or being fetched.
    fn fetched_to(&mut self, name: &str, to: u64) {
        let to = to.max(self.ahead_of(name));
        self.ahead = Some((name.to_string(), to));
    }

    /// Put the blocks of `bytes`, read from block `b` on, in the LRU; returns the first.
    fn put_range(&mut self, name: &str, b: u64, bytes: &[u8]) -> Option<Arc<Vec<u8>>> {
        let mut first = None;
        for (i, piece) in bytes.chunks(READ_BLOCK_BYTES as usize).enumerate() {
            let piece = Arc::new(piece.to_vec());
            first.get_or_insert_with(|| piece.clone());
            self.put(name, b + i as u64, piece);
        }
        first
    }

    fn get(&mut self, name: &str, b: u64) -> Option<Arc<Vec<u8>>> {
        let key = (name.to_string(), b);
        let v = self.map.get(&key)?.clone();
        self.order.retain(|k| k != &key);
        self.order.push_back(key);
        Some(v)
    }
    fn put(&mut self, name: &str, b: u64, v: Arc<Vec<u8>>) {
        let key = (name.to_string(), b);
        if self.map.insert(key.clone(), v).is_none() {
            self.order.push_back(key);
        }
        while self.order.len() > READ_BLOCKS_KEPT {
            if let Some(k) = self.order.pop_front() {
                self.map.remove(&k);
            }
        }
    }
    fn forget(&mut self, name: &str) {
        self.map.retain(|k, _| k.0 != name);
        self.order.retain(|k| k.0 != name);
        self.in_flight.retain(|(n, _, _)| n != name);
        self.hinted.retain(|h| h.name != name);
        if self.ahead.as_ref().is_some_and(|(n, _)| n == name) {
            self.ahead = None;
        }
    }
}

impl Bucket for Shared {
    fn url(&self) -> &str {
        &self.url
    }

    fn put(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        Shared::put(self, name, bytes)
    }

    fn delete(&self, name: &str) -> io::Result<()> {
        Shared::delete(self, name)
    }

    fn get(&self, name: &str) -> std::result::Result<Vec<u8>, condense_object_store::Error> {
        self.store.get(name)
    }
}
