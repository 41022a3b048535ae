//! Creating a pool and opening one: superblock, crypto, segment discovery across the pool
//! and writeback directories, metadata from the checkpoint root, journal replay (with
//! salvage), leftovers of interrupted work, and the cache tier attached at open.

use crate::cache_tier::{writeback_split, CacheMode};
use crate::crypto::{self, Crypto, NonceScheme};
use crate::error::{Error, Result};
use crate::format::*;
use crate::io::{Dir, RealDir};
use crate::journal::{Journal, ReplayMode};
use crate::metadata::{Metadata, VolumeState};
use crate::page_alloc::PageAlloc;
use crate::page_cache::{PageCache, Ptr, TreeInfo, CHUNK_TREE};
use crate::segment::Segments;
use crate::staging::Staging;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};

use super::cache_tier::{read_cache_conf, stored_cache_dir};
use super::{
    default_metadata_cache_bytes, random_bytes, read_whole, CacheDir, InitOptions, OpenOptions,
    Pool, State, METADATA_CACHE_MIN, SPACE_CHECK_BYTES,
};

impl Pool {
    /// Create a new pool in the directory `path` (created if missing, owner-only; must hold
    /// no pool).
    pub fn init_path(path: &Path, opts: &InitOptions) -> Result<()> {
        let dir_existed = path.exists();
        let lock_path = path.join(LOCK_NAME);
        let lock_existed = lock_path.exists();
        crate::io::create_private_dir(path)
            .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
        let dir = RealDir::new(path);
        let lock = dir
            .lock(LOCK_NAME)
            .map_err(|e| Error::io(format!("locking {}", path.display()), e))?
            .ok_or_else(|| Error::Locked(path.to_path_buf()))?;
        let made = Pool::init(&dir, opts);
        if made.is_err() {
            // A refused init (a short passphrase, a bad option) leaves nothing behind: the
            // lock file and the directory go again if this call made them. `remove_dir`
            // removes only an empty directory, so nothing else is ever deleted.
            drop(lock);
            if !lock_existed {
                let _ = std::fs::remove_file(&lock_path);
            }
            if !dir_existed {
                let _ = std::fs::remove_dir(path);
            }
        }
        made
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
            if !Compression::zstd_level_ok(l) {
                return Err(Error::Invalid(format!(
                    "zstd level {l} must be 1 to 22, or -1 to -7 (zstd's fast levels)"
                )));
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
            durability: dir.durability(),
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
        Pool::write_new_pool(dir, &sb, crypto)
    }

    /// The files of a new, empty pool with superblock `sb` (sealed with `crypto` in an
    /// encrypted pool): the first journal, `meta.dat`, the root, and the superblock last.
    fn write_new_pool(dir: &dyn Dir, sb: &Superblock, crypto: Option<Arc<Crypto>>) -> Result<()> {
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
    fn open_remote(path: &Path, opts: OpenOptions) -> Result<Arc<Pool>> {
        let pool = Pool::open_remote_tree(path, opts)?;
        // Chunks of this tree may live in other hosts' segments: read them from the start.
        if let Err(e) = pool.attach_peers() {
            tracing::warn!(
                "pool {}: the other hosts' trees could not be read ({e}); chunks stored by \
                 them fail to read until `condense hosts sync` succeeds",
                pool.dir.describe()
            );
        }
        Ok(pool)
    }

    /// The metadata page cache of another host's part open read-only (a fold or a clone walks
    /// its chunk table: with 16 MiB, a clone of a 1.3 GB volume decoded pages again and again).
    const PEER_METADATA_CACHE: u64 = 64 << 20;

    /// Open one host's tree of an S3 pool read-only, from the local directory `path` made
    /// for it, with the key `key` (an encrypted pool's): a peer of [`crate::hosts`], whose
    /// own peers are not opened.
    pub(crate) fn open_peer(path: &Path, key: Option<crate::crypto::UserKey>) -> Result<Arc<Pool>> {
        let opts = OpenOptions {
            read_only: true,
            key,
            // Folds and clones walk its chunk table and block maps: room for their pages.
            metadata_cache_bytes: Some(Pool::PEER_METADATA_CACHE),
            ..OpenOptions::default()
        };
        Pool::open_remote_tree(path, opts)
    }

    /// [`Pool::open_remote`] without the other hosts' trees.
    fn open_remote_tree(path: &Path, mut opts: OpenOptions) -> Result<Arc<Pool>> {
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
        opened
            .after
            .finish(pool.sb.durability, |d| pool.store_durability(d))?;
        Ok(pool)
    }

    /// Create a new pool in an object store ([`crate::remote::init`] sets up the local
    /// directory `path` and the bucket side); its durability is `durability`.
    pub fn init_remote(
        path: &Path,
        conf: &crate::remote::RemoteConf,
        durability: crate::format::Durability,
        cache_size: u64,
        opts: &InitOptions,
    ) -> Result<()> {
        let dir = crate::remote::init(path, conf, durability, cache_size)?;
        // Pool::init stores the directory's durability in the superblock.
        Pool::init(&dir, opts)
    }

    /// Join the pool in a bucket as a new host (docs/S3.md "Many hosts"): register a slot, and
    /// create this host's tree under it with the pool's superblock (its identity, settings and
    /// durability; `key` unlocks an encrypted pool) and the local directory `path`, with the
    /// first host's dedup index setting. `conf` names the pool (its first host's URL).
    /// Returns the slot and the tree's URL.
    pub fn join_remote(
        path: &Path,
        conf: &crate::remote::RemoteConf,
        cache_size: u64,
        host: &str,
        key: Option<&crate::crypto::UserKey>,
    ) -> Result<(u8, String)> {
        let sb_bytes = crate::remote::stored_file(conf, SUPERBLOCK_NAME)?
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "{} holds no Condense pool to join: create one with `condense init {} \
                     --cache DIR --cache-size SIZE`",
                    conf.url, conf.url
                ))
            })?
            .1;
        let mut sb = Superblock::decode(&sb_bytes)?;
        // Check the key before anything is written: a wrong key joins nothing.
        sb.unlock(&sb_bytes, key, false, &conf.url)?;
        let (pool_url, _) = crate::remote::split_member_url(&conf.url);
        let pool_conf = crate::remote::RemoteConf {
            url: pool_url.clone(),
            ..conf.clone()
        };
        let slot = crate::remote::join(&pool_conf, host)?;
        let member = crate::remote::RemoteConf {
            url: crate::remote::member_url(&pool_url, slot),
            ..pool_conf
        };
        let durability = sb.durability.unwrap_or_default();
        let dir = crate::remote::init(path, &member, durability, cache_size)?;
        let crypto = sb.unlock(&sb_bytes, key, true, &member.url)?;
        Pool::write_new_pool(&dir, &sb, crypto)?;
        drop(dir); // its lease: the open below takes it again
        Pool::take_index_setting(path, key)?;
        Ok((slot, member.url))
    }

    /// Open the pool in `dir` (no lock file: for the simulator and tests).
    pub fn open(dir: Arc<dyn Dir>, opts: OpenOptions) -> Result<Arc<Pool>> {
        Pool::open_with_lock(dir, opts, None)
    }

    /// Open the pool in `dir`, whose lock (if any) the caller took: the steps below, in
    /// order; nothing is written before the superblock's MAC and the root are checked, and a
    /// read-only open writes nothing.
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
        let sb_copies = read_superblock(&dir, &opts)?;
        let (sb, crypto) = sb_copies.value.clone();
        let sync_writes = match sb.write_policy {
            WritePolicy::Sync => true,
            WritePolicy::Async => false,
            // Async when the directory honours flushes (a directory fsync succeeds).
            WritePolicy::Auto => dir.sync_dir().is_err(),
        };
        // Storage layers, composed: the writeback staging layer over the pool directory.
        let (upper, budget) = writeback_staging(&*dir, &opts)?;
        let writeback = upper.is_some();
        let staging = Arc::new(
            Staging::compose(dir, upper, budget)
                .map_err(|e| Error::io("finding the files held in the cache directory", e))?,
        );
        let dir: Arc<dyn Dir> = staging.clone();

        // The checkpoint root: the newest valid of its two copies.
        let root_copies = crate::copies::read_both(
            &*dir,
            CHECKPOINT_NAME,
            |bytes| decode_root(bytes, &sb.uuid, crypto.as_deref()),
            |a, b| (a.journal_gen, a.next_seq) > (b.journal_gen, b.next_seq),
        )?;
        let root = &root_copies.value;
        let mut notes = Vec::new();
        let meta_file = open_meta_file(&*dir, &sb, opts.read_only, &mut notes)?;
        let segments = find_segments(&dir, &sb)?;
        let mut md = load_metadata(&sb, root, meta_file, crypto.clone(), &opts);
        md.spill.dir = Some(dir.clone());
        if let Some((page_words, pages)) = opts.attribution_pages {
            md.spill.page_words = page_words;
            md.spill.pages = pages;
        }
        if !opts.read_only {
            let dir = super::saved_index::index_dir(&dir, &opts);
            md.saved_index =
                super::saved_index::find(dir, sb.uuid, &md, root.journal_gen, root.next_seq);
        }
        let (journal, mut replay) =
            replay_journal(&dir, root, &sb, crypto.clone(), &opts, &mut md, &segments)?;
        let state = State {
            md,
            segments,
            journal,
            appended: 0,
            durable: 0,
            poisoned: None,
            written_since_space_check: SPACE_CHECK_BYTES,
            checkpointed: 0,
            journal_flush_at: opts.journal_bytes_max,
            sketch: None,
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
            remove_leftovers(&dir, &staging, state.journal.gen)?;
        }

        let pool = Pool::assemble(dir, sb, crypto, sync_writes, opts, state, replay, lock_file);
        // An S3 pool's cache is its local directory, which a read-only open (export, a
        // reader host) may use too: every read of the bucket costs a request.
        if !pool.read_only || pool.dir.reads_cost_requests() {
            pool.open_attached_cache();
        }
        if !pool.read_only && writeback && pool.opts.destage_in_background {
            pool.start_destager();
        }
        pool.start_releaser();
        Ok(pool)
    }

    /// The pool, from what open found.
    #[expect(clippy::too_many_arguments, reason = "the parts open found, each once")]
    fn assemble(
        dir: Arc<dyn Dir>,
        sb: Superblock,
        crypto: Option<Arc<Crypto>>,
        sync_writes: bool,
        opts: OpenOptions,
        state: State,
        replay: crate::journal::ReplayReport,
        lock_file: Option<std::fs::File>,
    ) -> Arc<Pool> {
        let slot = dir.segment_slot();
        let deltas_on = state.md.meta.contains_key(super::delta::DELTA_MODE_KEY);
        Arc::new_cyclic(|me| Pool {
            slot,
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
            volume_io: Default::default(),
            me: me.clone(),
            read_errors: AtomicU64::new(0),
            lost_reads_zeros: std::sync::atomic::AtomicBool::new(false),
            lost_read_as_zeros: AtomicU64::new(0),
            scrub: Default::default(),
            writes_in_flight: Default::default(),
            reads_in_flight: Default::default(),
            space_low: Default::default(),
            spread_writes: std::sync::atomic::AtomicBool::new(true),
            journal_full: Default::default(),
            deltas_on: std::sync::atomic::AtomicBool::new(deltas_on),
            counters: Default::default(),
            replay,
            tier: RwLock::new(None),
            read_ahead: Default::default(),
            read_buffers: Default::default(),
            destager: Mutex::new(None),
            release_lock: Mutex::new(()),
            releaser: Mutex::new(None),
            index_builder: Mutex::new(None),
            peers: Mutex::new(Default::default()),
            deleted_names: Mutex::new(Default::default()),
            handover_stop: Default::default(),
            _lock_file: lock_file,
        })
    }
}

