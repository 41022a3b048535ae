//! The pool: the I/O side of the engine — segments, journal, group commit, checkpoints,
//! open and recovery — and the write and read paths over the metadata stores.
//!
//! Owns: [`State`], which pairs the [`Metadata`] (block maps, chunk table, dedup index,
//! records; changed only by [`Metadata::apply`]) with the segment store and the journal, behind
//! one mutex. Every change is a [`JournalRecord`] applied and appended to the journal in the
//! same critical section, so the journal order is the apply order.
//!
//! Locks, always taken in this order: `gc_lock` (one GC at a time), a volume's write lock
//! (held by read-modify-write of partial blocks, zeroing, resize and delete; whole-block
//! writes go without it), then `sync_lock` (one flush or checkpoint at a time), then `state`. CPU-heavy work (hashing,
//! compression, decompression) and data reads run without `state`.
//!
//! Durability: a flush (1) writes the journal's buffered records as a batch, (2) syncs every
//! segment written since the last flush and the directory if segments were created, then (3)
//! syncs the journal. Replay checks that every chunk a batch introduces is on disk and stops at
//! the first batch whose data is missing, so a batch written before its data was synced can
//! never surface garbage. A checkpoint writes only the dirty metadata pages (out of place) and
//! a small root naming them; see docs/FORMAT.md.
//!
//! Encryption at rest ([`crate::crypto`]): opening an encrypted pool unwraps the data key and
//! checks the superblock's MAC before anything is written (a missing or wrong key, or a
//! superblock changed without the key, changes no file); a writable open then seals under a
//! session of its own (a random salt, a counter in memory), so no file holds nonce state.

use crate::cache::{
    slot_budget, writeback_split, CacheConf, CacheMode, CacheStats, ChunkCache, CACHE_CONF_NAME,
};
use crate::crypto::{self, Crypto, Kind, NonceScheme, UserKey};
use crate::error::{Error, Result};
use crate::format::*;
use crate::io::{write_file_atomically, Dir, RealDir};
use crate::journal::{Journal, ReplayMode, ReplayReport};
use crate::locks::lock;
use crate::metadata::{Metadata, VolumeState};
use crate::page_alloc::PageAlloc;
use crate::page_cache::{PageCache, Ptr, TreeInfo, CHUNK_TREE};
use crate::reduction::{self, Compressor};
use crate::segment::Segments;
use rayon::prelude::*;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};

/// Settings fixed when a pool is created.
#[derive(Clone, Debug)]
pub struct InitOptions {
    pub block_size: u32,
    pub compression: Compression,
    pub write_policy: WritePolicy,
    pub segment_bytes_target: u64,
    /// The metadata page-cache budget stored in the pool (`None`: [`default_metadata_cache_bytes`]).
    pub metadata_cache_bytes: Option<u64>,
    /// Encrypt the pool at rest with a data key wrapped by this key (`None`: not encrypted).
    pub encryption: Option<UserKey>,
}

/// The default metadata page-cache budget: 256 MiB or 5 % of RAM, whichever is smaller.
pub fn default_metadata_cache_bytes() -> u64 {
    let ram = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| {
                    l.split_whitespace()
                        .nth(1)
                        .and_then(|k| k.parse::<u64>().ok())
                })
        })
        .map(|kib| kib * 1024);
    match ram {
        Some(r) => (r / 20).clamp(METADATA_CACHE_MIN, 256 << 20),
        None => 256 << 20,
    }
}

/// The smallest metadata cache accepted (a handful of pages; tests use it to force eviction).
pub const METADATA_CACHE_MIN: u64 = 16 * 4096;

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions {
            block_size: 4096,
            compression: Compression::Lz4,
            write_policy: WritePolicy::Auto,
            segment_bytes_target: 64 << 20,
            metadata_cache_bytes: None,
            encryption: None,
        }
    }
}

/// Settings of one open.
#[derive(Clone, Debug)]
pub struct OpenOptions {
    pub read_only: bool,
    /// Checkpoint when the journal file grows past this.
    pub journal_bytes_max: u64,
    /// Write the journal buffer out when it grows past this (without syncing).
    pub journal_buffer_bytes: usize,
    /// Keep this much of the disk free for metadata; data writes fail with NoSpace below it.
    pub reserve_bytes: u64,
    /// With less than this free beside `reserve_bytes`, writes ask the background GC to run
    /// at once ([`Pool::take_space_low`]).
    pub low_space_bytes: u64,
    /// Metadata page-cache budget for this open (`None`: the pool's stored setting).
    pub metadata_cache_bytes: Option<u64>,
    /// The key of an encrypted pool (ignored by a pool that is not encrypted).
    pub key: Option<UserKey>,
    /// Replay past journal damage instead of failing (read-only opens only; for
    /// [`crate::repair`], which then writes a consistent state).
    pub salvage_journal: bool,
    /// The directory of an attached cache tier, given explicitly (the crash simulator,
    /// tests); `None`: the path stored in the pool's `cache.conf`. Used only when the pool
    /// has a cache attached.
    pub cache_dir: Option<CacheDir>,
    /// Open a pool whose writeback cache directory is lost, without it (`condense cache
    /// detach --force`): segments it staged are missing and a journal it held is replaced by
    /// an empty one.
    pub without_writeback_cache: bool,
    /// With a writeback cache, destage sealed segments in a background thread (the crash
    /// simulator turns this off and calls [`Pool::destage_one`] itself, to stay deterministic).
    pub destage_in_background: bool,
}

/// The directory of a cache tier (a newtype so that [`OpenOptions`] stays `Debug`).
#[derive(Clone)]
pub struct CacheDir(pub Arc<dyn Dir>);

impl std::fmt::Debug for CacheDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CacheDir({})", self.0.describe())
    }
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            read_only: false,
            journal_bytes_max: 64 << 20,
            journal_buffer_bytes: 1 << 20,
            reserve_bytes: 32 << 20,
            low_space_bytes: 1 << 30,
            metadata_cache_bytes: None,
            key: None,
            salvage_journal: false,
            cache_dir: None,
            without_writeback_cache: false,
            destage_in_background: true,
        }
    }
}

/// A change to the metadata made inside a checkpoint ([`Pool::checkpoint_with`]).
pub(crate) type MetadataChange<'a> = dyn FnMut(&mut Metadata) -> Result<()> + 'a;

/// How long a checkpoint of an S3 pool waits for a store that stopped answering half-way.
const CHECKPOINT_STORE_WAIT: std::time::Duration = std::time::Duration::from_secs(300);

/// Re-check free disk space after this many bytes written.
const SPACE_CHECK_BYTES: u64 = 16 << 20;

/// The metadata stores and the I/O side, behind the pool's one state mutex.
pub(crate) struct State {
    pub md: Metadata,
    pub segments: Segments,
    pub journal: Journal,
    /// The directory the journal is in: the pool's, or a writeback cache's.
    pub journal_dir: Arc<dyn Dir>,
    /// Records appended so far / made durable so far (counts, for group commit).
    pub appended: u64,
    pub durable: u64,
    pub poisoned: Option<String>,
    pub written_since_space_check: u64,
    /// `appended` when the last checkpoint was prepared (an S3 pool checkpoints on a timer
    /// only if records were appended since).
    pub checkpointed: u64,
}

/// An open pool. Always held in an `Arc` (volumes keep a reference to it).
pub struct Pool {
    pub(crate) dir: Arc<dyn Dir>,
    pub(crate) sb: Superblock,
    /// Seals and opens everything stored, in an encrypted pool.
    pub(crate) crypto: Option<Arc<Crypto>>,
    pub(crate) sync_writes: bool,
    pub(crate) read_only: bool,
    pub(crate) opts: OpenOptions,
    pub(crate) state: Mutex<State>,
    pub(crate) sync_lock: Mutex<()>,
    /// One garbage collection at a time.
    pub(crate) gc_lock: Mutex<()>,
    vol_locks: Mutex<HashMap<u32, Arc<Mutex<()>>>>,
    /// Open writable handles per volume (rollback refuses while any is open).
    pub(crate) writers: Mutex<HashMap<u32, usize>>,
    pub(crate) me: Weak<Pool>,
    pub(crate) read_errors: AtomicU64,
    /// Blocks repair declared lost ([`ENTRY_LOST`]) read as zeros instead of failing
    /// ([`Pool::set_lost_reads_zeros`]).
    lost_reads_zeros: std::sync::atomic::AtomicBool,
    /// Lost blocks read as zeros through this handle.
    lost_read_as_zeros: AtomicU64,
    /// The scrub's progress and requests ([`crate::scrub`]).
    pub(crate) scrub: crate::scrub::ScrubState,
    /// Writes between their hashing and their commit (see [`Pool::write_blocks`]).
    writes_in_flight: std::sync::atomic::AtomicUsize,
    /// Set by a write that found less than `low_space_bytes` free; taken by the
    /// background GC ([`Pool::take_space_low`]).
    space_low: std::sync::atomic::AtomicBool,
    /// Whether a write alone in flight hashes and compresses on every core
    /// ([`Pool::set_spread_writes`]).
    spread_writes: std::sync::atomic::AtomicBool,
    /// Activity counters for monitoring ([`Pool::counters`]).
    pub(crate) counters: crate::counters::Counters,
    pub(crate) replay: ReplayReport,
    /// The attached cache tier, if any ([`crate::cache`]).
    pub(crate) cache: RwLock<Option<Arc<ChunkCache>>>,
    /// The background destage thread of a writeback cache ([`crate::destage`]).
    pub(crate) destager: Mutex<Option<crate::destage::Destager>>,
    _lock_file: Option<std::fs::File>,
}

/// Check a volume name: what NBD export names and file names can both carry.
pub fn check_volume_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 255
        && name != "."
        && name != ".."
        && !name.chars().any(|c| c == '/' || c.is_control());
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "invalid volume name {name:?}: use 1 to 255 bytes, no '/' or control characters"
        )))
    }
}

/// [`check_volume_name`] for a new volume or snapshot part: `@` separates a volume from
/// its snapshot, so it may not appear in either.
pub fn check_new_volume_name(name: &str) -> Result<()> {
    check_volume_name(name)?;
    if name.contains('@') {
        return Err(Error::Invalid(format!(
            "invalid name {name:?}: '@' separates a volume from its snapshot (VOLUME@SNAPSHOT)"
        )));
    }
    Ok(())
}

fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b)
        .map_err(|e| Error::io("reading random bytes", std::io::Error::other(e.to_string())))?;
    Ok(b)
}

impl Pool {
    // -----------------------------------------------------------------------------------------
    // Create and open.

    /// Create a new pool in the directory `path` (created if missing, owner-only; must hold
    /// no pool).
    pub fn init_path(path: &Path, opts: &InitOptions) -> Result<()> {
        crate::io::create_private_dir(path)
            .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
        let dir = RealDir::new(path);
        let _lock = dir
            .lock(LOCK_NAME)
            .map_err(|e| Error::io(format!("locking {}", path.display()), e))?
            .ok_or_else(|| Error::Locked(path.to_path_buf()))?;
        Pool::init(&dir, opts)
    }

    /// Create a new pool in `dir`.
    pub fn init(dir: &dyn Dir, opts: &InitOptions) -> Result<()> {
        if !opts.block_size.is_power_of_two()
            || !(BLOCK_SIZE_MIN..=BLOCK_SIZE_MAX).contains(&opts.block_size)
        {
            return Err(Error::Invalid(format!(
                "block size {} must be a power of two from 4K to 64K",
                opts.block_size
            )));
        }
        if let Compression::Zstd(l) = opts.compression {
            if !(1..=22).contains(&l) {
                return Err(Error::Invalid(format!("zstd level {l} must be 1 to 22")));
            }
        }
        if opts.segment_bytes_target < 1 << 16 || opts.segment_bytes_target > 1 << 31 {
            return Err(Error::Invalid("segment size must be 64K to 2G".into()));
        }
        if crate::copies::exists(dir, SUPERBLOCK_NAME)
            .map_err(|e| Error::io("checking for a superblock", e))?
        {
            return Err(Error::Invalid(format!(
                "{} already holds a Condense pool",
                dir.describe()
            )));
        }
        if opts
            .metadata_cache_bytes
            .is_some_and(|b| b < METADATA_CACHE_MIN)
        {
            return Err(Error::Invalid(format!(
                "metadata cache must be at least {METADATA_CACHE_MIN} bytes"
            )));
        }
        let mut sb = Superblock {
            block_size: opts.block_size,
            compression: opts.compression,
            write_policy: opts.write_policy,
            durability: dir.remote().map(|r| r.durability()),
            uuid: random_bytes()?,
            key: random_bytes()?,
            segment_bytes_target: opts.segment_bytes_target,
            metadata_cache_bytes: opts.metadata_cache_bytes.unwrap_or(0),
            encryption: None,
        };
        // Encrypted: init seals under a session of its own, as every writable open does.
        let crypto = match &opts.encryption {
            Some(user) => {
                let (wrap, data_key) = crypto::new_data_key(user, &sb.uuid)?;
                sb.encryption = Some(wrap);
                sb.key = [0u8; 32];
                let c = Crypto::reader(&data_key, sb.uuid, NonceScheme::Session)?
                    .start_session(&dir.describe())?;
                sb.authenticate(&c);
                Some(Arc::new(c))
            }
            None => None,
        };
        let journal = Journal::create(dir, 1, &sb.uuid, 0, crypto.clone())?;
        journal
            .file
            .sync()
            .map_err(|e| Error::io("syncing the journal", e))?;
        let meta = dir
            .open(META_NAME, true)
            .map_err(|e| Error::io(format!("creating {META_NAME}"), e))?;
        meta.set_len(0)
            .and_then(|_| meta.write_at(&encode_meta_header(&sb.uuid), 0))
            .and_then(|_| meta.sync())
            .map_err(|e| Error::io(format!("writing {META_NAME}"), e))?;
        let root = Root {
            journal_gen: 1,
            trees: vec![RootTree {
                id: CHUNK_TREE,
                height: 1,
                page: 0,
                crc: 0,
                units: 0,
                codec: 0,
            }],
            bitmap: vec![u64::MAX],
            ..Default::default()
        };
        crate::copies::write_both(
            dir,
            CHECKPOINT_NAME,
            &encode_root(&root, &sb.uuid, crypto.as_deref())?,
        )?;
        // The superblock goes last, its primary copy after its copy: a directory without one
        // is not a pool, so a crash during init leaves nothing that looks like a half-made pool.
        crate::copies::write_both_copy_first(dir, SUPERBLOCK_NAME, &sb.encode())?;
        Ok(())
    }

    /// Open the pool in directory `path`, taking its lock.
    pub fn open_path(path: &Path, opts: OpenOptions) -> Result<Arc<Pool>> {
        let dir = RealDir::new(path);
        if crate::remote::is_local_dir(path) {
            return Pool::open_remote(path, opts);
        }
        if !crate::copies::exists(&dir, SUPERBLOCK_NAME)
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?
        {
            return Err(Error::NotAPool(path.to_path_buf()));
        }
        let lock = dir
            .lock(LOCK_NAME)
            .map_err(|e| Error::io(format!("locking {}", path.display()), e))?
            .ok_or_else(|| Error::Locked(path.to_path_buf()))?;
        let mut opts = opts;
        if opts.cache_dir.is_none() {
            opts.cache_dir = stored_cache_dir(&dir);
        }
        Pool::open_with_lock(Arc::new(dir), opts, Some(lock))
    }

    /// Open the S3 pool whose local directory is `path` (docs/S3.md): its lock file, the
    /// lease, the bucket as the pool directory and `path` as its writeback cache.
    fn open_remote(path: &Path, mut opts: OpenOptions) -> Result<Arc<Pool>> {
        let local = RealDir::new(path);
        let lock = local
            .lock(LOCK_NAME)
            .map_err(|e| Error::io(format!("locking {}", path.display()), e))?
            .ok_or_else(|| Error::Locked(path.to_path_buf()))?;
        let opened = crate::remote::open_local(path, opts.read_only)?;
        opts.read_only = opened.read_only;
        opts.cache_dir = Some(CacheDir(opened.cache_dir));
        opts.without_writeback_cache = false;
        let pool = Pool::open_with_lock(opened.dir, opts, Some(lock))?;
        opened.after.finish(&pool)?;
        Ok(pool)
    }

    /// Open the pool in `dir` (no lock file: for the simulator and tests).
    pub fn open(dir: Arc<dyn Dir>, opts: OpenOptions) -> Result<Arc<Pool>> {
        Pool::open_with_lock(dir, opts, None)
    }

    pub(crate) fn open_with_lock(
        dir: Arc<dyn Dir>,
        opts: OpenOptions,
        lock_file: Option<std::fs::File>,
    ) -> Result<Arc<Pool>> {
        if opts.salvage_journal && !opts.read_only {
            return Err(Error::Invalid(
                "replaying past journal damage needs a read-only open".into(),
            ));
        }
        // The superblock: its primary copy if valid (and authentic), else its copy.
        let sb_copies = crate::copies::read_both(
            &*dir,
            SUPERBLOCK_NAME,
            |bytes| {
                let mut sb = Superblock::decode(bytes)?;
                let crypto =
                    pool_crypto(&*dir, bytes, &mut sb, opts.key.as_ref(), !opts.read_only)?;
                Ok((sb, crypto))
            },
            |_, _| false,
        )
        .map_err(|e| match e {
            Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                Error::NotAPool(dir.describe().into())
            }
            e => e,
        })?;
        let (sb, crypto) = sb_copies.value.clone();
        let sync_writes = match sb.write_policy {
            WritePolicy::Sync => true,
            WritePolicy::Async => false,
            // Async when the directory honours flushes (a directory fsync succeeds).
            WritePolicy::Auto => dir.sync_dir().is_err(),
        };

        // A writeback cache holds segments and the journal: its directory is part of the pool.
        let conf = read_cache_conf(&*dir);
        let staging: Option<Arc<dyn Dir>> = match &conf {
            Ok(Some(c)) if c.mode == CacheMode::WriteBack => match &opts.cache_dir {
                Some(d) if !opts.without_writeback_cache => Some(d.0.clone()),
                _ if opts.without_writeback_cache => None,
                _ => return Err(Error::WritebackCacheMissing(c.path.clone())),
            },
            _ => None,
        };
        let staging_max = match (&conf, opts.read_only) {
            (Ok(Some(c)), false) if staging.is_some() => writeback_split(c.size_bytes).1,
            _ => 0,
        };

        // The checkpoint root: the newest valid of its two copies.
        let root_copies = crate::copies::read_both(
            &*dir,
            CHECKPOINT_NAME,
            |bytes| decode_root(bytes, &sb.uuid, crypto.as_deref()),
            |a, b| (a.journal_gen, a.next_seq) > (b.journal_gen, b.next_seq),
        )?;
        let root = &root_copies.value;
        let meta_file = dir
            .open(META_NAME, false)
            .map_err(|e| Error::io(format!("opening {META_NAME}"), e))?;
        let mut header = vec![0u8; 64];
        meta_file
            .read_at(&mut header, 0)
            .map_err(|e| Error::io(format!("reading {META_NAME}"), e))?;
        let mut notes = Vec::new();
        if crate::format::header_intact(&header) {
            decode_meta_header(&header, &sb.uuid)?;
        } else {
            // Every field of the header is known; the pages check themselves (their CRCs in
            // the root and the interior pages). A writable open rewrites it.
            notes.push(format!(
                "the header of {META_NAME} was damaged; rebuilt from the superblock"
            ));
            if !opts.read_only {
                meta_file
                    .write_at(&encode_meta_header(&sb.uuid), 0)
                    .and_then(|_| meta_file.sync())
                    .map_err(|e| Error::io(format!("rewriting the header of {META_NAME}"), e))?;
            }
        }

        let mut segments = Segments::new(sb.segment_bytes_target, sb.uuid);
        // A segment in both directories was destaged (the pool's copy is complete and
        // durable before the staged one is removed): the pool's copy is used.
        let mut both = Vec::new();
        for (d, staged) in std::iter::once((&dir, false)).chain(staging.iter().map(|s| (s, true))) {
            for name in d
                .list(SEGMENT_PREFIX)
                .map_err(|e| Error::io(format!("listing segments in {}", d.describe()), e))?
            {
                let Some(id) = parse_segment_name(&name) else {
                    continue;
                };
                if staged && segments.file(id).is_some() {
                    both.push(name);
                    continue;
                }
                let file = d
                    .open(&name, false)
                    .map_err(|e| Error::io(format!("opening {name} in {}", d.describe()), e))?;
                let len = file
                    .len()
                    .map_err(|e| Error::io(format!("reading {name} in {}", d.describe()), e))?;
                segments.add_existing(id, file, len, staged);
            }
        }

