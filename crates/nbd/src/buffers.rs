//! Reusable data buffers for large READ replies and WRITE payloads.
//!
//! A fresh `vec![0; 1 MiB]` per request costs a memset of the whole buffer before the volume
//! fills it (measured at a tenth of the server's CPU on 1 MiB sequential reads). Buffers of
//! 64 KiB and more are instead taken from a pool by power-of-two size class and go back to it
//! when dropped; their bytes stay initialized, so reuse costs nothing. Smaller requests use
//! plain vectors: zeroing a few KiB is cheaper than the pool's lock.
//!
//! The idle buffers (at most [`IDLE_BYTES_MAX`]) are kept only while clients are in
//! transmission: when the last one leaves, the server calls [`BufPool::release_idle`], so
//! what a burst of large requests made does not stay resident in an idle server.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// Requests below this size get plain vectors.
const POOLED_BYTES_MIN: usize = 64 * 1024;
/// Idle bytes the pool keeps; buffers returned beyond it are freed. Idle buffers are memory
/// outside the in-flight budget ([`crate::budget`]), so this stays small: enough for the
/// buffers of a few pipelined 1 MiB requests per connection.
const IDLE_BYTES_MAX: usize = 32 * 1024 * 1024;

#[derive(Default)]
struct Idle {
    by_class: HashMap<usize, Vec<Vec<u8>>>,
    bytes: usize,
}

#[derive(Default)]
pub struct BufPool {
    idle: Mutex<Idle>,
}

impl BufPool {
    fn lock(&self) -> MutexGuard<'_, Idle> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The bytes [`BufPool::take`] allocates for `len` usable bytes (what a request's
    /// buffer costs in the in-flight budget).
    pub fn alloc_bytes(len: usize) -> usize {
        if len < POOLED_BYTES_MIN {
            len
        } else {
            len.next_power_of_two()
        }
    }

    /// A buffer of exactly `len` usable bytes (contents unspecified).
    pub fn take(self: &Arc<Self>, len: usize) -> Buf {
        if len < POOLED_BYTES_MIN {
            return Buf {
                v: vec![0; len],
                len,
                pool: None,
            };
        }
        let class = Self::alloc_bytes(len);
        let reused = {
            let mut idle = self.lock();
            let v = idle.by_class.get_mut(&class).and_then(Vec::pop);
            if v.is_some() {
                idle.bytes -= class;
            }
            v
        };
        Buf {
            v: reused.unwrap_or_else(|| vec![0; class]),
            len,
            pool: Some(self.clone()),
        }
    }

    /// Keep a returned buffer for reuse. When the idle bytes would pass the limit, buffers
    /// of other sizes go first: the size just used is the one the next request wants (after
    /// nbdcopy's 256 KiB writes, fio's 1 MiB reads must not find the pool full of 256 KiB).
    fn give(&self, v: Vec<u8>) {
        let class = v.len();
        let mut idle = self.lock();
        while idle.bytes + class > IDLE_BYTES_MAX {
            let Some(other) = idle
                .by_class
                .iter()
                .find(|(c, l)| **c != class && !l.is_empty())
                .map(|(c, _)| *c)
            else {
                break;
            };
            if let Some(old) = idle.by_class.get_mut(&other).and_then(Vec::pop) {
                idle.bytes -= old.len();
            }
        }
        if idle.bytes + class <= IDLE_BYTES_MAX {
            idle.bytes += class;
            idle.by_class.entry(class).or_default().push(v);
        }
    }
}

impl BufPool {
    /// Free every idle buffer, and ask the allocator to hand the freed memory back to the
    /// OS (glibc keeps freed heap pages otherwise). For when no client is in transmission.
    pub fn release_idle(&self) {
        let freed = std::mem::take(&mut *self.lock());
        drop(freed);
        return_free_memory();
    }
}

/// Hand the allocator's free heap pages back to the OS.
fn return_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free pages of glibc's heaps; it takes no pointers
    // and is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// A data buffer; pooled ones return to their pool on drop.
pub struct Buf {
    v: Vec<u8>,
    len: usize,
    pool: Option<Arc<BufPool>>,
}

impl Buf {
    pub fn as_slice(&self) -> &[u8] {
        &self.v[..self.len]
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.v[..self.len]
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.give(std::mem::take(&mut self.v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_by_size_class() {
        let pool = Arc::new(BufPool::default());
        let mut a = pool.take(1 << 20);
        assert_eq!(a.as_slice().len(), 1 << 20);
        a.as_mut_slice()[0] = 7;
        let ptr = a.as_slice().as_ptr();
        drop(a);
        let b = pool.take(600 * 1024); // same 1 MiB class
        assert_eq!(b.as_slice().len(), 600 * 1024);
        assert_eq!(b.as_slice().as_ptr(), ptr, "reused");
        assert_eq!(BufPool::alloc_bytes(600 * 1024), 1 << 20);
        assert_eq!(BufPool::alloc_bytes(100), 100);
        let small = pool.take(100);
        assert_eq!(small.as_slice(), &[0u8; 100][..]);
    }

    #[test]
    fn release_idle_frees_every_idle_buffer() {
        let pool = Arc::new(BufPool::default());
        drop(pool.take(1 << 20));
        assert_eq!(pool.lock().bytes, 1 << 20);
        pool.release_idle();
        assert_eq!(pool.lock().bytes, 0);
        assert!(pool.lock().by_class.is_empty());
    }

    #[test]
    fn the_size_in_use_displaces_idle_buffers_of_other_sizes() {
        let pool = Arc::new(BufPool::default());
        let n = IDLE_BYTES_MAX / (256 * 1024);
        let small: Vec<Buf> = (0..n).map(|_| pool.take(256 * 1024)).collect();
        drop(small);
        assert_eq!(
            pool.lock().bytes,
            IDLE_BYTES_MAX,
            "idle pool full of 256 KiB buffers"
        );
        drop(pool.take(1 << 20));
        let idle = pool.lock();
        assert!(idle.bytes <= IDLE_BYTES_MAX);
        assert_eq!(
            idle.by_class.get(&(1 << 20)).map(Vec::len),
            Some(1),
            "the 1 MiB buffer was kept, a 256 KiB one was let go"
        );
    }
}
