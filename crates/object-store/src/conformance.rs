//! The one conformance suite every [`ObjectBackend`] must pass (the crate's invariants, in
//! lib.rs). Test support, not API: `cargo test -p condense-object-store` runs it against a
//! [`crate::LocalBackend`] always and against S3 when `CONDENSE_S3_TEST=1`
//! (tests/conformance.rs, tests/s3/run.sh).
//!
//! Everything it writes is under `conformance/RUN/` (RUN unique per call) and removed at the
//! end, so runs can share a bucket. A failed check panics with what differed.

#![doc(hidden)]
#![allow(clippy::unwrap_used)] // test support: a failed expectation is the report

use crate::{Error, ObjectBackend};
use std::time::{Duration, Instant};

/// What a run did, for the test's output.
#[derive(Debug, Clone, Copy)]
pub struct Report {
    pub elapsed: Duration,
    pub stats_delta: crate::BackendStats,
    /// What the conditional-PUT checks found ([`conditional_put`]).
    pub conditional_put: ConditionalPut,
}

/// Whether the store honours conditional PUT, as the suite saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConditionalPut {
    /// The backend says it does, and 8 racers creating one name had exactly one winner, whose
    /// bytes stayed, in every round.
    Honoured,
    /// The backend says it does not (its probe at open saw an overwrite): `winners` is the
    /// most racers that were told they created the name in one round (the best-effort check
    /// may tell one or several).
    NotSupported { winners: usize },
}

impl std::fmt::Display for ConditionalPut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConditionalPut::Honoured => {
                f.write_str("honoured (one winner of 8 racers, every round)")
            }
            ConditionalPut::NotSupported { winners } => write!(
                f,
                "not supported (If-None-Match: * not enforced; best effort: up to {winners} of 8 \
                 racers won one round)"
            ),
        }
    }
}

/// `len` bytes of a xorshift stream: incompressible, different per `seed`.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn is_past_end(r: crate::Result<Vec<u8>>) -> bool {
    matches!(r, Err(Error::RangePastEnd { .. }))
}

/// Run every check against `b`, in this order (the list check counts what the round trips
/// left). Panics on the first failure.
pub fn run(b: &dyn ObjectBackend) -> Report {
    let began = Instant::now();
    let before = b.stats();
    let root = format!("conformance/{}", crate::nonce());
    round_trips(b, &root);
    ranges(b, &root);
    missing_objects(b, &root);
    invalid_names(b);
    lists(b, &root);
    overwrite_and_delete(b, &root);
    put_if_absent(b, &root);
    let conditional = conditional_put(b, &root);
    cleanup(b, &root);
    report(b, before, began, conditional)
}

/// The name `s` under the run's `root`.
fn under(root: &str, s: &str) -> String {
    format!("{root}/{s}")
}

fn round_trips(b: &dyn ObjectBackend, root: &str) {
    let n = |s: &str| under(root, s);
    // Round trips: 0 B, 1 B, 4 KiB, 33 MiB (bigger than one 32 MiB segment).
    for (i, len) in [0usize, 1, 4096, 33 << 20].into_iter().enumerate() {
        let name = n(&format!("size/{len}"));
        let data = pattern(len, i as u64 + 1);
        b.put(&name, &data).unwrap();
        assert_eq!(b.head(&name).unwrap(), Some(len as u64), "head {name}");
        let got = b.get(&name).unwrap();
        assert!(
            got == data,
            "get {name}: {} bytes back, not the {len} put",
            got.len()
        );
        // A range across 16 MiB (where a multipart upload's parts would meet), and the last
        // byte.
        if len > 16 << 20 {
            let at = (16 << 20) - 10;
            let seam = b.get_range(&name, at as u64, 20).unwrap();
            assert!(seam == data[at..at + 20], "get_range {name} across 16 MiB");
            let last = b.get_range(&name, len as u64 - 1, 1).unwrap();
            assert_eq!(last, data[len - 1..], "the last byte of {name}");
        }
    }
}

