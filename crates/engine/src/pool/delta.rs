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

use crate::chunk_table::ChunkEntry;
use crate::error::{Error, Result};
use crate::format::reduction::{self, DeltaPayload};
use crate::format::*;
use condense_meta::delta_search;
pub(crate) use condense_meta::delta_search::{Delta, Deltas, IN_WRITE};
use condense_meta::sketch_index::{DeltaFigures, SketchIndex, DEFAULT_BUDGET};
use std::collections::{HashMap, HashSet};

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
    /// `alone(i)` (the payload length of block `i` stored alone).
    pub(crate) fn find_deltas(
        &self,
        data: &[u8],
        misses: &[usize],
        alone: &dyn Fn(usize) -> usize,
    ) -> Result<Deltas> {
        let bs = self.sb.block_size as usize;
        if misses.is_empty() || !self.deltas_on.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(Deltas::default());
        }
        let keys = delta_search::miss_keys(data, bs, misses);
        let global = self.delta_candidates(misses, &keys);
        let delta = delta_search::choose(
            data,
            bs,
            misses,
            (&keys, &global),
            &mut |c| self.base_block(c).ok(),
            alone,
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
    /// the first write), each a chunk with a record that is not a delta; under one hold.
    fn delta_candidates(
        &self,
        misses: &[usize],
        keys: &HashMap<usize, [u64; sketch::FEATURES]>,
    ) -> HashMap<usize, Vec<u64>> {
        let mut st = self.lock_state();
        let st = &mut *st;
        let index = st
            .sketch
            .get_or_insert_with(|| SketchIndex::new(DEFAULT_BUDGET));
        let mut out = HashMap::new();
        for i in misses {
            let Some(k) = keys.get(i) else { continue };
            let ok: Vec<u64> = index
                .candidates(k)
                .into_iter()
                .filter(|&c| {
                    matches!(st.md.chunks.resolve(&mut st.md.pages, c),
                        Ok(Some((_, e))) if !e.loc.codec.is_delta())
                })
                .collect();
            if !ok.is_empty() {
                out.insert(*i, ok);
            }
        }
        out
    }

    /// The block of chunk `id` (resolved if a forward), which must not be a delta: from
    /// memory, the cache tier or its segment, checked and decompressed. Takes the state lock.
    pub(crate) fn base_block(&self, id: u64) -> Result<Vec<u8>> {
        let what = || format!("base chunk {id} of a delta");
        let (rid, e, file, in_memory) = {
            let mut st = self.lock_state();
            let md = &mut st.md;
            let (rid, e) = md
                .chunks
                .resolve(&mut md.pages, id)?
                .ok_or_else(|| Error::corrupt(what(), "the chunk does not exist"))?;
            let file = st.segments.file(e.loc.segment);
            (rid, e, file, st.segments.in_memory(&e.loc))
        };
        if e.loc.codec.is_delta() {
            return Err(Error::corrupt(what(), "a base is itself a delta"));
        }
        let record = match (in_memory, self.tier()) {
            (Some(m), _) => m,
            (None, tier) => match tier.and_then(|c| c.lookup(rid, &e.fp, &e.loc)) {
                Some(r) => r,
                None => {
                    let file = file.ok_or_else(|| {
                        Error::corrupt(what(), format!("segment {} is missing", e.loc.segment))
                    })?;
                    let mut buf = vec![0u8; e.loc.record_bytes() as usize];
                    file.read_at(&mut buf, u64::from(e.loc.offset))
                        .map_err(|err| Error::io(what(), err))?;
                    buf
                }
            },
        };
        let payload = open_record(
            &record,
            record_id(rid, &e.loc, self.slot),
            &e.loc,
            self.crypto.as_deref(),
            Some(&e.fp),
            what,
        )?;
        let mut out = vec![0u8; self.sb.block_size as usize];
        reduction::decompress(e.loc.codec, &payload, &mut out, what)?;
        Ok(out)
    }

    /// Decode a delta record's (opened) payload into `dst`, reading its bases.
    pub(crate) fn decode_delta(
        &self,
        payload: &[u8],
        dst: &mut [u8],
        what: impl Fn() -> String,
    ) -> Result<()> {
        let p = DeltaPayload::parse(payload, &what)?;
        let mut dict = Vec::with_capacity(p.bases.len() * dst.len());
        for &b in &p.bases {
            dict.extend_from_slice(
                &self.base_block(b).map_err(|e| {
                    Error::corrupt(what(), format!("reading its base chunk {b}: {e}"))
                })?,
            );
        }
        reduction::decompress_delta(p.compressed, &dict, dst, what)
    }

    /// The bases a delta's record (whole, as read from its segment) names.
    pub(crate) fn delta_bases_of(
        &self,
        id: u64,
        e: &ChunkEntry,
        record: &[u8],
    ) -> Result<Vec<u64>> {
        let what = || format!("delta chunk {id} in segment {}", e.loc.segment);
        let payload = open_record(
            record,
            record_id(id, &e.loc, self.slot),
            &e.loc,
            self.crypto.as_deref(),
            Some(&e.fp),
            what,
        )?;
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
