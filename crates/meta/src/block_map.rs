//! A volume's block map: block number → chunk id, or ZERO / UNMAPPED / LOST.
//!
//! Owns: the authoritative content of each block of one volume (with the chunk table), and
//! the volume's block counters.
//! Stored as a paged copy-on-write tree ([`crate::page_cache`]) whose leaves hold 512 entries
//! of 8 bytes: 0 UNMAPPED, 1 ZERO, `id + 2` a chunk, `u64::MAX` LOST (a block repair gave
//! up: reads fail until it is written). A never-written leaf is a null pointer,
//! so a thin volume costs metadata only where it was written. Counters (`data_blocks`,
//! `zero_blocks`) are kept with every change, so statistics never walk a map.

use crate::page_cache::{PageCache, TreeId};
use condense_format::error::Result;
pub use condense_format::map_entry::{decode, encode};
use condense_format::map_entry::{raw_chunk, slot, write_slot};
use condense_format::{ENTRY_LOST, ENTRY_UNMAPPED, ENTRY_ZERO, MAP_PAGE_ENTRIES};

const PER: u64 = MAP_PAGE_ENTRIES as u64;

/// Counters of one volume's map.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MapCounts {
    /// Blocks holding a chunk.
    pub data_blocks: u64,
    /// Blocks written as zeros.
    pub zero_blocks: u64,
}

impl MapCounts {
    fn count(&mut self, entry: u64, add: bool) {
        let c = match entry {
            // A lost block holds nothing: counted neither as data nor as zeros.
            ENTRY_UNMAPPED | ENTRY_LOST => return,
            ENTRY_ZERO => &mut self.zero_blocks,
            _ => &mut self.data_blocks,
        };
        if add {
            *c += 1
        } else {
            *c -= 1
        }
    }
}

/// Leaves a map of `blocks` blocks needs.
pub fn leaves_for(blocks: u64) -> u64 {
    blocks.div_ceil(PER).max(1)
}

/// The entry of `block`.
pub fn get(cache: &mut PageCache, tree: TreeId, block: u64) -> Result<u64> {
    Ok(cache
        .leaf(tree, block / PER)?
        .map_or(ENTRY_UNMAPPED, |leaf| {
            decode(slot(leaf, (block % PER) as usize))
        }))
}

/// The entries of `count` blocks from `first`, appended to `out`.
pub fn get_range(
    cache: &mut PageCache,
    tree: TreeId,
    first: u64,
    count: u64,
    out: &mut Vec<u64>,
) -> Result<()> {
    let mut b = first;
    let end = first + count;
    while b < end {
        let leaf_end = (b / PER + 1) * PER;
        let stop = leaf_end.min(end);
        match cache.leaf(tree, b / PER)? {
            Some(leaf) => {
                for x in b..stop {
                    out.push(decode(slot(leaf, (x % PER) as usize)));
                }
            }
            None => out.extend(std::iter::repeat_n(ENTRY_UNMAPPED, (stop - b) as usize)),
        }
        b = stop;
    }
    Ok(())
}

/// Set one entry; returns the old one.
pub fn set(
    cache: &mut PageCache,
    tree: TreeId,
    counts: &mut MapCounts,
    block: u64,
    entry: u64,
) -> Result<u64> {
    let i = (block % PER) as usize;
    if entry == ENTRY_UNMAPPED {
        // Unmapping never creates a leaf.
        match cache.leaf(tree, block / PER)? {
            None => return Ok(ENTRY_UNMAPPED),
            Some(leaf) if slot(leaf, i) == 0 => return Ok(ENTRY_UNMAPPED),
            Some(_) => {}
        }
    }
    let leaf = cache.leaf_mut(tree, block / PER)?;
    let old = decode(slot(leaf, i));
    write_slot(leaf, i, entry);
    counts.count(old, false);
    counts.count(entry, true);
    Ok(old)
}

/// Every mapped entry (not UNMAPPED) in blocks `[from, to)`: (block, entry).
pub fn mapped(cache: &mut PageCache, tree: TreeId, from: u64, to: u64) -> Result<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    if from >= to {
        return Ok(out);
    }
    cache.for_each_leaf(tree, from / PER, (to - 1) / PER + 1, &mut |li, leaf| {
        // Only the part of the leaf inside [from, to).
        let lo = from.max(li * PER);
        let hi = to.min((li + 1) * PER);
        for b in lo..hi {
            let i = (b % PER) as usize;
            let raw = slot(leaf, i);
            if raw != 0 {
                out.push((b, decode(raw)));
            }
        }
        Ok(true)
    })?;
    Ok(out)
}

/// The first mapped block at or after `from`, if any.
pub fn first_mapped(cache: &mut PageCache, tree: TreeId, from: u64) -> Result<Option<u64>> {
    let mut found = None;
    cache.for_each_leaf(tree, from / PER, u64::MAX, &mut |li, leaf| {
        for b in from.max(li * PER)..(li + 1) * PER {
            if slot(leaf, (b % PER) as usize) != 0 {
                found = Some(b);
                return Ok(false);
            }
        }
        Ok(true)
    })?;
    Ok(found)
}

/// Visit every chunk id the map names, leaf by leaf (for dropping references on delete).
pub fn leaf_chunks(leaf: &[u8], mut f: impl FnMut(u64)) {
    for i in 0..MAP_PAGE_ENTRIES {
        if let Some(id) = raw_chunk(slot(leaf, i)) {
            f(id);
        }
    }
}

/// Visit every entry of a leaf that names a chunk: (index in the leaf, chunk id).
pub fn leaf_entries(leaf: &[u8], mut f: impl FnMut(usize, u64)) {
    for i in 0..MAP_PAGE_ENTRIES {
        if let Some(id) = raw_chunk(slot(leaf, i)) {
            f(i, id);
        }
    }
}

/// Decode every entry of a leaf into `out` (512 entries: chunk id, ZERO, UNMAPPED or LOST).
pub fn leaf_entries_all(leaf: &[u8], out: &mut [u64]) {
    for (i, e) in out.iter_mut().enumerate().take(MAP_PAGE_ENTRIES) {
        *e = decode(slot(leaf, i));
    }
}
