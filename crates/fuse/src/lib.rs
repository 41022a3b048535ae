//! The Condense FUSE mount: a thin adapter from the kernel's FUSE protocol to the Volume API.
//!
//! ```text
//! MOUNTPOINT/volumes/NAME            every volume whose name does not start with '.', as a
//!                                    regular file of the volume's logical size
//! MOUNTPOINT/snapshots/VOLUME@SNAP   every snapshot of those volumes, as a read-only file
//!                                    (mode 0400 by default) of the snapshot's size
//! MOUNTPOINT/files/...               an ordinary directory tree whose regular files each keep
//!                                    their content in a hidden volume `.file.<inode>`
//! ```
//!
//! `volumes/NAME` maps read/write to [`Volume::read`]/[`Volume::write`], fsync/fdatasync to
//! [`Volume::flush`], `fallocate(PUNCH_HOLE)` to [`Volume::trim`], `fallocate(ZERO_RANGE)` to
//! [`Volume::write_zeroes`] without unmap, and `lseek(SEEK_DATA/SEEK_HOLE)` to
//! [`Volume::block_status`] (zero and unmapped extents are holes). Its size is the volume's:
//! writes past it fail with ENOSPC and change nothing; truncate fails with EPERM (volumes are
//! resized with `condense volume resize`).
//!
//! `snapshots/VOLUME@SNAP` reads through the read-only volume [`Catalog::open`] gives for
//! `VOLUME@SNAP`, with lseek SEEK_DATA/SEEK_HOLE and `st_blocks` as in `volumes/`, and mtime
//! and ctime the snapshot's creation time. Every change is refused with EROFS: open for
//! writing, truncate, chmod/chown/utimens, fallocate, and create, unlink or rename inside
//! `snapshots/` (a user other than root who opens a read-only file for writing gets EACCES
//! from the kernel first). Snapshots taken or deleted while mounted show at the next readdir or lookup;
//! a deleted snapshot's file, even one already open, answers ENOENT within a second.
//!
//! Access: the mount's own directories (the root, `volumes/`, `snapshots/`) and the files of
//! `volumes/` and `snapshots/` belong to the mounting user, with modes 0777, 0666 and 0444
//! less [`MountOptions::umask`] (077 by default: 0700, 0600 and 0400), and the kernel checks
//! them (`default_permissions`). So even with `allow_other` no other user reaches a volume, or
//! anything under `files/`, unless a wider umask is given.
//!
//! `files/` keeps names and attributes in the pool's metadata records ([`format`]), one small
//! record per inode and per directory. See `crates/fuse/FORMAT.md` for the layout and the
//! choices (growth of content volumes, how `du` is computed, crash ordering).
//!
//! [`Volume::read`]: condense_api::Volume::read
//! [`Volume::write`]: condense_api::Volume::write
//! [`Volume::flush`]: condense_api::Volume::flush
//! [`Volume::trim`]: condense_api::Volume::trim
//! [`Volume::write_zeroes`]: condense_api::Volume::write_zeroes
//! [`Volume::block_status`]: condense_api::Volume::block_status
//! [`Catalog::open`]: condense_api::Catalog::open

#![deny(clippy::unwrap_used)]

pub mod format;
mod fs;
/// Entry points of the fuzz targets; not in release builds (feature `fuzzing`, on in
/// fuzz/Cargo.toml and for this crate's own tests).
#[cfg(feature = "fuzzing")]
pub mod fuzz;
mod metrics;
mod seek;
pub mod tree;

use condense_api::{Catalog, VolumeError};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

pub use format::FormatError;
pub use metrics::FuseMetrics;

/// How to mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountOptions {
    /// Let users other than the one mounting use the mount (`allow_other`; a non-root user
    /// needs `user_allow_other` in /etc/fuse.conf).
    pub allow_other: bool,
    /// Refuse every change (EROFS).
    pub read_only: bool,
    /// Mode bits taken away from the mount's own directories (0777) and from the files of
    /// `volumes/` (0666) and `snapshots/` (0444): 0o077 by default, so that they are the
    /// mounting user's only. `files/` keeps the modes its files are given.
    pub umask: u32,
    /// Threads serving FUSE requests.
    pub threads: usize,
    /// Ask the kernel for its writeback cache (`FUSE_WRITEBACK_CACHE`): buffered writes to
    /// `files/` land in the page cache and reach the pool later, in requests of up to 1 MiB,
    /// instead of one request per `write(2)`; the kernel then owns the size and mtime of the
    /// files it caches, and written data reaches the pool at writeback, fsync, close or
    /// unmount. `volumes/` files are opened in direct-I/O mode instead (no page cache), so that
    /// a volume's size stays the pool's and every write reaches the pool before it returns.
    /// The mount raises its dirty-page limit to [`WRITEBACK_MAX_RATIO`] (root only).
    /// Off by default; ignored on a read-only mount or a kernel without it. See `docs/FUSE.md`.
    pub writeback_cache: bool,
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            allow_other: false,
            read_only: false,
            umask: 0o077,
            threads: 4,
            writeback_cache: false,
        }
    }
}