fn ranges(b: &dyn ObjectBackend, root: &str) {
    let n = |s: &str| under(root, s);
    // Ranges: start, middle, end, whole; past the end fails, never a short read.
    let big = n(&format!("size/{}", 33 << 20));
    let data = pattern(33 << 20, 4);
    let size = data.len() as u64;
    for (start, len) in [
        (0u64, 4096u64),
        (size / 2 - 1000, 70_000),
        (size - 4096, 4096),
        (size - 1, 1),
        (0, size),
    ] {
        let got = b.get_range(&big, start, len).unwrap();
        assert!(
            got == data[start as usize..(start + len) as usize],
            "get_range {start}+{len} of {big}"
        );
    }
    assert!(
        is_past_end(b.get_range(&big, size - 10, 11)),
        "range over the end"
    );
    assert!(is_past_end(b.get_range(&big, size, 1)), "range at the end");
    assert!(
        is_past_end(b.get_range(&big, size + 100, 5)),
        "range after the end"
    );
    assert!(
        is_past_end(b.get_range(&big, 1, u64::MAX)),
        "overflowing range"
    );
    let one = n("size/1");
    assert_eq!(b.get_range(&one, 0, 1).unwrap(), pattern(1, 2));
    assert!(
        is_past_end(b.get_range(&one, 0, 2)),
        "2 bytes of a 1-byte object"
    );
    assert!(
        b.get_range(&one, 1, 0).unwrap().is_empty(),
        "empty range at the end"
    );
}

fn missing_objects(b: &dyn ObjectBackend, root: &str) {
    let n = |s: &str| under(root, s);
    // Missing objects.
    let missing = n("missing/object");
    assert_eq!(b.head(&missing).unwrap(), None);
    assert!(b.get(&missing).unwrap_err().is_not_found(), "get missing");
    assert!(
        b.get_range(&missing, 0, 1).unwrap_err().is_not_found(),
        "range of missing"
    );
}

fn invalid_names(b: &dyn ObjectBackend) {
    // Invalid names are refused before any request.
    for bad in ["", "/x", "x//y", "x/.tmp", "a b"] {
        assert!(
            matches!(b.put(bad, b"x"), Err(Error::InvalidName { .. })),
            "name {bad:?} accepted"
        );
    }
}

fn lists(b: &dyn ObjectBackend, root: &str) {
    let n = |s: &str| under(root, s);
    // Lists: by path prefix, sorted, other prefixes not listed; names with slashes.
    let listed = [
        ("p/a", 1usize),
        ("p/b/c", 2),
        ("p/b/d/e", 3),
        ("pq/x", 4),
        ("q", 5),
    ];
    for (name, len) in listed {
        b.put(&n(name), &pattern(len, len as u64)).unwrap();
    }
    let names = |prefix: &str| -> Vec<(String, u64)> {
        b.list(&n(prefix))
            .unwrap()
            .into_iter()
            .map(|(name, size)| {
                (
                    name.strip_prefix(&format!("{root}/")).unwrap().to_string(),
                    size,
                )
            })
            .collect()
    };
    let want = |v: &[(&str, u64)]| -> Vec<(String, u64)> {
        v.iter().map(|(s, l)| (s.to_string(), *l)).collect()
    };
    assert_eq!(
        names("p"),
        want(&[("p/a", 1), ("p/b/c", 2), ("p/b/d/e", 3)])
    );
    assert_eq!(names("p/b"), want(&[("p/b/c", 2), ("p/b/d/e", 3)]));
    assert_eq!(names("pq"), want(&[("pq/x", 4)]));
    assert_eq!(names("nothing"), want(&[]));
    assert_eq!(b.get(&n("p/b/d/e")).unwrap(), pattern(3, 3));
    let all = b.list(root).unwrap();
    assert_eq!(
        all.len(),
        4 + listed.len(),
        "list of the run's root: {all:?}"
    );
    assert!(all.windows(2).all(|w| w[0].0 < w[1].0), "list is sorted");
}

