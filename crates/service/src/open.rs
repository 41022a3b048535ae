//! Opening a pool for a command or a daemon: the key from the key files or the terminal,
//! what recovery did said on stderr, and a warning when the pool's directories let others in.
//!
//! Owns: every open of a pool by the CLI and the daemon ([`open_pool`] and its variants), and
//! [`closing`], which leaves a pool clean when a command fails after changing it.

use crate::error::{Context, Result};
use condense_engine::{OpenOptions, Pool};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The pool at `path`, opened for a command (read-only if `read_only`).
pub fn open_pool(path: &Path, read_only: bool) -> Result<Arc<Pool>> {
    open_pool_with(path, read_only, None)
}

/// `r`, the outcome of a command's work on `pool`, which the command opened. On failure after
/// a change (an import whose input is longer than `--size`, say, which deletes what it wrote)
/// the pool is closed before the error is returned, so that it is left clean rather than
/// needing recovery at the next open; a failure before any change leaves every file as it
/// was. The command's error wins over one of the close, which is only printed.
pub fn closing<T, E>(pool: &Pool, r: std::result::Result<T, E>) -> std::result::Result<T, E> {
    if r.is_err() && pool.has_unsaved_changes() {
        if let Err(e) = pool.close() {
            eprintln!("condense: warning: closing the pool after the error below failed: {e}");
        }
    }
    r
}

/// [`open_pool`] for a pool whose writeback cache directory is lost (`cache detach --force`).
pub fn open_pool_without_writeback_cache(path: &Path) -> Result<Arc<Pool>> {
    open_pool_opts(
        path,
        OpenOptions {
            without_writeback_cache: true,
            key: crate::keys::user_key()?,
            ..Default::default()
        },
    )
}

/// [`open_pool`] with the pool's settings for this open overridden by command-line options.
pub fn open_pool_with(
    path: &Path,
    read_only: bool,
    metadata_cache: Option<u64>,
) -> Result<Arc<Pool>> {
    open_pool_opts(
        path,
        OpenOptions {
            read_only,
            metadata_cache_bytes: metadata_cache,
            key: crate::keys::user_key()?,
            ..Default::default()
        },
    )
}

pub fn open_pool_opts(path: &Path, opts: OpenOptions) -> Result<Arc<Pool>> {
    let mut opts = opts;
    let mut opened = Pool::open_path(path, opts.clone());
    if matches!(opened, Err(condense_engine::Error::KeyRequired(_))) && opts.key.is_none() {
        // An encrypted pool and no key option: ask the terminal, if there is one.
        if let Some(key) =
            crate::keys::prompt(&format!("Passphrase of pool {}", path.display()), false)?
        {
            opts.key = Some(key);
            opened = Pool::open_path(path, opts);
        }
    }
    let pool = opened.with_context(|| format!("cannot open pool {}", path.display()))?;
    let r = pool.replay_report();
    if r.torn_bytes > 0 || r.batches > 0 {
        eprintln!(
            "condense: recovered pool {} after an unclean shutdown: replayed {} journal batches, dropped a torn tail of {} bytes (writes never acknowledged as durable)",
            path.display(),
            r.batches,
            r.torn_bytes
        );
    }
    for note in &r.notes {
        let mended = if pool.is_read_only() {
            "a writable open or `condense repair` mends it"
        } else {
            "mended"
        };
        eprintln!(
            "condense: warning: pool {}: {note} ({mended})",
            path.display()
        );
    }
    warn_loose_access(path, &pool);
    Ok(pool)
}

/// Warn when the pool's directory or its cache tier's lets other users in: Condense creates
/// them owner-only but leaves an administrator's mode alone (docs/SECURITY.md).
pub fn warn_loose_access(path: &Path, pool: &Pool) {
    let mut dirs = vec![(path.to_path_buf(), "pool directory")];
    // (An S3 pool's cache is in its local directory, checked already.)
    if let Some(Ok(Some(conf))) = (!pool.dir().whole_files_only()).then(|| pool.cache_conf()) {
        dirs.push((PathBuf::from(conf.path), "cache directory"));
    }
    for (dir, what) in dirs {
        if let Some(w) = condense_engine::io::loose_access_warning(&dir, what) {
            eprintln!("condense: warning: {w}");
        }
    }
}
