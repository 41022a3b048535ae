//! Pools on S3-compatible object storage (docs/S3.md).
//!
//! Owns: how a pool's files map to objects of a bucket ([`RemoteDir`]), the write-ahead
//! objects of `--durability remote` ([`WalDir`]), the one-writer lease ([`Lease`]), the
//! pool's durability ([`crate::pool::Pool::set_durability`]) and the pool's *local
//! directory* (`remote.conf`, written by [`init`] and [`connect`]).
//!
//! A pool on S3 is a writeback-cache pool whose pool directory is a bucket. Its local
//! directory is the cache directory: the cache tier's slots, the journal, the open segment and
//! sealed segments not yet uploaded ("staged"), the lock file and the control socket, plus
//! `pool/` (a mirror of `meta.dat` and the local `cache.conf`). The engine sees the bucket
//! through the [`Dir`] seam; the mapping is:
//!
//! | pool file | in the bucket (`PREFIX/...`) |
//! |---|---|
//! | `superblock`, `checkpoint` and their copies `superblock.copy`, `checkpoint.copy` | one object each, replaced whole by a PUT (the engine writes them to a `.tmp` name and renames: the rename is the PUT) |
//! | `seg-N.dat` | one immutable object, uploaded whole by the destager (the rename of `seg-N.dat.partial` is the PUT) |
//! | `meta.dat` | `meta/XXXXXXXX`, fixed extents of [`META_EXTENT_BYTES`]; a sync uploads the extents written since the last one |
//! | `journal-G.wal` | only at `init` (the empty first generation); afterwards the journal lives in the local directory |
//! | `cache.conf` | not in the bucket: each host has its own cache (`pool/cache.conf`) |
//!
//! Invariants:
//! - **A checkpoint root in the bucket names only objects already in the bucket.** The pages
//!   are uploaded (the `meta.dat` sync) before the root (the checkpoint rename), and so is
//!   every segment the root can name: a checkpoint seals the open segment and uploads every
//!   staged one first (`Pool::upload_staged_through`). So the bucket alone is a whole pool
//!   as of its last root, and the write-ahead objects of `remote` durability are needed only
//!   for what came after it.
//! - **Replacing a `meta.dat` extent never changes a page the bucket's root names.** The page
//!   allocator never overwrites a unit the last durable root references
//!   ([`crate::page_alloc`]), so each extent object, old or new, holds those units intact.
//! - **The local mirror of `meta.dat` is trusted only if it matches the bucket's root**:
//!   `pool/meta.synced` holds a hash of the last root this host uploaded or downloaded; any
//!   other root in the bucket (another host wrote since) makes the open fetch every extent.
//! - **Only the lease holder writes** (best effort on stores without conditional PUT, such as
//!   Garage 2.5.0: see [`Lease`]). Every PUT and DELETE of a [`RemoteDir`] or [`WalDir`] is
//!   refused once the lease is lost, and a read-only open never writes to the bucket.
//! - With `--durability remote`, a sync of the journal or of a staged segment returns only
//!   after a write-ahead object (`wal/SEQ`) holding the bytes written since the previous sync
//!   is in the bucket; an open whose local directory lacks those files rebuilds them from
//!   the `wal/` objects, in sequence order ([`WalDir::recover`]).
//! - **The durability is the pool's**: stored in its superblock (set by [`init`], changed
//!   only by [`crate::pool::Pool::set_durability`]), read by every open from the bucket and
//!   checked against the superblock the pool then opens (`AfterOpen::finish`); never taken
//!   from the host, except once from an older `remote.conf` for a pool that stores none.
//! - Credentials never come from a command line: an endpoint or pool URL with a user name or
//!   password is refused without showing it ([`check_endpoint`]); a credentials file is read
//!   only if its owner alone can access it ([`crate::secret_file`]).

use crate::cache::{CacheConf, CacheMode};
use crate::error::{Error, Result};
use crate::format::{Superblock, CHECKPOINT_NAME, META_NAME};
use crate::io::{Dir, File, RealDir};
use condense_remote::{BackendStats, ObjectBackend};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The local directory's description of its pool in the bucket.
pub const REMOTE_CONF_NAME: &str = "remote.conf";
/// The subdirectory of the local directory for the `meta.dat` mirror and `cache.conf`.
pub const LOCAL_SUBDIR: &str = "pool";
/// Bytes of one `meta.dat` extent object.
pub const META_EXTENT_BYTES: u64 = 256 << 10;
/// Reads of an object fetch aligned blocks of this many bytes, kept in a small LRU: one block
/// (one GET) for a read out of order, [`READ_AHEAD_BLOCKS`] in one GET for a read that
/// continues the previous one (a request costs ~45-90 ms on Garage whatever its size).
const READ_BLOCK_BYTES: u64 = 256 << 10;
const READ_AHEAD_BLOCKS: u64 = 16;
/// Blocks kept by the read LRU (64 MiB).
const READ_BLOCKS_KEPT: usize = 256;
/// Uploads and downloads of extents run this many at a time.
const PARALLEL_REQUESTS: usize = 8;
const META_SYNCED_NAME: &str = "meta.synced";
const CONF_FIRST_LINE: &str = "condense-remote 1";
const LEASE_NAME: &str = "lease";
const LEASE_FIRST_LINE: &str = "condense-lease 1";
/// A lease not renewed for this long is free to take.
pub const LEASE_SECONDS: u64 = 30;
/// The holder renews its lease this often.
const LEASE_RENEW: Duration = Duration::from_secs(10);
/// After writing the lease, wait this long and read it back (stores without conditional PUT).
const LEASE_SETTLE: Duration = Duration::from_millis(500);
const WAL_PREFIX: &str = "wal";
const WAL_MAGIC: [u8; 8] = *b"CNDSWAL1";

pub use crate::format::Durability;

/// `remote.conf`: where the pool is and how this host reaches it. Holds no secret.
///
/// The durability is the pool's, stored in its superblock, not here. A `remote.conf` written
/// by a Condense that kept it here (before issue 23) holds a `durability=` line: for a pool
/// that stores none yet it is taken once (the first writable open stores it in the pool and
/// drops the line); for a pool that stores one, the pool's wins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteConf {
    /// `s3://BUCKET[/PREFIX]`, or `file:///DIR` (a directory as the object store: tests).
    pub url: String,
    /// S3 endpoint (`None`: `$AWS_ENDPOINT_URL`, else AWS).
    pub endpoint: Option<String>,
    /// S3 region (`None`: `$AWS_REGION`, else us-east-1).
    pub region: Option<String>,
    /// A file of `KEY=VALUE` lines with the credentials (`None`: the environment).
    pub credentials: Option<PathBuf>,
    /// A durability for a pool that stores none yet (made before issue 23): the old
    /// `durability=` line, or `connect --durability` to such a pool. `None` otherwise.
    pub durability_to_store: Option<Durability>,
    /// This host only reads the pool (no lease; never writes to the bucket).
    pub read_only: bool,
}

