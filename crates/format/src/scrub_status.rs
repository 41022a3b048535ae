//! The scrub's state and results: what `stats`, the metrics and `condense scrub --status`
//! read ([`ScrubStatus`]), the record of the last finished pass kept in the pool
//! (`scrub/last`, [`LAST_KEY`], encoded by [`ScrubPass::encode`]), and the requests that
//! start or stop a pass ([`ScrubState`], held by the pool), and how a pass walks the chunk
//! table ([`WINDOW_PAGES`]). Below the pool: the pool's scrub room and `stats` read it; the
//! background thread is the engine's `scrub` module. Pure data and its
//! encoding, so it lives with the encodings (condense-format).

use std::sync::atomic::AtomicBool;
use std::sync::Mutex;

/// The pool's metadata record of the last finished pass.
pub const LAST_KEY: &str = "scrub/last";
/// Damaged chunks kept in the status (all are counted).
pub const DAMAGED_KEPT: usize = 100;
/// Block ranges kept in the record of the last pass.
pub const RANGES_KEPT: usize = 100;

/// A scrub's progress and results, as `stats` shows them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScrubStatus {
    /// Record bytes per second a pass may read (0: no limit).
    pub rate_bytes_per_sec: u64,
    /// A pass is under way.
    pub running: bool,
    /// The pass under way (or the last one this process ran).
    pub current: Option<ScrubPass>,
    /// The last pass that finished, as recorded in the pool (any process).
    pub last: Option<ScrubPass>,
}

/// One pass: what it checked and found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScrubPass {
    pub started_unix: u64,
    /// `None` while under way.
    pub finished_unix: Option<u64>,
    /// Live chunks when the pass started (the progress's total).
    pub chunks_total: u64,
    pub chunks_checked: u64,
    pub bytes_checked: u64,
    pub damaged_chunks: u64,
    /// Damaged records written again from the cache tier's valid copy.
    pub healed_chunks: u64,
    /// (chunk id, what is wrong), the first [`DAMAGED_KEPT`].
    pub damaged: Vec<(u64, String)>,
    /// Blocks naming a damaged chunk: (volume or `VOL@SNAP`, first block, blocks), found at
    /// the end of a pass that found damage.
    pub damaged_blocks: Vec<(String, u64, u64)>,
    /// The pass was stopped before its end (the process stopped, or `condense scrub --stop`).
    pub stopped: bool,
}

impl ScrubPass {
    /// Share of the pass done, 0..=1.
    pub fn progress(&self) -> f64 {
        if self.finished_unix.is_some() || self.chunks_total == 0 {
            1.0
        } else {
            (self.chunks_checked as f64 / self.chunks_total as f64).min(1.0)
        }
    }

    /// The record kept in the pool: `key=value` lines, then one `block` line per damaged
    /// range (volume TAB first TAB count).
    pub fn encode(&self) -> Vec<u8> {
        let mut s = format!(
            "started={}\nfinished={}\nchunks_total={}\nchunks={}\nbytes={}\ndamaged={}\nhealed={}\nstopped={}\n",
            self.started_unix,
            self.finished_unix.unwrap_or(0),
            self.chunks_total,
            self.chunks_checked,
            self.bytes_checked,
            self.damaged_chunks,
            self.healed_chunks,
            u8::from(self.stopped),
        );
        for (v, first, n) in self.damaged_blocks.iter().take(RANGES_KEPT) {
            s.push_str(&format!(
                "block\t{}\t{first}\t{n}\n",
                v.replace(['\t', '\n'], " ")
            ));
        }
        s.into_bytes()
    }

    /// A record as [`ScrubPass::encode`] wrote it; unknown or malformed lines are skipped (it
    /// is a report, not something the pool depends on).
    pub fn decode(bytes: &[u8]) -> ScrubPass {
        let mut p = ScrubPass::default();
        for line in String::from_utf8_lossy(bytes).lines() {
            if let Some(rest) = line.strip_prefix("block\t") {
                let f: Vec<&str> = rest.split('\t').collect();
                if let [v, first, n] = f[..] {
                    if let (Ok(first), Ok(n)) = (first.parse(), n.parse()) {
                        p.damaged_blocks.push((v.to_string(), first, n));
                    }
                }
                continue;
            }
            let Some((k, v)) = line.split_once('=') else {
                continue;
            };
            let n: u64 = v.parse().unwrap_or(0);
            match k {
                "started" => p.started_unix = n,
                "finished" => p.finished_unix = Some(n),
                "chunks_total" => p.chunks_total = n,
                "chunks" => p.chunks_checked = n,
                "bytes" => p.bytes_checked = n,
                "damaged" => p.damaged_chunks = n,
                "healed" => p.healed_chunks = n,
                "stopped" => p.stopped = n != 0,
                _ => {}
            }
        }
        p
    }
}

pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The scrub's shared state: what `stats` reads and what asks a pass to start or stop.
#[derive(Default)]
pub struct ScrubState {
    pub status: Mutex<ScrubStatus>,
    /// Start a pass now, whatever the schedule (`condense scrub`).
    pub start: AtomicBool,
    /// Stop the pass under way (`condense scrub --stop`).
    pub stop: AtomicBool,
}

/// Chunk-table pages per window (128 chunk ids each).
pub const WINDOW_PAGES: u64 = 8;
/// Merge sorted block numbers into (first, count) ranges.
pub fn ranges(blocks: &[u64]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &b in blocks {
        match out.last_mut() {
            Some((first, n)) if *first + *n == b => *n += 1,
            _ => out.push((b, 1)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_record_reads_back_and_junk_is_skipped() {
        let p = ScrubPass {
            started_unix: 10,
            finished_unix: Some(20),
            chunks_total: 5,
            chunks_checked: 5,
            bytes_checked: 9000,
            damaged_chunks: 1,
            healed_chunks: 2,
            damaged: vec![],
            damaged_blocks: vec![("vm@s1".into(), 7, 2)],
            stopped: false,
        };
        assert_eq!(ScrubPass::decode(&p.encode()), p);
        let junk = ScrubPass::decode(b"chunks=x\nblock\tv\t1\nbytes=3\n\xff\xfe");
        assert_eq!(junk.bytes_checked, 3);
        assert!(junk.damaged_blocks.is_empty());
    }

    #[test]
    fn blocks_merge_into_ranges() {
        assert_eq!(ranges(&[1, 2, 3, 7, 9, 10]), vec![(1, 3), (7, 1), (9, 2)]);
        assert_eq!(ranges(&[]), vec![]);
    }
}
