//! The FUSE request handlers: the synthetic root, `volumes/`, `snapshots/` and the `files/`
//! tree.
//!
//! Inode numbers: 1 is the mount root, 2 is `volumes/`, 3 is `files/` (the tree's root), 4 is
//! `snapshots/`; tree inodes are below [`TREE_INO_MAX`] and persistent; volume and snapshot
//! files get numbers above it, handed out in memory for the life of the mount and never reused
//! within it. A snapshot file is a volume file whose name is `VOLUME@SNAPSHOT` (volume names
//! cannot hold '@'); it is read-only whatever the mount, and every change to it or inside
//! `snapshots/` is refused with EROFS.
//!
//! Locks: the tree lock is held for namespace changes and attribute updates, never during
//! volume I/O. A file's content slot (`FileData::slot`) is shared by reads and writes and taken
//! exclusively to grow or shrink the content volume; when both are needed the slot is taken
//! first.

use crate::format::{file_volume_name, Kind, Timestamp, NAME_BYTES_MAX};
use crate::metrics::Op;
use crate::seek::{seek, Whence};
use crate::tree::{errno_of, AttrChange, Released, Tree, FIRST_INO, TREE_INO_MAX, TREE_ROOT};
use crate::FuseError;
use condense_api::{split_snapshot_name, Catalog, ExtentKind, Volume, VolumeError};
use fuser::{
    BsdFileFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, InitFlags, KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate,
    ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyLseek, ReplyOpen, ReplyStatfs,
    ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const ROOT_INO: u64 = 1;
const VOLUMES_INO: u64 = 2;
const SNAPSHOTS_INO: u64 = 4;
const VOLUME_INO_BASE: u64 = TREE_INO_MAX;

/// How long the kernel may cache attributes and names.
const TTL: Duration = Duration::from_secs(1);
/// How long a listing of the pool's snapshots is trusted by getattr, open and read on a
/// snapshot file (readdir and lookup in `snapshots/` always list afresh): a snapshot deleted
/// while mounted fails with ENOENT within this time, even on a file already open.
const SNAPSHOTS_TTL: Duration = Duration::from_secs(1);
/// How long a computed `st_blocks` is reused.
const BLOCKS_TTL: Duration = Duration::from_secs(1);
/// Preferred I/O size reported in `st_blksize` (cp and friends size their buffers by it).
const IO_BYTES: u32 = 1 << 20;
/// Largest write the kernel sends in one request.
const MAX_WRITE_BYTES: u32 = 1 << 20;
/// A content volume grows to at least this many times its capacity...
const GROW_FACTOR: u64 = 4;
/// ...but by no more than this at once...
const GROW_STEP_BYTES_MAX: u64 = 4 << 30;
/// ...and, once it holds more than a block, to no less than this. Each growth is a
/// `Catalog::resize`, which may flush the pool: few and large steps keep appends fast, and
/// capacity that is never written costs nothing (volumes are thin).
const GROW_BYTES_MIN: u64 = 1 << 20;
/// Largest file under `files/`.
const FILE_BYTES_MAX: u64 = 1 << 50;

const _: () = assert!(VOLUME_INO_BASE > TREE_ROOT);
const _: () = assert!(SNAPSHOTS_INO > TREE_ROOT && SNAPSHOTS_INO < FIRST_INO);
const _: () = assert!(GROW_STEP_BYTES_MAX < FILE_BYTES_MAX);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock means a handler panicked; the state it guards is still consistent
    // (every change is applied before anything that can panic), so keep serving.
    m.lock().unwrap_or_else(|e| e.into_inner())
}
fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}
fn write<T>(m: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|e| e.into_inner())
}

fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to).saturating_mul(to)
}

/// The content volume of one file under `files/`.
#[derive(Default)]
struct Slot {
    loaded: bool,
    vol: Option<Arc<dyn Volume>>,
    /// The volume's size: bytes at and past it read as zeros.
    capacity: u64,
}

#[derive(Default)]
struct FileData {
    slot: RwLock<Slot>,
}

/// A file under `volumes/` or `snapshots/`.
struct VolEntry {
    /// The volume's name, or `VOLUME@SNAPSHOT` for a snapshot.
    name: String,
    vol: Option<Arc<dyn Volume>>,
    /// Last write through the mount (volumes), or the creation time (snapshots).
    mtime: SystemTime,
}

#[derive(Default)]
struct VolTable {
    by_name: HashMap<String, u64>,
    by_ino: HashMap<u64, VolEntry>,
    next: u64,
    /// When the snapshot entries were last reconciled with `Catalog::snapshots`.
    snapshots_listed: Option<Instant>,
}

impl VolTable {
    /// A new inode number for `name`.
    fn insert(&mut self, name: &str, mtime: SystemTime) -> u64 {
        let ino = self.next;
        self.next += 1;
        self.by_name.insert(name.to_string(), ino);
        self.by_ino.insert(
            ino,
            VolEntry {
                name: name.to_string(),
                vol: None,
                mtime,
            },
        );
        ino
    }

    fn forget(&mut self, ino: u64) {
        if let Some(entry) = self.by_ino.remove(&ino) {
            if self.by_name.get(&entry.name) == Some(&ino) {
                self.by_name.remove(&entry.name);
            }
        }
    }
}

/// True for the name of a snapshot (`VOLUME@SNAPSHOT`); volume names cannot hold '@'.
fn is_snapshot(name: &str) -> bool {
    split_snapshot_name(name).is_some()
}

/// Shared state of a mount.
pub struct Inner {
    catalog: Arc<dyn Catalog>,
    read_only: bool,
    block_bytes: u64,
    uid: u32,
    gid: u32,
    /// Taken away from the modes of the mount's own directories and volume files.
    umask: u32,
    started: SystemTime,
    /// Reads and writes counted for monitoring.
    pub metrics: Arc<crate::metrics::FuseMetrics>,
    tree: Mutex<Tree>,
    files: Mutex<HashMap<u64, Arc<FileData>>>,
    vols: Mutex<VolTable>,
    /// Serializes listing the snapshots and reconciling the table with the listing, so that an
    /// older listing never undoes a newer one.
    snapshots_relist: Mutex<()>,
    blocks: Mutex<HashMap<u64, (Instant, u64)>>,
}