impl RemoteConf {
    pub fn encode(&self) -> String {
        let mut s = format!("{CONF_FIRST_LINE}\nurl={}\n", self.url);
        if let Some(e) = &self.endpoint {
            s += &format!("endpoint={e}\n");
        }
        if let Some(r) = &self.region {
            s += &format!("region={r}\n");
        }
        if let Some(c) = &self.credentials {
            s += &format!("credentials={}\n", c.display());
        }
        if let Some(d) = self.durability_to_store {
            s += &format!("durability={}\n", d.as_str());
        }
        s += &format!("read_only={}\n", self.read_only);
        s
    }

    pub fn decode(bytes: &[u8]) -> Result<RemoteConf> {
        let bad = |d: String| Error::corrupt(REMOTE_CONF_NAME, d);
        let text = std::str::from_utf8(bytes).map_err(|_| bad("not UTF-8 text".into()))?;
        let mut lines = text.lines();
        if lines.next() != Some(CONF_FIRST_LINE) {
            return Err(bad(format!("first line is not {CONF_FIRST_LINE:?}")));
        }
        let mut conf = RemoteConf {
            url: String::new(),
            endpoint: None,
            region: None,
            credentials: None,
            durability_to_store: None,
            read_only: false,
        };
        for l in lines {
            match l.split_once('=') {
                Some(("url", v)) => conf.url = v.to_string(),
                Some(("endpoint", v)) => conf.endpoint = Some(v.to_string()),
                Some(("region", v)) => conf.region = Some(v.to_string()),
                Some(("credentials", v)) => conf.credentials = Some(PathBuf::from(v)),
                Some(("durability", v)) => {
                    conf.durability_to_store =
                        Some(Durability::parse(v).ok_or_else(|| {
                            bad(format!("durability {v:?} is not local or remote"))
                        })?)
                }
                Some(("read_only", v)) => conf.read_only = v == "true",
                _ => {}
            }
        }
        if conf.url.is_empty() {
            return Err(bad("no url= line".into()));
        }
        Ok(conf)
    }

    /// Connect to the store this configuration names; `writer`: this open may write the
    /// bucket (a read-only open writes nothing, not even the conditional-put probe).
    pub fn backend(&self, writer: bool) -> Result<Arc<dyn ObjectBackend>> {
        if let Some(path) = self.url.strip_prefix("file://") {
            return condense_remote::LocalBackend::open(path)
                .map(|b| Arc::new(b) as Arc<dyn ObjectBackend>)
                .map_err(|e| remote_error(&self.url, e));
        }
        let (bucket, prefix) = parse_s3_url(&self.url)?;
        let vars = match &self.credentials {
            Some(f) => read_credentials(f)?,
            None => HashMap::new(),
        };
        let var = |k: &str| {
            vars.get(k)
                .cloned()
                .or_else(|| std::env::var(k).ok())
                .filter(|v| !v.is_empty())
        };
        let required = |k: &str| {
            var(k).ok_or_else(|| {
                Error::Invalid(format!(
                    "{k} is not set: export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or give \
                     --credentials FILE (lines of KEY=VALUE); never put them on the command line"
                ))
            })
        };
        let endpoint = match &self.endpoint {
            Some(e) => Some(e.clone()),
            None => var("AWS_ENDPOINT_URL"),
        };
        if let Some(e) = &endpoint {
            check_endpoint(e).map_err(|e| match (e, &self.endpoint) {
                (Error::Invalid(m), None) => Error::Invalid(format!("$AWS_ENDPOINT_URL: {m}")),
                (e, _) => e,
            })?;
        }
        let config = condense_remote::S3Config {
            bucket,
            prefix,
            endpoint,
            region: self
                .region
                .clone()
                .or_else(|| var("AWS_REGION"))
                .unwrap_or_else(|| "us-east-1".into()),
            access_key_id: required("AWS_ACCESS_KEY_ID")?,
            secret_access_key: required("AWS_SECRET_ACCESS_KEY")?,
            allow_http: var("AWS_ALLOW_HTTP")
                .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1"),
            timeouts: Default::default(),
            probe_conditional_put: writer && !self.read_only,
        };
        condense_remote::S3Backend::open(&config)
            .map(|b| Arc::new(b) as Arc<dyn ObjectBackend>)
            .map_err(|e| remote_error(&self.url, e))
    }
}

/// True if `spec` names a pool in an object store (`s3://...`, or `file://...` for tests).
pub fn is_remote_url(spec: &str) -> bool {
    spec.starts_with("s3://") || spec.starts_with("file://")
}

/// `s3://BUCKET[/PREFIX]` → (bucket, prefix).
pub fn parse_s3_url(url: &str) -> Result<(String, String)> {
    let rest = url.strip_prefix("s3://").ok_or_else(|| {
        Error::Invalid(format!("{url:?} is not an S3 URL: give s3://BUCKET/PREFIX"))
    })?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if let Some(shown) = without_userinfo(url).filter(|_| bucket.contains('@')) {
        return Err(Error::Invalid(format!(
            "{shown} has a user name or password in it: give s3://BUCKET/PREFIX, and the \
             credentials with --credentials FILE or in the environment, never on the command line"
        )));
    }
    if bucket.is_empty() {
        return Err(Error::Invalid(format!(
            "{url:?} names no bucket: give s3://BUCKET/PREFIX"
        )));
    }
    Ok((bucket.to_string(), prefix.trim_end_matches('/').to_string()))
}

/// `url` with everything between its scheme and its last `@` (a user name, a password)
/// replaced by `***`; `None` if it has no `@`.
fn without_userinfo(url: &str) -> Option<String> {
    let at = url.rfind('@')?;
    let start = url
        .find("://")
        .map(|i| i + 3)
        .filter(|&s| s <= at)
        .unwrap_or(0);
    Some(format!("{}***{}", &url[..start], &url[at..]))
}

/// Refuse an S3 endpoint URL that carries credentials (`https://USER:PASSWORD@HOST`): they
/// would sit in the process list, the shell history and `remote.conf`. The error shows the URL
/// without them.
pub fn check_endpoint(endpoint: &str) -> Result<()> {
    match without_userinfo(endpoint) {
        None => Ok(()),
        Some(shown) => Err(Error::Invalid(format!(
            "the S3 endpoint {shown} has a user name or password in it: give the endpoint as \
             http(s)://HOST[:PORT], and the credentials with --credentials FILE (lines \
             AWS_ACCESS_KEY_ID=... and AWS_SECRET_ACCESS_KEY=..., mode 0600) or in the \
             environment, never on the command line"
        ))),
    }
}

/// `KEY=VALUE` lines (`export ` and quotes allowed, `#` comments), as `credentials.env` files
/// are written. The file must be its owner's only ([`crate::secret_file`]).
fn read_credentials(path: &Path) -> Result<HashMap<String, String>> {
    const WHAT: &str = "credentials file";
    let bytes = crate::secret_file::read(path, WHAT)?;
    let text = std::str::from_utf8(&bytes)
        .map_err(|_| Error::Invalid(format!("{WHAT} {} is not UTF-8 text", path.display())))?;
    let mut vars = HashMap::new();
    for line in text.lines() {
        let line = line.trim();
        let line = line.strip_prefix("export ").unwrap_or(line);
        if line.starts_with('#') {
            continue;
        }
        if let Some((k, v)) = line.split_once('=') {
            let v = v.trim().trim_matches('"').trim_matches('\'');
            vars.insert(k.trim().to_string(), v.to_string());
        }
    }
    Ok(vars)
}

