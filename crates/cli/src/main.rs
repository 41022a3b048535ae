//! `condense`: the command line of Condense.
//!
//! A thin adapter: it parses arguments, calls the engine or the service (`condense-service`:
//! the daemon, the control socket and every report), and prints answers in an administrator's
//! terms. Error policy: every error names what failed
//! and where, and says what to do; the exit status is 1 on any error, 2 on bad usage (clap),
//! and 3 when `verify` finds damage.

#![deny(clippy::unwrap_used)]

mod bench;
mod cache;
mod estimate;
mod image;
mod keys;
mod libvirt;
mod mount;
mod repair;
mod s3;
mod scrub;
mod serve;
mod size;
mod snapshot;
mod top;
mod volume;

use anyhow::{bail, Context, Result};
use clap::{Args, CommandFactory, Parser, Subcommand};
use condense_engine::hosts::SharedPool;
use condense_engine::{Compression, InitOptions, OpenOptions, Pool, WritePolicy};
use condense_service::control::{self, Ctx};
use condense_service::daemon::DaemonOptions;
use condense_service::open::{closing, open_pool, open_pool_with, warn_loose_access};
use condense_service::render::stats::StatsReport;
use condense_service::render::verify::VerifyReport;
use condense_service::render::{FileNames, Report};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Parser)]
#[command(
    name = "condense",
    version,
    about = "Data-reduction storage for virtual machine disks: thin volumes, deduplicated and compressed inline",
    long_about = "Condense keeps a pool of thin-provisioned volumes in one directory. Every block \
written is checked for zeros, fingerprinted (BLAKE3), deduplicated across all volumes of the pool, \
and compressed (LZ4 by default). Volumes are imported from and exported to disk images, and served \
to VMs over NBD or FUSE.\n\nThe pool is ./condense-pool unless --pool or $CONDENSE_POOL says otherwise.\n\n\
While `serve` or `mount` holds the pool, `volume`, `snapshot`, `diff`, `stats`, `gc`, `verify`, \
`cache` and `durability` act on the live pool through its control socket (POOL/control.sock, usable by the pool's owner and \
root); otherwise they open the pool themselves. Either way they print the same and exit the same."
)]
struct Cli {
    /// The pool directory.
    #[arg(
        long,
        global = true,
        env = "CONDENSE_POOL",
        default_value = "condense-pool"
    )]
    pool: PathBuf,
    #[command(flatten)]
    keys: keys::KeyArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create a pool: in a local directory, or in an S3-compatible object store
    /// (`condense init s3://BUCKET/PREFIX --cache DIR --cache-size SIZE`, docs/S3.md).
    Init(InitArgs),
    /// Use a pool of an object store on this host: a new host, a disaster reopen from the
    /// bucket alone, moving a pool, or (--read-only) a reader beside the writer. Creates the
    /// local directory DIR; then use --pool DIR.
    Connect(s3::ConnectArgs),
    /// Create, list, inspect, resize, clone, roll back and delete volumes.
    #[command(subcommand)]
    Volume(volume::VolumeCommand),
    /// Point-in-time, read-only copies of a volume: create, list (with the space each one
    /// holds), delete (docs/SNAPSHOTS.md).
    #[command(subcommand)]
    Snapshot(snapshot::SnapshotCommand),
    /// Which parts of a volume changed between one of its snapshots and a later snapshot or
    /// the volume as it is now (what an incremental backup must copy).
    Diff(snapshot::DiffArgs),
    /// Import a disk image (raw, or any format qemu-img reads) into a new volume; holes stay holes.
    Import(ImportArgs),
    /// Export a volume as a sparse raw image (byte-identical), or as qcow2/vmdk/vdi/vhdx. The
    /// file is created mode 0600 (it holds the volume's data: chmod or chown it to share it).
    Export(ExportArgs),
    /// Serve every volume over NBD (for QEMU, qemu-img, nbdcopy, fio, nbd-client) until
    /// SIGINT/SIGTERM.
    Serve(serve::ServeArgs),
    /// Mount the pool with FUSE: MOUNTPOINT/volumes/NAME (each volume as a file) and
    /// MOUNTPOINT/files/ (a deduplicated file tree). Foreground; unmounts on SIGINT/SIGTERM.
    Mount(mount::MountArgs),
    /// How much the pool saves: logical vs physical bytes, dedup and compression, RAM.
    Stats(StatsArgs),
    /// A live view of a served pool, per volume: IOPS, MiB/s, latency, dedup, compression
    /// and cache hits of the I/O now (like `zpool iostat -v 1`). Also `condense iostat`.
    #[command(visible_alias = "iostat", long_about = top::LONG_ABOUT)]
    Top(top::TopArgs),
    /// Reclaim the space of chunks no block refers to any more.
    Gc(GcArgs),
    /// A cache of hot chunks on a fast directory in front of the pool: attach, detach, stats
    /// (docs/CACHE.md).
    #[command(subcommand)]
    Cache(cache::CacheCommand),
    /// What a flush promises in a pool in an object store (local or remote): show, set.
    /// Stored with the pool, for every host that uses it (docs/S3.md).
    #[command(subcommand)]
    Durability(s3::DurabilityCommand),
    /// The dedup index: dense (every chunk in RAM) or sparse (a RAM budget): show, set.
    #[command(subcommand)]
    Index(condense_service::index::IndexCommand),
    /// The hosts that share a pool in an object store (`connect --join`): list them, or
    /// fold them in now (docs/S3.md "Many hosts").
    Hosts {
        #[command(subcommand)]
        command: Option<s3::HostsCommand>,
        /// Without a subcommand: list them as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Read and check every chunk and every block map; report damaged volumes and blocks.
    Verify(VerifyArgs),
    /// Salvage a pool with a damaged journal or checkpoint page: keep everything valid, report
    /// what was lost, leave the pool consistent (docs/REPAIR.md). Pool must not be in use.
    #[command(long_about = repair::LONG_ABOUT)]
    Repair(repair::RepairArgs),
    /// Read every stored chunk back and check it: start a background pass on a served pool,
    /// stop it, show its progress and results, or run one here (docs/REPAIR.md).
    #[command(long_about = scrub::LONG_ABOUT)]
    Scrub(scrub::ScrubCmdArgs),
    /// Project how much a pool would save on disk images (dedup, compression, RAM), without
    /// a pool and without writing anything (docs/ESTIMATE.md).
    Estimate(estimate::EstimateArgs),
    /// Measure savings, disk performance and resource use against a plain directory on the
    /// same disk; writes a Markdown report with SVG charts (docs/BENCH.md).
    Bench(bench::BenchArgs),
    /// Where a volume's block map lives in meta.dat (for support and tests): JSON with the
    /// tree's height and its root page's first 64-byte unit, length in units and CRC.
    #[command(hide = true)]
    DebugMap { name: String },
}