/// What an inode number names.
enum Target {
    Root,
    VolumesDir,
    SnapshotsDir,
    /// A file under `volumes/` or `snapshots/`.
    Volume,
    Tree,
}

fn target(ino: u64) -> Target {
    match ino {
        ROOT_INO => Target::Root,
        VOLUMES_INO => Target::VolumesDir,
        SNAPSHOTS_INO => Target::SnapshotsDir,
        i if i >= VOLUME_INO_BASE => Target::Volume,
        _ => Target::Tree,
    }
}

impl Inner {
    pub fn new(catalog: Arc<dyn Catalog>, read_only: bool, umask: u32) -> Result<Inner, FuseError> {
        let uid = nix::unistd::geteuid().as_raw();
        let gid = nix::unistd::getegid().as_raw();
        let block_bytes = u64::from(catalog.usage()?.block_size.max(512));
        let tree = Tree::load(catalog.clone(), read_only, uid, gid)?;
        Ok(Inner {
            catalog,
            read_only,
            block_bytes,
            uid,
            gid,
            umask: umask & 0o777,
            started: SystemTime::now(),
            metrics: Default::default(),
            tree: Mutex::new(tree),
            files: Mutex::new(HashMap::new()),
            vols: Mutex::new(VolTable {
                next: VOLUME_INO_BASE,
                ..VolTable::default()
            }),
            snapshots_relist: Mutex::new(()),
            blocks: Mutex::new(HashMap::new()),
        })
    }

    /// Write every changed inode and make everything durable.
    pub fn sync(&self) -> Result<(), FuseError> {
        lock(&self.tree).persist_all()?;
        if !self.read_only {
            self.catalog.flush()?;
        }
        Ok(())
    }

    fn writable(&self) -> Result<(), Errno> {
        if self.read_only {
            Err(Errno::EROFS)
        } else {
            Ok(())
        }
    }

    // ---- attributes ----

    /// `mode` less the mount's umask, for the mount's own directories and volume files.
    fn perm(&self, mode: u32) -> u16 {
        (mode & !self.umask) as u16
    }

    fn dir_attr(&self, ino: u64, nlink: u32) -> FileAttr {
        FileAttr {
            ino: INodeNo(ino),
            size: 0,
            blocks: 0,
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
            crtime: self.started,
            kind: FileType::Directory,
            perm: self.perm(0o777),
            nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: IO_BYTES,
            flags: 0,
        }
    }

    /// 512-byte units of data a volume holds in its first `len` bytes (the `du` figure).
    ///
    /// This counts the blocks whose block status is Data: the logical bytes stored, before
    /// deduplication and compression shrink them. A block shared with other files counts in
    /// full for each of them, as on a file system with reflinks.
    fn blocks_of(&self, ino: u64, vol: &dyn Volume, len: u64) -> u64 {
        if let Some(&(at, blocks)) = lock(&self.blocks).get(&ino) {
            if at.elapsed() < BLOCKS_TTL {
                return blocks;
            }
        }
        let len = len.min(vol.size());
        // The physical share after dedup and compression when the store knows it; otherwise
        // the data blocks (before dedup).
        let bytes: u64 = match vol.physical_bytes().map(Ok).unwrap_or_else(|| {
            vol.block_status(0, len).map(|extents| {
                extents
                    .iter()
                    .filter(|e| e.kind == ExtentKind::Data)
                    .map(|e| e.len)
                    .sum()
            })
        }) {
            Ok(bytes) => bytes,
            Err(e) => {
                tracing::warn!("block status of {}: {e}", vol.name());
                0
            }
        };
        let blocks = bytes.div_ceil(512);
        lock(&self.blocks).insert(ino, (Instant::now(), blocks));
        blocks
    }

    fn forget_blocks(&self, ino: u64) {
        lock(&self.blocks).remove(&ino);
    }

    fn attr(&self, ino: u64) -> Result<FileAttr, Errno> {
        match target(ino) {
            Target::Root => Ok(self.dir_attr(ROOT_INO, 5)),
            Target::VolumesDir => Ok(self.dir_attr(VOLUMES_INO, 2)),
            Target::SnapshotsDir => Ok(self.dir_attr(SNAPSHOTS_INO, 2)),
            Target::Volume => self.volume_attr(ino),
            Target::Tree => self.tree_attr(ino),
        }
    }

