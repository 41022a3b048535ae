//! Setting up and opening a pool in a bucket: `condense init s3://...` ([`init`]),
//! `condense connect` ([`connect`]), and the open of its local directory
//! ([`open_local`]: the lease, the view of the bucket, the rebuilt local files, the
//! `meta.dat` mirror).
//!
//! Invariants:
//! - A local directory is made only in a missing or empty directory, and holds
//!   `remote.conf`, `pool/cache.conf` and the writeback cache.
//! - The durability is the pool's, read from its superblock; a `durability=` line of an
//!   older `remote.conf` is taken once, for a pool that stores none, and then dropped.
//! - The superblock the pool opens must name the durability the bucket side was set up with
//!   ([`AfterOpen::finish`]).

use super::conf::{backend, remote_error, RemoteConf, REMOTE_CONF_NAME};
use super::lease::Lease;
use super::names::{Names, View};
use super::object_dir::{RemoteDir, LOCAL_SUBDIR};
use super::shared::{ReadBlocks, Shared};
use super::wal::WalDir;
use crate::cache_tier::{CacheConf, CacheMode};
use crate::io::{Dir, RealDir};
use condense_format::error::{Error, Result};
use condense_format::Durability;
use condense_format::Superblock;
use condense_object_store::ObjectBackend;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

/// Create the local directory `path` for the pool `conf` names, with a writeback cache of
/// `cache_size` bytes. `path` must be missing or empty.
fn prepare_local(path: &Path, conf: &RemoteConf, cache_size: u64) -> Result<()> {
    if let Ok(mut entries) = std::fs::read_dir(path) {
        if entries.next().is_some() {
            return Err(Error::Invalid(format!(
                "{} is not empty: give a new (or empty) directory for the pool's local files",
                path.display()
            )));
        }
    }
    crate::io::create_private_dir(path)
        .and_then(|()| crate::io::create_private_dir(&path.join(LOCAL_SUBDIR)))
        .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
    let abs = std::fs::canonicalize(path)
        .map_err(|e| Error::io(format!("resolving {}", path.display()), e))?;
    let cache = CacheConf {
        path: abs.display().to_string(),
        size_bytes: cache_size,
        mode: CacheMode::WriteBack,
    };
    let sub = RealDir::new(&abs.join(LOCAL_SUBDIR));
    crate::io::write_file_atomically(
        &sub,
        crate::cache_tier::CACHE_CONF_NAME,
        cache.encode().as_bytes(),
    )?;
    crate::io::write_file_atomically(
        &RealDir::new(&abs),
        REMOTE_CONF_NAME,
        conf.encode().as_bytes(),
    )
}

pub(super) fn shared_for(
    conf: &RemoteConf,
    store: Arc<dyn ObjectBackend>,
    read_only: bool,
    durability: Durability,
) -> Arc<Shared> {
    Arc::new(Shared {
        store,
        url: conf.url.clone(),
        read_only,
        remote_durability: AtomicBool::new(durability == Durability::Remote),
        lease_lost: AtomicBool::new(false),
        fence: Mutex::new(None),
        names: Names::default(),
        last_error: Mutex::new(None),
        last_upload: Mutex::new(None),
        blocks: Mutex::new(ReadBlocks::default()),
        prefetched: std::sync::Condvar::new(),
    })
}

/// The two copies of the superblock (crate::copies), primary first.
fn superblock_names() -> [String; 2] {
    let primary = condense_format::SUPERBLOCK_NAME;
    [primary.to_string(), crate::copies::copy_name(primary)]
}

/// The pool's superblock in `view` (`None`: no pool there): its primary copy, or its copy
/// where the primary is missing or damaged (the pool's open says which it used).
fn read_superblock(
    conf: &RemoteConf,
    store: &dyn ObjectBackend,
    view: &View,
) -> Result<Option<Superblock>> {
    let mut first_error = None;
    for name in superblock_names() {
        let Some((obj, _)) = view.object(&name) else {
            continue;
        };
        match store.get(&obj) {
            Ok(b) => match Superblock::decode(&b) {
                Ok(sb) => return Ok(Some(sb)),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            },
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(remote_error(&conf.url, e)),
        }
    }
    first_error.map_or(Ok(None), Err)
}

