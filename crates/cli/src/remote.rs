//! `condense init s3://...` and `condense connect s3://...`: pools in an S3-compatible object
//! store (docs/S3.md). The pool lives in the bucket; a local directory on this host (given
//! with `--cache`) holds its cache tier, journal, segments not yet uploaded, a metadata
//! mirror, the lock and the control socket. Every other command takes `--pool DIR` with that
//! directory, exactly as for a local pool.

use crate::size;
use anyhow::{bail, Context, Result};
use condense_engine::remote::{self, Durability, RemoteConf};
use condense_engine::{InitOptions, OpenOptions, Pool};
use std::path::{Path, PathBuf};

/// Where the bucket is and how to reach it (`init s3://...`, `connect`).
#[derive(clap::Args, Debug, Clone)]
pub struct RemoteArgs {
    /// S3 endpoint, http(s)://HOST[:PORT] (default: $AWS_ENDPOINT_URL, else AWS). Plain http
    /// needs AWS_ALLOW_HTTP=true.
    #[arg(long, value_name = "URL")]
    pub endpoint: Option<String>,
    /// S3 region (default: $AWS_REGION, else us-east-1).
    #[arg(long, value_name = "REGION")]
    pub region: Option<String>,
    /// A file of KEY=VALUE lines (shell syntax) with AWS_ACCESS_KEY_ID and
    /// AWS_SECRET_ACCESS_KEY; default: the environment. Credentials never go on the command
    /// line.
    #[arg(long, value_name = "FILE")]
    pub credentials: Option<PathBuf>,
    /// What a flush (fsync in the VM) promises: local (default: once the local journal has
    /// it; data and metadata are uploaded in the background, at least every 60 s) or remote
    /// (once the object store has it: a host lost with its disks loses nothing flushed;
    /// each flush costs a PUT).
    #[arg(long, value_name = "MODE", default_value = "local", value_parser = parse_durability)]
    pub durability: Durability,
}

fn parse_durability(s: &str) -> Result<Durability, String> {
    Durability::parse(s).ok_or_else(|| format!("unknown durability {s:?}: use local or remote"))
}

/// `condense connect`.
#[derive(clap::Args, Debug)]
pub struct ConnectArgs {
    /// The pool: s3://BUCKET/PREFIX.
    pub url: String,
    #[command(flatten)]
    pub remote: RemoteArgs,
    /// The pool's local directory on this host (new or empty; on a fast disk): its cache
    /// tier, journal, segments not yet uploaded and metadata mirror. Use it as --pool DIR.
    #[arg(long, value_name = "DIR")]
    pub cache: PathBuf,
    /// Size of the cache tier in DIR (a quarter of it holds segments not yet uploaded).
    #[arg(long, value_name = "SIZE", value_parser = size::parse_size)]
    pub cache_size: u64,
    /// Only read the pool (no lease: beside the host that writes it, e.g. to serve its
    /// snapshots and golden images); sees the pool as of its last upload at each open.
    #[arg(long)]
    pub read_only: bool,
}

/// The shortest cache accepted: the staging quarter must hold a few 64 MiB segments.
const CACHE_SIZE_MIN: u64 = 1 << 30;

fn conf(url: &str, args: &RemoteArgs, read_only: bool) -> Result<RemoteConf> {
    if url.starts_with("s3://") {
        remote::parse_s3_url(url)?;
    }
    let credentials = match &args.credentials {
        Some(f) => Some(
            f.canonicalize()
                .with_context(|| format!("cannot read the credentials file {}", f.display()))?,
        ),
        None => None,
    };
    Ok(RemoteConf {
        url: url.trim_end_matches('/').to_string(),
        endpoint: args.endpoint.clone(),
        region: args.region.clone(),
        credentials,
        durability: args.durability,
        read_only,
    })
}

fn check_cache(dir: Option<&Path>, size: Option<u64>) -> Result<(PathBuf, u64)> {
    let (Some(dir), Some(size)) = (dir, size) else {
        bail!("a pool in an object store needs a local directory on a fast disk: add --cache DIR --cache-size SIZE (e.g. --cache /var/lib/condense/vm-pool --cache-size 20G)");
    };
    if size < CACHE_SIZE_MIN {
        bail!(
            "--cache-size {} is too small for a pool in an object store: give at least {} (a quarter holds segments not yet uploaded)",
            size::human(size),
            size::human(CACHE_SIZE_MIN)
        );
    }
    Ok((dir.to_path_buf(), size))
}

/// `condense init s3://BUCKET/PREFIX --cache DIR --cache-size SIZE ...`.
pub fn init(
    url: &str,
    args: &RemoteArgs,
    dir: Option<&Path>,
    size: Option<u64>,
    opts: &InitOptions,
) -> Result<()> {
    let (dir, size) = check_cache(dir, size)?;
    let conf = conf(url, args, false)?;
    remote::init(&dir, &conf, size, opts)
        .with_context(|| format!("cannot create a pool in {url}"))?;
    let pool = Pool::open_path(
        &dir,
        OpenOptions {
            key: opts.encryption.clone(),
            ..Default::default()
        },
    )
    .with_context(|| format!("cannot open the new pool {url}"))?;
    pool.close()?;
    println!(
        "created pool {url} (block size {}, durability {}{}); its local directory is {} \
         (cache {}): use it as --pool {}",
        size::human(u64::from(pool.block_size())),
        conf.durability.as_str(),
        if opts.encryption.is_some() {
            ", encrypted: keep the key, without it the data is lost"
        } else {
            ""
        },
        dir.display(),
        size::human(size),
        dir.display()
    );
    Ok(())
}

/// `condense connect s3://BUCKET/PREFIX --cache DIR --cache-size SIZE ...`.
pub fn connect(a: &ConnectArgs) -> Result<()> {
    let (dir, size) = check_cache(Some(&a.cache), Some(a.cache_size))?;
    let conf = conf(&a.url, &a.remote, a.read_only)?;
    remote::connect(&dir, &conf, size)
        .with_context(|| format!("cannot connect to the pool in {}", a.url))?;
    println!(
        "connected {} to {}{} (cache {}): use it as --pool {}",
        dir.display(),
        a.url,
        if a.read_only { " read-only" } else { "" },
        size::human(size),
        dir.display()
    );
    Ok(())
}
