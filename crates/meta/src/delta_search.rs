//! Which new chunks of a write become deltas (issue 44; docs/FORMAT.md "Delta records"): the
//! pure part of the write path's search, shared by the engine (`pool/delta.rs`) and the
//! replay `condense estimate --delta` runs ([`crate::delta_replay`]), so both decide alike.
//!
//! Owns: the search's constants (zstd level, tries per block, the in-write base marker) and
//! [`choose`]: for each miss of a write, in order, its candidate bases (the earlier misses of
//! the same write stored alone that share the most super-features with it, up to 2, then the
//! sketch index's candidates the caller looked up), compressed against each alone and the
//! first two together ([`reduction::best_delta`]), kept if it saves 1/8 of the block stored
//! alone. Invariants: a miss that is not kept as a delta becomes a base for the later misses
//! of its write (never one that is: depth 1); the caller supplies the index's candidates and
//! their blocks, so this module holds no state and touches no pool.
//!
//! Side by side (`spread`): the choice is sequential (a miss's in-write bases depend on what
//! the misses before it became), but a try's bytes depend only on the block and its bases.
//! So `guess_in_write` guesses each miss's in-write bases (a miss with no base at all is
//! stored alone), `ahead` makes the tries of the guessed bases and the index's candidates
//! for each fetched group of misses on rayon's threads, and the sequential pass looks them
//! up ([`reduction::DeltaMemo`]) and makes only the tries the guess missed. A write of
//! more than one group runs as a pipeline: a scoped thread fetches the next group's
//! candidate blocks and makes its tries while the calling thread chooses among the current
//! group's (one group ahead, so at most two groups' blocks are held). The same tries give
//! the same bytes, so what is chosen does not depend on `spread` (test
//! `choices_do_not_depend_on_spread`).

use condense_format::reduction::{self, DeltaMemo};
use condense_format::sketch::{self, FEATURES};
use rayon::prelude::*;
use std::collections::HashMap;

/// zstd level of delta records.
pub const LEVEL: i32 = 3;
/// Most candidate bases a block is compressed against (each alone, the first two together).
pub const MAX_TRIES: usize = 4;
/// Misses whose candidates' blocks are fetched together (at most 4 × 4 KiB each: 4 MiB), so
/// that the engine reads them with one hold of its lock, whatever the write's size.
pub const FETCH_MISSES: usize = 256;

/// A base id naming block `j` of the same write (`IN_WRITE | j`), resolved to its chunk id
/// when the write is staged (chunk ids are below 2^48).
pub const IN_WRITE: u64 = 1 << 63;

/// A new chunk found to be a delta: its bases (some maybe [`IN_WRITE`]) and its payload with
/// those ids, unsealed (staging names the real ids, then seals it).
pub struct Delta {
    pub bases: Vec<u64>,
    pub payload: Vec<u8>,
}

/// What the search found for a write, by block index: deltas, and the super-features of the
/// other new chunks (indexed once they have an id).
#[derive(Default)]
pub struct Deltas {
    pub delta: HashMap<usize, Delta>,
    pub keys: Keys,
}

/// Blocks by chunk id.
pub type Blocks = HashMap<u64, Vec<u8>>;
/// Super-features by block index of a write.
pub type Keys = HashMap<usize, [u64; FEATURES]>;
/// The sketch index's candidate bases by block index of a write, best first.
pub type Candidates = HashMap<usize, Vec<u64>>;

/// The super-features of the misses of a write (`bs`-byte blocks of `data`) that have any;
/// on rayon's threads if `spread`.
pub fn miss_keys(data: &[u8], bs: usize, misses: &[usize], spread: bool) -> Keys {
    let key = |&i: &usize| Some((i, sketch::super_features(&data[i * bs..(i + 1) * bs])?));
    if spread {
        misses.par_iter().filter_map(key).collect()
    } else {
        misses.iter().filter_map(key).collect()
    }
}

/// The tries of `misses` made on rayon's threads, by miss: [`reduction::delta_tries`] of its
/// guessed bases in the write (`in_write`, from [`guess_in_write`]) then its index
/// candidates with a fetched block, the first [`MAX_TRIES`]: the tries [`Search::group`]
/// makes when the guess is right. A try it needs and does not find here, it makes itself.
fn ahead(
    data: &[u8],
    bs: usize,
    misses: &[usize],
    (global, in_write): (&Candidates, &HashMap<usize, Vec<usize>>),
    blocks: &Blocks,
) -> HashMap<usize, DeltaMemo> {
    misses
        .par_iter()
        .filter_map(|&i| {
            let local = in_write.get(&i).map_or(&[][..], |l| &l[..]);
            let ids = global.get(&i).map_or(&[][..], |g| &g[..]);
            let bases = bases_of(data, bs, local, ids, blocks);
            if bases.is_empty() {
                return None;
            }
            let block = &data[i * bs..(i + 1) * bs];
            let memo: DeltaMemo = reduction::delta_tries(&bases)
                .into_iter()
                .filter_map(|(ids, d)| {
                    Some((ids, reduction::compress_delta(block, &d.concat(), LEVEL)?))
                })
                .collect();
            Some((i, memo))
        })
        .collect()
}