/// What went wrong mounting, serving or unmounting.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum FuseError {
    #[error("cannot mount at {path}: {source}")]
    Mount { path: PathBuf, source: io::Error },
    #[error("the FUSE session at {path} ended with an error: {source}")]
    Session { path: PathBuf, source: io::Error },
    #[error("cannot unmount {path}: {source}")]
    Unmount { path: PathBuf, source: io::Error },
    #[error("cannot unmount {path}: it is busy (files are open on it)")]
    Busy { path: PathBuf },
    #[error(transparent)]
    Volume(#[from] VolumeError),
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error("the file tree is damaged: {0}")]
    Corrupt(String),
    #[error("file system operation failed: {0}")]
    Os(io::Error),
}

impl From<fuser::Errno> for FuseError {
    fn from(e: fuser::Errno) -> Self {
        FuseError::Os(io::Error::from_raw_os_error(e.code()))
    }
}

/// A running mount, served by background threads. Dropping it unmounts (lazily if busy).
pub struct Mounted {
    mountpoint: PathBuf,
    thread: Option<JoinHandle<io::Result<()>>>,
    fs: Arc<fs::Inner>,
    writeback_cache: bool,
}

/// Unmounts a [`Mounted`] from any thread (a signal handler's thread, say).
#[derive(Debug, Clone)]
pub struct Unmounter {
    mountpoint: PathBuf,
}

/// Mount `catalog` at `mountpoint` and serve it until it is unmounted (by `umount`,
/// `fusermount3 -u` or an [`Unmounter`]); then write every pending change and flush the pool.
pub fn mount(
    catalog: Arc<dyn Catalog>,
    mountpoint: &Path,
    opts: MountOptions,
) -> Result<(), FuseError> {
    spawn(catalog, mountpoint, opts)?.join()
}

/// Mount `catalog` at `mountpoint` and serve it from background threads.
pub fn spawn(
    catalog: Arc<dyn Catalog>,
    mountpoint: &Path,
    opts: MountOptions,
) -> Result<Mounted, FuseError> {
    let mount_err = |source: io::Error| FuseError::Mount {
        path: mountpoint.to_path_buf(),
        source,
    };
    // A mount left by a daemon that died (kill -9): detach it and mount afresh. statfs asks
    // the daemon every time, where a stat can be answered from the kernel's attribute cache
    // for a second after the daemon died (and mounting on top then fails with ENOTCONN).
    let dead = matches!(
        nix::sys::statfs::statfs(mountpoint),
        Err(nix::errno::Errno::ENOTCONN)
    ) || matches!(std::fs::metadata(mountpoint),
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN));
    if dead {
        tracing::warn!(
            "{} is a dead FUSE mount (its daemon is gone): detaching it",
            mountpoint.display()
        );
        Unmounter {
            mountpoint: mountpoint.to_path_buf(),
        }
        .unmount_lazy()?;
    }
    let meta = std::fs::metadata(mountpoint).map_err(mount_err)?;
    if !meta.is_dir() {
        return Err(mount_err(io::Error::new(
            io::ErrorKind::NotADirectory,
            "the mount point is not a directory",
        )));
    }
    let mountpoint = mountpoint.canonicalize().map_err(mount_err)?;
    let inner = Arc::new(fs::Inner::new(catalog, opts.read_only, opts.umask)?);

    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::FSName("condense".to_string()),
        fuser::MountOption::Subtype("condense".to_string()),
        fuser::MountOption::DefaultPermissions,
        fuser::MountOption::NoDev,
        fuser::MountOption::NoSuid,
        fuser::MountOption::NoAtime,
        if opts.read_only {
            fuser::MountOption::RO
        } else {
            fuser::MountOption::RW
        },
    ];
    if opts.allow_other {
        config.acl = fuser::SessionACL::All;
    }
    config.n_threads = Some(opts.threads.max(1));
    config.clone_fd = opts.threads > 1;

    let writeback_cache = opts.writeback_cache && !opts.read_only;
    let fs = fs::Fs {
        inner: inner.clone(),
        writeback_cache,
    };
    let session =
        fuser::Session::new(fs, &mountpoint, &config).map_err(|source| FuseError::Mount {
            path: mountpoint.clone(),
            source,
        })?;
    let thread = std::thread::Builder::new()
        .name("condense-fuse".to_string())
        .spawn(move || session.run())
        .map_err(|source| FuseError::Mount {
            path: mountpoint.clone(),
            source,
        })?;
    tracing::info!("mounted at {}", mountpoint.display());
    if writeback_cache {
        match raise_dirty_limit(&mountpoint) {
            Ok(Some(path)) => tracing::info!(
                "{}: the writeback cache may hold up to {WRITEBACK_MAX_RATIO} % of the \
                 system's dirty-page limit",
                path.display()
            ),
            Ok(None) => {}
            // Not root: the cache works, but the kernel's 1 % limit throttles it.
            Err((path, e)) => tracing::warn!(
                "cannot raise the writeback cache's dirty limit ({e}): buffered writes to \
                 files/ are throttled at 1 % of the dirty-page limit; as root: \
                 echo {WRITEBACK_MAX_RATIO} > {}",
                path.display()
            ),
        }
    }
    Ok(Mounted {
        mountpoint,
        thread: Some(thread),
        fs: inner,
        writeback_cache,
    })
}

