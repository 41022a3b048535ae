//! `condense snapshot …`, `condense volume clone|rollback` and `condense diff`: snapshots and
//! clones through the Volume API's [`Catalog`] (JSON documented in docs/SNAPSHOTS.md).

use anyhow::{bail, Context, Result};
use condense_api::{Catalog, SnapshotInfo, VolumeError};
use condense_service::control::Ctx;
use condense_service::render::diff::DiffReport;
use condense_service::render::human;
use condense_service::render::snapshots::{local_time, SnapshotList};
use std::io::Write;

#[derive(clap::Subcommand)]
pub enum SnapshotCommand {
    /// Freeze a volume as it is now, under the name VOL@SNAP. Every write that completed
    /// before is in it. Takes no space at first; it then holds the blocks the volume
    /// overwrites afterwards. Snapshots are read-only; export one over NBD as VOL@SNAP, or
    /// make a writable copy with `condense volume clone VOL@SNAP NEW`.
    Create {
        /// The volume.
        volume: String,
        /// The snapshot's name (unique per volume).
        snapshot: String,
    },
    /// List snapshots: when each was taken (local time), the volume's size then, the bytes
    /// written in it, and the bytes deleting it would free (the blocks only it holds).
    List {
        /// Only the snapshots of this volume.
        volume: Option<String>,
        /// Machine-readable output (schema in docs/SNAPSHOTS.md).
        #[arg(long)]
        json: bool,
    },
    /// Delete a snapshot. The volume and its other snapshots are untouched; the blocks only
    /// this snapshot held are released (space returns after `condense gc`).
    Delete {
        #[arg(value_name = "VOL@SNAP", value_parser = parse_snapshot_name)]
        target: (String, String),
    },
}

#[derive(clap::Args)]
pub struct DiffArgs {
    /// The older version: VOL@SNAP.
    #[arg(value_name = "VOL@A")]
    pub from: String,
    /// The newer version: VOL@SNAP, or VOL for the volume as it is now.
    #[arg(value_name = "VOL[@B]")]
    pub to: String,
    /// Machine-readable output (schema in docs/SNAPSHOTS.md).
    #[arg(long)]
    pub json: bool,
}

/// `VOL@SNAP` → (VOL, SNAP); both parts non-empty.
pub fn parse_snapshot_name(s: &str) -> Result<(String, String), String> {
    match condense_api::split_snapshot_name(s) {
        Some((v, n)) if !v.is_empty() && !n.is_empty() => Ok((v.to_string(), n.to_string())),
        _ => Err(format!(
            "{s:?} is not a snapshot name: write VOLUME@SNAPSHOT (see `condense snapshot list`)"
        )),
    }
}

/// Add a hint to errors an administrator can act on.
fn hint(e: VolumeError) -> anyhow::Error {
    match e {
        VolumeError::Busy(_) => anyhow::Error::new(e).context(
            "the volume is open for writing (an NBD client or a mount); stop the client, or pass --force",
        ),
        e => anyhow::Error::new(e),
    }
}

pub fn run(ctx: &mut Ctx, cmd: SnapshotCommand) -> Result<i32> {
    match cmd {
        SnapshotCommand::Create { volume, snapshot } => {
            let pool = ctx.pool(false)?;
            create(&*pool, ctx.out, &volume, &snapshot)?;
            ctx.done(&pool)?;
        }
        SnapshotCommand::List { volume, json } => {
            let pool = ctx.pool(true)?;
            let shown = ctx.path.display().to_string();
            list(&*pool, ctx.out, volume.as_deref(), json, &shown)?;
            ctx.done(&pool)?;
        }
        SnapshotCommand::Delete {
            target: (volume, snapshot),
        } => {
            let pool = ctx.pool(false)?;
            delete(&*pool, ctx.out, &volume, &snapshot)?;
            crate::image::release_deleted(ctx, &pool)?;
            ctx.done(&pool)?;
        }
    }
    Ok(0)
}

/// `condense volume clone SOURCE NEW`.
pub fn clone(ctx: &mut Ctx, source: &str, new: &str) -> Result<()> {
    let pool = ctx.pool(false)?;
    clone_in(&*pool, ctx.out, source, new)?;
    Ok(ctx.done(&pool)?)
}

/// `condense volume rollback VOLUME@SNAPSHOT [--force]`.
pub fn rollback(ctx: &mut Ctx, volume: &str, snapshot: &str, force: bool) -> Result<()> {
    let pool = ctx.pool(false)?;
    rollback_in(&*pool, ctx.out, volume, snapshot, force)?;
    crate::image::release_deleted(ctx, &pool)?;
    Ok(ctx.done(&pool)?)
}