    fn volume_attr(&self, ino: u64) -> Result<FileAttr, Errno> {
        let (name, vol, mtime) = self.volume(ino)?;
        let size = vol.size();
        let snapshot = is_snapshot(&name);
        let writable = !self.read_only && !vol.is_read_only() && !snapshot;
        Ok(FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: self.blocks_of(ino, &*vol, size),
            atime: mtime,
            mtime,
            ctime: mtime,
            crtime: if snapshot { mtime } else { self.started },
            kind: FileType::RegularFile,
            perm: self.perm(if writable { 0o666 } else { 0o444 }),
            nlink: 1,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: IO_BYTES,
            flags: 0,
        })
    }

    fn tree_attr(&self, ino: u64) -> Result<FileAttr, Errno> {
        let (rec, nlink) = {
            let tree = lock(&self.tree);
            let node = tree.node(ino)?;
            let nlink = match node.rec.kind {
                Kind::Dir => 2u32.saturating_add(tree.subdirs(ino)),
                _ if node.unlinked => 0,
                _ => 1,
            };
            (node.rec.clone(), nlink)
        };
        let blocks = if rec.kind == Kind::File {
            let data = self.file_data(ino);
            let slot = self.loaded_slot(ino, &data)?;
            match &slot.vol {
                Some(vol) => self.blocks_of(ino, &**vol, round_up(rec.size, self.block_bytes)),
                None => 0,
            }
        } else {
            0
        };
        Ok(FileAttr {
            ino: INodeNo(ino),
            size: rec.size,
            blocks,
            atime: rec.atime.to_system(),
            mtime: rec.mtime.to_system(),
            ctime: rec.ctime.to_system(),
            crtime: rec.ctime.to_system(),
            kind: match rec.kind {
                Kind::Dir => FileType::Directory,
                Kind::File => FileType::RegularFile,
                Kind::Symlink => FileType::Symlink,
            },
            perm: (rec.mode & 0o7777) as u16,
            nlink,
            uid: rec.uid,
            gid: rec.gid,
            rdev: 0,
            blksize: IO_BYTES,
            flags: 0,
        })
    }

    // ---- volumes/ ----

    fn volume_ino(&self, name: &str) -> u64 {
        let mut t = lock(&self.vols);
        if let Some(&ino) = t.by_name.get(name) {
            return ino;
        }
        t.insert(name, self.started)
    }

    /// The volume behind a volume or snapshot file, opened on first use. A snapshot file is
    /// checked against a listing of the pool's snapshots at most [`SNAPSHOTS_TTL`] old: one
    /// that was deleted is forgotten and ENOENT.
    fn volume(&self, ino: u64) -> Result<(String, Arc<dyn Volume>, SystemTime), Errno> {
        let stale_snapshot = {
            let t = lock(&self.vols);
            let entry = t.by_ino.get(&ino).ok_or(Errno::ENOENT)?;
            is_snapshot(&entry.name)
                && t.snapshots_listed
                    .is_none_or(|at| at.elapsed() >= SNAPSHOTS_TTL)
        };
        if stale_snapshot {
            self.snapshot_refresh()?;
        }
        let name = {
            let t = lock(&self.vols);
            let entry = t.by_ino.get(&ino).ok_or(Errno::ENOENT)?;
            if let Some(vol) = &entry.vol {
                return Ok((entry.name.clone(), vol.clone(), entry.mtime));
            }
            entry.name.clone()
        };
        match self.catalog.open(&name) {
            Ok(vol) => {
                let mut t = lock(&self.vols);
                let entry = t.by_ino.get_mut(&ino).ok_or(Errno::ENOENT)?;
                let vol = entry.vol.get_or_insert(vol).clone();
                Ok((name, vol, entry.mtime))
            }
            Err(e) => Err(self.volume_error(ino, &e)),
        }
    }

    /// The errno of a failed volume operation; a volume that vanished is forgotten.
    fn volume_error(&self, ino: u64, e: &VolumeError) -> Errno {
        if matches!(e, VolumeError::NotFound(_)) {
            lock(&self.vols).forget(ino);
        } else {
            tracing::warn!("volume I/O: {e}");
        }
        errno_of(e)
    }

    fn volume_touched(&self, ino: u64) {
        if let Some(entry) = lock(&self.vols).by_ino.get_mut(&ino) {
            entry.mtime = SystemTime::now();
        }
    }

    fn volume_lookup(&self, name: &[u8]) -> Result<u64, Errno> {
        if name.len() > NAME_BYTES_MAX {
            return Err(Errno::ENAMETOOLONG);
        }
        let name = std::str::from_utf8(name).map_err(|_| Errno::ENOENT)?;
        // Snapshots are shown under snapshots/ only.
        if name.starts_with('.') || is_snapshot(name) {
            return Err(Errno::ENOENT);
        }
        if let Some(&ino) = lock(&self.vols).by_name.get(name) {
            return Ok(ino);
        }
        // Not seen yet: it exists if it opens.
        match self.catalog.open(name) {
            Ok(vol) => {
                let ino = self.volume_ino(name);
                if let Some(entry) = lock(&self.vols).by_ino.get_mut(&ino) {
                    entry.vol.get_or_insert(vol);
                }
                Ok(ino)
            }
            Err(e) => Err(errno_of(&e)),
        }
    }

    fn volume_names(&self) -> Result<Vec<(u64, String)>, Errno> {
        let list = self.catalog.list().map_err(|e| errno_of(&e))?;
        Ok(list
            .into_iter()
            .filter(|v| !v.name.starts_with('.') && !is_snapshot(&v.name))
            .map(|v| (self.volume_ino(&v.name), v.name))
            .collect())
    }

    // ---- snapshots/ ----

    /// The snapshots `snapshots/` shows (all but those of hidden volumes), with their inode
    /// numbers, listed afresh. Snapshot files no longer listed are forgotten (their inode
    /// numbers answer ENOENT from now on), and a name listed with another creation time than
    /// before (deleted and taken again) gets a new inode number.
    fn snapshot_list(&self) -> Result<Vec<(u64, String)>, Errno> {
        let _serial = lock(&self.snapshots_relist);
        self.snapshot_list_locked()
    }

    /// List the snapshots again unless another thread did in the last [`SNAPSHOTS_TTL`].
    fn snapshot_refresh(&self) -> Result<(), Errno> {
        let _serial = lock(&self.snapshots_relist);
        let fresh = lock(&self.vols)
            .snapshots_listed
            .is_some_and(|at| at.elapsed() < SNAPSHOTS_TTL);
        if !fresh {
            self.snapshot_list_locked()?;
        }
        Ok(())
    }

    /// [`Inner::snapshot_list`] with `snapshots_relist` held.
    fn snapshot_list_locked(&self) -> Result<Vec<(u64, String)>, Errno> {
        let list = self.catalog.snapshots().map_err(|e| {
            tracing::warn!("listing snapshots: {e}");
            errno_of(&e)
        })?;
        let mut t = lock(&self.vols);
        let mut out = Vec::with_capacity(list.len());
        let mut listed = HashSet::with_capacity(list.len());
        for info in list {
            if info.volume.starts_with('.') {
                continue;
            }
            let name = info.full_name();
            let created = UNIX_EPOCH + Duration::from_secs(info.created_unix);
            let known = t.by_name.get(&name).copied().filter(|ino| {
                t.by_ino
                    .get(ino)
                    .is_some_and(|entry| entry.mtime == created)
            });
            let ino = match known {
                Some(ino) => ino,
                None => {
                    if let Some(old) = t.by_name.get(&name).copied() {
                        t.forget(old);
                    }
                    t.insert(&name, created)
                }
            };
            listed.insert(ino);
            out.push((ino, name));
        }
        let gone: Vec<u64> = t
            .by_ino
            .iter()
            .filter(|(ino, entry)| is_snapshot(&entry.name) && !listed.contains(*ino))
            .map(|(&ino, _)| ino)
            .collect();
        for ino in gone {
            t.forget(ino);
        }
        t.snapshots_listed = Some(Instant::now());
        Ok(out)
    }

    fn snapshot_lookup(&self, name: &[u8]) -> Result<u64, Errno> {
        if name.len() > NAME_BYTES_MAX {
            return Err(Errno::ENAMETOOLONG);
        }
        let name = std::str::from_utf8(name).map_err(|_| Errno::ENOENT)?;
        if !is_snapshot(name) || name.starts_with('.') {
            return Err(Errno::ENOENT);
        }
        self.snapshot_list()?
            .into_iter()
            .find(|(_, n)| n == name)
            .map(|(ino, _)| ino)
            .ok_or(Errno::ENOENT)
    }

    /// True if `ino` is a snapshot file.
    fn is_snapshot_ino(&self, ino: u64) -> bool {
        lock(&self.vols)
            .by_ino
            .get(&ino)
            .is_some_and(|entry| is_snapshot(&entry.name))
    }

    // ---- files/ content ----

    fn file_data(&self, ino: u64) -> Arc<FileData> {
        lock(&self.files).entry(ino).or_default().clone()
    }

    /// The slot of file `ino`, with its volume looked up.
    fn loaded_slot<'a>(
        &self,
        ino: u64,
        data: &'a FileData,
    ) -> Result<RwLockReadGuard<'a, Slot>, Errno> {
        {
            let slot = read(&data.slot);
            if slot.loaded {
                return Ok(slot);
            }
        }
        self.load_slot(ino, &mut write(&data.slot))?;
        Ok(read(&data.slot))
    }

    fn load_slot(&self, ino: u64, slot: &mut Slot) -> Result<(), Errno> {
        if slot.loaded {
            return Ok(());
        }
        match self.catalog.open(&file_volume_name(ino)) {
            Ok(vol) => {
                slot.capacity = vol.size();
                slot.vol = Some(vol);
            }
            Err(VolumeError::NotFound(_)) => {
                slot.capacity = 0;
                slot.vol = None;
            }
            Err(e) => return Err(errno_of(&e)),
        }
        slot.loaded = true;
        Ok(())
    }

    /// Make the content volume of `ino` at least `end` bytes long. A new volume is just big
    /// enough; an existing one grows by [`GROW_FACTOR`] (by at most [`GROW_STEP_BYTES_MAX`], to
    /// at least [`GROW_BYTES_MIN`]) so that appends resize it rarely.
    fn grow(&self, ino: u64, slot: &mut Slot, end: u64) -> Result<(), Errno> {
        self.load_slot(ino, slot)?;
        if end <= slot.capacity {
            return Ok(());
        }
        let name = file_volume_name(ino);
        let wanted = if slot.vol.is_none() {
            end
        } else {
            let step = slot
                .capacity
                .saturating_mul(GROW_FACTOR)
                .min(end + GROW_STEP_BYTES_MAX)
                .max(GROW_BYTES_MIN);
            end.max(step)
        };
        let capacity = round_up(wanted, self.block_bytes).max(self.block_bytes);
        let result = match &slot.vol {
            None => self.catalog.create(&name, capacity),
            Some(_) => self.catalog.resize(&name, capacity, false),
        };
        result.map_err(|e| {
            tracing::warn!("growing {name} to {capacity} bytes: {e}");
            errno_of(&e)
        })?;
        let vol = match &slot.vol {
            // A handle that already sees the new size is kept.
            Some(vol) if vol.size() >= capacity => vol.clone(),
            _ => self.catalog.open(&name).map_err(|e| errno_of(&e))?,
        };
        slot.capacity = vol.size();
        slot.vol = Some(vol);
        if slot.capacity < end {
            return Err(Errno::EFBIG);
        }
        Ok(())
    }

    fn file_read(&self, ino: u64, offset: u64, size: u32) -> Result<Vec<u8>, Errno> {
        let data = self.file_data(ino);
        let slot = self.loaded_slot(ino, &data)?;
        let file_len = lock(&self.tree).node(ino)?.rec.size;
        if offset >= file_len {
            return Ok(Vec::new());
        }
        let n = u64::from(size).min(file_len - offset);
        let mut buf = vec![0u8; n as usize];
        if let Some(vol) = &slot.vol {
            let backed = slot.capacity.saturating_sub(offset).min(n) as usize;
            if backed > 0 {
                vol.read(offset, &mut buf[..backed])
                    .map_err(|e| errno_of(&e))?;
            }
        }
        Ok(buf)
    }

    fn file_write(&self, ino: u64, offset: u64, bytes: &[u8], fua: bool) -> Result<u32, Errno> {
        self.writable()?;
        let len = bytes.len() as u64;
        let end = offset.checked_add(len).ok_or(Errno::EFBIG)?;
        if end > FILE_BYTES_MAX {
            return Err(Errno::EFBIG);
        }
        let data = self.file_data(ino);
        let slot = self.loaded_slot(ino, &data)?;
        let slot = if end <= slot.capacity {
            slot
        } else {
            drop(slot);
            self.grow(ino, &mut write(&data.slot), end)?;
            read(&data.slot)
        };
        let vol = slot.vol.as_ref().ok_or(Errno::EIO)?;
        vol.write(offset, bytes, fua).map_err(|e| errno_of(&e))?;
        // Still under the slot: a truncate cannot slip between the write and the new length.
        lock(&self.tree).wrote(ino, end)?;
        drop(slot);
        self.forget_blocks(ino);
        u32::try_from(len).map_err(|_| Errno::EINVAL)
    }

    /// Set the length of file `ino`; bytes past the new end are released.
    fn file_truncate(&self, ino: u64, new_len: u64) -> Result<(), Errno> {
        self.writable()?;
        if new_len > FILE_BYTES_MAX {
            return Err(Errno::EFBIG);
        }
        let data = self.file_data(ino);
        let mut slot = write(&data.slot);
        self.load_slot(ino, &mut slot)?;
        let old_len = lock(&self.tree).node(ino)?.rec.size;
        if new_len < old_len {
            if let Some(vol) = slot.vol.clone() {
                // Keep the invariant "bytes past the length read as zeros" before the new length
                // is recorded, so that a crash in between shows zeros, never old bytes.
                let used_end = round_up(old_len, self.block_bytes).min(slot.capacity);
                if new_len < used_end {
                    vol.trim(new_len, used_end - new_len, false)
                        .map_err(|e| errno_of(&e))?;
                }
                let needed = round_up(new_len, self.block_bytes).max(self.block_bytes);
                if slot.capacity > needed.saturating_mul(2) {
                    let name = file_volume_name(ino);
                    self.catalog
                        .resize(&name, needed, true)
                        .map_err(|e| errno_of(&e))?;
                    let vol = self.catalog.open(&name).map_err(|e| errno_of(&e))?;
                    slot.capacity = vol.size();
                    slot.vol = Some(vol);
                }
            }
            self.forget_blocks(ino);
        }
        // Growing needs no volume change: bytes past the capacity read as zeros.
        let mut tree = lock(&self.tree);
        tree.set_size(ino, new_len, true)?;
        tree.persist(ino)
    }

    fn file_fallocate(&self, ino: u64, offset: u64, length: u64, mode: i32) -> Result<(), Errno> {
        self.writable()?;
        let end = offset.checked_add(length).ok_or(Errno::EFBIG)?;
        if end > FILE_BYTES_MAX {
            return Err(Errno::EFBIG);
        }
        let keep_size = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        let data = self.file_data(ino);
        let slot = self.loaded_slot(ino, &data)?;
        let op = mode & !libc::FALLOC_FL_KEEP_SIZE;
        let backed_end = end.min(slot.capacity);
        match op {
            // Thin: nothing to reserve.
            0 => {}
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE => {
                if op == libc::FALLOC_FL_PUNCH_HOLE && !keep_size {
                    return Err(Errno::EOPNOTSUPP);
                }
                if let (Some(vol), true) = (&slot.vol, offset < backed_end) {
                    let r = if op == libc::FALLOC_FL_PUNCH_HOLE {
                        vol.trim(offset, backed_end - offset, false)
                    } else {
                        vol.write_zeroes(offset, backed_end - offset, false, false)
                    };
                    r.map_err(|e| errno_of(&e))?;
                }
                self.forget_blocks(ino);
            }
            _ => return Err(Errno::EOPNOTSUPP),
        }
        let mut tree = lock(&self.tree);
        let len = tree.node(ino)?.rec.size;
        if !keep_size && end > len {
            tree.set_size(ino, end, true)?;
        } else if op != 0 {
            tree.wrote(ino, len)?;
        }
        drop(tree);
        drop(slot);
        Ok(())
    }

    fn file_seek(&self, ino: u64, offset: u64, whence: Whence) -> Result<u64, Errno> {
        let data = self.file_data(ino);
        let slot = self.loaded_slot(ino, &data)?;
        let len = lock(&self.tree).node(ino)?.rec.size;
        let mapped = if slot.vol.is_some() { slot.capacity } else { 0 };
        seek(offset, len, mapped, whence, |o, l| match &slot.vol {
            Some(vol) => vol.block_status(o, l),
            None => Ok(Vec::new()),
        })
    }

    /// Delete content volumes of inodes that are gone.
    fn release(&self, released: Released) {
        for name in released.volumes {
            if let Some(ino) = crate::format::parse_file_volume_name(&name) {
                lock(&self.files).remove(&ino);
                self.forget_blocks(ino);
            }
            match self.catalog.delete(&name) {
                Ok(()) | Err(VolumeError::NotFound(_)) => {}
                // Left behind; the next mount deletes it as an orphan.
                Err(e) => tracing::warn!("deleting content volume {name}: {e}"),
            }
        }
    }

    fn flush_pool(&self) -> Result<(), Errno> {
        if self.read_only {
            return Ok(());
        }
        self.catalog.flush().map_err(|e| errno_of(&e))
    }
}

