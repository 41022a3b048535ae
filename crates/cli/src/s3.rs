//! `condense init s3://...`, `condense connect s3://...` and `condense durability`: pools in
//! an S3-compatible object store (docs/S3.md). The pool lives in the bucket; a local
//! directory on this host (given with `--cache`) holds its cache tier, journal, segments not
//! yet uploaded, a metadata mirror, the lock and the control socket. Every other command
//! takes `--pool DIR` with that directory, exactly as for a local pool.
//!
//! The durability (what a flush promises) is the pool's: set by `init --durability`, stored
//! in the bucket, kept by `connect`, changed only by `condense durability set`.

use crate::size;
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use condense_engine::hosts::SharedPool;
use condense_engine::remote::{self, Durability, RemoteConf};
use condense_engine::{InitOptions, OpenOptions, Pool};
use condense_service::control::Ctx;
use condense_service::render::durability::{meaning, DurabilityReport};
use condense_service::render::hosts::{Forgotten, HostsList, SyncReport};
use condense_service::render::{now_unix, write_report};
use std::path::{Path, PathBuf};

/// Where the bucket is and how to reach it (`init s3://...`, `connect`).
#[derive(clap::Args, Debug, Clone)]
pub struct StoreArgs {
    /// S3 endpoint, http(s)://HOST[:PORT] (default: $AWS_ENDPOINT_URL, else AWS). Plain http
    /// needs AWS_ALLOW_HTTP=true. A user name or password in the URL is refused: use
    /// --credentials.
    #[arg(long, value_name = "URL")]
    pub endpoint: Option<String>,
    /// S3 region (default: $AWS_REGION, else us-east-1).
    #[arg(long, value_name = "REGION")]
    pub region: Option<String>,
    /// A file of KEY=VALUE lines (shell syntax) with AWS_ACCESS_KEY_ID and
    /// AWS_SECRET_ACCESS_KEY, readable by its owner only (chmod 600); default: the
    /// environment. Credentials never go on the command line.
    #[arg(long, value_name = "FILE")]
    pub credentials: Option<PathBuf>,
}

/// `init s3://...`: the bucket, and the new pool's durability.
#[derive(clap::Args, Debug, Clone)]
pub struct RemoteArgs {
    #[command(flatten)]
    pub store: StoreArgs,
    /// Pools in an object store: what a flush (fsync in the VM) promises, for every host
    /// that uses the pool (stored with it; change it later with `condense durability set`).
    /// local (default): once this host's local journal has it; data and metadata are
    /// uploaded in the background, at least every 60 s. remote: once the object store has
    /// it: a host lost with its disks loses nothing flushed; each flush costs 1-2 PUTs.
    #[arg(long, value_name = "MODE", value_parser = parse_durability)]
    pub durability: Option<Durability>,
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
    pub store: StoreArgs,
    /// Check that the pool's durability is MODE (local or remote) and refuse to connect if
    /// it is not. The durability is the pool's, stored with it: connect keeps it, whether
    /// given or not; change it with `condense durability set`.
    #[arg(long, value_name = "MODE", value_parser = parse_durability)]
    pub durability: Option<Durability>,
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
    /// Join the pool as one more host that writes it (docs/S3.md "Many hosts"): this host
    /// gets a part of the pool of its own (its volumes, its writes), deduplicated against
    /// the chunks of every other host; the other hosts go on writing theirs. An encrypted
    /// pool needs its key (--key-file or --passphrase-file).
    #[arg(long, conflicts_with_all = ["read_only", "durability"])]
    pub join: bool,
    /// With --join: the name this host is listed under in `condense hosts` (default: the
    /// machine's host name).
    #[arg(long, value_name = "NAME", requires = "join")]
    pub host: Option<String>,
}

