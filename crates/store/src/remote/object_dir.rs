//! The bucket as the pool directory: [`RemoteDir`], the [`Dir`] a pool on S3 opens, and
//! the mirror of `meta.dat` in the local directory (see the module docs of
//! [`crate::remote`] for how files map to objects).
//!
//! Invariants:
//! - Names of the local subdirectory (`cache.conf`, the lock) never reach the bucket.
//! - Only a file being written can be renamed, and the rename is its one PUT, of a new object
//!   ([`super::names`]: no object is ever replaced); renaming a checkpoint root puts its
//!   manifest first and records the root's hash in `meta.synced` (the mirror matches it).
//! - The directory is this open's view ([`super::names`]): what the newest root names, and
//!   what this open uploaded since. Listing it costs no request.
//! - The mirror of `meta.dat` is used only while `meta.synced` names the root in the view;
//!   otherwise the open fetches every extent.

use super::conf::remote_error;
use super::files::{BufFile, BufState, MetaFile, ObjFile, META_EXTENT_BYTES};
use super::lease::Lease;
use super::parallel::in_parallel;
use super::shared::Shared;
use crate::io::StoreStatus;
use crate::io::{Dir, File, RealDir};
use condense_format::error::{Error, Result};
use condense_format::Durability;
use condense_format::{CHECKPOINT_NAME, META_NAME};
use std::collections::{BTreeSet, HashMap};
use std::io;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// The subdirectory of the local directory for the `meta.dat` mirror and `cache.conf`.
pub const LOCAL_SUBDIR: &str = "pool";
const META_SYNCED_NAME: &str = "meta.synced";

/// The pool directory of an S3 pool (see the module docs for the mapping).
pub struct RemoteDir {
    shared: Arc<Shared>,
    /// `LOCAL/pool/`: the `meta.dat` mirror, `meta.synced`, `cache.conf`.
    local: RealDir,
    meta: Mutex<Option<Arc<MetaFile>>>,
    opened: Instant,
    /// Files being written whole (`.tmp`, `.partial`, new files), by name, for `rename`.
    writing: Mutex<HashMap<String, Weak<BufFile>>>,
    lease: Option<Lease>,
    /// This host's place among the hosts sharing the pool (`None`: a reader of one tree).
    membership: Option<super::members::Membership>,
    /// The volume claims, made at the first use (a writer's only).
    claims: std::sync::OnceLock<Option<Arc<dyn crate::io::VolumeClaims>>>,
}

/// The objects of a listing of this tree's prefix that are its own: not the trees of the
/// hosts that joined the pool, nor their registry (the first host's prefix holds both).
fn own_objects(all: Vec<(String, u64)>) -> Vec<(String, u64)> {
    all.into_iter()
        .filter(|(o, _)| !condense_format::bucket::is_pool_wide(o))
        .collect()
}

/// Names kept in the local subdirectory, never uploaded.
fn is_local_name(name: &str) -> bool {
    name == crate::cache_tier::CACHE_CONF_NAME
        || name == "cache.conf.tmp"
        || name == condense_format::LOCK_NAME
}

impl RemoteDir {
    /// The bucket side of the pool whose local directory is `path`.
    pub(super) fn new(shared: Arc<Shared>, path: &Path, lease: Option<Lease>) -> RemoteDir {
        RemoteDir {
            shared,
            local: RealDir::new(&path.join(LOCAL_SUBDIR)),
            meta: Mutex::new(None),
            opened: Instant::now(),
            writing: Mutex::new(HashMap::new()),
            lease,
            membership: None,
            claims: std::sync::OnceLock::new(),
        }
    }

    fn describe_url(&self) -> &str {
        &self.shared.url
    }