fn remote_error(store: &str, e: condense_remote::Error) -> Error {
    Error::io(
        format!("object store {store}"),
        io::Error::other(e.to_string()),
    )
}

fn to_io(e: condense_remote::Error) -> io::Error {
    if e.is_not_found() {
        return io::Error::new(io::ErrorKind::NotFound, e.to_string());
    }
    io::Error::other(StoreUnavailable(e.to_string()))
}

/// The object store did not take or give what was asked (unreachable, timed out, refused):
/// the pool's state is unchanged and the request can be retried once the store answers.
#[derive(Debug)]
pub struct StoreUnavailable(pub String);

impl std::fmt::Display for StoreUnavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StoreUnavailable {}

/// True if `e` is (or wraps) a [`StoreUnavailable`]: a flush that failed so has changed
/// nothing locally and must not poison the pool.
pub fn is_store_unavailable(e: &Error) -> bool {
    match e {
        Error::Io { source, .. } => source.get_ref().is_some_and(|r| r.is::<StoreUnavailable>()),
        _ => false,
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

// ---------------------------------------------------------------------------------------------
// Health and counters shared by the directory, its files, the WAL and the lease.

/// What `stats` shows about the bucket side of a pool.
#[derive(Clone, Debug, Default)]
pub struct RemoteStatus {
    pub url: String,
    /// The pool's durability (stored in its superblock; what this open's flushes do).
    pub durability: Durability,
    /// `ok`, `degraded: ERROR (N s ago)`, `lease lost`, or `read-only`.
    pub health: String,
    pub objects: u64,
    pub bytes: u64,
    pub requests: BackendStats,
    /// Staged segments not yet uploaded, and the local journal (local durability).
    pub pending_bytes: u64,
    /// Seconds since the last checkpoint was uploaded (`None`: none since open).
    pub last_upload_age_seconds: Option<u64>,
    pub conditional_put_honoured: bool,
}

struct Shared {
    store: Arc<dyn ObjectBackend>,
    url: String,
    read_only: bool,
    /// The pool's durability is `remote`: journal and segment files opened from now on log
    /// their syncs as write-ahead objects ([`WalDir`]). Changed only with the stored value
    /// ([`crate::pool::Pool::set_durability`]).
    remote_durability: AtomicBool,
    lease_lost: AtomicBool,
    /// The last failed request, and when; cleared by the next success.
    last_error: Mutex<Option<(Instant, String)>>,
    last_upload: Mutex<Option<Instant>>,
    blocks: Mutex<ReadBlocks>,
}

impl Shared {
    fn durability(&self) -> Durability {
        if self.remote_durability.load(Ordering::Relaxed) {
            Durability::Remote
        } else {
            Durability::Local
        }
    }

    fn note<T>(&self, r: condense_remote::Result<T>) -> io::Result<T> {
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

    fn may_write(&self, what: &str) -> io::Result<()> {
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

    fn put(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        self.may_write(&format!("uploading {name}"))?;
        self.blocks_forget(name);
        self.note(self.store.put(name, bytes))
    }

    fn delete(&self, name: &str) -> io::Result<()> {
        self.may_write(&format!("deleting {name}"))?;
        self.blocks_forget(name);
        self.note(self.store.delete(name))
    }

    fn blocks_forget(&self, name: &str) {
        self.blocks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .forget(name);
    }

    /// `len` bytes at `offset` of object `name` (of `size` bytes), through the block LRU.
    fn read(&self, name: &str, size: u64, buf: &mut [u8], offset: u64) -> io::Result<()> {
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
            let (cached, sequential) = {
                let mut blocks = self.blocks.lock().unwrap_or_else(|e| e.into_inner());
                let sequential = blocks.follows(name, b);
                (blocks.get(name, b), sequential)
            };
            let block = match cached {
                Some(x) => x,
                None => {
                    let want = if sequential { READ_AHEAD_BLOCKS } else { 1 };
                    let len = (want * READ_BLOCK_BYTES).min(size - start);
                    let got = self.note(self.store.get_range(name, start, len))?;
                    let mut blocks = self.blocks.lock().unwrap_or_else(|e| e.into_inner());
                    let mut first = None;
                    for (i, piece) in got.chunks(READ_BLOCK_BYTES as usize).enumerate() {
                        let piece = Arc::new(piece.to_vec());
                        first.get_or_insert_with(|| piece.clone());
                        blocks.put(name, b + i as u64, piece);
                    }
                    first.ok_or_else(|| {
                        io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            format!("empty range of {name} in {}", self.url),
                        )
                    })?
                }
            };
            let from = (pos - start) as usize;
            let n = (block.len() - from).min(buf.len() - at);
            buf[at..at + n].copy_from_slice(&block[from..from + n]);
            at += n;
        }
        Ok(())
    }
}

/// The most recently used blocks of objects read.
#[derive(Default)]
struct ReadBlocks {
    map: HashMap<(String, u64), Arc<Vec<u8>>>,
    order: VecDeque<(String, u64)>,
    /// The block read last.
    last: Option<(String, u64)>,
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
    }
}

/// `f` on every item, [`PARALLEL_REQUESTS`] at a time (one request each); the results in
/// the items' order.
fn in_parallel<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let mut out = Vec::with_capacity(items.len());
    for batch in items.chunks(PARALLEL_REQUESTS) {
        std::thread::scope(|s| {
            let handles: Vec<_> = batch.iter().map(|item| s.spawn(|| f(item))).collect();
            for h in handles {
                match h.join() {
                    Ok(r) => out.push(r),
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
        });
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The bucket as the pool directory.

/// The pool directory of an S3 pool (see the module docs for the mapping).
pub struct RemoteDir {
    shared: Arc<Shared>,
    /// `LOCAL/pool/`: the `meta.dat` mirror, `meta.synced`, `cache.conf`.
    local: RealDir,
    meta: Mutex<Option<Arc<MetaFile>>>,
    opened: Instant,
    /// Sizes of the objects the last `list` returned, taken by the next `open` of each (an
    /// open lists the segments, then opens each one: no HEAD per segment). Forgotten when
    /// this directory writes or removes the name.
    listed: Mutex<HashMap<String, u64>>,
    /// Files being written whole (`.tmp`, `.partial`, new files), by name, for `rename`.
    writing: Mutex<HashMap<String, Weak<BufFile>>>,
    _lease: Option<Lease>,
}

/// Names kept in the local subdirectory, never uploaded.
fn is_local_name(name: &str) -> bool {
    name == crate::cache::CACHE_CONF_NAME
        || name == "cache.conf.tmp"
        || name == crate::format::LOCK_NAME
}

impl RemoteDir {
    /// The bucket side of the pool whose local directory is `path`.
    fn new(shared: Arc<Shared>, path: &Path, lease: Option<Lease>) -> RemoteDir {
        RemoteDir {
            shared,
            local: RealDir::new(&path.join(LOCAL_SUBDIR)),
            meta: Mutex::new(None),
            opened: Instant::now(),
            writing: Mutex::new(HashMap::new()),
            listed: Mutex::new(HashMap::new()),
            _lease: lease,
        }
    }

    fn describe_url(&self) -> &str {
        &self.shared.url
    }

    /// The meta.dat mirror is current if it matches the root in the bucket; otherwise fetch
    /// every extent.
    fn sync_meta_mirror(&self) -> Result<()> {
        // The primary root, or its copy where the primary is missing (a damaged primary only
        // fails to match the mirror's tag: the mirror is fetched again).
        let mut found = None;
        for name in [
            CHECKPOINT_NAME.to_string(),
            crate::copies::copy_name(CHECKPOINT_NAME),
        ] {
            match self.shared.store.get(&name) {
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
        let local_tag =
            std::fs::read_to_string(self.local.path().join(META_SYNCED_NAME)).unwrap_or_default();
        let mirror = self.local.path().join(META_NAME);
        if local_tag.trim() == tag && mirror.exists() {
            return Ok(());
        }
        let extents = self
            .shared
            .store
            .list("meta")
            .map_err(|e| remote_error(&self.shared.url, e))?;
        tracing::info!(
            "fetching the metadata of {} ({} extents)",
            self.shared.url,
            extents.len()
        );
        let file = self
            .local
            .open(META_NAME, true)
            .and_then(|f| f.set_len(0).map(|_| f))
            .map_err(|e| Error::io(format!("creating {}", mirror.display()), e))?;
        let mut jobs = Vec::new();
        for (name, _) in &extents {
            let Some(n) = name
                .strip_prefix("meta/")
                .and_then(|h| u64::from_str_radix(h, 16).ok())
            else {
                continue;
            };
            jobs.push((name.clone(), n));
        }
        let fetched = in_parallel(&jobs, |(name, n)| {
            self.shared
                .note(self.shared.store.get(name))
                .and_then(|bytes| file.write_at(&bytes, n * META_EXTENT_BYTES))
                .map_err(|e| Error::io(format!("fetching {name}"), e))
        });
        fetched.into_iter().collect::<Result<Vec<()>>>()?;
        file.sync()
            .map_err(|e| Error::io(format!("syncing {}", mirror.display()), e))?;
        self.write_meta_synced(&root)
    }

    fn write_meta_synced(&self, root: &[u8]) -> Result<()> {
        let tag = blake3::hash(root).to_hex().to_string();
        crate::io::write_file_atomically(&self.local, META_SYNCED_NAME, tag.as_bytes())
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
    fn set_durability(&self, d: Durability) {
        self.shared
            .remote_durability
            .store(d == Durability::Remote, Ordering::Relaxed);
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
            .note(self.shared.store.head(crate::format::SUPERBLOCK_NAME))
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

    /// The bucket side of the pool for `stats` (one LIST).
    pub fn status(&self) -> RemoteStatus {
        let (objects, bytes) = match self.shared.store.list("") {
            Ok(l) => (l.len() as u64, l.iter().map(|(_, s)| s).sum()),
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
        RemoteStatus {
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

impl Dir for RemoteDir {
    fn open(&self, name: &str, create: bool) -> io::Result<Arc<dyn File>> {
        if is_local_name(name) {
            return self.local.open(name, create);
        }
        if name == META_NAME {
            return Ok(self.meta_file(create)? as Arc<dyn File>);
        }
        let listed = self
            .listed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
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
        let size = match listed {
            Some(len) => Some(len),
            None => self.shared.note(self.shared.store.head(name))?,
        };
        match size {
            Some(len) => Ok(Arc::new(ObjFile {
                shared: self.shared.clone(),
                name: name.to_string(),
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
        Ok(self.shared.note(self.shared.store.head(name))?.is_some())
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        if is_local_name(name) {
            return self.local.remove(name);
        }
        self.writing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        self.listed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        self.shared.delete(name)
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
        self.listed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(to);
        let bytes = file.store_as(to)?;
        if to == CHECKPOINT_NAME {
            self.uploaded();
            self.write_meta_synced(&bytes)
                .map_err(|e| io::Error::other(e.to_string()))?;
        }
        Ok(())
    }

    fn list(&self, prefix: &str) -> io::Result<Vec<String>> {
        let all = self.shared.note(self.shared.store.list(""))?;
        let found: Vec<(String, u64)> = all
            .into_iter()
            .filter(|(n, _)| !n.contains('/') && n.starts_with(prefix) && n != LEASE_NAME)
            .collect();
        self.listed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(found.iter().cloned());
        Ok(found.into_iter().map(|(n, _)| n).collect())
    }

    fn sync_dir(&self) -> io::Result<()> {
        // Every PUT is durable when acknowledged.
        Ok(())
    }

    fn total_bytes(&self) -> io::Result<u64> {
        let all = self.shared.note(self.shared.store.list(""))?;
        Ok(all.iter().map(|(_, s)| s).sum())
    }

    fn available_bytes(&self) -> io::Result<u64> {
        Ok(u64::MAX / 4)
    }

    fn describe(&self) -> String {
        self.shared.url.clone()
    }

    fn remote(&self) -> Option<&RemoteDir> {
        Some(self)
    }
}

/// An object read in place (a destaged segment, the superblock, a checkpoint root).
struct ObjFile {
    shared: Arc<Shared>,
    name: String,
    len: u64,
}

fn read_only_object(name: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        format!("object {name} is immutable"),
    )
}

impl File for ObjFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.shared.read(&self.name, self.len, buf, offset)
    }
    fn write_at(&self, _: &[u8], _: u64) -> io::Result<()> {
        Err(read_only_object(&self.name))
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.len)
    }
    fn set_len(&self, _: u64) -> io::Result<()> {
        Err(read_only_object(&self.name))
    }
    fn sync(&self) -> io::Result<()> {
        Ok(())
    }
}

enum BufState {
    Writing(Vec<u8>),
    /// Uploaded under this name, with this length; read in place from now on.
    Stored(String, u64),
}

/// A file written whole in memory and uploaded by `sync` (its own name) or by `rename`.
struct BufFile {
    shared: Arc<Shared>,
    name: String,
    state: Mutex<BufState>,
}

impl BufFile {
    /// Upload the buffer as `to`; the file reads that object from now on. Returns the bytes.
    fn store_as(&self, to: &str) -> io::Result<Vec<u8>> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let bytes = match &mut *st {
            BufState::Writing(b) => std::mem::take(b),
            BufState::Stored(n, _) => {
                return Err(io::Error::other(format!(
                    "{} was already uploaded as {n}",
                    self.name
                )))
            }
        };
        if let Err(e) = self.shared.put(to, &bytes) {
            *st = BufState::Writing(bytes);
            return Err(e);
        }
        *st = BufState::Stored(to.to_string(), bytes.len() as u64);
        Ok(bytes)
    }

    fn is_temporary(&self) -> bool {
        self.name.ends_with(".tmp") || self.name.ends_with(crate::destage::PARTIAL_SUFFIX)
    }
}

impl File for BufFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match &*st {
            BufState::Writing(b) => {
                let end = offset as usize + buf.len();
                if end > b.len() {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("read past the end of {}", self.name),
                    ));
                }
                buf.copy_from_slice(&b[offset as usize..end]);
                Ok(())
            }
            BufState::Stored(n, len) => {
                let (n, len) = (n.clone(), *len);
                drop(st);
                self.shared.read(&n, len, buf, offset)
            }
        }
    }
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let BufState::Writing(b) = &mut *st else {
            return Err(read_only_object(&self.name));
        };
        let end = offset as usize + data.len();
        if b.len() < end {
            b.resize(end, 0);
        }
        b[offset as usize..end].copy_from_slice(data);
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        Ok(
            match &*self.state.lock().unwrap_or_else(|e| e.into_inner()) {
                BufState::Writing(b) => b.len() as u64,
                BufState::Stored(_, len) => *len,
            },
        )
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let BufState::Writing(b) = &mut *st else {
            return Err(read_only_object(&self.name));
        };
        b.resize(len as usize, 0);
        Ok(())
    }
    fn sync(&self) -> io::Result<()> {
        if self.is_temporary() {
            // Made durable by the rename that follows (a PUT).
            return Ok(());
        }
        let bytes = match &*self.state.lock().unwrap_or_else(|e| e.into_inner()) {
            BufState::Writing(b) => b.clone(),
            BufState::Stored(..) => return Ok(()),
        };
        self.shared.put(&self.name, &bytes)
    }
}

/// `meta.dat`: a local mirror; a sync uploads the extents written since the last sync.
struct MetaFile {
    local: Arc<dyn File>,
    dirty: Mutex<BTreeSet<u64>>,
    shared: Arc<Shared>,
}

impl File for MetaFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.local.read_at(buf, offset)
    }
    /// The bucket's extent objects hold every page the bucket's root names, whatever the
    /// mirror's disk did to them; a page written since the last upload is only in the mirror
    /// (the bucket's older bytes then fail the caller's check too, as they should).
    fn read_other_copy(&self, buf: &mut [u8], offset: u64) -> io::Result<bool> {
        let end = offset + buf.len() as u64;
        let mut at = offset;
        while at < end {
            let e = at / META_EXTENT_BYTES;
            let ext_start = e * META_EXTENT_BYTES;
            let ext_end = (ext_start + META_EXTENT_BYTES).min(end);
            let obj = self
                .shared
                .note(self.shared.store.get(&format!("meta/{e:08x}")))?;
            let (from, to) = ((at - ext_start) as usize, (ext_end - ext_start) as usize);
            let got = obj.get(from..to).ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("meta/{e:08x} is shorter than {to} bytes"),
                )
            })?;
            let dst = (at - offset) as usize;
            buf[dst..dst + got.len()].copy_from_slice(got);
            at = ext_end;
        }
        // Mend the mirror (the bucket has these bytes already: nothing to upload).
        if let Err(e) = self.local.write_at(buf, offset) {
            tracing::warn!("could not mend meta.dat at {offset}: {e}");
        }
        Ok(true)
    }
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.shared.may_write("writing meta.dat")?;
        self.local.write_at(data, offset)?;
        let mut d = self.dirty.lock().unwrap_or_else(|e| e.into_inner());
        let last = (offset + data.len().max(1) as u64 - 1) / META_EXTENT_BYTES;
        d.extend(offset / META_EXTENT_BYTES..=last);
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        self.local.len()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.local.set_len(len)
    }
    fn sync(&self) -> io::Result<()> {
        self.local.sync()?;
        let extents: Vec<u64> = self
            .dirty
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .copied()
            .collect();
        if extents.is_empty() {
            return Ok(());
        }
        let file_len = self.local.len()?;
        let uploaded = in_parallel(&extents, |&e| {
            let start = e * META_EXTENT_BYTES;
            let len = META_EXTENT_BYTES.min(file_len.saturating_sub(start));
            let mut buf = vec![0u8; len as usize];
            self.local
                .read_at(&mut buf, start)
                .and_then(|_| self.shared.put(&format!("meta/{e:08x}"), &buf))
        });
        // An extent stays dirty until its upload succeeded.
        let mut d = self.dirty.lock().unwrap_or_else(|e| e.into_inner());
        let mut failed = None;
        for (e, r) in extents.iter().zip(uploaded) {
            match r {
                Ok(()) => {
                    d.remove(e);
                }
                Err(err) => failed = Some(err),
            }
        }
        failed.map_or(Ok(()), Err)
    }
}

