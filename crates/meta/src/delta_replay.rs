//! What delta compression stores, without a pool: writes replayed through a
//! [`SketchIndex`] and the write path's own search ([`crate::delta_search`]). `condense
//! estimate --delta` runs the images' blocks through it (docs/ESTIMATE.md "Delta
//! compression").
//!
//! Owns: the sketch index of the modelled pool (the default budget, as a pool's), the next
//! chunk id, and the bytes and deltas stored so far.
//!
//! Invariants, so that the replay stores what an import into a delta pool stores:
//! - The caller gives each write's misses as the pool's dense index finds them (the first
//!   block of each fingerprint the pool lacks, in order) and each miss's payload stored alone
//!   as the write path compresses it (`reduction::compressor_run`'s runs, each its own
//!   `Compressor`). The replay hands out ids in miss order from 0, as the pool's chunk table
//!   does.
//! - A write goes as the write path takes one (engine `pool/write.rs` and `pool/delta.rs`, one
//!   writer): the misses' candidates are looked up in the index before any of them is stored,
//!   [`delta_search::choose`] picks the deltas, then the misses are stored in order, each
//!   one not a delta joining the index under its id.
//! - [`DeltaReplay::reopen`] is an open by a new process (each `condense import`): the index
//!   starts empty, as a pool's does.
//! - Where the model differs: in a pool a candidate or base is checked to be alive, not a
//!   delta and below the reference limit when the delta is staged; during imports into a
//!   fresh pool every chunk the index names is, so the replay keeps every delta it finds.
//!   Payloads are counted unsealed (an encrypted pool adds 40 bytes to each).

use crate::delta_search::{self, Delta};
use crate::sketch_index::{SketchIndex, DEFAULT_BUDGET};
use condense_format::reduction::Compressor;
use condense_format::Compression;

/// The payload bytes of the blocks at `run` (one run of a write's misses, in order:
/// `reduction::compressor_run` says how the write path splits them) stored alone with
/// `compression`, as the write path's `Compressor` stores them (the block itself where
/// compression saves less than 1/8, or where it skipped the block in a run of noise).
pub fn alone_sizes(data: &[u8], bs: usize, run: &[usize], compression: Compression) -> Vec<usize> {
    let mut z = Compressor::default();
    run.iter()
        .map(|&i| {
            z.try_compress(compression, &data[i * bs..(i + 1) * bs])
                .map_or(bs, |(_, c)| c.len())
        })
        .collect()
}

/// What a write stored for one miss.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stored {
    /// The block's position in the write.
    pub block: usize,
    /// Its chunk id.
    pub id: u64,
    /// Its payload bytes (a delta's, or the block's stored alone).
    pub bytes: u64,
    /// Stored as a delta.
    pub delta: bool,
}

/// The bytes stored so far, with deltas and as they would be without.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeltaTotals {
    /// Chunks stored (every miss).
    pub chunks: u64,
    /// Payload bytes stored.
    pub stored_bytes: u64,
    /// Payload bytes every chunk would take stored alone (a pool without deltas).
    pub alone_bytes: u64,
    /// Chunks stored as deltas, and the bytes they saved against being stored alone.
    pub deltas: u64,
    pub saved_bytes: u64,
    /// Sketch index lookups and those that found a candidate, over every import.
    pub lookups: u64,
    pub hits: u64,
}

/// Writes replayed through the sketch index.
pub struct DeltaReplay {
    budget: u64,
    index: SketchIndex,
    next_id: u64,
    totals: DeltaTotals,
}

impl Default for DeltaReplay {
    fn default() -> DeltaReplay {
        DeltaReplay::new(DEFAULT_BUDGET)
    }
}

impl DeltaReplay {
    /// An empty pool whose sketch index has `budget` bytes (a pool's: [`DEFAULT_BUDGET`]).
    pub fn new(budget: u64) -> DeltaReplay {
        DeltaReplay {
            budget,
            index: SketchIndex::new(budget),
            next_id: 0,
            totals: DeltaTotals::default(),
        }
    }

    /// The pool opened again by a new process: the sketch index starts empty.
    pub fn reopen(&mut self) {
        self.totals.lookups += self.index.lookups;
        self.totals.hits += self.index.hits;
        self.index = SketchIndex::new(self.budget);
    }

