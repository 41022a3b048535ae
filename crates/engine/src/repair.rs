//! `condense repair`: salvage a pool whose journal is damaged in the middle or whose
//! checkpoint has an unreadable block-map or chunk-table page, and leave it consistent.
//!
//! Owns: what a salvage replay sets aside (`pool::salvage::apply_after_damage`; the rules of what it
//! tolerates are `metadata::Mode::Salvage`'s, where every record is interpreted), the
//! rebuild of every block map and of the chunk table from what is readable, the report of
//! what was lost (volume, blocks, why), and the backup of the damaged files.
//!
//! How it works (docs/REPAIR.md has the administrator's version):
//! 1. Take the pool's lock (a running `serve`/`mount` makes repair refuse) and, unless this is
//!    a dry run, copy `superblock`, `checkpoint`, `meta.dat` and the journals into
//!    `POOL/repair-<UTC time>/` before anything is written.
//! 2. Open the pool read-only with the journal replayed in salvage mode: damaged stretches
//!    are skipped and every batch is applied by `pool::salvage::apply_after_damage` (`Metadata::apply_in`
//!    in salvage mode), which sets map entries without touching reference counts and
//!    remembers where the batches put chunks.
//! 3. Build fresh metadata next to the old: every volume and snapshot's map is walked leaf by
//!    leaf; an unreadable map page loses its blocks; every chunk a map names is taken from the
//!    batches, else the old chunk table (if the segment it names exists), else found by
//!    scanning the segments for a valid record with its id and, when the old chunk table knows
//!    it, its fingerprint (ids a crash took back are handed out again, so a record with the
//!    id may hold other data; a missing segment, e.g. a lost writeback cache, loses its
//!    blocks). A delta is kept only with every base its record names, found the same way, and
//!    applied as `NewDelta` (`repair/deltas.rs`); a lost base loses its deltas' blocks. Reference
//!    counts, live bytes and free metadata space are recomputed from the maps and the deltas;
//!    chunks nothing names are dropped (their bytes are dead space for `condense gc`).
//! 4. Write the new pages into space the old checkpoint does not use, then a new root and an
//!    empty journal: the switch is the atomic replacement of the root, so a crash during
//!    repair leaves the old (damaged) pool or the repaired one.
//!
//! Invariants: nothing is written in a dry run; nothing is written before the backup exists;
//! every block not reported lost reads what it read before the damage (or what a valid batch
//! after the damage wrote); snapshots lose their sharing with their volume (each gets its own
//! map pages) but keep their content.

use crate::block_map;
use crate::chunk_table::ChunkTable;
use crate::crypto::{Crypto, UserKey};
use crate::error::{Error, Result};
use crate::format::*;
use crate::io::{Dir, RealDir};
use crate::journal::{DamagedStretch, Journal};
use crate::metadata::Metadata;
use crate::page_alloc::PageAlloc;
use crate::page_cache::{PageCache, Ptr, TreeInfo, CHUNK_TREE, FANOUT};
use crate::pool::{OpenOptions, Pool};
use crate::segment::Segments;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod deltas;

const PER: u64 = MAP_PAGE_ENTRIES as u64;

use crate::format::damage::{merge, subtract, utc_stamp};
pub use crate::journal::Salvage;
use crate::pool::damage::encode_damage;
pub use crate::pool::damage::{
    clear_damage_history, damage_history, DamageRecord, LostRange, DAMAGE_PREFIX,
};

/// What repair found and did.
#[derive(Clone, Debug, Default)]
pub struct RepairReport {
    pub dry_run: bool,
    pub block_size: u32,
    /// Where the damaged files were copied (not in a dry run, nor when nothing was damaged).
    pub backup: Option<PathBuf>,
    /// Valid journal batches and records salvaged.
    pub journal_batches: u64,
    pub journal_records: u64,
    /// Damaged stretches of the journal that were skipped.
    pub damaged_journal: Vec<DamagedStretch>,
    /// Blocks lost, by volume, sorted.
    pub lost: Vec<LostRange>,
    /// Other things lost or skipped, in words.
    pub notes: Vec<String>,
    pub volumes: u64,
    /// Chunks the repaired pool holds; of them, found by scanning segments.
    pub chunks_kept: u64,
    pub chunks_from_segments: u64,
    /// Chunks the old table counted live that nothing names any more (now dead space).
    pub chunks_dropped: u64,
    pub unreadable_map_pages: u64,
    pub unreadable_chunk_pages: u64,
    /// Chunk records read and checked (CRC, authentication, decompression, fingerprint), and
    /// of them damaged.
    pub chunks_checked: u64,
    pub damaged_chunks: u64,
}

impl RepairReport {
    /// True if repair found something to repair.
    pub fn found_damage(&self) -> bool {
        !self.damaged_journal.is_empty()
            || !self.lost.is_empty()
            || !self.notes.is_empty()
            || self.damaged_chunks > 0
            || self.unreadable_map_pages > 0
            || self.unreadable_chunk_pages > 0
    }

