//! `condense verify`: read and check every chunk and every map; report damage by volume and
//! block.
//!
//! Each live chunk is read, its record CRC checked, decompressed, and its fingerprint
//! recomputed and compared. Blocks whose chunk fails are listed per volume, together with any
//! metadata problems found when the pool was opened (damaged checkpoint sections).

use crate::error::Result;
use crate::format::{decode_record, CHUNK_ID_LIMIT, ENTRY_ZERO};
use crate::pool::{lock, Pool};
use crate::reduction;
use rayon::prelude::*;
use std::collections::{BTreeMap, HashSet};

#[derive(Clone, Debug, Default)]
pub struct VerifyReport {
    pub chunks_checked: u64,
    pub bytes_checked: u64,
    /// (chunk id, what is wrong)
    pub bad_chunks: Vec<(u32, String)>,
    /// volume name → damaged block numbers
    pub bad_blocks: BTreeMap<String, Vec<u64>>,
    /// Volumes whose block map is damaged (every block unreadable).
    pub bad_volumes: Vec<String>,
    pub metadata_problems: Vec<String>,
}

impl VerifyReport {
    pub fn is_clean(&self) -> bool {
        self.bad_chunks.is_empty()
            && self.bad_blocks.is_empty()
            && self.bad_volumes.is_empty()
            && self.metadata_problems.is_empty()
    }
}

impl Pool {
    /// Check everything. `progress(done, total)` is called as chunks are checked.
    pub fn verify(&self, progress: &(dyn Fn(u64, u64) + Sync)) -> Result<VerifyReport> {
        self.flush()?;
        let bs = self.block_size() as usize;
        let key = self.sb.key;
        let (work, mut report) = {
            let st = lock(&self.state);
            let mut report = VerifyReport {
                metadata_problems: st.open_problems.clone(),
                ..Default::default()
            };
            let mut work = Vec::new();
            for (id, e) in st.chunks.iter() {
                match e.location() {
                    Some(loc) => work.push((id, e.fp, loc, st.segments.file(loc.segment))),
                    None => report
                        .bad_chunks
                        .push((id, "chunk metadata damaged".into())),
                }
            }
            (work, report)
        };
        let total = work.len() as u64;
        let done = std::sync::atomic::AtomicU64::new(0);
        let results: Vec<(u64, Option<(u32, String)>)> = work
            .par_iter()
            .map(|(id, fp, loc, file)| {
                let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if n.is_multiple_of(4096) {
                    progress(n, total);
                }
                let Some(file) = file else {
                    return (
                        0,
                        Some((*id, format!("segment {} is missing", loc.segment))),
                    );
                };
                let mut buf = vec![0u8; loc.record_bytes() as usize];
                if let Err(e) = file.read_at(&mut buf, u64::from(loc.offset)) {
                    return (
                        0,
                        Some((
                            *id,
                            format!("cannot read segment {} at {}: {e}", loc.segment, loc.offset),
                        )),
                    );
                }
                let payload = match decode_record(&buf, *id, loc) {
                    Ok((_, p)) => p,
                    Err(e) => return (0, Some((*id, e.to_string()))),
                };
                let mut out = vec![0u8; bs];
                if let Err(e) =
                    reduction::decompress(loc.codec, payload, &mut out, || format!("chunk {id}"))
                {
                    return (0, Some((*id, e.to_string())));
                }
                if &reduction::fingerprint(&key, &out) != fp {
                    return (
                        0,
                        Some((*id, "content does not match its fingerprint".into())),
                    );
                }
                (buf.len() as u64, None)
            })
            .collect();
        progress(total, total);
        for (bytes, bad) in results {
            report.chunks_checked += 1;
            report.bytes_checked += bytes;
            if let Some(b) = bad {
                report.bad_chunks.push(b);
            }
        }
        let bad: HashSet<u32> = report.bad_chunks.iter().map(|(id, _)| *id).collect();
        let st = lock(&self.state);
        for v in st.volumes.values() {
            if v.damaged.is_some() {
                report.bad_volumes.push(v.name.clone());
                continue;
            }
            let blocks: Vec<u64> = v
                .map
                .iter_from(0)
                .filter(|&(_, e)| {
                    e < CHUNK_ID_LIMIT
                        && e != ENTRY_ZERO
                        && (bad.contains(&e) || st.chunks.get(e).is_none())
                })
                .map(|(b, _)| b)
                .collect();
            if !blocks.is_empty() {
                report.bad_blocks.insert(v.name.clone(), blocks);
            }
        }
        Ok(report)
    }
}
