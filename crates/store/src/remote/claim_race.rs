//! Racing the claim protocols (the lease, a slot join, a volume claim) in tests: two callers on
//! one directory store, one of them paused between its LIST and its PUT (docs/S3.md "Lease:
//! claims"), on a store with conditional PUT (a directory) and on one without (the same
//! directory seen through `conformance::Faulty`, whose `put_if_absent` is a HEAD and a plain
//! PUT). For this crate's tests and, with the `sim` feature, the volume-claim races of
//! condense-engine.

use super::members::ClaimRegistry;
use super::setup::shared_for;
use condense_format::error::{Error, Result};
use condense_format::remote::RemoteConf;
use condense_format::Durability;
use condense_object_store::conformance::Faulty;
use condense_object_store::{LocalBackend, ObjectBackend};
use std::sync::Arc;
use std::time::Duration;

/// Longer than the window bound and than the other caller's whole claim (LIST, PUT, 1 s
/// settle, LIST): without the window the paused caller would claim after the other won.
pub const PAUSE: Duration = Duration::from_millis(2000);
/// The other caller starts this long after the paused one listed.
pub const HEAD_START: Duration = Duration::from_millis(100);

/// Two handles on one fresh directory store: (the one that will be paused, the other).
pub fn two_handles(dir: &std::path::Path, conditional: bool) -> Result<(Arc<Faulty>, Arc<Faulty>)> {
    let inner: Arc<dyn ObjectBackend> = Arc::new(
        LocalBackend::open(dir).map_err(|e| Error::Invalid(format!("opening {dir:?}: {e}")))?,
    );
    Ok((
        Arc::new(Faulty::new(inner.clone(), conditional)),
        Arc::new(Faulty::new(inner, conditional)),
    ))
}

/// The `remote.conf` of a pool in directory `dir` (a `file://` URL).
pub fn conf(dir: &std::path::Path) -> RemoteConf {
    RemoteConf {
        url: format!("file://{}", dir.display()),
        endpoint: None,
        region: None,
        credentials: None,
        durability_to_store: None,
        read_only: false,
    }
}

/// Run `paused(handle)` on a handle paused after its first LIST and, `HEAD_START` later,
/// `other(handle)`, at once; their results.
pub fn race<T: Send>(
    handles: (Arc<Faulty>, Arc<Faulty>),
    paused: impl FnOnce(Arc<Faulty>) -> T + Send,
    other: impl FnOnce(Arc<Faulty>) -> T + Send,
) -> (T, T) {
    let (p, o) = handles;
    p.pause_after_next_list(PAUSE);
    std::thread::scope(|s| {
        let a = s.spawn(move || paused(p));
        let b = s.spawn(move || {
            std::thread::sleep(HEAD_START);
            other(o)
        });
        match (a.join(), b.join()) {
            (Ok(a), Ok(b)) => (a, b),
            _ => panic!("a racer panicked"),
        }
    })
}

/// `round(dir)` for `rounds` fresh directories, all at once (each on a thread of its own).
pub fn in_rounds(
    rounds: usize,
    round: impl Fn(&std::path::Path) -> Result<()> + Sync,
) -> Result<()> {
    let dirs: Vec<tempfile::TempDir> = (0..rounds)
        .map(|_| tempfile::tempdir().map_err(|e| Error::io("tempdir", e)))
        .collect::<Result<_>>()?;
    std::thread::scope(|s| {
        let hs: Vec<_> = dirs.iter().map(|d| s.spawn(|| round(d.path()))).collect();
        hs.into_iter()
            .try_for_each(|h| h.join().unwrap_or_else(|_| panic!("a round panicked")))
    })
}

/// The volume-claim registry of slot `slot` (writer `0x100 + slot`) of the pool `c` names,
/// through `store`.
pub fn claim_registry(c: &RemoteConf, store: Arc<Faulty>, slot: u8) -> ClaimRegistry {
    let store: Arc<dyn ObjectBackend> = store;
    let shared = shared_for(c, store.clone(), false, Durability::Local);
    ClaimRegistry::on(store, &c.url, shared, slot, 0x100 + u64::from(slot))
}
