//! `condense repair`: arguments and the report, in an administrator's terms. The work is
//! `condense_engine::repair` (docs/REPAIR.md).

use crate::size;
use anyhow::{Context, Result};
use clap::Args;
use condense_engine::repair::RepairReport;
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
    let mut key = crate::keys::user_key()?;
    let bar = crate::report::bar(0, "checking chunks");
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
        key = crate::keys::prompt(&format!("Passphrase of pool {}", pool.display()), false)?;
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
    if a.json {
        println!("{}", serde_json::to_string_pretty(&json(&r))?);
    } else {
        print!("{}", text(pool, &r));
    }
    Ok(if a.dry_run && r.found_damage() { 3 } else { 0 })
}

/// `repair --history` and `--clear-history`.
fn history(path: &Path, a: &RepairArgs) -> Result<i32> {
    let pool = crate::open_pool(path, a.history)?;
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
    let h = condense_engine::repair::damage_history(&pool);
    if a.json {
        let v = crate::report::damage_history_json(&h);
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else if h.is_empty() {
        println!("no earlier repair of pool {} lost anything", path.display());
    } else {
        for d in &h {
            let blocks: u64 = d.lost.iter().map(|l| l.blocks).sum();
            println!("repair {}: {blocks} blocks lost", d.when);
            for l in &d.lost {
                println!(
                    "  volume {} blocks {}-{}: {}",
                    l.volume,
                    l.first_block,
                    l.first_block + l.blocks.saturating_sub(1),
                    l.reason
                );
            }
        }
    }
    Ok(0)
}

fn json(r: &RepairReport) -> serde_json::Value {
    let bs = u64::from(r.block_size);
    serde_json::json!({
        "dry_run": r.dry_run,
        "damage_found": r.found_damage(),
        "block_size": r.block_size,
        "backup": r.backup.as_ref().map(|b| b.display().to_string()),
        "journal": {
            "batches_salvaged": r.journal_batches,
            "records_salvaged": r.journal_records,
            "damaged": r.damaged_journal.iter().map(|d| serde_json::json!({
                "file": d.file,
                "offset": d.offset,
                "bytes": d.bytes,
                "first_batch": d.first_seq,
                "next_valid_batch": d.next_seq,
                "decoded_records": d.records.len(),
                "decoded_whole": d.decoded_whole,
            })).collect::<Vec<_>>(),
        },
        "lost": r.lost.iter().map(|l| serde_json::json!({
            "volume": l.volume,
            "first_block": l.first_block,
            "blocks": l.blocks,
            "offset": l.first_block * bs,
            "bytes": l.blocks * bs,
            "reason": l.reason,
        })).collect::<Vec<_>>(),
        "lost_blocks": r.lost_blocks(),
        "notes": r.notes,
        "volumes": r.volumes,
        "chunks_kept": r.chunks_kept,
        "chunks_found_in_segments": r.chunks_from_segments,
        "chunks_no_longer_named": r.chunks_dropped,
        "unreadable_map_pages": r.unreadable_map_pages,
        "unreadable_chunk_table_pages": r.unreadable_chunk_pages,
        "chunks_checked": r.chunks_checked,
        "damaged_chunks": r.damaged_chunks,
    })
}

fn text(pool: &Path, r: &RepairReport) -> String {
    let bs = u64::from(r.block_size);
    let mut s = String::new();
    let mut line = |l: String| {
        s.push_str(&l);
        s.push('\n');
    };
    line(format!(
        "repair of pool {}{}",
        pool.display(),
        if r.dry_run {
            " (dry run: nothing was changed)"
        } else {
            ""
        }
    ));
    if !r.found_damage() {
        line("no damage found: nothing to repair, nothing changed (`condense verify` reads every chunk)".into());
        return s;
    }
    line(format!(
        "journal: {} valid batches ({} records) salvaged",
        r.journal_batches, r.journal_records
    ));
    for d in &r.damaged_journal {
        line(format!(
            "  damaged: {} bytes {}..{} (batch {} up to {}), {} of its records decodable without their checksum",
            d.file,
            d.offset,
            d.offset + d.bytes,
            d.first_seq,
            d.next_seq,
            d.records.len()
        ));
    }
    line(format!(
        "chunks: {} checked, {} with a damaged record",
        r.chunks_checked, r.damaged_chunks
    ));
    if r.unreadable_map_pages + r.unreadable_chunk_pages > 0 {
        line(format!(
            "checkpoint: {} unreadable block-map page(s), {} unreadable chunk-table page(s)",
            r.unreadable_map_pages, r.unreadable_chunk_pages
        ));
    }
    if r.lost.is_empty() {
        line("lost: no blocks".into());
    } else {
        line(format!(
            "lost: {} blocks ({}) in {} range(s){}:",
            r.lost_blocks(),
            size::human(r.lost_blocks() * bs),
            r.lost.len(),
            if r.dry_run { " would be" } else { "" }
        ));
        for l in &r.lost {
            let (first, last) = (l.first_block, l.first_block + l.blocks - 1);
            line(format!(
                "  {:?} blocks {first}-{last} ({} blocks, bytes {}-{}): {}",
                l.volume,
                l.blocks,
                first * bs,
                (last + 1) * bs - 1,
                l.reason
            ));
        }
    }
    for n in &r.notes {
        line(format!("  note: {n}"));
    }
    line(format!(
        "{}: {} volumes and snapshots, {} chunks ({} found by scanning segments); {} chunks no longer named (dead space for `condense gc`)",
        if r.dry_run { "would keep" } else { "kept" },
        r.volumes,
        r.chunks_kept,
        r.chunks_from_segments,
        r.chunks_dropped
    ));
    match &r.backup {
        Some(b) => line(format!(
            "the damaged metadata files were copied to {}; next: `condense verify`",
            b.display()
        )),
        None => line("run `condense repair` (without --dry-run) to do it; it first copies the damaged files to POOL/repair-<time>/".into()),
    }
    s
}