        let budget = opts
            .metadata_cache_bytes
            .or((sb.metadata_cache_bytes > 0).then_some(sb.metadata_cache_bytes))
            .unwrap_or_else(default_metadata_cache_bytes);
        let trees: BTreeMap<u64, TreeInfo> = root
            .trees
            .iter()
            .map(|t| {
                (
                    t.id,
                    TreeInfo {
                        height: t.height,
                        root: Ptr {
                            page: t.page,
                            crc: t.crc,
                            units: t.units,
                            codec: t.codec,
                        },
                    },
                )
            })
            .collect();
        let mut cache = PageCache::new(
            meta_file,
            PageAlloc::from_bitmap(root.bitmap.clone()),
            trees,
            budget,
        );
        if let Some(c) = &crypto {
            cache.set_crypto(c.clone());
        }
        let mut md = Metadata {
            block_size: sb.block_size,
            volumes: BTreeMap::new(),
            names: HashMap::new(),
            next_vol: root.next_vol,
            cache,
            chunks: crate::chunk_table::ChunkTable {
                next_id: root.next_chunk,
                live_bytes: root.segment_live.iter().copied().collect(),
                live_chunks: root.live_chunks,
                live_stored_bytes: root.live_stored_bytes,
            },
            index: Default::default(),
            index_ready: false,
            meta: root.meta.iter().cloned().collect(),
            meta_bytes_written_before: root.meta_bytes_written,
            checkpoints: root.checkpoints,
        };
        for v in &root.volumes {
            md.volumes.insert(
                v.id,
                VolumeState {
                    name: v.name.clone(),
                    size: v.size,
                    counts: crate::block_map::MapCounts {
                        data_blocks: v.data_blocks,
                        zero_blocks: v.zero_blocks,
                    },
                    snapshot_of: v.snapshot_of,
                    created: v.created,
                },
            );
            md.names.insert(v.name.clone(), v.id);
        }
        md.cache
            .set_shared_pages(root.shared_pages.iter().copied().collect());
        if opts.read_only {
            md.cache.set_read_only();
        }

        let block_size = sb.block_size;
        let mut salvage = crate::repair::Salvage::default();
        let jname = journal_name(root.journal_gen);
        if let (Some(_), Some(s)) = (dir.remote(), &staging) {
            local_journal(&*dir, &**s, root, &sb, crypto.clone())?;
        }
        let journal_dir = match &staging {
            Some(s)
                if s.exists(&jname)
                    .map_err(|e| Error::io("looking for the journal", e))? =>
            {
                s.clone()
            }
            _ => dir.clone(),
        };
        if opts.without_writeback_cache
            && !opts.read_only
            && !journal_dir
                .exists(&jname)
                .map_err(|e| Error::io("looking for the journal", e))?
        {
            // It was on the lost cache device: the changes since the checkpoint are gone.
            tracing::warn!(
                "journal {jname} was in the lost writeback cache; starting an empty one"
            );
            Journal::create(
                &*journal_dir,
                root.journal_gen,
                &sb.uuid,
                root.next_seq,
                crypto.clone(),
            )?
            .file
            .sync()
            .and_then(|_| journal_dir.sync_dir())
            .map_err(|e| Error::io(format!("creating {jname}"), e))?;
        }
        let (journal, mut replay) = Journal::replay(
            &*journal_dir,
            root.journal_gen,
            &sb.uuid,
            root.next_seq,
            match (opts.salvage_journal, opts.read_only) {
                (true, _) => ReplayMode::Salvage,
                (false, true) => ReplayMode::ReadOnly,
                (false, false) => ReplayMode::Writable,
            },
            crypto.clone(),
            |records, after_damage| {
                if !after_damage
                    && !batch_data_present(&segments, &records, block_size, crypto.as_deref())
                {
                    return Ok(false);
                }
                if opts.salvage_journal {
                    let s = &mut salvage;
                    crate::repair::apply_after_damage(
                        &mut md,
                        &segments,
                        crypto.as_deref(),
                        records,
                        after_damage,
                        s,
                    )?;
                    return Ok(true);
                }
                for r in &records {
                    md.apply(r)?;
                }
                md.cache.evict_to_budget()?;
                Ok(true)
            },
        )?;
        replay.salvage = salvage;
        segments.set_staging(staging.clone(), staging_max);
        let state = State {
            md,
            segments,
            journal,
            journal_dir,
            appended: 0,
            durable: 0,
            poisoned: None,
            written_since_space_check: SPACE_CHECK_BYTES,
            checkpointed: 0,
        };

        // A copy of the superblock or root that open did not use is said, and a writable open
        // rewrites it from the one it used before anything else changes (copies.rs).
        notes.extend([sb_copies.note(), root_copies.note()].into_iter().flatten());
        notes.append(&mut replay.notes);
        for note in &notes {
            tracing::info!("pool {}: {note}", dir.describe());
        }
        replay.notes = notes;
        if !opts.read_only {
            sb_copies.repair_other(&*dir)?;
            root_copies.repair_other(&*dir)?;
            // Leftovers of interrupted checkpoints: other journal generations, a temp file;
            // of interrupted destages: a partial copy, or a staged copy already destaged.
            for d in std::iter::once(&dir).chain(staging.iter()) {
                for name in d
                    .list(JOURNAL_PREFIX)
                    .map_err(|e| Error::io("listing journals", e))?
                {
                    if parse_journal_name(&name).is_some_and(|g| g != state.journal.gen) {
                        d.remove(&name)
                            .map_err(|e| Error::io(format!("removing {name}"), e))?;
                    }
                }
            }
            for name in dir
                .list(SEGMENT_PREFIX)
                .map_err(|e| Error::io("listing segments", e))?
            {
                if name.ends_with(crate::destage::PARTIAL_SUFFIX) {
                    dir.remove(&name)
                        .map_err(|e| Error::io(format!("removing {name}"), e))?;
                }
            }
            if let Some(s) = &staging {
                for name in &both {
                    s.remove(name)
                        .map_err(|e| Error::io(format!("removing destaged {name}"), e))?;
                }
            }
            for tmp in [CHECKPOINT_NAME, SUPERBLOCK_NAME]
                .into_iter()
                .flat_map(|n| {
                    [
                        format!("{n}.tmp"),
                        format!("{}.tmp", crate::copies::copy_name(n)),
                    ]
                })
            {
                if dir.exists(&tmp).map_err(|e| Error::io("listing", e))? {
                    dir.remove(&tmp)
                        .map_err(|e| Error::io(format!("removing {tmp}"), e))?;
                }
            }
        }