#[derive(Args)]
struct InitArgs {
    /// Where to create the pool (default: --pool, $CONDENSE_POOL or ./condense-pool), or
    /// s3://BUCKET/PREFIX for a pool in an object store (with --cache DIR --cache-size SIZE:
    /// DIR becomes its local directory, the --pool of every later command).
    dir: Option<PathBuf>,
    #[command(flatten)]
    remote: s3::RemoteArgs,
    /// Block size: the unit of deduplication, 4K to 64K, a power of two.
    #[arg(long, default_value = "4K", value_parser = size::parse_size)]
    block_size: u64,
    /// Compression of new chunks: lz4 (fast), zstd or zstd:LEVEL (1-22, denser; -1 to -7,
    /// zstd's fast levels: on VM images zstd:-1 stores ~15 % less than lz4), or none.
    #[arg(long, default_value = "lz4", value_parser = parse_compression)]
    compression: Compression,
    /// When writes are acknowledged: sync (durable first), async (durable at the next flush),
    /// auto (async where the pool's directory honours flushes, else sync).
    #[arg(long, default_value = "auto", value_parser = clap::value_parser!(WritePolicy))]
    write_policy: WritePolicy,
    /// Size at which segment files are sealed.
    #[arg(long, default_value = "64M", value_parser = size::parse_size, hide = true)]
    segment_size: u64,
    #[command(flatten)]
    metadata_cache: MetadataCacheArg,
    #[command(flatten)]
    index: condense_service::index::InitIndexArgs,
    /// Encrypt everything the pool stores (AES-256-GCM) under a key from --key-file, or a
    /// passphrase from --passphrase-file or the terminal. Every later command that opens the
    /// pool needs the same key or passphrase; without it the data is lost (docs/ENCRYPTION.md).
    #[arg(long)]
    encrypt: bool,
    #[command(flatten)]
    tier: cache::CacheTierArg,
}

