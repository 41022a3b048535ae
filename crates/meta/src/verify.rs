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
//! `Pool::verify` and `Pool::check_chunks` (condense-engine, the room `pool/verify.rs`),
//! under the pool's locks. Here, in the metadata crate, as they need only the metadata.
//!
//! The maps walked are every tree of the metadata but the chunk table
//! ([`trees_to_walk`]): each volume and snapshot by its name, up to its size, and the map of
//! a deleted volume still being released (a tree without a volume) up to its capacity, as
//! "a deleted volume being released (tree N)": its leaves hold chunk references until
//! released, so the counts compared include them.
//!
//! On a served pool the walk goes in bounded steps ([`MapWalk`]), the state lock let go
//! between them, so the other volumes' I/O goes on. Invariants:
//! - Whatever a step reports (a block naming a damaged or missing chunk, a damaged map
//!   page) was true under that step's lock.
//! - Reference counts are compared only when the walk saw one state of the maps: no
//!   metadata change was committed from its first step to the last step of the comparison
//!   (the pool's count of appended records unchanged). Else the walk is repeated a few
//!   times, and if the pool never held still the report says, in
//!   [`VerifyReport::not_checked`], that the counts were not compared, rather than report
//!   counts that moved as wrong. An exclusive open (`condense verify` on a pool nobody
//!   serves) changes nothing meanwhile: its check is always whole.
//! - The shared-page counts ([`check_shared_pages`]) are compared under one hold of the
//!   lock, whose work is the interior map pages (one per 256 leaves), not the leaves.

use crate::metadata::Metadata;
use condense_format::MAP_PAGE_ENTRIES;
use std::collections::{BTreeMap, HashMap, HashSet};

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
    /// Losses earlier repairs accepted (the pool's history, [`condense_format::damage::DAMAGE_PREFIX`]):
    /// those blocks fail to read until written (or read as zeros, as the repair was asked).
    /// Not damage now: a pool with only these is clean.
    pub accepted: Vec<condense_format::damage::DamageRecord>,
    /// Checks that could not be made, and why (a served pool that kept changing while its
    /// maps were walked): not damage, a clean pool may have them.
    pub not_checked: Vec<String>,
}

impl VerifyReport {
    pub fn is_clean(&self) -> bool {
        self.bad_chunks.is_empty()
            && self.bad_blocks.is_empty()
            && self.bad_volumes.is_empty()
            && self.metadata_problems.is_empty()
    }
}

/// What reading every live chunk found (`Pool::check_chunks`).
#[derive(Clone, Debug, Default)]
pub struct ChunkCheck {
    pub chunks_checked: u64,
    pub bytes_checked: u64,
    /// (chunk id, what is wrong), in chunk id order.
    pub bad: Vec<(u64, String)>,
    /// Problems reading the chunk table itself.
    pub metadata_problems: Vec<String>,
    /// Bit `id` set: the chunk table holds chunk `id`.
    pub exists: Vec<u64>,
    /// Each chunk's stored reference count.
    pub stored_refs: Vec<u32>,
    pub next_id: u64,
    /// The forwards the pass met: chunk id → the chunk it forwards to.
    pub forwards: HashMap<u64, u64>,
    /// The bases the delta chunks name, one per reference they hold.
    pub delta_bases: Vec<u64>,
}

/// One chunk-table slot in use, as `Pool::chunk_window` found it.
pub struct ChunkToCheck {
    pub id: u64,
    pub entry: crate::chunk_table::ChunkEntry,
    /// The segment file of its record (`None`: the segment is missing).
    pub file: Option<std::sync::Arc<dyn condense_store::io::File>>,
    /// The record's bytes, if still in memory (written since the last flush).
    pub in_memory: Option<Vec<u8>>,
}

/// What the chunk pass found, as the map walk checks entries against it.
pub struct Known<'a> {
    /// Bit `id` set: the chunk table held chunk `id`.
    pub exists: &'a [u64],
    pub next_id: u64,
    /// Chunks whose record failed its check (and forwards to them).
    pub bad: &'a HashSet<u64>,
    /// Forwards: an entry naming one counts for it and for the chunk it forwards to.
    pub forwards: &'a HashMap<u64, u64>,
    /// One base id per reference a delta chunk holds on it (docs/FORMAT.md "Delta records").
    pub delta_bases: &'a [u64],
}

