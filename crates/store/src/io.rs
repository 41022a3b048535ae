//! The narrow I/O seam: every byte the engine reads or writes goes through [`Dir`] and [`File`].
//!
//! The storage layers implement it and are composed at open (docs/ARCHITECTURE.md "Storage
//! layers"): [`RealDir`] (a directory on a local file system), [`crate::sim::SimDir`] (an
//! in-memory disk that loses unsynced writes, tears writes and stops at the Nth call, for
//! crash simulation) and [`crate::remote::RemoteDir`] (an S3 bucket, with a local directory).
//! This module imports nothing above it: the pool asks a directory what it must know of the
//! store behind it by meaning ([`Dir::whole_files_only`], [`Dir::reads_cost_requests`],
//! [`Dir::check_reachable`], [`Dir::checkpoint_due`], [`Dir::durability`],
//! [`Dir::store_status`]), and each layer answers for itself; a local directory keeps the
//! defaults.
//!
//! Assumptions about the media, which the simulation models and the engine relies on:
//! - `File::sync` makes every completed write and `set_len` of that file durable.
//! - Creating, renaming or removing a name is durable only after `Dir::sync_dir`.
//! - A write that was not synced may be lost, applied, or torn (a prefix of it applied, at
//!   512-byte granularity) by a crash; writes to different files persist independently.
//! - Reads return what was last written (no silent corruption); corruption is caught by the
//!   checksums the engine keeps on every record.
//!
//! Access: a pool holds every volume's data, so it is its owner's alone. [`RealDir`] creates
//! every file with mode [`FILE_MODE`] (0600) and [`create_private_dir`] every directory with
//! [`DIR_MODE`] (0700), whatever the process's umask, set in the `open(2)`/`mkdir(2)` call
//! itself so that no other user ever sees a wider mode. An existing directory keeps the mode
//! its administrator gave it; [`loose_access_warning`] says when that lets others in.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One file. All methods are safe to call from many threads.
#[expect(
    clippy::len_without_is_empty,
    reason = "a file's length is a number to read, not a collection"
)]
pub trait File: Send + Sync {
    /// Read exactly `buf.len()` bytes at `offset`; a short file is `UnexpectedEof`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Write all of `data` at `offset`, extending the file as needed.
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()>;
    fn len(&self) -> io::Result<u64>;
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// Make the file's content durable.
    fn sync(&self) -> io::Result<()>;
    /// Read `buf.len()` bytes at `offset` from another copy of this file's bytes, where one
    /// exists (an S3 pool's `meta.dat` mirror: the bucket's extent objects), and mend this
    /// copy with them; `Ok(false)`: no other copy. Called when bytes `read_at` gave failed
    /// their check, before the damage is an error.
    fn read_other_copy(&self, _buf: &mut [u8], _offset: u64) -> io::Result<bool> {
        Ok(false)
    }
    /// A hint: `len` bytes at `offset` will be read soon. A file whose reads cost requests (an
    /// object in a bucket) may start fetching them in the background; others ignore it. Never
    /// an error and never a wait: a hint that cannot be taken is dropped.
    fn will_need(&self, _offset: u64, _len: u64) {}
}

/// A directory of files: the pool.
pub trait Dir: Send + Sync {
    /// Open a file; with `create` it is made if missing.
    fn open(&self, name: &str, create: bool) -> io::Result<Arc<dyn File>>;
    fn exists(&self, name: &str) -> io::Result<bool>;
    fn remove(&self, name: &str) -> io::Result<()>;
    /// Replace `to` with `from` atomically.
    fn rename(&self, from: &str, to: &str) -> io::Result<()>;
    /// Names of the files whose name starts with `prefix`.
    fn list(&self, prefix: &str) -> io::Result<Vec<String>>;
    /// Make creations, renames and removals durable.
    fn sync_dir(&self) -> io::Result<()>;
    /// Sum of the sizes of all files, in bytes (what `du -sb` of the pool directory shows).
    fn total_bytes(&self) -> io::Result<u64>;
    /// Free bytes on the underlying disk.
    fn available_bytes(&self) -> io::Result<u64>;
    /// Where this directory is, for messages.
    fn describe(&self) -> String;