/// Open step 1: the superblock, its primary copy if valid (and authentic), else its copy,
/// with the pool's encryption context.
fn read_superblock(
    dir: &Arc<dyn Dir>,
    opts: &OpenOptions,
) -> Result<crate::copies::Chosen<(Superblock, Option<Arc<Crypto>>)>> {
    crate::copies::read_both(
        &**dir,
        SUPERBLOCK_NAME,
        |bytes| {
            let mut sb = Superblock::decode(bytes)?;
            let crypto = sb.unlock(bytes, opts.key.as_ref(), !opts.read_only, &dir.describe())?;
            Ok((sb, crypto))
        },
        |_, _| false,
    )
    .map_err(|e| match e {
        Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            Error::NotAPool(dir.describe().into())
        }
        e => e,
    })
}

/// Open step 2: a writeback cache holds segments and the journal, so its directory is part
/// of the pool (the staging layer's upper directory); with the bytes of segments it may
/// hold (0 for a read-only open).
fn writeback_staging(dir: &dyn Dir, opts: &OpenOptions) -> Result<(Option<Arc<dyn Dir>>, u64)> {
    let conf = read_cache_conf(dir);
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
    Ok((staging, staging_max))
}

/// Open step 3: `meta.dat`, its header checked against the superblock. A damaged header is
/// rebuilt from the superblock (every field of it is known; the pages check themselves by
/// the CRCs in the root and the interior pages), in place unless the open is read-only.
fn open_meta_file(
    dir: &dyn Dir,
    sb: &Superblock,
    read_only: bool,
    notes: &mut Vec<String>,
) -> Result<Arc<dyn crate::io::File>> {
    let meta_file = dir
        .open(META_NAME, false)
        .map_err(|e| Error::io(format!("opening {META_NAME}"), e))?;
    let mut header = vec![0u8; 64];
    meta_file
        .read_at(&mut header, 0)
        .map_err(|e| Error::io(format!("reading {META_NAME}"), e))?;
    if crate::format::header_intact(&header) {
        decode_meta_header(&header, &sb.uuid)?;
        return Ok(meta_file);
    }
    notes.push(format!(
        "the header of {META_NAME} was damaged; rebuilt from the superblock"
    ));
    if !read_only {
        meta_file
            .write_at(&encode_meta_header(&sb.uuid), 0)
            .and_then(|_| meta_file.sync())
            .map_err(|e| Error::io(format!("rewriting the header of {META_NAME}"), e))?;
    }
    Ok(meta_file)
}