        let pool = Arc::new_cyclic(|me| Pool {
            dir,
            sb,
            crypto,
            sync_writes,
            read_only: opts.read_only,
            opts,
            state: Mutex::new(state),
            sync_lock: Mutex::new(()),
            gc_lock: Mutex::new(()),
            vol_locks: Mutex::new(HashMap::new()),
            writers: Mutex::new(HashMap::new()),
            me: me.clone(),
            read_errors: AtomicU64::new(0),
            lost_reads_zeros: std::sync::atomic::AtomicBool::new(false),
            lost_read_as_zeros: AtomicU64::new(0),
            scrub: Default::default(),
            writes_in_flight: Default::default(),
            space_low: Default::default(),
            spread_writes: std::sync::atomic::AtomicBool::new(true),
            counters: Default::default(),
            replay,
            cache: RwLock::new(None),
            destager: Mutex::new(None),
            _lock_file: lock_file,
        });
        // An S3 pool's cache is its local directory, which a read-only open (export, a
        // reader host) may use too: every read of the bucket costs a request.
        if !pool.read_only || pool.dir.remote().is_some() {
            pool.open_attached_cache();
        }
        if !pool.read_only && staging.is_some() && pool.opts.destage_in_background {
            pool.start_destager();
        }
        Ok(pool)
    }

    /// What recovery found in the journal at open.
    pub fn replay_report(&self) -> &ReplayReport {
        &self.replay
    }

    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }

    pub fn block_size(&self) -> u32 {
        self.sb.block_size
    }

    /// True when every write is made durable before it returns.
    pub fn sync_writes(&self) -> bool {
        self.sync_writes
    }

    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    pub fn dir(&self) -> &dyn Dir {
        &*self.dir
    }

    /// Make everything durable and write a checkpoint, so the next open replays nothing.
    pub fn close(&self) -> Result<()> {
        if self.read_only {
            // (Only an S3 pool opens its cache tier read-only: keep what it promoted.)
            if let Some(c) = self.cache() {
                if let Err(e) = c.close() {
                    tracing::warn!("closing the cache tier: {e}");
                }
            }
            return Ok(());
        }
        self.stop_destager();
        self.flush()?;
        let guard = lock(&self.sync_lock);
        self.checkpoint_locked(&guard)?;
        drop(guard);
        if let Some(c) = self.cache() {
            if let Err(e) = c.close() {
                tracing::warn!("closing the cache tier: {e}");
            }
        }
        Ok(())
    }

    // -----------------------------------------------------------------------------------------
    // Cache tier.

    /// The attached cache, if any.
    pub(crate) fn cache(&self) -> Option<Arc<ChunkCache>> {
        self.cache.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// What `cache.conf` says, if a cache is attached.
    pub fn cache_conf(&self) -> Result<Option<CacheConf>> {
        read_cache_conf(&*self.dir)
    }

    /// Open the cache named by `cache.conf` (in `opts.cache_dir`); a cache that cannot be
    /// opened is a warning, never a failure (writethrough: it holds nothing the pool lacks).
    fn open_attached_cache(&self) {
        let conf = match read_cache_conf(&*self.dir) {
            Ok(Some(c)) => c,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("{e}; running without the cache tier");
                return;
            }
        };
        let Some(dir) = self.opts.cache_dir.clone() else {
            tracing::warn!(
                "the cache directory {} is missing or unreadable; running without the cache tier \
                 (`condense cache detach` forgets it)",
                conf.path
            );
            return;
        };
        match ChunkCache::open(
            dir.0,
            slot_budget(&conf),
            conf.mode,
            self.sb.uuid,
            self.sb.block_size,
        ) {
            Ok(c) => {
                let c = Arc::new(c);
                *self.cache.write().unwrap_or_else(|e| e.into_inner()) = Some(c.clone());
                lock(&self.state).md.cache.set_l2(Some(c));
            }
            Err(e) => tracing::warn!(
                "opening the cache tier in {}: {e}; running without it",
                conf.path
            ),
        }
    }

    /// Attach a cache tier in `dir` (at `path`, stored in `cache.conf` so later opens use it).
    /// In writeback mode, new segments and the journal move to `dir` too (the journal at a
    /// checkpoint made here), and a background thread destages sealed segments.
    pub fn attach_cache(&self, dir: Arc<dyn Dir>, conf: CacheConf) -> Result<()> {
        if self.read_only {
            return Err(Error::ReadOnly);
        }
        let writeback = conf.mode == CacheMode::WriteBack;
        {
            let mut slot = self.cache.write().unwrap_or_else(|e| e.into_inner());
            if slot.is_some() || read_cache_conf(&*self.dir)?.is_some() {
                return Err(Error::Invalid(format!(
                    "pool {} already has a cache attached; detach it first (`condense cache detach`)",
                    self.dir.describe()
                )));
            }
            if writeback {
                // Pool files left by an earlier writeback attachment would be taken for this
                // pool's at the next open.
                for prefix in [SEGMENT_PREFIX, JOURNAL_PREFIX] {
                    let found = dir
                        .list(prefix)
                        .map_err(|e| Error::io(format!("listing {}", dir.describe()), e))?;
                    if let Some(name) = found.first() {
                        return Err(Error::Invalid(format!(
                            "cache directory {} holds pool files ({name}) of an earlier writeback cache; \
                             give an empty directory, or remove them if no pool needs them",
                            dir.describe()
                        )));
                    }
                }
            }
            let cache = ChunkCache::open(
                dir.clone(),
                slot_budget(&conf),
                conf.mode,
                self.sb.uuid,
                self.sb.block_size,
            )?;
            // cache.conf is durable before anything is staged, so every open finds the stage.
            write_file_atomically(&*self.dir, CACHE_CONF_NAME, conf.encode().as_bytes())?;
            *slot = Some(Arc::new(cache));
        }
        // (Not under the cache's lock: a read holds the state lock while it looks up the cache.)
        let tier = self
            .cache()
            .map(|c| c as Arc<dyn crate::page_cache::PageTier>);
        lock(&self.state).md.cache.set_l2(tier);
        if writeback {
            let guard = lock(&self.sync_lock);
            lock(&self.state)
                .segments
                .set_staging(Some(dir), writeback_split(conf.size_bytes).1);
            self.checkpoint_locked(&guard)?;
            drop(guard);
            if self.opts.destage_in_background {
                self.start_destager();
            }
        }
        Ok(())
    }

    /// Detach the cache tier: reads go to the segments only, and `cache.conf` is removed.
    /// Its files stay in the cache directory (delete them freely). Without `force`, an index
    /// that cannot be written at close is an error (the cache stays attached).
    ///
    /// A writeback cache is emptied first: new segments go to the pool directory, every
    /// staged segment is destaged, and a checkpoint moves the journal back; only then is
    /// `cache.conf` removed (a crash before that leaves the cache attached and whole).
    pub fn detach_cache(&self, force: bool) -> Result<()> {
        if self.read_only {
            return Err(Error::ReadOnly);
        }
        if let Some(r) = self.dir.remote() {
            return Err(Error::Invalid(format!(
                "pool {} is in an object store: its cache is its local directory (the journal and segments not yet uploaded live there) and cannot be detached",
                r.describe()
            )));
        }
        if self.cache().is_none() && read_cache_conf(&*self.dir).ok().flatten().is_none() {
            return Err(Error::Invalid(format!(
                "pool {} has no cache attached",
                self.dir.describe()
            )));
        }
        self.stop_destager();
        let staging = lock(&self.state).segments.staging().cloned();
        if let Some(staging) = staging {
            let guard = lock(&self.sync_lock);
            {
                let mut st = lock(&self.state);
                self.writable(&st)?;
                st.segments.set_staging(Some(staging.clone()), 0);
                if st
                    .segments
                    .open_id()
                    .is_some_and(|id| st.segments.is_staged(id))
                {
                    st.segments.seal_open()?;
                }
            }
            drop(guard);
            self.flush()?;
            while self.destage_one()? {}
            let guard = lock(&self.sync_lock);
            let left = lock(&self.state).segments.staged_count();
            if left > 0 {
                return Err(Error::Invalid(format!(
                    "{left} segments are still staged in the cache (a destage is running?); retry"
                )));
            }
            // The new journal generation is created in the pool directory.
            self.checkpoint_locked(&guard)?;
            lock(&self.state).segments.set_staging(None, 0);
        }
        lock(&self.state).md.cache.set_l2(None);
        let mut slot = self.cache.write().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = slot.as_ref() {
            if let Err(e) = c.close() {
                if !force {
                    return Err(e);
                }
                tracing::warn!("closing the cache tier: {e}");
            }
        }
        *slot = None;
        self.dir
            .remove(CACHE_CONF_NAME)
            .or_else(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    Ok(())
                } else {
                    Err(e)
                }
            })
            .and_then(|_| self.dir.sync_dir())
            .map_err(|e| Error::io(format!("removing {CACHE_CONF_NAME}"), e))
    }

    /// The cache tier's counters and figures, if one is attached (read from its index when
    /// it is not open: a read-only open, or a cache directory that could not be opened).
    pub fn cache_stats(&self) -> Option<CacheStats> {
        let mut s = match self.cache() {
            Some(c) => c.stats(),
            None => {
                let conf = read_cache_conf(&*self.dir).ok().flatten()?;
                let dir = self.opts.cache_dir.as_ref().map(|d| &*d.0);
                crate::cache::peek_stats(dir, &conf, self.sb.block_size)
            }
        };
        // A writeback cache's dirty bytes are the segments not yet destaged.
        let st = lock(&self.state);
        s.dirty_bytes = st.segments.staged_bytes();
        s.used_bytes += s.dirty_bytes;
        if st.segments.staging().is_some() {
            s.size_bytes = read_cache_conf(&*self.dir)
                .ok()
                .flatten()
                .map_or(s.size_bytes, |c| c.size_bytes);
        }
        s.destaged_segments = self.counters.destaged_segments.load(Ordering::Relaxed);
        s.destaged_bytes = self.counters.destaged_bytes.load(Ordering::Relaxed);
        Some(s)
    }

    /// Wait until the cache's queued promotions are written (tests; `cache stats`).
    pub fn cache_drain(&self) {
        if let Some(c) = self.cache() {
            c.drain();
        }
    }

    // -----------------------------------------------------------------------------------------
    // Volumes.

    pub(crate) fn writable(&self, st: &State) -> Result<()> {
        if self.read_only {
            return Err(Error::ReadOnly);
        }
        if let Some(p) = st.poisoned.as_deref().or(st.segments.write_failure()) {
            return Err(Error::Poisoned(p.to_string()));
        }
        Ok(())
    }

    fn check_size(&self, size: u64) -> Result<()> {
        let bs = u64::from(self.sb.block_size);
        if size == 0 || !size.is_multiple_of(bs) {
            return Err(Error::Invalid(format!(
                "size {size} is not a positive multiple of the pool's block size ({bs} bytes)"
            )));
        }
        if size > 1 << 60 {
            return Err(Error::Invalid(format!("size {size} is larger than 1 EiB")));
        }
        Ok(())
    }

    pub fn create_volume(&self, name: &str, size: u64) -> Result<()> {
        check_new_volume_name(name)?;
        self.check_size(size)?;
        let mut st = lock(&self.state);
        self.writable(&st)?;
        if st.md.names.contains_key(name) {
            return Err(Error::AlreadyExists(name.to_string()));
        }
        let vol = st.md.next_vol;
        self.commit(
            &mut st,
            vec![JournalRecord::VolumeCreate {
                vol,
                size,
                name: name.to_string(),
            }],
        )?;
        drop(st);
        self.after_metadata_change()
    }

    pub fn delete_volume(&self, name: &str) -> Result<()> {
        let vol_lock = self.volume_lock(self.volume_id(name)?);
        let _w = lock(&vol_lock);
        let mut st = lock(&self.state);
        self.writable(&st)?;
        let vol = *st
            .md
            .names
            .get(name)
            .ok_or_else(|| Error::NotFound(name.to_string()))?;
        let snaps = crate::snapshot::snapshot_names_of(&st.md, vol);
        if !snaps.is_empty() {
            return Err(Error::Invalid(format!(
                "volume {name:?} has {} snapshot(s) ({}); delete them first (`condense snapshot delete {name}@{}`)",
                snaps.len(),
                snaps.join(", "),
                snaps[0]
            )));
        }
        let mut records = vec![JournalRecord::VolumeDelete { vol }];
        let mark = crate::importing::key(name);
        if st.md.meta.contains_key(&mark) {
            // No "import in progress" mark outlives its volume (engine::importing).
            records.push(JournalRecord::MetaPut {
                key: mark,
                value: None,
            });
        }
        self.commit(&mut st, records)?;
        drop(st);
        self.after_metadata_change()
    }

    /// Grow or shrink a volume. Shrinking below written blocks needs `force`.
    pub fn resize_volume(&self, name: &str, size: u64, force: bool) -> Result<()> {
        self.check_size(size)?;
        let vol_lock = self.volume_lock(self.volume_id(name)?);
        let _w = lock(&vol_lock);
        let mut st = lock(&self.state);
        self.writable(&st)?;
        let vol = *st
            .md
            .names
            .get(name)
            .ok_or_else(|| Error::NotFound(name.to_string()))?;
        st.md.writable_volume_for(vol, name, "resize", 0, 0)?;
        let first_cut = size / u64::from(self.sb.block_size);
        let first_data =
            crate::block_map::first_mapped(&mut st.md.cache, u64::from(vol), first_cut)?;
        if let Some(block) = first_data {
            if !force {
                return Err(Error::Invalid(format!(
                    "volume {name:?} has data at block {block} (offset {}), past the new size {size}; \
                     shrinking would discard it (use --force to discard)",
                    block * u64::from(self.sb.block_size)
                )));
            }
        }
        self.commit(&mut st, vec![JournalRecord::VolumeResize { vol, size }])?;
        drop(st);
        self.after_metadata_change()
    }

    /// Names and sizes of all volumes (not snapshots), sorted by name.
    pub fn volumes(&self) -> Vec<(String, u64)> {
        let st = lock(&self.state);
        let mut v: Vec<_> = st
            .md
            .volumes
            .values()
            .filter(|v| v.snapshot_of.is_none())
            .map(|v| (v.name.clone(), v.size))
            .collect();
        v.sort();
        v
    }

    pub fn volume_id(&self, name: &str) -> Result<u32> {
        lock(&self.state)
            .md
            .names
            .get(name)
            .copied()
            .ok_or_else(|| Error::NotFound(name.to_string()))
    }

    pub(crate) fn volume_lock(&self, vol: u32) -> Arc<Mutex<()>> {
        lock(&self.vol_locks).entry(vol).or_default().clone()
    }

    /// A handle to a volume.
    pub fn volume(&self, name: &str) -> Result<crate::volume::VolumeHandle> {
        let (vol, snapshot) = {
            let st = lock(&self.state);
            let vol = *st
                .md
                .names
                .get(name)
                .ok_or_else(|| Error::NotFound(name.to_string()))?;
            let snapshot = st
                .md
                .volumes
                .get(&vol)
                .is_some_and(|v| v.snapshot_of.is_some());
            (vol, snapshot)
        };
        let pool = self
            .me
            .upgrade()
            .ok_or_else(|| Error::Invalid("pool is closing".into()))?;
        let read_only = self.read_only || snapshot;
        if !read_only {
            *lock(&self.writers).entry(vol).or_default() += 1;
        }
        Ok(crate::volume::VolumeHandle::new(
            pool,
            vol,
            name.to_string(),
            read_only,
        ))
    }

    pub(crate) fn volume_size(&self, vol: u32, name: &str) -> Result<u64> {
        let st = lock(&self.state);
        st.md
            .volumes
            .get(&vol)
            .map(|v| v.size)
            .ok_or_else(|| Error::NotFound(name.to_string()))
    }

    /// Read a named metadata record.
    pub fn meta_get(&self, key: &str) -> Option<Vec<u8>> {
        lock(&self.state).md.meta.get(key).cloned()
    }

    /// Set or remove a named metadata record.
    pub fn meta_put(&self, key: &str, value: Option<&[u8]>) -> Result<()> {
        if key.is_empty() || key.len() > 1024 || value.is_some_and(|v| v.len() > 16 << 20) {
            return Err(Error::Invalid(
                "metadata key must be 1 to 1024 bytes, value up to 16 MiB".into(),
            ));
        }
        let mut st = lock(&self.state);
        self.writable(&st)?;
        self.commit(
            &mut st,
            vec![JournalRecord::MetaPut {
                key: key.to_string(),
                value: value.map(|v| v.to_vec()),
            }],
        )?;
        drop(st);
        if self.sync_writes {
            self.flush()?;
        }
        Ok(())
    }

    pub fn meta_keys(&self, prefix: &str) -> Vec<String> {
        let st = lock(&self.state);
        st.md
            .meta
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Volume creation, deletion and resize are durable when they return.
    fn after_metadata_change(&self) -> Result<()> {
        self.flush()
    }

    /// Apply records to the state and append them to the journal: the one way state changes.
    /// Writes a full journal buffer out first, so a failure there changes nothing.
    /// Pages the records touch are loaded first, so a damaged page fails the request before
    /// anything changes; pages over the cache budget are written out after.
    pub(crate) fn commit(&self, st: &mut State, records: Vec<JournalRecord>) -> Result<u64> {
        if st.journal.pending_bytes() >= self.opts.journal_buffer_bytes {
            st.journal.seal()?;
        }
        st.md.prefetch(&records)?;
        for r in &records {
            if let Err(e) = st.md.apply(r) {
                // The state may be half-changed: stop accepting writes until reopened.
                st.poisoned = Some(e.to_string());
                return Err(e);
            }
            st.journal.append(r);
        }
        st.appended += records.len() as u64;
        crate::counters::add(&self.counters.journal_records, records.len() as u64);
        let appended = st.appended;
        let index_bytes = st.md.index.ram_bytes();
        st.md.cache.set_reserved_bytes(index_bytes);
        if let Err(e) = st.md.cache.evict_to_budget() {
            st.poisoned = Some(e.to_string());
            return Err(e);
        }
        Ok(appended)
    }

    // -----------------------------------------------------------------------------------------
    // Write path.

    /// Write whole blocks starting at block `first`. Safe to call concurrently; callers doing a
    /// read-modify-write hold the volume's write lock around it.
    pub(crate) fn write_blocks(
        &self,
        vol: u32,
        name: &str,
        first: u64,
        data: &[u8],
    ) -> Result<u64> {
        let bs = self.sb.block_size as usize;
        debug_assert_eq!(data.len() % bs, 0);
        let key = self.sb.key;
        // Hash and compress on every core only while this is the only write in flight (and
        // the pool is not behind the NBD server: `set_spread_writes`): with more (an NBD
        // client's queue, FUSE's threads) each write on its own thread keeps both cores busy
        // without the cost of handing blocks between threads.
        let in_flight = InFlight::enter(&self.writes_in_flight);
        let spread = in_flight.alone() && self.spread_writes.load(Ordering::Relaxed);
        // 1. Zero detection and fingerprints (small blocks hashed 16 at a time).
        let fps: Vec<Option<Fingerprint>> = if spread && data.len() >= 32 * bs {
            let parts: Vec<Vec<Option<Fingerprint>>> = data
                .par_chunks(16 * bs)
                .map(|part| reduction::classify(&key, part, bs))
                .collect();
            parts.concat()
        } else {
            reduction::classify(&key, data, bs)
        };
        // 2. Which blocks are new chunks. A small write skips this and compresses its new
        // chunks under the lock in step 4: one lock round trip instead of two.
        let mut ids_at_lookup = None;
        let misses: Vec<usize> = if fps.len() <= SMALL_WRITE_BLOCKS {
            Vec::new()
        } else {
            let mut st = lock(&self.state);
            ids_at_lookup = Some(st.md.chunks.next_id);
            self.writable(&st)?;
            let mut seen: HashMap<Fingerprint, (), FpHash> =
                HashMap::with_capacity_and_hasher(fps.len(), FpHash);
            let mut misses = Vec::new();
            for (i, fp) in fps.iter().enumerate() {
                if let Some(Some(ahead)) = fps.get(i + PREFETCH_AHEAD) {
                    st.md.prefetch_duplicate(ahead);
                }
                let Some(fp) = fp.as_ref() else { continue };
                let hit = st.md.find_duplicate(fp).is_some();
                if !hit && seen.insert(*fp, ()).is_none() {
                    misses.push(i);
                }
            }
            misses
        };
        // 3. Compress the new chunks.
        let comp = self.sb.compression;
        let crypto = self.crypto.as_deref();
        // Compressed (or the block itself), then sealed in an encrypted pool (bound to the
        // fingerprint and codec).
        let store =
            |z: &mut Compressor, i: usize, fp: Option<&Fingerprint>| -> Result<Stored<'_>> {
                let block = &data[i * bs..(i + 1) * bs];
                let (codec, payload) = match z.try_compress(comp, block) {
                    Some((codec, c)) => (codec, Cow::Owned(c)),
                    None => (ChunkCodec::Raw, Cow::Borrowed(block)),
                };
                match (crypto, fp) {
                    (Some(c), Some(fp)) => Ok((
                        codec,
                        Cow::Owned(c.sealed(Kind::Chunk, &chunk_ctx(fp, codec), &payload)?),
                    )),
                    _ => Ok((codec, payload)),
                }
            };
        // In write order, a run of misses per compressor (it skips LZ4 in runs of noise).
        let compress_run = |run: &[usize]| -> Result<Vec<(usize, Stored<'_>)>> {
            let mut z = Compressor::default();
            run.iter()
                .map(|&i| store(&mut z, i, fps[i].as_ref()).map(|c| (i, c)))
                .collect()
        };
        let compressed_list: Vec<(usize, Stored<'_>)> = if spread && misses.len() >= 16 {
            // Four runs per core: long enough to skip noise, enough to share the cores.
            let per = misses
                .len()
                .div_ceil(4 * rayon::current_num_threads())
                .max(8);
            let runs: Vec<Vec<(usize, Stored<'_>)>> = misses
                .par_chunks(per)
                .map(compress_run)
                .collect::<Result<_>>()?;
            runs.concat()
        } else {
            compress_run(&misses)?
        };
        let mut compressed: Vec<Option<Stored<'_>>> = vec![None; fps.len()];
        for (i, c) in compressed_list {
            compressed[i] = Some(c);
        }
        drop(in_flight);
        // 4. Stage the new records.
        let mut st = lock(&self.state);
        self.writable(&st)?;
        st.md
            .writable_volume_for(vol, name, "write", first, (data.len() / bs) as u64)?;
        self.check_space(&mut st, data.len() as u64)?;
        let mut records = Vec::new();
        let mut entries = Vec::with_capacity(fps.len());
        let mut batch_new: HashMap<Fingerprint, u64, FpHash> =
            HashMap::with_capacity_and_hasher(fps.len(), FpHash);
        let first_new_id = st.md.chunks.next_id;
        let mark = st.segments.mark();
        // No chunk was added since step 2 (ids are taken and committed under one hold of the
        // lock): its misses are misses still, and are not looked up again.
        let misses_hold = ids_at_lookup == Some(first_new_id);
        let mut small = Compressor::default();
        for (i, fp) in fps.iter().enumerate() {
            // Also for known misses: the commit below inserts them.
            if let Some(Some(ahead)) = fps.get(i + PREFETCH_AHEAD) {
                st.md.prefetch_duplicate(ahead);
            }
            let Some(fp) = fp else {
                entries.push(ENTRY_ZERO);
                continue;
            };
            if let Some(&id) = batch_new.get(fp) {
                entries.push(id);
                continue;
            }
            let known_miss = misses_hold && compressed[i].is_some();
            if !known_miss {
                if let Some(id) = st.md.find_duplicate(fp) {
                    entries.push(id);
                    continue;
                }
            }
            // A new chunk (compressed above, or now if the index changed since step 2).
            let fresh;
            let (codec, payload) = match &compressed[i] {
                Some((c, p)) => (*c, &**p),
                None => {
                    fresh = match store(&mut small, i, Some(fp)) {
                        Ok(f) => f,
                        Err(e) => {
                            Self::unwind(&mut st, first_new_id, mark);
                            return Err(e);
                        }
                    };
                    (fresh.0, &*fresh.1)
                }
            };
            let Some(id) = st.md.chunks.allocate_id() else {
                Self::unwind(&mut st, first_new_id, mark);
                return Err(Error::NoSpace(
                    "allocating a chunk id (the pool holds 2^48 chunks)".into(),
                ));
            };
            let loc = match st.segments.append(&*self.dir, id, fp, codec, payload) {
                Ok(loc) => loc,
                Err(e) => {
                    Self::unwind(&mut st, first_new_id, mark);
                    return Err(e);
                }
            };
            records.push(JournalRecord::NewChunk { id, loc, fp: *fp });
            batch_new.insert(*fp, id);
            entries.push(id);
        }
        // 5. Apply and journal the changes. The new records are readable from memory until
        // a batch's worth is staged and handed to be written (by the segment writer, in the
        // background, where the directory offers direct I/O); a flush writes them all.
        records.push(JournalRecord::MapRun {
            vol,
            start: first,
            entries,
        });
        let committed = self.commit(&mut st, records);
        if committed.is_err() {
            // Unless the state is half-changed (poisoned already), nothing was applied: the
            // journal buffer could not be written out, or a page could not be read.
            if st.poisoned.is_none() {
                Self::unwind(&mut st, first_new_id, mark);
            }
            return committed;
        }
        st.segments.write_full_batch()?;
        committed
    }

    /// Give back the ids and staged records of a write that failed before anything of it
    /// was applied. Records of it that a full segment sent to be written stay there,
    /// unreferenced (GC reclaims them).
    fn unwind(st: &mut State, first_id: u64, mark: (Option<u32>, u64)) {
        st.segments.discard_since(mark);
        st.md.chunks.unallocate_to(first_id);
    }

    /// Whether a write that is the only one in flight spreads its hashing and compression
    /// over every core (on by default). Worth it for one stream of writes in this process
    /// (`condense import`: 10.3–11.4 s against 12.0–13.2 s for the ten corpus images). The
    /// NBD server turns it off: its writes arrive while the connection copies the next
    /// request from the socket and the client runs on the same cores, and the spread took
    /// their CPU (rayon's idle workers spin between writes). Over NBD, 1 MiB writes went
    /// from ~960 to ~1040 MiB/s at queue depth 4 and from 611 to 713 at depth 1 without it.
    pub fn set_spread_writes(&self, on: bool) {
        self.spread_writes.store(on, Ordering::Relaxed);
    }

    /// Whether blocks `condense repair` declared lost read as zeros through this handle
    /// (`condense export --lost-as-zeros`, to copy what is left of a damaged volume) instead
    /// of failing with [`Error::Lost`] (the default, so that no client takes zeros for data).
    pub fn set_lost_reads_zeros(&self, on: bool) {
        self.lost_reads_zeros.store(on, Ordering::Relaxed);
    }

    /// Lost blocks read as zeros so far ([`Pool::set_lost_reads_zeros`]).
    pub fn lost_blocks_read_as_zeros(&self) -> u64 {
        self.lost_read_as_zeros.load(Ordering::Relaxed)
    }

    /// Whether a write found the disk low on space since the last call (and clear it):
    /// less than [`OpenOptions::low_space_bytes`] free beside the reserve. Overwrites at disk
    /// speed make dead space far faster than a periodic GC check notices.
    pub fn take_space_low(&self) -> bool {
        self.space_low
            .swap(false, std::sync::atomic::Ordering::Relaxed)
    }

    fn check_space(&self, st: &mut State, bytes: u64) -> Result<()> {
        st.written_since_space_check += bytes;
        if st.written_since_space_check < SPACE_CHECK_BYTES {
            return Ok(());
        }
        let avail = self
            .dir
            .available_bytes()
            .map_err(|e| Error::io("checking free space", e))?;
        if avail < self.opts.reserve_bytes + self.opts.low_space_bytes {
            self.space_low
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        if avail < self.opts.reserve_bytes + bytes {
            return Err(Error::NoSpace(format!(
                "writing {bytes} bytes: only {avail} bytes free on the pool's disk, {} kept for metadata",
                self.opts.reserve_bytes
            )));
        }
        st.written_since_space_check = 0;
        Ok(())
    }

    /// Set `count` blocks from `first` to ZERO or UNMAPPED. The caller holds the write lock.
    pub(crate) fn fill_blocks(
        &self,
        vol: u32,
        name: &str,
        first: u64,
        count: u64,
        entry: u64,
    ) -> Result<u64> {
        debug_assert!(entry == ENTRY_ZERO || entry == ENTRY_UNMAPPED);
        let mut st = lock(&self.state);
        self.writable(&st)?;
        st.md.writable_volume_for(vol, name, "zero", first, count)?;
        self.commit(
            &mut st,
            vec![JournalRecord::MapFill {
                vol,
                start: first,
                count,
                entry,
            }],
        )
    }

    /// Make durable every record appended up to `target` (group commit: one flush covers all
    /// writers waiting for it).
    pub(crate) fn flush_through(&self, target: u64) -> Result<()> {
        if lock(&self.state).durable >= target {
            return Ok(());
        }
        self.flush()
    }

    /// Make every completed write durable.
    pub fn flush(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        let guard = lock(&self.sync_lock);
        let (dirty, staging, journal, target) = {
            let mut st = lock(&self.state);
            self.writable(&st)?;
            if st.durable == st.appended {
                return Ok(());
            }
            // The journal records name chunks in the staged records: those are written
            // first (and synced before the journal, below).
            let dirty = match st.segments.take_dirty() {
                Ok(d) => d,
                Err(e) => {
                    st.poisoned = Some(e.to_string());
                    return Err(e);
                }
            };
            st.journal.seal_flush()?;
            let staging = st.segments.staging().cloned().filter(|_| dirty.staging_dir);
            (dirty, staging, st.journal.file.clone(), st.appended)
        };
        let started = std::time::Instant::now();
        let synced = (|| {
            sync_segments(&dirty.files)?;
            if dirty.pool_dir {
                self.dir
                    .sync_dir()
                    .map_err(|e| Error::io("syncing the pool directory", e))?;
            }
            if let Some(s) = staging {
                s.sync_dir()
                    .map_err(|e| Error::io("syncing the cache directory", e))?;
            }
            let journal_started = std::time::Instant::now();
            journal
                .sync()
                .map_err(|e| Error::io("syncing the journal", e))?;
            let c = &self.counters;
            crate::counters::add(&c.journal_syncs, 1);
            crate::counters::add(
                &c.journal_sync_nanos,
                crate::counters::nanos(journal_started.elapsed()),
            );
            Ok(())
        })();
        crate::counters::add(&self.counters.flushes, 1);
        crate::counters::add(
            &self.counters.flush_nanos,
            crate::counters::nanos(started.elapsed()),
        );
        // An S3 pool with `remote` durability: every file was synced locally, only the upload
        // of its write-ahead object failed. The flush fails (nothing is acknowledged) and
        // the next one uploads what this one could not; the pool stays usable.
        if let Err(e) = &synced {
            if crate::remote::is_store_unavailable(e) {
                return synced;
            }
        }
        let st = self.settle_sync(synced, target)?;
        let big = st.journal.file_bytes() > self.opts.journal_bytes_max;
        drop(st);
        if big {
            match self.dir.remote() {
                // An S3 pool's journal grows on the local disk while the store is away.
                Some(r) if r.check_reachable().is_err() => {
                    tracing::warn!(
                        "journal past {} bytes: checkpointing once {} answers",
                        self.opts.journal_bytes_max,
                        r.describe()
                    );
                }
                _ => self.checkpoint_locked(&guard)?,
            }
        }
        Ok(())
    }

    /// Write a checkpoint of the whole state and start a new journal generation. The caller
    /// holds `sync_lock`.
    pub(crate) fn checkpoint_locked(&self, sync: &MutexGuard<'_, ()>) -> Result<()> {
        self.checkpoint_with(sync, &|_| Ok(()), None)
    }

    /// A checkpoint that also makes a change no journal record describes (snapshots,
    /// clones, rollback: they share pages, which needs every page of the source written).
    /// Under the state lock: `check` may refuse (nothing changes); then dirty pages are
    /// written, `change` runs, and what it dirtied is written too, so the new root holds
    /// it. The change is durable, and visible after a crash, once this returns. The caller
    /// holds `sync_lock`, so no flush can acknowledge a later write before that.
    pub(crate) fn checkpoint_with(
        &self,
        _sync: &MutexGuard<'_, ()>,
        check: &dyn Fn(&Metadata) -> Result<()>,
        change: Option<&mut MetadataChange<'_>>,
    ) -> Result<()> {
        let started = std::time::Instant::now();
        if let Some(r) = self.dir.remote() {
            // Before anything changes: a checkpoint of an S3 pool that fails half-way poisons it.
            r.check_reachable()?;
            let last_sealed = {
                let st = lock(&self.state);
                st.segments
                    .last_id()
                    .filter(|&id| Some(id) != st.segments.open_id())
            };
            if let Some(last) = last_sealed {
                self.upload_staged_through(last, false)?;
            }
        }
        let (
            (body, upload_through),
            (old_gen, old_dir),
            new_journal_file,
            (files, dirs),
            target,
            freed,
        ) = {
            let mut st = lock(&self.state);
            self.writable(&st)?;
            check(&st.md)?;
            st.journal.seal()?;
            let new_gen = st.journal.gen + 1;
            let next_seq = st.journal.next_seq();
            // Dirty pages go to their new places now (written, not yet synced); the root
            // names them. Pages written after this belong to the next epoch.
            let prepared = (|| {
                let (mut pages, mut freed) = st.md.cache.prepare_checkpoint()?;
                st.md.cache.write_pages(&mut pages)?;
                if let Some(change) = change {
                    change(&mut st.md)?;
                    let (mut more, freed_more) = st.md.cache.prepare_checkpoint()?;
                    st.md.cache.write_pages(&mut more)?;
                    freed.extend(freed_more);
                }
                Ok::<_, Error>(freed)
            })();
            let freed = match prepared {
                Ok(f) => f,
                Err(e) => {
                    st.poisoned = Some(e.to_string());
                    return Err(e);
                }
            };
            st.md.checkpoints += 1;
            st.checkpointed = st.appended;
            // An S3 pool: the root goes to the bucket only after every segment it can name
            // (the open one is sealed here), so the bucket alone is whole without the
            // write-ahead objects of `remote` durability (they are then deleted).
            let upload_through = match self.dir.remote() {
                Some(_) => {
                    if st.segments.open_id().is_some() {
                        st.segments.seal_open()?;
                    }
                    st.segments.last_id()
                }
                _ => None,
            };
            let body = encode_root(
                &st.md.root(new_gen, next_seq),
                &self.sb.uuid,
                self.crypto.as_deref(),
            )?;
            // With a writeback cache the journal lives in its directory (fast fsyncs).
            let journal_dir = st
                .segments
                .staging()
                .filter(|_| st.segments.stages_new())
                .cloned()
                .unwrap_or_else(|| self.dir.clone());
            let journal = Journal::create(
                &*journal_dir,
                new_gen,
                &self.sb.uuid,
                next_seq,
                self.crypto.clone(),
            )?;
            let file = journal.file.clone();
            let old = std::mem::replace(&mut st.journal, journal);
            let old_dir = std::mem::replace(&mut st.journal_dir, journal_dir.clone());
            let dirty = match st.segments.take_dirty() {
                Ok(d) => d,
                Err(e) => {
                    st.poisoned = Some(e.to_string());
                    return Err(e);
                }
            };
            let mut dirs = vec![self.dir.clone()];
            if let Some(s) = st.segments.staging() {
                dirs.push(s.clone());
            }
            (
                (body, upload_through),
                (old.gen, old_dir),
                file,
                (dirty.files, dirs),
                st.appended,
                freed,
            )
        };
        let meta_file = lock(&self.state).md.cache.file().clone();
        let done = (|| {
            self.store_retry(|| sync_segments(&files))?;
            self.store_retry(|| {
                meta_file
                    .sync()
                    .map_err(|e| Error::io(format!("syncing {META_NAME}"), e))
            })?;
            self.store_retry(|| {
                new_journal_file
                    .sync()
                    .map_err(|e| Error::io("syncing the new journal", e))
            })?;
            for d in &dirs {
                d.sync_dir()
                    .map_err(|e| Error::io(format!("syncing {}", d.describe()), e))?;
            }
            if let Some(last) = upload_through {
                self.upload_staged_through(last, true)?;
            }
            self.store_retry(|| crate::copies::write_both(&*self.dir, CHECKPOINT_NAME, &body))?;
            old_dir
                .remove(&journal_name(old_gen))
                .map_err(|e| Error::io("removing the old journal", e))
        })();
        let mut st = self.settle_sync(done, target)?;
        // The new root no longer names the pages freed before it: they may be reused, and a
        // free tail of meta.dat is given back to the file system.
        st.md.cache.alloc.release(freed);
        st.md.cache.trim_file()?;
        let took = crate::counters::nanos(started.elapsed());
        let c = &self.counters;
        crate::counters::add(&c.checkpoints, 1);
        crate::counters::add(&c.checkpoint_nanos, took);
        c.checkpoint_last_nanos
            .store(took, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Run a step of a checkpoint. In an S3 pool, a store that stops answering half-way is
    /// waited for (backing off, up to [`CHECKPOINT_STORE_WAIT`]) instead of poisoning the
    /// pool at once: every step can be repeated (a PUT replaces, an extent stays dirty until
    /// uploaded). Flushes wait meanwhile; writes go on.
    fn store_retry<T>(&self, mut step: impl FnMut() -> Result<T>) -> Result<T> {
        let deadline = std::time::Instant::now() + CHECKPOINT_STORE_WAIT;
        let mut pause = std::time::Duration::from_millis(500);
        loop {
            match step() {
                Err(e)
                    if self.dir.remote().is_some()
                        && crate::remote::is_store_unavailable(&e)
                        && std::time::Instant::now() < deadline =>
                {
                    tracing::warn!("checkpoint: {e}; retrying in {} ms", pause.as_millis());
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(std::time::Duration::from_secs(10));
                }
                r => return r,
            }
        }
    }

    /// After syncing: on success everything appended up to `target` is durable; on failure
    /// the kernel may have dropped dirty pages, so the pool refuses writes until reopened.
    fn settle_sync(&self, synced: Result<()>, target: u64) -> Result<MutexGuard<'_, State>> {
        let mut st = lock(&self.state);
        if let Err(e) = synced {
            st.poisoned = Some(e.to_string());
            return Err(e);
        }
        st.durable = st.durable.max(target);
        Ok(st)
    }

    // -----------------------------------------------------------------------------------------
    // Read path.

    /// Read `out.len() / block_size` whole blocks from block `first`.
    pub(crate) fn read_blocks(
        &self,
        vol: u32,
        name: &str,
        first: u64,
        out: &mut [u8],
    ) -> Result<()> {
        let bs = self.sb.block_size as usize;
        let n = out.len() / bs;
        // Where each block's bytes are: (index in out, chunk id, location, file).
        let mut wanted = Vec::new();
        let mut in_memory: Vec<Option<Vec<u8>>> = Vec::new();
        {
            let mut st = lock(&self.state);
            st.md.volume_for(vol, name, "read", first, n as u64)?;
            let mut entries = Vec::with_capacity(n);
            let looked_up = crate::block_map::get_range(
                &mut st.md.cache,
                u64::from(vol),
                first,
                n as u64,
                &mut entries,
            )
            .map_err(|err| in_volume(err, name, &format!("blocks {first}..{}", first + n as u64)));
            if let Err(err) = looked_up {
                self.read_errors.fetch_add(1, Ordering::Relaxed);
                return Err(err);
            }
            for (i, &e) in entries.iter().enumerate() {
                if e == ENTRY_LOST {
                    if !self.lost_reads_zeros.load(Ordering::Relaxed) {
                        self.read_errors.fetch_add(1, Ordering::Relaxed);
                        return Err(Error::Lost {
                            volume: name.to_string(),
                            block: first + i as u64,
                        });
                    }
                    self.lost_read_as_zeros.fetch_add(1, Ordering::Relaxed);
                }
                if e == ENTRY_ZERO || e == ENTRY_UNMAPPED || e == ENTRY_LOST {
                    out[i * bs..(i + 1) * bs].fill(0);
                    continue;
                }
                let md = &mut st.md;
                let loc = md.chunks.get(&mut md.cache, e).and_then(|c| {
                    c.map(|c| (c.loc, c.fp)).ok_or_else(|| {
                        Error::corrupt(
                            format!("volume {name:?} block {}", first + i as u64),
                            format!("chunk {e} does not exist (damaged metadata)"),
                        )
                    })
                });
                let (loc, fp) = match loc {
                    Ok(l) => l,
                    Err(err) => {
                        self.read_errors.fetch_add(1, Ordering::Relaxed);
                        return Err(with_context(
                            err,
                            &format!("volume {name:?} block {}", first + i as u64),
                        ));
                    }
                };
                let file = st.segments.file(loc.segment).ok_or_else(|| {
                    Error::corrupt(
                        format!("volume {name:?} block {}", first + i as u64),
                        format!("segment {} of chunk {e} is missing", loc.segment),
                    )
                })?;
                // Staged or being written: not in the file yet.
                in_memory.push(st.segments.in_memory(&loc));
                wanted.push((i, e, loc, file, fp));
            }
            if let Err(e) = st.md.cache.evict_to_budget() {
                st.poisoned = Some(e.to_string());
                return Err(e);
            }
        }
        // The cache tier first: a hit is the record exactly as the segment holds it. A miss
        // is read from its segment, or from memory while it is staged or being written.
        let cache = self.cache();
        let mut cached: Vec<Option<Vec<u8>>> = vec![None; wanted.len()];
        if let Some(c) = &cache {
            for (k, w) in wanted.iter().enumerate() {
                cached[k] = c.lookup(w.1, &w.4, &w.2);
            }
        }
        let cache_misses = cached.iter().filter(|c| c.is_none()).count();
        let missed: Vec<usize> = (0..wanted.len())
            .filter(|&k| cached[k].is_none() && in_memory[k].is_none())
            .collect();
        // Coalesce missed records that are adjacent in one segment into one read; a group
        // is a range of `missed`.
        let mut groups: Vec<(usize, usize)> = Vec::new();
        for (m, &k) in missed.iter().enumerate() {
            let w = &wanted[k];
            match groups.last_mut() {
                Some((_, e))
                    if {
                        let prev = &wanted[missed[*e - 1]].2;
                        prev.segment == w.2.segment
                            && u64::from(prev.offset) + prev.record_bytes() == u64::from(w.2.offset)
                    } =>
                {
                    *e = m + 1
                }
                _ => groups.push((m, m + 1)),
            }
        }
        // Read each group with one call, then check and decode every block (in parallel for
        // large reads).
        let read_group = |&(s, e): &(usize, usize)| -> Result<(u64, Vec<u8>)> {
            let first = &wanted[missed[s]];
            let first_loc = &first.2;
            let last_loc = &wanted[missed[e - 1]].2;
            let start = u64::from(first_loc.offset);
            let len = (u64::from(last_loc.offset) + last_loc.record_bytes() - start) as usize;
            let mut buf = vec![0u8; len];
            first.3.read_at(&mut buf, start).map_err(|err| {
                Error::io(
                    format!(
                        "reading segment {} at offset {start} for volume {name:?}",
                        first_loc.segment
                    ),
                    err,
                )
            })?;
            Ok((start, buf))
        };
        let parallel = wanted.len() >= 32;
        let bufs: Result<Vec<(u64, Vec<u8>)>> = if parallel && groups.len() >= 4 {
            groups.par_iter().map(read_group).collect()
        } else {
            groups.iter().map(read_group).collect()
        };
        let result = bufs.and_then(|bufs| {
            // For each block of `out`: (group or None for a cache hit, wanted index), or
            // None for zeros.
            let mut slot: Vec<Option<(Option<usize>, usize)>> = vec![None; n];
            for (g, &(s, e)) in groups.iter().enumerate() {
                for &k in &missed[s..e] {
                    slot[wanted[k].0] = Some((Some(g), k));
                }
            }
            for (k, (c, m)) in cached.iter().zip(&in_memory).enumerate() {
                if c.is_some() || m.is_some() {
                    slot[wanted[k].0] = Some((None, k));
                }
            }
            let decode = |(i, dst): (usize, &mut [u8])| -> Result<()> {
                let Some((g, k)) = slot[i] else { return Ok(()) };
                let (_, id, loc, _, fp) = &wanted[k];
                let record: &[u8] = match (g, &cached[k], &in_memory[k]) {
                    (Some(g), _, _) => {
                        let (start, buf) = &bufs[g];
                        &buf[(u64::from(loc.offset) - start) as usize..]
                    }
                    (None, Some(c), _) | (None, None, Some(c)) => c,
                    (None, None, None) => return Ok(()),
                };
                let what = || {
                    format!(
                        "volume {name:?} block {} (chunk {id}, segment {}, offset {})",
                        first + i as u64,
                        loc.segment,
                        loc.offset
                    )
                };
                let payload = open_record(record, *id, loc, self.crypto.as_deref(), Some(fp), what)
                    .map_err(|err| with_context(err, &what()))?;
                reduction::decompress(loc.codec, &payload, dst, what)?;
                let from_segment = cached[k].is_none();
                if let (Some(c), true) = (&cache, from_segment) {
                    if let Some(r) = record.get(..loc.record_bytes() as usize) {
                        c.offer(*id, fp, r);
                    }
                }
                Ok(())
            };
            if parallel {
                out.par_chunks_mut(bs).enumerate().try_for_each(decode)
            } else {
                out.chunks_mut(bs).enumerate().try_for_each(decode)
            }
        });
        if let Some(c) = &cache {
            let hits = (wanted.len() - cache_misses) as u64;
            c.count(hits, cache_misses as u64, bs as u64);
        }
        if let Err(e) = &result {
            if e.is_damage() {
                self.read_errors.fetch_add(1, Ordering::Relaxed);
                // The client only sees EIO: the log says what and where.
                tracing::error!("read failed: {e}");
            }
        }
        result
    }

    /// The map entries of `count` blocks from `first`.
    pub(crate) fn map_entries(
        &self,
        vol: u32,
        name: &str,
        first: u64,
        count: u64,
    ) -> Result<Vec<(u64, u64)>> {
        let mut st = lock(&self.state);
        st.md.volume_for(vol, name, "block_status", first, count)?;
        let r = crate::block_map::mapped(&mut st.md.cache, u64::from(vol), first, first + count)
            .map_err(|e| in_volume(e, name, &format!("blocks {first}..{}", first + count)));
        st.md.cache.evict_to_budget()?;
        r
    }
}

/// How many blocks ahead a write's loops over fingerprints prefetch the dedup index.
const PREFETCH_AHEAD: usize = 8;

/// Hashes a fingerprint by its first eight bytes: they are already uniformly random.
#[derive(Clone, Copy, Default)]
pub(crate) struct FpHash;

impl std::hash::BuildHasher for FpHash {
    type Hasher = FpHasher;
    fn build_hasher(&self) -> FpHasher {
        FpHasher(0)
    }
}

#[derive(Default)]
pub(crate) struct FpHasher(u64);

impl std::hash::Hasher for FpHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // A fingerprint arrives as one 16-byte write; fold anything else in too.
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(5) ^ u64::from_le_bytes(b);
        }
    }
}