    /// Blocks lost in all.
    pub fn lost_blocks(&self) -> u64 {
        self.lost.iter().map(|l| l.blocks).sum()
    }
}

/// Repair the pool in directory `path` (see the module documentation). With `dry_run`
/// nothing is written: the report says what a repair would salvage and lose.
/// Repair the pool at `path` (`key`: the key of an encrypted pool). In an encrypted pool a
/// repair (not a dry run) seals the new pages, root and journal under a session of its own,
/// as a writable open does.
pub fn repair(
    path: &Path,
    dry_run: bool,
    key: Option<UserKey>,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<RepairReport> {
    repair_with(
        path,
        RepairOptions {
            dry_run,
            key,
            lost_as_zeros: false,
        },
        progress,
    )
}

/// How [`repair_with`] runs.
#[derive(Clone, Default)]
pub struct RepairOptions {
    /// Say what would be done; write nothing.
    pub dry_run: bool,
    /// The key of an encrypted pool.
    pub key: Option<UserKey>,
    /// Lost blocks become zeros (unmapped) instead of [`ENTRY_LOST`], which fails every read
    /// until the block is written again.
    pub lost_as_zeros: bool,
}

/// [`repair`] with every option.
pub fn repair_with(
    path: &Path,
    opts: RepairOptions,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<RepairReport> {
    let RepairOptions {
        dry_run,
        key,
        lost_as_zeros,
    } = opts;
    refuse_remote(path)?;
    let dir = RealDir::new(path);
    let lock_file = lock_pool(&dir, path)?;
    let Head {
        mut sb,
        sb_bytes,
        reader,
        old_root,
    } = read_head(&dir, path, key.as_ref())?;
    // What the rebuilt metadata is sealed with: a session of its own, as a writable open
    // (refused for a format 3 pool before anything is written).
    let sealer = if dry_run {
        reader
    } else {
        sb.unlock(&sb_bytes, key.as_ref(), true, &dir.describe())?
    };
    let backup = if dry_run { None } else { Some(back_up(path)?) };
    let pool = open_salvaged(&dir, path, key, lock_file)?;
    let mut report = RepairReport {
        dry_run,
        block_size: sb.block_size,
        backup: backup.clone(),
        ..Default::default()
    };
    let (damaged, salvage) = survey(&pool, progress, &mut report)?;
    let (crypto, slot) = (pool.crypto.clone(), pool.slot);

    let (next_seq, mut new) = pool.salvaged(|md, segments, next_seq| -> Result<_> {
        let mut new = fresh_metadata(md, &old_root, dry_run, sealer.clone());
        let mut lost = Lost {
            as_zeros: lost_as_zeros,
            ..Default::default()
        };
        journal_losses(
            md,
            &salvage,
            &report.damaged_journal,
            &mut lost,
            &mut report.notes,
        );
        rebuild(
            md,
            (segments, crypto.as_deref(), slot),
            &salvage,
            &damaged,
            &mut new,
            &mut lost,
            &mut report,
        )?;
        report.lost = lost.ranges(md);
        report.volumes = new.volumes.len() as u64;
        report.chunks_kept = new.chunks.live_chunks;
        report.chunks_dropped = md.chunks.live_chunks.saturating_sub(new.chunks.live_chunks);
        Ok((next_seq, new))
    })?;

    if dry_run {
        return Ok(report);
    }
    if !report.found_damage() {
        // Nothing to repair: leave the pool as it was and drop the unneeded backup.
        if let Some(b) = &backup {
            let _ = std::fs::remove_dir_all(b);
        }
        report.backup = None;
        return Ok(report);
    }
    record_loss(&mut new, &report.lost);
    write_new_state(&dir, &sb, &old_root, &mut new, next_seq, sealer)?;
    // Both superblock copies as the one used (a damaged or missing copy is mended).
    crate::copies::write_both(&dir, SUPERBLOCK_NAME, &sb_bytes)?;
    Ok(report)
}

/// Refuse the local directory of a pool on S3 (its repair is not built).
fn refuse_remote(path: &Path) -> Result<()> {
    if path.join(crate::format::remote::REMOTE_CONF_NAME).exists() {
        return Err(Error::Invalid(format!(
            "{} is the local directory of a pool on S3: repair of a pool on S3 is not built yet. \
             The bucket holds the pool as of its last checkpoint upload: `condense connect` it \
             into a new local directory to open it as of then (with `local` durability the \
             writes since that upload are lost; with `remote` none that was flushed), see docs/S3.md",
            path.display()
        )));
    }
    Ok(())
}

/// Take the pool's lock (a running `serve` or `mount` holds it: repair refuses).
fn lock_pool(dir: &RealDir, path: &Path) -> Result<std::fs::File> {
    if !crate::copies::exists(dir, SUPERBLOCK_NAME)
        .map_err(|e| Error::io(format!("reading {}", path.display()), e))?
    {
        return Err(Error::NotAPool(path.to_path_buf()));
    }
    dir.lock(LOCK_NAME)
        .map_err(|e| Error::io(format!("locking {}", path.display()), e))?
        .ok_or_else(|| Error::Locked(path.to_path_buf()))
}

/// The superblock and the checkpoint root, each of the copy open would use (copies.rs).
struct Head {
    sb: Superblock,
    /// The superblock as stored (rewritten into both copies by a repair).
    sb_bytes: Vec<u8>,
    /// What reads the pool's sealed objects (an encrypted pool).
    reader: Option<Arc<Crypto>>,
    old_root: Root,
}

fn read_head(dir: &RealDir, path: &Path, key: Option<&UserKey>) -> Result<Head> {
    let sb_copies = crate::copies::read_both(
        dir,
        SUPERBLOCK_NAME,
        |bytes| {
            let sb = Superblock::decode(bytes)?;
            sb.clone()
                .unlock(bytes, key, false, &dir.describe())
                .map(|c| (sb, c))
        },
        |_, _| false,
    )?;
    let sb_bytes = sb_copies.bytes.clone();
    let (sb, reader) = sb_copies.value;
    let old_root = crate::copies::read_both(
        dir,
        CHECKPOINT_NAME,
        |bytes| decode_root(bytes, &sb.uuid, reader.as_deref()),
        |a, b| (a.journal_gen, a.next_seq) > (b.journal_gen, b.next_seq),
    )
    .map_err(|e| {
        Error::corrupt(
            format!("checkpoint root of {}", path.display()),
            format!("{e}; both copies of the root (checkpoint and checkpoint.copy) are damaged, and the root names every map and the chunk table, so repair cannot rebuild the pool: restore it from a backup"),
        )
    })?
    .value;
    Ok(Head {
        sb,
        sb_bytes,
        reader,
        old_root,
    })
}

/// Open the pool read-only under `lock_file` with the journal replayed in salvage mode.
fn open_salvaged(
    dir: &RealDir,
    path: &Path,
    key: Option<UserKey>,
    lock_file: std::fs::File,
) -> Result<Arc<Pool>> {
    // A writeback cache holds segments and maybe the journal: read them there. If its
    // directory is lost (or was given up with `cache detach --force`), its segments are
    // missing and the blocks whose chunks were in them are reported lost.
    let cache_dir = crate::pool::cache_tier::stored_cache_dir(dir);
    let opts = OpenOptions {
        read_only: true,
        salvage_journal: true,
        key,
        without_writeback_cache: cache_dir.is_none(),
        cache_dir,
        ..Default::default()
    };
    Pool::open_with_lock(Arc::new(RealDir::new(path)), opts, Some(lock_file))
}

/// Check every chunk's record and read what the salvage replay found into `report`; returns
/// the damaged chunks (id → why) and what the replay set aside.
fn survey(
    pool: &Pool,
    progress: &(dyn Fn(u64, u64) + Sync),
    report: &mut RepairReport,
) -> Result<(HashMap<u64, String>, Salvage)> {
    // Every chunk's record, checked as `verify` checks it: a damaged one is treated as a chunk
    // that cannot be located (another valid record of it in the segments is used; else the
    // blocks naming it are lost).
    let checked = pool.check_chunks(progress)?;
    report.chunks_checked = checked.chunks_checked;
    report.damaged_chunks = checked.bad.len() as u64;
    let damaged: HashMap<u64, String> = checked.bad.into_iter().collect();
    let replay = pool.replay_report();
    report.journal_batches = replay.batches;
    report.journal_records = replay.records;
    report.damaged_journal = replay.damaged.clone();
    let salvage = replay.salvage.clone();
    report.notes.extend(salvage.skipped.iter().cloned());
    report.notes.extend(replay.notes.iter().cloned());
    Ok((damaged, salvage))
}

/// Keep what was lost in the pool's history (`damage/<UTC time>`) until an administrator
/// clears it.
fn record_loss(new: &mut Metadata, lost: &[LostRange]) {
    if lost.is_empty() {
        return;
    }
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut key = format!("{DAMAGE_PREFIX}{}", utc_stamp(secs));
    let mut n = 1;
    while new.meta.contains_key(&key) {
        n += 1;
        key = format!("{DAMAGE_PREFIX}{}-{n}", utc_stamp(secs));
    }
    new.meta.insert(key, encode_damage(lost));
}

/// Copy the metadata files into `POOL/repair-<UTC time>/` and sync them.
fn back_up(path: &Path) -> Result<PathBuf> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut to = path.join(format!("repair-{}", utc_stamp(secs)));
    let mut n = 1;
    while to.exists() {
        n += 1;
        to = path.join(format!("repair-{}-{n}", utc_stamp(secs)));
    }
    crate::io::create_private_dir(&to)
        .map_err(|e| Error::io(format!("creating {}", to.display()), e))?;
    let entries =
        std::fs::read_dir(path).map_err(|e| Error::io(format!("listing {}", path.display()), e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(format!("listing {}", path.display()), e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let wanted = [
            SUPERBLOCK_NAME,
            CHECKPOINT_NAME,
            CHECKPOINT_TMP_NAME,
            META_NAME,
        ]
        .iter()
        .any(|n| name == *n || name == crate::copies::copy_name(n))
            || name.starts_with(JOURNAL_PREFIX);
        if !wanted {
            continue;
        }
        let dst = to.join(&name);
        std::fs::copy(entry.path(), &dst)
            .and_then(|_| std::fs::File::open(&dst)?.sync_all())
            .map_err(|e| {
                Error::io(
                    format!(
                        "backing up {name} to {} (nothing was changed)",
                        to.display()
                    ),
                    e,
                )
            })?;
    }
    std::fs::File::open(&to)
        .and_then(|d| d.sync_all())
        .and_then(|_| std::fs::File::open(path)?.sync_all())
        .map_err(|e| Error::io(format!("syncing {}", to.display()), e))?;
    Ok(to)
}

/// Empty metadata for the rebuild, on the same `meta.dat`: its allocator starts from the old
/// root's bitmap, so no page the old root names is overwritten before the new root is durable.
fn fresh_metadata(
    old: &Metadata,
    old_root: &Root,
    dry_run: bool,
    crypto: Option<Arc<Crypto>>,
) -> Metadata {
    let mut trees = BTreeMap::new();
    trees.insert(
        CHUNK_TREE,
        TreeInfo {
            height: 1,
            root: Ptr::NULL,
        },
    );
    let mut cache = PageCache::new(
        old.pages.file().clone(),
        PageAlloc::from_bitmap(old_root.bitmap.clone()),
        trees,
        old.pages.budget_bytes(),
    );
    if dry_run {
        cache.set_read_only();
    }
    if let Some(c) = crypto {
        cache.set_crypto(c);
    }
    Metadata {
        block_size: old.block_size,
        volumes: BTreeMap::new(),
        names: HashMap::new(),
        next_vol: old.next_vol,
        pages: cache,
        chunks: ChunkTable {
            next_id: old.chunks.next_id,
            ..Default::default()
        },
        index: Default::default(),
        saved_index: None,
        index_origin: Default::default(),
        meta: old.meta.clone(),
        meta_bytes_written_before: old.meta_bytes_written(),
        checkpoints: old.checkpoints,
        attribution: None,
        counting: None,
        released_figures: Default::default(),
        spill: old.spill.clone(),
        // A map being released holds nothing the rebuild keeps: its chunks' references are
        // counted again from the volumes, so what only it held goes to GC.
        releasing: BTreeMap::new(),
        to_free: Vec::new(),
        index_build: None,
        index_load: None,
    }
}

/// Lost blocks as they are found: (volume id, reason) → blocks.
#[derive(Default)]
struct Lost {
    blocks: BTreeMap<(u32, String), Vec<(u64, u64)>>,
    /// Lost blocks become zeros ([`RepairOptions::lost_as_zeros`]), not [`ENTRY_LOST`].
    as_zeros: bool,
}

impl Lost {
    /// How the blocks the rebuild gives up read afterwards, for the report's reasons.
    fn now_reads(&self) -> &'static str {
        if self.as_zeros {
            "the blocks now read as zeros"
        } else {
            "the blocks now fail to read (an I/O error) until written again"
        }
    }

    /// Blocks `[first, end)` of `vol` the rebuild cannot keep: named in the report, and
    /// marked lost in the new map unless they are to read as zeros (left unmapped).
    fn give_up(
        &mut self,
        new: &mut Metadata,
        vol: u32,
        first: u64,
        end: u64,
        reason: &str,
    ) -> Result<()> {
        self.add(vol, first, end, reason);
        if self.as_zeros || first >= end {
            return Ok(());
        }
        new.apply(&JournalRecord::MapFill {
            vol,
            start: first,
            count: end - first,
            entry: ENTRY_LOST,
        })
    }

    fn add(&mut self, vol: u32, first: u64, end: u64, reason: &str) {
        if first < end {
            self.blocks
                .entry((vol, reason.to_string()))
                .or_default()
                .push((first, end));
        }
    }

    /// Merged ranges, named, sorted by volume name and block.
    fn ranges(self, md: &Metadata) -> Vec<LostRange> {
        let mut out = Vec::new();
        for ((vol, reason), mut r) in self.blocks {
            let name = md
                .volumes
                .get(&vol)
                .map_or_else(|| format!("volume id {vol}"), |v| v.name.clone());
            for (first, end) in merge(&mut r) {
                out.push(LostRange {
                    volume: name.clone(),
                    first_block: first,
                    blocks: end - first,
                    reason: reason.clone(),
                });
            }
        }
        out.sort_by(|a, b| (&a.volume, a.first_block).cmp(&(&b.volume, b.first_block)));
        out
    }
}

/// What the damaged journal stretches changed and no later batch wrote again.
fn journal_losses(
    md: &Metadata,
    salvage: &Salvage,
    damaged: &[DamagedStretch],
    lost: &mut Lost,
    notes: &mut Vec<String>,
) {
    let mut after: BTreeMap<u32, Vec<(u64, u64)>> = BTreeMap::new();
    for (vol, r) in &salvage.written_after {
        after.insert(*vol, merge(&mut r.clone()));
    }
    let bs = u64::from(md.block_size);
    for d in damaged {
        let reason = format!(
            "written by damaged journal batch(es) {}..{} ({} bytes at offset {} of {}); the blocks keep their content from before that write",
            d.first_seq, d.next_seq, d.bytes, d.offset, d.file
        );
        if !d.decoded_whole {
            notes.push(format!(
                "journal batch(es) {}..{} in {} (offset {}, {} bytes) could not be decoded{}: the blocks they wrote are unknown and keep older content; compare the volumes with a backup",
                d.first_seq,
                d.next_seq,
                d.file,
                d.offset,
                d.bytes,
                if d.records.is_empty() { "" } else { " in full (the ranges listed are what did decode)" }
            ));
        }
        for r in &d.records {
            let (vol, start, end) = match r {
                JournalRecord::MapRun {
                    vol,
                    start,
                    entries,
                } => (*vol, *start, start + entries.len() as u64),
                JournalRecord::MapFill {
                    vol, start, count, ..
                } => (*vol, *start, start.saturating_add(*count)),
                JournalRecord::VolumeCreate { vol, name, .. } => {
                    notes.push(format!(
                        "volume {name:?} (id {vol}) was created in a damaged journal batch{}",
                        if md.volumes.contains_key(vol) {
                            ""
                        } else {
                            " and is lost with every write to it"
                        }
                    ));
                    continue;
                }
                JournalRecord::VolumeDelete { vol } => {
                    notes.push(format!(
                        "volume id {vol} was deleted in a damaged journal batch; it is kept"
                    ));
                    continue;
                }
                JournalRecord::VolumeResize { vol, size } => {
                    notes.push(format!(
                        "volume id {vol} was resized to {size} bytes in a damaged journal batch; that resize is lost"
                    ));
                    continue;
                }
                _ => continue,
            };
            let Some(v) = md.volumes.get(&vol) else {
                continue;
            };
            let end = end.min(v.size / bs);
            let cut = after.get(&vol).map_or(&[][..], |c| &c[..]);
            for (s, e) in subtract(start, end, cut) {
                lost.add(vol, s, e, &reason);
            }
        }
    }
}

/// Where chunk `id` is, if it can be found: the batches, then the old chunk table. With the
/// id of the chunk whose record it is: a forward of the old table resolves to the chunk it
/// names (the rebuild maps the blocks to that one, so the new table holds no forward).
fn locate(
    old: &mut Metadata,
    salvage: &Salvage,
    segments: &Segments,
    id: u64,
) -> std::result::Result<(u64, Location, Fingerprint), (String, Option<Fingerprint>)> {
    if let Some((loc, fp)) = salvage.chunks.get(&id) {
        if let Some(fp) = fp.or_else(|| record_fp(segments, id, loc)) {
            return Ok((id, *loc, fp));
        }
    }
    match old.chunks.resolve(&mut old.pages, id) {
        Ok(Some((_, e))) if segments.file(e.loc.segment).is_none() => Err((
            format!(
                "was in segment {}, which is missing (a lost writeback cache?)",
                e.loc.segment
            ),
            Some(e.fp),
        )),
        Ok(Some((rid, e))) => Ok((rid, e.loc, e.fp)),
        Ok(None) => Err(("is not in the chunk table".into(), None)),
        Err(e) => Err((format!("is on an unreadable chunk-table page ({e})"), None)),
    }
}

/// The fingerprint in chunk `id`'s record at `loc`, if the record is valid.
fn record_fp(segments: &Segments, id: u64, loc: &Location) -> Option<Fingerprint> {
    let file = segments.file(loc.segment)?;
    let mut buf = vec![0u8; loc.record_bytes() as usize];
    file.read_at(&mut buf, u64::from(loc.offset)).ok()?;
    decode_record(&buf, id, loc).ok().map(|(fp, _)| fp)
}

/// Scan every segment for valid records of the chunks in `wanted`; stops reading a segment
/// at the first record that does not check (record boundaries are unknown past it). Where
/// `expect` knows a chunk's fingerprint, only a record with it counts: a write a crash took
/// back leaves a record whose id was handed out again to other data.
pub fn scan_segments(
    segments: &Segments,
    wanted: &HashMap<u64, String>,
    expect: &HashMap<u64, Fingerprint>,
) -> HashMap<u64, (Location, Fingerprint)> {
    let mut found = HashMap::new();
    let ids: Vec<(u32, u64)> = segments.ids().collect();
    for (seg, len) in ids {
        let Some(file) = segments.file(seg) else {
            continue;
        };
        let mut data = vec![0u8; len as usize];
        if file.read_at(&mut data, 0).is_err() {
            continue;
        }
        let mut pos = SEGMENT_HEADER_BYTES;
        while let Some(h) = data.get(pos..pos + RECORD_HEADER_BYTES) {
            let word = |at: usize| u32::from_le_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]]);
            let id = u64::from(word(4)) | u64::from(word(28)) << 32;
            let len_codec = word(24);
            let Some(codec) = ChunkCodec::from_u8((len_codec >> 24) as u8) else {
                break;
            };
            let loc = Location {
                segment: seg,
                offset: pos as u32,
                stored_len: len_codec & 0x00ff_ffff,
                codec,
            };
            let Ok((fp, _)) = decode_record(&data[pos..], id, &loc) else {
                break;
            };
            if wanted.contains_key(&id) && expect.get(&id).is_none_or(|e| *e == fp) {
                found.insert(id, (loc, fp));
            }
            pos += loc.record_bytes() as usize;
        }
    }
    found
}