/// A miss's bases, in the order they are tried: `local` (blocks of the write, by index),
/// then the index candidates `ids` with a block in `blocks`, the first [`MAX_TRIES`].
fn bases_of<'a>(
    data: &'a [u8],
    bs: usize,
    local: &[usize],
    ids: &[u64],
    blocks: &'a Blocks,
) -> Vec<(u64, &'a [u8])> {
    let mut bases: Vec<(u64, &[u8])> = local
        .iter()
        .map(|&j| (IN_WRITE | j as u64, &data[j * bs..(j + 1) * bs]))
        .collect();
    bases.extend(ids.iter().filter_map(|c| Some((*c, &blocks.get(c)?[..]))));
    bases.truncate(MAX_TRIES);
    bases
}

/// The earlier misses of the write in `local` (super-feature → the latest that had it) that
/// share the most super-features with a miss of super-features `keys`, up to 2, most first
/// (the later miss first on a tie).
fn ranked(keys: &[u64; FEATURES], local: &HashMap<u64, usize>) -> Vec<usize> {
    let mut shared: Vec<(usize, usize)> = Vec::new();
    for k in keys {
        if let Some(&j) = local.get(k) {
            match shared.iter_mut().find(|(x, _)| *x == j) {
                Some((_, n)) => *n += 1,
                None => shared.push((j, 1)),
            }
        }
    }
    shared.sort_unstable_by_key(|&(j, n)| std::cmp::Reverse((n, j)));
    shared.iter().take(2).map(|&(j, _)| j).collect()
}

/// For each miss of `group`, in order, a guess of its bases in the write: [`ranked`] over
/// the earlier misses guessed to be stored alone (`alone`, updated here). A miss is guessed
/// to be stored alone if it has no base at all: neither a guessed one in the write nor an
/// index candidate with a fetched block that may be a base (one with a base usually
/// becomes a delta). A wrong guess costs tries, never choices.
fn guess_in_write(
    group: &[usize],
    (keys, global): (&Keys, &Candidates),
    blocks: &Blocks,
    alone: &mut HashMap<u64, usize>,
) -> HashMap<usize, Vec<usize>> {
    let mut guess = HashMap::new();
    for &i in group {
        let Some(k) = keys.get(&i) else {
            continue;
        };
        let local = ranked(k, alone);
        let indexed = global.get(&i).is_some_and(|ids| {
            ids.iter()
                .any(|c| blocks.get(c).is_some_and(|b| reduction::may_be_base(b)))
        });
        if local.is_empty() && !indexed {
            alone.extend(k.iter().map(|&f| (f, i)));
        }
        guess.insert(i, local);
    }
    guess
}

/// A fetch group's candidate blocks, and the tries made ahead for its misses (with `spread`).
type Prepared = (Blocks, HashMap<usize, DeltaMemo>);

/// The deltas among the misses of a write, in order (see the module docs). `keys` are
/// [`miss_keys`]; `global` the sketch index's candidates of each miss (chunks that may be
/// bases), best first; `fetch(ids)` the blocks of such candidates (one left out is not
/// usable), asked for [`FETCH_MISSES`] misses' candidates at a time; `alone(i)` the payload
/// length of block `i` stored alone; `spread`: make the tries that allow it side by side
/// (same result), and fetch and try the next group's on another thread while this one
/// chooses among the current group's.
pub fn choose(
    data: &[u8],
    bs: usize,
    misses: &[usize],
    (keys, global): (&Keys, &Candidates),
    fetch: &mut (dyn FnMut(&[u64]) -> Blocks + Send),
    alone: &dyn Fn(usize) -> usize,
    spread: bool,
) -> HashMap<usize, Delta> {
    // Super-feature → the latest miss guessed to be stored alone ([`guess_in_write`]).
    let mut guessed = HashMap::new();
    let mut prepare = |group: &[usize]| -> Prepared {
        let ids: Vec<u64> = group
            .iter()
            .filter_map(|i| global.get(i))
            .flatten()
            .copied()
            .collect();
        let blocks = if ids.is_empty() {
            Blocks::new()
        } else {
            fetch(&ids)
        };
        let made = match spread {
            true => {
                let in_write = guess_in_write(group, (keys, global), &blocks, &mut guessed);
                ahead(data, bs, group, (global, &in_write), &blocks)
            }
            false => HashMap::new(),
        };
        (blocks, made)
    };
    let mut search = Search {
        data,
        bs,
        keys,
        global,
        alone,
        found: HashMap::new(),
        local: HashMap::new(),
    };
    if spread && misses.len() > FETCH_MISSES {
        // One group ahead: the next group's blocks are fetched and its tries made while
        // this thread chooses the current group's deltas (a rendezvous channel).
        std::thread::scope(|s| {
            let (tx, rx) = std::sync::mpsc::sync_channel::<Prepared>(0);
            s.spawn(move || {
                for group in misses.chunks(FETCH_MISSES) {
                    if tx.send(prepare(group)).is_err() {
                        break;
                    }
                }
            });
            for (group, prepared) in misses.chunks(FETCH_MISSES).zip(rx) {
                search.group(group, &prepared);
            }
        });
    } else {
        for group in misses.chunks(FETCH_MISSES) {
            let prepared = prepare(group);
            search.group(group, &prepared);
        }
    }
    search.found
}