    // The store behind the files, asked by what it means, never by which layer answers. A
    // local directory (and the simulator) keeps these defaults; the bucket layer
    // ([`crate::remote::RemoteDir`]) answers for its object store.

    /// Files reach this store only whole and only when written out by a request (a bucket):
    /// the pool then stages every new segment and its journal in its local directory (the
    /// cache directory, which cannot be detached), uploads sealed segments before a
    /// checkpoint root may name them, and finds the first journal here at its first open.
    fn whole_files_only(&self) -> bool {
        false
    }
    /// Every read costs a request (a bucket): a read-only open keeps a cache tier too, and
    /// the background scrub is off unless asked for.
    fn reads_cost_requests(&self) -> bool {
        false
    }
    /// Whether the store answers now: fails at once, changing nothing, if its last request
    /// failed and it does not answer now either (checked before a checkpoint starts).
    fn check_reachable(&self) -> condense_format::error::Result<()> {
        Ok(())
    }
    /// Whether the store wants a checkpoint now for its own sake, when records were appended
    /// since the last one (a bucket: so it is never far behind the local directory).
    fn checkpoint_due(&self) -> bool {
        false
    }
    /// What a flush makes durable on this store (`None`: a flush syncs the local disk, and
    /// there is nothing to choose).
    fn durability(&self) -> Option<condense_format::Durability> {
        None
    }
    /// Make flushes of the files opened from now on give `d` (the caller has stored it in the
    /// pool); false, changing nothing, if the store has no durability to choose.
    fn set_durability(&self, _d: condense_format::Durability) -> bool {
        false
    }
    /// This host's member slot in a pool several hosts share (docs/S3.md "Many hosts"): the
    /// high byte of the id of every segment it creates. 0 in a pool of one host.
    fn segment_slot(&self) -> u8 {
        0
    }
    /// The other hosts that share this pool, each with a local directory prepared to open
    /// its part read-only (asked anew each time: hosts join). Empty for a pool of one host.
    fn peers(&self) -> io::Result<Vec<Peer>> {
        Ok(Vec::new())
    }
    /// The volume claims of a pool several hosts share, if this directory is a writer's part
    /// of one (docs/S3.md "Volume claims"); `None` everywhere else.
    fn volume_claims(&self) -> Option<Arc<dyn VolumeClaims>> {
        None
    }
    /// What the store reports beyond its files, for `stats` (a bucket: one LIST).
    fn store_status(&self) -> Option<StoreStatus> {
        None
    }
    /// A new file for bytes that matter only to this process while the pool is open (the
    /// space attribution's pages past its RAM budget, `condense_meta::spill`): nameless, gone when
    /// its last handle closes, never seen by another open, its bytes sealed by its user.
    /// `None`: this store has no such file, and those bytes stay in RAM.
    fn scratch_file(&self) -> io::Result<Option<Arc<dyn File>>> {
        Ok(None)
    }
    /// A second handle on an existing file for direct I/O (`O_DIRECT`: no page cache), if
    /// this directory's file system offers it; reads, lengths and syncs go through the
    /// file's ordinary handle.
    fn open_direct(&self, _name: &str) -> io::Result<Option<Arc<dyn DirectWriter>>> {
        Ok(None)
    }

    // Files held in a faster directory on their way to this one: answered by the writeback
    // staging layer ([`crate::staging::Staging`]), which the pool composes over every
    // directory it opens; any other directory holds nothing back.

    /// Hold new segments and journals in `upper` (a faster directory) from now on, segments
    /// while fewer than `budget` bytes of them are held; `budget` 0 holds no new ones (the
    /// held ones wait to be moved down). `None` stops holding: refused while anything is
    /// held.
    fn hold_in(&self, _upper: Option<(Arc<dyn Dir>, u64)>) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("{} cannot hold files in another directory", self.describe()),
        ))
    }
    /// Hold no new files from now on; the held ones wait to be moved down.
    fn hold_no_new(&self) {}
    /// The files held in the faster directory (not yet in this one), in name order (segments
    /// oldest first), with their lengths.
    fn held(&self) -> io::Result<Vec<(String, u64)>> {
        Ok(Vec::new())
    }
    /// Move held file `name`, which is never written again, down into this directory: its
    /// copy here is complete and durable before the held one is removed, and handles already
    /// open on it read the copy here from then on. False if `name` is not held, was removed
    /// while it was being moved, or another move is running (one at a time).
    fn move_down(&self, _name: &str) -> io::Result<bool> {
        Ok(false)
    }
}