/// The share of the system's dirty-page limit (`vm.dirty_ratio`, percent of it) that the
/// mount's pages may hold with the writeback cache on: the `max_ratio` of its backing device
/// (`/sys/class/bdi/MAJOR:MINOR/`), which the kernel sets to 1 for every FUSE mount, with
/// `strict_limit`. At 1 % the kernel throttles a buffered writer of `files/` almost at once,
/// and random 4 KiB writes with the cache were slower than without it (docs/FUSE.md). `strict_limit` stays on: the mount's dirty pages
/// stay bounded by this share whatever other devices do. The setting ends with the mount.
pub const WRITEBACK_MAX_RATIO: u32 = 20;

/// Raise the `max_ratio` of the mount's backing device to [`WRITEBACK_MAX_RATIO`] unless it
/// is that high already. The file's path if it was raised, or with the error if it could not
/// be (only root may write it).
fn raise_dirty_limit(mountpoint: &Path) -> Result<Option<PathBuf>, (PathBuf, io::Error)> {
    use std::os::unix::fs::MetadataExt;
    let unknown = PathBuf::from("/sys/class/bdi/MAJOR:MINOR/max_ratio");
    // The mount's root, answered by the mount itself: its device is the FUSE connection's.
    let dev = std::fs::metadata(mountpoint)
        .map_err(|e| (unknown, e))?
        .dev();
    let path = PathBuf::from(format!(
        "/sys/class/bdi/{}:{}/max_ratio",
        nix::sys::stat::major(dev),
        nix::sys::stat::minor(dev)
    ));
    let now = match std::fs::read_to_string(&path) {
        Ok(s) => s.trim().parse::<u32>().map_err(|e| {
            (
                path.clone(),
                io::Error::new(io::ErrorKind::InvalidData, format!("{s:?}: {e}")),
            )
        })?,
        Err(e) => return Err((path, e)),
    };
    if now >= WRITEBACK_MAX_RATIO {
        return Ok(None);
    }
    match std::fs::write(&path, format!("{WRITEBACK_MAX_RATIO}\n")) {
        Ok(()) => Ok(Some(path)),
        Err(e) => Err((path, e)),
    }
}

impl Mounted {
    /// Where the file system is mounted.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// A handle that unmounts this mount, usable from another thread.
    pub fn unmounter(&self) -> Unmounter {
        Unmounter {
            mountpoint: self.mountpoint.clone(),
        }
    }

    /// True once the session has ended (the file system was unmounted).
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Wait until the file system is unmounted, then write every pending change and flush.
    pub fn join(mut self) -> Result<(), FuseError> {
        let result = match self.thread.take() {
            Some(thread) => match thread.join() {
                // The kernel ends a session with ENODEV, or ECONNABORTED when the connection
                // was torn down (a detached mount's last file closed, fusectl abort): both
                // mean the file system is gone, which is what waiting here is for.
                Ok(Err(e)) if e.raw_os_error() == Some(libc::ECONNABORTED) => Ok(()),
                Ok(r) => r.map_err(|source| FuseError::Session {
                    path: self.mountpoint.clone(),
                    source,
                }),
                Err(_) => Err(FuseError::Session {
                    path: self.mountpoint.clone(),
                    source: io::Error::other("a FUSE thread panicked"),
                }),
            },
            None => Ok(()),
        };
        self.fs.sync()?;
        tracing::info!("unmounted {}", self.mountpoint.display());
        result
    }

