//! The Volume API: the one interface between Condense frontends and the storage below.
//!
//! Frontends (the NBD server, the FUSE mount, the CLI's import/export) depend on this crate only;
//! they never see segments, chunks or journals. The engine implements [`Volume`] and
//! [`Catalog`]; [`mem`] holds a plain in-memory implementation that is the reference model in
//! property tests and the backing store in frontend unit tests.
//!
//! Contract of every implementation:
//! - Unwritten bytes read as zeros. Reads and writes may start and end anywhere inside the
//!   volume (implementations handle partial blocks); anything past [`Volume::size`] is
//!   [`VolumeError::OutOfRange`] and changes nothing.
//! - A write is durable once `flush()` has returned after it (on any handle of the same pool:
//!   [`Volume::flush_is_pool_wide`]), or when it was made with `fua = true`.
//! - After a crash every block reads either its content before or after any write in flight.

#![deny(clippy::unwrap_used)]

pub mod mem;
pub mod size;

use std::sync::Arc;

/// Result of every Volume API call.
pub type Result<T, E = VolumeError> = std::result::Result<T, E>;

/// What went wrong, in kinds a frontend can map to an errno or a protocol error.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("volume {0:?} not found")]
    NotFound(String),
    #[error("volume {0:?} already exists")]
    AlreadyExists(String),
    #[error("{op} of {len} bytes at offset {offset} is past the end of volume {volume:?} ({size} bytes)")]
    OutOfRange {
        op: &'static str,
        volume: String,
        offset: u64,
        len: u64,
        size: u64,
    },
    #[error("no space left in the pool: {0}")]
    NoSpace(String),
    #[error("the pool is open read-only")]
    ReadOnly,
    #[error("data damaged: {0}")]
    Corrupt(String),
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("I/O error: {0}")]
    Io(String),
    #[error("busy: {0}")]
    Busy(String),
}

impl VolumeError {
    /// The POSIX errno that best describes this error (for FUSE and NBD replies).
    pub fn errno(&self) -> i32 {
        match self {
            VolumeError::NotFound(_) => 2,        // ENOENT
            VolumeError::AlreadyExists(_) => 17,  // EEXIST
            VolumeError::OutOfRange { .. } => 28, // ENOSPC: past the end of the device
            VolumeError::NoSpace(_) => 28,        // ENOSPC
            VolumeError::ReadOnly => 30,          // EROFS
            VolumeError::Corrupt(_) => 5,         // EIO
            VolumeError::Invalid(_) => 22,        // EINVAL
            VolumeError::Io(_) => 5,              // EIO
            VolumeError::Busy(_) => 16,           // EBUSY
        }
    }
}

/// What a range of a volume holds, as block status reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtentKind {
    /// Stored data.
    Data,
    /// Written as zeros: reads zeros, takes no data space, but is "allocated" (not a hole).
    Zero,
    /// Never written, trimmed or zeroed with unmap allowed: a hole that reads zeros.
    Unmapped,
}

/// A run of bytes of one kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    pub len: u64,
    pub kind: ExtentKind,
}

/// A thin-provisioned virtual disk. All methods take `&self` and are safe to call from many
/// threads. A call that returned is visible to every later call; writes that overlap and are
/// in flight at the same time land in either order, as on any disk.
pub trait Volume: Send + Sync {
    /// The volume's name (its NBD export name, its file name under the FUSE mount).
    fn name(&self) -> &str;
    /// Logical size in bytes (a multiple of the block size).
    fn size(&self) -> u64;
    /// The pool's block size: the unit of allocation, deduplication and holes.
    fn block_size(&self) -> u32;
    /// True when writes are refused with [`VolumeError::ReadOnly`].
    fn is_read_only(&self) -> bool;
    /// True when a `flush()` on any handle makes every completed write of the pool durable
    /// (what NBD's CAN_MULTI_CONN promises).
    fn flush_is_pool_wide(&self) -> bool;