/// The bytes of pool file `name` as the newest root of the pool in `conf`'s bucket names it
/// (`None`: no such file): for tests and tools that look inside a bucket.
pub fn stored_file(conf: &RemoteConf, name: &str) -> Result<Option<(String, Vec<u8>)>> {
    let store = backend(conf, false)?;
    let view = View::load(&*store, &conf.url)?;
    let Some((obj, _)) = view.object(name) else {
        return Ok(None);
    };
    let bytes = store.get(&obj).map_err(|e| remote_error(&conf.url, e))?;
    Ok(Some((obj, bytes)))
}

/// Every pool file of the pool in `conf`'s bucket as its newest root names it: name →
/// (object, bytes).
pub fn stored_files(
    conf: &RemoteConf,
) -> Result<std::collections::BTreeMap<String, (String, u64)>> {
    let store = backend(conf, false)?;
    Ok(View::load(&*store, &conf.url)?.files())
}

/// Take the lease of the pool in `shared`'s bucket and load the view that lease writes
/// over: a view loaded after the claim was won, in which no generation is newer than ours.
fn take_lease(shared: &Arc<Shared>, known_epoch: u64) -> Result<(Lease, View)> {
    let lease = Lease::acquire(shared, known_epoch)?;
    let view = View::load(&*shared.store, &shared.url)?;
    if view.max_epoch >= lease.generation().epoch {
        return Err(Error::corrupt(
            format!("{} claims/", shared.url),
            format!(
                "objects of epoch {} are in the bucket but the claims name none above {}: the \
                 claims were removed by hand; restore them or ask for help before writing",
                view.max_epoch,
                lease.generation().epoch - 1
            ),
        ));
    }
    Ok((lease, view))
}

/// `condense init s3://...`, the bucket side: the local directory `path` set up, and the
/// bucket as the directory on which `condense_engine::pool::Pool::init_remote` creates the pool
/// (it stores `durability`).
pub fn init(
    path: &Path,
    conf: &RemoteConf,
    durability: Durability,
    cache_size: u64,
) -> Result<RemoteDir> {
    let store = backend(conf, true)?;
    let holds_pool = |view: &View| superblock_names().iter().any(|n| view.object(n).is_some());
    let already = || {
        Error::Invalid(format!(
            "{} already holds a Condense pool: to use it on this host, run `condense connect {} \
             --cache DIR --cache-size SIZE`",
            conf.url, conf.url
        ))
    };
    let view = View::load(&*store, &conf.url)?;
    if holds_pool(&view) {
        return Err(already());
    }
    let conf = RemoteConf {
        durability_to_store: None,
        ..conf.clone()
    };
    prepare_local(path, &conf, cache_size)?;
    let shared = shared_for(&conf, store, false, durability);
    let (lease, view) = take_lease(&shared, view.max_epoch)?;
    if holds_pool(&view) {
        return Err(already());
    }
    shared.names.install(view);
    shared.names.begin(&*shared, lease.generation())?;
    Ok(RemoteDir::new(shared, path, Some(lease)))
}

/// `condense connect s3://...`: the local directory `path` for a pool already in the bucket
/// (a new host, a disaster reopen, a reader beside the writer). The pool keeps its stored
/// durability: `durability`, if given, must be the same (it is only a check), except for a
/// pool that stores none yet (made before issue 23), where it is stored by the first
/// writable open. Returns the pool's stored durability.
pub fn connect(
    path: &Path,
    conf: &RemoteConf,
    durability: Option<Durability>,
    cache_size: u64,
) -> Result<Option<Durability>> {
    let store = backend(conf, false)?;
    let view = View::load(&*store, &conf.url)?;
    let Some(sb) = read_superblock(conf, &*store, &view)? else {
        return Err(Error::Invalid(format!(
            "{} holds no Condense pool: create one with `condense init {} --cache DIR --cache-size SIZE`",
            conf.url, conf.url
        )));
    };
    if let (Some(stored), Some(asked)) = (sb.durability, durability) {
        if stored != asked {
            return Err(Error::Invalid(format!(
                "pool {} has durability {} (stored with the pool, for every host that uses it); \
                 connect does not change it: leave out --durability {}, and to change it for \
                 every host, run `condense --pool {} durability set {}` once connected",
                conf.url,
                stored.as_str(),
                asked.as_str(),
                path.display(),
                asked.as_str()
            )));
        }
    }
    let conf = RemoteConf {
        durability_to_store: if sb.durability.is_none() {
            durability
        } else {
            None
        },
        ..conf.clone()
    };
    prepare_local(path, &conf, cache_size)?;
    Ok(sb.durability)
}