    /// The meta.dat mirror is current if it matches the root in the bucket; otherwise fetch
    /// every extent.
    pub(super) fn sync_meta_mirror(&self) -> Result<()> {
        // The primary root, or its copy where the primary is missing (a damaged primary only
        // fails to match the mirror's tag: the mirror is fetched again).
        let names = &self.shared.names;
        let mut found = None;
        for name in [
            CHECKPOINT_NAME.to_string(),
            crate::copies::copy_name(CHECKPOINT_NAME),
        ] {
            let Some((obj, _)) = names.object(&name) else {
                continue;
            };
            match self.shared.store.get(&obj) {
                Ok(r) => {
                    found = Some(r);
                    break;
                }
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(remote_error(&self.shared.url, e)),
            }
        }
        let Some(root) = found else {
            return Ok(());
        };
        let tag = blake3::hash(&root).to_hex().to_string();
        let synced =
            std::fs::read_to_string(self.local.path().join(META_SYNCED_NAME)).unwrap_or_default();
        let mirror = self.local.path().join(META_NAME);
        let mut lines = synced.lines();
        let local_tag = lines.next().unwrap_or_default();
        if local_tag.trim() == tag && mirror.exists() {
            return Ok(());
        }
        // Extents the mirror holds, by the object they came from: an object is never
        // replaced, so an extent whose object is the same holds the same bytes.
        let held: HashMap<u64, String> = if mirror.exists() {
            lines
                .filter_map(|l| {
                    let (n, obj) = l.split_once(' ')?;
                    Some((n.parse().ok()?, obj.to_string()))
                })
                .collect()
        } else {
            HashMap::new()
        };
        let all = names.extents();
        let jobs: Vec<(u64, String)> = all
            .iter()
            .filter(|(n, obj, _)| held.get(n) != Some(obj))
            .map(|(n, obj, _)| (*n, obj.clone()))
            .collect();
        tracing::info!(
            "fetching the metadata of {} ({} of {} extents changed)",
            self.shared.url,
            jobs.len(),
            all.len()
        );
        // A crash while the mirror changes leaves no claim that it matches anything.
        match std::fs::remove_file(self.local.path().join(META_SYNCED_NAME)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(format!("removing {META_SYNCED_NAME}"), e)),
        }
        let file = self
            .local
            .open(META_NAME, true)
            .map_err(|e| Error::io(format!("opening {}", mirror.display()), e))?;
        let fetched = in_parallel(&jobs, |(n, name)| {
            self.shared
                .note(self.shared.store.get(name))
                .and_then(|bytes| file.write_at(&bytes, n * META_EXTENT_BYTES))
                .map_err(|e| Error::io(format!("fetching {name}"), e))
        });
        fetched.into_iter().collect::<Result<Vec<()>>>()?;
        let end = all
            .iter()
            .map(|(n, _, b)| n * META_EXTENT_BYTES + b)
            .max()
            .unwrap_or(0);
        file.set_len(end)
            .and_then(|()| file.sync())
            .map_err(|e| Error::io(format!("syncing {}", mirror.display()), e))?;
        self.write_meta_synced(&root)
    }

    /// Record that the mirror holds the pages of `root`, and which extent object each of its
    /// extents came from.
    fn write_meta_synced(&self, root: &[u8]) -> Result<()> {
        let mut text = blake3::hash(root).to_hex().to_string();
        text.push('\n');
        for (n, obj, _) in self.shared.names.extents() {
            text += &format!("{n} {obj}\n");
        }
        crate::io::write_file_atomically(&self.local, META_SYNCED_NAME, text.as_bytes())
    }

    fn meta_file(&self, create: bool) -> io::Result<Arc<MetaFile>> {
        let mut slot = self.meta.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = &*slot {
            return Ok(m.clone());
        }
        let local = self.local.open(META_NAME, create)?;
        let m = Arc::new(MetaFile {
            local,
            dirty: Mutex::new(BTreeSet::new()),
            shared: self.shared.clone(),
        });
        *slot = Some(m.clone());
        Ok(m)
    }

    /// The pool's durability, as stored in its superblock.
    pub fn durability(&self) -> Durability {
        self.shared.durability()
    }

    /// Use `d` for the files opened from now on (the caller has stored it in the pool).
    pub(super) fn use_durability(&self, d: Durability) {
        self.shared.use_durability(d);
    }

    /// Fail at once, changing nothing, if the store's last request failed and it does not
    /// answer now either (checked before a checkpoint starts: a checkpoint that fails
    /// half-way must poison the pool, one that never starts need not).
    pub fn check_reachable(&self) -> Result<()> {
        let failing = self
            .shared
            .last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some();
        if !failing {
            return Ok(());
        }
        self.shared
            .note(self.shared.store.head(condense_format::SUPERBLOCK_NAME))
            .map(|_| ())
            .map_err(|e| {
                Error::io(
                    format!(
                        "checkpointing to {}: the store does not answer; the checkpoint runs once it does",
                        self.shared.url
                    ),
                    e,
                )
            })
    }

    /// Time since this open uploaded a checkpoint root, or since the open.
    pub fn since_last_upload(&self) -> Duration {
        self.shared
            .last_upload
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map_or_else(|| self.opened.elapsed(), |t| t.elapsed())
    }

    /// Mark that a checkpoint root was uploaded now.
    fn uploaded(&self) {
        *self
            .shared
            .last_upload
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
    }

    /// Take part in the pool as `m` says (its slot, the other members).
    pub(super) fn with_membership(mut self, m: super::members::Membership) -> RemoteDir {
        self.membership = Some(m);
        self
    }

    /// The bucket side of the pool for `stats` (one LIST).
    pub fn status(&self) -> StoreStatus {
        let (objects, bytes) = match self.shared.store.list("") {
            Ok(l) => {
                let own = own_objects(l);
                (own.len() as u64, own.iter().map(|(_, s)| s).sum())
            }
            Err(_) => (0, 0),
        };
        let health = if self.shared.lease_lost.load(Ordering::Relaxed) {
            "lease lost".to_string()
        } else if let Some((since, msg)) = &*self
            .shared
            .last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
        {
            format!("degraded for {} s: {msg}", since.elapsed().as_secs())
        } else if self.shared.read_only {
            "ok (read-only)".to_string()
        } else {
            "ok".to_string()
        };
        StoreStatus {
            url: self.shared.url.clone(),
            durability: self.durability(),
            health,
            objects,
            bytes,
            requests: self.shared.store.stats(),
            pending_bytes: 0,
            last_upload_age_seconds: self
                .shared
                .last_upload
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .map(|t| t.elapsed().as_secs()),
            conditional_put_honoured: self.shared.store.conditional_put_honoured(),
        }
    }
}