// ---------------------------------------------------------------------------------------------
// Write-ahead objects (`--durability remote`).

/// The local directory of a `remote`-durability pool: a real directory whose journal and
/// segment files also upload, at each sync, what was written to them since the last one.
///
/// Whether a file logs its syncs is decided when it is opened, by the pool's durability then
/// (a change of durability is followed by a checkpoint, which replaces the journal and seals
/// the open segment). With `local` durability the directory still rebuilds files from
/// write-ahead objects another open left, and deletes them with their files.
pub struct WalDir {
    local: Arc<RealDir>,
    log: Arc<WalLog>,
}

/// The write-ahead objects written so far, shared by a [`WalDir`] and its files.
struct WalLog {
    shared: Arc<Shared>,
    next_seq: AtomicU64,
    /// The write-ahead objects of each file, so that removing the file deletes them.
    by_file: Mutex<HashMap<String, Vec<String>>>,
    /// Files synced locally whose bytes a failed upload left unlogged: every later sync of
    /// any file logs them first (a flush that failed so is retried by the next flush, which
    /// may not sync those segment files again), in order, before its own bytes.
    unlogged: Mutex<Vec<Arc<WalFile>>>,
}

fn is_logged(name: &str) -> bool {
    name.starts_with(crate::format::SEGMENT_PREFIX)
        || name.starts_with(crate::format::JOURNAL_PREFIX)
}