/// The volume claims of a shared pool ([`Dir::volume_claims`]): small objects at the pool's
/// prefix, each put once and never replaced. The claim protocol on top of them is
/// [`crate::volume_claims`].
pub trait VolumeClaims: Send + Sync {
    /// The claims of volume `name` (`None`: of every volume), as listed now.
    fn list(&self, name: Option<&str>) -> io::Result<Vec<condense_format::hosts::VolumeClaim>>;
    /// Put this host's claim of `name` at `turn` (its slot, and the writer id of this
    /// process): refused past the pool lease's write fence.
    fn put(&self, name: &str, turn: u32) -> io::Result<condense_format::hosts::VolumeClaim>;
    /// Delete one claim (gone already is fine), and the turn object of its name and turn if
    /// that names the claim's writer.
    fn delete(&self, claim: &condense_format::hosts::VolumeClaim) -> io::Result<()>;
    /// Whether the store honours conditional PUT (probed when this open connected): a race
    /// for a turn of a name is then decided by [`VolumeClaims::take_turn`], not by timing.
    fn conditional(&self) -> bool {
        false
    }
    /// Create the turn object of `name` at `turn` for this writer if absent
    /// ([`condense_format::hosts::VolumeClaim::turn_object`]); the (slot, writer) it names
    /// (this writer's if this call created it; `None` if it exists but is unreadable).
    /// Refused past the pool lease's write fence.
    fn take_turn(&self, _name: &str, _turn: u32) -> io::Result<Option<(u8, u64)>> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this store has no turn objects",
        ))
    }
    /// The turn objects under `name` (`None`: of every name), as (name, turn).
    fn turns(&self, _name: Option<&str>) -> io::Result<Vec<(String, u32)>> {
        Ok(Vec::new())
    }
    /// The (slot, writer) the turn object of `name` at `turn` names (`None`: none, or
    /// unreadable).
    fn turn_holder(&self, _name: &str, _turn: u32) -> io::Result<Option<(u8, u64)>> {
        Ok(None)
    }
    /// Delete the turn object of `name` at `turn` (gone already is fine).
    fn delete_turn(&self, _name: &str, _turn: u32) -> io::Result<()> {
        Ok(())
    }
    /// The writer id this open's claims carry (a claim of this slot with another one was
    /// put by an earlier writer of this part).
    fn writer(&self) -> u64;
}

/// Another host sharing the pool ([`Dir::peers`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Its member slot (the high byte of its segment ids).
    pub slot: u8,
    /// The host name it joined with.
    pub host: String,
    /// Where its part of the pool is (`s3://BUCKET/PREFIX/hosts/SS`), for messages.
    pub url: String,
    /// A local directory that opens its part read-only (`condense_engine::pool::Pool::open_path`).
    pub local: std::path::PathBuf,
    /// A local directory that opens its part writable, to take its volumes over once its
    /// lease expired (a host that died): `condense_engine::pool::Pool::take_over_volume`.
    pub takeover: std::path::PathBuf,
}

impl Peer {
    /// Whether `host` names this peer: its host name, or its slot as 2 hex digits (as
    /// `condense hosts` lists them).
    pub fn answers_to(&self, host: &str) -> bool {
        self.host == host || format!("{:02x}", self.slot) == host
    }
}

/// What [`Dir::store_status`] reports: the object store behind a pool directory.
#[derive(Clone, Debug, Default)]
pub struct StoreStatus {
    pub url: String,
    /// The pool's durability (stored in its superblock; what this open's flushes do).
    pub durability: condense_format::Durability,
    /// `ok`, `degraded: ERROR (N s ago)`, `lease lost`, or `read-only`.
    pub health: String,
    pub objects: u64,
    pub bytes: u64,
    pub requests: condense_object_store::BackendStats,
    /// Staged segments not yet uploaded, and the local journal (local durability).
    pub pending_bytes: u64,
    /// Seconds since the last checkpoint was uploaded (`None`: none since open).
    pub last_upload_age_seconds: Option<u64>,
    pub conditional_put_honoured: bool,
}