/// A new chunk as stored: its codec and payload (the block itself when stored raw).
type Stored<'a> = (ChunkCodec, Cow<'a, [u8]>);

/// Writes of at most this many blocks compress their new chunks under the state lock.
const SMALL_WRITE_BLOCKS: usize = 4;

/// One write counted in [`Pool::writes_in_flight`] while it lives.
struct InFlight<'a> {
    count: &'a std::sync::atomic::AtomicUsize,
    before: usize,
}

impl<'a> InFlight<'a> {
    fn enter(count: &'a std::sync::atomic::AtomicUsize) -> InFlight<'a> {
        let before = count.fetch_add(1, Ordering::Relaxed);
        InFlight { count, before }
    }

    /// No other write was in flight when this one started.
    fn alone(&self) -> bool {
        self.before == 0
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::Relaxed);
    }
}

fn sync_segments(files: &[Arc<dyn crate::io::File>]) -> Result<()> {
    for f in files {
        f.sync().map_err(|e| Error::io("syncing a segment", e))?;
    }
    Ok(())
}

/// Name the volume and blocks a metadata error was met in, keeping what it says.
pub(crate) fn in_volume(e: Error, name: &str, blocks: &str) -> Error {
    match e {
        Error::Checksum {
            what,
            expected,
            found,
        } => Error::Checksum {
            what: format!("volume {name:?} {blocks}: {what}"),
            expected,
            found,
        },
        Error::Corrupt { what, detail } => Error::Corrupt {
            what: format!("volume {name:?} {blocks}: {what}"),
            detail,
        },
        Error::Auth { what, detail } => Error::Auth {
            what: format!("volume {name:?} {blocks}: {what}"),
            detail,
        },
        e => e,
    }
}

