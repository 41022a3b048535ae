//! The pool: volumes, the write and read paths, flush, open and recovery.
//!
//! Owns: the in-memory state (block maps, chunk table, dedup index, metadata records) behind
//! one mutex, the journal, and the segment store. Every change to the state is a
//! [`JournalRecord`] applied by [`apply`] — live and during replay alike — and appended to the
//! journal in the same critical section, so the journal order is the apply order.
//!
//! Locks, always taken in this order: a volume's write lock (held by read-modify-write of
//! partial blocks, zeroing, resize and delete; whole-block writes go without it), then
//! `sync_lock` (one flush or checkpoint at a time), then `state`. CPU-heavy work (hashing, compression, decompression) and data
//! reads run without `state`.
//!
//! Durability: a flush (1) writes the journal's buffered records as a batch, (2) syncs every
//! segment written since the last flush and the directory if segments were created, then (3)
//! syncs the journal. Replay checks that every chunk a batch introduces is on disk and stops at
//! the first batch whose data is missing, so a batch written before its data was synced can
//! never surface garbage.

use crate::block_map::BlockMap;
use crate::chunk_table::ChunkTable;
use crate::dedup_index::DedupIndex;
use crate::error::{Error, Result};
use crate::format::*;
use crate::io::{Dir, RealDir};
use crate::journal::{Journal, ReplayReport};
use crate::reduction;
use crate::segment::Segments;
use rayon::prelude::*;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// Settings fixed when a pool is created.
#[derive(Clone, Debug)]
pub struct InitOptions {
    pub block_size: u32,
    pub compression: Compression,
    pub write_policy: WritePolicy,
    pub segment_bytes_target: u64,
    /// The metadata page-cache budget stored in the pool (`None`: [`default_metadata_cache_bytes`]).
    pub metadata_cache_bytes: Option<u64>,
}

/// The default metadata page-cache budget: 256 MiB or 5 % of RAM, whichever is smaller.
pub fn default_metadata_cache_bytes() -> u64 {
    let ram = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|k| k.parse::<u64>().ok()))
        })
        .map(|kib| kib * 1024);
    match ram {
        Some(r) => (r / 20).min(256 << 20).max(METADATA_CACHE_MIN),
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
    /// Metadata page-cache budget for this open (`None`: the pool's stored setting).
    pub metadata_cache_bytes: Option<u64>,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            read_only: false,
            journal_bytes_max: 64 << 20,
            journal_buffer_bytes: 1 << 20,
            reserve_bytes: 32 << 20,
            metadata_cache_bytes: None,
        }
    }
}

/// Writes at or above this many references to one chunk store a new copy instead.
const REFS_MAX: u32 = u32::MAX / 2;
/// Re-check free disk space after this many bytes written.
const SPACE_CHECK_BYTES: u64 = 16 << 20;

pub(crate) struct VolumeState {
    pub name: String,
    pub size: u64,
    pub map: BlockMap,
    /// Its block map could not be read from the checkpoint: reads fail, writes are refused.
    /// Holds the damaged section's bytes, which later checkpoints carry over verbatim so the
    /// damage is never silently turned into an empty volume.
    pub damaged: Option<Vec<u8>>,
}

pub(crate) struct State {
    pub block_size: u32,
    pub volumes: BTreeMap<u32, VolumeState>,
    pub names: HashMap<String, u32>,
    pub next_vol: u32,
    pub chunks: ChunkTable,
    pub index: DedupIndex,
    pub meta: BTreeMap<String, Vec<u8>>,
    pub segments: Segments,
    pub journal: Journal,
    /// Records appended so far / made durable so far (counts, for group commit).
    pub appended: u64,
    pub durable: u64,
    pub poisoned: Option<String>,
    /// Problems found while opening (damaged checkpoint sections), for `verify`.
    pub open_problems: Vec<String>,
    pub written_since_space_check: u64,
}