/// The cause inside an I/O error of a store behind a directory that did not answer: the
/// pool's state is unchanged and the request can be retried once the store answers.
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
pub fn is_store_unavailable(e: &condense_format::error::Error) -> bool {
    match e {
        condense_format::error::Error::Io { source, .. } => {
            source.get_ref().is_some_and(|r| r.is::<StoreUnavailable>())
        }
        _ => false,
    }
}

/// Writes that bypass the page cache ([`Dir::open_direct`]).
pub trait DirectWriter: Send + Sync {
    /// Write all of `data` at `offset`; the buffer's address, its length and the offset are
    /// multiples of [`DIRECT_IO_ALIGN`].
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()>;
}

/// Alignment of the buffers, lengths and offsets of direct I/O: a page, which covers the
/// logical block size of every disk (512 or 4096 bytes).
pub const DIRECT_IO_ALIGN: usize = 4096;

#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct AlignedPage([u8; DIRECT_IO_ALIGN]);

/// A growable byte buffer whose start is aligned to [`DIRECT_IO_ALIGN`], for direct I/O.
pub struct AlignedBuf {
    pages: Vec<AlignedPage>,
    len: usize,
}

impl Default for AlignedBuf {
    fn default() -> Self {
        AlignedBuf::new()
    }
}

impl AlignedBuf {
    pub fn new() -> AlignedBuf {
        AlignedBuf {
            pages: Vec::new(),
            len: 0,
        }
    }

    fn all(&self) -> &[u8] {
        // SAFETY: `pages` is a contiguous allocation of `pages.len()` plain byte arrays with
        // no padding (size == alignment == DIRECT_IO_ALIGN), borrowed immutably with `self`.
        unsafe {
            std::slice::from_raw_parts(
                self.pages.as_ptr().cast::<u8>(),
                self.pages.len() * DIRECT_IO_ALIGN,
            )
        }
    }

    fn all_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `all`, borrowed mutably with `self`.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.pages.as_mut_ptr().cast::<u8>(),
                self.pages.len() * DIRECT_IO_ALIGN,
            )
        }
    }

    /// An empty buffer with room for `bytes` without moving.
    pub fn with_capacity(bytes: usize) -> AlignedBuf {
        AlignedBuf {
            pages: Vec::with_capacity(bytes.div_ceil(DIRECT_IO_ALIGN)),
            len: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.all()[..self.len]
    }

    /// Grow by `n` bytes and return them to be filled.
    pub fn extend_by(&mut self, n: usize) -> &mut [u8] {
        let start = self.len;
        let end = start + n;
        let pages = end.div_ceil(DIRECT_IO_ALIGN);
        if pages > self.pages.len() {
            self.pages.resize(pages, AlignedPage([0; DIRECT_IO_ALIGN]));
        }
        self.len = end;
        &mut self.all_mut()[start..end]
    }

    pub fn extend_from_slice(&mut self, data: &[u8]) {
        self.extend_by(data.len()).copy_from_slice(data);
    }

    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Drop the first `n` bytes (moving the rest to the front).
    pub fn drain_front(&mut self, n: usize) {
        let n = n.min(self.len);
        let len = self.len;
        self.all_mut().copy_within(n..len, 0);
        self.len -= n;
    }

    /// Fill the rest of the last page with zeros (for [`AlignedBuf::padded`]).
    pub fn zero_padding(&mut self) {
        let end = self.len.next_multiple_of(DIRECT_IO_ALIGN);
        let len = self.len;
        self.all_mut()[len..end].fill(0);
    }

    /// The bytes and the rest of the last page: zeros after [`AlignedBuf::zero_padding`].
    pub fn padded(&self) -> &[u8] {
        let end = self.len.next_multiple_of(DIRECT_IO_ALIGN);
        debug_assert!(self.all()[self.len..end].iter().all(|&b| b == 0));
        &self.all()[..end]
    }
}

/// Mode of every file Condense creates in a pool, a cache tier or an S3 pool's local
/// directory: read and write for the owner only.
pub const FILE_MODE: u32 = 0o600;

/// Mode of every directory Condense creates for a pool or a cache tier: the owner only.
pub const DIR_MODE: u32 = 0o700;