/// The sequential part of [`choose`]: what it has found so far, and which earlier misses of
/// the write were stored alone.
struct Search<'a> {
    data: &'a [u8],
    bs: usize,
    keys: &'a Keys,
    global: &'a Candidates,
    alone: &'a dyn Fn(usize) -> usize,
    found: HashMap<usize, Delta>,
    /// Super-feature → the latest earlier miss of this write stored alone that had it.
    local: HashMap<u64, usize>,
}

impl Search<'_> {
    /// Each miss of `group`, in order: compressed against its bases (the earlier misses of
    /// the write stored alone that share the most super-features with it, up to 2, then
    /// its fetched index candidates), kept as a delta if that saves 1/8 of it stored alone.
    fn group(&mut self, group: &[usize], (blocks, made): &Prepared) {
        let (data, bs) = (self.data, self.bs);
        let none = DeltaMemo::new();
        for &i in group {
            let Some(keys) = self.keys.get(&i) else {
                continue;
            };
            let ids = self.global.get(&i).map_or(&[][..], |g| &g[..]);
            let bases = bases_of(data, bs, &ranked(keys, &self.local), ids, blocks);
            let block = &data[i * bs..(i + 1) * bs];
            let alone = (self.alone)(i);
            let memo = made.get(&i).unwrap_or(&none);
            match reduction::best_delta(block, &bases, LEVEL, alone - alone / 8, memo) {
                Some((bases, payload)) => {
                    self.found.insert(i, Delta { bases, payload });
                }
                None => self.local.extend(keys.iter().map(|&k| (k, i))),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(rng: &mut condense_store::sim::SimRng, n: usize) -> Vec<u8> {
        (0..n).map(|_| rng.next_u64() as u8).collect()
    }

    /// A write of 600 misses (three fetch groups): near copies of stored blocks (the index's
    /// candidates), of earlier blocks of the write, of both, and noise. Choosing with the
    /// tries made ahead on rayon's threads gives exactly what the sequential search gives.
    #[test]
    fn choices_do_not_depend_on_spread() {
        const BS: usize = 4096;
        let mut rng = condense_store::sim::SimRng::new(44);
        let stored: Blocks = (0..40u64).map(|id| (id, noise(&mut rng, BS))).collect();
        let mut data = Vec::with_capacity(600 * BS);
        let mut global = Candidates::new();
        for i in 0..600usize {
            let mut block = match i % 4 {
                0 | 1 => stored[&(i as u64 % 40)].clone(),
                2 if i >= 8 => data[(i - 7) * BS..(i - 6) * BS].to_vec(),
                _ => noise(&mut rng, BS),
            };
            for _ in 0..1 + i % 5 {
                let at = (rng.next_u64() % (BS as u64 - 16)) as usize;
                block[at..at + 16].copy_from_slice(&noise(&mut rng, 16));
            }
            if i % 4 != 3 {
                let c = (0..1 + i % 4).map(|k| (i + k * 7) as u64 % 40).collect();
                global.insert(i, c);
            }
            data.extend_from_slice(&block);
        }
        let misses: Vec<usize> = (0..600).collect();
        let run = |spread: bool| {
            let keys = miss_keys(&data, BS, &misses, spread);
            let mut fetch = |ids: &[u64]| -> Blocks {
                ids.iter()
                    .filter_map(|c| Some((*c, stored.get(c)?.clone())))
                    .collect()
            };
            let found = (&keys, &global);
            let alone = |_: usize| BS;
            let mut out: Vec<(usize, Vec<u64>, Vec<u8>)> =
                choose(&data, BS, &misses, found, &mut fetch, &alone, spread)
                    .into_iter()
                    .map(|(i, d)| (i, d.bases, d.payload))
                    .collect();
            out.sort();
            out
        };
        let sequential = run(false);
        let in_write = sequential
            .iter()
            .filter(|(_, b, _)| b.iter().any(|&b| b & IN_WRITE != 0))
            .count();
        assert!(sequential.len() > 300, "deltas: {}", sequential.len());
        assert!(
            in_write > 50,
            "deltas naming blocks of the write: {in_write}"
        );
        assert_eq!(run(true), sequential);
    }
}