impl WalLog {
    /// Log what earlier failed syncs left unlogged.
    fn retry_unlogged(&self) -> io::Result<()> {
        let files = std::mem::take(&mut *self.unlogged.lock().unwrap_or_else(|e| e.into_inner()));
        for (i, f) in files.iter().enumerate() {
            if let Err(e) = f.log_dirty() {
                self.unlogged
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend(files[i..].iter().cloned());
                return Err(e);
            }
        }
        Ok(())
    }

    fn append(&self, name: &str, offset: u64, data: &[u8]) -> io::Result<()> {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let obj = format!("{WAL_PREFIX}/{seq:016x}");
        self.shared.put(&obj, &encode_wal(name, offset, data))?;
        self.by_file
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(name.to_string())
            .or_default()
            .push(obj);
        Ok(())
    }
}

impl WalDir {
    /// Rebuild the journal and staged segment files missing from the local directory from
    /// the bucket's write-ahead objects (a new host, a lost local disk). Returns how many
    /// files were rebuilt.
    fn recover(&self) -> Result<usize> {
        let url = &self.log.shared.url;
        let store = &self.log.shared.store;
        let objects = store.list(WAL_PREFIX).map_err(|e| remote_error(url, e))?;
        let present: BTreeSet<String> = self
            .local
            .list("")
            .map_err(|e| Error::io("listing the local directory", e))?
            .into_iter()
            .collect();
        let mut rebuilt: HashMap<String, Arc<dyn File>> = HashMap::new();
        let mut next = 0;
        for (obj, _) in &objects {
            let Some(seq) = obj
                .strip_prefix("wal/")
                .and_then(|s| u64::from_str_radix(s, 16).ok())
            else {
                continue;
            };
            next = next.max(seq + 1);
            let bytes = store.get(obj).map_err(|e| remote_error(url, e))?;
            let (name, offset, data) = decode_wal(&bytes)
                .ok_or_else(|| Error::corrupt(format!("{url} {obj}"), "bad write-ahead object"))?;
            self.log
                .by_file
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(name.clone())
                .or_default()
                .push(obj.clone());
            if present.contains(&name) {
                continue;
            }
            let file = match rebuilt.get(&name) {
                Some(f) => f.clone(),
                None => {
                    let f = self
                        .local
                        .open(&name, true)
                        .and_then(|f| f.set_len(0).map(|_| f))
                        .map_err(|e| Error::io(format!("rebuilding {name}"), e))?;
                    rebuilt.insert(name.clone(), f.clone());
                    f
                }
            };
            file.write_at(data, offset)
                .map_err(|e| Error::io(format!("rebuilding {name}"), e))?;
        }
        for (name, f) in &rebuilt {
            f.sync()
                .map_err(|e| Error::io(format!("syncing rebuilt {name}"), e))?;
        }
        self.local
            .sync_dir()
            .map_err(|e| Error::io("syncing the local directory", e))?;
        self.log.next_seq.store(next, Ordering::Relaxed);
        if !rebuilt.is_empty() {
            let mut names: Vec<_> = rebuilt.keys().cloned().collect();
            names.sort();
            tracing::warn!(
                "rebuilt {} files of the local directory from {url}'s write-ahead objects: {}",
                names.len(),
                names.join(", ")
            );
        }
        Ok(rebuilt.len())
    }
}