fn with_context(e: Error, what: &str) -> Error {
    match e {
        Error::Checksum {
            expected, found, ..
        } => Error::Checksum {
            what: what.to_string(),
            expected,
            found,
        },
        Error::Corrupt { detail, .. } => Error::Corrupt {
            what: what.to_string(),
            detail,
        },
        Error::Auth { detail, .. } => Error::Auth {
            what: what.to_string(),
            detail,
        },
        e => e,
    }
}

/// The encryption context of an encrypted pool (`None` for a plain one): unwraps the data key
/// with `key`, checks the MAC of the superblock (`sb_bytes`, as read) and sets the fingerprint
/// key in `sb`. With `seal`, the context has a session of its own and can seal; without it, it
/// only opens. Nothing is written: nonces depend on no file.
pub(crate) fn pool_crypto(
    dir: &dyn Dir,
    sb_bytes: &[u8],
    sb: &mut Superblock,
    key: Option<&UserKey>,
    seal: bool,
) -> Result<Option<Arc<Crypto>>> {
    let Some(wrap) = &sb.encryption else {
        return Ok(None);
    };
    let pool = dir.describe();
    let user = key.ok_or_else(|| Error::KeyRequired(pool.clone()))?;
    let data_key = crypto::unwrap_data_key(user, wrap, &sb.uuid, &pool)?;
    let mut c = Crypto::reader(&data_key, sb.uuid, wrap.scheme)?;
    if wrap.scheme == NonceScheme::Session {
        Superblock::check_mac(sb_bytes, &c, &pool)?;
    }
    if seal {
        c = c.start_session(&pool)?;
    }
    sb.key = crypto::fingerprint_key(&data_key);
    Ok(Some(Arc::new(c)))
}

