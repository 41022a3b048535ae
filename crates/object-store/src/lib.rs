//! Object-store backends for Condense: where sealed segments, metadata pages and checkpoint
//! roots live when a pool is on S3-compatible storage (issue 11, docs/S3.md).
//!
//! Owns: the [`ObjectBackend`] trait — a narrow, **blocking** seam between the (synchronous)
//! engine and a store of whole immutable objects — and its two implementations:
//!
//! - [`LocalBackend`]: a directory; every object is a file, written to a temporary name,
//!   fsynced, renamed into place and the directory fsynced.
//! - [`S3Backend`]: any S3-compatible store through the `object_store` crate, with its own
//!   small tokio runtime, bounded timeouts and retries, and request/byte counters.
//!
//! It owns nothing of the pool's format: names and bytes are opaque here.
//!
//! Invariants (each checked by `conformance::run`, feature `conformance`, which every backend
//! must pass):
//!
//! 1. `put` is atomic: a reader sees the whole old object, the whole new one, or none —
//!    never a prefix. A `put` that returned `Ok` is durable (fsync / the store's ack).
//! 2. Names are validated identically by every backend ([`validate_name`]): `/`-separated
//!    segments of `[A-Za-z0-9._-]`, none empty or starting with `.`. So an object written
//!    through one backend can be named through any other, and internal files (temporary
//!    copies, probes) can never collide with or be listed as objects.
//! 3. `list(prefix)` returns only names *under* `prefix` as a path (`a` lists `a/x`, never
//!    `ab/x`), sorted by name.
//! 4. `get_range` returns exactly `len` bytes or fails: a range past the object's end is
//!    [`Error::RangePastEnd`], never a short read.
//! 5. `delete` of a missing object is `Ok` (deletes are idempotent, so retries are safe).
//! 6. `put_if_absent` says honestly what it guarantees: [`ObjectBackend::conditional_put_honoured`]
//!    is `true` only if the store itself refuses to overwrite (a local `link(2)`, or an S3 store
//!    that honours `If-None-Match: *`, detected by a probe at open). Otherwise it is a
//!    best-effort check documented on [`S3Backend`] (Garage 2.5.0 is such a store).
//! 7. No input from outside (a name, a config value, a store's answer) makes this crate panic:
//!    errors name the operation, the object and what to do ([`Error`]).
//! 8. After `delete` returned `Ok`, `get` and `head` of that name say not found, but `list`
//!    may still name it for a moment on a replicated store (seen once in CI on a 3-node Garage
//!    2.5.0 cluster: objects listed right after their deletes returned). The engine lists only
//!    when it opens, repairs or attaches a pool and for `stats`, never to confirm a delete.

#![deny(clippy::unwrap_used)]

#[cfg(any(test, feature = "conformance"))]
pub mod conformance;
mod error;
mod local;
mod s3;

pub use error::{Error, Op, Result, SizeText};
pub use local::LocalBackend;
pub use s3::{redacted, S3Backend, S3Config, Timeouts};

use std::sync::atomic::{AtomicU64, Ordering};

/// The longest object name accepted (S3 allows 1024 bytes for the whole key, prefix included).
pub const NAME_BYTES_MAX: usize = 512;

/// A store of whole, immutable objects, used synchronously by the engine.
///
/// Every method blocks until the store has answered (or the backend's timeouts expired).
/// Implementations are `Send + Sync` and may be called from many threads at once.
pub trait ObjectBackend: Send + Sync {
    /// Store `bytes` as object `name`, replacing any object of that name. Atomic and durable
    /// when it returns `Ok` (invariant 1).
    fn put(&self, name: &str, bytes: &[u8]) -> Result<()>;

    /// The whole object. A missing object is [`Error::NotFound`].
    fn get(&self, name: &str) -> Result<Vec<u8>>;

    /// Exactly `len` bytes of the object from byte `start`. A range that does not lie wholly
    /// inside the object is [`Error::RangePastEnd`]; a missing object is [`Error::NotFound`].
    fn get_range(&self, name: &str, start: u64, len: u64) -> Result<Vec<u8>>;

    /// The object's size, or `None` if there is no such object.
    fn head(&self, name: &str) -> Result<Option<u64>>;

    /// Every object under `prefix` (a path: `""` lists all, `"a"` lists `a/...` but not
    /// `ab/...`), as (name, size), sorted by name.
    fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>>;

    /// Remove the object. A missing object is `Ok`.
    fn delete(&self, name: &str) -> Result<()>;

    /// Store `bytes` as `name` only if no object of that name exists. `Ok(true)`: this call
    /// created it; `Ok(false)`: one existed (and is unchanged, if
    /// [`conditional_put_honoured`](Self::conditional_put_honoured) is `true`).
    fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<bool>;

    /// Whether `put_if_absent` is enforced by the store (`true`) or a best-effort check that
    /// two simultaneous callers can both win (`false`).
    fn conditional_put_honoured(&self) -> bool;

    /// Requests and bytes since the backend was opened.
    fn stats(&self) -> BackendStats;

    /// Where the objects are, for messages (`/srv/pool/objects`, `s3://bucket/prefix`).
    fn describe(&self) -> String;
}