/// `condense hosts`: the hosts that share a pool in an object store.
#[derive(Subcommand, Debug)]
pub enum HostsCommand {
    /// List the hosts of the pool (the default): each one's slot and name, its volumes, the
    /// bytes written to them and its part's bytes in the bucket, the chunk ids it published
    /// and how far this host folded them in, and its lease (held by which host and process
    /// and for how long, released, or expired); then the whole pool.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Fold the other hosts in now (a running serve or mount does it every 30 s): their new
    /// chunks become deduplicated against, blocks both stored are merged into one copy,
    /// and this host's segments every other host let go are deleted.
    Sync {
        #[arg(long)]
        json: bool,
    },
    /// Forget a host that is gone for good (docs/S3.md "Forgetting a host"): its
    /// acknowledgements are no longer awaited, so this host's condemned segments are deleted
    /// at once (this command then syncs) and every other host's at its next sync; its
    /// volumes, as its newest root has them, can be adopted by any host without a hand-over
    /// (`condense volume adopt VOL --from-host HOST`). Recorded in this host's part of the
    /// pool: every host honours it, and the forgotten host refuses to sync if it comes back.
    ///
    /// Refused while the host's part lease is alive (it renewed it in the last 30 s), unless
    /// --force.
    Forget {
        /// The host: its name or its slot (2 hex digits), as `condense hosts` lists them.
        #[arg(value_name = "HOST")]
        host: String,
        /// Forget it although its lease is alive. If it is in fact running, it goes on writing
        /// its volumes until its next sync sees the forget, while another host may adopt
        /// them: two writers of one volume. Only for a host known to be gone (powered off,
        /// its disks lost) whose lease still shows alive.
        #[arg(long)]
        force: bool,
        /// Also reclaim its part's space: once every other host acknowledged (at its next
        /// sync), its segments that no host's chunk names are deleted from the bucket. Its
        /// volumes not adopted by then are given up: adopt what you want to keep first, then
        /// run `hosts forget HOST --reclaim`.
        #[arg(long)]
        reclaim: bool,
        /// Print what was done as JSON (the forget, and the sync after it).
        #[arg(long)]
        json: bool,
    },
}

/// `condense durability`.
#[derive(Subcommand, Debug)]
pub enum DurabilityCommand {
    /// Show what a flush of the pool promises.
    Show {
        #[arg(long)]
        json: bool,
    },
    /// Change what a flush promises, for every host that uses the pool.
    ///
    /// Pools in an object store only. remote: a flush returns once the object store has a write-ahead copy of it
    /// (1-2 PUTs per flush; a host lost with its disk loses nothing flushed). local: a flush
    /// returns once this host's local journal has it (uploads in the background; a host lost
    /// with its disk loses what was written since the last upload, at most ~60 s). Stored
    /// in the bucket; a running `serve` or `mount` applies it at once (after uploading
    /// everything written so far).
    Set {
        /// local or remote.
        #[arg(value_name = "MODE", value_parser = parse_durability)]
        mode: Durability,
    },
}

/// The shortest cache accepted: the staging quarter must hold a few 64 MiB segments.
const CACHE_SIZE_MIN: u64 = 1 << 30;