/// Create the directory `path` with mode [`DIR_MODE`] if it is missing (its missing parents
/// are created as `mkdir -p` would, with the umask's mode). An existing directory is left as
/// it is: see [`loose_access_warning`].
pub fn create_private_dir(path: &Path) -> io::Result<()> {
    if path.is_dir() {
        return Ok(());
    }
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent)?;
    }
    match fs::DirBuilder::new().mode(DIR_MODE).create(path) {
        Ok(()) => Ok(()),
        // Created meanwhile by someone else: what matters is that it is a directory now.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && path.is_dir() => Ok(()),
        Err(e) => Err(e),
    }
}

/// Write `data` to the file `path`, created with mode [`FILE_MODE`] if missing, replacing
/// what it held (for small files beside a pool that are not part of it, such as the status a
/// daemon publishes).
pub fn write_private(path: &Path, data: &[u8]) -> io::Result<()> {
    use std::io::Write;
    fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(FILE_MODE)
        .open(path)?
        .write_all(data)
}

/// A warning when the directory `path` lets users other than its owner in (any group or
/// other permission bit), naming the `chmod` that closes it; `None` when it is owner-only or
/// cannot be examined. `what` says what the directory is ("pool directory", "cache
/// directory").
pub fn loose_access_warning(path: &Path, what: &str) -> Option<String> {
    let mode = fs::metadata(path).ok()?.permissions().mode() & 0o777;
    (mode & 0o077 != 0).then(|| {
        format!(
            "{what} {shown} has mode {mode:03o}: other users can reach what is in it; run \
             `chmod 700 {shown}` to keep it to its owner",
            shown = path.display()
        )
    })
}

/// A real directory on a local file system.
pub struct RealDir {
    path: PathBuf,
}

struct RealFile {
    file: fs::File,
}

/// A file opened with `O_DIRECT`.
struct DirectFile {
    file: fs::File,
}

impl RealDir {
    /// Use `path` (which must exist) as a pool directory.
    pub fn new(path: &Path) -> RealDir {
        RealDir {
            path: path.to_path_buf(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Take an exclusive advisory lock on `name` for the life of the returned file.
    pub fn lock(&self, name: &str) -> io::Result<Option<fs::File>> {
        use std::os::fd::AsRawFd;
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(FILE_MODE)
            .open(self.path.join(name))?;
        // SAFETY: flock on a file descriptor we own; no memory is involved.
        let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            Ok(Some(f))
        } else {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                Ok(None)
            } else {
                Err(err)
            }
        }
    }
}

impl File for RealFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(data, offset)
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }
    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }
}

impl DirectWriter for DirectFile {
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        let aligned = |n: usize| n.is_multiple_of(DIRECT_IO_ALIGN);
        if !aligned(data.as_ptr() as usize) || !aligned(data.len()) || !aligned(offset as usize) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "direct write of {} bytes at offset {offset} is not aligned to {DIRECT_IO_ALIGN}",
                    data.len()
                ),
            ));
        }
        self.file.write_all_at(data, offset)
    }
}

