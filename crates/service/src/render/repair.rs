//! `repair`: what a repair kept, lost and changed (or would), and `repair --history`.

use super::verify::DamageHistory;
use super::{human, Report};
use condense_engine::repair::{DamageRecord, RepairReport};
use serde::{Serialize, Serializer};
use std::path::Path;

/// The result of `repair` (or `repair --dry-run`) of the pool at `pool`.
pub struct RepairResult<'a> {
    pub pool: &'a Path,
    pub report: &'a RepairReport,
}

#[derive(Serialize)]
struct Wire<'a> {
    dry_run: bool,
    damage_found: bool,
    block_size: u32,
    backup: Option<String>,
    journal: Journal<'a>,
    lost: Vec<Lost<'a>>,
    lost_blocks: u64,
    notes: &'a [String],
    volumes: u64,
    chunks_kept: u64,
    chunks_found_in_segments: u64,
    chunks_no_longer_named: u64,
    unreadable_map_pages: u64,
    unreadable_chunk_table_pages: u64,
    chunks_checked: u64,
    damaged_chunks: u64,
}

#[derive(Serialize)]
struct Journal<'a> {
    batches_salvaged: u64,
    records_salvaged: u64,
    damaged: Vec<Stretch<'a>>,
}

#[derive(Serialize)]
struct Stretch<'a> {
    file: &'a str,
    offset: u64,
    bytes: u64,
    first_batch: u64,
    next_valid_batch: u64,
    decoded_records: usize,
    decoded_whole: bool,
}

#[derive(Serialize)]
struct Lost<'a> {
    volume: &'a str,
    first_block: u64,
    blocks: u64,
    offset: u64,
    bytes: u64,
    reason: &'a str,
}

impl Serialize for RepairResult<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let r = self.report;
        let bs = u64::from(r.block_size);
        let damaged = r.damaged_journal.iter().map(|d| Stretch {
            file: &d.file,
            offset: d.offset,
            bytes: d.bytes,
            first_batch: d.first_seq,
            next_valid_batch: d.next_seq,
            decoded_records: d.records.len(),
            decoded_whole: d.decoded_whole,
        });
        let lost = r.lost.iter().map(|l| Lost {
            volume: &l.volume,
            first_block: l.first_block,
            blocks: l.blocks,
            offset: l.first_block * bs,
            bytes: l.blocks * bs,
            reason: &l.reason,
        });
        Wire {
            dry_run: r.dry_run,
            damage_found: r.found_damage(),
            block_size: r.block_size,
            backup: r.backup.as_ref().map(|b| b.display().to_string()),
            journal: Journal {
                batches_salvaged: r.journal_batches,
                records_salvaged: r.journal_records,
                damaged: damaged.collect(),
            },
            lost: lost.collect(),
            lost_blocks: r.lost_blocks(),
            notes: &r.notes,
            volumes: r.volumes,
            chunks_kept: r.chunks_kept,
            chunks_found_in_segments: r.chunks_from_segments,
            chunks_no_longer_named: r.chunks_dropped,
            unreadable_map_pages: r.unreadable_map_pages,
            unreadable_chunk_table_pages: r.unreadable_chunk_pages,
            chunks_checked: r.chunks_checked,
            damaged_chunks: r.damaged_chunks,
        }
        .serialize(s)
    }
}

impl Report for RepairResult<'_> {
    fn text(&self) -> String {
        let r = self.report;
        let bs = u64::from(r.block_size);
        let mut s = String::new();
        let mut line = |l: String| {
            s.push_str(&l);
            s.push('\n');
        };
        line(format!(
            "repair of pool {}{}",
            self.pool.display(),
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
                human(r.lost_blocks() * bs),
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
}

/// `repair --history`: what earlier repairs of the pool at `pool` lost.
pub struct History<'a> {
    pub pool: &'a Path,
    pub history: &'a [DamageRecord],
}

impl Serialize for History<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        DamageHistory(self.history).serialize(s)
    }
}

impl Report for History<'_> {
    fn text(&self) -> String {
        use std::fmt::Write;
        if self.history.is_empty() {
            return format!(
                "no earlier repair of pool {} lost anything\n",
                self.pool.display()
            );
        }
        let mut o = String::new();
        for d in self.history {
            let blocks: u64 = d.lost.iter().map(|l| l.blocks).sum();
            let _ = writeln!(o, "repair {}: {blocks} blocks lost", d.when);
            for l in &d.lost {
                let _ = writeln!(
                    o,
                    "  volume {} blocks {}-{}: {}",
                    l.volume,
                    l.first_block,
                    l.first_block + l.blocks.saturating_sub(1),
                    l.reason
                );
            }
        }
        o
    }
}
