//! Delta compression (issue 44; docs/FORMAT.md "Delta records"): the engine's glue between
//! the write and read paths and the pure parts (`format::sketch`, `reduction::DeltaPayload`,
//! `meta::sketch_index`, and `meta::delta_search`, the choice of deltas, which `condense
//! estimate --delta` replays too).
//!
//! Owns: the pool's delta mode (the named record [`DELTA_MODE_KEY`], mirrored in
//! `Pool::deltas_on` for the write path), the sketch index in the state (built from nothing after an open),
//! finding a write's deltas, and reading a delta's bases. Invariants: a base is never a
//! delta (depth 1: only records that are not deltas enter the sketch index, and a candidate
//! is checked under the lock); a delta is kept only if it saves 1/8 of the block stored
//! alone; a delta names its bases by chunk id, each resolved (it may have become a forward)
//! when read.

use crate::error::{Error, Result};
use crate::format::reduction::{self, DeltaPayload};
use crate::format::*;
use condense_meta::delta_search;
pub(crate) use condense_meta::delta_search::{Delta, Deltas, IN_WRITE};
use condense_meta::sketch_index::{DeltaFigures, SketchIndex, DEFAULT_BUDGET};
use std::collections::{HashMap, HashSet};

use super::read::{adjacent_groups, hint_groups, read_group, Wanted};
use super::{Pool, State};
use crate::stats::PoolStats;

/// The named metadata record that turns delta compression on for a pool's new writes.
pub const DELTA_MODE_KEY: &str = "delta/mode";

impl Pool {
    /// Turn delta compression on for new writes: the root on disk first made one older
    /// builds refuse (the delta section: version 5), then the mode record journaled.
    pub fn enable_deltas(&self) -> Result<()> {
        if self.read_only {
            return Err(Error::ReadOnly);
        }
        self.allow_section(|c| &mut c.deltas)?;
        self.meta_put(DELTA_MODE_KEY, Some(b"zstd"))?;
        self.deltas_on
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// True if the pool stores new chunks as deltas where they save.
    pub fn deltas_enabled(&self) -> bool {
        self.lock_state().md.meta.contains_key(DELTA_MODE_KEY)
    }

    /// The misses of a write in a delta pool, in order: their super-features, candidates
    /// looked up in the sketch index under the lock, then, without it,
    /// [`delta_search::choose`]: each compressed against its candidates
    /// ([`reduction::best_delta`]): the earlier misses of this write stored alone that share
    /// the most super-features with it (up to 2), then the index's; kept if it saves 1/8 of
    /// `alone(i)` (the payload length of block `i` stored alone). `spread`: sketches and
    /// tries on every core (the write is alone in flight), with the same result.
    pub(crate) fn find_deltas(
        &self,
        data: &[u8],
        misses: &[usize],
        alone: &dyn Fn(usize) -> usize,
        spread: bool,
    ) -> Result<Deltas> {
        let bs = self.sb.block_size as usize;
        if misses.is_empty() || !self.deltas_on.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(Deltas::default());
        }
        let keys = delta_search::miss_keys(data, bs, misses, spread);
        let global = self.delta_candidates(misses, &keys);
        let delta = delta_search::choose(
            data,
            bs,
            misses,
            (&keys, &global),
            &mut |ids| {
                let fetched = self.base_blocks(ids).into_iter();
                fetched.filter_map(|(c, b)| Some((c, b.ok()?))).collect()
            },
            alone,
            spread,
        );
        Ok(Deltas { delta, keys })
    }