/// Rebuild every map and the chunk table into `new` from what is readable in `old`; `records`
/// are the segments and what opens their records (the crypto, the host slot).
fn rebuild(
    old: &mut Metadata,
    (segments, crypto, slot): (&Segments, Option<&Crypto>, u8),
    salvage: &Salvage,
    damaged: &HashMap<u64, String>,
    new: &mut Metadata,
    lost: &mut Lost,
    report: &mut RepairReport,
) -> Result<()> {
    count_unreadable_chunk_pages(old, report)?;
    let next_id = old
        .chunks
        .next_id
        .max(salvage.chunks.keys().max().map_or(0, |m| m + 1));
    new.chunks.next_id = next_id;
    let mut r = Rebuild {
        now_reads: lost.now_reads(),
        old,
        segments,
        crypto,
        slot,
        salvage,
        damaged,
        new,
        lost,
        report,
        next_id,
        inserted: Inserted::new(next_id),
        pending: Vec::new(),
        why: HashMap::new(),
        expect: HashMap::new(),
        waiting: HashMap::new(),
        lost_deltas: HashMap::new(),
    };
    let vols: Vec<u32> = r.old.volumes.keys().copied().collect();
    for vol in vols {
        r.volume(vol)?;
    }
    r.resolve_from_segments()?;
    // The counts of deltas and forwards made over the pool's life (the root's sections) go on.
    new.chunks.deltas = old.chunks.deltas;
    new.chunks.forwards = old.chunks.forwards.or(new.chunks.forwards);
    Ok(())
}