impl State {
    /// Volume `vol`, checked to exist, to have a readable block map, and to hold blocks
    /// `[first, first + count)`.
    pub(crate) fn volume_for(
        &self,
        vol: u32,
        name: &str,
        op: &'static str,
        first: u64,
        count: u64,
    ) -> Result<&VolumeState> {
        let v = self
            .volumes
            .get(&vol)
            .ok_or_else(|| Error::NotFound(name.to_string()))?;
        if v.damaged.is_some() {
            return Err(Error::corrupt(
                format!("volume {name:?}"),
                "its block map is damaged (see `condense verify`)",
            ));
        }
        let bs = u64::from(self.block_size);
        let end = first.checked_add(count).and_then(|e| e.checked_mul(bs));
        if end.is_none_or(|e| e > v.size) {
            return Err(Error::OutOfRange {
                op,
                volume: name.to_string(),
                offset: first.saturating_mul(bs),
                len: count.saturating_mul(bs),
                size: v.size,
            });
        }
        Ok(v)
    }
}

/// An open pool. Always held in an `Arc` (volumes keep a reference to it).
pub struct Pool {
    pub(crate) dir: Arc<dyn Dir>,
    pub(crate) sb: Superblock,
    pub(crate) sync_writes: bool,
    pub(crate) read_only: bool,
    pub(crate) opts: OpenOptions,
    pub(crate) state: Mutex<State>,
    pub(crate) sync_lock: Mutex<()>,
    vol_locks: Mutex<HashMap<u32, Arc<Mutex<()>>>>,
    pub(crate) me: Weak<Pool>,
    pub(crate) read_errors: AtomicU64,
    pub(crate) replay: ReplayReport,
    _lock_file: Option<std::fs::File>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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

fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b)
        .map_err(|e| Error::io("reading random bytes", std::io::Error::other(e.to_string())))?;
    Ok(b)
}

impl Pool {
    // -----------------------------------------------------------------------------------------
    // Create and open.

    /// Create a new pool in the directory `path` (created if missing; must hold no pool).
    pub fn init_path(path: &Path, opts: &InitOptions) -> Result<()> {
        std::fs::create_dir_all(path)
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
        if dir
            .exists(SUPERBLOCK_NAME)
            .map_err(|e| Error::io("checking for a superblock", e))?
        {
            return Err(Error::Invalid(format!(
                "{} already holds a Condense pool",
                dir.describe()
            )));
        }
        let sb = Superblock {
            block_size: opts.block_size,
            compression: opts.compression,
            write_policy: opts.write_policy,
            uuid: random_bytes()?,
            key: random_bytes()?,
            segment_bytes_target: opts.segment_bytes_target,
        };
        let journal = Journal::create(dir, 1, &sb.uuid, 0)?;
        journal
            .file
            .sync()
            .map_err(|e| Error::io("syncing the journal", e))?;
        let mut ck = Vec::new();
        let header = CheckpointHeader {
            journal_gen: 1,
            next_seq: 0,
            sections: 0,
        };
        ck.extend_from_slice(&encode_checkpoint_header(&header, &sb.uuid));
        write_file_atomically(dir, CHECKPOINT_NAME, &ck)?;
        // The superblock goes last: a directory without one is not a pool, so a crash during
        // init leaves nothing that looks like a half-made pool.
        write_file_atomically(dir, SUPERBLOCK_NAME, &sb.encode())?;
        Ok(())
    }

    /// Open the pool in directory `path`, taking its lock.
    pub fn open_path(path: &Path, opts: OpenOptions) -> Result<Arc<Pool>> {
        let dir = RealDir::new(path);
        if !dir
            .exists(SUPERBLOCK_NAME)
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?
        {
            return Err(Error::NotAPool(path.to_path_buf()));
        }
        let lock = dir
            .lock(LOCK_NAME)
            .map_err(|e| Error::io(format!("locking {}", path.display()), e))?
            .ok_or_else(|| Error::Locked(path.to_path_buf()))?;
        Pool::open_with_lock(Arc::new(dir), opts, Some(lock))
    }