/// `--metadata-cache SIZE`, on `init` (stored in the pool) and on the commands that open the
/// pool for long or heavy work (`import`, `serve`, `mount`; for that open only).
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct MetadataCacheArg {
    /// metadata page-cache budget (default: the pool's setting; at init 256 MiB or 5 % of RAM,
    /// whichever is smaller)
    #[arg(long, value_name = "SIZE", value_parser = parse_metadata_cache)]
    pub metadata_cache: Option<u64>,
}

fn parse_metadata_cache(s: &str) -> Result<u64, String> {
    let bytes = size::parse_size(s)?;
    let min = condense_engine::METADATA_CACHE_MIN;
    if bytes < min {
        return Err(format!(
            "a metadata cache of {} is too small: the minimum is {} ({min} bytes)",
            size::human(bytes),
            size::human(min)
        ));
    }
    Ok(bytes)
}

#[derive(Args)]
struct ImportArgs {
    /// A disk image: raw (read directly, fastest) or qcow2/vmdk/vdi/vhdx/vpc (through
    /// `qemu-img convert`, which must be installed); `-` reads a raw image from standard
    /// input (needs --name and --size). Only this file is read: an image that names another
    /// file (a backing file, VMDK extents) is refused unless --allow-backing-file.
    file: PathBuf,
    /// Name of the new volume (default: the file name without its extension; required with
    /// `-`).
    #[arg(long)]
    name: Option<String>,
    /// Logical size of the new volume when importing from standard input (`-`): K/M/G/T
    /// suffixes, a multiple of the block size. Input shorter than this leaves the rest
    /// unwritten (zeros); longer input is an error.
    #[arg(long, value_parser = size::parse_size)]
    size: Option<u64>,
    #[command(flatten)]
    image: image::ImageFileArgs,
    #[command(flatten)]
    cache: MetadataCacheArg,
}

#[derive(Args)]
struct ExportArgs {
    name: String,
    file: PathBuf,
    /// Image format: raw, qcow2, vmdk, vdi or vhdx (default: from FILE's extension, else raw).
    #[arg(long)]
    format: Option<String>,
    /// Overwrite FILE if it exists (a regular file only). A raw export replaces FILE only once
    /// it is complete (mode 0600); if the export fails, FILE is left as it was.
    #[arg(long)]
    force: bool,
    /// Write zeros for the blocks `condense repair` declared lost, instead of failing on the
    /// first one: a copy of what is left of a damaged volume (the count is printed; `condense
    /// repair --history` lists the blocks).
    #[arg(long)]
    lost_as_zeros: bool,
}

#[derive(Args)]
struct StatsArgs {
    /// Only this volume.
    name: Option<String>,
    /// Machine-readable output (schema in docs/STATS.md).
    #[arg(long)]
    json: bool,
    /// Also show segments, metadata, RAM and error counters.
    #[arg(long)]
    verbose: bool,
}

#[derive(Args)]
struct GcArgs {
    /// Compact segments with at least this share of dead bytes.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u8).range(1..=100))]
    min_dead_percent: u8,
}

#[derive(Args)]
struct VerifyArgs {
    #[arg(long)]
    json: bool,
}

fn parse_compression(s: &str) -> Result<Compression, String> {
    s.parse()
}