/// Count the chunk-table pages that cannot be read, for the report.
fn count_unreadable_chunk_pages(old: &mut Metadata, report: &mut RepairReport) -> Result<()> {
    let table_pages = old.chunks.next_id.div_ceil(CHUNKS_PER_PAGE as u64);
    for p in 0..table_pages {
        if old.pages.leaf(CHUNK_TREE, p).is_err() {
            report.unreadable_chunk_pages += 1;
        }
        if p % 256 == 255 {
            old.pages.evict_to_budget()?;
        }
    }
    Ok(())
}

/// The rebuild in progress: the old metadata read, the new written.
struct Rebuild<'a> {
    old: &'a mut Metadata,
    segments: &'a Segments,
    /// What opens a record (a delta's names its bases): the pool's crypto and host slot.
    crypto: Option<&'a Crypto>,
    slot: u8,
    salvage: &'a Salvage,
    /// Chunks whose record failed the check: id → why.
    damaged: &'a HashMap<u64, String>,
    new: &'a mut Metadata,
    lost: &'a mut Lost,
    report: &'a mut RepairReport,
    /// How lost blocks read afterwards, for the reasons.
    now_reads: &'static str,
    /// Past the last id the old table or the batches knew.
    next_id: u64,
    inserted: Inserted,
    /// Blocks whose chunk could not be located yet: (volume, block, chunk id).
    pending: Vec<(u32, u64, u64)>,
    /// Why each pending chunk could not be located.
    why: HashMap<u64, String>,
    /// The fingerprints pending chunks must have, where the old table knows them.
    expect: HashMap<u64, Fingerprint>,
    /// Deltas located whose bases are not all located yet: kept or lost after the scan.
    waiting: HashMap<u64, (Location, Fingerprint)>,
    /// Deltas given up (a base lost): id → why.
    lost_deltas: HashMap<u64, String>,
}