impl Dir for RealDir {
    fn scratch_file(&self) -> io::Result<Option<Arc<dyn File>>> {
        let tmpfile = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_TMPFILE)
            .mode(FILE_MODE)
            .open(&self.path);
        let file = match tmpfile {
            Ok(f) => f,
            // A file system without O_TMPFILE: a named file, unlinked at once.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL)
                ) =>
            {
                static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let path = self
                    .path
                    .join(format!(".scratch-{}-{n}", std::process::id()));
                let f = fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .mode(FILE_MODE)
                    .open(&path)?;
                fs::remove_file(&path)?;
                f
            }
            Err(e) => return Err(e),
        };
        Ok(Some(Arc::new(RealFile { file })))
    }
    fn open_direct(&self, name: &str) -> io::Result<Option<Arc<dyn DirectWriter>>> {
        match fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(self.path.join(name))
        {
            Ok(file) => Ok(Some(Arc::new(DirectFile { file }))),
            // The file system does not do direct I/O (tmpfs before Linux 6.6, some FUSE ones).
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(None),
            Err(e) => Err(e),
        }
    }
    fn open(&self, name: &str, create: bool) -> io::Result<Arc<dyn File>> {
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .truncate(false)
            .mode(FILE_MODE)
            .open(self.path.join(name))?;
        Ok(Arc::new(RealFile { file }))
    }
    fn exists(&self, name: &str) -> io::Result<bool> {
        self.path.join(name).try_exists()
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        fs::remove_file(self.path.join(name))
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        fs::rename(self.path.join(from), self.path.join(to))
    }
    fn list(&self, prefix: &str) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        for e in fs::read_dir(&self.path)? {
            let e = e?;
            if let Some(name) = e.file_name().to_str() {
                if name.starts_with(prefix) && e.file_type()?.is_file() {
                    out.push(name.to_string());
                }
            }
        }
        out.sort();
        Ok(out)
    }
    fn sync_dir(&self) -> io::Result<()> {
        fs::File::open(&self.path)?.sync_all()
    }
    fn total_bytes(&self) -> io::Result<u64> {
        let mut total = 0;
        for e in fs::read_dir(&self.path)? {
            // A file renamed or removed between the listing and its stat (a temporary file
            // being renamed into place, a segment GC just deleted) no longer counts.
            let m = match e?.metadata() {
                Ok(m) => m,
                Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
                Err(err) => return Err(err),
            };
            if m.is_file() {
                total += m.len();
            }
        }
        Ok(total)
    }
    fn available_bytes(&self) -> io::Result<u64> {
        use std::ffi::CString;
        use std::os::unix::ffi::OsStrExt;
        let c = CString::new(self.path.as_os_str().as_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: statvfs writes into the zeroed struct we pass; the path is a valid C string.
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        let rc = unsafe { libc::statvfs(c.as_ptr(), &mut s) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(s.f_bavail as u64 * s.f_frsize as u64)
    }
    fn describe(&self) -> String {
        self.path.display().to_string()
    }
}

/// Replace `name` with `data` so that a crash leaves the old or the new file, never a mix.
pub fn write_file_atomically(
    dir: &dyn Dir,
    name: &str,
    data: &[u8],
) -> condense_format::error::Result<()> {
    let tmp = format!("{name}.tmp");
    let f = dir
        .open(&tmp, true)
        .map_err(|e| condense_format::error::Error::io(format!("creating {tmp}"), e))?;
    f.set_len(0)
        .and_then(|_| f.write_at(data, 0))
        .and_then(|_| f.sync())
        .map_err(|e| condense_format::error::Error::io(format!("writing {tmp}"), e))?;
    dir.rename(&tmp, name)
        .map_err(|e| condense_format::error::Error::io(format!("renaming {tmp} to {name}"), e))?;
    dir.sync_dir()
        .map_err(|e| condense_format::error::Error::io("syncing the pool directory", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(path: &Path) -> io::Result<u32> {
        Ok(fs::metadata(path)?.permissions().mode() & 0o777)
    }

    #[test]
    fn pool_files_and_directories_are_owner_only() -> io::Result<()> {
        let tmp = tempfile::tempdir()?;
        let pool = tmp.path().join("parent/pool");
        create_private_dir(&pool)?;
        assert_eq!(mode(&pool)?, DIR_MODE);
        assert_eq!(loose_access_warning(&pool, "pool directory"), None);
        let dir = RealDir::new(&pool);
        dir.open("segment.1", true)?.write_at(b"data", 0)?;
        drop(dir.lock("lock")?);
        write_private(&pool.join("status.json"), b"{}")?;
        for name in ["segment.1", "lock", "status.json"] {
            assert_eq!(mode(&pool.join(name))?, FILE_MODE, "{name}");
        }
        Ok(())
    }

    #[test]
    fn an_open_directory_is_left_alone_with_a_warning_naming_the_chmod() -> io::Result<()> {
        let tmp = tempfile::tempdir()?;
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755))?;
        create_private_dir(tmp.path())?;
        assert_eq!(mode(tmp.path())?, 0o755);
        let w = loose_access_warning(tmp.path(), "pool directory").unwrap_or_default();
        assert!(w.contains("mode 755"), "{w}");
        assert!(
            w.contains(&format!("chmod 700 {}", tmp.path().display())),
            "{w}"
        );
        Ok(())
    }
}