/// Open step 4: every segment of the pool (the staging layer lists the held ones too).
fn find_segments(dir: &Arc<dyn Dir>, sb: &Superblock) -> Result<Segments> {
    let mut segments = Segments::new(sb.segment_bytes_target, sb.uuid);
    segments.set_slot(dir.segment_slot());
    for name in dir
        .list(SEGMENT_PREFIX)
        .map_err(|e| Error::io(format!("listing segments in {}", dir.describe()), e))?
    {
        let Some(id) = parse_segment_name(&name) else {
            continue;
        };
        let file = dir
            .open(&name, false)
            .map_err(|e| Error::io(format!("opening {name} in {}", dir.describe()), e))?;
        let len = file
            .len()
            .map_err(|e| Error::io(format!("reading {name} in {}", dir.describe()), e))?;
        segments.add_existing(id, file, len);
    }
    Ok(segments)
}

/// Open step 5: the metadata stores as of the checkpoint root, behind a page cache of the
/// configured budget.
fn load_metadata(
    sb: &Superblock,
    root: &Root,
    meta_file: Arc<dyn crate::io::File>,
    crypto: Option<Arc<Crypto>>,
    opts: &OpenOptions,
) -> Metadata {
    let budget = opts
        .metadata_cache_bytes
        .or((sb.metadata_cache_bytes > 0).then_some(sb.metadata_cache_bytes))
        .unwrap_or_else(default_metadata_cache_bytes);
    let trees: BTreeMap<u64, TreeInfo> = root
        .trees
        .iter()
        .map(|t| {
            let root = Ptr {
                page: t.page,
                crc: t.crc,
                units: t.units,
                codec: t.codec,
            };
            (
                t.id,
                TreeInfo {
                    height: t.height,
                    root,
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
    if let Some(c) = crypto {
        cache.set_crypto(c);
    }
    let mut md = Metadata {
        block_size: sb.block_size,
        volumes: BTreeMap::new(),
        names: HashMap::new(),
        next_vol: root.next_vol,
        pages: cache,
        chunks: crate::chunk_table::ChunkTable {
            next_id: root.next_chunk,
            live_bytes: root.segment_live.iter().copied().collect(),
            live_chunks: root.live_chunks,
            live_stored_bytes: root.live_stored_bytes,
            forwards: root.forwards,
            deltas: root.deltas,
        },
        index: Default::default(),
        saved_index: None,
        index_origin: Default::default(),
        meta: root.meta.iter().cloned().collect(),
        meta_bytes_written_before: root.meta_bytes_written,
        checkpoints: root.checkpoints,
        attribution: None,
        counting: None,
        released_figures: Default::default(),
        spill: Default::default(),
        to_free: Vec::new(),
        index_build: None,
        index_load: None,
        releasing: releasing_of(root),
    };
    for v in &root.volumes {
        let counts = crate::block_map::MapCounts {
            data_blocks: v.data_blocks,
            zero_blocks: v.zero_blocks,
        };
        let state = VolumeState {
            name: v.name.clone(),
            size: v.size,
            counts,
            snapshot_of: v.snapshot_of,
            created: v.created,
        };
        md.volumes.insert(v.id, state);
        md.names.insert(v.name.clone(), v.id);
    }
    md.pages
        .set_shared_pages(root.shared_pages.iter().copied().collect());
    if opts.read_only {
        md.pages.set_read_only();
    }
    md
}

/// The maps being released in the background, as the root lists them.
fn releasing_of(root: &Root) -> BTreeMap<u64, crate::metadata::Releasing> {
    root.releasing
        .iter()
        .map(|r| {
            let x = crate::metadata::Releasing {
                name: r.name.clone(),
                end: r.end,
                next: r.next,
                data_blocks: r.data_blocks,
            };
            (r.tree, x)
        })
        .collect()
}

/// Open step 6: the journal generation the root names, replayed into `md`; each batch only
/// if the chunks it introduces are on disk (a salvage replay also past damage, through
/// [`super::salvage::apply_after_damage`]). Returns the journal and what replay found.
fn replay_journal(
    dir: &Arc<dyn Dir>,
    root: &Root,
    sb: &Superblock,
    crypto: Option<Arc<Crypto>>,
    opts: &OpenOptions,
    md: &mut Metadata,
    segments: &Segments,
) -> Result<(Journal, crate::journal::ReplayReport)> {
    let block_size = sb.block_size;
    let mut salvage = crate::journal::Salvage::default();
    let jname = journal_name(root.journal_gen);
    if dir.whole_files_only() {
        local_journal(&**dir, root, sb, crypto.clone(), opts.read_only)?;
    }
    if opts.without_writeback_cache
        && !opts.read_only
        && !dir
            .exists(&jname)
            .map_err(|e| Error::io("looking for the journal", e))?
    {
        // It was on the lost cache device: the changes since the checkpoint are gone.
        tracing::warn!("journal {jname} was in the lost writeback cache; starting an empty one");
        Journal::create(
            &**dir,
            root.journal_gen,
            &sb.uuid,
            root.next_seq,
            crypto.clone(),
        )?
        .file
        .sync()
        .and_then(|_| dir.sync_dir())
        .map_err(|e| Error::io(format!("creating {jname}"), e))?;
    }
    let mode = match (opts.salvage_journal, opts.read_only) {
        (true, _) => ReplayMode::Salvage,
        (false, true) => ReplayMode::ReadOnly,
        (false, false) => ReplayMode::Writable,
    };
    let (journal, mut replay) = Journal::replay(
        &**dir,
        root.journal_gen,
        &sb.uuid,
        root.next_seq,
        mode,
        crypto.clone(),
        |records, after_damage| {
            if !after_damage
                && !segments.batch_data_present(&records, block_size, crypto.as_deref())
            {
                return Ok(false);
            }
            if opts.salvage_journal {
                super::salvage::apply_after_damage(
                    md,
                    segments,
                    crypto.as_deref(),
                    records,
                    after_damage,
                    &mut salvage,
                )?;
                return Ok(true);
            }
            for r in &records {
                md.apply(r)?;
            }
            md.pages.evict_to_budget()?;
            Ok(true)
        },
    )?;
    replay.salvage = salvage;
    Ok((journal, replay))
}

/// Open step 7 (writable opens): leftovers of interrupted checkpoints (other journal
/// generations, temp files) and of interrupted destages (a partial copy, or a held copy
/// already moved down).
fn remove_leftovers(dir: &Arc<dyn Dir>, staging: &Staging, journal_gen: u64) -> Result<()> {
    for name in dir
        .list(JOURNAL_PREFIX)
        .map_err(|e| Error::io("listing journals", e))?
    {
        if parse_journal_name(&name).is_some_and(|g| g != journal_gen) {
            dir.remove(&name)
                .map_err(|e| Error::io(format!("removing {name}"), e))?;
        }
    }
    for name in dir
        .list(SEGMENT_PREFIX)
        .map_err(|e| Error::io("listing segments", e))?
    {
        if name.ends_with(crate::format::PARTIAL_SUFFIX) {
            dir.remove(&name)
                .map_err(|e| Error::io(format!("removing {name}"), e))?;
        }
    }
    staging
        .remove_shadowed()
        .map_err(|e| Error::io("removing segments already moved out of the cache", e))?;
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
    Ok(())
}

/// An S3 pool keeps its journal in its local directory (held by the staging layer). If it
/// is not there: the bucket's copy (the empty first generation `init` wrote), else, on a new
/// host or after a lost local disk with `local` durability, an empty journal: the pool is
/// as of the last checkpoint uploaded.
fn local_journal(
    dir: &dyn Dir,
    root: &Root,
    sb: &Superblock,
    crypto: Option<Arc<Crypto>>,
    read_only: bool,
) -> Result<()> {
    let jname = journal_name(root.journal_gen);
    let io = |e| {
        Error::io(
            format!("restoring journal {jname} in the local directory"),
            e,
        )
    };
    if dir.held().map_err(io)?.iter().any(|(n, _)| *n == jname) {
        return Ok(());
    }
    // Not held: `exists` and `read_whole` ask the bucket; `open(.., true)` creates the held copy.
    if dir.exists(&jname).map_err(io)? {
        let bytes = read_whole(dir, &jname)?;
        let f = dir.open(&jname, true).map_err(io)?;
        f.write_at(&bytes, 0).and_then(|_| f.sync()).map_err(io)?;
    } else if read_only {
        // A reader (another host's part, `connect --read-only`): always as of the last upload.
        tracing::debug!(
            "journal {jname}: none here; {} opens as of its last checkpoint",
            dir.describe()
        );
        Journal::create(dir, root.journal_gen, &sb.uuid, root.next_seq, crypto)?
            .file
            .sync()
            .map_err(io)?;
    } else {
        tracing::warn!(
            "journal {jname} is not in the local directory (a new host, or a lost local disk): the pool opens as of its last checkpoint in {}: all of it after a clean stop; with local durability, writes after that checkpoint are lost",
            dir.describe()
        );
        Journal::create(dir, root.journal_gen, &sb.uuid, root.next_seq, crypto)?
            .file
            .sync()
            .map_err(io)?;
    }
    dir.sync_dir().map_err(io)
}