fn main() {
    // Warnings (a store that does not answer, a cache that cannot be opened) are shown
    // unless CONDENSE_LOG says otherwise (e.g. CONDENSE_LOG=error, or =info for more).
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::builder()
                .with_default_directive(tracing_subscriber::filter::LevelFilter::WARN.into())
                .with_env_var("CONDENSE_LOG")
                .from_env_lossy(),
        )
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
    // `serve`/`mount --config FILE`: the file's options join the command line first.
    let argv =
        match condense_service::config::expand(&Cli::command(), std::env::args_os().collect()) {
            Ok(argv) => argv,
            Err(e) => {
                eprintln!("condense: error: {}", error_text(&e.into()));
                std::process::exit(1);
            }
        };
    let cli = Cli::parse_from(argv);
    // The state lock's slow-hold log speaks of every volume's I/O waiting: a one-shot
    // command holds the pool alone, so its long holds stall nobody (unless asked for).
    let serves = matches!(
        cli.command,
        Command::Serve(_) | Command::Mount(_) | Command::Bench(_)
    );
    if !serves && std::env::var_os("CONDENSE_SLOW_HOLD_MS").is_none() {
        std::env::set_var("CONDENSE_SLOW_HOLD_MS", "0");
    }
    keys::set(&cli.keys);
    match run(cli) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("condense: error: {}", error_text(&e));
            std::process::exit(1);
        }
    }
}

/// An error and its causes, joined by ": ", each cause said once: the libraries' errors
/// name their cause in their own message too, and would otherwise end in it twice.
fn error_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let c = cause.to_string();
        if text.is_empty() {
            text = c;
        } else if !text.ends_with(&c) {
            text = format!("{text}: {c}");
        }
    }
    text
}

impl Command {
    /// Commands that act on a pool a daemon holds through its control socket.
    fn routed(&self) -> bool {
        matches!(
            self,
            Command::Volume(_)
                | Command::Snapshot(_)
                | Command::Diff(_)
                | Command::Stats(_)
                | Command::Gc(_)
                | Command::Verify(_)
                | Command::Scrub(_)
                | Command::Cache(_)
                | Command::Durability(_)
                | Command::Index(_)
                | Command::Hosts { .. }
        ) || matches!(self, Command::Top(a) if a.counters())
    }
}

fn run(cli: Cli) -> Result<i32> {
    let pool = &cli.pool;
    match cli.command {
        Command::Init(a) => init(pool, &a)?,
        Command::Import(a) if a.file.as_os_str() == "-" => import_stdin(pool, &a)?,
        Command::Import(a) => import(pool, &a)?,
        Command::Export(a) => export(pool, &a)?,
        Command::Mount(a) => daemon(
            pool,
            &daemon_options(a.read_only, &a.cache, &a.tier, &a.scrub),
            |p| condense_service::mount::run(p, &a.options()),
        )?,
        Command::Serve(a) => {
            // Bad certificate files and endpoints refused are reported before the pool is
            // opened.
            let opts = a.options();
            opts.tls.load()?;
            opts.endpoints(pool)?;
            daemon(
                pool,
                &daemon_options(a.read_only, &a.cache, &a.tier, &a.scrub),
                |p| {
                    // The NBD client on this host and the connection copying the next request
                    // need the other core more than one write does (Pool::set_spread_writes).
                    // A FUSE mount keeps the default: it made no difference measured there
                    // (bench/README.md, fio-bench, fourth stop on issue 13).
                    p.set_spread_writes(false);
                    condense_service::serve::run(p, pool, &opts)
                },
            )?
        }
        Command::Connect(a) => s3::connect(&a)?,
        Command::Top(a) => return top::run(pool, &a),
        Command::Bench(a) => bench::run(pool, &a)?,
        Command::Repair(a) => return repair::run(pool, &a),
        Command::Estimate(a) => estimate::run(&a)?,
        Command::DebugMap { name } => debug_map(pool, name)?,
        cmd => {
            // Through the daemon that holds the pool, if one does; else directly.
            if let Some(code) = control::forward(pool)? {
                return Ok(code);
            }
            let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
            let mut ctx = Ctx::direct(pool, &mut out, &mut err);
            return routed(&mut ctx, cmd);
        }
    }
    Ok(0)
}