/// True if every chunk the batch introduces (or moves) is whole on disk.
pub(crate) fn batch_data_present(
    segments: &Segments,
    records: &[JournalRecord],
    block_size: u32,
    crypto: Option<&Crypto>,
) -> bool {
    records.iter().all(|r| match r {
        JournalRecord::NewChunk { id, loc, .. } | JournalRecord::Relocate { id, loc } => {
            let fp = match r {
                JournalRecord::NewChunk { fp, .. } => Some(fp),
                _ => None,
            };
            let Some(file) = segments.file(loc.segment) else {
                return false;
            };
            let mut buf = vec![0u8; loc.record_bytes() as usize];
            if file.read_at(&mut buf, u64::from(loc.offset)).is_err() {
                return false;
            }
            let Ok(payload) = open_record(&buf, *id, loc, crypto, fp, String::new) else {
                return false;
            };
            let mut out = vec![0u8; block_size as usize];
            reduction::decompress(loc.codec, &payload, &mut out, String::new).is_ok()
        }
        _ => true,
    })
}

/// An S3 pool keeps its journal in the local directory `local`. If it is not there: the
/// bucket's copy (the empty first generation `init` wrote), else, on a new host or after a
/// lost local disk with `local` durability, an empty journal: the pool is as of the last
/// checkpoint uploaded.
fn local_journal(
    bucket: &dyn Dir,
    local: &dyn Dir,
    root: &Root,
    sb: &Superblock,
    crypto: Option<Arc<Crypto>>,
) -> Result<()> {
    let jname = journal_name(root.journal_gen);
    let io = |e| {
        Error::io(
            format!("restoring journal {jname} in {}", local.describe()),
            e,
        )
    };
    if local.exists(&jname).map_err(io)? {
        return Ok(());
    }
    if bucket.exists(&jname).map_err(io)? {
        let bytes = read_whole(bucket, &jname)?;
        let f = local.open(&jname, true).map_err(io)?;
        f.write_at(&bytes, 0).and_then(|_| f.sync()).map_err(io)?;
    } else {
        tracing::warn!(
            "journal {jname} is not in {} (a new host, or a lost local disk): the pool opens as of its last checkpoint in {}: all of it after a clean stop; with local durability, writes after that checkpoint are lost",
            local.describe(),
            bucket.describe()
        );
        Journal::create(local, root.journal_gen, &sb.uuid, root.next_seq, crypto)?
            .file
            .sync()
            .map_err(io)?;
    }
    local.sync_dir().map_err(io)
}

