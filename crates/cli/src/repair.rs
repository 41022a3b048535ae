//! `condense repair`: arguments and the report, in an administrator's terms. The work is
//! `condense_engine::repair` (docs/REPAIR.md).

use anyhow::{Context, Result};
use clap::Args;
use condense_service::render::repair::{History, RepairResult};
use std::path::Path;

/// The long help of `condense repair`.
pub(crate) const LONG_ABOUT: &str =
    "Salvage a pool whose journal is damaged in the middle (opening fails with \"run \
`condense repair`\"), whose checkpoint has an unreadable block-map or chunk-table page, or \
whose segments hold damaged chunk records (reads and `condense verify` fail). Every chunk is \
read and checked as `condense verify` does; a damaged one is replaced by another valid copy \
in the segments if there is one, else the blocks naming it are lost. Everything valid is kept; the report names what was lost: \
volume (or VOLUME@SNAPSHOT), block and byte ranges, and why. Reference counts and free metadata \
space are recomputed from the block maps, and a fresh checkpoint and journal are written, so \
`condense verify` is clean and the pool opens afterwards.\n\n\
The pool must not be in use (stop `condense serve` / `condense mount` first). Before changing \
anything, repair copies the superblock, checkpoint, meta.dat and journals into \
POOL/repair-<UTC time>/. Run with --dry-run first: it reads the same things, prints the same \
report, and writes nothing.\n\n\
Exit status: 0 when the repair was done (or a dry run found nothing to repair), 3 when a dry \
run found damage that a repair would fix, 1 on error. See docs/REPAIR.md.";

#[derive(Args)]
pub(crate) struct RepairArgs {
    /// Report what a repair would salvage and lose; change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Repair nothing: list what earlier repairs lost (kept in the pool until cleared;
    /// `condense verify` lists it too).
    #[arg(long, conflicts_with_all = ["dry_run", "clear_history"])]
    history: bool,
    /// Repair nothing: forget what earlier repairs lost, once those blocks are restored or
    /// no longer matter.
    #[arg(long, conflicts_with = "dry_run")]
    clear_history: bool,
    /// Lost blocks read as zeros after the repair. Without it they fail with an I/O error
    /// until written again, so that no guest or backup takes zeros for its data; zeros let a
    /// guest's file system mount and its fsck find the holes. `condense export
    /// --lost-as-zeros` copies a volume with lost blocks either way.
    #[arg(long, conflicts_with_all = ["history", "clear_history"])]
    lost_as_zeros: bool,
}

pub(crate) fn run(pool: &Path, a: &RepairArgs) -> Result<i32> {
    if a.history || a.clear_history {
        return history(pool, a);
    }
    let mut key = condense_service::keys::user_key()?;
    let bar = crate::image::bar(0, "checking chunks");
    let progress = |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    };
    let opts = |key| condense_engine::repair::RepairOptions {
        dry_run: a.dry_run,
        key,
        lost_as_zeros: a.lost_as_zeros,
    };
    let mut r = condense_engine::repair::repair_with(pool, opts(key.clone()), &progress);
    if matches!(r, Err(condense_engine::Error::KeyRequired(_))) && key.is_none() {
        // An encrypted pool and no key option: ask the terminal, if there is one.
        key = condense_service::keys::prompt(
            &format!("Passphrase of pool {}", pool.display()),
            false,
        )?;
        if key.is_some() {
            r = condense_engine::repair::repair_with(pool, opts(key), &progress);
        }
    }
    bar.finish_and_clear();
    let r = r.with_context(|| {
        format!(
            "cannot repair pool {}{}",
            pool.display(),
            if a.dry_run { " (dry run)" } else { "" }
        )
    })?;
    let report = RepairResult { pool, report: &r };
    crate::print(&mut std::io::stdout(), &report, a.json)?;
    Ok(if a.dry_run && r.found_damage() { 3 } else { 0 })
}

/// `repair --history` and `--clear-history`.
fn history(path: &Path, a: &RepairArgs) -> Result<i32> {
    let pool = condense_service::open::open_pool(path, a.history)?;
    if a.clear_history {
        let n = condense_engine::repair::clear_damage_history(&pool)
            .with_context(|| format!("clearing the damage history of pool {}", path.display()))?;
        pool.close()?;
        println!(
            "forgot the losses of {n} earlier repair(s) of pool {}",
            path.display()
        );
        return Ok(0);
    }
    let history = condense_engine::repair::damage_history(&pool);
    let report = History {
        pool: path,
        history: &history,
    };
    crate::print(&mut std::io::stdout(), &report, a.json)?;
    Ok(0)
}