/// `condense diff FROM TO [--json]`: compared in bounded steps (each costs the block-map
/// leaves it looks at, not the bytes it covers), giving up between two steps when nobody
/// waits for the answer any more ([`Ctx::should_stop`]).
pub fn diff(ctx: &mut Ctx, a: &DiffArgs) -> Result<i32> {
    let pool = ctx.pool(true)?;
    let cat: &dyn Catalog = &*pool;
    let len = size_of(cat, &a.from)?.max(size_of(cat, &a.to)?);
    let mut changes = Vec::new();
    let mut at = 0;
    while at < len {
        if ctx.should_stop() {
            bail!(
                "diff of {} and {} stopped at byte {at} of {len}: its client went away or the daemon is stopping",
                a.from,
                a.to
            );
        }
        let (part, next) = pool
            .diff_step(&a.from, &a.to, at, len - at)
            .with_context(|| format!("cannot compare {} with {}", a.from, a.to))?;
        for c in part {
            condense_api::push_change(&mut changes, c.offset, c.len, c.changed);
        }
        at = next;
    }
    write_diff(ctx.out, a, len, &changes)?;
    ctx.done(&pool)?;
    Ok(0)
}

fn size_of(cat: &dyn Catalog, name: &str) -> Result<u64> {
    Ok(cat
        .open(name)
        .with_context(|| format!("cannot open {name}"))?
        .size())
}

fn create(cat: &dyn Catalog, out: &mut dyn Write, volume: &str, snapshot: &str) -> Result<()> {
    cat.snapshot_create(volume, snapshot)
        .map_err(hint)
        .with_context(|| format!("cannot snapshot volume {volume:?} as {snapshot:?}"))?;
    let made = cat.snapshots().ok().and_then(|l| {
        l.into_iter()
            .find(|s| s.volume == volume && s.snapshot == snapshot)
    });
    match made {
        Some(s) => writeln!(
            out,
            "created snapshot {} ({} logical, {} written), taken {}",
            s.full_name(),
            human(s.size_bytes),
            human(s.written_bytes),
            local_time(s.created_unix).0
        )?,
        None => writeln!(out, "created snapshot {volume}@{snapshot}")?,
    }
    Ok(())
}

fn list(
    cat: &dyn Catalog,
    out: &mut dyn Write,
    volume: Option<&str>,
    json: bool,
    pool_shown: &str,
) -> Result<()> {
    if let Some(v) = volume {
        if !cat.list()?.iter().any(|i| i.name == v) {
            bail!("volume {v:?} not found in pool {pool_shown} (see `condense volume list`)");
        }
    }
    let snaps: Vec<SnapshotInfo> = cat
        .snapshots()
        .context("cannot list snapshots")?
        .into_iter()
        .filter(|s| volume.is_none_or(|v| v == s.volume))
        .collect();
    let mut rows = Vec::with_capacity(snaps.len());
    for s in snaps {
        let freeable = cat
            .snapshot_freeable_bytes(&s.volume, &s.snapshot)
            .with_context(|| format!("cannot size snapshot {}", s.full_name()))?;
        rows.push((s, freeable));
    }
    crate::print(out, &SnapshotList { rows }, json)
}

fn delete(cat: &dyn Catalog, out: &mut dyn Write, volume: &str, snapshot: &str) -> Result<()> {
    cat.snapshot_delete(volume, snapshot)
        .map_err(hint)
        .with_context(|| format!("cannot delete snapshot {volume}@{snapshot}"))?;
    writeln!(
        out,
        "deleted snapshot {volume}@{snapshot}; run `condense gc` to reclaim the space only it held"
    )?;
    Ok(())
}

fn clone_in(cat: &dyn Catalog, out: &mut dyn Write, source: &str, new: &str) -> Result<()> {
    cat.clone_volume(source, new)
        .map_err(hint)
        .with_context(|| format!("cannot clone {source} as {new:?}"))?;
    match size_of(cat, new) {
        Ok(size) => writeln!(
            out,
            "created volume {new}, a clone of {source} ({} logical, thin: shares its blocks until written)",
            human(size)
        )?,
        Err(_) => writeln!(out, "created volume {new}, a clone of {source}")?,
    }
    Ok(())
}

fn rollback_in(
    cat: &dyn Catalog,
    out: &mut dyn Write,
    volume: &str,
    snapshot: &str,
    force: bool,
) -> Result<()> {
    cat.rollback(volume, snapshot, force)
        .map_err(hint)
        .with_context(|| format!("cannot roll volume {volume:?} back to {volume}@{snapshot}"))?;
    writeln!(
        out,
        "rolled volume {volume} back to snapshot {volume}@{snapshot}{}; what was written since is gone",
        size_of(cat, volume)
            .map(|s| format!(" ({} logical)", human(s)))
            .unwrap_or_default()
    )?;
    Ok(())
}

#[cfg(test)]
fn diff_in(cat: &dyn Catalog, out: &mut dyn Write, a: &DiffArgs) -> Result<()> {
    let len = size_of(cat, &a.from)?.max(size_of(cat, &a.to)?);
    let changes = cat
        .diff(&a.from, &a.to, 0, len)
        .with_context(|| format!("cannot compare {} with {}", a.from, a.to))?;
    write_diff(out, a, len, &changes)
}