impl Rebuild<'_> {
    /// Volume `vol` in the new metadata, with every map leaf that can be read.
    fn volume(&mut self, vol: u32) -> Result<()> {
        let Some(v) = self.old.volumes.get(&vol) else {
            return Ok(());
        };
        let (name, size, snapshot_of, created) = (v.name.clone(), v.size, v.snapshot_of, v.created);
        self.new
            .apply(&JournalRecord::VolumeCreate { vol, size, name })?;
        if let Some(nv) = self.new.volumes.get_mut(&vol) {
            nv.snapshot_of = snapshot_of;
            nv.created = created;
        }
        let blocks = size / u64::from(self.old.block_size);
        let leaves = blocks.div_ceil(PER);
        let mut group = 0;
        while group * FANOUT < leaves {
            let (from, to) = (group * FANOUT, ((group + 1) * FANOUT).min(leaves));
            group += 1;
            let present = match self.old.pages.present_leaves(u64::from(vol), from, to) {
                Ok(p) => p,
                Err(e) => {
                    self.unreadable_map_page(vol, from * PER, (to * PER).min(blocks), &e)?;
                    continue;
                }
            };
            for li in present {
                self.leaf(vol, li, blocks)?;
            }
        }
        Ok(())
    }

    /// Blocks `[first, end)` of `vol` are lost with a map page that cannot be read.
    fn unreadable_map_page(&mut self, vol: u32, first: u64, end: u64, e: &Error) -> Result<()> {
        self.report.unreadable_map_pages += 1;
        let reason = format!("block-map page unreadable ({e}); {}", self.now_reads);
        self.lost.give_up(self.new, vol, first, end, &reason)
    }

    /// Map leaf `li` of `vol` (a volume of `blocks` blocks) into the new map: each chunk it
    /// names located and put in the new table, or left pending for the segment scan.
    fn leaf(&mut self, vol: u32, li: u64, blocks: u64) -> Result<()> {
        let first = li * PER;
        let mut entries = vec![ENTRY_UNMAPPED; MAP_PAGE_ENTRIES];
        match self.old.pages.leaf(u64::from(vol), li) {
            Ok(Some(leaf)) => block_map::leaf_entries_all(leaf, &mut entries),
            Ok(None) => return Ok(()),
            Err(e) => {
                return self.unreadable_map_page(vol, first, ((li + 1) * PER).min(blocks), &e)
            }
        }
        entries.truncate(blocks.saturating_sub(first).min(PER) as usize);
        let mut lost = Vec::new();
        for (i, e) in entries.iter_mut().enumerate() {
            let (id, block) = (*e, first + i as u64);
            if id >= CHUNK_ID_LIMIT || self.inserted.contains(id) {
                continue;
            }
            *e = ENTRY_UNMAPPED;
            match self.locate_checked(id) {
                Ok((rid, loc, fp)) if loc.codec.is_delta() => {
                    match self.keep_delta(rid, loc, fp, None)? {
                        deltas::Fate::Kept => *e = rid,
                        deltas::Fate::Wait => self.pending.push((vol, block, rid)),
                        deltas::Fate::Lost(why) => lost.push((block, why)),
                    }
                }
                Ok((rid, loc, fp)) => {
                    if !self.inserted.contains(rid) {
                        self.new
                            .apply(&JournalRecord::NewChunk { id: rid, loc, fp })?;
                        self.inserted.add(rid);
                    }
                    *e = rid;
                }
                Err((w, fp)) => {
                    self.why.entry(id).or_insert(w);
                    if let Some(fp) = fp {
                        self.expect.insert(id, fp);
                    }
                    self.pending.push((vol, block, id));
                }
            }
        }
        self.new.apply(&JournalRecord::MapRun {
            vol,
            start: first,
            entries,
        })?;
        for (block, why) in lost {
            let reason = format!("{why}; {}", self.now_reads);
            self.lost
                .give_up(self.new, vol, block, block + 1, &reason)?;
        }
        self.old.pages.evict_to_budget()?;
        self.new.pages.evict_to_budget()
    }

    /// Where chunk `id` is ([`locate`]), unless its record failed the check (a missing
    /// segment is said by `locate` itself).
    fn locate_checked(
        &mut self,
        id: u64,
    ) -> std::result::Result<(u64, Location, Fingerprint), (String, Option<Fingerprint>)> {
        let located = if id < self.next_id {
            locate(self.old, self.salvage, self.segments, id)
        } else {
            Err(("is past the last chunk id".into(), None))
        };
        match (located, self.damaged.get(&id)) {
            // A delta whose own record opens: the damage is a base's, judged with its bases.
            (Ok((rid, loc, fp)), Some(_))
                if loc.codec.is_delta() && self.bases_of(rid, &loc, &fp).is_ok() =>
            {
                Ok((rid, loc, fp))
            }
            (Ok((_, _, fp)), Some(why)) => Err((format!("has a damaged record ({why})"), Some(fp))),
            (located, _) => located,
        }
    }

    /// Chunks no map entry could locate: look for their records in the segments; the blocks
    /// of those not found are lost.
    fn resolve_from_segments(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let mut found = scan_segments(self.segments, &self.why, &self.expect);
        self.scan_for_bases(&mut found);
        for (vol, block, id) in std::mem::take(&mut self.pending) {
            let kept = match self.waiting.get(&id).or_else(|| found.get(&id)).copied() {
                Some((loc, fp)) if loc.codec.is_delta() => {
                    let scanned = !self.waiting.contains_key(&id) && !self.inserted.contains(id);
                    match self.keep_delta(id, loc, fp, Some(&found))? {
                        deltas::Fate::Kept => {
                            self.report.chunks_from_segments += u64::from(scanned);
                            Ok(())
                        }
                        deltas::Fate::Lost(why) => Err(why),
                        deltas::Fate::Wait => Err(format!("its delta chunk {id} lacks a base")),
                    }
                }
                Some((loc, fp)) => {
                    if !self.inserted.contains(id) {
                        self.new.apply(&JournalRecord::NewChunk { id, loc, fp })?;
                        self.report.chunks_from_segments += 1;
                        self.inserted.add(id);
                    }
                    Ok(())
                }
                None => {
                    let w = self.why.get(&id).map_or("is missing", |w| w.as_str());
                    Err(format!(
                        "its chunk {w} and no valid copy is in the segments"
                    ))
                }
            };
            match kept {
                Ok(()) => self.new.apply(&JournalRecord::MapRun {
                    vol,
                    start: block,
                    entries: vec![id],
                })?,
                Err(why) => {
                    let reason = format!("{why}; {}", self.now_reads);
                    self.lost
                        .give_up(self.new, vol, block, block + 1, &reason)?;
                }
            }
            self.new.pages.evict_to_budget()?;
        }
        Ok(())
    }
}

