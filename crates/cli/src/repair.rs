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
`condense repair`\") or whose checkpoint has an unreadable block-map or chunk-table page \
(reads and `condense verify` fail). Everything valid is kept; the report names what was lost: \
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
}

pub(crate) fn run(pool: &Path, a: &RepairArgs) -> Result<i32> {
    let mut key = crate::keys::user_key()?;
    let mut r = condense_engine::repair::repair(pool, a.dry_run, key.clone());
    if matches!(r, Err(condense_engine::Error::KeyRequired(_))) && key.is_none() {
        // An encrypted pool and no key option: ask the terminal, if there is one.
        key = crate::keys::prompt(&format!("Passphrase of pool {}", pool.display()), false)?;
        if key.is_some() {
            r = condense_engine::repair::repair(pool, a.dry_run, key);
        }
    }
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
