//! The other hosts of a pool several hosts share, as the core knows them (docs/S3.md "Many
//! hosts"; the protocols are [`crate::hosts`]'): their trees open read-only (the peers),
//! their names and slots in the registry, the forgets every host honours, and the steps at
//! which a test stops a hand-over.
//!
//! Owns: `Pool::peers` (slot → the peer's tree, opened again at each fold) and the segments
//! of each peer this pool reads records from. The peer rule of the lock order (pool/mod.rs):
//! a peer's `state` is taken only by its own methods, with no pool's `state` held, and never
//! under the `peers` map's lock (the map is copied out first).

use crate::crypto::UserKey;
use crate::error::{Error, Result};
use crate::format::hosts::{released_slot, Forgotten};
use crate::format::segment_slot;
use crate::index::SETTING_KEY;
use crate::io::{File, Peer};
use crate::locks::lock;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

use super::Pool;

/// The steps of a hand-over at which a test can stop it as a kill would
/// ([`Pool::stop_handovers_at`]): a move's release recorded but not published; an adopt's or
/// clone's claim put, its volume made, its first batch of blocks mapped, every block mapped,
/// and the adopt recorded but not published.
pub const STEP_RELEASED: u32 = 1;
pub const STEP_CLAIMED: u32 = 2;
pub const STEP_CREATED: u32 = 3;
pub const STEP_FIRST_BATCH: u32 = 4;
pub const STEP_FILLED: u32 = 5;
pub const STEP_COMPLETED: u32 = 6;
/// `handover_stop` once a stop was hit: every later step stops too.
const STOPPED: u32 = u32::MAX;

/// A peer's tree and how it opened: (the registry's entry, the tree or why it failed).
pub(crate) type OpenedPeer = (Peer, Result<Arc<Pool>>);

impl Pool {
    /// True if other hosts share this pool (they may name this host's records).
    pub fn is_shared(&self) -> Result<bool> {
        Ok(!self
            .dir
            .peers()
            .map_err(|e| Error::io("listing the hosts of the pool", e))?
            .is_empty())
    }

    /// A host that just joined ([`Pool::join_remote`], its part at `path`) takes the pool's
    /// dedup index setting, its first host's `index/mode` record, so that every host's index
    /// has the mode and budget the pool was made with (docs/S3.md "Many hosts"); `condense
    /// index set` changes one host's later. Without a readable first host it stays dense.
    pub(crate) fn take_index_setting(path: &Path, key: Option<&UserKey>) -> Result<()> {
        let opts = super::OpenOptions {
            key: key.cloned(),
            ..Default::default()
        };
        let pool = Pool::open_path(path, opts)?;
        let first = pool.peers().get(&0).and_then(|p| p.meta_get(SETTING_KEY));
        if let Some(v) = first {
            pool.meta_put(SETTING_KEY, Some(&v))?;
        }
        pool.close()
    }

    /// The peers as last opened ([`Pool::attach_peers`]), by slot.
    pub(crate) fn peers(&self) -> BTreeMap<u8, Arc<Pool>> {
        lock(&self.peers).clone()
    }

    /// Open every other host's tree read-only (again: a fresh view of each) and read the
    /// records of their segments from now on. A tree that fails to open is reported, and the
    /// segments already known of it stay readable.
    pub(crate) fn attach_peers(&self) -> Result<Vec<OpenedPeer>> {
        let peers = self
            .dir
            .peers()
            .map_err(|e| Error::io("listing the hosts of the pool", e))?;
        let mut out = Vec::new();
        for peer in peers {
            // The previous open of this peer holds its local directory's lock: close it first.
            // Another thread may hold it for a moment more (a name check): wait for it.
            lock(&self.peers).remove(&peer.slot);
            let mut tries = 0;
            let opened = loop {
                match Pool::open_peer(&peer.local, self.opts.key.clone()) {
                    Err(Error::Locked(_)) if tries < 40 => {
                        tries += 1;
                        std::thread::sleep(std::time::Duration::from_millis(50));
                    }
                    r => break r,
                }
            }
            .map_err(|e| Error::Invalid(format!("reading host {} ({}): {e}", peer.host, peer.url)));
            if let Ok(p) = &opened {
                let files = p.uploaded_segments();
                let mut st = self.lock_state();
                for (id, f) in files {
                    if segment_slot(id) == peer.slot && st.segments.is_foreign(id) {
                        st.segments.add_foreign(id, f);
                    }
                }
                drop(st);
                lock(&self.peers).insert(peer.slot, p.clone());
            }
            out.push((peer, opened));
        }
        Ok(out)
    }

    /// The segments of this (peer's) tree that are in its store: every one but those a
    /// writer still holds in its local directory.
    pub(crate) fn uploaded_segments(&self) -> Vec<(u32, Arc<dyn File>)> {
        let held: BTreeSet<String> = self
            .dir
            .held()
            .map(|h| h.into_iter().map(|(n, _)| n).collect())
            .unwrap_or_default();
        let st = self.lock_state();
        st.segments
            .ids()
            .filter(|(id, _)| !held.contains(&crate::format::segment_name(*id)))
            .filter_map(|(id, _)| st.segments.file(id).map(|f| (id, f)))
            .collect()
    }