    /// Open the pool in `dir` (no lock file: for the simulator and tests).
    pub fn open(dir: Arc<dyn Dir>, opts: OpenOptions) -> Result<Arc<Pool>> {
        Pool::open_with_lock(dir, opts, None)
    }

    fn open_with_lock(
        dir: Arc<dyn Dir>,
        opts: OpenOptions,
        lock_file: Option<std::fs::File>,
    ) -> Result<Arc<Pool>> {
        let sb_bytes = read_whole(&*dir, SUPERBLOCK_NAME).map_err(|e| match e {
            Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                Error::NotAPool(dir.describe().into())
            }
            e => e,
        })?;
        let sb = Superblock::decode(&sb_bytes)?;
        let sync_writes = match sb.write_policy {
            WritePolicy::Sync => true,
            WritePolicy::Async => false,
            // Async when the directory honours flushes (a directory fsync succeeds).
            WritePolicy::Auto => dir.sync_dir().is_err(),
        };

        let ck_bytes = read_whole(&*dir, CHECKPOINT_NAME)?;
        let ck = crate::checkpoint::load(&ck_bytes, &sb)?;

        let mut segments = Segments::new(sb.segment_bytes_target, sb.uuid);
        for name in dir
            .list(SEGMENT_PREFIX)
            .map_err(|e| Error::io("listing segments", e))?
        {
            let Some(id) = parse_segment_name(&name) else {
                continue;
            };
            let file = dir
                .open(&name, false)
                .map_err(|e| Error::io(format!("opening {name}"), e))?;
            let len = file
                .len()
                .map_err(|e| Error::io(format!("reading {name}"), e))?;
            segments.add_existing(id, file, len);
        }

        let placeholder = Journal::placeholder();
        let mut state = State {
            block_size: sb.block_size,
            volumes: ck.volumes,
            names: HashMap::new(),
            next_vol: ck.next_vol,
            chunks: ck.chunks,
            index: DedupIndex::default(),
            meta: ck.meta,
            segments,
            journal: placeholder,
            appended: 0,
            durable: 0,
            poisoned: None,
            open_problems: ck.problems,
            written_since_space_check: SPACE_CHECK_BYTES,
        };
        for (&id, v) in &state.volumes {
            state.names.insert(v.name.clone(), id);
        }

        let block_size = sb.block_size;
        let (journal, replay) = Journal::replay(
            &*dir,
            ck.journal_gen,
            &sb.uuid,
            ck.next_seq,
            opts.read_only,
            |records| {
                if !batch_data_present(&state, &records, block_size) {
                    return Ok(false);
                }
                for r in &records {
                    apply(&mut state, r)?;
                }
                Ok(true)
            },
        )?;
        state.journal = journal;
        state.chunks.rebuild_free_list();
        let mut index = DedupIndex::default();
        for (id, e) in state.chunks.iter() {
            if e.location().is_some() {
                index.insert(&e.fp, id, &state.chunks);
            }
        }
        state.index = index;

        if !opts.read_only {
            // Leftovers of interrupted checkpoints: other journal generations, a temp file.
            for name in dir
                .list(JOURNAL_PREFIX)
                .map_err(|e| Error::io("listing journals", e))?
            {
                if parse_journal_name(&name).is_some_and(|g| g != state.journal.gen) {
                    dir.remove(&name)
                        .map_err(|e| Error::io(format!("removing {name}"), e))?;
                }
            }
            if dir
                .exists(CHECKPOINT_TMP_NAME)
                .map_err(|e| Error::io("listing", e))?
            {
                dir.remove(CHECKPOINT_TMP_NAME)
                    .map_err(|e| Error::io("removing checkpoint.tmp", e))?;
            }
        }