fn overwrite_and_delete(b: &dyn ObjectBackend, root: &str) {
    let n = |s: &str| under(root, s);
    let missing = n("missing/object");
    // Overwrite replaces (whole: never a mix).
    let ow = n("overwrite");
    b.put(&ow, &pattern(10_000, 7)).unwrap();
    b.put(&ow, &pattern(3000, 8)).unwrap();
    assert_eq!(b.get(&ow).unwrap(), pattern(3000, 8));
    assert_eq!(b.head(&ow).unwrap(), Some(3000));

    // Delete, then NotFound; deleting a missing object is Ok.
    b.delete(&ow).unwrap();
    assert!(b.get(&ow).unwrap_err().is_not_found(), "get after delete");
    assert_eq!(b.head(&ow).unwrap(), None);
    b.delete(&ow).unwrap();
    b.delete(&missing).unwrap();
}

fn put_if_absent(b: &dyn ObjectBackend, root: &str) {
    let n = |s: &str| under(root, s);
    // put_if_absent: true, then false, and the first bytes stay.
    let once = n("lease/once");
    assert!(
        b.put_if_absent(&once, b"first").unwrap(),
        "put_if_absent on absent"
    );
    assert!(
        !b.put_if_absent(&once, b"second").unwrap(),
        "put_if_absent on present"
    );
    assert_eq!(b.get(&once).unwrap(), b"first");
    b.delete(&once).unwrap();
    assert!(
        b.put_if_absent(&once, b"third").unwrap(),
        "put_if_absent after delete"
    );
    assert_eq!(b.get(&once).unwrap(), b"third");
}

