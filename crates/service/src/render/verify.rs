//! `verify`: what was read, what is damaged, and what earlier repairs lost.

use super::{human, FileNames, Report};
use condense_engine::repair::DamageRecord;
use serde::{Serialize, Serializer};
use std::fmt::Write;

/// The result of `verify`, damaged blocks named by volume (and file).
pub struct VerifyReport<'a> {
    pub report: &'a condense_engine::verify::VerifyReport,
    pub files: &'a FileNames,
}

#[derive(Serialize)]
struct Wire<'a> {
    clean: bool,
    chunks_checked: u64,
    bytes_checked: u64,
    bad_chunks: Vec<BadChunk<'a>>,
    bad_blocks: Vec<BadBlocks<'a>>,
    bad_volumes: &'a [String],
    metadata_problems: &'a [String],
    /// Checks that could not be made (not damage).
    not_checked: &'a [String],
    accepted_damage: DamageHistory<'a>,
}

#[derive(Serialize)]
struct BadChunk<'a> {
    chunk: u64,
    problem: &'a str,
}

#[derive(Serialize)]
struct BadBlocks<'a> {
    volume: &'a str,
    file: Option<&'a str>,
    blocks: &'a [u64],
}

impl Serialize for VerifyReport<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let r = self.report;
        Wire {
            clean: r.is_clean(),
            chunks_checked: r.chunks_checked,
            bytes_checked: r.bytes_checked,
            bad_chunks: r
                .bad_chunks
                .iter()
                .map(|(chunk, problem)| BadChunk {
                    chunk: *chunk,
                    problem,
                })
                .collect(),
            bad_blocks: r
                .bad_blocks
                .iter()
                .map(|(v, blocks)| BadBlocks {
                    volume: v,
                    file: self.files.get(v),
                    blocks,
                })
                .collect(),
            bad_volumes: &r.bad_volumes,
            metadata_problems: &r.metadata_problems,
            not_checked: &r.not_checked,
            accepted_damage: DamageHistory(&r.accepted),
        }
        .serialize(s)
    }
}

impl Report for VerifyReport<'_> {
    fn text(&self) -> String {
        let (r, files) = (self.report, self.files);
        let mut o = format!(
            "checked {} chunks ({})\n",
            r.chunks_checked,
            human(r.bytes_checked)
        );
        for n in &r.not_checked {
            let _ = writeln!(o, "not checked: {n}");
        }
        if r.is_clean() {
            o.push_str("no damage found\n");
            accepted_text(&r.accepted, &mut o);
            return o;
        }
        for p in &r.metadata_problems {
            let _ = writeln!(o, "metadata: {p}");
        }
        for (id, why) in r.bad_chunks.iter().take(20) {
            let _ = writeln!(o, "chunk {id}: {why}");
        }
        if r.bad_chunks.len() > 20 {
            let _ = writeln!(o, "... and {} more damaged chunks", r.bad_chunks.len() - 20);
        }
        for v in &r.bad_volumes {
            let _ = writeln!(o, "volume {v}: block map damaged, every block unreadable");
        }
        for (v, blocks) in &r.bad_blocks {
            let shown: Vec<String> = blocks.iter().take(16).map(|b| b.to_string()).collect();
            let _ = writeln!(
                o,
                "volume {}: {} damaged blocks: {}{}",
                files.show(v),
                blocks.len(),
                shown.join(", "),
                if blocks.len() > 16 { ", ..." } else { "" }
            );
        }
        o.push_str("reads of damaged blocks fail with an I/O error; other blocks read normally. Stop the pool's users and run `condense repair --dry-run`, then `condense repair`: it keeps everything valid and names what is lost (restore that from a backup).\n");
        accepted_text(&r.accepted, &mut o);
        o
    }
}

/// What earlier repairs lost (the pool's damage history), as `verify --json` and `repair
/// --history --json` print it.
pub struct DamageHistory<'a>(pub &'a [DamageRecord]);

#[derive(Serialize)]
struct Repaired<'a> {
    repaired: &'a str,
    lost: Vec<Lost<'a>>,
}

#[derive(Serialize)]
struct Lost<'a> {
    volume: &'a str,
    first_block: u64,
    blocks: u64,
    reason: &'a str,
}

impl Serialize for DamageHistory<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|d| {
            Repaired {
                repaired: &d.when,
                lost: d
                    .lost
                    .iter()
                    .map(|l| Lost {
                        volume: &l.volume,
                        first_block: l.first_block,
                        blocks: l.blocks,
                        reason: &l.reason,
                    })
                    .collect(),
            }
        }))
    }
}

/// The losses earlier repairs accepted, one line per range (at most 20 in all).
fn accepted_text(accepted: &[DamageRecord], o: &mut String) {
    if accepted.is_empty() {
        return;
    }
    let _ = writeln!(
        o,
        "damage accepted by earlier repairs (each line says how those blocks read now; `condense repair --clear-history` forgets them):"
    );
    let mut shown = 0;
    for d in accepted {
        for l in &d.lost {
            if shown < 20 {
                let _ = writeln!(
                    o,
                    "  repair {}: volume {} blocks {}-{}: {}",
                    d.when,
                    l.volume,
                    l.first_block,
                    l.first_block + l.blocks.saturating_sub(1),
                    l.reason
                );
            }
            shown += 1;
        }
    }
    if shown > 20 {
        let _ = writeln!(o, "  ... and {} more ranges", shown - 20);
    }
}
