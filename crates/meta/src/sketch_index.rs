//! The sketch index (issue 44, delta compression): super-feature → the most recent chunk
//! that had it and may be a base.
//!
//! Owns: a fixed-size table allocated once (its RAM budget), one slot per super-feature's
//! hash, holding the full super-feature and a chunk id; a newer chunk overwrites the slot, so
//! the table is a window over the most recent chunks and its RAM never grows. Kept in memory
//! only: rebuilt from nothing at open (a miss costs a delta, never correctness: a delta's
//! bases are checked when it is made). Invariants: only chunks that may be bases (records
//! that are not deltas) are inserted; an id found may since have died or become a forward,
//! so callers resolve and check it. Counters: lookups, lookups that found a candidate, and
//! deltas made (counted by the write path).

use condense_format::sketch::FEATURES;

/// Bytes per slot: the super-feature (8) and the chunk id (8).
pub const SLOT_BYTES: u64 = 16;
/// The default RAM budget: 64 MiB, 4 Mi slots (about 350 000 chunks' 12 super-features).
pub const DEFAULT_BUDGET: u64 = 64 << 20;

/// Most candidates a lookup returns.
pub const MAX_CANDIDATES: usize = 4;

/// Slots of a table of `budget` bytes: the largest power of two within it, at least 1024.
pub fn slots_for(budget: u64) -> u64 {
    let want = (budget / SLOT_BYTES).max(1024);
    if want.is_power_of_two() {
        want
    } else {
        want.next_power_of_two() / 2
    }
}

/// The table and its counters.
pub struct SketchIndex {
    /// `[super-feature, chunk id + 1]`; all zeros is an empty slot, so a new table is
    /// zeroed memory the kernel hands out as it is first touched (a pool opened with deltas
    /// on does not pay for its whole budget's pages up front).
    slots: Vec<[u64; 2]>,
    mask: u64,
    pub lookups: u64,
    pub hits: u64,
    pub deltas: u64,
    pub delta_saved_bytes: u64,
}

impl SketchIndex {
    /// A table of the largest power-of-two slot count within `budget` bytes (at least 1024).
    pub fn new(budget: u64) -> SketchIndex {
        let n = slots_for(budget);
        SketchIndex {
            slots: vec![[0, 0]; n as usize],
            mask: n - 1,
            lookups: 0,
            hits: 0,
            deltas: 0,
            delta_saved_bytes: 0,
        }
    }

    /// Bytes the table takes.
    pub fn ram_bytes(&self) -> u64 {
        self.slots.len() as u64 * SLOT_BYTES
    }

    fn slot(&self, key: u64) -> usize {
        // Super-features are hashes already; the low bits pick the slot.
        (key & self.mask) as usize
    }

    /// The candidate bases of a block with super-features `keys`, best first: most
    /// super-features shared, then most recent (highest id). At most [`MAX_CANDIDATES`].
    pub fn candidates(&mut self, keys: &[u64; FEATURES]) -> Vec<u64> {
        self.lookups += 1;
        let mut found: Vec<(u64, u32)> = Vec::new();
        for &k in keys {
            let [key, id_plus_1] = self.slots[self.slot(k)];
            if key != k || id_plus_1 == 0 {
                continue;
            }
            let id = id_plus_1 - 1;
            match found.iter_mut().find(|(c, _)| *c == id) {
                Some((_, n)) => *n += 1,
                None => found.push((id, 1)),
            }
        }
        if !found.is_empty() {
            self.hits += 1;
        }
        found.sort_unstable_by_key(|&(id, n)| std::cmp::Reverse((n, id)));
        found.truncate(MAX_CANDIDATES);
        found.into_iter().map(|(id, _)| id).collect()
    }

    /// Chunk `id` (not a delta) has super-features `keys`: it is their most recent chunk.
    pub fn insert(&mut self, keys: &[u64; FEATURES], id: u64) {
        // u64::MAX is no chunk's id, and a slot could not name it.
        let Some(id_plus_1) = id.checked_add(1) else {
            return;
        };
        for &k in keys {
            let s = self.slot(k);
            self.slots[s] = [k, id_plus_1];
        }
    }
}

/// The delta compression figures of `stats` (docs/STATS.md "delta_mode" and after).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeltaFigures {
    /// Delta compression is on for new writes.
    pub mode: bool,
    /// Delta records written over the pool's life.
    pub chunks_written: u64,
    /// Since open: delta records written, and the payload bytes they saved.
    pub chunks_since_open: u64,
    pub saved_bytes_since_open: u64,
    /// Since open: sketch index lookups, and those that found a candidate.
    pub sketch_lookups: u64,
    pub sketch_hits: u64,
    /// The sketch index's RAM (what it will take before the first write), the most recent
    /// chunks it covers, and its RAM per unique chunk of the pool.
    pub sketch_index_bytes: u64,
    pub sketch_index_chunks: u64,
    pub sketch_index_bytes_per_chunk: f64,
}

impl DeltaFigures {
    /// The figures of a pool whose mode is `mode`, with `written` deltas over its life,
    /// `unique_chunks` live chunks and `index` (if made since open).
    pub fn of(
        index: Option<&SketchIndex>,
        mode: bool,
        written: u64,
        unique_chunks: u64,
    ) -> DeltaFigures {
        let ram = match index {
            Some(x) => x.ram_bytes(),
            None if mode => slots_for(DEFAULT_BUDGET) * SLOT_BYTES,
            None => 0,
        };
        let x = |f: fn(&SketchIndex) -> u64| index.map_or(0, f);
        DeltaFigures {
            mode,
            chunks_written: written,
            chunks_since_open: x(|i| i.deltas),
            saved_bytes_since_open: x(|i| i.delta_saved_bytes),
            sketch_lookups: x(|i| i.lookups),
            sketch_hits: x(|i| i.hits),
            sketch_index_bytes: ram,
            sketch_index_chunks: ram / SLOT_BYTES / FEATURES as u64,
            sketch_index_bytes_per_chunk: match unique_chunks {
                0 => 0.0,
                n => ram as f64 / n as f64,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_rank_by_shared_then_recency_and_the_table_stays_its_size() {
        let mut ix = SketchIndex::new(0);
        assert_eq!(ix.ram_bytes(), 1024 * SLOT_BYTES);
        let a: [u64; FEATURES] = std::array::from_fn(|i| 100 + i as u64);
        let mut b = a;
        b[..4].copy_from_slice(&[900, 901, 902, 903]);
        ix.insert(&a, 1);
        ix.insert(&b, 2);
        // 8 shared with 2, 4 with 1 (the others overwritten by 2).
        assert_eq!(ix.candidates(&a), vec![2, 1]);
        let none: [u64; FEATURES] = std::array::from_fn(|i| 5000 + i as u64);
        assert!(ix.candidates(&none).is_empty());
        assert_eq!((ix.lookups, ix.hits), (2, 1));
        for id in 0..100_000u64 {
            let k: [u64; FEATURES] = std::array::from_fn(|i| id * 13 + i as u64 + 7);
            ix.insert(&k, id);
        }
        assert_eq!(ix.ram_bytes(), 1024 * SLOT_BYTES, "a window: never grows");
    }
}
