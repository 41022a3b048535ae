//! `condense cache attach | detach | stats`: the cache tier on a fast directory
//! (docs/CACHE.md). Parses, calls the engine, prints; the work is in `condense_engine::cache_tier`.

use crate::size;
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use condense_engine::CacheMode;
use condense_service::control::Ctx;
use condense_service::render::cache::CacheReport;
use condense_service::tier::CacheTier;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum CacheCommand {
    /// Keep a cache of hot chunks in DIR (on a fast device) in front of the pool. Persistent:
    /// every later open of the pool uses it. Chunks are cached once for every volume, clone and
    /// snapshot that shares them.
    Attach {
        /// A directory on the fast device (created if missing; give an absolute path when a
        /// `serve` or `mount` holds the pool).
        dir: PathBuf,
        /// How much of DIR the cache may take (K/M/G/T suffixes).
        #[arg(long, value_parser = size::parse_size)]
        size: u64,
        /// writethrough: writes go to the pool, the cache holds copies of chunks read (losing
        /// the cache device loses nothing). writeback: writes land in DIR first (new segments
        /// and the journal: a flush syncs only the fast device) and are copied to the pool in
        /// whole segments in the background; a quarter of --size holds writes not yet copied,
        /// the rest caches reads. Losing the cache device in writeback mode loses the writes
        /// not yet copied (docs/CACHE.md).
        #[arg(long, default_value = "writethrough", value_parser = parse_mode)]
        mode: CacheMode,
    },
    /// Stop using the cache; its files stay in its directory (remove them freely). A writeback
    /// cache is emptied first: every write it holds is copied to the pool (as long as writing
    /// its dirty bytes to the pool's device takes).
    Detach {
        /// Detach even if the cache's index cannot be written at close (a failed device), and
        /// even if a writeback cache's directory is lost: the writes it held are lost then
        /// (`condense verify` names the chunks lost; `condense repair` reports the blocks and
        /// marks them lost: they fail to read until written again).
        #[arg(long)]
        force: bool,
    },
    /// Hits, misses, promotions, evictions, corrupt entries, space used (since attach).
    Stats {
        #[arg(long)]
        json: bool,
    },
}

pub fn parse_mode(s: &str) -> Result<CacheMode, String> {
    CacheMode::parse(s).map_err(|e| e.to_string())
}

/// `--cache DIR --cache-size SIZE [--cache-mode MODE]` on `init`, `serve` and `mount`.
#[derive(clap::Args, Debug, Clone)]
pub struct CacheTierArg {
    /// Attach a cache tier in this directory on a fast device, kept for later opens (see
    /// `condense cache attach`); nothing changes if the pool already uses this directory.
    #[arg(long, value_name = "DIR", requires = "cache_size")]
    pub cache: Option<PathBuf>,
    /// Size of the cache tier given with --cache.
    #[arg(long, value_name = "SIZE", value_parser = size::parse_size, requires = "cache")]
    pub cache_size: Option<u64>,
    /// Mode of the cache tier given with --cache: writethrough or writeback (see `condense
    /// cache attach --help`).
    #[arg(long, value_name = "MODE", default_value = "writethrough", value_parser = parse_mode)]
    pub cache_mode: CacheMode,
}

impl CacheTierArg {
    /// The tier to attach, if --cache was given.
    pub fn tier(&self) -> Option<CacheTier> {
        let (Some(dir), Some(size)) = (&self.cache, self.cache_size) else {
            return None;
        };
        Some(CacheTier {
            dir: dir.clone(),
            size,
            mode: self.cache_mode,
        })
    }
}

/// Whether opening the pool failed because its writeback cache directory is missing.
fn writeback_cache_missing(e: &condense_service::ServiceError) -> bool {
    matches!(
        e.engine(),
        Some(condense_engine::Error::WritebackCacheMissing(_))
    )
}

pub fn run(ctx: &mut Ctx, cmd: CacheCommand) -> Result<i32> {
    match cmd {
        CacheCommand::Attach { dir, size, mode } => {
            condense_service::tier::attach(ctx, &dir, size, mode)?
        }
        CacheCommand::Detach { force } => {
            let pool = match ctx.pool(false) {
                Err(e) if force && writeback_cache_missing(&e) => {
                    writeln!(
                        ctx.err,
                        "condense: warning: the writeback cache of pool {} is lost; detaching it \
                         loses the writes it held that were not yet copied to the pool",
                        ctx.path.display()
                    )?;
                    condense_service::open::open_pool_without_writeback_cache(&ctx.path)?
                }
                r => r?,
            };
            let conf = pool.cache_conf().ok().flatten();
            let dirty = pool.cache_stats().map_or(0, |s| s.dirty_bytes);
            if dirty > 0 {
                writeln!(
                    ctx.out,
                    "copying {} of writes from the writeback cache to the pool...",
                    size::human(dirty)
                )?;
            }
            pool.detach_cache(force).with_context(|| {
                format!("cannot detach the cache of pool {}", ctx.path.display())
            })?;
            match conf {
                Some(c) => writeln!(
                    ctx.out,
                    "detached the cache in {}; its files (cache.dat, cache.idx) may be removed",
                    c.path
                )?,
                None => writeln!(ctx.out, "detached the cache")?,
            }
            ctx.done(&pool)?;
        }
        CacheCommand::Stats { json } => {
            let pool = ctx.pool(true)?;
            // Promotions still queued are counted already; let them land in used bytes.
            pool.cache_drain();
            let s = pool.cache_stats();
            ctx.done(&pool)?;
            let Some(s) = s else {
                bail!(
                    "pool {} has no cache attached (attach one with `condense cache attach DIR --size SIZE`)",
                    ctx.path.display()
                );
            };
            crate::print(ctx.out, &CacheReport(&s), json)?;
        }
    }
    Ok(0)
}