/// An S3 pool with changes checkpoints (uploads its metadata) at least this often.
pub const REMOTE_CHECKPOINT_EVERY: Duration = Duration::from_secs(60);

impl Dir for RemoteDir {
    fn open(&self, name: &str, create: bool) -> io::Result<Arc<dyn File>> {
        if is_local_name(name) {
            return self.local.open(name, create);
        }
        if name == META_NAME {
            return Ok(self.meta_file(create)? as Arc<dyn File>);
        }
        if create {
            self.shared.may_write(&format!("creating {name}"))?;
            let f = Arc::new(BufFile {
                shared: self.shared.clone(),
                name: name.to_string(),
                state: Mutex::new(BufState::Writing(Vec::new())),
            });
            self.writing
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(name.to_string(), Arc::downgrade(&f));
            return Ok(f);
        }
        match self.shared.names.object(name) {
            Some((obj, len)) => Ok(Arc::new(ObjFile {
                shared: self.shared.clone(),
                name: obj,
                len,
            })),
            None => Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no object {name} in {}", self.describe_url()),
            )),
        }
    }

    fn exists(&self, name: &str) -> io::Result<bool> {
        if is_local_name(name) || name == META_NAME {
            return self.local.exists(name);
        }
        Ok(self.shared.names.object(name).is_some())
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        if is_local_name(name) {
            return self.local.remove(name);
        }
        self.writing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        self.shared.names.remove_file(&*self.shared, name)
    }

    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        if is_local_name(from) && is_local_name(to) {
            return self.local.rename(from, to);
        }
        let file = self
            .writing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(from)
            .and_then(|w| w.upgrade())
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!(
                        "renaming {from} to {to} in {}: only a file being written can be renamed",
                        self.describe_url()
                    ),
                )
            })?;
        let bytes = file.store_as(to)?;
        if to == CHECKPOINT_NAME {
            self.uploaded();
            self.write_meta_synced(&bytes)
                .map_err(|e| io::Error::other(e.to_string()))?;
        }
        Ok(())
    }

    fn list(&self, prefix: &str) -> io::Result<Vec<String>> {
        Ok(self
            .shared
            .names
            .list(prefix)
            .into_iter()
            .map(|(n, _)| n)
            .collect())
    }

    fn sync_dir(&self) -> io::Result<()> {
        // Every PUT is durable when acknowledged.
        Ok(())
    }

    fn total_bytes(&self) -> io::Result<u64> {
        let all = own_objects(self.shared.note(self.shared.store.list(""))?);
        Ok(all.iter().map(|(_, s)| s).sum())
    }

    fn available_bytes(&self) -> io::Result<u64> {
        Ok(u64::MAX / 4)
    }

    /// In the local directory (`LOCAL/pool/`): scratch bytes never go to the bucket.
    fn scratch_file(&self) -> io::Result<Option<Arc<dyn crate::io::File>>> {
        self.local.scratch_file()
    }

    fn describe(&self) -> String {
        self.shared.url.clone()
    }

    fn whole_files_only(&self) -> bool {
        true
    }

    fn reads_cost_requests(&self) -> bool {
        true
    }

    fn check_reachable(&self) -> Result<()> {
        RemoteDir::check_reachable(self)
    }

    fn checkpoint_due(&self) -> bool {
        self.since_last_upload() >= REMOTE_CHECKPOINT_EVERY
    }

    fn durability(&self) -> Option<Durability> {
        Some(RemoteDir::durability(self))
    }

    fn set_durability(&self, d: Durability) -> bool {
        self.use_durability(d);
        true
    }

    fn store_status(&self) -> Option<StoreStatus> {
        Some(self.status())
    }

    fn segment_slot(&self) -> u8 {
        self.membership.as_ref().map_or(0, |m| m.slot)
    }

    fn peers(&self) -> io::Result<Vec<crate::io::Peer>> {
        match &self.membership {
            Some(m) => m.peers(),
            None => Ok(Vec::new()),
        }
    }

    fn volume_claims(&self) -> Option<Arc<dyn crate::io::VolumeClaims>> {
        self.claims
            .get_or_init(|| {
                let (m, lease) = (self.membership.as_ref()?, self.lease.as_ref()?);
                match m.claims(self.shared.clone(), lease.generation().writer) {
                    Ok(c) => Some(Arc::new(c) as Arc<dyn crate::io::VolumeClaims>),
                    Err(e) => {
                        tracing::warn!("{}: volume claims unavailable: {e}", self.shared.url);
                        None
                    }
                }
            })
            .clone()
    }
}