/// True if `path` is the local directory of a pool in an object store.
pub fn is_local_dir(path: &Path) -> bool {
    path.join(REMOTE_CONF_NAME).is_file()
}

/// What the pool needs to open an S3 pool from its local directory.
pub struct Opened {
    pub dir: Arc<RemoteDir>,
    /// The cache (and staging) directory: the local directory, as a [`WalDir`] with
    /// `remote` durability.
    pub cache_dir: Arc<dyn Dir>,
    pub read_only: bool,
    /// To do once the pool is open (`AfterOpen::finish`).
    pub after: AfterOpen,
}

/// The durability of an S3 pool, as the open found it, checked and (for a pool that stores
/// none yet) stored once the pool is open.
pub struct AfterOpen {
    /// The durability in the superblock read before the open.
    read: Option<Durability>,
    /// Store this one in the pool: it stores none yet, and this open may write.
    store: Option<Durability>,
    conf_path: PathBuf,
    conf: RemoteConf,
}

impl AfterOpen {
    /// The open pool's superblock (the one it checked, and authenticated in an encrypted
    /// pool) must name the durability the bucket side was set up with; a pool that stores
    /// none yet gets the one this open uses.
    pub fn finish(
        self,
        stored: Option<Durability>,
        store: impl FnOnce(Durability) -> Result<()>,
    ) -> Result<()> {
        if stored != self.read {
            return Err(Error::corrupt(
                format!("superblock of {}", self.conf.url),
                "it changed while this host opened the pool (another host wrote it): open the pool again",
            ));
        }
        let Some(d) = self.store else {
            return Ok(());
        };
        store(d)?;
        tracing::warn!(
            "pool {} stored no durability (made by an older Condense): it now stores {} ({}); \
             change it with `condense durability set local|remote`",
            self.conf.url,
            d.as_str(),
            if self.conf.durability_to_store.is_some() {
                "from this host's remote.conf"
            } else {
                "the default"
            }
        );
        forget_conf_durability(&self.conf_path, &self.conf)
    }
}

/// Rewrite `remote.conf` without its `durability=` line (the pool stores its own).
fn forget_conf_durability(path: &Path, conf: &RemoteConf) -> Result<()> {
    if conf.durability_to_store.is_none() {
        return Ok(());
    }
    let conf = RemoteConf {
        durability_to_store: None,
        ..conf.clone()
    };
    crate::io::write_file_atomically(
        &RealDir::new(path),
        REMOTE_CONF_NAME,
        conf.encode().as_bytes(),
    )
}

/// Open the bucket side of the pool whose local directory is `path`: take the lease (unless
/// read-only), rebuild lost local files from write-ahead objects, bring the metadata mirror
/// up to date. The durability comes from the pool's superblock.
/// The lease of the part whose local directory is `path` (one LIST, a GET per claim), for
/// `condense hosts`: its holder now, or its last holder (released or expired).
pub fn part_lease(path: &Path) -> Result<Option<super::lease::LeaseBody>> {
    let conf = RemoteConf::decode(
        &std::fs::read(path.join(REMOTE_CONF_NAME))
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?,
    )?;
    let shared = shared_for(&conf, backend(&conf, false)?, true, Durability::Local);
    super::lease::holder(&shared)
}

