//! Attaching a cache tier (docs/CACHE.md): `cache attach`, and `--cache DIR` on `init`,
//! `serve` and `mount`.
//!
//! Owns: making the cache directory (owner-only), resolving it to an absolute path (a held
//! pool keeps it for later opens), and attaching it; a pool with another cache attached is an
//! error (detach it first), the same one again changes nothing.

use crate::control::Ctx;
use crate::error::{io, Context, Result, ServiceError};
use crate::render::human;
use condense_engine::io::RealDir;
use condense_engine::{CacheConf, CacheMode, Pool};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A cache tier to attach before serving (`--cache DIR --cache-size SIZE --cache-mode MODE`).
#[derive(Debug, Clone)]
pub struct CacheTier {
    pub dir: PathBuf,
    pub size: u64,
    pub mode: CacheMode,
}

/// `cache attach DIR --size SIZE --mode MODE` on the pool of `ctx`.
pub fn attach(ctx: &mut Ctx, dir: &Path, size: u64, mode: CacheMode) -> Result<()> {
    if ctx.in_daemon() && dir.is_relative() {
        return Err(ServiceError::Invalid(format!(
            "the cache directory {} is relative and the pool is held by a running daemon: give an absolute path",
            dir.display()
        )));
    }
    condense_engine::io::create_private_dir(dir)
        .with_context(|| format!("cannot create the cache directory {}", dir.display()))?;
    if let Some(w) = condense_engine::io::loose_access_warning(dir, "cache directory") {
        let _ = writeln!(ctx.err, "condense: warning: {w}");
    }
    let abs = dir
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", dir.display()))?;
    let path = abs
        .to_str()
        .ok_or_else(|| {
            ServiceError::Invalid(format!("the cache path {} is not UTF-8", abs.display()))
        })?
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
        human(size),
        mode.as_str(),
        ctx.path.display()
    )
    .map_err(io("cannot write the output"))?;
    ctx.done(&pool)
}

/// Attach the cache tier given with `--cache` unless the pool already has it; a pool with
/// another cache attached is an error (detach it first).
pub fn attach_given(pool: &Arc<Pool>, path: &Path, tier: &CacheTier) -> Result<()> {
    condense_engine::io::create_private_dir(&tier.dir)
        .with_context(|| format!("cannot create the cache directory {}", tier.dir.display()))?;
    let abs = tier
        .dir
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", tier.dir.display()))?;
    if let Some(conf) = pool.cache_conf().ok().flatten() {
        if Path::new(&conf.path) == abs {
            if conf.size_bytes != tier.size || conf.mode != tier.mode {
                eprintln!(
                    "condense: warning: pool {} keeps its cache in {} as attached ({} {}); to change its size or mode, `condense cache detach` and attach again",
                    path.display(),
                    conf.path,
                    human(conf.size_bytes),
                    conf.mode.as_str()
                );
            }
            return Ok(());
        }
        return Err(ServiceError::Invalid(format!(
            "pool {} already has a cache in {}; detach it first (`condense cache detach`) to use {}",
            path.display(),
            conf.path,
            abs.display()
        )));
    }
    let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
    let mut ctx = Ctx::held(path, pool.clone(), &mut out, &mut err);
    attach(&mut ctx, &abs, tier.size, tier.mode)
}
