//! Delta compression (issue 44; docs/FORMAT.md "Delta records"): the engine's glue between
//! the write and read paths and the pure parts (`format::sketch`, `reduction::DeltaPayload`,
//! `meta::sketch_index`).
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
use condense_meta::sketch_index::{DeltaFigures, SketchIndex, DEFAULT_BUDGET};
use std::collections::HashMap;

use super::{Pool, State};
use crate::stats::PoolStats;

/// The named metadata record that turns delta compression on for a pool's new writes.
pub const DELTA_MODE_KEY: &str = "delta/mode";

/// zstd level of delta records.
const LEVEL: i32 = 3;

/// A new chunk found to be a delta: its bases and its payload as stored (sealed in an
/// encrypted pool).
pub(crate) struct Delta {
    pub bases: Vec<u64>,
    pub payload: Vec<u8>,
}

/// What [`Pool::find_deltas`] found for a write, by block index: deltas, and the
/// super-features of the other new chunks (indexed once they have an id).
#[derive(Default)]
pub(crate) struct Deltas {
    pub delta: HashMap<usize, Delta>,
    pub keys: HashMap<usize, [u64; sketch::FEATURES]>,
}

impl Pool {
    /// Turn delta compression on for new writes: the root on disk first made one older
    /// builds refuse ([`Pool::allow_deltas`]), then the mode record journaled.
    pub fn enable_deltas(&self) -> Result<()> {
        if self.read_only {
            return Err(Error::ReadOnly);
        }
        self.allow_deltas()?;
        self.meta_put(DELTA_MODE_KEY, Some(b"zstd"))?;
        self.deltas_on
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Make sure the root on disk allows deltas before the first is journaled: a checkpoint
    /// whose root has the delta section (version 5, docs/FORMAT.md "Delta records"), once in
    /// the pool's life, so builds that do not know deltas refuse the pool.
    fn allow_deltas(&self) -> Result<()> {
        if self.lock_state().md.chunks.deltas.is_some() {
            return Ok(());
        }
        let sync = crate::locks::lock(&self.sync_lock);
        let mut allow = |md: &mut crate::metadata::Metadata| {
            md.chunks.deltas.get_or_insert(0);
            Ok(())
        };
        self.checkpoint_with(&sync, &|_| Ok(()), Some(&mut allow))
    }

    /// True if the pool stores new chunks as deltas where they save.
    pub fn deltas_enabled(&self) -> bool {
        self.lock_state().md.meta.contains_key(DELTA_MODE_KEY)
    }

    /// The misses of a write in a delta pool: their super-features, candidates looked up in
    /// the sketch index under the lock, then, without it, each compressed against its
    /// candidates ([`reduction::best_delta`]); kept if it saves 1/8 of `alone(i)` (the
    /// payload length of block `i` as step 3 stored it).
    pub(crate) fn find_deltas(
        &self,
        data: &[u8],
        fps: &[Option<Fingerprint>],
        misses: &[usize],
        alone: &dyn Fn(usize) -> usize,
    ) -> Result<Deltas> {
        let bs = self.sb.block_size as usize;
        let mut found = Deltas::default();
        if misses.is_empty() || !self.deltas_on.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(found);
        }
        for &i in misses {
            if let Some(k) = sketch::super_features(&data[i * bs..(i + 1) * bs]) {
                found.keys.insert(i, k);
            }
        }
        let mut blocks: HashMap<u64, Option<Vec<u8>>> = HashMap::new();
        for (i, cands) in self.delta_candidates(misses, &found.keys) {
            let Some(fp) = fps[i] else { continue };
            for &c in &cands {
                blocks.entry(c).or_insert_with(|| self.base_block(c).ok());
            }
            let bases: Vec<(u64, &[u8])> = cands
                .iter()
                .filter_map(|c| Some((*c, blocks.get(c)?.as_deref()?)))
                .collect();
            let block = &data[i * bs..(i + 1) * bs];
            let limit = alone(i) - alone(i) / 8;
            let Some((bases, payload)) = reduction::best_delta(block, &bases, LEVEL, limit) else {
                continue;
            };
            let payload = match self.crypto.as_deref() {
                Some(c) => c.sealed(
                    crate::crypto::Kind::Chunk,
                    &chunk_ctx(&fp, ChunkCodec::ZstdDelta),
                    &payload,
                )?,
                None => payload,
            };
            found.delta.insert(i, Delta { bases, payload });
        }
        Ok(found)
    }

    /// The candidate bases of each miss with super-features, from the sketch index (made by
    /// the first write), each a chunk with a record that is not a delta; under one hold.
    fn delta_candidates(
        &self,
        misses: &[usize],
        keys: &HashMap<usize, [u64; sketch::FEATURES]>,
    ) -> Vec<(usize, Vec<u64>)> {
        let mut st = self.lock_state();
        let st = &mut *st;
        let index = st
            .sketch
            .get_or_insert_with(|| SketchIndex::new(DEFAULT_BUDGET));
        let mut out = Vec::new();
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
                out.push((*i, ok));
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