fn conf(url: &str, args: &StoreArgs, read_only: bool) -> Result<RemoteConf> {
    if url.starts_with("s3://") {
        remote::parse_s3_url(url)?;
    }
    if let Some(e) = &args.endpoint {
        remote::check_endpoint(e)?;
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
        durability_to_store: None,
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

/// `init DIR` of a local pool: the options of pools in an object store are refused, not
/// ignored.
pub fn refuse_for_local_pool(args: &RemoteArgs, dir: &Path) -> Result<()> {
    let given = [
        ("--durability", args.durability.is_some()),
        ("--endpoint", args.store.endpoint.is_some()),
        ("--region", args.store.region.is_some()),
        ("--credentials", args.store.credentials.is_some()),
    ];
    if let Some((opt, _)) = given.iter().find(|(_, g)| *g) {
        bail!(
            "{opt} is for pools in an object store (condense init s3://BUCKET/PREFIX ...); {} is a local pool: a flush of a local pool returns once its own disk has it",
            dir.display()
        );
    }
    Ok(())
}

/// `condense init s3://BUCKET/PREFIX --cache DIR --cache-size SIZE ... [--index ...]`.
pub fn init(
    url: &str,
    args: &RemoteArgs,
    dir: Option<&Path>,
    size: Option<u64>,
    opts: &InitOptions,
    index: condense_service::index::InitSettings,
) -> Result<()> {
    let (dir, size) = check_cache(dir, size)?;
    let conf = conf(url, &args.store, false)?;
    let durability = args.durability.unwrap_or_default();
    Pool::init_remote(&dir, &conf, durability, size, opts)
        .with_context(|| format!("cannot create a pool in {url}"))?;
    let pool = Pool::open_path(
        &dir,
        OpenOptions {
            key: opts.encryption.clone(),
            ..Default::default()
        },
    )
    .with_context(|| format!("cannot open the new pool {url}"))?;
    condense_service::index::store_given(&pool, index)?;
    pool.close()?;
    println!(
        "created pool {url} (block size {}, durability {}{}); its local directory is {} \
         (cache {}): use it as --pool {}",
        size::human(u64::from(pool.block_size())),
        durability.as_str(),
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
    let conf = conf(&a.url, &a.store, a.read_only)?;
    if a.join {
        let host = match &a.host {
            Some(h) => h.clone(),
            None => std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|_| "unknown-host".into()),
        };
        if host.is_empty() || host.len() > 255 || host.chars().any(char::is_control) {
            bail!("--host {host:?}: give 1 to 255 printable characters");
        }
        let key = condense_service::keys::user_key()?;
        let (slot, url) = Pool::join_remote(&dir, &conf, size, &host, key.as_ref())
            .with_context(|| format!("cannot join the pool in {}", a.url))?;
        println!(
            "joined {} as host {host} (slot {slot}, its part at {url}; cache {}): use it as --pool {}",
            a.url,
            size::human(size),
            dir.display()
        );
        return Ok(());
    }
    let stored = remote::connect(&dir, &conf, a.durability, size)
        .with_context(|| format!("cannot connect to the pool in {}", a.url))?;
    let durability = match stored {
        Some(d) => format!("durability {}, the pool's", d.as_str()),
        None => format!(
            "durability {}: the pool stores none yet (made by an older Condense); its first \
             writable open stores it",
            a.durability.unwrap_or_default().as_str()
        ),
    };
    println!(
        "connected {} to {}{} ({durability}; cache {}): use it as --pool {}",
        dir.display(),
        a.url,
        if a.read_only { " read-only" } else { "" },
        size::human(size),
        dir.display()
    );
    Ok(())
}

/// `condense durability show|set`: directly, or in the daemon that holds the pool.
pub fn durability_command(ctx: &mut Ctx, cmd: DurabilityCommand) -> Result<i32> {
    match cmd {
        DurabilityCommand::Show { json } => {
            let pool = ctx.pool(true)?;
            let report = DurabilityReport {
                pool: &ctx.path,
                durability: pool.durability(),
            };
            write_report(ctx.out, &report, json, false)?;
            ctx.done(&pool)?;
        }
        DurabilityCommand::Set { mode } => {
            let pool = ctx.pool(false)?;
            let was = pool.set_durability(mode).with_context(|| {
                format!("cannot set the durability of pool {}", ctx.path.display())
            })?;
            if was == mode {
                writeln!(
                    ctx.out,
                    "durability is already {}: nothing changed",
                    mode.as_str()
                )?;
            } else {
                writeln!(
                    ctx.out,
                    "durability {} -> {}, stored with the pool (every host that uses it; kept by connect) and in effect now{}: {}",
                    was.as_str(),
                    mode.as_str(),
                    if ctx.in_daemon() {
                        " in the running server"
                    } else {
                        ""
                    },
                    meaning(mode)
                )?;
            }
            ctx.done(&pool)?;
        }
    }
    Ok(0)
}

/// Write `report` to the command's output: as one JSON line with `json`, else as text.
/// `condense hosts list|sync|forget`: directly, or in the daemon that holds the pool.
pub fn hosts_command(ctx: &mut Ctx, cmd: Option<HostsCommand>) -> Result<i32> {
    let cmd = cmd.unwrap_or(HostsCommand::List { json: false });
    let pool = ctx.pool(matches!(cmd, HostsCommand::List { .. }))?;
    if !pool.dir().whole_files_only() {
        bail!("hosts: the pool is not in an object store; only a pool in a bucket is shared by hosts (docs/S3.md)");
    }
    let code = match cmd {
        HostsCommand::List { json } => {
            let (slot, condemned, _) = pool.hosts_state();
            let hosts = pool
                .hosts_overview(&ctx.path)
                .context("cannot list the hosts of the pool")?;
            let list = HostsList {
                slot,
                condemned,
                hosts: &hosts,
                now: now_unix(),
            };
            write_report(ctx.out, &list, json, false)?;
            0
        }
        HostsCommand::Forget {
            host,
            force,
            reclaim,
            json,
        } => {
            let f = pool
                .forget_host(&host, force, reclaim)
                .with_context(|| format!("cannot forget host {host}"))?;
            // Then a sync: this host's condemned segments waiting for that host go now.
            let synced = pool.sync_hosts();
            let report = Forgotten {
                forget: &f,
                synced: synced.as_ref().map_err(|e| format!("{e:#}")),
                now: now_unix(),
            };
            write_report(ctx.out, &report, json, false)?;
            i32::from(synced.is_err())
        }
        HostsCommand::Sync { json } => {
            let r = pool
                .sync_hosts()
                .context("cannot fold the other hosts in")?;
            write_report(ctx.out, &SyncReport(&r), json, false)?;
            let failed = r.peers.iter().any(|p| p.error.is_some() && !p.forgotten);
            i32::from(failed || !r.name_conflicts.is_empty())
        }
    };
    ctx.done(&pool)?;
    Ok(code)
}