pub(crate) fn encode_wal(name: &str, offset: u64, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(32 + name.len() + data.len());
    v.extend_from_slice(&WAL_MAGIC);
    v.extend_from_slice(&(name.len() as u16).to_le_bytes());
    v.extend_from_slice(name.as_bytes());
    v.extend_from_slice(&offset.to_le_bytes());
    v.extend_from_slice(&(data.len() as u64).to_le_bytes());
    v.extend_from_slice(&crc32c::crc32c(data).to_le_bytes());
    v.extend_from_slice(data);
    v
}

pub(crate) fn decode_wal(b: &[u8]) -> Option<(String, u64, &[u8])> {
    if b.get(..8)? != WAL_MAGIC {
        return None;
    }
    let nlen = u16::from_le_bytes(b.get(8..10)?.try_into().ok()?) as usize;
    let name = std::str::from_utf8(b.get(10..10 + nlen)?).ok()?.to_string();
    let at = 10 + nlen;
    let offset = u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?);
    let len = usize::try_from(u64::from_le_bytes(b.get(at + 8..at + 16)?.try_into().ok()?)).ok()?;
    let crc = u32::from_le_bytes(b.get(at + 16..at + 20)?.try_into().ok()?);
    let data = b.get(at + 20..at.checked_add(20)?.checked_add(len)?)?;
    let safe = !name.is_empty() && !name.contains('/') && !name.starts_with('.');
    (crc32c::crc32c(data) == crc && safe && is_logged(&name)).then_some((name, offset, data))
}

impl Dir for WalDir {
    fn open(&self, name: &str, create: bool) -> io::Result<Arc<dyn File>> {
        let file = self.local.open(name, create)?;
        // A read-only open never writes the bucket: a file it restores locally (an empty
        // journal) is not logged.
        let logs = self.log.shared.durability() == Durability::Remote && !self.log.shared.read_only;
        if !logs || !is_logged(name) {
            return Ok(file);
        }
        Ok(Arc::new_cyclic(|me| WalFile {
            file,
            name: name.to_string(),
            dirty: Mutex::new(None),
            log: self.log.clone(),
            me: me.clone(),
        }))
    }
    fn exists(&self, name: &str) -> io::Result<bool> {
        self.local.exists(name)
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        self.local.remove(name)?;
        let objs = self
            .log
            .by_file
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name)
            .unwrap_or_default();
        for o in objs {
            // Best effort: a write-ahead object left behind rebuilds a file the next open
            // removes again (an old journal generation, a segment already uploaded).
            if let Err(e) = self.log.shared.delete(&o) {
                tracing::warn!("deleting {o}: {e}");
            }
        }
        Ok(())
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        self.local.rename(from, to)
    }
    fn list(&self, prefix: &str) -> io::Result<Vec<String>> {
        self.local.list(prefix)
    }
    fn sync_dir(&self) -> io::Result<()> {
        self.local.sync_dir()
    }
    fn total_bytes(&self) -> io::Result<u64> {
        self.local.total_bytes()
    }
    fn available_bytes(&self) -> io::Result<u64> {
        self.local.available_bytes()
    }
    fn describe(&self) -> String {
        self.local.describe()
    }
}

/// A journal or segment file of a [`WalDir`].
struct WalFile {
    file: Arc<dyn File>,
    name: String,
    /// Bytes written since the last sync: [start, end).
    dirty: Mutex<Option<(u64, u64)>>,
    log: Arc<WalLog>,
    me: Weak<WalFile>,
}

impl WalFile {
    /// Upload the bytes written since the last logged sync as one write-ahead object.
    fn log_dirty(&self) -> io::Result<()> {
        let range = *self.dirty.lock().unwrap_or_else(|e| e.into_inner());
        let Some((start, end)) = range else {
            return Ok(());
        };
        let end = end.min(self.file.len()?);
        if end > start {
            let mut buf = vec![0u8; (end - start) as usize];
            self.file.read_at(&mut buf, start)?;
            self.log.append(&self.name, start, &buf)?;
        }
        // Writes that raced with this sync extended the range; they are logged by the next.
        let mut d = self.dirty.lock().unwrap_or_else(|e| e.into_inner());
        if *d == range {
            *d = None;
        } else if let Some((s, e)) = *d {
            *d = Some((s.max(end).min(e), e));
        }
        Ok(())
    }
}

impl File for WalFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_at(buf, offset)
    }
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_at(data, offset)?;
        let end = offset + data.len() as u64;
        let mut d = self.dirty.lock().unwrap_or_else(|e| e.into_inner());
        *d = Some(match *d {
            Some((s, e)) => (s.min(offset), e.max(end)),
            None => (offset, end),
        });
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        self.file.len()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }
    fn sync(&self) -> io::Result<()> {
        self.file.sync()?;
        let logged = self.log.retry_unlogged().and_then(|_| self.log_dirty());
        if logged.is_err() {
            if let Some(me) = self.me.upgrade() {
                let mut u = self.log.unlogged.lock().unwrap_or_else(|e| e.into_inner());
                if !u.iter().any(|f| Arc::ptr_eq(f, &me)) {
                    u.push(me);
                }
            }
        }
        logged
    }
}

// ---------------------------------------------------------------------------------------------
// The lease.