/// A tree the map walk visits: a volume's or snapshot's block map, or the map of a deleted
/// volume still being released (its leaves keep their chunk references until released).
pub struct TreeToWalk {
    pub tree: u64,
    /// The volume's name, or `None` for a deleted volume's map being released.
    pub volume: Option<String>,
    /// The walk's upper bound in leaves: the volume's size, or the tree's capacity.
    pub leaves: u64,
}

impl TreeToWalk {
    fn label(&self) -> String {
        match &self.volume {
            Some(name) => format!("volume {name:?}"),
            None => format!("a deleted volume being released (tree {})", self.tree),
        }
    }
}

/// Every tree the maps hold but the chunk table: the volumes and snapshots by name, and the
/// maps of deleted volumes not yet released (in `md.pages.trees()` without a volume).
pub fn trees_to_walk(md: &Metadata) -> Vec<TreeToWalk> {
    let per = MAP_PAGE_ENTRIES as u64;
    md.pages
        .trees()
        .iter()
        .filter(|(&tree, _)| tree != crate::page_cache::CHUNK_TREE)
        .map(|(&tree, info)| {
            let vol = u32::try_from(tree).ok().and_then(|v| md.volumes.get(&v));
            match vol {
                Some(v) => TreeToWalk {
                    tree,
                    volume: Some(v.name.clone()),
                    leaves: (v.size / u64::from(md.block_size)).div_ceil(per),
                },
                None => TreeToWalk {
                    tree,
                    volume: None,
                    leaves: crate::page_cache::capacity(info.height),
                },
            }
        })
        .collect()
}

/// What a walk of the maps found: damaged maps and blocks naming a bad or missing chunk,
/// and the references counted per chunk.
#[derive(Default)]
pub struct MapFindings {
    pub bad_blocks: BTreeMap<String, Vec<u64>>,
    pub bad_volumes: Vec<String>,
    pub problems: Vec<String>,
    /// Per chunk id below the chunk pass's next id: the map entries naming it, each stored
    /// leaf counted once.
    pub counted: Vec<u32>,
}

/// A walk of every map in bounded steps ([`MapWalk::step`]), the state lock held only
/// during a step: each step visits at most [`LEAVES_PER_STEP`] leaves that exist.
///
/// What a step finds is true of the pool under that step's lock: an entry naming a bad
/// chunk, or a chunk neither the chunk pass saw nor the chunk table holds live now (looked
/// up under the same lock). The references counted are per stored leaf page, over every
/// step; they are a count at one instant only if no change was committed between the first
/// step and the last (the caller's rule, `pool/verify.rs`).
pub struct MapWalk {
    trees: std::collections::VecDeque<TreeToWalk>,
    next_leaf: u64,
    /// Stored leaves counted already: a leaf shared by snapshots or clones holds one
    /// reference per chunk entry, however many trees reach it.
    counted_leaves: HashSet<u64>,
    /// Blocks of the tree being walked that name a bad or missing chunk.
    bad_here: Vec<u64>,
    pub found: MapFindings,
}

/// Leaves visited per step of [`MapWalk`] at most (~1-2 ms with the leaves in memory; the
/// caller's pause after a step lets the busy VMs make their requests).
pub const LEAVES_PER_STEP: u64 = 128;

impl MapWalk {
    pub fn new(trees: Vec<TreeToWalk>, next_id: u64) -> MapWalk {
        MapWalk {
            trees: trees.into(),
            next_leaf: 0,
            counted_leaves: HashSet::new(),
            bad_here: Vec::new(),
            found: MapFindings {
                counted: vec![0; next_id as usize],
                ..MapFindings::default()
            },
        }
    }