/// Racers that create one name at once: a backend that says it honours conditional PUT
/// (`conditional_put_honoured`) must give exactly one of them `true`, and keep its bytes, in
/// every round; one that says it does not is reported as such, never failed (what the claim
/// protocols then rely on is their timing, docs/S3.md).
pub fn conditional_put(b: &dyn ObjectBackend, root: &str) -> ConditionalPut {
    const RACERS: usize = 8;
    const ROUNDS: usize = 5;
    let honoured = b.conditional_put_honoured();
    let mut most = 0;
    for round in 0..ROUNDS {
        let name = under(root, &format!("conditional/{round}"));
        let barrier = std::sync::Barrier::new(RACERS);
        let results: Vec<bool> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..RACERS)
                .map(|i| {
                    let (name, barrier) = (&name, &barrier);
                    s.spawn(move || {
                        barrier.wait();
                        b.put_if_absent(name, format!("racer {i}").as_bytes())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        let winners: Vec<usize> = (0..RACERS).filter(|i| results[*i]).collect();
        most = most.max(winners.len());
        if honoured {
            assert_eq!(
                winners.len(),
                1,
                "conditional put honoured, yet {} of {RACERS} racers created {name}",
                winners.len()
            );
            let kept = b.get(&name).unwrap();
            assert_eq!(
                kept,
                format!("racer {}", winners[0]).into_bytes(),
                "the winner's bytes of {name} were replaced"
            );
            // A later create of the name, after the race, is refused too.
            assert!(
                !b.put_if_absent(&name, b"late").unwrap(),
                "late create of {name}"
            );
        }
    }
    if honoured {
        ConditionalPut::Honoured
    } else {
        ConditionalPut::NotSupported { winners: most }
    }
}

fn cleanup(b: &dyn ObjectBackend, root: &str) {
    // Clean up: the run leaves nothing behind. A listing may lag a delete for a moment
    // (invariant 8), so the check waits up to 10 s for the listing to agree; an object that
    // is never deleted still fails it.
    for (name, _) in b.list(root).unwrap() {
        b.delete(&name).unwrap();
    }
    let waited = Instant::now();
    let mut left = b.list(root).unwrap();
    while !left.is_empty() && waited.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(100));
        left = b.list(root).unwrap();
    }
    assert_eq!(left, vec![], "objects still listed 10 s after cleanup");
}

/// The counters moved, and by how much since `before`.
fn report(
    b: &dyn ObjectBackend,
    before: crate::BackendStats,
    began: Instant,
    conditional_put: ConditionalPut,
) -> Report {
    let after = b.stats();
    assert!(after.put_requests > before.put_requests, "puts are counted");
    assert!(
        after.get_bytes >= before.get_bytes + (66 << 20),
        "get bytes are counted"
    );
    Report {
        elapsed: began.elapsed(),
        stats_delta: crate::BackendStats {
            put_requests: after.put_requests - before.put_requests,
            put_bytes: after.put_bytes - before.put_bytes,
            get_requests: after.get_requests - before.get_requests,
            get_bytes: after.get_bytes - before.get_bytes,
            head_requests: after.head_requests - before.head_requests,
            list_requests: after.list_requests - before.list_requests,
            delete_requests: after.delete_requests - before.delete_requests,
        },
        conditional_put,
    }
}

/// Test support for the claim protocols (docs/S3.md "Lease: claims"): another backend seen
/// through a handle that may pretend the store lacks conditional PUT (`put_if_absent` is then
/// a HEAD and a plain PUT, so racers can both win, as on Garage 2.5.0) and that can hold the
/// caller for a while after a LIST answered: a deterministic "pause" between a claim's LIST
/// and its PUT.
pub struct Faulty {
    inner: std::sync::Arc<dyn ObjectBackend>,
    conditional: bool,
    /// After the next LIST answers, sleep this long (once).
    pause_after_list: std::sync::Mutex<Option<Duration>>,
    /// Every DELETE fails as an unreachable store's would.
    refuse_deletes: std::sync::atomic::AtomicBool,
}

impl Faulty {
    /// `inner` as a store with conditional PUT (if `inner` has it and `conditional`) or
    /// without.
    pub fn new(inner: std::sync::Arc<dyn ObjectBackend>, conditional: bool) -> Faulty {
        Faulty {
            conditional: conditional && inner.conditional_put_honoured(),
            inner,
            pause_after_list: std::sync::Mutex::new(None),
            refuse_deletes: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Make every DELETE fail (the store unreachable for it) while `on`.
    pub fn refuse_deletes(&self, on: bool) {
        self.refuse_deletes
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Hold the caller of the next LIST for `d` after the store answered it.
    pub fn pause_after_next_list(&self, d: Duration) {
        *self.pause_after_list.lock().unwrap() = Some(d);
    }
}

impl ObjectBackend for Faulty {
    fn put(&self, name: &str, bytes: &[u8]) -> crate::Result<()> {
        self.inner.put(name, bytes)
    }
    fn get(&self, name: &str) -> crate::Result<Vec<u8>> {
        self.inner.get(name)
    }
    fn get_range(&self, name: &str, start: u64, len: u64) -> crate::Result<Vec<u8>> {
        self.inner.get_range(name, start, len)
    }
    fn head(&self, name: &str) -> crate::Result<Option<u64>> {
        self.inner.head(name)
    }
    fn list(&self, prefix: &str) -> crate::Result<Vec<(String, u64)>> {
        let listed = self.inner.list(prefix);
        if let Some(d) = self.pause_after_list.lock().unwrap().take() {
            std::thread::sleep(d);
        }
        listed
    }
    fn delete(&self, name: &str) -> crate::Result<()> {
        if self
            .refuse_deletes
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return Err(crate::Error::Unreachable {
                op: crate::Op::Delete,
                name: name.to_string(),
                endpoint: "faulty test store".into(),
                detail: "deletes refused by the test".into(),
            });
        }
        self.inner.delete(name)
    }
    fn put_if_absent(&self, name: &str, bytes: &[u8]) -> crate::Result<bool> {
        if self.conditional {
            return self.inner.put_if_absent(name, bytes);
        }
        if self.inner.head(name)?.is_some() {
            return Ok(false);
        }
        self.inner.put(name, bytes)?;
        Ok(true)
    }
    fn conditional_put_honoured(&self) -> bool {
        self.conditional
    }
    fn stats(&self) -> crate::BackendStats {
        self.inner.stats()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
}
