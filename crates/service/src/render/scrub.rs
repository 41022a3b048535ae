//! The scrub: `scrub --status`, and the `scrub` part of `stats` (docs/STATS.md).

use super::{ago, human, round2, FileNames, Report};
use condense_engine::scrub::{ScrubPass, ScrubStatus};
use serde::{Serialize, Serializer};
use std::fmt::Write;

/// The scrub's status: the pass under way and the last one, damage named by volume (and by
/// file for a `files/` file's volume).
pub struct ScrubReport<'a> {
    pub status: &'a ScrubStatus,
    pub block_size: u32,
    pub files: &'a FileNames,
}

#[derive(Serialize)]
struct Status<'a> {
    rate_bytes_per_sec: u64,
    running: bool,
    current: Option<Pass<'a>>,
    last: Option<Pass<'a>>,
}

#[derive(Serialize)]
struct Pass<'a> {
    started_unix: u64,
    finished_unix: Option<u64>,
    chunks_total: u64,
    chunks_checked: u64,
    bytes_checked: u64,
    progress_percent: f64,
    damaged_chunks: u64,
    healed_chunks: u64,
    stopped: bool,
    damaged: Vec<Damaged<'a>>,
    damaged_blocks: Vec<DamagedBlocks<'a>>,
}

#[derive(Serialize)]
struct Damaged<'a> {
    chunk: u64,
    problem: &'a str,
}

#[derive(Serialize)]
struct DamagedBlocks<'a> {
    volume: &'a str,
    file: Option<&'a str>,
    first_block: u64,
    blocks: u64,
    offset: u64,
    bytes: u64,
}

impl<'a> ScrubReport<'a> {
    fn pass(&self, p: &'a ScrubPass) -> Pass<'a> {
        let bs = u64::from(self.block_size);
        Pass {
            started_unix: p.started_unix,
            finished_unix: p.finished_unix,
            chunks_total: p.chunks_total,
            chunks_checked: p.chunks_checked,
            bytes_checked: p.bytes_checked,
            progress_percent: round2(p.progress() * 100.0),
            damaged_chunks: p.damaged_chunks,
            healed_chunks: p.healed_chunks,
            stopped: p.stopped,
            damaged: p
                .damaged
                .iter()
                .map(|(chunk, problem)| Damaged {
                    chunk: *chunk,
                    problem,
                })
                .collect(),
            damaged_blocks: p
                .damaged_blocks
                .iter()
                .map(|(v, first, n)| DamagedBlocks {
                    volume: v,
                    file: self.files.get(v),
                    first_block: *first,
                    blocks: *n,
                    offset: first * bs,
                    bytes: n * bs,
                })
                .collect(),
        }
    }
}

impl Serialize for ScrubReport<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        Status {
            rate_bytes_per_sec: self.status.rate_bytes_per_sec,
            running: self.status.running,
            current: self.status.current.as_ref().map(|p| self.pass(p)),
            last: self.status.last.as_ref().map(|p| self.pass(p)),
        }
        .serialize(s)
    }
}

impl Report for ScrubReport<'_> {
    /// The scrub in words, for `stats` and `scrub --status`: the pass under way and the last.
    fn text(&self) -> String {
        let (s, files) = (self.status, self.files);
        let mut o = String::new();
        let rate = if s.rate_bytes_per_sec == 0 {
            "no limit".to_string()
        } else {
            format!("{}/s", human(s.rate_bytes_per_sec))
        };
        match (&s.current, s.running) {
            (Some(p), true) => {
                let _ = writeln!(
                    o,
                    "  {:<28} running at {rate}: {:.1} %, {}",
                    "scrub",
                    p.progress() * 100.0,
                    pass_text(p, files)
                );
            }
            _ => {
                let _ = writeln!(o, "  {:<28} not running", "scrub");
            }
        }
        match &s.last {
            Some(p) => {
                let _ = writeln!(
                    o,
                    "  {:<28} finished {}: {}",
                    "last scrub",
                    p.finished_unix.map_or_else(|| "?".into(), ago),
                    pass_text(p, files)
                );
            }
            None => {
                let _ = writeln!(o, "  {:<28} never", "last scrub");
            }
        }
        if s.last.as_ref().is_some_and(|p| p.damaged_chunks > 0)
            || s.current.as_ref().is_some_and(|p| p.damaged_chunks > 0)
        {
            let _ = writeln!(
                o,
                "  damage found: `condense verify` names every block, `condense repair` salvages the pool (docs/REPAIR.md)"
            );
        }
        o
    }
}

/// One pass in words: "checked 1200 of 1500 chunks (4.7 MiB), no damage".
fn pass_text(p: &ScrubPass, files: &FileNames) -> String {
    let mut t = format!(
        "checked {} of {} chunks ({}){}, ",
        p.chunks_checked,
        p.chunks_total,
        human(p.bytes_checked),
        if p.stopped {
            ", stopped before the end"
        } else {
            ""
        }
    );
    if p.healed_chunks > 0 {
        let _ = write!(
            t,
            "{} damaged records written again from the cache tier's copy, ",
            p.healed_chunks
        );
    }
    if p.damaged_chunks == 0 {
        t.push_str("no damage");
        return t;
    }
    let _ = write!(t, "{} DAMAGED chunks", p.damaged_chunks);
    let names: Vec<String> = p
        .damaged_blocks
        .iter()
        .take(5)
        .map(|(v, first, n)| match n {
            1 => format!("{} block {first}", files.show(v)),
            _ => format!("{} blocks {first}-{}", files.show(v), first + n - 1),
        })
        .collect();
    if !names.is_empty() {
        let more = if p.damaged_blocks.len() > 5 {
            ", ..."
        } else {
            ""
        };
        let _ = write!(t, " ({}{more})", names.join(", "));
    }
    t
}