    /// Fill `buf` with the bytes at `offset`.
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()>;
    /// Write `data` at `offset`; with `fua` it is durable when this returns.
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()>;
    /// Make `len` bytes at `offset` read as zeros. With `may_unmap` whole blocks become holes
    /// (as by trim); without it they stay allocated ([`ExtentKind::Zero`]).
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool, fua: bool) -> Result<()>;
    /// Release whole blocks inside the range (they read zeros afterwards); partial blocks at the
    /// edges are zeroed in place.
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()>;
    /// Make every completed write durable.
    fn flush(&self) -> Result<()>;
    /// The extents covering `[offset, offset+len)`, in order, merged where adjacent and equal.
    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>>;
    /// One read for a reader that sends holes as holes (NBD's structured replies): the
    /// extents of `[offset, offset + buf.len())` as [`Volume::block_status`] gives them, with
    /// the bytes of its [`ExtentKind::Data`] extents read into `buf` (the rest of `buf` is
    /// left as it was). An implementation that counts its reads counts this as one read of
    /// `buf.len()` bytes, holes included, as a plain [`Volume::read`] of the range would be.
    fn read_sparse(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<Extent>> {
        let extents = self.block_status(offset, buf.len() as u64)?;
        read_data_extents(self, &extents, offset, buf)?;
        Ok(extents)
    }
    /// Bytes of the pool's disk this volume accounts for after deduplication and compression
    /// (shared data divided among its users), if the implementation knows; what `du` shows.
    fn physical_bytes(&self) -> Option<u64> {
        None
    }
    /// Names of this volume's snapshots (the part after `@`), oldest first.
    fn snapshot_names(&self) -> Result<Vec<String>> {
        Ok(Vec::new())
    }
    /// Which blocks of `[offset, offset+len)` differ from snapshot `snapshot` of this volume:
    /// runs in order, covering the range (an incremental backup reads the `changed` ones).
    /// Block granularity: a run starts and ends on block boundaries or at the range's edges.
    fn changed_since(&self, snapshot: &str, offset: u64, len: u64) -> Result<Vec<Change>> {
        let _ = (offset, len);
        Err(VolumeError::NotFound(format!("{}@{snapshot}", self.name())))
    }
}

/// A run of bytes that did (`changed`) or did not change between two versions of a volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Change {
    pub offset: u64,
    pub len: u64,
    pub changed: bool,
}

/// Read the parts of the [`ExtentKind::Data`] extents among `extents` that lie inside
/// `[offset, offset + buf.len())` into their places in `buf`, with [`Volume::read`].
fn read_data_extents<V: Volume + ?Sized>(
    v: &V,
    extents: &[Extent],
    offset: u64,
    buf: &mut [u8],
) -> Result<()> {
    let end = offset.saturating_add(buf.len() as u64);
    for e in extents.iter().filter(|e| e.kind == ExtentKind::Data) {
        let from = e.offset.max(offset);
        let to = e.offset.saturating_add(e.len).min(end);
        if from < to {
            // Both lie inside the buffer's range, which fits in usize.
            let dst = &mut buf[(from - offset) as usize..(to - offset) as usize];
            v.read(from, dst)?;
        }
    }
    Ok(())
}

/// Append a run, merging it with the previous one when adjacent and equal.
pub fn push_change(out: &mut Vec<Change>, offset: u64, len: u64, changed: bool) {
    if len == 0 {
        return;
    }
    if let Some(last) = out.last_mut() {
        if last.changed == changed && last.offset + last.len == offset {
            last.len += len;
            return;
        }
    }
    out.push(Change {
        offset,
        len,
        changed,
    });
}

/// One snapshot: a frozen, read-only copy of a volume at one instant, opened by
/// [`Catalog::open`] as `VOLUME@SNAPSHOT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub volume: String,
    pub snapshot: String,
    /// Seconds since the Unix epoch.
    pub created_unix: u64,
    pub size_bytes: u64,
    /// Bytes in blocks that hold data when the snapshot was taken.
    pub written_bytes: u64,
}

impl SnapshotInfo {
    /// `VOLUME@SNAPSHOT`, the name it is opened and exported under.
    pub fn full_name(&self) -> String {
        format!("{}@{}", self.volume, self.snapshot)
    }
}

/// Split `VOLUME@SNAPSHOT` into its parts; `None` for a plain volume name.
pub fn split_snapshot_name(name: &str) -> Option<(&str, &str)> {
    name.split_once('@')
}

/// One line of a volume listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeInfo {
    pub name: String,
    pub size_bytes: u64,
    /// Bytes in blocks that hold data (not zero, not unmapped).
    pub written_bytes: u64,
}

