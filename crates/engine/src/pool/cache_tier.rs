//! Attaching, opening and detaching the cache tier ([`crate::cache_tier`]) and its figures.

use crate::cache_tier::{
    slot_budget, writeback_split, CacheConf, CacheMode, CacheStats, ChunkCache, CACHE_CONF_NAME,
};
use crate::error::{Error, Result};
use crate::format::*;
use crate::io::{write_file_atomically, Dir, RealDir};
use crate::locks::lock;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{read_whole, CacheDir, Pool};

impl Pool {
    /// The attached cache, if any.
    pub(crate) fn tier(&self) -> Option<Arc<ChunkCache>> {
        self.tier.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether a cache tier is open in front of the pool now.
    pub fn has_cache_tier(&self) -> bool {
        self.tier().is_some()
    }

    /// What `cache.conf` says, if a cache is attached.
    pub fn cache_conf(&self) -> Result<Option<CacheConf>> {
        read_cache_conf(&*self.dir)
    }

    /// Open the cache named by `cache.conf` (in `opts.cache_dir`); a cache that cannot be
    /// opened is a warning, never a failure (writethrough: it holds nothing the pool lacks).
    pub(super) fn open_attached_cache(&self) {
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
                *self.tier.write().unwrap_or_else(|e| e.into_inner()) = Some(c.clone());
                self.lock_state().md.pages.set_l2(Some(c));
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
            let mut slot = self.tier.write().unwrap_or_else(|e| e.into_inner());
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
            .tier()
            .map(|c| c as Arc<dyn crate::page_cache::PageTier>);
        self.lock_state().md.pages.set_l2(tier);
        if writeback {
            let guard = lock(&self.sync_lock);
            self.dir
                .hold_in(Some((dir, writeback_split(conf.size_bytes).1)))
                .map_err(|e| Error::io("holding new segments in the writeback cache", e))?;
            // The new journal generation is held in the cache directory.
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
        if self.dir.whole_files_only() {
            return Err(Error::Invalid(format!(
                "pool {} is in an object store: its cache is its local directory (the journal and segments not yet uploaded live there) and cannot be detached",
                self.dir.describe()
            )));
        }
        if self.tier().is_none() && read_cache_conf(&*self.dir).ok().flatten().is_none() {
            return Err(Error::Invalid(format!(
                "pool {} has no cache attached",
                self.dir.describe()
            )));
        }
        self.stop_destager();
        let writeback = read_cache_conf(&*self.dir)
            .ok()
            .flatten()
            .is_some_and(|c| c.mode == CacheMode::WriteBack);
        if writeback || !self.held_segments()?.is_empty() {
            let guard = lock(&self.sync_lock);
            {
                let mut st = self.lock_state();
                self.writable(&st)?;
                self.dir.hold_no_new();
                // The open segment may be held: sealed, so it can be moved down.
                st.segments.seal_open()?;
            }
            drop(guard);
            self.flush()?;
            while self.destage_one()? {}
            let guard = lock(&self.sync_lock);
            let left = self.held_segments()?.len();
            if left > 0 {
                return Err(Error::Invalid(format!(
                    "{left} segments are still staged in the cache (a destage is running?); retry"
                )));
            }
            // The new journal generation is created in the pool directory.
            self.checkpoint_locked(&guard)?;
            self.dir.hold_in(None).map_err(|e| {
                Error::io("detaching the writeback cache's directory from the pool", e)
            })?;
        }
        self.lock_state().md.pages.set_l2(None);
        let mut slot = self.tier.write().unwrap_or_else(|e| e.into_inner());
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
        let mut s = match self.tier() {
            Some(c) => c.stats(),
            None => {
                let conf = read_cache_conf(&*self.dir).ok().flatten()?;
                let dir = self.opts.cache_dir.as_ref().map(|d| &*d.0);
                crate::cache_tier::peek_stats(dir, &conf, self.sb.block_size)
            }
        };
        // A writeback cache's dirty bytes are the segments not yet destaged.
        s.dirty_bytes = self
            .held_segments()
            .map_or(0, |h| h.iter().map(|&(_, len)| len).sum());
        s.used_bytes += s.dirty_bytes;
        if let Some(conf) = read_cache_conf(&*self.dir).ok().flatten() {
            if conf.mode == CacheMode::WriteBack {
                s.size_bytes = conf.size_bytes;
            }
        }
        s.destaged_segments = self.counters.destaged_segments.load(Ordering::Relaxed);
        s.destaged_bytes = self.counters.destaged_bytes.load(Ordering::Relaxed);
        Some(s)
    }

    /// Wait until the cache's queued promotions are written (tests; `cache stats`).
    pub fn cache_drain(&self) {
        if let Some(c) = self.tier() {
            c.drain();
        }
    }
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
