//! Per-volume I/O counters, for a live view of who does what (`condense top`). Plain atomics
//! over std, kept on the ground floor with the other utilities (locks, worker) so the engine
//! stays within its size.
//!
//! Owns: [`VolumeIo`], the counters of one volume (or snapshot) name: operations, bytes and a
//! latency histogram for reads, writes and zeroing (write-zeroes and trim), errors, what the
//! write path did with the blocks written (zero, deduplicated, new and their stored bytes),
//! and the cache tier's hits and misses for the volume's reads; [`VolumeIoValues`], the plain
//! copy the engine's `Pool::volume_io` returns; [`Latency`], the histogram.
//!
//! They are maintained beneath the frontends, by the Volume API calls of
//! the engine's `VolumeHandle` (NBD, FUSE, import and export all count), with relaxed
//! atomic adds on an `Arc` the handle took when it was opened: no lock and no lookup per
//! operation. Every handle of a name shares one `VolumeIo`, kept in the pool while the name
//! exists or a handle holds it.
//!
//! Invariants: counters start at zero when the pool is opened (or the name first opened) and
//! only go up while the name lives; a reader computing rates takes differences between two
//! copies and treats a smaller value as a restart (the volume was deleted and made again).
//! Latency bucket `i` counts operations that took `[2^(i-1), 2^i)` microseconds (bucket 0:
//! under 1 µs; the last bucket: everything longer).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Number of latency buckets (the last holds everything from 2^30 µs, ~18 min, up).
pub const LATENCY_BUCKETS: usize = 32;

/// A latency histogram with log2 buckets of microseconds (see the module docs).
#[derive(Debug)]
pub struct Latency([AtomicU64; LATENCY_BUCKETS]);