/// The chunk ids the rebuild has put in the new chunk table: a bitmap below the last id the
/// old table or the batches knew, a set above it (chunks created in damaged batches and
/// found in the segments).
struct Inserted {
    bits: Vec<u64>,
    beyond: std::collections::HashSet<u64>,
}

impl Inserted {
    fn new(next_id: u64) -> Inserted {
        Inserted {
            bits: vec![0u64; next_id.div_ceil(64) as usize],
            beyond: Default::default(),
        }
    }
    fn contains(&self, id: u64) -> bool {
        match self.bits.get((id / 64) as usize) {
            Some(w) => w & (1 << (id % 64)) != 0,
            None => self.beyond.contains(&id),
        }
    }
    fn add(&mut self, id: u64) {
        match self.bits.get_mut((id / 64) as usize) {
            Some(w) => *w |= 1 << (id % 64),
            None => {
                self.beyond.insert(id);
            }
        }
    }
}

/// Write the rebuilt metadata: pages, then a fresh journal, then the root (the switch), then
/// remove the old journals.
fn write_new_state(
    dir: &dyn Dir,
    sb: &Superblock,
    old_root: &Root,
    new: &mut Metadata,
    next_seq: u64,
    crypto: Option<Arc<Crypto>>,
) -> Result<()> {
    let (mut pages, _) = new.pages.prepare_checkpoint()?;
    new.pages.write_pages(&mut pages)?;
    let gen = old_root.journal_gen + 1;
    new.checkpoints += 1;
    let mut root = new.root(gen, next_seq);
    // Units in use: what this rebuild wrote (the old root's pages become free).
    let mut bits: Vec<u64> = root
        .bitmap
        .iter()
        .enumerate()
        .map(|(i, w)| w & !old_root.bitmap.get(i).copied().unwrap_or(0))
        .collect();
    for s in 0..crate::page_alloc::HEADER_UNITS {
        let w = (s / 64) as usize;
        if w >= bits.len() {
            bits.resize(w + 1, 0);
        }
        bits[w] |= 1 << (s % 64);
    }
    root.bitmap = bits;
    root.shared_pages.clear();
    let body = encode_root(&root, &sb.uuid, crypto.as_deref())?;
    let journal = Journal::create(dir, gen, &sb.uuid, next_seq, crypto)?;
    journal
        .file
        .sync()
        .map_err(|e| Error::io("syncing the new journal", e))?;
    new.pages
        .file()
        .sync()
        .map_err(|e| Error::io(format!("syncing {META_NAME}"), e))?;
    dir.sync_dir()
        .map_err(|e| Error::io("syncing the pool directory", e))?;
    crate::copies::write_both(dir, CHECKPOINT_NAME, &body)?;
    for name in dir
        .list(JOURNAL_PREFIX)
        .map_err(|e| Error::io("listing journals", e))?
    {
        if parse_journal_name(&name).is_some_and(|g| g != gen) {
            dir.remove(&name)
                .map_err(|e| Error::io(format!("removing the old journal {name}"), e))?;
        }
    }
    Ok(())
}

/// Where the block-map page holding `block` of `volume` is stored: its byte offset in
/// `meta.dat` (`None` if the page was never written). For tests that damage a page and for
/// diagnosis; the pool's pages must be written (after a checkpoint or close).
pub fn map_page_offset(pool: &Pool, volume: &str, block: u64) -> Result<Option<u64>> {
    let vol = pool.volume_id(volume)?;
    pool.stored_page_offset(u64::from(vol), block / PER)
}

/// [`map_page_offset`] for the chunk-table page holding chunk `id`.
pub fn chunk_page_offset(pool: &Pool, id: u64) -> Result<Option<u64>> {
    pool.stored_page_offset(CHUNK_TREE, crate::chunk_table::page_of(id))
}