    /// Unmount, wait for the session to end and flush. Fails with [`FuseError::Busy`] (and
    /// stays mounted) while files are open on the mount.
    pub fn unmount(self) -> Result<(), FuseError> {
        self.unmounter().unmount()?;
        self.join()
    }

    /// Write every pending change of the file tree and flush the pool, leaving it mounted.
    pub fn sync(&self) -> Result<(), FuseError> {
        self.fs.sync()
    }

    /// With the writeback cache, have the kernel pass on every dirty page it holds for this
    /// mount (`syncfs(2)` on it, served by the mount's own threads), then [`Mounted::sync`].
    /// Call it before detaching a busy mount: once detached, what the kernel still caches
    /// reaches the pool only when the files are closed. Without the writeback cache every
    /// write reached the pool before it returned, and this is [`Mounted::sync`].
    pub fn write_back(&self) -> Result<(), FuseError> {
        if self.writeback_cache && !self.is_finished() {
            let dir = std::fs::File::open(&self.mountpoint).map_err(FuseError::Os)?;
            nix::unistd::syncfs(&dir).map_err(|e| FuseError::Os(e.into()))?;
        }
        self.sync()
    }

    /// The mount's counters (reads, writes, bytes, latency), to register with a metrics
    /// endpoint.
    pub fn metrics(&self) -> Arc<FuseMetrics> {
        self.fs.metrics.clone()
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if let Some(thread) = self.thread.take() {
            if let Err(e) = self.unmounter().unmount_lazy() {
                tracing::warn!("{e}");
            }
            if thread.join().is_err() {
                tracing::warn!("a FUSE thread panicked");
            }
            if let Err(e) = self.fs.sync() {
                tracing::warn!("flushing at unmount: {e}");
            }
        }
    }
}

impl Unmounter {
    /// Unmount now. Fails with [`FuseError::Busy`] while files are open on the mount. A
    /// mount can stay busy for a moment after its last file was closed (the kernel releases
    /// files asynchronously), so EBUSY is retried for up to a second first.
    pub fn unmount(&self) -> Result<(), FuseError> {
        for _ in 0..20 {
            match self.umount(false) {
                Err(FuseError::Busy { .. }) => {
                    std::thread::sleep(std::time::Duration::from_millis(50))
                }
                other => return other,
            }
        }
        self.umount(false)
    }

    /// Detach the mount now; the kernel ends the session when the last open file closes.
    pub fn unmount_lazy(&self) -> Result<(), FuseError> {
        self.umount(true)
    }

    fn umount(&self, lazy: bool) -> Result<(), FuseError> {
        use nix::errno::Errno;
        use nix::mount::MntFlags;
        let flags = if lazy {
            MntFlags::MNT_DETACH
        } else {
            MntFlags::empty()
        };
        match nix::mount::umount2(&self.mountpoint, flags) {
            Ok(()) => Ok(()),
            Err(Errno::EBUSY) => Err(FuseError::Busy {
                path: self.mountpoint.clone(),
            }),
            // Already unmounted.
            Err(Errno::EINVAL) | Err(Errno::ENOENT) => Ok(()),
            // Not root: the setuid helper unmounts what this user mounted.
            Err(Errno::EPERM) => self.fusermount(lazy),
            Err(e) => Err(FuseError::Unmount {
                path: self.mountpoint.clone(),
                source: e.into(),
            }),
        }
    }

    fn fusermount(&self, lazy: bool) -> Result<(), FuseError> {
        let mut last = io::Error::new(io::ErrorKind::NotFound, "fusermount3 not found");
        for bin in ["fusermount3", "fusermount"] {
            let mut cmd = std::process::Command::new(bin);
            cmd.arg("-u");
            if lazy {
                cmd.arg("-z");
            }
            match cmd.arg(&self.mountpoint).output() {
                Ok(out) if out.status.success() => return Ok(()),
                Ok(out) => {
                    let msg = String::from_utf8_lossy(&out.stderr).trim().to_string();
                    if msg.contains("busy") {
                        return Err(FuseError::Busy {
                            path: self.mountpoint.clone(),
                        });
                    }
                    last = io::Error::other(format!("{bin}: {msg}"));
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => last = e,
            }
        }
        Err(FuseError::Unmount {
            path: self.mountpoint.clone(),
            source: last,
        })
    }
}