/// Request and byte counts of one backend since it was opened. A HEAD is counted apart from
/// GETs (S3 prices them alike); a LIST counts one request per page of up to 1000 names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendStats {
    pub put_requests: u64,
    pub put_bytes: u64,
    pub get_requests: u64,
    pub get_bytes: u64,
    pub head_requests: u64,
    pub list_requests: u64,
    pub delete_requests: u64,
}

impl BackendStats {
    /// Every request counted.
    pub fn requests(&self) -> u64 {
        self.put_requests
            + self.get_requests
            + self.head_requests
            + self.list_requests
            + self.delete_requests
    }
}

/// The counters behind [`BackendStats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    put_requests: AtomicU64,
    put_bytes: AtomicU64,
    get_requests: AtomicU64,
    get_bytes: AtomicU64,
    head_requests: AtomicU64,
    list_requests: AtomicU64,
    delete_requests: AtomicU64,
}

impl Counters {
    pub(crate) fn put(&self, bytes: usize) {
        self.put_requests.fetch_add(1, Ordering::Relaxed);
        self.put_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
    pub(crate) fn get(&self, bytes: usize) {
        self.get_requests.fetch_add(1, Ordering::Relaxed);
        self.get_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
    pub(crate) fn head(&self) {
        self.head_requests.fetch_add(1, Ordering::Relaxed);
    }
    /// One LIST that returned `names` names: one request per page of 1000.
    pub(crate) fn list(&self, names: usize) {
        let pages = names.div_ceil(1000).max(1) as u64;
        self.list_requests.fetch_add(pages, Ordering::Relaxed);
    }
    pub(crate) fn delete(&self) {
        self.delete_requests.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn snapshot(&self) -> BackendStats {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        BackendStats {
            put_requests: l(&self.put_requests),
            put_bytes: l(&self.put_bytes),
            get_requests: l(&self.get_requests),
            get_bytes: l(&self.get_bytes),
            head_requests: l(&self.head_requests),
            list_requests: l(&self.list_requests),
            delete_requests: l(&self.delete_requests),
        }
    }
}

/// Check an object name (invariant 2): 1..=[`NAME_BYTES_MAX`] bytes of `/`-separated
/// segments, each non-empty, of `[A-Za-z0-9._-]`, not starting with `.`.
pub fn validate_name(name: &str) -> Result<()> {
    validate(name, false)
}

/// Check a list prefix: a valid name, or empty (everything).
pub fn validate_prefix(prefix: &str) -> Result<()> {
    validate(prefix, true)
}

fn validate(name: &str, empty_ok: bool) -> Result<()> {
    let bad = |why: &str| Error::InvalidName {
        name: name.to_string(),
        why: why.to_string(),
    };
    if name.is_empty() {
        return if empty_ok {
            Ok(())
        } else {
            Err(bad("it is empty"))
        };
    }
    if name.len() > NAME_BYTES_MAX {
        return Err(bad(&format!("it is longer than {NAME_BYTES_MAX} bytes")));
    }
    for seg in name.split('/') {
        if seg.is_empty() {
            return Err(bad(
                "it has an empty segment (a leading, trailing or double '/')",
            ));
        }
        if seg.starts_with('.') {
            return Err(bad(
                "a segment starts with '.' (reserved for temporary files)",
            ));
        }
        if let Some(c) = seg
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        {
            return Err(bad(&format!(
                "it contains {c:?} (allowed: A-Z a-z 0-9 . _ - and '/' between segments)"
            )));
        }
    }
    Ok(())
}

/// Whether `name` is under `prefix` as a path (invariant 3).
pub(crate) fn under(name: &str, prefix: &str) -> bool {
    prefix.is_empty()
        || name
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('/'))
}

/// A value no other caller will pick: for temporary names and put-if-absent nonces.
pub(crate) fn nonce() -> String {
    use std::collections::hash_map::RandomState;
    use std::hash::{BuildHasher, Hasher};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(SEQ.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(d.as_nanos());
    }
    let a = h.finish();
    let mut h2 = RandomState::new().build_hasher();
    h2.write_u64(a);
    format!("{a:016x}{:016x}", h2.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated_alike_everywhere() {
        for ok in ["a", "seg/0000000000000001", "meta/p-1.pg", "A_b-c.d/e"] {
            assert!(validate_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "", "/a", "a/", "a//b", ".a", "a/.tmp", "a b", "a\\b", "é", "a?b",
        ] {
            assert!(
                matches!(validate_name(bad), Err(Error::InvalidName { .. })),
                "{bad}"
            );
        }
        assert!(validate_name(&"x".repeat(NAME_BYTES_MAX + 1)).is_err());
        assert!(validate_prefix("").is_ok());
    }

    #[test]
    fn under_is_a_path_prefix() {
        assert!(under("a/b", "a"));
        assert!(under("a/b/c", "a/b"));
        assert!(!under("ab/c", "a"));
        assert!(!under("a", "a"));
        assert!(under("x", ""));
    }

    #[test]
    fn nonces_differ() {
        assert_ne!(nonce(), nonce());
        assert_eq!(nonce().len(), 32);
    }
}