pub fn open_local(path: &Path, read_only: bool) -> Result<Opened> {
    let conf = RemoteConf::decode(&std::fs::read(path.join(REMOTE_CONF_NAME)).map_err(|e| {
        Error::io(
            format!("reading {}", path.join(REMOTE_CONF_NAME).display()),
            e,
        )
    })?)?;
    let read_only = read_only || conf.read_only;
    let store = backend(&conf, !read_only)?;
    let mut view = View::load(&*store, &conf.url)?;
    if read_superblock(&conf, &*store, &view)?.is_none() {
        return Err(Error::NotAPool(PathBuf::from(&conf.url)));
    }
    // A writer takes the lease first, and reads the pool as it is once the lease is its own.
    let shared = shared_for(&conf, store, read_only, Durability::Local);
    let lease = if read_only {
        None
    } else {
        let (lease, after) = take_lease(&shared, view.max_epoch)?;
        view = after;
        Some(lease)
    };
    let sb = read_superblock(&conf, &*shared.store, &view)?
        .ok_or_else(|| Error::NotAPool(PathBuf::from(&conf.url)))?;
    let durability = match (sb.durability, conf.durability_to_store) {
        (Some(stored), Some(here)) if stored != here => {
            tracing::warn!(
                "{} says durability={} (written by an older Condense); the pool {} stores {}, \
                 which is used",
                path.join(REMOTE_CONF_NAME).display(),
                here.as_str(),
                conf.url,
                stored.as_str()
            );
            stored
        }
        (Some(stored), _) => stored,
        (None, here) => here.unwrap_or_default(),
    };
    let after = AfterOpen {
        read: sb.durability,
        store: (sb.durability.is_none() && !read_only).then_some(durability),
        conf_path: path.to_path_buf(),
        conf: conf.clone(),
    };
    if sb.durability.is_some() && !read_only {
        forget_conf_durability(path, &conf)?;
    }
    shared.use_durability(durability);
    shared.names.install(view);
    if let Some(l) = &lease {
        shared.names.begin(&*shared, l.generation())?;
    }
    let local = Arc::new(RealDir::new(path));
    // A writer's local directory (even opened read-only, e.g. by `export`) is rebuilt from
    // the write-ahead objects in the bucket, whatever the pool's durability (it may have
    // been `remote` before a change); a reader host's never is (they are the writer's).
    let cache_dir: Arc<dyn Dir> = if conf.read_only {
        local
    } else {
        let wal = WalDir::new(local.clone(), shared.clone());
        wal.recover()?;
        Arc::new(wal)
    };
    let dir = RemoteDir::new(shared, path, lease).with_membership(super::members::Membership::new(
        &conf,
        path,
        prepare_local,
    ));
    dir.sync_meta_mirror()?;
    Ok(Opened {
        dir: Arc::new(dir),
        cache_dir,
        read_only,
        after,
    })
}

/// Delete the pool files `names` of the part whose local directory is `path` (its
/// `remote.conf` names the part) from the bucket, directly, without that part's lease: for
/// the segments of a forgotten host's part that no other host names (`condense_engine::hosts::forget`;
/// the caller checked that its lease is not held). Returns the files and bytes deleted.
pub fn delete_part_files(
    path: &Path,
    names: &std::collections::BTreeSet<String>,
) -> Result<(u64, u64)> {
    let conf = RemoteConf::decode(
        &std::fs::read(path.join(REMOTE_CONF_NAME))
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?,
    )?;
    let conf = RemoteConf {
        read_only: false,
        ..conf
    };
    let store = backend(&conf, true)?;
    let view = View::load(&*store, &conf.url)?;
    let (mut files, mut bytes) = (0, 0);
    for (name, (obj, len)) in view.files() {
        if !names.contains(&name) {
            continue;
        }
        match store.delete(&obj) {
            Ok(()) => {}
            Err(e) if e.is_not_found() => continue,
            Err(e) => return Err(remote_error(&conf.url, e)),
        }
        files += 1;
        bytes += len;
    }
    Ok((files, bytes))
}
