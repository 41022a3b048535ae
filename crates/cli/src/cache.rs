//! `condense cache attach | detach | stats`: the cache tier on a fast directory
//! (docs/CACHE.md). Parses, calls the engine, prints; the work is in `condense_engine::cache_tier`.

use crate::control::Ctx;
use crate::size;
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use condense_engine::io::RealDir;
use condense_engine::{CacheConf, CacheMode, CacheStats};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;

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

/// Attach the cache tier named by `--cache` (if given) unless the pool already has it; a
/// pool with another cache attached is an error (detach it first).
pub fn attach_given(
    pool: &Arc<condense_engine::Pool>,
    path: &std::path::Path,
    tier: &CacheTierArg,
) -> Result<()> {
    let (Some(dir), Some(size)) = (&tier.cache, tier.cache_size) else {
        return Ok(());
    };
    condense_engine::io::create_private_dir(dir)
        .with_context(|| format!("cannot create the cache directory {}", dir.display()))?;
    let abs = dir
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", dir.display()))?;
    if let Some(conf) = pool.cache_conf().ok().flatten() {
        if std::path::Path::new(&conf.path) == abs {
            if conf.size_bytes != size || conf.mode != tier.cache_mode {
                eprintln!(
                    "condense: warning: pool {} keeps its cache in {} as attached ({} {}); to change its size or mode, `condense cache detach` and attach again",
                    path.display(),
                    conf.path,
                    size::human(conf.size_bytes),
                    conf.mode.as_str()
                );
            }
            return Ok(());
        }
        bail!(
            "pool {} already has a cache in {}; detach it first (`condense cache detach`) to use {}",
            path.display(),
            conf.path,
            abs.display()
        );
    }
    let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
    let mut ctx = Ctx::held(path, pool.clone(), &mut out, &mut err);
    run(
        &mut ctx,
        CacheCommand::Attach {
            dir: abs,
            size,
            mode: tier.cache_mode,
        },
    )?;
    Ok(())
}

/// Whether opening the pool failed because its writeback cache directory is missing.
fn writeback_cache_missing(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<condense_engine::Error>(),
            Some(condense_engine::Error::WritebackCacheMissing(_))
        )
    })
}

pub fn run(ctx: &mut Ctx, cmd: CacheCommand) -> Result<i32> {
    match cmd {
        CacheCommand::Attach { dir, size, mode } => {
            if ctx.in_daemon() && dir.is_relative() {
                bail!(
                    "the cache directory {} is relative and the pool is held by a running daemon: give an absolute path",
                    dir.display()
                );
            }
            condense_engine::io::create_private_dir(&dir)
                .with_context(|| format!("cannot create the cache directory {}", dir.display()))?;
            if let Some(w) = condense_engine::io::loose_access_warning(&dir, "cache directory") {
                let _ = writeln!(ctx.err, "condense: warning: {w}");
            }
            let abs = dir
                .canonicalize()
                .with_context(|| format!("cannot resolve {}", dir.display()))?;
            let path = abs
                .to_str()
                .with_context(|| format!("the cache path {} is not UTF-8", abs.display()))?
                .to_string();
            let pool = ctx.pool(false)?;
            pool.attach_cache(
                Arc::new(RealDir::new(&abs)),
                CacheConf {
                    path: path.clone(),
                    size_bytes: size,
                    mode,
                },
            )
            .with_context(|| format!("cannot attach a cache in {path}"))?;
            writeln!(
                ctx.out,
                "attached a {} {} cache in {path} to pool {}",
                size::human(size),
                mode.as_str(),
                ctx.path.display()
            )?;
            ctx.done(&pool)?;
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
                    crate::open_pool_without_writeback_cache(&ctx.path)?
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
            if json {
                writeln!(
                    ctx.out,
                    "{}",
                    serde_json::to_string_pretty(&stats_json(&s))?
                )?;
            } else {
                write!(ctx.out, "{}", stats_text(&s))?;
            }
        }
    }
    Ok(0)
}

/// The cache's figures under the keys `cache stats --json` and `stats --json` share.
pub fn stats_json(s: &CacheStats) -> Value {
    json!({
        "cache_dir": s.dir,
        "cache_mode": s.mode,
        "cache_size_bytes": s.size_bytes,
        "cache_used_bytes": s.used_bytes,
        "cache_dirty_bytes": s.dirty_bytes,
        "cache_hits": s.hits,
        "cache_misses": s.misses,
        "cache_hit_bytes": s.hit_bytes,
        "cache_miss_bytes": s.miss_bytes,
        "cache_promotions": s.promotions,
        "cache_demotions": s.demotions,
        "cache_corrupt_entries": s.corrupt,
        "cache_destaged_segments": s.destaged_segments,
        "cache_destaged_bytes": s.destaged_bytes,
        "cache_meta_hits": s.meta_hits,
        "cache_meta_misses": s.meta_misses,
    })
}

/// Add the cache keys to a `stats --json` object (nothing when no cache is attached).
pub fn add_to_json(v: &mut Value, s: Option<&CacheStats>) {
    if let (Some(s), Some(obj)) = (s, v.as_object_mut()) {
        if let Value::Object(c) = stats_json(s) {
            obj.extend(c);
        }
    }
}

pub fn stats_text(s: &CacheStats) -> String {
    let reads = s.hits + s.misses;
    let ratio = if reads > 0 {
        format!("{:.1} %", 100.0 * s.hits as f64 / reads as f64)
    } else {
        "-".into()
    };
    format!(
        "cache\n  dir         {}\n  mode        {}\n  size        {}\n  used        {}\n  dirty       {}\n  \
         hits        {} ({}), hit ratio {ratio}\n  misses      {} ({})\n  promotions  {}\n  \
         demotions   {}\n  corrupt     {} entries detected (dropped, read from the pool)\n  \
         destaged    {} segments ({}) copied to the pool since it was opened\n  \
         metadata    {} page faults served from the cache, {} read from the pool since it was opened\n",
        s.dir,
        s.mode,
        size::human(s.size_bytes),
        size::human(s.used_bytes),
        size::human(s.dirty_bytes),
        s.hits,
        size::human(s.hit_bytes),
        s.misses,
        size::human(s.miss_bytes),
        s.promotions,
        s.demotions,
        s.corrupt,
        s.destaged_segments,
        size::human(s.destaged_bytes),
        s.meta_hits,
        s.meta_misses
    )
}