/// The FUSE file system; cheap to clone handles onto one [`Inner`].
pub struct Fs {
    pub inner: Arc<Inner>,
    /// Ask for the kernel's writeback cache at INIT ([`crate::MountOptions::writeback_cache`]);
    /// after INIT, whether the kernel granted it.
    pub writeback_cache: bool,
}

fn entry_reply(reply: ReplyEntry, r: Result<FileAttr, Errno>) {
    match r {
        Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
        Err(e) => reply.error(e),
    }
}

fn empty_reply(reply: ReplyEmpty, r: Result<(), Errno>) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(e),
    }
}

fn refuse_here(what: &str, parent: u64) -> Errno {
    if parent == SNAPSHOTS_INO {
        return Errno::EROFS;
    }
    if parent == VOLUMES_INO {
        tracing::info!(
            "{what} in volumes/ refused: manage volumes with `condense volume create/delete`"
        );
    }
    Errno::EPERM
}

fn timestamp(t: TimeOrNow) -> Timestamp {
    match t {
        TimeOrNow::Now => Timestamp::now(),
        TimeOrNow::SpecificTime(t) => Timestamp::from_system(t),
    }
}

impl Fs {
    fn create_node(
        &self,
        req: &Request,
        parent: u64,
        name: &OsStr,
        kind: Kind,
        mode: u32,
        link_target: &[u8],
    ) -> Result<FileAttr, Errno> {
        let inner = &self.inner;
        if !matches!(target(parent), Target::Tree) {
            if name.len() > NAME_BYTES_MAX {
                return Err(Errno::ENAMETOOLONG);
            }
            return Err(refuse_here("creating", parent));
        }
        inner.writable()?;
        let ino = lock(&inner.tree).create(
            parent,
            name.as_bytes(),
            kind,
            mode,
            req.uid(),
            req.gid(),
            link_target,
        )?;
        inner.attr(ino)
    }
}