/// What the pool's `cache.conf` says (`None`: no cache attached).
pub(crate) fn read_cache_conf(dir: &dyn Dir) -> Result<Option<CacheConf>> {
    if !dir
        .exists(CACHE_CONF_NAME)
        .map_err(|e| Error::io(format!("reading {CACHE_CONF_NAME}"), e))?
    {
        return Ok(None);
    }
    CacheConf::decode(&read_whole(dir, CACHE_CONF_NAME)?).map(Some)
}

/// The cache directory `cache.conf` names, if it is a readable directory.
pub(crate) fn stored_cache_dir(dir: &RealDir) -> Option<CacheDir> {
    let conf = read_cache_conf(dir).ok().flatten()?;
    let path = std::path::Path::new(&conf.path);
    std::fs::read_dir(path).ok()?;
    Some(CacheDir(Arc::new(RealDir::new(path))))
}

pub(crate) fn read_whole(dir: &dyn Dir, name: &str) -> Result<Vec<u8>> {
    let f = dir
        .open(name, false)
        .map_err(|e| Error::io(format!("opening {name}"), e))?;
    let len = f
        .len()
        .map_err(|e| Error::io(format!("reading {name}"), e))?;
    let mut buf = vec![0u8; len as usize];
    f.read_at(&mut buf, 0)
        .map_err(|e| Error::io(format!("reading {name}"), e))?;
    Ok(buf)
}