/// One writer per pool: the `lease` object names the host and process that writes the pool
/// and until when; the holder renews it every 10 s and deletes it at a clean close.
///
/// On a store that honours conditional PUT the first writer of an absent lease wins
/// exactly. Garage 2.5.0 does not (tests/s3/README.md): there the taker writes the lease,
/// waits [`LEASE_SETTLE`], reads it back and holds it only if its nonce is there. That
/// refuses every writer that comes after the lease is visible; two opens within one round
/// trip could both win, and the renewal then finds a foreign nonce: that host stops
/// writing (`health: lease lost`). A lease whose process is gone from this host (kill -9,
/// a crash) is taken over at once; one of another host after it expires (30 s).
pub struct Lease {
    shared: Arc<Shared>,
    nonce: String,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

pub(crate) struct LeaseBody {
    host: String,
    pid: u32,
    nonce: String,
    expires: u64,
    renewed: u64,
}

impl LeaseBody {
    pub(crate) fn encode(&self) -> Vec<u8> {
        format!(
            "{LEASE_FIRST_LINE}\nhost={}\npid={}\nnonce={}\nexpires_unix={}\nrenewed_unix={}\n",
            self.host, self.pid, self.nonce, self.expires, self.renewed
        )
        .into_bytes()
    }

    pub(crate) fn decode(b: &[u8]) -> Option<LeaseBody> {
        let text = std::str::from_utf8(b).ok()?;
        let mut lines = text.lines();
        if lines.next()? != LEASE_FIRST_LINE {
            return None;
        }
        let mut l = LeaseBody {
            host: String::new(),
            pid: 0,
            nonce: String::new(),
            expires: 0,
            renewed: 0,
        };
        for line in lines {
            match line.split_once('=') {
                Some(("host", v)) => l.host = v.to_string(),
                Some(("pid", v)) => l.pid = v.parse().ok()?,
                Some(("nonce", v)) => l.nonce = v.to_string(),
                Some(("expires_unix", v)) => l.expires = v.parse().ok()?,
                Some(("renewed_unix", v)) => l.renewed = v.parse().ok()?,
                _ => {}
            }
        }
        Some(l)
    }

