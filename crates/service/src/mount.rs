//! `condense mount`: the pool as a FUSE file system until SIGINT, SIGTERM or `umount`.
//!
//! ```text
//! MOUNTPOINT/volumes/NAME   each volume as a regular file of its size (losetup, dd, fio, qemu)
//! MOUNTPOINT/files/...      a deduplicated directory tree: cp VM images in, mv, rm, ls -l, du
//! ```
//!
//! The file system lives in `condense-fuse`; this module mounts it in the foreground and on a
//! signal unmounts it cleanly and flushes the pool. If files are still open on the mount, it is
//! detached (`umount -l`): everything written so far is flushed at once, the kernel ends the
//! session when the last file closes, and a second signal stops waiting for that.

use crate::error::{Context, Result};
use condense_api::Catalog;
use condense_engine::Pool;
use condense_fuse::{FuseError, Mounted};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// What `mount` mounts and how (the CLI's `mount` options).
#[derive(Debug, Clone, Default)]
pub struct MountOptions {
    /// An existing empty directory to mount on.
    pub mountpoint: PathBuf,
    /// Let other users use the mount.
    pub allow_other: bool,
    /// Mode bits taken away from the mount's directories and volume files.
    pub umask: u32,
    pub read_only: bool,
    /// The kernel's writeback cache for files/ (docs/FUSE.md).
    pub writeback_cache: bool,
    /// Serve Prometheus metrics at `http://HOST:PORT/metrics`.
    pub metrics_listen: Option<String>,
}

/// How often the foreground loop checks whether the mount was ended by `umount`.
const POLL: Duration = Duration::from_millis(200);

/// Waits for SIGINT or SIGTERM, or for the mount to end by itself. True on a signal.
fn wait_signal_or_end(rt: &tokio::runtime::Runtime, mounted: &Mounted) -> bool {
    use tokio::signal::unix::{signal, SignalKind};
    rt.block_on(async {
        let (mut int, mut term) = match (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) {
            (Ok(i), Ok(t)) => (i, t),
            (Err(e), _) | (_, Err(e)) => {
                // Without handlers a signal would kill the process with the mount left
                // behind; unmount now instead.
                eprintln!("condense mount: cannot watch SIGINT/SIGTERM ({e}); unmounting");
                return true;
            }
        };
        loop {
            tokio::select! {
                _ = int.recv() => return true,
                _ = term.recv() => return true,
                _ = tokio::time::sleep(POLL) => {
                    if mounted.is_finished() {
                        return false;
                    }
                }
            }
        }
    })
}

/// Mount the pool at `args.mountpoint` and serve it until SIGINT/SIGTERM or an external
/// unmount; then unmount, write every pending change and flush the pool.
pub fn run(pool: Arc<Pool>, args: &MountOptions) -> Result<()> {
    // Listen first: a taken address fails before anything is mounted.
    let metrics = crate::metrics::Endpoint::start(args.metrics_listen.as_deref(), &pool, "mount")?;
    let catalog: Arc<dyn Catalog> = pool;
    let opts = condense_fuse::MountOptions {
        allow_other: args.allow_other,
        read_only: args.read_only,
        umask: args.umask,
        writeback_cache: args.writeback_cache,
        ..condense_fuse::MountOptions::default()
    };
    let mounted = condense_fuse::spawn(catalog, &args.mountpoint, opts).with_context(|| {
        format!(
            "cannot mount on {} (it must be an existing directory; FUSE needs /dev/fuse, \
             and a non-root user needs fusermount3 from the fuse3 package)",
            args.mountpoint.display()
        )
    })?;
    if let Some(m) = &metrics {
        m.register(mounted.metrics());
    }
    let shown = mounted.mountpoint().display().to_string();
    eprintln!(
        "condense mount: mounted at {shown}{} (volumes/ and files/{}); stop with Ctrl-C, \
         SIGTERM or `umount {shown}`",
        if args.read_only { " read-only" } else { "" },
        if args.writeback_cache && !args.read_only {
            ", writeback cache for files/"
        } else {
            ""
        }
    );
    if args.allow_other && args.umask & 0o077 == 0o077 {
        eprintln!(
            "condense mount: --allow-other with --umask {:03o}: the volumes and the mount's \
             directories stay yours alone; add --umask 022 (everyone reads) or 007 (your \
             group reads and writes) to let other users in",
            args.umask
        );
    }
    crate::notify::ready(&format!("mounted at {shown}"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the signal watcher")?;

    if wait_signal_or_end(&rt, &mounted) {
        crate::notify::stopping(&format!("unmounting {shown}"));
        eprintln!("condense mount: unmounting {shown}");
        let unmounter = mounted.unmounter();
        match unmounter.unmount() {
            Ok(()) => {}
            Err(FuseError::Busy { .. }) => {
                // The kernel's writeback cache, if on, is written back while still attached.
                mounted
                    .write_back()
                    .context("cannot write back the mount's cache before detaching it")?;
                unmounter
                    .unmount_lazy()
                    .with_context(|| format!("cannot detach {shown}"))?;
                mounted
                    .sync()
                    .context("cannot flush the pool after detaching the mount")?;
                eprintln!(
                    "condense mount: {shown} is busy: detached; everything written so far is \
                     flushed; waiting for the open files to close (signal again to stop now)"
                );
                if wait_signal_or_end(&rt, &mounted) {
                    mounted
                        .sync()
                        .context("cannot flush the pool before stopping")?;
                    eprintln!("condense mount: stopped with files still open; pool flushed");
                    // The serving threads end with the process; joining them would wait for
                    // the open files.
                    std::mem::forget(mounted);
                    return Ok(());
                }
            }
            Err(e) => return Err(e).with_context(|| format!("cannot unmount {shown}")),
        }
    }
    mounted
        .join()
        .with_context(|| format!("the mount at {shown} failed"))?;
    eprintln!("condense mount: unmounted {shown}; pool flushed");
    Ok(())
}