impl Default for Latency {
    fn default() -> Latency {
        Latency(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl Latency {
    /// The bucket a duration falls in.
    pub fn bucket(d: Duration) -> usize {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        ((u64::BITS - us.leading_zeros()) as usize).min(LATENCY_BUCKETS - 1)
    }

    fn record(&self, d: Duration) {
        self.0[Self::bucket(d)].fetch_add(1, Ordering::Relaxed);
    }

    fn values(&self) -> [u64; LATENCY_BUCKETS] {
        std::array::from_fn(|i| self.0[i].load(Ordering::Relaxed))
    }
}

/// One kind of operation: how many, their bytes, how long they took.
#[derive(Debug, Default)]
struct OpCounter {
    ops: AtomicU64,
    bytes: AtomicU64,
    /// Microseconds the operations took, in all.
    time_us: AtomicU64,
    latency: Latency,
}

impl OpCounter {
    fn record(&self, bytes: u64, took: Duration) {
        self.ops.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.time_us.fetch_add(us, Ordering::Relaxed);
        self.latency.record(took);
    }

    fn values(&self) -> OpValues {
        OpValues {
            ops: self.ops.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            time_us: self.time_us.load(Ordering::Relaxed),
            latency: self.latency.values(),
        }
    }
}

/// What the write path did with the blocks of one write (see [`VolumeIo`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reduced {
    /// All-zero blocks (stored as zero entries, no chunk).
    pub zero: u64,
    /// Blocks whose content the pool (or the same write) held already.
    pub dedup: u64,
    /// Blocks stored as new chunks, and the bytes of those chunks as stored (compressed,
    /// sealed when encrypted).
    pub new: u64,
    pub stored_bytes: u64,
}

impl Reduced {
    pub fn add(&mut self, other: Reduced) {
        self.zero += other.zero;
        self.dedup += other.dedup;
        self.new += other.new;
        self.stored_bytes += other.stored_bytes;
    }
}

/// The live counters of one volume or snapshot name (see the module docs).
#[derive(Debug, Default)]
pub struct VolumeIo {
    read: OpCounter,
    write: OpCounter,
    zero: OpCounter,
    errors: AtomicU64,
    zero_blocks: AtomicU64,
    dedup_blocks: AtomicU64,
    new_blocks: AtomicU64,
    new_stored_bytes: AtomicU64,
    cache_hits: AtomicU64,
    cache_misses: AtomicU64,
}

impl VolumeIo {
    pub fn read(&self, bytes: u64, took: Duration, cache: (u64, u64)) {
        self.read.record(bytes, took);
        add(&self.cache_hits, cache.0);
        add(&self.cache_misses, cache.1);
    }

    pub fn write(&self, bytes: u64, took: Duration, r: Reduced) {
        self.write.record(bytes, took);
        self.reduced(r);
    }

    pub fn zero(&self, bytes: u64, took: Duration, r: Reduced) {
        self.zero.record(bytes, took);
        self.reduced(r);
    }

    pub fn error(&self) {
        add(&self.errors, 1);
    }

    fn reduced(&self, r: Reduced) {
        add(&self.zero_blocks, r.zero);
        add(&self.dedup_blocks, r.dedup);
        add(&self.new_blocks, r.new);
        add(&self.new_stored_bytes, r.stored_bytes);
    }

    pub fn values(&self) -> VolumeIoValues {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        VolumeIoValues {
            read: self.read.values(),
            write: self.write.values(),
            zero: self.zero.values(),
            errors: get(&self.errors),
            zero_blocks: get(&self.zero_blocks),
            dedup_blocks: get(&self.dedup_blocks),
            new_blocks: get(&self.new_blocks),
            new_stored_bytes: get(&self.new_stored_bytes),
            cache_hits: get(&self.cache_hits),
            cache_misses: get(&self.cache_misses),
        }
    }
}

fn add(c: &AtomicU64, n: u64) {
    if n > 0 {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// One kind of operation at one instant: totals since the counters started.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpValues {
    pub ops: u64,
    pub bytes: u64,
    /// Microseconds the operations took, in all.
    pub time_us: u64,
    /// Operations per latency bucket ([`Latency`]).
    pub latency: [u64; LATENCY_BUCKETS],
}

/// A copy of one name's counters at one instant (totals since they started).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VolumeIoValues {
    pub read: OpValues,
    pub write: OpValues,
    /// Write-zeroes and trim requests (their bytes are the range zeroed).
    pub zero: OpValues,
    /// Operations that failed (not counted above).
    pub errors: u64,
    /// Blocks written (by writes, or by zeroing part of a block) that were all zeros,
    /// deduplicated against a chunk the pool held, or stored as new chunks.
    pub zero_blocks: u64,
    pub dedup_blocks: u64,
    pub new_blocks: u64,
    /// Bytes of the new chunks as stored (after compression).
    pub new_stored_bytes: u64,
    /// Chunks of this volume's reads found in, or missing from, the cache tier (zero without
    /// one).
    pub cache_hits: u64,
    pub cache_misses: u64,
}

/// The counters of every name, in the pool.
pub type VolumeIoMap = std::sync::Mutex<HashMap<String, Arc<VolumeIo>>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_buckets_are_log2_microseconds() {
        let b = |us| Latency::bucket(Duration::from_micros(us));
        assert_eq!(Latency::bucket(Duration::from_nanos(999)), 0);
        assert_eq!(b(1), 1);
        assert_eq!(b(2), 2);
        assert_eq!(b(3), 2);
        assert_eq!(b(4), 3);
        assert_eq!(b(1023), 10);
        assert_eq!(b(1024), 11);
        assert_eq!(Latency::bucket(Duration::from_secs(1 << 40)), 31);
    }

    #[test]
    fn counters_add_up() {
        let io = VolumeIo::default();
        io.write(
            8192,
            Duration::from_micros(100),
            Reduced {
                zero: 0,
                dedup: 1,
                new: 1,
                stored_bytes: 1000,
            },
        );
        io.read(4096, Duration::from_micros(5), (1, 0));
        io.read(4096, Duration::from_micros(6), (0, 1));
        io.error();
        let v = io.values();
        assert_eq!((v.write.ops, v.write.bytes), (1, 8192));
        assert_eq!(
            v.write.latency[Latency::bucket(Duration::from_micros(100))],
            1
        );
        assert_eq!((v.read.ops, v.read.bytes), (2, 8192));
        assert_eq!(v.read.latency[3], 2);
        assert_eq!(
            (v.dedup_blocks, v.new_blocks, v.new_stored_bytes),
            (1, 1, 1000)
        );
        assert_eq!((v.cache_hits, v.cache_misses, v.errors), (1, 1, 1));
        assert_eq!(v.zero, OpValues::default());
    }
}