    /// Stage new chunk `id` (block `fp`) as its delta `d` in the open segment, if its bases
    /// still hold: a block of this write ([`IN_WRITE`]) must have been staged alone (its id in
    /// `plain`; `entries` are the write's ids so far), another base must be a chunk that is
    /// not a delta and can take another reference. Returns the record and the bytes stored;
    /// counts the delta and what it saved against `alone` bytes.
    pub(crate) fn stage_delta(
        &self,
        st: &mut State,
        (id, fp): (u64, &Fingerprint),
        d: &Delta,
        (entries, plain): (&[u64], &HashSet<u64>),
        alone: usize,
    ) -> Result<Option<(JournalRecord, u64)>> {
        let mut bases = Vec::with_capacity(d.bases.len());
        for &b in &d.bases {
            let b = match b & IN_WRITE {
                0 => b,
                _ => match entries.get((b & !IN_WRITE) as usize) {
                    Some(&e) if plain.contains(&e) => e,
                    _ => return Ok(None),
                },
            };
            let md = &mut st.md;
            let holds = plain.contains(&b)
                || matches!(md.chunks.resolve(&mut md.pages, b),
                    Ok(Some((_, e))) if !e.loc.codec.is_delta() && e.refs < crate::metadata::REFS_MAX);
            if !holds {
                return Ok(None);
            }
            bases.push(b);
        }
        let compressed = DeltaPayload::parse(&d.payload, String::new)?.compressed;
        let payload = DeltaPayload {
            bases: bases.clone(),
            compressed,
        }
        .encode();
        let payload = match self.crypto.as_deref() {
            Some(c) => c.sealed(
                crate::crypto::Kind::Chunk,
                &chunk_ctx(fp, ChunkCodec::ZstdDelta),
                &payload,
            )?,
            None => payload,
        };
        let loc = st
            .segments
            .append(&*self.dir, id, fp, ChunkCodec::ZstdDelta, &payload)?;
        if let Some(s) = st.sketch.as_mut() {
            s.deltas += 1;
            s.delta_saved_bytes += alone.saturating_sub(payload.len()) as u64;
        }
        let record = JournalRecord::NewDelta {
            id,
            loc,
            fp: *fp,
            bases,
        };
        Ok(Some((record, payload.len() as u64)))
    }

    /// The candidate bases of each miss with super-features, from the sketch index (made by
    /// the first write), under one short hold: the index only, no chunk looked up (only
    /// chunks that are not deltas enter it; [`Pool::base_blocks`] skips one that went or
    /// became a forward to a delta, and staging checks each base again).
    fn delta_candidates(
        &self,
        misses: &[usize],
        keys: &HashMap<usize, [u64; sketch::FEATURES]>,
    ) -> HashMap<usize, Vec<u64>> {
        let mut st = self.lock_state();
        let index = st
            .sketch
            .get_or_insert_with(|| SketchIndex::new(DEFAULT_BUDGET));
        let found = |i: &usize| Some((*i, index.candidates(keys.get(i)?)));
        misses
            .iter()
            .filter_map(found)
            .filter(|(_, c)| !c.is_empty())
            .collect()
    }

    /// The blocks of chunks `ids` (each resolved if a forward; none may be a delta), by id:
    /// the bases of a read's deltas fetched together. The records are located under one
    /// hold of the state lock; then, as a read's own records, each is taken from memory or
    /// the cache tier or read from its segment (adjacent ones with one call; on a store
    /// whose reads cost requests, every group hinted first, so they are fetched side by
    /// side), checked and decompressed; one read from its segment is offered to the cache
    /// tier, which so keeps bases as hot as the blocks read. Each id's result is its own.
    pub(crate) fn base_blocks(&self, ids: &[u64]) -> HashMap<u64, Result<Vec<u8>>> {
        let mut out: HashMap<u64, Result<Vec<u8>>> = HashMap::new();
        let mut wanted: Vec<(u64, Wanted, Option<Vec<u8>>)> = Vec::new();
        // Each id once, before the lock (a read of 8,192 deltas names up to 16,384 bases).
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        {
            let mut st = self.lock_state();
            let st = &mut *st;
            for &id in &ids {
                let what = || format!("base chunk {id} of a delta");
                let found = st.md.chunks.resolve(&mut st.md.pages, id).and_then(|c| {
                    let (rid, e) =
                        c.ok_or_else(|| Error::corrupt(what(), "the chunk does not exist"))?;
                    if e.loc.codec.is_delta() {
                        return Err(Error::corrupt(what(), "a base is itself a delta"));
                    }
                    let file = st.segments.file(e.loc.segment).ok_or_else(|| {
                        Error::corrupt(what(), format!("segment {} is missing", e.loc.segment))
                    })?;
                    let w = Wanted {
                        index: wanted.len(),
                        id: rid,
                        loc: e.loc,
                        file,
                        fp: e.fp,
                    };
                    Ok((w, st.segments.in_memory(&e.loc)))
                });
                match found {
                    Ok((w, mem)) => wanted.push((id, w, mem)),
                    Err(e) => drop(out.insert(id, Err(e))),
                }
            }
        }
        wanted.sort_by_key(|(_, w, _)| (w.loc.segment, w.loc.offset));
        let tier = self.tier();
        let (mut asked, mut ws, mut records) = (Vec::new(), Vec::new(), Vec::new());
        let mut hits = 0;
        for (id, w, mem) in wanted {
            let cached = || tier.as_ref()?.lookup(w.id, &w.fp, &w.loc);
            let record = mem.or_else(|| cached().inspect(|_| hits += 1));
            records.push(record);
            asked.push(id);
            ws.push(w);
        }
        let missed: Vec<usize> = (0..ws.len()).filter(|&k| records[k].is_none()).collect();
        let bs = self.sb.block_size as usize;
        if let Some(c) = &tier {
            c.count(hits, missed.len() as u64, bs as u64);
        }
        let groups = adjacent_groups(&ws, &missed);
        if self.dir.reads_cost_requests() {
            hint_groups(&ws, &missed, &groups);
        }
        for &(s, e) in &groups {
            match read_group(&ws, &missed, (s, e), "a delta's bases", &self.read_buffers) {
                Ok((start, buf)) => {
                    for &k in &missed[s..e] {
                        let at = (u64::from(ws[k].loc.offset) - start) as usize;
                        let record = buf[at..at + ws[k].loc.record_bytes() as usize].to_vec();
                        if let Some(c) = &tier {
                            self.offer_to_cache(c, &ws[k], &record);
                        }
                        records[k] = Some(record);
                    }
                    self.read_buffers.give_back(std::iter::once(buf));
                }
                Err(err) => {
                    for &k in &missed[s..e] {
                        let what = format!("base chunk {} of a delta", asked[k]);
                        let err = std::io::Error::other(err.to_string());
                        out.insert(asked[k], Err(Error::io(what, err)));
                    }
                }
            }
        }
        for ((w, id), record) in ws.iter().zip(asked).zip(records) {
            let Some(record) = record else { continue };
            let what = || format!("base chunk {id} of a delta");
            let rid = record_id(w.id, &w.loc, self.slot);
            let block = open_record(
                &record,
                rid,
                &w.loc,
                self.crypto.as_deref(),
                Some(&w.fp),
                what,
            )
            .and_then(|payload| {
                let mut block = vec![0u8; bs];
                reduction::decompress(w.loc.codec, &payload, &mut block, what)?;
                Ok(block)
            });
            out.insert(id, block);
        }
        out
    }