        let pool = Arc::new_cyclic(|me| Pool {
            dir,
            sb,
            sync_writes,
            read_only: opts.read_only,
            opts,
            state: Mutex::new(state),
            sync_lock: Mutex::new(()),
            vol_locks: Mutex::new(HashMap::new()),
            me: me.clone(),
            read_errors: AtomicU64::new(0),
            replay,
            _lock_file: lock_file,
        });
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
            return Ok(());
        }
        self.flush()?;
        let guard = lock(&self.sync_lock);
        self.checkpoint_locked(&guard)
    }

    // -----------------------------------------------------------------------------------------
    // Volumes.

    pub(crate) fn writable(&self, st: &State) -> Result<()> {
        if self.read_only {
            return Err(Error::ReadOnly);
        }
        if let Some(p) = &st.poisoned {
            return Err(Error::Poisoned(p.clone()));
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
        check_volume_name(name)?;
        self.check_size(size)?;
        let mut st = lock(&self.state);
        self.writable(&st)?;
        if st.names.contains_key(name) {
            return Err(Error::AlreadyExists(name.to_string()));
        }
        let vol = st.next_vol;
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
            .names
            .get(name)
            .ok_or_else(|| Error::NotFound(name.to_string()))?;
        self.commit(&mut st, vec![JournalRecord::VolumeDelete { vol }])?;
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
            .names
            .get(name)
            .ok_or_else(|| Error::NotFound(name.to_string()))?;
        let v = st.volume_for(vol, name, "resize", 0, 0)?;
        let first_cut = size / u64::from(self.sb.block_size);
        if let Some((block, _)) = v.map.iter_from(first_cut).next() {
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

    /// Names and sizes of all volumes, sorted by name.
    pub fn volumes(&self) -> Vec<(String, u64)> {
        let st = lock(&self.state);
        let mut v: Vec<_> = st
            .volumes
            .values()
            .map(|v| (v.name.clone(), v.size))
            .collect();
        v.sort();
        v
    }

    pub fn volume_id(&self, name: &str) -> Result<u32> {
        lock(&self.state)
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
        let vol = self.volume_id(name)?;
        let pool = self
            .me
            .upgrade()
            .ok_or_else(|| Error::Invalid("pool is closing".into()))?;
        Ok(crate::volume::VolumeHandle::new(
            pool,
            vol,
            name.to_string(),
        ))
    }

    pub(crate) fn volume_size(&self, vol: u32, name: &str) -> Result<u64> {
        let st = lock(&self.state);
        st.volumes
            .get(&vol)
            .map(|v| v.size)
            .ok_or_else(|| Error::NotFound(name.to_string()))
    }

    /// Read a named metadata record.
    pub fn meta_get(&self, key: &str) -> Option<Vec<u8>> {
        lock(&self.state).meta.get(key).cloned()
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
        st.meta
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
    pub(crate) fn commit(&self, st: &mut State, records: Vec<JournalRecord>) -> Result<u64> {
        if st.journal.pending_bytes() >= self.opts.journal_buffer_bytes {
            st.journal.seal()?;
        }
        for r in &records {
            if let Err(e) = apply(st, r) {
                // The state may be half-changed: stop accepting writes until reopened.
                st.poisoned = Some(e.to_string());
                return Err(e);
            }
            st.journal.append(r);
        }
        st.appended += records.len() as u64;
        Ok(st.appended)
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
        // 1. Zero detection and fingerprints, in parallel for large writes.
        let classify = |b: &[u8]| {
            if reduction::is_zero(b) {
                None
            } else {
                Some(reduction::fingerprint(&key, b))
            }
        };
        let fps: Vec<Option<Fingerprint>> = if data.len() >= 16 * bs {
            data.par_chunks(bs).map(classify).collect()
        } else {
            data.chunks(bs).map(classify).collect()
        };
        // 2. Which blocks are new chunks.
        let misses: Vec<usize> = {
            let st = lock(&self.state);
            self.writable(&st)?;
            let mut seen: HashMap<Fingerprint, (), FpHash> =
                HashMap::with_capacity_and_hasher(fps.len(), FpHash);
            fps.iter()
                .enumerate()
                .filter_map(|(i, fp)| {
                    let fp = fp.as_ref()?;
                    let hit = st
                        .index
                        .find(fp, &st.chunks)
                        .is_some_and(|id| st.chunks.get(id).is_some_and(|e| e.refs < REFS_MAX));
                    (!hit && seen.insert(*fp, ()).is_none()).then_some(i)
                })
                .collect()
        };
        // 3. Compress the new chunks, in parallel.
        let comp = self.sb.compression;
        let compress = |&i: &usize| (i, reduction::compress(comp, &data[i * bs..(i + 1) * bs]));
        let compressed_list: Vec<(usize, (ChunkCodec, Vec<u8>))> = if misses.len() >= 8 {
            misses.par_iter().map(compress).collect()
        } else {
            misses.iter().map(compress).collect()
        };
        let mut compressed: Vec<Option<(ChunkCodec, Vec<u8>)>> = vec![None; fps.len()];
        for (i, c) in compressed_list {
            compressed[i] = Some(c);
        }
        // 4. Commit: stage new records, write them, then apply and journal the changes.
        let mut st = lock(&self.state);
        self.writable(&st)?;
        st.volume_for(vol, name, "write", first, (data.len() / bs) as u64)?;
        self.check_space(&mut st, data.len() as u64)?;
        let mut records = Vec::new();
        let mut entries = Vec::with_capacity(fps.len());
        let mut batch_new: HashMap<Fingerprint, u32, FpHash> = HashMap::with_hasher(FpHash);
        let mut new_ids = Vec::new();
        for (i, fp) in fps.iter().enumerate() {
            let Some(fp) = fp else {
                entries.push(ENTRY_ZERO);
                continue;
            };
            if let Some(&id) = batch_new.get(fp) {
                entries.push(id);
                continue;
            }
            if let Some(id) = st
                .index
                .find(fp, &st.chunks)
                .filter(|&id| st.chunks.get(id).is_some_and(|e| e.refs < REFS_MAX))
            {
                entries.push(id);
                continue;
            }
            // A new chunk (compressed above, or now if the index changed since step 2).
            let fresh;
            let (codec, payload) = match &compressed[i] {
                Some((c, p)) => (*c, p),
                None => {
                    fresh = reduction::compress(comp, &data[i * bs..(i + 1) * bs]);
                    (fresh.0, &fresh.1)
                }
            };
            let Some(id) = st.chunks.allocate_id() else {
                self.unwind_ids(&mut st, &new_ids);
                return Err(Error::NoSpace(
                    "allocating a chunk id (the pool holds 2^32 chunks)".into(),
                ));
            };
            new_ids.push(id);
            let loc = match st.segments.append(&*self.dir, id, fp, codec, payload) {
                Ok(loc) => loc,
                Err(e) => {
                    self.unwind_ids(&mut st, &new_ids);
                    return Err(e);
                }
            };
            records.push(JournalRecord::NewChunk { id, loc, fp: *fp });
            batch_new.insert(*fp, id);
            entries.push(id);
        }
        if let Err(e) = st.segments.write_pending() {
            self.unwind_ids(&mut st, &new_ids);
            return Err(e);
        }
        records.push(JournalRecord::MapRun {
            vol,
            start: first,
            entries,
        });
        let committed = self.commit(&mut st, records);
        if committed.is_err() && st.poisoned.is_none() {
            // Nothing was applied (the journal buffer could not be written out).
            self.unwind_ids(&mut st, &new_ids);
        }
        committed
    }

    /// Give back ids allocated for a batch that failed before anything was applied.
    fn unwind_ids(&self, st: &mut State, ids: &[u32]) {
        st.segments.discard_pending();
        for &id in ids.iter().rev() {
            st.chunks.remove(id);
        }
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
        entry: u32,
    ) -> Result<u64> {
        debug_assert!(entry == ENTRY_ZERO || entry == ENTRY_UNMAPPED);
        let mut st = lock(&self.state);
        self.writable(&st)?;
        st.volume_for(vol, name, "zero", first, count)?;
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
        let (files, dir_changed, journal, target) = {
            let mut st = lock(&self.state);
            if let Some(p) = &st.poisoned {
                return Err(Error::Poisoned(p.clone()));
            }
            if st.durable == st.appended {
                return Ok(());
            }
            st.journal.seal()?;
            let (files, dir_changed) = st.segments.take_dirty();
            (files, dir_changed, st.journal.file.clone(), st.appended)
        };
        let synced = (|| {
            sync_segments(&files)?;
            if dir_changed {
                self.dir
                    .sync_dir()
                    .map_err(|e| Error::io("syncing the pool directory", e))?;
            }
            journal
                .sync()
                .map_err(|e| Error::io("syncing the journal", e))
        })();
        let st = self.settle_sync(synced, target)?;
        let big = st.journal.file_bytes() > self.opts.journal_bytes_max;
        drop(st);
        if big {
            self.checkpoint_locked(&guard)?;
        }
        Ok(())
    }

    /// Write a checkpoint of the whole state and start a new journal generation. The caller
    /// holds `sync_lock`.
    pub(crate) fn checkpoint_locked(&self, _sync: &MutexGuard<'_, ()>) -> Result<()> {
        let (body, old_gen, new_journal_file, files, target) = {
            let mut st = lock(&self.state);
            self.writable(&st)?;
            st.journal.seal()?;
            let new_gen = st.journal.gen + 1;
            let next_seq = st.journal.next_seq();
            let body = crate::checkpoint::encode(&st, new_gen, next_seq, &self.sb.uuid)?;
            let journal = Journal::create(&*self.dir, new_gen, &self.sb.uuid, next_seq)?;
            let file = journal.file.clone();
            let old = std::mem::replace(&mut st.journal, journal);
            let (files, _) = st.segments.take_dirty();
            (body, old.gen, file, files, st.appended)
        };
        let done = (|| {
            sync_segments(&files)?;
            new_journal_file
                .sync()
                .map_err(|e| Error::io("syncing the new journal", e))?;
            self.dir
                .sync_dir()
                .map_err(|e| Error::io("syncing the pool directory", e))?;
            write_file_atomically(&*self.dir, CHECKPOINT_NAME, &body)?;
            self.dir
                .remove(&journal_name(old_gen))
                .map_err(|e| Error::io("removing the old journal", e))
        })();
        self.settle_sync(done, target).map(drop)
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
        {
            let st = lock(&self.state);
            let v = st.volume_for(vol, name, "read", first, n as u64)?;
            for i in 0..n {
                let e = v.map.get(first + i as u64);
                if e == ENTRY_ZERO || e == ENTRY_UNMAPPED {
                    out[i * bs..(i + 1) * bs].fill(0);
                    continue;
                }
                let loc = st.chunks.get(e).and_then(|c| c.location()).ok_or_else(|| {
                    Error::corrupt(
                        format!("volume {name:?} block {}", first + i as u64),
                        format!("chunk {e} has no readable location (damaged metadata)"),
                    )
                });
                let loc = match loc {
                    Ok(l) => l,
                    Err(err) => {
                        self.read_errors.fetch_add(1, Ordering::Relaxed);
                        return Err(err);
                    }
                };
                let file = st.segments.file(loc.segment).ok_or_else(|| {
                    Error::corrupt(
                        format!("volume {name:?} block {}", first + i as u64),
                        format!("segment {} of chunk {e} is missing", loc.segment),
                    )
                })?;
                wanted.push((i, e, loc, file));
            }
        }
        // Coalesce records that are adjacent in one segment into one read.
        let mut groups: Vec<(usize, usize)> = Vec::new();
        for (k, w) in wanted.iter().enumerate() {
            match groups.last_mut() {
                Some((s, e))
                    if {
                        let prev = &wanted[*e - 1].2;
                        prev.segment == w.2.segment
                            && u64::from(prev.offset) + prev.record_bytes() == u64::from(w.2.offset)
                    } =>
                {
                    *e = k + 1
                }
                _ => groups.push((k, k + 1)),
            }
        }
        // Read each group with one call, then check and decode every block (in parallel for
        // large reads).
        let read_group = |&(s, e): &(usize, usize)| -> Result<(u64, Vec<u8>)> {
            let first_loc = &wanted[s].2;
            let last_loc = &wanted[e - 1].2;
            let start = u64::from(first_loc.offset);
            let len = (u64::from(last_loc.offset) + last_loc.record_bytes() - start) as usize;
            let mut buf = vec![0u8; len];
            wanted[s].3.read_at(&mut buf, start).map_err(|err| {
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
            // For each block of `out`: (group, wanted index), or None for zeros.
            let mut slot: Vec<Option<(usize, usize)>> = vec![None; n];
            for (g, &(s, e)) in groups.iter().enumerate() {
                for k in s..e {
                    slot[wanted[k].0] = Some((g, k));
                }
            }
            let decode = |(i, dst): (usize, &mut [u8])| -> Result<()> {
                let Some((g, k)) = slot[i] else { return Ok(()) };
                let (_, id, loc, _) = &wanted[k];
                let (start, buf) = &bufs[g];
                let at = (u64::from(loc.offset) - start) as usize;
                let what = || {
                    format!(
                        "volume {name:?} block {} (chunk {id}, segment {}, offset {})",
                        first + i as u64,
                        loc.segment,
                        loc.offset
                    )
                };
                let (_, payload) = decode_record(&buf[at..], *id, loc)
                    .map_err(|err| with_context(err, &what()))?;
                reduction::decompress(loc.codec, payload, dst, what)
            };
            if parallel {
                out.par_chunks_mut(bs).enumerate().try_for_each(decode)
            } else {
                out.chunks_mut(bs).enumerate().try_for_each(decode)
            }
        });
        if let Err(e) = &result {
            if e.is_damage() {
                self.read_errors.fetch_add(1, Ordering::Relaxed);
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
    ) -> Result<Vec<(u64, u32)>> {
        let st = lock(&self.state);
        let v = st.volume_for(vol, name, "block_status", first, count)?;
        Ok(v.map
            .iter_from(first)
            .take_while(|(b, _)| *b < first + count)
            .collect())
    }
}

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

fn sync_segments(files: &[Arc<dyn crate::io::File>]) -> Result<()> {
    for f in files {
        f.sync().map_err(|e| Error::io("syncing a segment", e))?;
    }
    Ok(())
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
        e => e,
    }
}

/// True if every chunk the batch introduces (or moves) is whole on disk.
fn batch_data_present(st: &State, records: &[JournalRecord], block_size: u32) -> bool {
    records.iter().all(|r| match r {
        JournalRecord::NewChunk { id, loc, .. } | JournalRecord::Relocate { id, loc } => {
            let Some(file) = st.segments.file(loc.segment) else {
                return false;
            };
            let mut buf = vec![0u8; loc.record_bytes() as usize];
            if file.read_at(&mut buf, u64::from(loc.offset)).is_err() {
                return false;
            }
            let Ok((_, payload)) = decode_record(&buf, *id, loc) else {
                return false;
            };
            let mut out = vec![0u8; block_size as usize];
            reduction::decompress(loc.codec, payload, &mut out, String::new).is_ok()
        }
        _ => true,
    })
}

/// Apply one record to the state. The only place the state's metadata changes.
pub(crate) fn apply(st: &mut State, r: &JournalRecord) -> Result<()> {
    match r {
        JournalRecord::NewChunk { id, loc, fp } => {
            st.chunks.insert(*id, *fp, loc);
            st.index.insert(fp, *id, &st.chunks);
        }
        JournalRecord::MapRun {
            vol,
            start,
            entries,
        } => {
            let State {
                volumes, chunks, ..
            } = st;
            let v = volumes.get_mut(vol).ok_or_else(|| {
                Error::corrupt("journal", format!("map change for unknown volume {vol}"))
            })?;
            for (i, &e) in entries.iter().enumerate() {
                set_entry(v, chunks, start + i as u64, e);
            }
        }
        JournalRecord::MapFill {
            vol,
            start,
            count,
            entry,
        } => {
            let State {
                volumes, chunks, ..
            } = st;
            let v = volumes.get_mut(vol).ok_or_else(|| {
                Error::corrupt("journal", format!("map change for unknown volume {vol}"))
            })?;
            if *entry == ENTRY_UNMAPPED {
                let mapped: Vec<u64> = v
                    .map
                    .iter_from(*start)
                    .take_while(|(b, _)| *b < start + count)
                    .map(|(b, _)| b)
                    .collect();
                for b in mapped {
                    set_entry(v, chunks, b, ENTRY_UNMAPPED);
                }
            } else {
                for b in *start..start + count {
                    set_entry(v, chunks, b, *entry);
                }
            }
        }
        JournalRecord::VolumeCreate { vol, size, name } => {
            st.volumes.insert(
                *vol,
                VolumeState {
                    name: name.clone(),
                    size: *size,
                    map: BlockMap::default(),
                    damaged: None,
                },
            );
            st.names.insert(name.clone(), *vol);
            st.next_vol = st.next_vol.max(vol + 1);
        }
        JournalRecord::VolumeResize { vol, size } => {
            let first_cut = size / u64::from(st.block_size);
            let State {
                volumes, chunks, ..
            } = st;
            let v = volumes.get_mut(vol).ok_or_else(|| {
                Error::corrupt("journal", format!("resize of unknown volume {vol}"))
            })?;
            let cut: Vec<u64> = v.map.iter_from(first_cut).map(|(b, _)| b).collect();
            for b in cut {
                set_entry(v, chunks, b, ENTRY_UNMAPPED);
            }
            v.size = *size;
        }
        JournalRecord::VolumeDelete { vol } => {
            let State {
                volumes,
                chunks,
                names,
                ..
            } = st;
            let v = volumes.remove(vol).ok_or_else(|| {
                Error::corrupt("journal", format!("delete of unknown volume {vol}"))
            })?;
            for (_, e) in v.map.iter_from(0) {
                if e < CHUNK_ID_LIMIT {
                    chunks.decref(e);
                }
            }
            names.remove(&v.name);
        }
        JournalRecord::Relocate { id, loc } => st.chunks.relocate(*id, loc),
        JournalRecord::DropChunk { id } => {
            if let Some(fp) = st.chunks.get(*id).map(|e| e.fp) {
                if st.index.find(&fp, &st.chunks) == Some(*id) {
                    st.index.remove(&fp, &st.chunks);
                }
            }
            st.chunks.remove(*id);
        }
        JournalRecord::MetaPut { key, value } => match value {
            Some(v) => {
                st.meta.insert(key.clone(), v.clone());
            }
            None => {
                st.meta.remove(key);
            }
        },
    }
    Ok(())
}

fn set_entry(v: &mut VolumeState, chunks: &mut ChunkTable, block: u64, e: u32) {
    if e < CHUNK_ID_LIMIT {
        chunks.incref(e);
    }
    let old = v.map.set(block, e);
    if old < CHUNK_ID_LIMIT {
        chunks.decref(old);
    }
}

fn read_whole(dir: &dyn Dir, name: &str) -> Result<Vec<u8>> {
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

/// Replace `name` with `data` so that a crash leaves the old or the new file, never a mix.
pub(crate) fn write_file_atomically(dir: &dyn Dir, name: &str, data: &[u8]) -> Result<()> {
    let tmp = format!("{name}.tmp");
    let f = dir
        .open(&tmp, true)
        .map_err(|e| Error::io(format!("creating {tmp}"), e))?;
    f.set_len(0)
        .and_then(|_| f.write_at(data, 0))
        .and_then(|_| f.sync())
        .map_err(|e| Error::io(format!("writing {tmp}"), e))?;
    dir.rename(&tmp, name)
        .map_err(|e| Error::io(format!("renaming {tmp} to {name}"), e))?;
    dir.sync_dir()
        .map_err(|e| Error::io("syncing the pool directory", e))
}