    /// One step under the caller's hold of the state lock: the next leaves of the tree
    /// being walked. True once every tree is walked.
    pub fn step(&mut self, md: &mut Metadata, known: &Known<'_>) -> bool {
        let Some(t) = self.trees.front() else {
            return true;
        };
        let (tree, to, volume) = (t.tree, t.leaves, t.volume.is_some());
        let Known {
            exists,
            next_id,
            bad,
            forwards,
            ..
        } = *known;
        let per = MAP_PAGE_ENTRIES as u64;
        // Chunks the chunk pass did not see: written since (on a live pool), or missing.
        let mut unknown: Vec<(u64, u64)> = Vec::new();
        let (mut visited, mut last) = (0u64, None);
        let (counted, counted_leaves, bad_here) = (
            &mut self.found.counted,
            &mut self.counted_leaves,
            &mut self.bad_here,
        );
        let walked =
            md.pages
                .for_each_leaf_page(tree, self.next_leaf, to, &mut |li, page, leaf| {
                    let first_visit = page == 0 || counted_leaves.insert(page);
                    crate::block_map::leaf_entries(leaf, |i, id| {
                        let b = li * per + i as u64;
                        let seen =
                            id < next_id && exists[(id / 64) as usize] & (1 << (id % 64)) != 0;
                        if !seen {
                            unknown.push((b, id));
                        } else if volume && bad.contains(&id) {
                            // (A damaged chunk only a deleted volume names harms no reader.)
                            bad_here.push(b);
                        }
                        if !first_visit {
                            return;
                        }
                        let to = forwards.get(&id).copied();
                        for id in std::iter::once(id).chain(to) {
                            if let Some(c) = counted.get_mut(id as usize) {
                                *c = c.saturating_add(1);
                            }
                        }
                    });
                    visited += 1;
                    last = Some(li);
                    Ok(visited < LEAVES_PER_STEP)
                });
        for (b, id) in unknown {
            if !matches!(md.chunks.get(&mut md.pages, id), Ok(Some(e)) if e.refs > 0) {
                self.bad_here.push(b);
            }
        }
        match (walked, last) {
            (Err(e), _) => {
                self.fail_tree(&e.to_string());
                self.finish_tree();
            }
            (Ok(()), Some(li)) if visited == LEAVES_PER_STEP => self.next_leaf = li + 1,
            (Ok(()), _) => self.finish_tree(),
        }
        self.trees.is_empty()
    }

    /// The tree being walked has a damaged map page.
    fn fail_tree(&mut self, e: &str) {
        let Some(t) = self.trees.front() else { return };
        if let Some(name) = &t.volume {
            self.found.bad_volumes.push(name.clone());
        }
        self.found
            .problems
            .push(format!("block map of {}: {e}", t.label()));
    }

    /// The tree being walked is done: its bad blocks reported, the next tree's turn.
    fn finish_tree(&mut self) {
        self.next_leaf = 0;
        let Some(t) = self.trees.pop_front() else {
            return;
        };
        let mut bad = std::mem::take(&mut self.bad_here);
        if bad.is_empty() {
            return;
        }
        bad.sort_unstable();
        bad.dedup();
        match t.volume {
            Some(name) => {
                self.found.bad_blocks.insert(name, bad);
            }
            // Its reference is still counted: a chunk missing is a metadata problem.
            None => self.found.problems.push(format!(
                "{} has {} entries naming a missing chunk (first: block {})",
                t.label(),
                bad.len(),
                bad[0]
            )),
        }
    }
}

/// Every metadata page shared by snapshots or clones must have as many parents as its count
/// says, and every counted page a parent.
pub fn check_shared_pages(md: &mut Metadata, report: &mut VerifyReport) {
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

/// The chunks whose references counted by a map walk differ from the stored count the
/// chunk pass read (which may be older than the walk): the only ones whose count must be
/// read again. No lock needed.
pub fn ref_count_suspects(counted: &[u32], stored_refs: &[u32], exists: &[u64]) -> Vec<u64> {
    // Both are indexed by chunk id, up to the chunk pass's next id.
    debug_assert_eq!(counted.len(), stored_refs.len());
    counted
        .iter()
        .zip(stored_refs.iter())
        .enumerate()
        .filter(|&(id, (c, s))| c != s && exists[id / 64] & (1 << (id % 64)) != 0)
        .map(|(id, _)| id as u64)
        .collect()
}

/// Chunks whose stored reference count differs from the references counted: (chunk id,
/// counted, stored), reading the counts of `suspects` now (the caller holds the state lock).
pub fn wrong_ref_counts(
    md: &mut Metadata,
    suspects: &[u64],
    counted: &[u32],
) -> Vec<(u64, u32, u32)> {
    suspects
        .iter()
        .filter_map(|&id| {
            let c = counted.get(id as usize).copied().unwrap_or(0);
            let now = md
                .chunks
                .get(&mut md.pages, id)
                .ok()
                .flatten()
                .map_or(0, |e| e.refs);
            (now != c).then_some((id, c, now))
        })
        .collect()
}

/// Report chunks whose reference count is wrong (as [`wrong_ref_counts`] found them).
pub fn report_wrong_ref_counts(wrong: &[(u64, u32, u32)], report: &mut VerifyReport) {
    if let Some(&(id, c, s)) = wrong.first() {
        report.metadata_problems.push(format!(
            "{} chunks have a wrong reference count (first: chunk {id} is named by {c} blocks, its count says {s})",
            wrong.len()
        ));
    }
}