    /// Decode a delta record's (opened) payload into `dst` with its bases' blocks, from
    /// `fetched` (a read's bases, fetched together) or else fetched here.
    pub(crate) fn decode_delta(
        &self,
        payload: &[u8],
        dst: &mut [u8],
        fetched: Option<&HashMap<u64, Result<Vec<u8>>>>,
        what: impl Fn() -> String,
    ) -> Result<()> {
        let p = DeltaPayload::parse(payload, &what)?;
        let own;
        let fetched = match fetched {
            Some(f) if p.bases.iter().all(|b| f.contains_key(b)) => f,
            _ => {
                own = self.base_blocks(&p.bases);
                &own
            }
        };
        let mut dict = Vec::with_capacity(p.bases.len() * dst.len());
        for b in &p.bases {
            match fetched.get(b) {
                Some(Ok(block)) => dict.extend_from_slice(block),
                Some(Err(e)) => {
                    return Err(Error::corrupt(
                        what(),
                        format!("reading its base chunk {b}: {e}"),
                    ))
                }
                None => return Err(Error::corrupt(what(), format!("base chunk {b} not read"))),
            }
        }
        reduction::decompress_delta(p.compressed, &dict, dst, what)
    }

    /// The bases a delta's record (whole, as read from its segment) names.
    pub(crate) fn delta_bases_of(
        &self,
        id: u64,
        (loc, fp): (&Location, &Fingerprint),
        record: &[u8],
    ) -> Result<Vec<u64>> {
        let what = || format!("delta chunk {id} in segment {}", loc.segment);
        let rid = record_id(id, loc, self.slot);
        let payload = open_record(record, rid, loc, self.crypto.as_deref(), Some(fp), what)?;
        Ok(DeltaPayload::parse(&payload, what)?.bases)
    }
}

impl Pool {
    /// The delta figures of `stats` (docs/STATS.md): the sketch index's RAM counts in
    /// `index_ram_bytes`.
    pub(crate) fn add_delta_figures(st: &State, s: &mut PoolStats) {
        let (mode, written) = (
            st.md.meta.contains_key(DELTA_MODE_KEY),
            st.md.chunks.deltas.unwrap_or(0),
        );
        s.delta = DeltaFigures::of(st.sketch.as_ref(), mode, written, s.unique_chunks);
        s.index_ram_bytes += s.delta.sketch_index_bytes;
        if s.unique_chunks > 0 {
            s.ram_bytes_per_unique_chunk = s.index_ram_bytes as f64 / s.unique_chunks as f64;
        }
    }
}
