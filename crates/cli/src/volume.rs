//! `condense volume`: create, list, inspect, resize, delete, clone, move, adopt and roll
//! back volumes; the reports are `condense_service::render::volumes`.

use crate::{libvirt, size, snapshot};
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use condense_engine::hosts::SharedPool;
use condense_service::control::Ctx;
use condense_service::render::volumes::{VolumeInfo, VolumeList};

#[derive(Subcommand)]
pub enum VolumeCommand {
    /// Create a thin volume: it takes no space until written.
    Create {
        name: String,
        /// Logical size (K/M/G/T suffixes), a multiple of the block size.
        #[arg(long, value_parser = size::parse_size)]
        size: u64,
    },
    /// List volumes with their size, written bytes and saving.
    List {
        #[arg(long)]
        json: bool,
        /// Also list internal volumes (names starting with '.', such as FUSE file contents).
        #[arg(long)]
        all: bool,
    },
    /// Show one volume.
    Info {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Grow or shrink a volume. Shrinking below written data needs --force and releases the
    /// blocks past the new end.
    Resize {
        name: String,
        #[arg(value_parser = size::parse_size)]
        size: u64,
        #[arg(long)]
        force: bool,
    },
    /// Delete a volume and release its blocks (space returns after `condense gc`).
    Delete { name: String },
    /// Make a new writable volume NEW with the content of a volume or of a snapshot
    /// (VOL@SNAP). Instant and thin: the two share every block until one is written; they are
    /// independent afterwards.
    Clone {
        /// The source: VOLUME (as it is now) or VOLUME@SNAPSHOT.
        source: String,
        /// Name of the new volume.
        new: String,
        /// The source is another host's (a pool several hosts share, `condense hosts`), as
        /// that host's last checkpoint has it: no data is copied, the clone names that host's
        /// records (a golden image of one hypervisor cloned on another).
        #[arg(long, value_name = "HOST")]
        from_host: Option<String>,
    },
    /// Move a volume to another host of the pool (a pool several hosts share): its writes are
    /// refused here from now on, everything written is flushed and published; then run
    /// `condense volume adopt VOL --from-host THIS-HOST` on HOST, after which this host
    /// deletes its copy at its next `hosts sync` (serve and mount sync every 30 s). Running it
    /// again with the same HOST (after a kill) publishes the hand-over already recorded.
    Move {
        name: String,
        /// The host to move it to (its name or slot, as `condense hosts` lists them).
        #[arg(long, value_name = "HOST")]
        to: String,
    },
    /// Take over volumes another host moved to this one (`condense volume move VOL --to
    /// THIS-HOST` there): each volume as that host flushed it, under the same name, written
    /// here from now on. No data is copied. With --take-over, the other host is gone (crashed,
    /// powered off): this host waits for that host's lease to expire (30 s after its last
    /// renewal), takes its part of the pool, hands the volumes over on its behalf with every
    /// write it flushed (durability `remote`: every write a client saw complete), and adopts
    /// them. A host forgotten with `condense hosts forget` needs no hand-over: its volumes are
    /// adopted as its newest root has them. An adopt that was killed half way is continued by
    /// running it again (or by the next `hosts sync`).
    Adopt {
        /// The volumes (names as on the other host).
        #[arg(required = true, value_name = "VOL")]
        names: Vec<String>,
        /// The host they come from (its name or slot).
        #[arg(long, value_name = "HOST")]
        from_host: String,
        /// The host is gone: take its volumes over without its hand-over.
        #[arg(long)]
        take_over: bool,
        /// With --take-over: how long to wait for the host's lease to expire.
        #[arg(long, value_name = "SECONDS", default_value_t = 60)]
        wait: u64,
    },
    /// Put a volume back to one of its snapshots (its content and its size). What was written
    /// since is lost; later snapshots are kept. Refused while the volume is exported
    /// read-write (an NBD client or a mount has it open) unless --force.
    Rollback {
        /// VOLUME@SNAPSHOT
        #[arg(value_name = "VOL@SNAP", value_parser = snapshot::parse_snapshot_name)]
        target: (String, String),
        /// Roll back even while a client has the volume open for writing (it then reads the
        /// snapshot's content under its feet: stop the VM first unless you know it is safe).
        #[arg(long)]
        force: bool,
    },
    /// Print the libvirt <disk> element of a volume or snapshot as `condense serve` exports it.
    ///
    /// The disk is a volume, or a snapshot VOLUME@SNAPSHOT (read-only), reached over serve's
    /// Unix socket (default POOL/nbd.sock, or --socket PATH) or over TCP with TLS (--tls
    /// HOST[:PORT]). Put it in the domain's <devices> (`virsh edit`), or attach it: `condense
    /// volume libvirt-xml vm1 --target vdb > disk.xml; virsh attach-device DOMAIN disk.xml
    /// --config`. Permissions, the TLS settings of qemu.conf, snapshots, clones and migration:
    /// docs/LIBVIRT.md.
    LibvirtXml(libvirt::LibvirtXmlArgs),
}

/// `condense volume ...`: directly, or in the daemon that holds the pool.
pub fn run(ctx: &mut Ctx, cmd: VolumeCommand) -> Result<i32> {
    match cmd {
        VolumeCommand::Create { name, size } => {
            let pool = ctx.pool(false)?;
            pool.create_volume(&name, size)
                .with_context(|| format!("cannot create volume {name:?}"))?;
            writeln!(
                ctx.out,
                "created volume {name} ({} logical, thin)",
                size::human(size)
            )?;
            ctx.done(&pool)?;
        }
        VolumeCommand::List { json, all } => list(ctx, json, all)?,
        VolumeCommand::Info { name, json } => info(ctx, &name, json)?,
        VolumeCommand::Resize { name, size, force } => {
            let pool = ctx.pool(false)?;
            pool.resize_volume(&name, size, force)
                .with_context(|| format!("cannot resize volume {name:?}"))?;
            writeln!(ctx.out, "volume {name} is now {}", size::human(size))?;
            ctx.done(&pool)?;
        }
        VolumeCommand::Delete { name } => {
            let pool = ctx.pool(false)?;
            pool.delete_volume(&name)
                .with_context(|| format!("cannot delete volume {name:?}"))?;
            let how = crate::image::release_deleted(ctx, &pool)?;
            writeln!(
                ctx.out,
                "deleted volume {name}; {how}, then `condense gc` reclaims its space"
            )?;
            ctx.done(&pool)?;
        }
        VolumeCommand::Clone {
            source,
            new,
            from_host: None,
        } => snapshot::clone(ctx, &source, &new)?,
        VolumeCommand::Clone {
            source,
            new,
            from_host: Some(host),
        } => {
            let pool = ctx.pool(false)?;
            let r = pool
                .clone_from_host(&host, &source, &new)
                .with_context(|| format!("cannot clone {source} of host {host}"))?;
            writeln!(
                ctx.out,
                "cloned {source} of host {} as {new}: {} blocks with data, {} chunks new to this host (read from host {}'s records; nothing copied)",
                r.host, r.data_blocks, r.chunks_added, r.host
            )?;
            ctx.done(&pool)?;
        }
        VolumeCommand::Move { name, to } => {
            let pool = ctx.pool(false)?;
            let r = pool
                .move_out_volume(&name, &to)
                .with_context(|| format!("cannot move volume {name:?} to host {to}"))?;
            writeln!(
                ctx.out,
                "volume {name} handed to host {} (slot {}): written there from now on; run `condense volume adopt {name} --from-host HOST` on {}, where HOST is this host's name in `condense hosts`",
                r.host, r.slot, r.host
            )?;
            ctx.done(&pool)?;
        }
        VolumeCommand::Adopt {
            names,
            from_host,
            take_over,
            wait,
        } => adopt(ctx, &names, &from_host, take_over.then_some(wait))?,
        VolumeCommand::Rollback {
            target: (volume, snap),
            force,
        } => snapshot::rollback(ctx, &volume, &snap, force)?,
        VolumeCommand::LibvirtXml(a) => libvirt::run(ctx, &a)?,
    }
    Ok(0)
}

/// `volume list`.
fn list(ctx: &mut Ctx, json: bool, all: bool) -> Result<()> {
    let pool = ctx.pool_for_figures(true)?;
    let stats = pool.stats()?;
    let volumes = stats
        .volumes
        .iter()
        .filter(|v| all || !v.name.starts_with('.'))
        .map(|v| (v, pool.is_importing(&v.name)))
        .collect();
    crate::print(ctx.out, &VolumeList { volumes }, json)?;
    Ok(ctx.done(&pool)?)
}

/// `volume info NAME`.
fn info(ctx: &mut Ctx, name: &str, json: bool) -> Result<()> {
    let pool = ctx.pool(true)?;
    if !pool.volumes().iter().any(|(n, _)| n == name) {
        bail!(
            "volume {name:?} not found in pool {} (see `condense volume list`)",
            ctx.path.display()
        );
    }
    let volume = &pool
        .volume_stats(name)
        .with_context(|| format!("cannot read volume {name:?}"))?;
    let importing = pool.is_importing(name);
    crate::print(ctx.out, &VolumeInfo { volume, importing }, json)?;
    Ok(ctx.done(&pool)?)
}

/// `volume adopt VOL... --from-host HOST [--take-over --wait SECONDS]` (`wait` with
/// --take-over).
fn adopt(ctx: &mut Ctx, names: &[String], from_host: &str, wait: Option<u64>) -> Result<()> {
    let started = std::time::Instant::now();
    let pool = ctx.pool(false)?;
    let reports =
        if let Some(wait) = wait {
            writeln!(
            ctx.out,
            "taking {} over from host {from_host}: waiting up to {wait} s for its lease to expire",
            names.join(", ")
        )?;
            pool.take_over_volumes(names, from_host, std::time::Duration::from_secs(wait))
                .with_context(|| {
                    format!(
                        "cannot take {} over from host {from_host}",
                        names.join(", ")
                    )
                })?
        } else {
            let mut all = Vec::new();
            for name in names {
                all.push(pool.adopt_volume(name, from_host).with_context(|| {
                    format!("cannot adopt volume {name:?} from host {from_host}")
                })?);
            }
            all
        };
    for r in reports {
        let c = r.clone.unwrap_or_default();
        writeln!(
            ctx.out,
            "adopted volume {} from host {} ({} blocks with data, {} chunks new to this host); host {} deletes its copy at its next sync",
            r.volume, r.host, c.data_blocks, c.chunks_added, r.host
        )?;
    }
    writeln!(ctx.out, "done in {:.2} s", started.elapsed().as_secs_f64())?;
    ctx.done(&pool)?;
    Ok(())
}