    /// The other host `host` names (its name or slot), as the registry has it.
    pub(crate) fn peer_named(&self, host: &str) -> Result<Peer> {
        self.dir
            .peers()
            .map_err(|e| Error::io("listing the hosts of the pool", e))?
            .into_iter()
            .find(|p| p.answers_to(host))
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "host {host} in this pool (`condense hosts` lists them)"
                ))
            })
    }

    /// The name of the host in `slot`, as the registry has it.
    pub(crate) fn host_name_of(&self, slot: u8) -> String {
        if slot == 0 {
            return crate::remote::FIRST_HOST.to_string();
        }
        self.dir
            .peers()
            .ok()
            .and_then(|ps| ps.into_iter().find(|p| p.slot == slot).map(|p| p.host))
            .unwrap_or_else(|| format!("in slot {slot:02x}"))
    }

    /// The hosts forgotten (`condense hosts forget`), as this host's root and the newest
    /// roots of the other hosts it read last record it: a forget recorded by any host is
    /// honoured by every host.
    pub fn forgotten_hosts(&self) -> BTreeMap<u8, Forgotten> {
        let mut all = self.read_records(|r| Forgotten::all(r.meta()));
        for p in self.peers().into_values() {
            for (slot, f) in p.read_records(|r| Forgotten::all(r.meta())) {
                let e = all.entry(slot).or_insert_with(|| f.clone());
                e.reclaim |= f.reclaim;
                e.reclaimed |= f.reclaimed;
            }
        }
        all
    }

    /// The host whose part holds a volume `name` (as its root this host read last has it),
    /// unless that host handed it to this one: a new volume of that name is refused here.
    /// Best effort: two hosts creating one name within a fold interval both succeed (exact
    /// names across hosts need volume claims, not built).
    pub(crate) fn held_by_another_host(&self, name: &str) -> Option<String> {
        let forgotten = self.forgotten_hosts();
        let slot = self.peers().into_iter().find_map(|(slot, p)| {
            if forgotten.contains_key(&slot) {
                return None; // a forgotten host's volumes are adopted without a hand-over
            }
            p.read_records(|r| {
                r.has_volume(name) && released_slot(r.meta(), name) != Some(self.slot)
            })
            .then_some(slot)
        })?;
        Some(self.host_name_of(slot))
    }

    /// Tests only: stop this open's next hand-over at `step` (one of the `STEP_` constants)
    /// as a kill would: the command fails there, and nothing after that step runs (no
    /// clean-up either). The test then closes the pool and runs the command again. Feature
    /// `sim` (tests): in a release build no stop can be set, and every point passes.
    #[cfg(any(test, feature = "sim"))]
    pub fn stop_handovers_at(&self, step: u32) {
        self.handover_stop
            .store(step, std::sync::atomic::Ordering::Relaxed);
    }

    /// A step of a hand-over: fails if a test stops it here (or stopped it before).
    pub(crate) fn handover_point(&self, step: u32) -> Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        let at = self.handover_stop.load(Relaxed);
        if at != 0 && (at == step || at == STOPPED) {
            self.handover_stop.store(STOPPED, Relaxed);
            return Err(Error::Invalid(format!(
                "hand-over stopped at step {step} (a test's simulated kill)"
            )));
        }
        Ok(())
    }

    /// Whether a test's stop was hit ([`Pool::handover_point`]).
    pub(crate) fn handover_stopped(&self) -> bool {
        self.handover_stop
            .load(std::sync::atomic::Ordering::Relaxed)
            == STOPPED
    }
}

// Debug builds only: the assertion it tests is a debug assertion.
#[cfg(all(test, debug_assertions))]
mod tests {
    use crate::{InitOptions, OpenOptions, Pool};

    /// The peer rule of the lock order: a thread that holds one pool's state and takes
    /// another's (a peer's) fails in debug builds, and one at a time is fine.
    #[test]
    fn a_thread_takes_one_pools_state_at_a_time() {
        let (a, b) = (
            tempfile::tempdir().expect("tempdir"),
            tempfile::tempdir().expect("tempdir"),
        );
        for d in [&a, &b] {
            Pool::init_path(d.path(), &InitOptions::default()).expect("init");
        }
        let own = Pool::open_path(a.path(), OpenOptions::default()).expect("open");
        let peer = Pool::open_path(b.path(), OpenOptions::default()).expect("open");
        drop(own.lock_state());
        drop(peer.lock_state());
        let both = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _mine = own.lock_state();
            let _theirs = peer.lock_state();
        }));
        assert!(
            both.is_err(),
            "a peer's state taken under this pool's must fail"
        );
        // The mark went with the guards: the next hold is fine.
        drop(peer.lock_state());
    }
}