/// `condense init`: a pool in a directory, or in an object store.
fn init(pool: &Path, a: &InitArgs) -> Result<()> {
    let dir = a.dir.clone().unwrap_or_else(|| pool.to_path_buf());
    let encryption = match (a.encrypt, condense_service::keys::user_key()?) {
        (false, None) => None,
        (false, Some(_)) => bail!(
            "a key was given (--key-file, --passphrase-file, $CONDENSE_KEY_FILE or $CONDENSE_PASSPHRASE_FILE) but not --encrypt: add --encrypt to create an encrypted pool, or drop the key option"
        ),
        (true, Some(k)) => Some(k),
        (true, None) => Some(
            condense_service::keys::prompt("Passphrase for the new pool", true)?.context(
                "--encrypt needs a key: --key-file FILE (32 random bytes: `head -c 32 /dev/urandom > FILE`), --passphrase-file FILE, or a terminal to type a passphrase on",
            )?,
        ),
    };
    let encrypted = encryption.is_some();
    let opts = InitOptions {
        block_size: u32::try_from(a.block_size).context("block size too large")?,
        compression: a.compression,
        write_policy: a.write_policy,
        segment_bytes_target: a.segment_size,
        metadata_cache_bytes: a.metadata_cache.metadata_cache,
        encryption: encryption.clone(),
    };
    if let Some(url) = dir
        .to_str()
        .filter(|d| condense_engine::remote::is_remote_url(d))
    {
        s3::init(
            url,
            &a.remote,
            a.tier.cache.as_deref(),
            a.tier.cache_size,
            &opts,
            a.index.setting()?,
        )?;
        return Ok(());
    }
    s3::refuse_for_local_pool(&a.remote, &dir)?;
    let index = a.index.setting()?;
    Pool::init_path(&dir, &opts)
        .with_context(|| format!("cannot create a pool in {}", dir.display()))?;
    let pool = Pool::open_path(
        &dir,
        OpenOptions {
            key: encryption,
            ..Default::default()
        },
    )
    .with_context(|| format!("cannot open the new pool {}", dir.display()))?;
    warn_loose_access(&dir, &pool);
    condense_service::index::store_given(&pool, index)?;
    println!(
        "created pool {} (block size {}, compression {}, writes {}{})",
        dir.display(),
        size::human(a.block_size),
        a.compression,
        if pool.sync_writes() {
            "sync"
        } else {
            "async (durable at each flush)"
        },
        if encrypted {
            ", encrypted: keep the key, without it the data is lost"
        } else {
            ""
        }
    );
    if let Some(tier) = a.tier.tier() {
        condense_service::tier::attach_given(&pool, &dir, &tier)?;
    }
    pool.close()?;
    Ok(())
}

/// `condense import - --name NAME --size SIZE`: a raw image from standard input.
fn import_stdin(pool_dir: &Path, a: &ImportArgs) -> Result<()> {
    let (Some(name), Some(size)) = (&a.name, a.size) else {
        let missing: Vec<&str> = [
            ("--name NAME", a.name.is_none()),
            ("--size SIZE", a.size.is_none()),
        ]
        .into_iter()
        .filter_map(|(arg, missing)| missing.then_some(arg))
        .collect();
        bail!(
            "importing from standard input (`condense import -`) needs {}: the name and the logical size of the new volume, e.g. `zstdcat vm.raw.zst | condense import - --name vm --size 16G`",
            missing.join(" and ")
        );
    };
    if std::io::stdin().is_terminal() {
        bail!("standard input is a terminal; pipe a raw image in, e.g. `zstdcat vm.raw.zst | condense import - --name {name} --size SIZE`");
    }
    let declared_raw = match a.image.format {
        None => false,
        Some(condense_estimate::probe::Format::Raw) => true,
        Some(f) => {
            bail!("standard input is read as a raw disk only; import a {f} image from its file")
        }
    };
    let pool = open_pool_with(pool_dir, false, a.cache.metadata_cache)?;
    let report = closing(
        &pool,
        condense_image::import_stdin(
            &pool,
            name,
            size,
            declared_raw,
            std::io::stdin(),
            &image::Bars::default(),
        ),
    )?;
    println!("{report}");
    pool.close()?;
    Ok(())
}

