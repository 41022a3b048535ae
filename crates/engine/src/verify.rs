//! `condense verify`: read and check every chunk, every metadata page and every map; report
//! damage by volume and block.
//!
//! Each live chunk is read, its record CRC checked, decompressed, and its fingerprint
//! recomputed and compared. Every metadata page is read and checked against the CRC its parent
//! holds. Every block-map entry must name an existing chunk, and each chunk's stored reference
//! count must equal the number of entries naming it. Chunks are checked a window at a time, so
//! verify's memory stays bounded apart from one bit and one counter per chunk id.
//!
//! Owns: the reports and the checks of the maps against the chunk pass; the passes run as
//! [`Pool::verify`](crate::Pool::verify) and [`Pool::check_chunks`](crate::Pool::check_chunks)
//! (the room `pool/verify.rs`), under the pool's locks.

use crate::format::MAP_PAGE_ENTRIES;
use crate::metadata::Metadata;
use std::collections::{BTreeMap, HashSet};

#[derive(Clone, Debug, Default)]
pub struct VerifyReport {
    pub chunks_checked: u64,
    pub bytes_checked: u64,
    /// (chunk id, what is wrong)
    pub bad_chunks: Vec<(u64, String)>,
    /// volume name → damaged block numbers
    pub bad_blocks: BTreeMap<String, Vec<u64>>,
    /// Volumes whose block map is damaged (every block unreadable).
    pub bad_volumes: Vec<String>,
    pub metadata_problems: Vec<String>,
    /// Losses earlier repairs accepted (the pool's history, [`crate::format::damage::DAMAGE_PREFIX`]):
    /// those blocks fail to read until written (or read as zeros, as the repair was asked).
    /// Not damage now: a pool with only these is clean.
    pub accepted: Vec<crate::format::damage::DamageRecord>,
}

impl VerifyReport {
    pub fn is_clean(&self) -> bool {
        self.bad_chunks.is_empty()
            && self.bad_blocks.is_empty()
            && self.bad_volumes.is_empty()
            && self.metadata_problems.is_empty()
    }
}

/// What reading every live chunk found ([`Pool::check_chunks`](crate::Pool::check_chunks)).
#[derive(Clone, Debug, Default)]
pub struct ChunkCheck {
    pub chunks_checked: u64,
    pub bytes_checked: u64,
    /// (chunk id, what is wrong), in chunk id order.
    pub bad: Vec<(u64, String)>,
    /// Problems reading the chunk table itself.
    pub metadata_problems: Vec<String>,
    /// Bit `id` set: the chunk table holds chunk `id`.
    pub(crate) exists: Vec<u64>,
    /// Each chunk's stored reference count.
    pub(crate) stored_refs: Vec<u32>,
    pub(crate) next_id: u64,
}

/// One chunk-table slot in use, as `Pool::chunk_window` found it.
pub(crate) struct ChunkToCheck {
    pub id: u64,
    pub entry: crate::chunk_table::ChunkEntry,
    /// The segment file of its record (`None`: the segment is missing).
    pub file: Option<std::sync::Arc<dyn crate::io::File>>,
    /// The record's bytes, if still in memory (written since the last flush).
    pub in_memory: Option<Vec<u8>>,
}

/// What the chunk pass found, as the map walk checks entries against it.
pub(crate) struct Known<'a> {
    /// Bit `id` set: the chunk table held chunk `id`.
    pub(crate) exists: &'a [u64],
    pub(crate) next_id: u64,
    /// Chunks whose record failed its check.
    pub(crate) bad: &'a HashSet<u64>,
}