/// Space of the pool as a file system's statfs would show it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolUsage {
    /// Bytes the pool occupies on its disk (data and metadata).
    pub physical_bytes: u64,
    /// Free bytes on the disk that holds the pool.
    pub available_bytes: u64,
    /// Sum of the logical sizes of all volumes.
    pub logical_bytes: u64,
    pub block_size: u32,
}

/// The volumes of a pool: list, open, create, delete, resize; plus small named metadata records
/// that frontends may keep in the pool (the FUSE file tree), journaled like everything else.
pub trait Catalog: Send + Sync {
    fn list(&self) -> Result<Vec<VolumeInfo>>;
    fn open(&self, name: &str) -> Result<Arc<dyn Volume>>;
    fn create(&self, name: &str, size_bytes: u64) -> Result<()>;
    fn delete(&self, name: &str) -> Result<()>;
    /// Grow or shrink. Shrinking below written data is refused unless `force`, which releases
    /// the blocks past the new end.
    fn resize(&self, name: &str, size_bytes: u64, force: bool) -> Result<()>;
    fn usage(&self) -> Result<PoolUsage>;
    /// Make everything durable.
    fn flush(&self) -> Result<()>;
    /// Read a named metadata record.
    fn meta_get(&self, key: &str) -> Result<Option<Vec<u8>>>;
    /// Set (`Some`) or remove (`None`) a named metadata record; durable at the next flush.
    fn meta_put(&self, key: &str, value: Option<&[u8]>) -> Result<()>;

    /// Every snapshot of every volume, by volume and then oldest first. A snapshot opens
    /// read-only through [`Catalog::open`] as `VOLUME@SNAPSHOT`.
    fn snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        Ok(Vec::new())
    }
    /// Freeze `volume` as it is now (every write that returned before is in it).
    fn snapshot_create(&self, volume: &str, snapshot: &str) -> Result<()> {
        let _ = (volume, snapshot);
        Err(VolumeError::Invalid(
            "this pool does not support snapshots".into(),
        ))
    }
    fn snapshot_delete(&self, volume: &str, snapshot: &str) -> Result<()> {
        let _ = (volume, snapshot);
        Err(VolumeError::Invalid(
            "this pool does not support snapshots".into(),
        ))
    }
    /// A new writable volume `new` with the content of `source` (a volume or
    /// `VOLUME@SNAPSHOT`); the two are independent afterwards.
    fn clone_volume(&self, source: &str, new: &str) -> Result<()> {
        let _ = (source, new);
        Err(VolumeError::Invalid(
            "this pool does not support clones".into(),
        ))
    }
    /// Bytes of the pool's disk that deleting snapshot `snapshot` of `volume` would free
    /// (what ZFS calls a snapshot's "used"); `None` if the implementation does not know.
    fn snapshot_freeable_bytes(&self, volume: &str, snapshot: &str) -> Result<Option<u64>> {
        let _ = (volume, snapshot);
        Ok(None)
    }
    /// Make `volume` read again as its snapshot `snapshot` (size included). Later
    /// snapshots of the volume are kept. Refused with [`VolumeError::Busy`] while a
    /// writable handle to the volume is open (an NBD client, a mount), unless `force`.
    fn rollback(&self, volume: &str, snapshot: &str, force: bool) -> Result<()> {
        let _ = (volume, snapshot, force);
        Err(VolumeError::Invalid(
            "this pool does not support snapshots".into(),
        ))
    }
    /// Which blocks of `[offset, offset+len)` differ between `from` and `to` (each a volume or
    /// `VOLUME@SNAPSHOT`); past the end of the shorter one a block differs if the longer one
    /// holds anything there.
    fn diff(&self, from: &str, to: &str, offset: u64, len: u64) -> Result<Vec<Change>> {
        let _ = (from, to, offset, len);
        Err(VolumeError::Invalid(
            "this pool does not support snapshots".into(),
        ))
    }
}

/// Check that `[offset, offset+len)` lies inside a volume of `size` bytes.
pub fn check_range(op: &'static str, volume: &str, offset: u64, len: u64, size: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(VolumeError::OutOfRange {
            op,
            volume: volume.to_string(),
            offset,
            len,
            size,
        }),
    }
}