    /// One write of `bs`-byte blocks `data` whose new chunks are the blocks at `misses`
    /// (ascending), each `alone(i)` bytes stored alone; `base(id)` is the block of chunk
    /// `id`, stored earlier in this import (`None`: unreadable, not used). What each miss
    /// became, in order.
    pub fn write(
        &mut self,
        data: &[u8],
        bs: usize,
        misses: &[usize],
        alone: &dyn Fn(usize) -> usize,
        base: &mut (dyn FnMut(u64) -> Option<Vec<u8>> + Send),
    ) -> Vec<Stored> {
        if misses.is_empty() {
            return Vec::new();
        }
        let keys = delta_search::miss_keys(data, bs, misses, true);
        let global = misses
            .iter()
            .filter_map(|i| {
                let found = self.index.candidates(keys.get(i)?);
                (!found.is_empty()).then_some((*i, found))
            })
            .collect();
        let mut fetch = |ids: &[u64]| ids.iter().filter_map(|&c| Some((c, base(c)?))).collect();
        let found = (&keys, &global);
        let deltas = delta_search::choose(data, bs, misses, found, &mut fetch, alone, true);
        let mut out = Vec::with_capacity(misses.len());
        for &i in misses {
            let id = self.next_id;
            self.next_id += 1;
            let a = alone(i) as u64;
            self.totals.chunks += 1;
            self.totals.alone_bytes += a;
            let (bytes, delta) = match deltas.get(&i) {
                Some(Delta { payload, .. }) => {
                    let p = payload.len() as u64;
                    self.totals.deltas += 1;
                    self.totals.saved_bytes += a.saturating_sub(p);
                    (p, true)
                }
                None => {
                    if let Some(k) = keys.get(&i) {
                        self.index.insert(k, id);
                    }
                    (a, false)
                }
            };
            self.totals.stored_bytes += bytes;
            out.push(Stored {
                block: i,
                id,
                bytes,
                delta,
            });
        }
        out
    }

    /// The totals so far (lookups and hits over every import, this one's included).
    pub fn totals(&self) -> DeltaTotals {
        DeltaTotals {
            lookups: self.totals.lookups + self.index.lookups,
            hits: self.totals.hits + self.index.hits,
            ..self.totals
        }
    }

    /// Bytes of RAM the sketch index takes (a pool's `sketch_index_bytes`).
    pub fn ram_bytes(&self) -> u64 {
        self.index.ram_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(seed: u64, n: usize) -> Vec<u8> {
        let mut rng = condense_store::sim::SimRng::new(seed);
        (0..n).map(|_| rng.next_u64() as u8).collect()
    }

    #[test]
    fn near_copies_become_deltas_within_a_write_and_across_writes_until_a_reopen() {
        const BS: usize = 4096;
        let a = noise(1, BS);
        let mut b = a.clone();
        b[100..120].copy_from_slice(&noise(2, 20));
        let c = noise(3, BS);
        let mut r = DeltaReplay::new(0);
        let blocks: Vec<Vec<u8>> = vec![a.clone(), b.clone(), c.clone()];
        let mut store: Vec<Vec<u8>> = Vec::new();
        let write = |r: &mut DeltaReplay, w: &[Vec<u8>], store: &mut Vec<Vec<u8>>| {
            let data = w.concat();
            let misses: Vec<usize> = (0..w.len()).collect();
            let known = store.clone();
            let out = r.write(&data, BS, &misses, &|_| BS, &mut |id| {
                known.get(id as usize).cloned()
            });
            store.extend(w.iter().cloned());
            out
        };
        let first = write(&mut r, &blocks, &mut store);
        assert_eq!(
            first.iter().map(|s| s.delta).collect::<Vec<_>>(),
            vec![false, true, false],
            "b is a near copy of a in the same write"
        );
        assert!(first[1].bytes < 200, "{}", first[1].bytes);
        // A near copy of c in a later write finds c in the index.
        let mut d = c.clone();
        d[3000..3010].copy_from_slice(&noise(4, 10));
        let second = write(&mut r, std::slice::from_ref(&d), &mut store);
        assert!(second[0].delta && second[0].id == 3);
        // After a reopen the index is empty: a near copy of a is stored alone.
        r.reopen();
        let mut e = a.clone();
        e[0] ^= 1;
        let third = write(&mut r, std::slice::from_ref(&e), &mut store);
        assert!(!third[0].delta);
        let t = r.totals();
        assert_eq!((t.chunks, t.deltas), (5, 2));
        assert_eq!(t.alone_bytes, 5 * BS as u64);
        assert_eq!(t.stored_bytes + t.saved_bytes, t.alone_bytes);
        assert_eq!((t.lookups, t.hits), (5, 1), "{t:?}");
    }
}