/// `condense import FILE`: a raw image read directly, another format through qemu-img.
fn import(pool_dir: &Path, a: &ImportArgs) -> Result<()> {
    if a.size.is_some() {
        bail!(
            "--size is only for importing from standard input (`condense import - --name NAME --size SIZE`); a volume imported from {} takes the image's size",
            a.file.display()
        );
    }
    // Checked before the pool opens: only this file is read, and it is consistent.
    let checked = condense_estimate::image::open(&a.file, &a.image.options())?;
    let pool = open_pool_with(pool_dir, false, a.cache.metadata_cache)?;
    let name = match a.name.clone() {
        Some(n) => n,
        None => a
            .file
            .file_stem()
            .and_then(|s| s.to_str())
            .map(str::to_string)
            .with_context(|| {
                format!(
                    "cannot derive a volume name from {}; pass --name",
                    a.file.display()
                )
            })?,
    };
    let bars = image::Bars::default();
    if checked.format == condense_estimate::probe::Format::Raw {
        let report = closing(
            &pool,
            condense_image::import_raw(&pool, &checked, &name, &bars),
        )?;
        println!("{report}");
    } else {
        let report = closing(
            &pool,
            condense_image::convert::import_image(&pool, &checked, &name, &bars),
        )?;
        println!("{report}");
    }
    pool.close()?;
    Ok(())
}

/// `condense export NAME FILE`.
fn export(pool_dir: &Path, a: &ExportArgs) -> Result<()> {
    let format = a
        .format
        .clone()
        .unwrap_or_else(|| condense_image::format_from_extension(&a.file));
    let bars = image::Bars::default();
    let pool = if format == "raw" {
        let pool = open_pool(pool_dir, true)?;
        pool.set_lost_reads_zeros(a.lost_as_zeros);
        let report = condense_image::export_raw(&pool, &a.name, &a.file, a.force, &bars)?;
        println!("{report}");
        pool
    } else {
        let pool = open_pool(pool_dir, false)?;
        pool.set_lost_reads_zeros(a.lost_as_zeros);
        let report = closing(
            &pool,
            condense_image::convert::export_image(
                pool.clone(),
                &a.name,
                &a.file,
                &format,
                a.force,
                &bars,
            ),
        )?;
        println!("{report}");
        pool
    };
    let lost = pool.lost_blocks_read_as_zeros();
    if lost > 0 {
        eprintln!(
            "condense: warning: {lost} blocks of {} were lost in an earlier repair and were written as zeros (`condense repair --history` lists them)",
            a.name
        );
    }
    pool.close()?;
    Ok(())
}

/// `condense debug-map NAME`: where a volume's block map lives (for support and tests).
fn debug_map(pool: &Path, name: String) -> Result<()> {
    #[derive(serde::Serialize)]
    struct MapRoot {
        volume: String,
        height: u8,
        root_unit: u64,
        root_units: u16,
        root_crc: u32,
    }
    let p = open_pool(pool, true)?;
    let t = p.map_root(&name)?;
    let root = MapRoot {
        volume: name,
        height: t.height,
        root_unit: t.root.page,
        root_units: t.root.units,
        root_crc: t.root.crc,
    };
    println!("{}", condense_service::render::json_line(&root)?);
    Ok(())
}

/// How `serve` or `mount` opens the pool and what runs beside it.
fn daemon_options(
    read_only: bool,
    cache: &MetadataCacheArg,
    tier: &cache::CacheTierArg,
    scrub: &scrub::ScrubArg,
) -> DaemonOptions {
    DaemonOptions {
        read_only,
        metadata_cache: cache.metadata_cache,
        cache_tier: tier.tier(),
        scrub_rate: scrub.scrub_rate,
        scrub_every: scrub.scrub_every,
    }
}