    pub(crate) fn fresh(nonce: &str) -> LeaseBody {
        let now = unix_now();
        LeaseBody {
            host: hostname(),
            pid: std::process::id(),
            nonce: nonce.to_string(),
            expires: now + LEASE_SECONDS,
            renewed: now,
        }
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown-host".into())
}

fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: kill with signal 0 only checks that the process exists; no memory involved.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// A holder on this host killed a moment ago (kill -9, then a restart) may take a few
/// seconds to exit; wait for it that long.
fn pid_alive_after_grace(pid: u32) -> bool {
    if pid == std::process::id() {
        return true;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while pid_alive(pid) {
        if Instant::now() > deadline {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

fn held_error(url: &str, l: &LeaseBody) -> Error {
    let now = unix_now();
    Error::Busy(format!(
        "pool {url} is held by {} (pid {}), lease renewed {} s ago, expires in {} s: stop it \
         there, or connect this host with `condense connect --read-only`; if {} is gone, the \
         lease expires in {} s and this host can then take the pool",
        l.host,
        l.pid,
        now.saturating_sub(l.renewed),
        l.expires.saturating_sub(now),
        l.host,
        l.expires.saturating_sub(now),
    ))
}

impl Lease {
    fn acquire(shared: &Arc<Shared>) -> Result<Lease> {
        let url = &shared.url;
        let store = &shared.store;
        let current = match store.get(LEASE_NAME) {
            Ok(b) => LeaseBody::decode(&b),
            Err(e) if e.is_not_found() => None,
            Err(e) => return Err(remote_error(url, e)),
        };
        if let Some(l) = &current {
            let mine_and_dead = l.host == hostname() && !pid_alive_after_grace(l.pid);
            if l.expires > unix_now() && !mine_and_dead {
                return Err(held_error(url, l));
            }
            tracing::warn!(
                "taking over the lease of {url} from {} (pid {}): {}",
                l.host,
                l.pid,
                if mine_and_dead {
                    "that process is gone"
                } else {
                    "it expired"
                }
            );
        }
        let nonce = blake3::hash(
            format!(
                "{}{}{:?}",
                hostname(),
                std::process::id(),
                SystemTime::now()
            )
            .as_bytes(),
        )
        .to_hex()[..32]
            .to_string();
        let body = LeaseBody::fresh(&nonce).encode();
        if current.is_none() && store.conditional_put_honoured() {
            if !store
                .put_if_absent(LEASE_NAME, &body)
                .map_err(|e| remote_error(url, e))?
            {
                return Err(Lease::held_now(shared));
            }
        } else {
            store
                .put(LEASE_NAME, &body)
                .map_err(|e| remote_error(url, e))?;
            std::thread::sleep(LEASE_SETTLE);
            let back = store.get(LEASE_NAME).map_err(|e| remote_error(url, e))?;
            match LeaseBody::decode(&back) {
                Some(l) if l.nonce == nonce => {}
                Some(l) => return Err(held_error(url, &l)),
                None => return Err(Error::corrupt(format!("{url} lease"), "unreadable")),
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (stop, shared, nonce) = (stop.clone(), shared.clone(), nonce.clone());
            std::thread::Builder::new()
                .name("condense-lease".into())
                .spawn(move || Lease::renew_loop(&shared, &nonce, &stop))
                .map_err(|e| Error::io("starting the lease thread", e))?
        };
        Ok(Lease {
            shared: shared.clone(),
            nonce,
            stop,
            thread: Some(thread),
        })
    }

    fn held_now(shared: &Shared) -> Error {
        match shared
            .store
            .get(LEASE_NAME)
            .ok()
            .and_then(|b| LeaseBody::decode(&b))
        {
            Some(l) => held_error(&shared.url, &l),
            None => Error::Busy(format!("pool {} is held by another host", shared.url)),
        }
    }

    fn renew_loop(shared: &Shared, nonce: &str, stop: &AtomicBool) {
        loop {
            std::thread::park_timeout(LEASE_RENEW);
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let current = shared.note(shared.store.get(LEASE_NAME));
            match current.map(|b| LeaseBody::decode(&b)) {
                Ok(Some(l)) if l.nonce != nonce => {
                    shared.lease_lost.store(true, Ordering::Relaxed);
                    tracing::error!(
                        "the lease of {} was taken by {} (pid {}): this host stops writing the pool",
                        shared.url,
                        l.host,
                        l.pid
                    );
                    return;
                }
                Err(e) if e.kind() != io::ErrorKind::NotFound => continue,
                _ => {}
            }
            let _ = shared.note(
                shared
                    .store
                    .put(LEASE_NAME, &LeaseBody::fresh(nonce).encode()),
            );
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
        if self.shared.lease_lost.load(Ordering::Relaxed) {
            return;
        }
        let ours = self
            .shared
            .store
            .get(LEASE_NAME)
            .ok()
            .and_then(|b| LeaseBody::decode(&b))
            .is_some_and(|l| l.nonce == self.nonce);
        if ours {
            if let Err(e) = self.shared.store.delete(LEASE_NAME) {
                tracing::warn!("releasing the lease of {}: {e}", self.shared.url);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The local directory: init, connect, open.

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
        crate::cache::CACHE_CONF_NAME,
        cache.encode().as_bytes(),
    )?;
    crate::io::write_file_atomically(
        &RealDir::new(&abs),
        REMOTE_CONF_NAME,
        conf.encode().as_bytes(),
    )
}

fn shared_for(
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
        last_error: Mutex::new(None),
        last_upload: Mutex::new(None),
        blocks: Mutex::new(ReadBlocks::default()),
    })
}

fn has_pool(conf: &RemoteConf, store: &dyn ObjectBackend) -> Result<bool> {
    for name in superblock_names() {
        if store
            .head(&name)
            .map_err(|e| remote_error(&conf.url, e))?
            .is_some()
        {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The two copies of the superblock (crate::copies), primary first.
fn superblock_names() -> [String; 2] {
    let primary = crate::format::SUPERBLOCK_NAME;
    [primary.to_string(), crate::copies::copy_name(primary)]
}

/// The pool's superblock in the bucket (`None`: no pool there): its primary copy, or its
/// copy where the primary is missing or damaged (the pool's open says which it used).
fn read_superblock(conf: &RemoteConf, store: &dyn ObjectBackend) -> Result<Option<Superblock>> {
    let mut first_error = None;
    for name in superblock_names() {
        match store.get(&name) {
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

/// `condense init s3://...`: a new pool in the bucket, with `durability` stored in it, and
/// its local directory `path`.
pub fn init(
    path: &Path,
    conf: &RemoteConf,
    durability: Durability,
    cache_size: u64,
    opts: &crate::pool::InitOptions,
) -> Result<()> {
    let store = conf.backend(true)?;
    if has_pool(conf, &*store)? {
        return Err(Error::Invalid(format!(
            "{} already holds a Condense pool: to use it on this host, run `condense connect {} \
             --cache DIR --cache-size SIZE`",
            conf.url, conf.url
        )));
    }
    let conf = RemoteConf {
        durability_to_store: None,
        ..conf.clone()
    };
    prepare_local(path, &conf, cache_size)?;
    let shared = shared_for(&conf, store, false, durability);
    // Pool::init stores the directory's durability in the superblock.
    crate::pool::Pool::init(&RemoteDir::new(shared, path, None), opts)
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
    let store = conf.backend(false)?;
    let Some(sb) = read_superblock(conf, &*store)? else {
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

/// What [`crate::pool::Pool`] needs to open an S3 pool from its local directory.
pub(crate) struct Opened {
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
pub(crate) struct AfterOpen {
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
    pub fn finish(self, pool: &crate::pool::Pool) -> Result<()> {
        if pool.sb.durability != self.read {
            return Err(Error::corrupt(
                format!("superblock of {}", self.conf.url),
                "it changed while this host opened the pool (another host wrote it): open the pool again",
            ));
        }
        let Some(d) = self.store else {
            return Ok(());
        };
        pool.store_durability(d)?;
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
pub(crate) fn open_local(path: &Path, read_only: bool) -> Result<Opened> {
    let conf = RemoteConf::decode(&std::fs::read(path.join(REMOTE_CONF_NAME)).map_err(|e| {
        Error::io(
            format!("reading {}", path.join(REMOTE_CONF_NAME).display()),
            e,
        )
    })?)?;
    let read_only = read_only || conf.read_only;
    let store = conf.backend(!read_only)?;
    let sb = read_superblock(&conf, &*store)?
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
    let shared = shared_for(&conf, store, read_only, durability);
    let lease = if read_only {
        None
    } else {
        Some(Lease::acquire(&shared)?)
    };
    let local = Arc::new(RealDir::new(path));
    // A writer's local directory (even opened read-only, e.g. by `export`) is rebuilt from
    // the write-ahead objects in the bucket, whatever the pool's durability (it may have
    // been `remote` before a change); a reader host's never is (they are the writer's).
    let cache_dir: Arc<dyn Dir> = if conf.read_only {
        local
    } else {
        let wal = WalDir {
            local: local.clone(),
            log: Arc::new(WalLog {
                shared: shared.clone(),
                next_seq: AtomicU64::new(0),
                by_file: Mutex::new(HashMap::new()),
                unlogged: Mutex::new(Vec::new()),
            }),
        };
        wal.recover()?;
        Arc::new(wal)
    };
    let dir = RemoteDir::new(shared, path, lease);
    dir.sync_meta_mirror()?;
    Ok(Opened {
        dir: Arc::new(dir),
        cache_dir,
        read_only,
        after,
    })
}

// ---------------------------------------------------------------------------------------------
// The pool's durability.

impl crate::pool::Pool {
    /// The durability of a pool in an object store (`None`: a local pool, whose flush
    /// always syncs its own disk).
    pub fn durability(&self) -> Option<Durability> {
        self.dir.remote().map(RemoteDir::durability)
    }

    /// `condense durability set`: store `d` as the pool's durability (every host that
    /// connects uses it) and apply it to this open at once. Returns the previous one.
    ///
    /// Under the sync lock, so no flush runs meanwhile: the superblock is replaced, then a
    /// checkpoint uploads everything written so far and starts a new journal and segment,
    /// which log their syncs (or not) by the new durability. Local → remote is therefore
    /// complete when this returns: what came before is in the bucket's root, what comes after
    /// is in write-ahead objects.
    pub fn set_durability(&self, d: Durability) -> Result<Durability> {
        let r = self.dir.remote().ok_or_else(|| {
            Error::Invalid(format!(
                "pool {} is not in an object store: a flush of a local pool always returns once \
                 its own disk has it (durability is a setting of pools in an object store)",
                self.dir.describe()
            ))
        })?;
        if self.read_only {
            return Err(Error::ReadOnly);
        }
        let guard = crate::locks::lock(&self.sync_lock);
        let was = r.durability();
        if was == d {
            return Ok(was);
        }
        self.writable(&crate::locks::lock(&self.state))?;
        // Before anything changes: a store that does not answer leaves the pool as it was.
        r.check_reachable()?;
        self.store_durability(d)?;
        r.set_durability(d);
        self.checkpoint_locked(&guard).inspect_err(|e| {
            tracing::warn!(
                "pool {} stores durability {} now, but the checkpoint that applies it failed \
                 ({e}): it applies fully at the next checkpoint or open",
                r.describe(),
                d.as_str()
            )
        })?;
        tracing::info!(
            "pool {}: durability {} -> {}",
            r.describe(),
            was.as_str(),
            d.as_str()
        );
        Ok(was)
    }

    /// Replace the superblock with one naming durability `d` (one PUT per copy, each atomic).
    ///
    /// Besides init, this is the one place the superblock is written; in an encrypted pool it
    /// is authenticated again with the data key, as at init.
    fn store_durability(&self, d: Durability) -> Result<()> {
        let mut sb = Superblock {
            durability: Some(d),
            ..self.sb.clone()
        };
        if let Some(c) = &self.crypto {
            // An encrypted pool's superblock carries a MAC over every field (docs/FORMAT.md).
            sb.authenticate(c);
        }
        crate::copies::write_both(&*self.dir, crate::format::SUPERBLOCK_NAME, &sb.encode())
    }
}