/// Print the changed extents of a comparison of `len` bytes.
fn write_diff(
    out: &mut dyn Write,
    a: &DiffArgs,
    len: u64,
    changes: &[condense_api::Change],
) -> Result<()> {
    crate::print(out, &DiffReport::new(&a.from, &a.to, len, changes), a.json)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn snapshot_names_need_both_parts() {
        assert_eq!(
            parse_snapshot_name("vm@monday"),
            Ok(("vm".into(), "monday".into()))
        );
        assert!(parse_snapshot_name("vm").is_err());
        assert!(parse_snapshot_name("@x").is_err());
        assert!(parse_snapshot_name("vm@").is_err());
    }

    fn out(f: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<String> {
        let mut buf = Vec::new();
        f(&mut buf)?;
        Ok(String::from_utf8(buf)?)
    }

    /// The commands' output over the Volume API's in-memory model (the engine's snapshots
    /// are tested through the binary in tests/control_socket.rs).
    #[test]
    fn snapshot_commands_over_the_reference_model() -> Result<()> {
        let cat = condense_api::mem::MemCatalog::new(4096);
        cat.create("v", 1 << 20)?;
        let v = cat.open("v")?;
        v.write(0, &[0xab; 8192], false)?;
        let text = out(|o| create(&cat, o, "v", "s1"))?;
        assert!(
            text.starts_with("created snapshot v@s1 (1.00 MiB logical, 8.00 KiB written)"),
            "{text}"
        );
        v.write(65536, &[0xcd; 4096], false)?;
        v.write(131072, &[0xcd; 4096], false)?;

        let j: Value = serde_json::from_str(&out(|o| list(&cat, o, None, true, "p"))?)?;
        assert_eq!(j["schema"], "condense.snapshots/1");
        let s = &j["snapshots"][0];
        assert_eq!(s["name"], "v@s1");
        assert_eq!(s["volume"], "v");
        assert_eq!(s["snapshot"], "s1");
        assert_eq!(s["size_bytes"], 1 << 20);
        assert_eq!(s["written_bytes"], 8192);
        assert!(s["created_unix"].is_u64());
        assert!(s["created"].is_string());
        assert!(s.get("freeable_bytes").is_some());
        let table = out(|o| list(&cat, o, Some("v"), false, "p"))?;
        assert!(
            table.lines().nth(1).is_some_and(|l| l.starts_with("v@s1 ")),
            "{table}"
        );
        assert!(list(&cat, &mut Vec::new(), Some("nope"), false, "p").is_err());

        let args = DiffArgs {
            from: "v@s1".into(),
            to: "v".into(),
            json: true,
        };
        let d: Value = serde_json::from_str(&out(|o| diff_in(&cat, o, &args))?)?;
        assert_eq!(d["schema"], "condense.diff/1");
        assert_eq!(d["size_bytes"], 1 << 20);
        assert_eq!(d["changed_bytes"], 8192);
        assert_eq!(d["extent_count"], 2);
        let extent = |i: usize| {
            (
                d["extents"][i]["offset"].clone(),
                d["extents"][i]["length"].clone(),
            )
        };
        assert_eq!(extent(0), (65536.into(), 4096.into()));
        assert_eq!(extent(1), (131072.into(), 4096.into()));
        let args = DiffArgs {
            json: false,
            ..args
        };
        let t = out(|o| diff_in(&cat, o, &args))?;
        assert!(
            t.ends_with("8.00 KiB changed in 2 extents between v@s1 and v (of 1.00 MiB)\n"),
            "{t}"
        );

        let t = out(|o| clone_in(&cat, o, "v@s1", "c"))?;
        assert!(
            t.starts_with("created volume c, a clone of v@s1 (1.00 MiB logical"),
            "{t}"
        );
        let t = out(|o| rollback_in(&cat, o, "v", "s1", false))?;
        assert!(
            t.starts_with("rolled volume v back to snapshot v@s1 (1.00 MiB logical)"),
            "{t}"
        );
        let args = DiffArgs {
            from: "v@s1".into(),
            to: "v".into(),
            json: true,
        };
        let d: Value = serde_json::from_str(&out(|o| diff_in(&cat, o, &args))?)?;
        assert_eq!(d["changed_bytes"], 0);
        assert_eq!(d["extents"].as_array().map(Vec::len), Some(0));

        out(|o| delete(&cat, o, "v", "s1"))?;
        let j: Value = serde_json::from_str(&out(|o| list(&cat, o, None, true, "p"))?)?;
        assert_eq!(j["snapshots"].as_array().map(Vec::len), Some(0));
        let e = delete(&cat, &mut Vec::new(), "v", "s1")
            .err()
            .map(|e| format!("{e:#}"));
        assert!(e.is_some_and(|e| e.contains("v@s1")));
        Ok(())
    }

    #[test]
    fn busy_gets_a_hint() {
        let e = format!("{:#}", hint(VolumeError::Busy("v is open".into())));
        assert!(e.contains("--force"), "{e}");
    }

    #[test]
    fn local_time_has_both_forms() {
        let (shown, iso) = local_time(0);
        assert_eq!(shown.len(), 19);
        assert_eq!(iso.len(), 25);
        assert_eq!(&shown[..10], &iso[..10]);
    }
}