/// Walk every volume's block map (the caller holds the state lock): damaged maps and blocks
/// naming a bad or missing chunk go into `report`; returns the references counted per chunk.
pub(crate) fn walk_maps(
    md: &mut Metadata,
    vols: Vec<(u32, String, u64)>,
    known: &Known<'_>,
    report: &mut VerifyReport,
) -> Vec<u32> {
    let Known {
        exists,
        next_id,
        bad,
    } = *known;
    let mut counted: Vec<u32> = vec![0; next_id as usize];
    // A leaf shared by snapshots or clones holds one reference per chunk entry, however
    // many trees reach it: count each stored leaf once.
    let mut counted_leaves: HashSet<u64> = HashSet::new();
    for (vol, name, blocks) in vols {
        let mut bad_blocks = Vec::new();
        // Chunks the chunk-table pass did not see: written since (on a live pool), or
        // missing. Decided below, under the same lock as this walk.
        let mut unknown: Vec<(u64, u64)> = Vec::new();
        let leaves = blocks.div_ceil(MAP_PAGE_ENTRIES as u64);
        let walked =
            md.pages
                .for_each_leaf_page(u64::from(vol), 0, leaves, &mut |li, page, leaf| {
                    let first_visit = page == 0 || counted_leaves.insert(page);
                    crate::block_map::leaf_entries(leaf, |i, id| {
                        let b = li * MAP_PAGE_ENTRIES as u64 + i as u64;
                        let known =
                            id < next_id && exists[(id / 64) as usize] & (1 << (id % 64)) != 0;
                        if !known {
                            unknown.push((b, id));
                        } else if bad.contains(&id) {
                            bad_blocks.push(b);
                        }
                        if let Some(c) = counted.get_mut(id as usize).filter(|_| first_visit) {
                            *c = c.saturating_add(1);
                        }
                    });
                    Ok(true)
                });
        for (b, id) in unknown {
            if !matches!(md.chunks.get(&mut md.pages, id), Ok(Some(e)) if e.refs > 0) {
                bad_blocks.push(b);
            }
        }
        bad_blocks.sort_unstable();
        if let Err(e) = walked {
            report.bad_volumes.push(name.clone());
            report
                .metadata_problems
                .push(format!("block map of volume {name:?}: {e}"));
        }
        if !bad_blocks.is_empty() {
            report.bad_blocks.insert(name, bad_blocks);
        }
    }
    counted
}

/// Every metadata page shared by snapshots or clones must have as many parents as its count
/// says, and every counted page a parent.
pub(crate) fn check_shared_pages(md: &mut Metadata, report: &mut VerifyReport) {
    match md.pages.count_parents() {
        Ok(parents) => {
            let stored = md.pages.shared_pages();
            let mut wrong: Vec<String> = parents
                .iter()
                .filter(|(p, &n)| n != stored.get(p).copied().unwrap_or(1))
                .map(|(p, &n)| {
                    format!(
                        "page at unit {p} has {n} parents, its count says {}",
                        stored.get(p).copied().unwrap_or(1)
                    )
                })
                .collect();
            wrong.extend(
                stored
                    .keys()
                    .filter(|p| !parents.contains_key(p))
                    .map(|p| format!("page at unit {p} is counted as shared but nothing names it")),
            );
            if !wrong.is_empty() {
                wrong.sort();
                report.metadata_problems.push(format!(
                    "{} shared metadata pages have a wrong count (first: {})",
                    wrong.len(),
                    wrong[0]
                ));
            }
        }
        Err(e) => report
            .metadata_problems
            .push(format!("walking the block maps: {e}")),
    }
}

/// Each chunk's stored reference count must equal the map entries naming it (re-read under
/// the state lock where the chunk pass saw another count).
pub(crate) fn check_ref_counts(
    md: &mut Metadata,
    counted: &[u32],
    stored_refs: &[u32],
    exists: &[u64],
    report: &mut VerifyReport,
) {
    // Both are indexed by chunk id, up to the chunk pass's next id.
    debug_assert_eq!(counted.len(), stored_refs.len());
    let mut wrong = 0u64;
    let mut first = None;
    for (id, (&c, &s)) in counted.iter().zip(stored_refs.iter()).enumerate() {
        let known = exists[id / 64] & (1 << (id % 64)) != 0;
        if known && c != s {
            // The count read in the first pass may be older than the maps walked
            // now (a live pool): compare with the count as it is under this lock.
            let now = md
                .chunks
                .get(&mut md.pages, id as u64)
                .ok()
                .flatten()
                .map_or(0, |e| e.refs);
            if now != c {
                wrong += 1;
                first.get_or_insert((id, c, now));
            }
        }
    }
    if let Some((id, c, s)) = first {
        report.metadata_problems.push(format!(
            "{wrong} chunks have a wrong reference count (first: chunk {id} is named by {c} blocks, its count says {s})"
        ));
    }
}