/// Run a long-lived frontend on the pool (`condense_service::daemon`), commands on its control
/// socket parsed as this command line's.
fn daemon(
    path: &Path,
    opts: &DaemonOptions,
    frontend: impl FnOnce(Arc<Pool>) -> condense_service::Result<()>,
) -> Result<()> {
    Ok(condense_service::daemon::run(
        path,
        opts,
        Arc::new(control_request),
        frontend,
    )?)
}

/// One command line received on the control socket, run on the pool the daemon holds.
fn control_request(argv: Vec<String>, ctx: &mut Ctx) -> i32 {
    let words = std::iter::once("condense".to_string()).chain(argv);
    let cli = match Cli::try_parse_from(words) {
        Ok(cli) => cli,
        Err(e) => {
            let text = e.render().to_string();
            let _ = if e.use_stderr() {
                ctx.err.write_all(text.as_bytes())
            } else {
                ctx.out.write_all(text.as_bytes())
            };
            return e.exit_code();
        }
    };
    let same_pool = match (cli.pool.canonicalize(), ctx.path.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    let result = if !same_pool {
        Err(anyhow::anyhow!(
            "this control socket serves pool {}, not {}",
            ctx.path.display(),
            cli.pool.display()
        ))
    } else if !cli.command.routed() {
        Err(anyhow::anyhow!(
            "only volume, snapshot, diff, stats, gc, verify, scrub, cache, durability and index run through the control socket"
        ))
    } else {
        ctx.path = cli.pool.clone();
        routed(ctx, cli.command)
    };
    control::finish(result, ctx.err)
}

/// The commands that run either directly or inside the daemon that holds the pool.
fn routed(ctx: &mut Ctx, cmd: Command) -> Result<i32> {
    match cmd {
        Command::Volume(v) => volume::run(ctx, v),
        Command::Snapshot(c) => snapshot::run(ctx, c),
        Command::Diff(a) => snapshot::diff(ctx, &a),
        Command::Stats(a) => stats_command(ctx, &a),
        Command::Gc(a) => gc_command(ctx, &a),
        Command::Verify(a) => verify_command(ctx, &a),
        Command::Scrub(a) => scrub::run(ctx, &a),
        Command::Cache(c) => cache::run(ctx, c),
        Command::Durability(c) => s3::durability_command(ctx, c),
        Command::Index(c) => Ok(condense_service::index::run(ctx, c)?),
        Command::Hosts { command, json } => {
            s3::hosts_command(ctx, command.or(Some(s3::HostsCommand::List { json })))
        }
        Command::Top(a) if a.counters() => Ok(condense_service::top::counters(ctx)?),
        _ => bail!("this command cannot run through the control socket"),
    }
}

fn stats_command(ctx: &mut Ctx, a: &StatsArgs) -> Result<i32> {
    let mut cache_stats = None;
    let mut hosts = Vec::new();
    let stats = match ctx.pool_for_figures(true) {
        Ok(pool) => {
            let s = pool.stats().context("cannot read pool statistics")?;
            cache_stats = pool.cache_stats();
            // A pool several hosts share: this host's part above, every part and the whole
            // pool below (one LIST per part).
            if a.name.is_none() && pool.is_shared().unwrap_or(false) {
                match pool.hosts_overview(&ctx.path) {
                    Ok(h) => hosts = h,
                    Err(e) => writeln!(ctx.err, "condense: warning: the other hosts' parts: {e}")?,
                }
            }
            ctx.done(&pool)?;
            s
        }
        // A running `serve` or `mount` holds the pool and its control socket does not answer
        // (an older condense): show what it last published.
        Err(e) if matches!(e.engine(), Some(condense_engine::Error::Locked(_))) => {
            let (stats, age, pid) = condense_service::status::read_status(&ctx.path)
                .map_err(|s| anyhow::Error::from(e).context(s))?;
            writeln!(
                ctx.err,
                "condense: pool in use by process {pid}; statistics it published {age} s ago"
            )?;
            stats
        }
        Err(e) => return Err(e.into()),
    };
    if let Some(n) = &a.name {
        if !stats
            .volumes
            .iter()
            .chain(&stats.snapshots)
            .any(|v| &v.name == n)
        {
            bail!(
                "volume {n:?} not found in pool {} (see `condense volume list`)",
                ctx.path.display()
            );
        }
    }
    let report = StatsReport {
        stats: &stats,
        only: a.name.as_deref(),
        verbose: a.verbose,
        cache: cache_stats.as_ref(),
        hosts: &hosts,
    };
    print(ctx.out, &report, a.json)?;
    Ok(0)
}

/// Write `report` to the command's output: as indented JSON with `json`, else as text.
pub(crate) fn print(out: &mut dyn Write, report: &impl Report, json: bool) -> Result<()> {
    Ok(condense_service::render::write_report(
        out, report, json, true,
    )?)
}

fn gc_command(ctx: &mut Ctx, a: &GcArgs) -> Result<i32> {
    let pool = ctx.pool(false)?;
    // Offline, the maps of deleted volumes are released first, so their space comes back now.
    crate::image::release_deleted(ctx, &pool)?;
    let r = pool
        .gc(a.min_dead_percent)
        .context("garbage collection failed")?;
    writeln!(
        ctx.out,
        "gc: removed {} segments, moved {} live chunks, dropped {} dead chunks; segment bytes {} -> {}",
        r.segments_removed,
        r.chunks_moved,
        r.chunks_dropped,
        size::human(r.bytes_before),
        size::human(r.bytes_after)
    )?;
    ctx.done(&pool)?;
    Ok(0)
}

fn verify_command(ctx: &mut Ctx, a: &VerifyArgs) -> Result<i32> {
    let pool = ctx.pool(false)?;
    let r = if ctx.in_daemon() {
        pool.verify(&|_, _| {})?
    } else {
        let bar = image::bar(0, "verifying chunks");
        let r = pool.verify(&|done, total| {
            bar.set_length(total);
            bar.set_position(done);
        })?;
        bar.finish_and_clear();
        r
    };
    let files = FileNames::of(&pool, r.bad_blocks.keys().map(String::as_str));
    let report = VerifyReport {
        report: &r,
        files: &files,
    };
    print(ctx.out, &report, a.json)?;
    ctx.done(&pool)?;
    Ok(if r.is_clean() { 0 } else { 3 })
}

#[cfg(test)]
mod tests {
    #[test]
    fn compression_levels_accepted_and_refused() {
        use super::{parse_compression, Compression};
        assert_eq!(parse_compression("zstd"), Ok(Compression::Zstd(3)));
        assert_eq!(parse_compression("zstd:-1"), Ok(Compression::Zstd(-1)));
        assert_eq!(parse_compression("zstd:-7"), Ok(Compression::Zstd(-7)));
        assert_eq!(parse_compression("zstd:22"), Ok(Compression::Zstd(22)));
        for bad in ["zstd:0", "zstd:-8", "zstd:23", "zstd:x", "lz5"] {
            let e = parse_compression(bad).expect_err(bad);
            assert!(e.contains("-1 to -7"), "{bad}: {e}");
        }
    }

    #[test]
    fn listen_and_insecure_listen_exclude_each_other() {
        use clap::Parser;
        let words = ["condense", "serve", "--listen", "127.0.0.1:1"];
        assert!(super::Cli::try_parse_from(words).is_ok());
        let both = [&words[..], &["--insecure-listen", "127.0.0.1:2"]].concat();
        assert!(super::Cli::try_parse_from(both).is_err());
    }

    /// An error that names its cause in its message, as the libraries' errors do.
    #[derive(Debug)]
    struct Listen(std::io::Error);
    impl std::fmt::Display for Listen {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "cannot listen on nbd://127.0.0.1:1: {}", self.0)
        }
    }
    impl std::error::Error for Listen {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn each_cause_is_said_once() {
        let e = anyhow::Error::new(Listen(std::io::Error::other("Address already in use")))
            .context("cannot serve");
        assert_eq!(
            super::error_text(&e),
            "cannot serve: cannot listen on nbd://127.0.0.1:1: Address already in use"
        );
        let e = anyhow::Error::new(std::io::Error::other("disk full")).context("writing x");
        assert_eq!(super::error_text(&e), "writing x: disk full");
    }
}