impl Filesystem for Fs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if let Err(nearest) = config.set_max_write(MAX_WRITE_BYTES) {
            let _ = config.set_max_write(nearest);
        }
        if let Err(nearest) = config.set_max_readahead(MAX_WRITE_BYTES) {
            let _ = config.set_max_readahead(nearest);
        }
        if self.writeback_cache {
            match config.add_capabilities(InitFlags::FUSE_WRITEBACK_CACHE) {
                Ok(()) => tracing::info!("kernel writeback cache on (files/ only)"),
                Err(_) => {
                    tracing::warn!("the kernel has no FUSE writeback cache: mounting without it");
                    self.writeback_cache = false;
                }
            }
            // volumes/ files are opened in direct-I/O mode then (see `open`); this keeps
            // mmap working on them (Linux 6.6 and later; refused with ENODEV before).
            if self.writeback_cache {
                let _ = config.add_capabilities(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP);
            }
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let inner = &self.inner;
        let name = name.as_bytes();
        let r = match target(parent.0) {
            Target::Root => match name {
                b"volumes" => inner.attr(VOLUMES_INO),
                b"files" => inner.attr(TREE_ROOT),
                b"snapshots" => inner.attr(SNAPSHOTS_INO),
                _ if name.len() > NAME_BYTES_MAX => Err(Errno::ENAMETOOLONG),
                _ => Err(Errno::ENOENT),
            },
            Target::VolumesDir => inner.volume_lookup(name).and_then(|ino| inner.attr(ino)),
            Target::SnapshotsDir => inner.snapshot_lookup(name).and_then(|ino| inner.attr(ino)),
            Target::Volume => Err(Errno::ENOTDIR),
            Target::Tree => {
                // The tree lock must be released before attr() takes it again.
                let found = lock(&inner.tree).lookup(parent.0, name);
                found.and_then(|ino| inner.attr(ino))
            }
        };
        entry_reply(reply, r);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.inner.attr(ino.0) {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let inner = &self.inner;
        let r = (|| {
            inner.writable()?;
            match target(ino.0) {
                Target::Root | Target::VolumesDir => return Err(Errno::EPERM),
                Target::SnapshotsDir => return Err(Errno::EROFS),
                Target::Volume => {
                    let (name, vol, _) = inner.volume(ino.0)?;
                    if is_snapshot(&name) {
                        return Err(Errno::EROFS);
                    }
                    if let Some(size) = size {
                        if size != vol.size() {
                            tracing::warn!(
                                "truncating volumes/{name} to {size} bytes refused: \
                                 resize it with `condense volume resize {name} SIZE`"
                            );
                            return Err(Errno::EPERM);
                        }
                    }
                    if mode.is_some() || uid.is_some() || gid.is_some() {
                        return Err(Errno::EPERM);
                    }
                    // Times of a volume file are not stored; accept and ignore them.
                }
                Target::Tree => {
                    if let Some(size) = size {
                        if lock(&inner.tree).node(ino.0)?.rec.kind != Kind::File {
                            return Err(Errno::EISDIR);
                        }
                        inner.file_truncate(ino.0, size)?;
                    }
                    let change = AttrChange {
                        mode,
                        uid,
                        gid,
                        atime: atime.map(timestamp),
                        mtime: mtime.map(timestamp),
                    };
                    if mode.is_some()
                        || uid.is_some()
                        || gid.is_some()
                        || atime.is_some()
                        || mtime.is_some()
                    {
                        lock(&inner.tree).set_attr(ino.0, change)?;
                    }
                }
            }
            inner.attr(ino.0)
        })();
        match r {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let tree = lock(&self.inner.tree);
        match tree.node(ino.0) {
            Ok(n) if n.rec.kind == Kind::Symlink => reply.data(&n.rec.target),
            Ok(_) => reply.error(Errno::EINVAL),
            Err(e) => reply.error(e),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        if mode & libc::S_IFMT != libc::S_IFREG {
            reply.error(Errno::EPERM);
            return;
        }
        let r = self.create_node(req, parent.0, name, Kind::File, mode & !umask, b"");
        entry_reply(reply, r);
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let r = self.create_node(req, parent.0, name, Kind::Dir, mode & !umask, b"");
        entry_reply(reply, r);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let inner = &self.inner;
        let r = match target(parent.0) {
            Target::Tree => inner.writable().and_then(|()| {
                let released = lock(&inner.tree).remove(parent.0, name.as_bytes(), false)?;
                inner.release(released);
                Ok(())
            }),
            _ => Err(refuse_here("removing", parent.0)),
        };
        empty_reply(reply, r);
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let inner = &self.inner;
        let r = match target(parent.0) {
            Target::Tree => inner.writable().and_then(|()| {
                let released = lock(&inner.tree).remove(parent.0, name.as_bytes(), true)?;
                inner.release(released);
                Ok(())
            }),
            _ => Err(refuse_here("removing", parent.0)),
        };
        empty_reply(reply, r);
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let r = self.create_node(
            req,
            parent.0,
            link_name,
            Kind::Symlink,
            0o777,
            target.as_os_str().as_bytes(),
        );
        entry_reply(reply, r);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let inner = &self.inner;
        let r = (|| {
            inner.writable()?;
            if parent.0 == SNAPSHOTS_INO || newparent.0 == SNAPSHOTS_INO {
                return Err(Errno::EROFS);
            }
            match (target(parent.0), target(newparent.0)) {
                (Target::Tree, Target::Tree) => {}
                (Target::Tree, _) | (_, Target::Tree) => return Err(Errno::EXDEV),
                _ => return Err(refuse_here("renaming", parent.0)),
            }
            if flags.contains(RenameFlags::RENAME_EXCHANGE)
                || flags.contains(RenameFlags::RENAME_WHITEOUT)
            {
                return Err(Errno::EINVAL);
            }
            let released = lock(&inner.tree).rename(
                parent.0,
                name.as_bytes(),
                newparent.0,
                newname.as_bytes(),
                flags.contains(RenameFlags::RENAME_NOREPLACE),
            )?;
            inner.release(released);
            Ok(())
        })();
        empty_reply(reply, r);
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let inner = &self.inner;
        let wants_write = flags.0 & libc::O_ACCMODE != libc::O_RDONLY;
        let r = (|| {
            if wants_write {
                inner.writable()?;
            }
            match target(ino.0) {
                Target::Volume => {
                    let (name, vol, _) = inner.volume(ino.0)?;
                    let snapshot = is_snapshot(&name);
                    if wants_write && (vol.is_read_only() || snapshot) {
                        return Err(Errno::EROFS);
                    }
                    // With the writeback cache the kernel would own a cached file's size:
                    // a write past a volume's end would succeed into the cache (the file
                    // growing past the volume) and fail only at writeback, and data written
                    // would wait in the kernel, unseen by a snapshot taken through the
                    // control socket. A volume's file bypasses the page cache instead.
                    if self.writeback_cache && !snapshot {
                        Ok(FopenFlags::FOPEN_DIRECT_IO)
                    } else {
                        Ok(FopenFlags::empty())
                    }
                }
                Target::Tree => {
                    let mut tree = lock(&inner.tree);
                    if tree.node(ino.0)?.rec.kind != Kind::File {
                        return Err(Errno::EISDIR);
                    }
                    tree.opened(ino.0)?;
                    Ok(FopenFlags::empty())
                }
                _ => Err(Errno::EISDIR),
            }
        })();
        match r {
            Ok(flags) => reply.opened(FileHandle(0), flags),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let inner = &self.inner;
        let started = std::time::Instant::now();
        let r = match target(ino.0) {
            Target::Volume => inner.volume(ino.0).and_then(|(_, vol, _)| {
                let vsize = vol.size();
                if offset >= vsize {
                    return Ok(Vec::new());
                }
                let n = u64::from(size).min(vsize - offset) as usize;
                let mut buf = vec![0u8; n];
                vol.read(offset, &mut buf)
                    .map_err(|e| inner.volume_error(ino.0, &e))?;
                Ok(buf)
            }),
            Target::Tree => inner.file_read(ino.0, offset, size),
            _ => Err(Errno::EISDIR),
        };
        let bytes = r.as_ref().ok().map(|b| b.len() as u64);
        inner.metrics.done(Op::Read, bytes, started.elapsed());
        match r {
            Ok(buf) => reply.data(&buf),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let inner = &self.inner;
        let started = std::time::Instant::now();
        let fua = flags.0 & (libc::O_SYNC | libc::O_DSYNC) != 0;
        let r = match target(ino.0) {
            Target::Volume => inner.writable().and_then(|()| {
                let (_, vol, _) = inner.volume(ino.0)?;
                vol.write(offset, data, fua)
                    .map_err(|e| inner.volume_error(ino.0, &e))?;
                inner.volume_touched(ino.0);
                inner.forget_blocks(ino.0);
                u32::try_from(data.len()).map_err(|_| Errno::EINVAL)
            }),
            Target::Tree => inner.file_write(ino.0, offset, data, fua),
            _ => Err(Errno::EISDIR),
        };
        let bytes = r.as_ref().ok().map(|&n| u64::from(n));
        inner.metrics.done(Op::Write, bytes, started.elapsed());
        match r {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let inner = &self.inner;
        let r = match target(ino.0) {
            Target::Tree => (|| {
                let released = lock(&inner.tree).closed(ino.0)?;
                inner.release(released);
                Ok(())
            })(),
            _ => Ok(()),
        };
        empty_reply(reply, r);
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let inner = &self.inner;
        let r = match target(ino.0) {
            Target::Volume => inner.volume(ino.0).and_then(|(name, vol, _)| {
                if inner.read_only || is_snapshot(&name) {
                    return Ok(());
                }
                vol.flush().map_err(|e| inner.volume_error(ino.0, &e))
            }),
            Target::Tree => (|| {
                lock(&inner.tree).persist(ino.0)?;
                inner.flush_pool()
            })(),
            _ => Ok(()),
        };
        empty_reply(reply, r);
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let inner = &self.inner;
        let entries: Result<Vec<(u64, FileType, Vec<u8>)>, Errno> = match target(ino.0) {
            Target::Root => Ok(vec![
                (ROOT_INO, FileType::Directory, b".".to_vec()),
                (ROOT_INO, FileType::Directory, b"..".to_vec()),
                (VOLUMES_INO, FileType::Directory, b"volumes".to_vec()),
                (TREE_ROOT, FileType::Directory, b"files".to_vec()),
                (SNAPSHOTS_INO, FileType::Directory, b"snapshots".to_vec()),
            ]),
            Target::SnapshotsDir => inner.snapshot_list().map(|names| {
                let mut out = vec![
                    (SNAPSHOTS_INO, FileType::Directory, b".".to_vec()),
                    (ROOT_INO, FileType::Directory, b"..".to_vec()),
                ];
                out.extend(
                    names
                        .into_iter()
                        // A name too long for a directory entry cannot be looked up either.
                        .filter(|(_, n)| n.len() <= NAME_BYTES_MAX)
                        .map(|(i, n)| (i, FileType::RegularFile, n.into_bytes())),
                );
                out
            }),
            Target::VolumesDir => inner.volume_names().map(|names| {
                let mut out = vec![
                    (VOLUMES_INO, FileType::Directory, b".".to_vec()),
                    (ROOT_INO, FileType::Directory, b"..".to_vec()),
                ];
                out.extend(
                    names
                        .into_iter()
                        .map(|(i, n)| (i, FileType::RegularFile, n.into_bytes())),
                );
                out
            }),
            Target::Volume => Err(Errno::ENOTDIR),
            Target::Tree => {
                let tree = lock(&inner.tree);
                (|| {
                    let node = tree.node(ino.0)?;
                    let mut out = vec![
                        (ino.0, FileType::Directory, b".".to_vec()),
                        (node.parent, FileType::Directory, b"..".to_vec()),
                    ];
                    for (name, &child) in tree.children(ino.0)? {
                        let kind = match tree.get(child).map(|n| n.rec.kind) {
                            Some(Kind::Dir) => FileType::Directory,
                            Some(Kind::Symlink) => FileType::Symlink,
                            _ => FileType::RegularFile,
                        };
                        out.push((child, kind, name.clone()));
                    }
                    Ok(out)
                })()
            }
        };
        match entries {
            Ok(entries) => {
                let skip = usize::try_from(offset).unwrap_or(usize::MAX);
                for (i, (child, kind, name)) in entries.into_iter().enumerate().skip(skip) {
                    if reply.add(INodeNo(child), i as u64 + 1, kind, OsStr::from_bytes(&name)) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(e),
        }
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let inner = &self.inner;
        let persisted = lock(&inner.tree).persist_all();
        let r = persisted.and_then(|()| inner.flush_pool());
        empty_reply(reply, r);
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let inner = &self.inner;
        match inner.catalog.usage() {
            Ok(u) => {
                let bs = u64::from(u.block_size.max(512));
                let free = u.available_bytes / bs;
                let total = (u.physical_bytes + u.available_bytes) / bs;
                let files = lock(&inner.tree).inode_count() as u64;
                reply.statfs(
                    total,
                    free,
                    free,
                    files + free,
                    free,
                    bs as u32,
                    NAME_BYTES_MAX as u32,
                    bs as u32,
                );
            }
            Err(e) => reply.error(errno_of(&e)),
        }
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        // With default_permissions the kernel checks modes itself.
        reply.ok();
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let inner = &self.inner;
        let r = self
            .create_node(req, parent.0, name, Kind::File, mode & !umask, b"")
            .and_then(|attr| {
                lock(&inner.tree).opened(attr.ino.0)?;
                Ok(attr)
            });
        match r {
            Ok(attr) => reply.created(
                &TTL,
                &attr,
                Generation(0),
                FileHandle(0),
                FopenFlags::empty(),
            ),
            Err(e) => reply.error(e),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let inner = &self.inner;
        let r = match target(ino.0) {
            Target::Volume => inner.writable().and_then(|()| {
                if inner.is_snapshot_ino(ino.0) {
                    return Err(Errno::EROFS);
                }
                let op = mode & !libc::FALLOC_FL_KEEP_SIZE;
                let keep_size = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
                let supported = op == 0
                    || op == libc::FALLOC_FL_ZERO_RANGE
                    || (op == libc::FALLOC_FL_PUNCH_HOLE && keep_size);
                if !supported {
                    return Err(Errno::EOPNOTSUPP);
                }
                let (name, vol, _) = inner.volume(ino.0)?;
                volume_fallocate(&name, &*vol, offset, length, mode)
                    .map_err(|e| inner.volume_error(ino.0, &e))?;
                inner.forget_blocks(ino.0);
                inner.volume_touched(ino.0);
                Ok(())
            }),
            Target::Tree => inner.file_fallocate(ino.0, offset, length, mode),
            _ => Err(Errno::EISDIR),
        };
        empty_reply(reply, r);
    }

    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let inner = &self.inner;
        let r = (|| {
            let whence = Whence::from_raw(whence).ok_or(Errno::EINVAL)?;
            let offset = u64::try_from(offset).map_err(|_| Errno::ENXIO)?;
            match target(ino.0) {
                Target::Volume => {
                    let (_, vol, _) = inner.volume(ino.0)?;
                    let size = vol.size();
                    seek(offset, size, size, whence, |o, l| vol.block_status(o, l))
                }
                Target::Tree => inner.file_seek(ino.0, offset, whence),
                _ => Err(Errno::EINVAL),
            }
        })();
        match r.and_then(|o| i64::try_from(o).map_err(|_| Errno::EOVERFLOW)) {
            Ok(o) => reply.offset(o),
            Err(e) => reply.error(e),
        }
    }
}

/// fallocate on a volume file: the volume's size never changes.
fn volume_fallocate(
    name: &str,
    vol: &dyn Volume,
    offset: u64,
    length: u64,
    mode: i32,
) -> Result<(), VolumeError> {
    let keep_size = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
    let size = vol.size();
    let end = offset.saturating_add(length);
    let op = mode & !libc::FALLOC_FL_KEEP_SIZE;
    if end > size && !keep_size {
        // It would have to grow the file: refused like a write past the end.
        return condense_api::check_range("fallocate", name, offset, length, size);
    }
    let end = end.min(size);
    match op {
        0 => Ok(()),
        libc::FALLOC_FL_PUNCH_HOLE if keep_size => {
            if offset < end {
                vol.trim(offset, end - offset, false)?;
            }
            Ok(())
        }
        libc::FALLOC_FL_ZERO_RANGE => {
            if offset < end {
                vol.write_zeroes(offset, end - offset, false, false)?;
            }
            Ok(())
        }
        _ => Err(VolumeError::Invalid(format!(
            "fallocate mode {mode:#x} is not supported on volume {name:?}"
        ))),
    }
}
